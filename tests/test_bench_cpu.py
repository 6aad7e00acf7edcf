"""``rollplex bench`` on the CPU with the tiny model: every policy runs full iterations side by side,
and on one recorded rollout (the replay engine) every policy computes serial's update."""
from __future__ import annotations

import json
import re

import pytest

from rollplex.config import load_config
from rollplex.engines.base import DecodeRequest, FinishedSequence
from rollplex.engines.replay_decode import ReplayDecodeEngine
from rollplex.errors import EngineError, RollplexError
from rollplex.pipeline.bench.bench import BenchConfig, run
from rollplex.pipeline.bench.results import parse_policy
from rollplex.pipeline.run.session import resolve_model_path


@pytest.mark.slow
def test_bench_runs_every_policy_and_replayed_updates_agree(tmp_path):
    config = resolve_model_path(load_config(None, [])) + "/config.json"
    out = run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=2, samples=2, vision_tokens=16,
                          text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=4, iterations=2,
                          profile=("rollplex",), out=str(tmp_path)), log=lambda *a: None)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [r["policy"] for r in saved["results"]] == ["plain", "serial-noshare", "serial", "rollplex", "serial#aa"]
    assert all(r["median_s"] > 0 and r["seconds_by_kind"]["decode_chunk"] > 0 for r in saved["results"])
    rates = saved["bound_rates"]  # measured here, so ÷bound is against this device, not an H200
    assert 1e8 < rates["copy_bytes_per_s"] < 1e13 and 1e8 < rates["matmul_flops_per_s"] < 1e15
    assert all(r["ratio_to_bound"] > 0 for r in saved["results"])
    updates = {u["policy"]: u for u in out["updates"]}
    assert updates["serial"]["replayed"] == 0.0  # replaying serial's rollout reproduces its update exactly
    # Same rollout, other schedule. Stage fusion scores the reference per finished sample, so its
    # batches differ from serial's and fp32 rounds differently; Adam's first step (lr·g/(|g|+ε))
    # turns that into ~1e-3 on near-zero gradients. A real fault is O(1): scoring the samples in
    # reverse order gives 1.1 on this workload.
    assert updates["rollplex"]["replayed"] <= 1e-2
    assert updates["serial-noshare"]["replayed"] <= 1e-3  # full-sequence scoring: fp32 rounding only
    # plain transformers/torch, full sequences in one padded batch per group: the same update
    assert updates["plain"]["replayed"] <= 1e-3 and updates["serial#aa"]["replayed"] == 0.0
    assert (tmp_path / "bench.png").exists() and not list(tmp_path.glob("trace_*"))
    trace = json.loads((tmp_path / "trace.json").read_text())  # every policy in one Perfetto trace
    names = {e["args"]["name"].split(":")[0] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"plain", "serial-noshare", "serial", "rollplex", "serial#aa"}
    assert {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"} >= {"decode_chunk", "prefix", "loss"}
    profiled = (tmp_path / "profile_rollplex.txt").read_text()  # operators of the stream threads, per kind
    assert "node:suffix_score" in profiled and "node:loss" in profiled


def test_scoring_the_late_chunks_in_one_node_keeps_serials_update(tmp_path):
    """``wc=1``: chunk 0's finished samples are scored in the window, chunks 1-3's by one node after
    decode; on serial's replayed rollout the update is serial's up to fp32 rounding (see above).
    Serial under options (``ppn=2``) is still the reference the others' updates are compared with."""
    config = resolve_model_path(load_config(None, [])) + "/config.json"
    out = run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=2, samples=2, vision_tokens=16,
                          text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=2, iterations=2,
                          policies=("serial:ppn=2", "rollplex:wc=1:tf=0"), out=str(tmp_path)), log=lambda *a: None)
    updates = {u["policy"]: u for u in out["updates"]}
    assert updates["serial:ppn=2"]["replayed"] == 0.0 and updates["serial:ppn=2#aa"]["replayed"] == 0.0
    # Each iteration was written as it ended (a time limit keeps them): warm-ups marked, the timed ones
    # the seconds bench.json reports.
    noted = [json.loads(line) for line in (tmp_path / "iterations.jsonl").read_text().splitlines()]
    policies = ("serial:ppn=2", "rollplex:wc=1:tf=0", "serial:ppn=2#aa")
    assert sorted((n["policy"], n["iteration"]) for n in noted) == sorted((p, i) for p in policies for i in (0, 1))
    saved = {r["policy"]: r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    for n in noted:
        assert n["warm_up"] == (n["iteration"] == 0) and n["alloc_retries"] == 0
        if not n["warm_up"]:
            assert saved[n["policy"]]["all_s"] == [pytest.approx(n["seconds"], abs=1e-4)]
    assert updates["rollplex:wc=1:tf=0"]["reference"] == "serial:ppn=2"
    assert updates["rollplex:wc=1:tf=0"]["replayed"] <= 1e-2
    trace = json.loads((tmp_path / "trace.json").read_text())
    pid = next(e["pid"] for e in trace["traceEvents"]
               if e.get("name") == "process_name" and e["args"]["name"].startswith("rollplex"))
    scored = {e["name"] for e in trace["traceEvents"]
              if e.get("ph") == "X" and e["pid"] == pid and e["name"].startswith("suffix_ref")}
    assert scored == {"suffix_ref_logprobs_c0", "suffix_ref_logprobs_c1"}


def test_a_policy_that_runs_out_of_memory_is_reported_and_the_rest_still_run(tmp_path, monkeypatch):
    """Run 6 lost every policy after the one that ran out of GPU memory. Now that one is reported as
    not measured, and the next starts clean: its update still matches serial's on the replay."""
    from rollplex.errors import NodeFailure
    from rollplex.pipeline.run import local

    import gc
    import weakref

    import torch

    real, real_collect = local.LocalExecutor.run, gc.collect
    failed_tensors, alive_at_collect = [], []

    def run_or_fail(self, graph, iteration, inputs):
        if any(h.name.endswith("/serial:ppn=2") for h in self.hosts) and iteration == 1:
            activations = torch.ones(1024)  # what the failed iteration held, reachable from its frame
            failed_tensors.append(weakref.ref(activations))
            raise NodeFailure("loss_m0", "loss", "OutOfMemoryError: CUDA out of memory. Tried to allocate 9.9 GiB")
        return real(self, graph, iteration, inputs)

    def collect(*args):
        found = real_collect(*args)
        alive_at_collect.extend(ref() is not None for ref in failed_tensors)
        return found

    monkeypatch.setattr(local.LocalExecutor, "run", run_or_fail)
    monkeypatch.setattr(gc, "collect", collect)
    config = resolve_model_path(load_config(None, [])) + "/config.json"
    out = run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=2, samples=2, vision_tokens=16,
                          text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=4, iterations=2,
                          policies=("serial", "serial:ppn=2", "rollplex"), aa=False, out=str(tmp_path)), log=lambda *a: None)
    saved = json.loads((tmp_path / "bench.json").read_text(),  # strict JSON: no NaN where a baseline is missing
                       parse_constant=lambda name: pytest.fail(f"bench.json holds {name}"))
    assert [r["policy"] for r in saved["results"]] == ["serial", "rollplex"]
    assert [r["speedup_vs_serial_noshare"] for r in saved["results"]] == [None, None]
    assert "out of memory" in saved["failed"]["serial:ppn=2"]
    # The bench frees the failed policy's memory after the traceback that held it is gone.
    assert alive_at_collect and not any(alive_at_collect), alive_at_collect
    monkeypatch.setattr(gc, "collect", real_collect)
    assert {u["policy"]: u for u in out["updates"]}["rollplex"]["replayed"] <= 1e-2
    from rollplex.pipeline.run.recovery import out_of_memory

    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert out_of_memory(NodeFailure("decode_c0", "decode_chunk", f"RuntimeError: {cublas}")) and out_of_memory(cublas)
    assert not out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(NodeFailure, match="ZeroDivisionError"):  # any other failure still stops the bench
        monkeypatch.setattr(local.LocalExecutor, "run", lambda *a: (_ for _ in ()).throw(
            NodeFailure("loss_m0", "loss", "ZeroDivisionError: division by zero")))
        run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=2, samples=2, vision_tokens=16,
                        text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=4, iterations=2,
                        policies=("serial",), out=str(tmp_path / "again")), log=lambda *a: None)


