"""Cost model, simulator and ``rollplex simulate``: facts the model must reproduce, invariants of
its outputs (breakdowns that sum to the makespan, traces in the runtime's format), calibration from
a trace, and the command's files and errors. CPU only, small workloads."""
from __future__ import annotations

import json
import math

from dataclasses import replace
from pathlib import Path

import pytest

from rollplex.cli import main
from rollplex.errors import ConfigError
from rollplex.pipeline.plan import simulator as S
from rollplex.pipeline.plan.costs import MEASURED_H200, Calibration, CostModel, Workload, measured_efficiency, parse_lengths
from rollplex.pipeline.plan.hardware import Layout, hardware
from rollplex.engines.modelspec import PRESETS, from_config, load_model
from rollplex.dags.grpo import grpo
from rollplex.pipeline.plan.trace import chrome_trace

SMALL = Workload(prompts=4, samples=2, max_new_tokens=64, chunk_tokens=16, vision_tokens=256,
                 response="lognormal:24:0.6")


@pytest.fixture(scope="module")
def small_results():
    scn = S.Scenario(PRESETS["qwen2.5-vl-3b"], hardware("h200", 2), SMALL, grpo)
    return scn, S.run(scn)


# -- model shapes and the measured facts --------------------------------------------------------------
@pytest.mark.parametrize("name, billions", [("qwen2.5-vl-3b", 3.75), ("qwen2.5-vl-7b", 8.29),
                                            ("qwen2.5-vl-32b", 33.45)])
def test_presets_have_the_published_parameter_counts(name, billions):
    assert PRESETS[name].params / 1e9 == pytest.approx(billions, rel=0.01)


def test_a_config_json_reads_like_its_preset(tmp_path):
    m = PRESETS["qwen2.5-vl-7b"]
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "intermediate_size": m.intermediate, "vocab_size": m.vocab,
        "tie_word_embeddings": False, "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                                                        "num_heads": 16, "out_hidden_size": m.hidden,
                                                        "fullatt_block_indexes": [7, 15, 23, 31]}}))
    spec = from_config(tmp_path)
    assert (spec.params, spec.kv_bytes_per_token()) == (m.params, m.kv_bytes_per_token())
    with pytest.raises(ConfigError, match="not a preset .* and no such file"):
        load_model(str(tmp_path / "missing.json"))


def test_efficiencies_reproduce_the_measured_iteration_and_predict_what_they_were_not_fitted_to():
    eff = measured_efficiency()
    assert 0 < eff.vit < eff.forward < 1 and 0 < eff.train < 1 and 0 < eff.decode_bw <= 1
    m, c = PRESETS["qwen2.5-vl-3b"], hardware("h200", 1)
    w = Workload(prompts=8, samples=8, text_tokens=64, vision_tokens=1024, max_new_tokens=256, response="fixed:256")
    cm = CostModel(m, c, w, Layout.colocate(c), efficiency=eff)
    full = sum(cm.suffix_flops(p, True) for p in range(8)) / (c.peak_flops * eff.forward)
    assert full == pytest.approx(MEASURED_H200["ref_full_seconds"], rel=1e-3)  # fitted
    shared = sum(cm.suffix_flops(p, False) + m.prefill_flops(1088) for p in range(8)) / (c.peak_flops * eff.forward)
    assert shared == pytest.approx(MEASURED_H200["ref_shared_seconds"], rel=0.25)  # not fitted: -17%
    for batch, seconds in MEASURED_H200["decode_steps"]:
        assert cm.decode_step(batch, 1344) == pytest.approx(seconds, rel=0.1)


