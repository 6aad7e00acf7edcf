"""The data-parallel pass (pipeline/compile/ranks.py) and its lowering onto Dask workers, on compiled graphs.
CPU only, no engines: invariants of the placed graph, not snapshots."""
from __future__ import annotations

import random
import re

import pytest
from dask._task_spec import TaskRef

from rollplex.errors import ConfigError, GraphError
from rollplex.pipeline.run.algorithms import load_algorithm
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
from rollplex.pipeline.run.executor import lower, task_key
from rollplex.pipeline.compile.ir import Node
from rollplex.pipeline.compile.ranks import (balance, check_data_parallel, check_placement, distribute, fit_prompts_per_node,
                                     rank_loads, rank_uses)
from rollplex.pipeline.plan.schedule import schedule

DIMS = ModelDims(128, 2, 2, 32, 1000, 10**6)
ENGINES = EngineChoice({"decode": "hf", "train": "deepspeed", "score": "transformers"})


def compiled(prompts=8, micro=1, per_node=2, chunks=2, ranks=2, policy="rollplex"):
    shape = BatchShape(prompts=prompts, samples=2, max_new_tokens=2 * chunks, chunk_tokens=2,
                       micro_batch_groups=micro, prompts_per_node=per_node)
    return schedule(distribute(compile_iteration(load_algorithm("grpo"), shape, ENGINES, DIMS), ranks), policy)


def prompt_rank(p: int, prompts: int, ranks: int) -> int:
    return p // (prompts // ranks)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("policy", ["rollplex", "serial"])
def test_every_node_runs_on_its_prompts_rank_and_device_values_never_cross(ranks, policy):
    g = compiled(ranks=ranks, policy=policy)
    check_placement(g)  # raises if a device tensor would move between workers
    for node in g:
        r = node.meta["rank"]
        for p in node.args.get("prompts", [node.args["prompt"]] if "prompt" in node.args else []):
            if node.kind != "advantage" or len(node.args["prompts"]) == 1:
                assert prompt_rank(p, 8, ranks) == r, node.name
    for u, v, data in g.g.edges(data=True):
        if g.nodes[u].meta["rank"] != g.nodes[v].meta["rank"] and data["reason"] == "value":
            assert all(g.values[o].device == "host" for o in g.nodes[u].outputs), (u, v)
        if data["reason"] == "accumulation order":  # each rank sums its own micro-batches
            assert g.nodes[u].meta["rank"] == g.nodes[v].meta["rank"], (u, v)


def test_each_rank_decodes_its_prompts_and_steps_its_own_engine_and_one_report_merges_them():
    g = compiled(ranks=2, micro=2)
    for r in range(2):
        mine = [n for n in g if n.meta["rank"] == r]
        decode = [n for n in mine if n.kind == "decode_chunk"]
        assert decode and all(n.args["prompts"] == list(range(4 * r, 4 * r + 4)) for n in decode)
        losses = [n for n in mine if n.kind == "loss"]
        assert len(losses) == 2 and all(n.args["world"] == 2 for n in losses)
        (step,) = [n for n in mine if n.kind == "optimizer_step"]
        assert set(step.inputs) == {n.outputs[0] for n in losses}
    # Every loss divides by the global batch's tokens: the gathered stats of both ranks' decodes.
    (stats,) = g.of_kind("gather")[:1]
    assert stats.outputs == ("rollout_stats",) and stats.inputs == ("rollout_stats_r0", "rollout_stats_r1")
    assert all("rollout_stats" in n.inputs for n in g.of_kind("loss"))
    sinks = [n for n in g.nodes if g.g.out_degree(n) == 0]
    assert sinks == ["report"] and g.nodes["report"].kind == "gather"