def test_replay_returns_recorded_samples_and_names_a_missing_one():
    seq = FinishedSequence("it0-p0", [5, 6], [-0.1, -0.2], "stop", index=1)
    engine = ReplayDecodeEngine({("it0-p0", 0): FinishedSequence("it0-p0", [7], [-0.3], "stop"), ("it0-p0", 1): seq})
    engine.add_requests([DecodeRequest("it0-p0", [1, 2], None, None, 4, seed=0, n=2)])
    assert [s.token_ids for s in engine.step(1)] == [[7]]  # finishes when it has as many tokens as recorded
    assert engine.has_unfinished() and engine.step(1) == [seq] and not engine.has_unfinished()
    with pytest.raises(EngineError, match="no recorded response for request 'it0-p1' sample 0"):
        engine.add_requests([DecodeRequest("it0-p1", [1], None, None, 4, seed=0)])


DP2 = "rollplex-dp2:ppn=1"  # the default spelled out: rows named with options are reported as plain ones


@pytest.mark.slow
def test_bench_two_gpu_policies_on_cpu_match_serial(tmp_path):
    """disaggregated (rollout on its own copy, weights shipped back) and rollplex-dp2 (two ranks, an
    in-process all-reduce, stage fusion per rank) run on two CPU "devices"; on serial's replayed
    rollout both compute serial's update, and the two ranks end the step with equal weights."""
    config = resolve_model_path(load_config(None, [])) + "/config.json"
    lines: list[str] = []
    out = run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=4, samples=2, vision_tokens=16,
                          text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=4, iterations=2,
                          policies=("serial", "rollplex-nofusion", "disaggregated", "disaggregated-noshare", DP2,
                                    "rollplex-nofusion:gate=4"),
                          out=str(tmp_path)),
              log=lines.append)
    rows = {r["policy"]: r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    assert rows[DP2]["gpus"] == 2 and rows["disaggregated"]["seconds_by_kind"]["weight_sync"] > 0
    assert rows[DP2]["ranks_max_weight_difference"] == 0.0
    updates = {u["policy"]: u for u in out["updates"]}
    assert updates["disaggregated"]["replayed"] <= 1e-6 and updates["rollplex-nofusion"]["replayed"] <= 1e-6
    assert "join" not in rows["rollplex-nofusion"]["seconds_by_kind"]  # no per-chunk scoring to join
    assert updates["disaggregated"]["identical_responses"] == updates["disaggregated"]["responses"]
    # Split roles as today's runtimes run them: full sequences scored on the training GPU. Its graph is
    # serial-noshare's (no prefix node), its update serial's within fp32 rounding of the other sums.
    noshare = rows["disaggregated-noshare"]
    assert noshare["seconds_by_kind"]["weight_sync"] > 0 and "prefix" not in noshare["seconds_by_kind"]
    assert "prefix" in rows["disaggregated"]["seconds_by_kind"]
    assert updates["disaggregated-noshare"]["replayed"] <= 1e-3
    assert f"{DP2} is" in " ".join(out["speedups"]) and any(
        line.startswith(f"{DP2} is") and "x disaggregated-noshare (" in line for line in out["speedups"])
    # Two ranks sum their halves' gradients instead of accumulating all micro-batches in one order,
    # and each scores its own chunks' samples (stage fusion per rank: the join of their scores runs),
    # which rounds as rollplex's per-sample scoring does (1e-2, see the first test).
    assert updates[DP2]["replayed"] <= 1e-2 and "join" in rows[DP2]["seconds_by_kind"]
    assert any(line.startswith(f"{DP2} is") for line in out["speedups"])
    assert f"{DP2}: ranks' weights after the step differ by at most 0.0e+00" in lines  # an option-named dp2 row too
    # A variant (prefix work gated until at most 4 of the 8 rows decode) is its own row, compared with serial.
    assert updates["rollplex-nofusion:gate=4"]["replayed"] <= 1e-6
    assert any(line.startswith("rollplex-nofusion:gate=4 is") for line in out["speedups"])


def test_an_iterations_prompts_and_lengths_do_not_depend_on_the_global_rng():
    """Policies take turns, and each consumes the global RNG its own way: the workload of iteration i
    must come from (seed, iteration) alone."""
    import torch
    from transformers import AutoConfig

    from rollplex.pipeline.bench.bench import make_prompts

    path = resolve_model_path(load_config(None, []))
    cfg = BenchConfig(model=path + "/config.json", device="cpu", prompts=3, samples=8, vision_tokens=16, text_tokens=8,
                      max_new_tokens=256, mean_new_tokens=96)
    hf = AutoConfig.from_pretrained(path)
    drawn = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        drawn.append([(p.input_ids.tolist(), p.meta["max_tokens"]) for p in make_prompts(cfg, hf, 5)])
    assert drawn[0] == drawn[1]
    lengths = [n for _, caps in drawn[0] for n in caps]
    assert len(set(lengths)) > 1 and all(4 <= n <= 256 for n in lengths)
    assert make_prompts(cfg, hf, 6)[0].meta["max_tokens"] != drawn[0][0][1]


def test_given_lengths_cap_every_iterations_samples_alike(tmp_path):
    """--lengths: a train run's caps (rollout.length_caps), the same each iteration, instead of fresh draws;
    a file of the wrong shape or with a cap out of range is one error naming the file and the bad part."""
    import subprocess
    import sys

    from transformers import AutoConfig

    from rollplex.errors import RollplexError
    from rollplex.pipeline.bench.bench import make_prompts
    from rollplex.pipeline.bench.results import read_lengths

    path = resolve_model_path(load_config(None, []))
    caps = [[1, 2, 3, 4], [256, 9, 9, 7]]
    (tmp_path / "caps.json").write_text(json.dumps(caps))
    lengths = read_lengths(str(tmp_path / "caps.json"), prompts=2, samples=4, most=256)
    cfg = BenchConfig(model=path + "/config.json", device="cpu", prompts=2, samples=4, vision_tokens=16,
                      text_tokens=8, max_new_tokens=256, lengths=lengths)
    hf = AutoConfig.from_pretrained(path)
    first, later = make_prompts(cfg, hf, 1), make_prompts(cfg, hf, 2)
    assert [p.meta["max_tokens"] for p in first] == caps == [p.meta["max_tokens"] for p in later]
    assert first[0].input_ids.tolist() != later[0].input_ids.tolist()  # only the lengths are held
    for bad, words in ((caps[:1], "2 lists (--prompts) of 4"), ([[1, 2, 3, 4], [1, 2, 3, 257]], "prompt 1: 257"),
                       ([[1, 2, 3, 4], [1, 2, 0, 4]], "prompt 1: 0 is not"), ("{", "caps.json")):
        (tmp_path / "caps.json").write_text(bad if isinstance(bad, str) else json.dumps(bad))
        with pytest.raises(RollplexError, match=re.escape(words)):
            read_lengths(str(tmp_path / "caps.json"), prompts=2, samples=4, most=256)
    done = subprocess.run([sys.executable, "-m", "rollplex.cli", "bench", "--device", "cpu", "--prompts", "2",
                           "--samples", "4", "--lengths", str(tmp_path / "caps.json"), "--out", str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--lengths" in done.stderr and "caps.json" in done.stderr
    assert not (tmp_path / "b").exists()  # refused before anything was built or written


def test_policy_options_batch_nodes_and_micro_batches():
    from transformers import AutoConfig

    from rollplex.pipeline.bench.bench import compile_for

    path = resolve_model_path(load_config(None, []))
    cfg = BenchConfig(model=path + "/config.json", device="cpu", prompts=4, samples=2, max_new_tokens=8, chunk_tokens=4,
                      train_fusion=True)
    hf = AutoConfig.from_pretrained(path)

    def kinds(policy: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in compile_for(cfg, policy, hf).nodes.values():
            counts[node.kind] = counts.get(node.kind, 0) + 1
        return counts

    plain, batched = kinds("serial"), kinds("serial:ppn=4:mb=4")
    assert (plain["loss"], plain["prefix"], plain["vit_encode"]) == (4, 8, 4)
    assert (batched["loss"], batched["prefix"], batched["vit_encode"]) == (1, 2, 1)
    assert kinds("rollplex:ppn=2:mb=2:tf=0")["prefix"] == 4
    # Under train fusion the policy's prefixes run in its training nodes: only the reference's remain.
    assert kinds("rollplex:ppn=2:mb=2")["prefix"] == 2
    fused, unfused = (set(compile_for(cfg, p, hf).nodes) for p in ("rollplex", "rollplex:tf=0"))  # per policy
    assert "train_c0" in fused - unfused and "loss_m0" in unfused - fused


def test_bench_names_an_unknown_policy_or_option():
    with pytest.raises(RollplexError, match="--policies: 'fastest' unknown"):
        run(BenchConfig(device="cpu", policies=("fastest",)), log=lambda *a: None)
    with pytest.raises(RollplexError, match="'rollplex:gates=4': option 'gates=4'"):
        run(BenchConfig(device="cpu", policies=("rollplex:gates=4",)), log=lambda *a: None)
    with pytest.raises(RollplexError, match="'serial:gate=4': option 'gate' applies to the rollplex policies only"):
        run(BenchConfig(device="cpu", policies=("serial:gate=4",)), log=lambda *a: None)
    with pytest.raises(RollplexError, match="'serial:sp=0': option 'sp' applies to the rollplex policies only"):
        run(BenchConfig(device="cpu", policies=("serial:sp=0",)), log=lambda *a: None)
    assert parse_policy("rollplex:sp=0:wc=4") == ("rollplex", {"sp": 0, "wc": 4})
    # The GIL's switch interval is the process's, as cluster.switch_interval_us is a run's: any policy's.
    assert parse_policy("serial:ppn=8:gil=200") == ("serial", {"ppn": 8, "gil": 200})
    assert parse_policy("plain:gil=200") == ("plain", {"gil": 200})


def test_in_process_all_reduce_steps_every_rank_on_the_mean_gradient():
    import threading

    import torch

    from rollplex.pipeline.bench.multi import InProcessAllReduce

    class Engine:
        def __init__(self, grad):
            p = torch.nn.Parameter(torch.zeros(3))
            p.grad = torch.tensor(grad)
            self._trainable = [("w", p)]
            self.stepped_with = None

        def step(self):
            self.stepped_with = self._trainable[0][1].grad.clone()
            return "stepped"

    group = InProcessAllReduce(2)
    engines = [Engine([1.0, 2.0, 3.0]), Engine([3.0, 2.0, -3.0])]
    ranks = [group.wrap(e, r) for r, e in enumerate(engines)]
    out = [None, None]
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, ranks[r].step())) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert out == ["stepped", "stepped"]
    for e in engines:  # both ranks stepped on the mean, so their weights stay equal
        assert e.stepped_with.tolist() == [2.0, 2.0, 0.0]

    lone = InProcessAllReduce(2)
    a, b = Engine([1.0, 1.0, 1.0]), Engine([1.0, 1.0, 1.0])
    b._trainable[0][1].grad = None
    lone.engines = [a, b]
    with pytest.raises(EngineError, match="gradient on some ranks only"):
        lone._average()


def test_a_slow_iteration_does_not_pull_the_breakdown_off_the_median():
    """The breakdown is each kind's median over the timed iterations, like the iteration time: a
    first iteration three times as slow leaves both where the other two are."""
    from rollplex.pipeline.bench.results import PolicyResult

    res = PolicyResult("serial", seconds=[15.0, 5.0, 5.2],
                       kinds=[{"decode_chunk": 6.0, "loss": 6.0}, {"decode_chunk": 2.0, "loss": 2.0},
                              {"decode_chunk": 2.2, "loss": 1.8}],
                       read_bytes=[12e9, 4e9, 4.4e9], generated=[600, 620, 640])
    assert res.median == 5.2
    assert res.by_kind == {"decode_chunk": 2.2, "loss": 2.0} and res.decode_seconds == 2.2
    assert res.decode_bandwidth() == 2e9 and res.tokens == 620


@pytest.mark.slow
def test_interleaved_policies_take_turns_and_compute_what_they_compute_in_a_row(tmp_path, monkeypatch):
    """Every iteration starts from the same weights, so taking turns changes no policy's rollout or
    update: both orders give the same responses and the same update differences from serial. Taking
    turns, serial goes first in every round and the others' order rotates by one each round."""
    from rollplex.pipeline.run.local import LocalExecutor

    config = resolve_model_path(load_config(None, [])) + "/config.json"
    policies = ("serial", "serial:ppn=2:mb=2", "rollplex")
    order: list[tuple[str, int]] = []
    timed = LocalExecutor.run

    def run_and_note(self, graph, iteration, inputs):
        order.append((self.hosts[0].name.split("/", 1)[1], iteration))
        return timed(self, graph, iteration, inputs)

    monkeypatch.setattr(LocalExecutor, "run", run_and_note)
    outs = {}
    for interleave in (True, False):
        order.clear()
        outs[interleave] = run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=2, samples=2,
                                           vision_tokens=16, text_tokens=8, max_new_tokens=8, mean_new_tokens=4,
                                           chunk_tokens=4, iterations=3, policies=policies, interleave=interleave,
                                           out=str(tmp_path / str(interleave))), log=lambda *a: None)
        names = [*policies, "serial#aa"]
        if not interleave:  # each policy's 3 iterations and its replay of iteration 0, in a row
            assert [i for _, i in order] == [0, 1, 2, 0] * 4
            continue
        # a round per iteration; the last one runs each policy's iteration 2 and at once its replay of 0
        rounds = [order[0:4], order[4:8], [x for x in order[8:] if x[1] == 2]]
        assert [{i for _, i in r} for r in rounds] == [{0}, {1}, {2}] and len(order) == 16
        others = [[p for p, _ in r[1:]] for r in rounds]
        assert all(r[0][0] == "serial" for r in rounds) and all(sorted(o) == sorted(names[1:]) for o in others)
        for before, after in zip(others, others[1:]):
            assert after == before[1:] + before[:1]  # rotated by one
    for a, b in zip(outs[True]["updates"], outs[False]["updates"]):
        assert a["policy"] == b["policy"]
        assert (a["sampled"], a["replayed"], a["identical_responses"]) == (b["sampled"], b["replayed"],
                                                                          b["identical_responses"])