def test_decode_steps_grow_with_batch_and_context_and_the_long_tail_is_light():
    c = hardware("h200", 8)
    cm = CostModel(PRESETS["qwen2.5-vl-7b"], c, Workload(prompts=64), Layout.colocate(c))
    assert cm.decode_step(8, 1000) < cm.decode_step(64, 1000) < cm.decode_step(64, 2000)
    prof = cm.profile
    assert prof.chunk_batch[0] >= prof.chunk_batch[-1] and min(prof.chunk_batch) < 8  # sequences finish
    assert len(prof.chunk_seconds) == math.ceil(1024 / 32) and all(s > 0 for s in prof.chunk_seconds)


def test_each_sample_finishes_in_a_chunk_no_later_than_its_group_and_scoring_splits_additively():
    """The profile's per-sample finish chunks end with the group's (the group waits for its last
    sample), and scoring a group's samples in parts costs what scoring it whole does."""
    c = hardware("h200", 8)
    cm = CostModel(PRESETS["qwen2.5-vl-7b"], c, Workload(prompts=16), Layout.colocate(c))
    prof = cm.profile
    assert set(prof.sample_chunks) == set(prof.finish_chunk)
    for p, chunks in prof.sample_chunks.items():
        assert len(chunks) == cm.w.samples and max(chunks) == prof.finish_chunk[p]
    assert any(len(set(chunks)) > 1 for chunks in prof.sample_chunks.values())  # a real spread
    half = cm.w.samples // 2
    whole = cm.suffix_flops(3, False)
    assert cm.suffix_flops(3, False, list(range(half))) + cm.suffix_flops(3, False, list(range(half, cm.w.samples))) \
        == pytest.approx(whole)
    assert cm.tokens(3, True, [0]) == cm.profile.lengths[3][0] + cm.w.prefix_tokens


def test_interference_reproduces_the_measured_hidden_fractions():
    inter = hardware("h200", 1, partitioned=True).interference
    for batch, hidden in inter.hidden_table:
        r = inter.compute_rate(batch)
        assert 1 - (1 - 1 / inter.slowdown) / r == pytest.approx(hidden)
    assert inter.hidden(8) > inter.hidden(32) > inter.hidden(64) > inter.hidden(128) == 0
    plain = hardware("h200", 1).interference  # the runtime's default, plain streams (cluster.sm_partitions)
    assert not plain.partitioned and plain.slowdown == plain.plain_decode_slowdown
    assert 1 - (1 - 1 / plain.slowdown) / plain.compute_rate(8) == pytest.approx(plain.plain_hidden)


def test_workload_errors_name_the_field():
    with pytest.raises(ConfigError, match="workload: samples must be ≥ 1"):
        Workload(samples=0)
    with pytest.raises(ConfigError, match="--response-len 'gauss:3'"):
        parse_lengths("gauss:3", 10)
    with pytest.raises(ConfigError, match="layout: train TP 3 does not divide its 8 GPUs"):
        Layout.colocate(hardware("h200", 8), 1, 3)


# -- scenario results ---------------------------------------------------------------------------------
def test_every_variant_fits_and_its_breakdown_sums_to_the_makespan(small_results):
    _, results = small_results
    assert set(results) == set(S.VARIANTS)
    for name, r in results.items():
        assert r.fits, (name, r.error)
        assert sum(r.phases().values()) == pytest.approx(r.makespan, rel=1e-9), name
        assert r.naive_terms and r.naive_peak > 0
    assert results["rollplex"].makespan < results["serial"].makespan


def test_the_simulated_trace_has_the_runtime_format(small_results):
    _, results = small_results
    r = results["rollplex"]
    trace = S.chrome_trace_of(r.plan, r.memory)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(s.gpus) for s in r.plan.slots.values())
    assert {e["cat"] for e in events} == {s.kind for s in r.plan.slots.values()}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {f"gpu{g}" for g in range(2)}
    assert set(trace["otherData"]["streams"]) <= {"decode", "compute", "host", "copy"}
    assert max(e["ts"] + e["dur"] for e in events) / 1e6 == pytest.approx(r.makespan, rel=1e-6)
    assert any(e["ph"] == "C" for e in trace["traceEvents"])  # the HBM counter
    # The same events through the runtime's own formatter give the same layout.
    same = chrome_trace([dict(e, pid=trace["otherData"]["workers"][e["pid"]],
                              tid=trace["otherData"]["streams"][e["tid"]], ts=e["ts"] + 5.0) for e in events],
                        0, "rollplex")
    assert [e["pid"] for e in same["traceEvents"] if e["ph"] == "X"] == [e["pid"] for e in events]


