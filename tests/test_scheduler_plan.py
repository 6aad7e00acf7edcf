"""plan(graph, cluster, costs, policy): invariants on random DAGs under two namings, and on the
compiled GRPO iteration. CPU only; no engines, no model weights."""
from __future__ import annotations

from dataclasses import replace

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollplex.dags.grpo import grpo
from rollplex.errors import GraphError
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
from rollplex.pipeline.plan.costs import NodeCost
from rollplex.pipeline.plan.hardware import Layout, hardware
from rollplex.pipeline.compile.ir import IterationGraph, Node
from rollplex.pipeline.plan.schedule import PLAN_POLICIES, SERIAL_PHASES, placement, plan, retime, schedule

EPS = 1e-9
KINDS = ("vit_encode", "decode_chunk", "prefix", "suffix_score", "reward", "loss", "optimizer_step", "weight_sync")
PHASE = {kind: i for i, kinds in enumerate(SERIAL_PHASES) for kind in kinds}
ENGINES = EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"})
DIMS = ModelDims(hidden=128, layers=2, kv_heads=2, head_dim=32, vocab=600, params=600_000, dtype_bytes=2)


# -- random DAGs under two namings ------------------------------------------------------------------
@st.composite
def dag_specs(draw):
    """(kind, preds, seconds, output bytes, decode batch) per node; preds point to earlier nodes."""
    n = draw(st.integers(2, 18))
    # Kinds in serial-phase order, so that data never flows back to an earlier phase (which no
    # serial plan can honour; see test_data_flow_against_the_phases_is_an_error).
    kinds = sorted(draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n)), key=PHASE.__getitem__)
    nodes = []
    for i in range(n):
        kind = kinds[i]
        preds = sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else []
        seconds = draw(st.sampled_from([0.0, 0.05, 0.1, 0.3, 1.0, 2.5]))
        nbytes = draw(st.sampled_from([0, 1 << 20, 1 << 28, 1 << 31]))
        batch = draw(st.sampled_from([4, 16, 32, 64, 256])) if kind == "decode_chunk" else 0
        nodes.append((kind, preds, seconds, nbytes, batch))
    return nodes


def build(spec, naming: str) -> tuple[IterationGraph, dict[str, NodeCost], dict[int, str]]:
    """naming "a": n0, n1, ... added in order; "b": other names, added in reverse order."""
    n = len(spec)
    name = {i: (f"n{i}" if naming == "a" else f"z{n - i:03d}_{(i * 7919) % 101}") for i in range(n)}
    value = {i: (f"v{i}" if naming == "a" else f"out_of_{name[i]}") for i in range(n)}
    g = IterationGraph("random")
    g.add_input("x", 16, "host")
    costs = {}
    order = range(n) if naming == "a" else reversed(range(n))
    for i in order:
        kind, preds, seconds, nbytes, batch = spec[i]
        inputs = tuple(value[p] for p in preds) or ("x",)
        g.add(Node(name[i], kind, inputs, (value[i],)), **{value[i]: dict(nbytes=nbytes, device="device")})
        costs[name[i]] = NodeCost(seconds, batch)
    return g.connect().lint(), costs, name


def check_plan(p) -> None:
    """Dependencies respected (with transfer delays); no lane of any GPU runs two nodes at once;
    every node on one of its candidate gangs."""
    t, jobs = p.timing, p.problem.jobs
    for i, succs in enumerate(p.problem.succs):
        for s, delay in succs:
            assert t.start[s] >= t.finish[i] + delay - EPS, (jobs[i].name, jobs[s].name)
    for i, job in enumerate(jobs):
        assert t.finish[i] >= t.start[i] - EPS
        assert t.gang[i] in job.gangs, (job.name, t.gang[i], job.gangs)
    busy: dict[tuple[int, str], list[tuple[float, float, str]]] = {}
    for i, job in enumerate(jobs):
        for gpu in t.gang[i]:
            busy.setdefault((gpu, job.lane), []).append((t.start[i], t.finish[i], job.name))
    for key, spans in busy.items():
        spans.sort()
        for (s0, f0, a), (s1, f1, b) in zip(spans, spans[1:]):
            assert s1 >= f0 - EPS, f"{key}: %{a} [{s0}, {f0}) overlaps %{b} [{s1}, {f1})"
    for name, slot in p.slots.items():
        meta = p.graph.nodes[name].meta
        assert (meta["start"], meta["finish"], tuple(meta["gpus"]), meta["lane"]) == \
            (slot.start, slot.finish, slot.gpus, slot.lane)
    assert math.isclose(p.makespan, max((s.finish for s in p.slots.values()), default=0.0))