def test_a_ratio_has_its_95_percent_interval_and_the_a_a_line_says_whether_the_run_counts():
    """The median of paired per-iteration ratios with a distribution-free interval from order
    statistics: six pairs give [min, max] (96.9% coverage), five too few for 95%."""
    from rollplex.pipeline.bench.results import PolicyResult, median_interval, speedups

    assert median_interval([1.0, 1.2, 0.9, 1.1, 1.05, 0.95]) == (1.025, 0.9, 1.2)
    assert median_interval([1.0, 1.2, 0.9, 1.1, 1.05]) is None
    assert median_interval(list(range(1, 21))) == (10.5, 6, 15)  # n = 20: x(6)..x(15), 95.9%
    base = [5.0, 5.2, 4.9, 5.1, 5.0, 5.3]
    calm = {"serial": PolicyResult("serial", seconds=base), "rollplex": PolicyResult("rollplex", seconds=[4.0] * 6),
            "serial#aa": PolicyResult("serial#aa", seconds=[5.05, 5.1, 5.0, 5.0, 5.1, 5.2])}
    lines = speedups(calm)
    assert "rollplex is 1.26x serial (95% 1.23-1.32, n=6)" in lines
    assert any(line.startswith("A/A: serial#aa is") and "contains 1: the run counts" in line for line in lines)
    drifting = dict(calm, **{"serial#aa": PolicyResult("serial#aa", seconds=[s * 0.9 for s in base])})
    assert any("does not contain 1" in line for line in speedups(drifting))