@pytest.mark.parametrize("window_chunks", [0, 1])
def test_stage_fusion_splits_per_rank_each_scoring_its_own_chains_samples(window_chunks):
    """A frozen model's per-chunk scoring over every prompt becomes one node per rank over its own
    prompts, fed by that rank's decode chain; each rank's join names its own prompts' scores."""
    shape = BatchShape(prompts=4, samples=2, max_new_tokens=6, chunk_tokens=2, micro_batch_groups=1,
                       stage_fusion=True, window_chunks=window_chunks)
    g = schedule(distribute(compile_iteration(load_algorithm("grpo"), shape, ENGINES, DIMS), 2), "rollplex")
    check_placement(g)
    scoring = [n for n in g if "handoff_chunk" in n.args]
    assert len(scoring) == 2 * (3 if window_chunks == 0 else 2)
    for node in scoring:
        r = node.meta["rank"]
        assert node.args["prompts"] == [2 * r, 2 * r + 1]
        for v in node.inputs:  # its prompts' prefixes and its own chain's hand-offs
            producer = g.nodes[g.values[v].producer]
            assert producer.meta["rank"] == r and (producer.kind != "decode_chunk" or v.endswith(f"_r{r}"))
    for r in range(2):
        join = g.nodes[f"join_ref_logprobs_r{r}"]
        assert join.outputs == tuple(f"ref_logprobs_p{p}" for p in (2 * r, 2 * r + 1))


def test_train_fusion_splits_per_rank_each_training_its_own_chains_groups():
    """``train_c{c}`` becomes one node per rank over its own prompts, reading its chain's hand-off and
    its own frozen scores; each rank's training nodes keep chunk order, its loss is scaled by the
    ranks, and each rank's optimizer step reads its own losses only."""
    shape = BatchShape(prompts=4, samples=2, max_new_tokens=6, chunk_tokens=2, micro_batch_groups=1,
                       stage_fusion=True, train_fusion=True)
    g = schedule(distribute(compile_iteration(load_algorithm("grpo"), shape, ENGINES, DIMS), 2), "rollplex")
    check_placement(g)
    for r in range(2):
        mine = [2 * r, 2 * r + 1]
        trains = [g.nodes[f"train_c{c}_r{r}"] for c in range(3)]
        for c, node in enumerate(trains):
            assert node.meta["rank"] == r and node.args["prompts"] == mine and node.args["world"] == 2
            assert f"handoff_c{c}_r{r}" in node.inputs and f"ref_logprobs_c{c}_r{r}" in node.inputs
            assert {g.nodes[g.values[v].producer].meta["rank"] for v in node.inputs if g.values[v].producer} == {r}
            assert not {v for v in node.inputs if v.startswith("prompt_p")} - {f"prompt_p{p}" for p in mine}
        assert all(g.g.has_edge(a.name, b.name) for a, b in zip(trains, trains[1:]))
        assert set(g.nodes[f"optimizer_step_r{r}"].inputs) >= {f"loss_m{c}_r{r}" for c in range(3)}
        assert not [v for v in g.nodes[f"optimizer_step_r{r}"].inputs if v.endswith(f"_r{1 - r}")]
        join = g.nodes[f"join_rewards_r{r}"]
        assert join.outputs == tuple(f"rewards_p{p}" for p in mine)
    assert not [n for n in g if n.name.startswith("train_c") and "_r" not in n.name]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("policy", ["rollplex", "serial"])