def fingerprint(p, kinds: dict[str, str]) -> list:
    """The plan as a multiset of (kind, gpus, lane, start, finish): equal across namings up to
    swapping nodes that are structurally identical."""
    return sorted((kinds[s.node], s.gpus, s.lane, round(s.start, 9), round(s.finish, 9)) for s in p.slots.values())


@settings(max_examples=60, deadline=None)
@given(spec=dag_specs(), policy=st.sampled_from(PLAN_POLICIES), gpus=st.sampled_from([2, 4]))
def test_random_dags_respect_dependencies_and_lanes_under_two_namings(spec, policy, gpus):
    cluster = hardware("h200", gpus)
    plans = []
    for naming in ("a", "b"):
        g, costs, _ = build(spec, naming)
        p = plan(g, cluster, costs, policy)
        check_plan(p)
        plans.append((p, {n.name: n.kind for n in g}))
    (a, ka), (b, kb) = plans
    assert math.isclose(a.makespan, b.makespan, abs_tol=1e-9)
    assert fingerprint(a, ka) == fingerprint(b, kb)


@settings(max_examples=15, deadline=None)
@given(spec=dag_specs(), policy=st.sampled_from(PLAN_POLICIES))
def test_replaying_a_plan_with_its_own_costs_reproduces_it(spec, policy):
    g, costs, _ = build(spec, "a")
    p = plan(g, hardware("h200", 2), costs, policy)
    again = retime(p)
    for name, slot in p.slots.items():
        other = again.slots[name]
        assert (other.gpus, other.lane) == (slot.gpus, slot.lane)
        assert math.isclose(other.start, slot.start, abs_tol=1e-9) and math.isclose(other.finish, slot.finish,
                                                                                    abs_tol=1e-9)


def test_slower_costs_replay_in_the_same_order_and_scale_the_makespan():
    """a -> b -> c on one lane: doubling every cost doubles the makespan, orders kept."""
    g, costs, name = build([("prefix", [], 1.0, 0, 0), ("prefix", [0], 0.5, 0, 0), ("loss", [1], 0.25, 0, 0)], "a")
    p = plan(g, hardware("h200", 1), costs, "serial")
    slow = retime(p, costs={k: NodeCost(v.seconds * 2) for k, v in costs.items()})
    assert slow.makespan == pytest.approx(2 * p.makespan)
    assert slow.lanes() == p.lanes()


# -- the interference model and the rollplex gate ------------------------------------------------------
def window(decode_batch: float, policy: str):
    """decode (4 s, batch B) beside an independent prefix (1 s) on one GPU.

        x -> decode
        x -> prefix
    """
    g, costs, name = build([("decode_chunk", [], 4.0, 0, decode_batch), ("prefix", [], 1.0, 0, 0)], "a")
    # On SM partitions, where what hides falls with the decode batch (plain streams hide 5% at any batch).
    return plan(g, hardware("h200", 1, partitioned=True), costs, policy), name


def test_prefix_under_light_decode_is_mostly_hidden():
    p, name = window(8, "rollplex")
    inter = hardware("h200", 1, partitioned=True).interference
    r = inter.compute_rate(8)
    decode, prefix = p.slots[name[0]], p.slots[name[1]]
    assert prefix.start == 0 and prefix.finish == pytest.approx(1.0 / r)  # progresses at r beside decode
    # decode runs at 1/s while sharing and loses (1 − 1/s)·T/r: what is left of the prefix's 1 s.
    assert decode.finish == pytest.approx(4.0 + (1 - 1 / inter.slowdown) / r)
    hidden = 1.0 - (p.makespan - 4.0) / 1.0
    assert hidden == pytest.approx(inter.hidden(8))  # the measured share, by construction


def test_rollplex_keeps_prefix_out_of_decode_that_hides_nothing():
    p, name = window(256, "rollplex")
    assert p.slots[name[1]].start == pytest.approx(p.slots[name[0]].finish)  # waited for decode to end
    assert p.makespan == pytest.approx(5.0)