def test_a_policys_gil_and_cudnn_options_hold_while_its_iterations_run_and_the_process_keeps_its_own(
        tmp_path, monkeypatch):
    import sys

    import torch

    from rollplex.pipeline.run.local import LocalExecutor

    config = resolve_model_path(load_config(None, [])) + "/config.json"
    seen: list[tuple[int, tuple[float, bool]]] = []
    timed = LocalExecutor.run

    def run_and_note(self, graph, iteration, inputs):
        seen.append((len(graph.nodes), (sys.getswitchinterval(), torch.backends.cuda.cudnn_sdp_enabled())))
        return timed(self, graph, iteration, inputs)

    monkeypatch.setattr(LocalExecutor, "run", run_and_note)
    before = (sys.getswitchinterval(), torch.backends.cuda.cudnn_sdp_enabled())
    run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=2, samples=2, vision_tokens=16,
                    text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=4, iterations=2,
                    policies=("serial", "rollplex:gil=250:cudnn=0"), aa=False, out=str(tmp_path)), log=lambda *a: None)
    by_graph: dict[int, list] = {}  # serial's and rollplex's graphs differ in size
    for nodes, settings in seen:
        by_graph.setdefault(nodes, []).append(settings)
    # Each ran two timed iterations and an untimed replay; only rollplex's timed ones take its options.
    rollplex, serial = sorted(by_graph.values(), key=lambda runs: runs.count(before))
    assert rollplex == [(250e-6, False)] * 2 + [before] and serial == [before] * 3
    assert (sys.getswitchinterval(), torch.backends.cuda.cudnn_sdp_enabled()) == before