def test_calibrating_from_a_trace_recovers_per_kind_factors():
    """A serial plan's trace (no interference) calibrates to 1; with every loss 2× slower, the loss
    factor is 2 and a replay with it is slower by exactly the loss time."""
    scn = S.Scenario(PRESETS["qwen2.5-vl-3b"], hardware("h200", 2), SMALL, grpo, memory=False)
    r = S.run_variant(scn, "serial")
    predicted = {n: r.costs(r.plan.graph.nodes[n], len(s.gpus)).seconds for n, s in r.plan.slots.items()}
    trace = S.chrome_trace_of(r.plan)
    # (trace times are rounded to 0.1 µs)
    assert all(f == pytest.approx(1.0, rel=1e-4) for f in Calibration.from_trace(trace, predicted).factors.values())
    for e in trace["traceEvents"]:
        if e.get("cat") == "loss":
            e["dur"] *= 2
    cal = Calibration.from_trace(trace, predicted)
    assert cal.factors["loss"] == pytest.approx(2.0, rel=1e-4)
    slower = S.simulate(r.plan, CostModel(r.costs.m, r.costs.c, r.costs.w, r.costs.layout, calibration=cal,
                                          prefix_sharing=False, recompute_prefix=True))
    loss = sum(s.finish - s.start for s in r.plan.slots.values() if s.kind == "loss")
    assert slower.makespan == pytest.approx(r.makespan + loss * (cal.factors["loss"] - 1), rel=1e-4)
    with pytest.raises(ConfigError, match="has no events for the graph's nodes"):
        Calibration.from_trace({"traceEvents": []}, predicted)


def test_calibration_fit_separates_per_node_overhead_from_the_roofline_factor():
    """Two runs of a kind at different sizes pin both terms; one size, or a fit that would need a
    negative overhead, falls back to the ratio; nothing usable is an error that says so."""
    truth = lambda nodes, predicted: nodes * 0.05 + 2.5 * predicted  # noqa: E731
    samples = [("suffix_score", 8, 0.2, truth(8, 0.2)), ("suffix_score", 8, 1.7, truth(8, 1.7)),
               ("prefix", 8, 0.3, 1.2)]
    cal = Calibration.fit(samples)
    assert cal.overheads["suffix_score"] == pytest.approx(0.05) and cal.factors["suffix_score"] == pytest.approx(2.5)
    assert "prefix" not in cal.overheads and cal.factors["prefix"] == pytest.approx(4.0)
    assert cal.apply("suffix_score", 0.1) == pytest.approx(0.05 + 0.25) and cal.apply("loss", 0.3) == 0.3
    superlinear = Calibration.fit([("loss", 4, 1.0, 1.0), ("loss", 4, 2.0, 3.0)])  # would need overhead < 0
    assert superlinear.factors["loss"] == pytest.approx(4.0 / 3.0) and not superlinear.overheads
    with pytest.raises(ConfigError, match="no node kinds"):
        Calibration.fit([("loss", 0, 1.0, 1.0)])