def test_serial_runs_phases_apart_and_rollplex_overlaps_them():
    serial, name = window(8, "serial")
    assert serial.slots[name[1]].start >= serial.slots[name[0]].finish - EPS
    overlapped, _ = window(8, "rollplex")
    assert overlapped.makespan < serial.makespan


# -- the compiled GRPO iteration ------------------------------------------------------------------------
def grpo_graph(prompts=4, samples=2, max_new_tokens=8, chunk_tokens=4, prefix_sharing=True,
               micro_batch_groups=2) -> IterationGraph:
    shape = BatchShape(prompts=prompts, samples=samples, max_new_tokens=max_new_tokens, chunk_tokens=chunk_tokens,
                       micro_batch_groups=micro_batch_groups, prefix_sharing=prefix_sharing)
    return compile_iteration(grpo, shape, ENGINES, DIMS)


def unit_costs(g: IterationGraph) -> dict[str, NodeCost]:
    base = {"decode_chunk": 1.0, "prefix": 0.3, "suffix_score": 0.4, "loss": 0.5, "vit_encode": 0.1,
            "optimizer_step": 0.2, "weight_sync": 0.1}
    return {n.name: NodeCost(base.get(n.kind, 0.01), 8 if n.kind == "decode_chunk" else 0) for n in g}


@pytest.mark.parametrize("policy", PLAN_POLICIES)
def test_compiled_grpo_plans_are_valid_and_name_independent(policy):
    g = grpo_graph()
    p = plan(g, hardware("h200", 4), unit_costs(g), policy)
    check_plan(p)
    assert set(p.slots) == set(g.nodes)
    # Nodes of the compiled graph are distinguishable (prompt and chunk indices), so a renamed copy
    # gets exactly the same placement and times node by node.
    new = {n: f"q{i}_{n[::-1]}" for i, n in enumerate(reversed(list(g.nodes)))}
    other = IterationGraph(g.name)
    other.meta = dict(g.meta)
    for v in g.values.values():
        if v.producer is None:
            other.add_input(v.name, **v.facts())
    for node in reversed(list(g)):
        other.add(Node(new[node.name], node.kind, node.inputs, node.outputs, node.model, node.engine, node.args),
                  **{o: g.values[o] for o in node.outputs})
    other.connect()
    for u, v, data in g.g.edges(data=True):
        if not data["values"]:
            other.add_order(new[u], new[v], data["reason"])
    q = plan(other.lint(), hardware("h200", 4), {new[k]: v for k, v in unit_costs(g).items()}, policy)
    for name, slot in p.slots.items():
        twin = q.slots[new[name]]
        assert (twin.gpus, twin.lane, twin.start, twin.finish) == (slot.gpus, slot.lane, slot.start, slot.finish)


def test_disaggregated_keeps_rollout_and_training_on_their_own_gpus():
    g = grpo_graph(prefix_sharing=False)
    cluster = hardware("h200", 4)
    p = plan(g, cluster, unit_costs(g), "disaggregated", Layout.split(cluster, 2))
    for slot in p.slots.values():
        if slot.kind == "decode_chunk":
            assert slot.gpus == (0, 1)
        if slot.kind in ("suffix_score", "loss", "optimizer_step"):
            assert set(slot.gpus) <= {2, 3}
        if slot.kind == "weight_sync":
            assert slot.gpus == (0, 1, 2, 3)


def test_a_stage_fused_graph_scores_a_chunks_finished_samples_while_decode_goes_on():
    """The graph compiled with stage fusion (as the rollplex schedule runs it): the reference scores
    what chunk 0 finished beside a long chunk 1, and the join that hands per-prompt scores on waits
    for the last chunk's."""
    shape = BatchShape(prompts=2, samples=2, max_new_tokens=8, chunk_tokens=4, stage_fusion=True)
    g = compile_iteration(grpo, shape, ENGINES, DIMS)
    costs = {**unit_costs(g), "decode_c1": NodeCost(5.0, 8)}
    p = plan(g, hardware("h200", 2, partitioned=True), costs, "rollplex")
    check_plan(p)
    assert p.slots["suffix_ref_logprobs_c0"].start < p.slots["decode_c1"].finish
    assert p.slots["join_ref_logprobs"].start >= p.slots["suffix_ref_logprobs_c1"].finish
    serial = plan(compile_iteration(grpo, replace(shape, stage_fusion=False), ENGINES, DIMS),
                  hardware("h200", 2, partitioned=True),
                  costs, "serial")
    assert min(s.start for s in serial.slots.values() if s.kind == "suffix_score") >= serial.slots["decode_c1"].finish