def test_a_policy_that_only_turns_a_runtime_knob_is_named_as_running_an_earlier_policys_graph():
    from transformers import AutoConfig

    from rollplex.pipeline.bench.bench import compile_for
    from rollplex.pipeline.bench.results import same_graph_as

    path = resolve_model_path(load_config(None, []))
    cfg = BenchConfig(model=path + "/config.json", device="cpu", prompts=4, samples=2, max_new_tokens=8, chunk_tokens=4)
    hf = AutoConfig.from_pretrained(path)
    policies = ["serial", "rollplex:ppn=2", "rollplex:ppn=2:sp=0:gil=100", "rollplex:ppn=4", "serial:cudnn=0"]
    graphs = {p: compile_for(cfg, p, hf) for p in policies}
    assert same_graph_as(graphs) == {"rollplex:ppn=2:sp=0:gil=100": "rollplex:ppn=2", "serial:cudnn=0": "serial"}


def test_trace_nodes_reads_a_policys_nodes_from_a_recorded_bench_trace():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("trace_nodes", root / "benchmarks/trace_nodes.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    trace = json.loads((root / "benchmarks/results/2026-11-30-h200-trace-run28-1024.json").read_text())
    serial = tool.nodes(trace, "serial:ppn=8:mb=2")
    assert [n["name"] for n in serial if n["lane"] == "decode"][:2] == ["decode_c0", "decode_c1"]
    assert len([n for n in serial if tool.kind(n["name"]) == "decode"]) == 32
    assert all(a["start_s"] <= b["start_s"] for a, b in zip(serial, serial[1:]))
    assert [tool.kind(n) for n in ("train_c7", "suffix_ref_logprobs_c2", "prefix_actor_p0-1", "loss_m0",
                                   "optimizer_step")] == ["train", "suffix_ref_logprobs", "prefix_actor", "loss",
                                                          "optimizer_step"]
    with pytest.raises(SystemExit, match="no policy 'rollplex' in the trace; it has: rollplex:ppn=8"):
        tool.nodes(trace, "rollplex")


def test_speedups_pair_policies_by_name_whatever_their_options():
    """``serial:ppn=8:mb=2`` is serial and ``rollplex:...:tf=1`` is rollplex: their ratio is printed
    against each other and against plain, and the A/A line is the serial variant's twin."""
    from rollplex.pipeline.bench.results import PolicyResult, speedups

    secs = {"plain": [10.0] * 6, "serial:ppn=8:mb=2": [5.0] * 6, "rollplex:ppn=8:tf=1": [4.0] * 6,
            "serial:ppn=8:mb=2#aa": [5.0, 5.1, 4.9, 5.0, 5.2, 4.8]}
    lines = speedups({name: PolicyResult(name, seconds) for name, seconds in secs.items()})
    assert "rollplex:ppn=8:tf=1 is 1.25x serial:ppn=8:mb=2 (95% 1.25-1.25, n=6)" in lines
    assert "rollplex:ppn=8:tf=1 is 2.50x plain (95% 2.50-2.50, n=6)" in lines
    assert "serial:ppn=8:mb=2 is 2.00x plain (95% 2.00-2.00, n=6)" in lines
    aa = [line for line in lines if line.startswith("A/A: serial:ppn=8:mb=2#aa is ")]
    assert len(aa) == 1 and aa[0].endswith("the interval contains 1: the run counts"), lines


def test_the_true_lower_bound_follows_the_devices_measured_rates():
    """Decode-bound: twice the copy bandwidth halves the bound; compute-bound: twice the matmul rate does."""
    from rollplex.engines.modelspec import PRESETS
    from rollplex.pipeline.bench.results import DeviceRates, lower_bound

    cfg, spec = BenchConfig(), PRESETS["qwen2.5-vl-3b"]
    rows = [{"prompt_id": f"p{p}", "response_token_ids": [0] * n} for p in range(8) for n in (40, 400, 900, 90)]
    slow, fast_copy = DeviceRates(3e12, 800e12), DeviceRates(6e12, 800e12)
    assert lower_bound(cfg, spec, rows, fast_copy) == pytest.approx(lower_bound(cfg, spec, rows, slow) / 2)
    short = [{"prompt_id": f"p{p}", "response_token_ids": [0]} for p in range(8)]  # one step: FLOPs bound it
    assert lower_bound(cfg, spec, short, DeviceRates(3e12, 1600e12)) == pytest.approx(
        lower_bound(cfg, spec, short, slow) / 2)