def test_each_rank_plays_its_own_prompts_multi_turn_episodes(ranks, policy):
    """Every node of the turns (decode, environment, observation vision, each turn's frozen scoring,
    the episodes' join) is one per rank over that rank's prompts and reads only its rank's values; the
    rollout stats are gathered through host relays, and each prompt's trajectories and reference
    log-probs come from its own rank."""
    shape = BatchShape(prompts=8, samples=2, max_new_tokens=4, chunk_tokens=2, prompts_per_node=2, max_turns=2,
                       observation_tokens=8)
    g = schedule(distribute(compile_iteration(load_algorithm("grpo"), shape, ENGINES, DIMS), ranks), policy)
    check_placement(g)
    turned = [n for n in g if "turn" in n.args or n.args.get("episodes")]
    assert len(turned) == ranks * len({n.name.rsplit("_r", 1)[0] for n in turned})
    for node in turned:
        r = node.meta["rank"]
        mine = list(range(r * 8 // ranks, (r + 1) * 8 // ranks))
        assert node.name.endswith(f"_r{r}") and node.args.get("prompts", mine) == mine, node.name
        for v in node.inputs:
            producer = g.values[v].producer
            assert producer is None or g.nodes[producer].meta["rank"] == r, (node.name, v)
            assert all(p in mine for p in g.values[v].prompts), (node.name, v)
        if node.args.get("episodes"):
            assert {o for o in node.outputs if o.startswith("responses_")} == {f"responses_p{p}" for p in mine}
    (gather,) = [n for n in g.of_kind("gather") if n.outputs == ("rollout_stats",)]
    assert gather.inputs == ("rollout_stats_r0", *(f"host_rollout_stats_r{r}" for r in range(1, ranks)))
    for p in range(8):
        (join,) = [n for n in g if f"ref_logprobs_p{p}" in n.outputs]
        assert join.meta["rank"] == prompt_rank(p, 8, ranks)


def test_one_rank_is_the_compiled_graph_itself():
    shape = BatchShape(prompts=4, samples=2, max_new_tokens=2, chunk_tokens=2)
    g = compile_iteration(load_algorithm("grpo"), shape, ENGINES, DIMS)
    assert distribute(g, 1) is g


def test_a_device_value_read_on_another_rank_is_refused_by_name():
    g = compiled(ranks=2)
    g.add(Node("peek", "custom", ("ref_logprobs_p7",), ("peeked",), args={"prompts": [0]}, meta={"rank": 0}))
    g.connect()
    with pytest.raises(GraphError, match=r"%peek on rank 0 reads from %suffix_ref_logprobs_p6-7 on rank 1.*device"):
        check_placement(g)


def test_a_node_over_two_ranks_prompts_is_refused_unless_host_only():
    shape = BatchShape(prompts=4, samples=2, max_new_tokens=2, chunk_tokens=2, prompts_per_node=4)
    g = compile_iteration(load_algorithm("grpo"), shape, ENGINES, DIMS)
    with pytest.raises(GraphError, match="device tensor"):
        distribute(g, 2)  # vit_p0-3 spans both ranks; its embeddings are device values
    assert fit_prompts_per_node(4, 2) == 2 and fit_prompts_per_node(3, 4) == 2 and fit_prompts_per_node(0, 3) == 1


def test_lowering_pins_each_task_to_its_ranks_worker_and_orders_across_ranks_by_token():
    g = compiled(ranks=2, policy="serial")  # serial barriers cross ranks
    ranks = ["tcp://w0:1", "tcp://w1:1"]
    inputs = {name: object() for name in g.inputs}
    low = lower(g, 3, inputs, ranks)
    home = {task_key(3, n): ranks[node.meta["rank"]] for n, node in g.nodes.items()}
    for key, task in low.graph.items():
        if key.endswith("/done"):  # a token: on its producer's worker, refers to that producer only
            (dep,) = task.dependencies
            assert low.workers[key] == [home[dep]]
            continue
        assert low.workers[key] == [home.get(key, low.workers[key][0])]
        for dep in task.dependencies:
            if dep in home and home[dep] != low.workers[key][0]:
                producer = g.nodes[dep.split("/", 1)[1]]
                assert all(g.values[o].device == "host" for o in producer.outputs), (key, dep)
    assert any(k.endswith("/done") for k in low.graph)
    # Every task's resources annotation is a dict, tokens' included (Dask's scheduler asserts it).
    assert all(isinstance(low.resources.get(k), dict) for k in low.graph)
    # Without ranks nothing is pinned (the single-worker path is unchanged).
    assert not lower(compiled(ranks=1), 3, inputs).workers


def test_values_read_on_several_ranks_are_not_counted_down():
    g = compiled(ranks=2)
    uses = rank_uses(g)
    assert uses["rollout_stats", 0] == 0 and uses["rollout_stats", 1] == 0
    assert uses["responses_p0", 0] >= 3 and ("responses_p0", 1) not in uses


def test_releasing_a_value_never_shrinks_a_bundle_that_is_being_sent_to_another_rank():
    """A bundle may hold a value read on another rank (sent whole, by Dask's serializer walking its
    items) and one read only here, whose last local use releases it from the bundle, possibly in the
    middle of that walk. Here the walk itself triggers the release (as a concurrent thread once did:
    "dictionary changed size during iteration", and the 2-rank run hung): it must go through, and the
    released value must be gone for any later reader."""
    import threading
    from types import SimpleNamespace

    import torch
    from distributed.protocol import deserialize, serialize

    from rollplex.pipeline.run.worker import RELEASED, WorkerHost

    host = SimpleNamespace(_lock=threading.Lock(), _remaining={})
    bundle: dict = {}

    class ReleasesOnSend:
        def __reduce__(self):
            WorkerHost.release(host, 0, {"local": bundle}, {"local": 1})
            return (int, (7,))

    # A tensor first: Dask then serializes the bundle item by item, as it does a real one.
    bundle.update(shared=torch.zeros(2), trigger=ReleasesOnSend(), local=torch.ones(3))
    header, frames = serialize(bundle, serializers=("dask", "pickle"), on_error="raise")
    assert deserialize(header, frames)["trigger"] == 7
    assert list(bundle) == ["shared", "trigger", "local"] and bundle["local"] is RELEASED


def test_balance_gives_equal_counts_and_evens_out_the_loads():
    rng = random.Random(0)
    for _ in range(200):
        ranks = rng.choice([2, 3, 4])
        costs = [rng.choice([1.0, 2.0, 8.0, 30.0]) * rng.random() for _ in range(ranks * rng.randint(1, 6))]
        order = balance(costs, ranks)
        assert sorted(order) == list(range(len(costs)))
        loads = rank_loads(costs, order, ranks)
        contiguous = rank_loads(costs, list(range(len(costs))), ranks)
        assert max(loads) <= max(contiguous) + 1e-9
        assert max(loads) - min(loads) <= max(costs) + 1e-9  # LPT with equal counts: within one prompt
    assert balance([5.0] * 4, 2) == [0, 2, 1, 3]  # equal costs: a fixed order


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompts=6), "rollout.prompts_per_iteration"),
    (dict(micro_batch_groups=3), "train.micro_batch_groups"),
    (dict(train_engine="hf"), "engines.train"),
    (dict(zero_stage=3), "train.zero_stage"),
    (dict(decode_engine="vllm"), "engines.decode"),
    (dict(processes=False), "cluster.processes"),
])
def test_data_parallel_settings_are_checked_by_name(kwargs, field):
    args = dict(workers=4, prompts=8, micro_batch_groups=1, train_engine="deepspeed", zero_stage=2,
                decode_engine="hf", processes=True) | kwargs
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_data_parallel(**args)
    check_data_parallel(**(args | {"workers": 1}))  # one rank: nothing to refuse