def test_predicting_the_recorded_gpu_bench_runs(tmp_path):
    """benchmarks/predict_bench.py on the recorded H200 run: every policy gets a finite prediction
    from the roofline, the two-size calibration and the measured contention."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "pred.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks/predict_bench.py"),
                           str(root / "benchmarks/results/2026-11-29-h200-bench-3b.json"), "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["policy"], r["prediction"]) for r in rows} == {
        (p, k) for p in ("serial-noshare", "serial", "rollplex") for k in ("roofline", "kinds", "+contention")}
    assert "worst |error|" in proc.stdout


def test_predicting_a_bench_run_with_batching_options(tmp_path):
    """Run 8 has serial at two batchings (one prompt per node; 8 per node and 2 per micro-batch):
    each policy's options reach the simulated workload, so the fit on both predicts both (if the
    options were dropped, both would get one prediction and one would miss by 25%)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "pred.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks/predict_bench.py"),
                           str(root / "benchmarks/results/2026-11-30-h200-bench-3b-run8.json"), "--json", str(out),
                           "--contention-from", "rollplex:ppn=8:mb=2:tf=0", "serial:ppn=8:mb=2",
                           "--also", "rollplex:ppn=8:mb=2:tf=0:wc=4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {(r["policy"], r["prediction"]): r for r in json.loads(out.read_text())["rows"]}
    assert abs(rows["serial", "kinds"]["error"]) < 0.05 and abs(rows["serial:ppn=8:mb=2", "kinds"]["error"]) < 0.05
    assert rows["serial:ppn=8:mb=2", "kinds"]["predicted_s"] < 0.85 * rows["serial", "kinds"]["predicted_s"]
    assert ("rollplex:ppn=8:mb=2:tf=0", "+contention") in rows
    what_if = rows["rollplex:ppn=8:mb=2:tf=0:wc=4", "kinds"]  # not measured: a prediction without an error
    assert what_if["measured_s"] is None and what_if["error"] is None and what_if["predicted_s"] > 0


# -- the command ---------------------------------------------------------------------------------------
ARGS = ["simulate", "--model", "qwen2.5-vl-3b", "--gpus", "2", "--prompts", "4", "-G", "2", "--max-new-tokens", "64",
        "--chunk-tokens", "16", "--vision-tokens", "256", "--response-len", "lognormal:24:0.6"]


def test_simulate_prints_the_table_and_writes_json_png_and_traces(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(ARGS + ["--json", str(out), "--png", str(tmp_path / "sim.png"), "--trace", str(tmp_path / "tr")]) == 0
    text = capsys.readouterr().out
    for needle in ("makespan", "rollplex vs serial:", "naive colocation", "assumptions", "decode step"):
        assert needle in text, needle
    data = json.loads(out.read_text())
    assert set(data["results"]) == set(S.VARIANTS)
    assert data["results"]["rollplex"]["makespan_s"] > 0 and data["scenario"]["gpus"] == 2
    assert (tmp_path / "sim.png").stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "tr").iterdir()) == sorted(f"{n}.json" for n in S.VARIANTS)


def test_simulate_models_plain_streams_as_a_run_does_and_partitions_on_request(capsys):
    """A run's window shares the GPU on plain streams unless cluster.sm_partitions is set; the simulator
    assumes the same, and --sm-partitions models the partitions (their measured hidden fractions)."""
    def predicted(*extra):
        assert main(ARGS + ["--schedule", "rollplex", *extra]) == 0
        text = capsys.readouterr().out
        return text, next(line for line in text.splitlines() if line.startswith("rollplex "))

    plain, plain_row = predicted()
    parted, parted_row = predicted("--sm-partitions")
    assert "decode on plain streams" in plain and "decode on SM partitions" in parted
    assert plain_row != parted_row  # 5% hidden at any batch against the partitions' table