def test_frozen_scoring_of_chunks_past_the_window_waits_for_the_last_chunk_in_one_node():
    """window_chunks=1 over three chunks: the samples finishing in chunks 1 and 2 are scored by one
    node, which waits for the last chunk; chunk 0's keep their own node in the window."""
    shape = BatchShape(prompts=1, samples=3, max_new_tokens=12, chunk_tokens=4, stage_fusion=True, window_chunks=1)
    g = compile_iteration(grpo, shape, ENGINES, DIMS)
    assert sorted(n.name for n in g.of_kind("suffix_score") if n.model == "ref") == [
        "suffix_ref_logprobs_c0", "suffix_ref_logprobs_c1"]
    p = plan(g, hardware("h200", 2), {**unit_costs(g), "decode_c1": NodeCost(3.0, 8)}, "rollplex")
    check_plan(p)
    assert p.slots["suffix_ref_logprobs_c1"].start >= p.slots["decode_c2"].finish
    assert p.slots["suffix_ref_logprobs_c0"].start < p.slots["decode_c1"].finish


def test_a_train_fused_graph_trains_an_early_chunks_groups_while_decode_goes_on():
    """The compiled fused graph (the normaliser deferred to the optimizer step): chunk 0's groups
    train beside a long decode tail, and the step waits for the last chunk's count."""
    shape = BatchShape(prompts=2, samples=2, max_new_tokens=8, chunk_tokens=4, micro_batch_groups=1,
                       stage_fusion=True, train_fusion=True)
    g = compile_iteration(grpo, shape, ENGINES, DIMS)
    costs = {**unit_costs(g), "decode_c1": NodeCost(5.0, 8)}  # a long tail: the last chunk decodes on
    fused = plan(g, hardware("h200", 2), costs, "rollplex")
    check_plan(fused)
    assert fused.slots["train_c0"].start < fused.slots["decode_c1"].finish
    assert fused.slots["optimizer_step"].start >= fused.slots["decode_c1"].finish
    serial = plan(g, hardware("h200", 2), costs, "serial")
    assert serial.slots["train_c0"].start >= serial.slots["decode_c1"].finish
    assert fused.makespan < serial.makespan


def test_schedule_with_a_cluster_writes_the_plan_into_meta_and_keeps_streams():
    g = grpo_graph()
    placed = schedule(g, "rollplex", hardware("h200", 2), unit_costs(g))
    for node in placed:
        assert node.meta["stream"] == node.kind_info.stream
        assert {"priority", "placement", "start", "finish", "gpus", "lane"} <= set(node.meta)
    assert "start" not in next(iter(g)).meta


def test_data_flow_against_the_phases_is_an_error():
    """loss -> prefix: serial barriers (prefix before loss) would close a cycle."""
    g, costs, _ = build([("loss", [], 1.0, 0, 0), ("prefix", [0], 1.0, 0, 0)], "a")
    with pytest.raises(GraphError, match="policy serial: the graph's data flow contradicts the serial phases"):
        plan(g, hardware("h200", 1), costs, "serial")
    assert plan(g, hardware("h200", 1), costs, "rollplex").makespan == pytest.approx(2.0)


def test_errors_name_the_policy_the_layout_and_the_node():
    g = grpo_graph(prompts=1)
    cluster = hardware("h200", 2)
    with pytest.raises(GraphError, match="unknown plan policy 'overlap'; choose one of serial, disaggregated"):
        plan(g, cluster, {}, "overlap")
    with pytest.raises(GraphError, match="policy rollplex needs a colocated layout"):
        plan(g, cluster, {}, "rollplex", Layout.split(cluster, 1))
    with pytest.raises(GraphError, match=r"%offload_x: a transfer node needs args\['gpus'\]"):
        placement(Node("offload_x", "offload", ("x",), ("y",)), Layout.colocate(cluster), cluster)
    with pytest.raises(GraphError, match=r"%vit_p0: cost -1.0 seconds"):
        plan(g, cluster, {"vit_p0": -1.0}, "serial")