def test_dispatch_gaps_count_only_time_a_ready_node_waited_on_an_idle_stream():
    """  a ──▶ b        lane (w0, compute): a [0, 10), b [15, 20)   b waited 5 µs after a
       c ─(order)─▶ d   lane (w1, host): c [0, 30), x [30, 50), d [52, 60)
                        d's predecessor c ended at 30, but its stream was busy until 50: 2 µs
    """
    from rollplex.pipeline.plan.trace import dispatch_gaps

    ev = lambda name, ts, dur, pid, tid: {"name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}  # noqa: E731
    events = [ev("a", 0, 10, "w0", "compute"), ev("b", 15, 5, "w0", "compute"), ev("c", 0, 30, "w1", "host"),
              ev("x", 30, 20, "w1", "host"), ev("d", 52, 8, "w1", "host")]
    gaps = dispatch_gaps(events, {"b": ["a"], "d": ["c"], "x": []})
    assert gaps == pytest.approx({"b": 5e-6, "d": 2e-6})  # a, c, x have no predecessor: no reference


def test_a_node_under_two_ranks_decode_at_once_is_hidden_once():
    """  prefix [0, 10) on w0; rank 0 and rank 1 decode [0, 10) and [5, 15) on the same worker:
    the prefix is hidden for 10 µs, not the 15 µs the two overlaps add to (the bench once printed 153%)."""
    from rollplex.pipeline.plan.trace import overlap_seconds

    x = lambda cat, ts, dur, pid="w0": {"ph": "X", "cat": cat, "name": f"{cat}{ts}", "ts": ts, "dur": dur, "pid": pid}  # noqa: E731
    trace = {"traceEvents": [x("prefix", 0, 10), x("decode_chunk", 0, 10), x("decode_chunk", 5, 10),
                             x("decode_chunk", 0, 10, pid="w1")]}
    assert overlap_seconds(trace, {"prefix"}, {"decode_chunk"}) == pytest.approx(10e-6)


def test_the_placed_graph_prints_each_nodes_rank():
    text = str(compiled(prompts=4, ranks=2))
    assert re.search(r"^%decode_r1_c0 : rank1/decode ", text, re.M)
    assert re.search(r"^%optimizer_step_r0 : rank0/compute ", text, re.M)
    assert re.search(r"^%report : rank0/host .* = gather\(%rollout_stats, %report_r0, %report_r1\)$", text, re.M)


def test_tensor_parallel_decode_groups_decode_their_prompts_together_and_hand_on_their_own():
    """4 ranks in 2 tensor-parallel decode groups: every rank of a group runs a decode chain over the
    group's prompts, on vision encodings made on its own rank; everything else is the data-parallel graph."""
    shape = BatchShape(prompts=8, samples=2, max_new_tokens=4, chunk_tokens=2, prompts_per_node=2)
    single = compile_iteration(load_algorithm("grpo"), shape, EngineChoice(
        {"decode": "torch-graph", "train": "deepspeed", "score": "transformers"}), DIMS)
    dp, tp = distribute(single, 4), distribute(single, 4, tp_rollout=2)
    check_placement(tp)
    for r in range(4):
        group = [0, 1] if r < 2 else [2, 3]
        decoded = [p for peer in group for p in range(2 * peer, 2 * peer + 2)]
        chain = [n for n in tp if n.kind == "decode_chunk" and n.meta["rank"] == r]
        assert chain and all(n.args["prompts"] == decoded and n.args["keep"] == [2 * r, 2 * r + 1] for n in chain)
        assert chain[-1].outputs[:2] == ("responses_p%d" % (2 * r), "responses_p%d" % (2 * r + 1))
        for v in chain[0].inputs:  # each vision encoding the chain reads was made on its own rank
            producer = tp.values[v].producer
            assert producer is None or tp.nodes[producer].meta["rank"] == r, (r, v)
    for p in range(8):  # each prompt's responses come from exactly one chain, on the prompt's rank
        (producer,) = {tp.values[f"responses_p{p}"].producer}
        assert tp.nodes[producer].meta["rank"] == p // 2
    replicas = {n.name for n in tp} - {n.name for n in dp}
    assert all(tp.nodes[n].kind == "vit_encode" for n in replicas) and len(replicas) == 4
    for name in {n.name for n in dp} & {n.name for n in tp}:
        if tp.nodes[name].kind != "decode_chunk":
            assert tp.nodes[name].meta["rank"] == dp.nodes[name].meta["rank"], name
    schedule(tp, "rollplex")  # the scheduler takes the placed graph as it takes a data-parallel one


def test_a_tensor_parallel_rollout_is_checked_by_name():
    with pytest.raises(ConfigError, match="cluster.tp_rollout \\(3\\) must divide cluster.workers \\(4\\)"):
        check_data_parallel(4, 8, 1, "deepspeed", 2, "torch-graph", tp_rollout=3)
    with pytest.raises(ConfigError, match="cluster.tp_rollout=2 needs engines.decode=torch-graph"):
        check_data_parallel(2, 8, 1, "deepspeed", 2, "hf", tp_rollout=2)
    with pytest.raises(ConfigError, match="must divide cluster.workers \\(1\\)"):
        check_data_parallel(1, 8, 1, "deepspeed", 2, "torch-graph", tp_rollout=2)
    with pytest.raises(GraphError, match="tensor-parallel rollout of 3 ranks does not divide 4 ranks"):
        distribute(compiled(ranks=1), 4, tp_rollout=3)


@pytest.mark.parametrize("device, workers, tp, expected", [
    ("cpu", 1, 1, "vllm"), ("cpu", 2, 1, "hf"), ("cpu", 2, 2, "torch-graph"), ("cuda", 1, 1, "torch-graph"),
    ("cuda", 4, 2, "torch-graph")])
def test_the_automatic_decode_engine_is_one_that_serves_the_cluster(device, workers, tp, expected):
    from rollplex.config import RunConfig
    from rollplex.engines.base import get_engine
    from rollplex.pipeline.run.session import resolve_engines

    import rollplex.engines  # noqa: F401

    if expected == "vllm" and not get_engine("vllm").installed():
        expected = "hf"
    cfg = RunConfig()
    cfg.cluster.workers, cfg.cluster.tp_rollout = workers, tp
    assert resolve_engines(cfg, device)[0] == expected