@pytest.mark.parametrize("extra, message", [
    (["--model", "llama-9000"], "--model 'llama-9000': not a preset"),
    (["--response-len", "normal:3"], "--response-len 'normal:3'"),
    (["--schedule", "serial,fast"], "--schedule 'serial,fast': unknown \\['fast'\\]"),
    (["--gpus", "12"], "--gpus 12: a h200 node has 8 GPUs"),
    (["--tp-train", "3"], "layout: train TP 3 does not divide its 2 GPUs"),
])
def test_simulate_errors_are_one_line_naming_the_flag(extra, message, capsys):
    assert main(ARGS + extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert __import__("re").search(message, err), err


def test_the_scenarios_grad_prefix_lookahead_orders_the_policys_prefixes_after_earlier_losses():
    w = Workload(prompts=4, samples=2, vision_tokens=16, text_tokens=8, max_new_tokens=8, chunk_tokens=4,
                 micro_batch_groups=1)
    for lookahead in (0, 1):
        scn = S.Scenario(load_model("qwen2.5-vl-3b"), hardware("h200", 1), w, grpo, grad_prefix_lookahead=lookahead)
        g = S.compile_for(scn, S.layout_for(scn, "rollplex"), True)
        ordered = [(u, v) for u, v in g.g.edges if g.nodes[u].kind == "loss" and g.nodes[v].kind == "prefix"]
        assert len(ordered) == (3 if lookahead else 0)  # micro-batches 1–3 each wait for the previous loss


def test_a_train_fusion_scenario_costs_each_group_in_the_chunk_that_finished_it_as_serial_does():
    """Under train fusion the simulated graph is the runtime's: ``train_c{c}`` runs the policy prefix,
    suffix with grad, loss and backward of the groups chunk c finished, and the reference scores those
    groups. Every response ends in chunk 1 here, so chunk 0's nodes cost nothing and chunk 1's cost
    what the unfused graph's nodes for the same groups cost, calibration overheads included."""
    w = Workload(prompts=4, samples=2, vision_tokens=16, text_tokens=8, max_new_tokens=8, chunk_tokens=4,
                 response="fixed:6", micro_batch_groups=4, prompts_per_node=4, checkpointing=False,
                 actor_forward="keep")
    cal = Calibration(factors={"prefix": 1.5, "suffix_score": 2.0, "loss": 0.7},
                      overheads={"prefix": 0.01, "suffix_score": 0.02, "loss": 0.1})
    graphs, costs = {}, None
    for fused in (False, True):
        scn = S.Scenario(load_model("qwen2.5-vl-3b"), hardware("h200", 1), w, grpo, stage_fusion=fused,
                         train_fusion=fused)
        layout = S.layout_for(scn, "rollplex")
        graphs[fused] = S.compile_for(scn, layout, True, rollplex=True)
        costs = CostModel(scn.model, scn.cluster, w, layout, calibration=cal)
    assert set(costs.profile.finish_chunk.values()) == {1}
    fused, unfused = graphs[True], graphs[False]
    assert not [n for n in fused.of_kind("prefix") if n.model == "actor"]  # the training nodes run them
    assert [n.name for n in fused.of_kind("loss")] == ["train_c0", "train_c1"]
    seconds = lambda g, name: costs(g.nodes[name], 1).seconds  # noqa: E731
    assert seconds(fused, "train_c0") == 0.0 and seconds(fused, "suffix_ref_logprobs_c0") == 0.0
    trained = sum(seconds(unfused, n.name) for n in unfused
                  if n.model == "actor" and n.kind in ("prefix", "suffix_score", "loss"))
    assert seconds(fused, "train_c1") == pytest.approx(trained)
    (ref,) = [n for n in unfused.of_kind("suffix_score") if n.model == "ref"]
    assert seconds(fused, "suffix_ref_logprobs_c1") == pytest.approx(seconds(unfused, ref.name))
    # Micro-batches of one group: one overhead per group and kind, as serial's nodes of one group pay.
    one = CostModel(scn.model, scn.cluster, replace(w, micro_batch_groups=1), layout, calibration=cal)
    node = fused.nodes["train_c1"]
    split = replace(node, args={**node.args, "micro_batch_groups": 1})
    assert one(split, 1).seconds - costs(node, 1).seconds == pytest.approx(3 * (0.01 + 0.02 + 0.1))