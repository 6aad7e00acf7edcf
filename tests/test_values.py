"""Values that say what they are, and graphs that know who reads them (pipeline/compile/ir.py).

Invariants on compiled iterations and hand-built ones: the users index equals a scan of the nodes
after every kind of change the code makes; a value's facts survive pickling, copying and the rank
split; and compile + distribute + schedule + plan give the same result under another naming of every
value and node, so no pass learns what a value is from its name. CPU only, no engines."""
from __future__ import annotations

from dataclasses import replace

import pickle
from concurrent.futures import Future

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollplex.dags.grpo import grpo
from rollplex.dags.ppo import ppo
from rollplex.engines.modelspec import load_model
from rollplex.errors import GraphError
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
from rollplex.pipeline.compile.ir import IterationGraph, Node, Value
from rollplex.pipeline.compile.ranks import distribute
from rollplex.pipeline.plan import footprint
from rollplex.pipeline.plan.costs import CostModel, Workload
from rollplex.pipeline.plan.hardware import Layout, hardware
from rollplex.pipeline.plan.memory import Resident, plan_memory
from rollplex.pipeline.plan.schedule import copy_graph, plan, schedule
from rollplex.pipeline.run.algorithms import load_algorithm
from rollplex.pipeline.run.local import LocalExecutor
from rollplex.pipeline.run.tables import run_tables
from test_memory_planner import chain  # a prefix's KV made first and read last, decode's pool between

DIMS = ModelDims(128, 2, 2, 32, 1000, 10**6)
ENGINES = EngineChoice({"decode": "hf", "train": "torch", "score": "transformers"})
GiB = 1024**3


def compiled(alg=grpo, prompts=8, **kw) -> IterationGraph:
    base = dict(prompts=prompts, samples=2, max_new_tokens=8, chunk_tokens=2, micro_batch_groups=2)
    return compile_iteration(alg, BatchShape(**{**base, **kw}), ENGINES, DIMS)


def check_users(g: IterationGraph) -> None:
    """The users index, lifetimes and the cached topological order against scans of the graph."""
    scanned: dict[str, list[str]] = {}
    for node in g:
        for v in node.inputs:
            scanned.setdefault(v, []).append(node.name)
    for v in set(scanned) | set(g.values):
        assert g.consumers(v) == tuple(scanned.get(v, ())), v
        assert g.uses(v) == len(scanned.get(v, ())), v
    index = {n: i for i, n in enumerate(g.nodes)}
    order = list(nx.lexicographical_topological_sort(g.g, key=index.__getitem__))
    assert g.topological_order() == order
    position = {n: i for i, n in enumerate(order)}
    for v in g.values.values():
        users = scanned.get(v.name, [])
        first = v.producer or (min(users, key=position.__getitem__) if users else "")
        assert g.lifetimes()[v.name] == (first, max(users, key=position.__getitem__) if users else first)


# -- the users index under every change the code makes -------------------------------------------------
@pytest.mark.parametrize("alg, kw", [(grpo, {}), (grpo, dict(stage_fusion=True)),
                                     (grpo, dict(stage_fusion=True, train_fusion=True)), (ppo, {}),
                                     (grpo, dict(prefix_sharing=False)), ("dags/examples/reward_model.py", {})])
def test_the_users_index_is_a_scan_after_compile_copy_schedule_and_the_rank_split(alg, kw):
    g = compiled(load_algorithm(alg) if isinstance(alg, str) else alg, **kw)
    check_users(g)
    check_users(copy_graph(g))
    for policy in ("serial", "rollplex"):
        check_users(schedule(g, policy))
    for ranks, tp in ((2, 1), (4, 2)):
        check_users(distribute(g, ranks, tp))
    back = pickle.loads(pickle.dumps(g))  # the index is rebuilt, not shipped
    check_users(back)
    assert str(back) == str(g) and dict(back.values) == dict(g.values)


def test_the_users_index_follows_stage_fusion_footprints_cache_hits_and_residency():
    """The plan's copy of a stage-fused graph, the footprint's rebuild, reference prefixes served from
    the cache (their inputs change) and the memory plan's offload/prefetch nodes (consumers moved to
    the prefetched copy)."""
    cluster, layout, cm, shape = planned_7b()
    g = footprint.annotate(compile_iteration(grpo, shape, ENGINES, DIMS), cm)
    check_users(g)
    check_users(copy_graph(g))
    check_users(footprint.copy_with_cache_hits(g, cm, lambda p: p % 2 == 0))
    p = plan(g, cluster, cm, "rollplex", layout)
    check_users(p.graph)
    mp = plan_memory(chain(), [Resident("pool", (0,), 20 * GiB, (("decode", "write"),))], budget=25 * GiB)
    assert "kv@dev0" in mp.plan.graph.values
    check_users(mp.plan.graph)


def planned_7b(**shape_fields):
    """Two H200s, the 7B preset, 8 prompts × 4 samples of up to 128 tokens, stage fusion on: (cluster,
    layout, cost model, batch shape)."""
    cluster = hardware("h200", 2)
    layout = Layout.colocate(cluster)
    w = Workload(prompts=8, samples=4, max_new_tokens=128, chunk_tokens=32, response="uniform:8:128",
                 actor_forward="keep")
    shape = BatchShape(prompts=8, samples=4, max_new_tokens=128, chunk_tokens=32, micro_batch_groups=2,
                       prompt_tokens=w.prefix_tokens, vision_tokens=w.vision_total, stage_fusion=True, **shape_fields)
    return cluster, layout, CostModel(load_model("qwen2.5-vl-7b"), cluster, w, layout), shape


@st.composite
def edits(draw):
    """A random DAG of n nodes (node i reads values of nodes before it), then edits: a node
    replaced with other inputs, an ordering edge added or removed."""
    n = draw(st.integers(2, 10))
    reads = [draw(st.sets(st.integers(0, i - 1), max_size=3)) if i else set() for i in range(n)]
    steps = draw(st.lists(st.tuples(st.sampled_from(["replace", "order", "unorder"]), st.integers(0, n - 1),
                                    st.sets(st.integers(0, n - 1), max_size=3)), max_size=8))
    return n, reads, steps


@settings(max_examples=60, deadline=None)
@given(edits())
def test_the_users_index_is_a_scan_after_random_replacements_and_order_edges(case):
    n, reads, steps = case
    g = IterationGraph("edits")
    g.add_input("x")
    for i in range(n):
        g.add(Node(f"n{i}", "custom", tuple(f"v{j}" for j in sorted(reads[i])) + ("x",), (f"v{i}",)))
    g.connect()
    check_users(g)
    for what, i, others in steps:
        node = g.nodes[f"n{i}"]
        if what == "replace":  # reads only values of earlier nodes: the graph stays acyclic
            inputs = tuple(f"v{j}" for j in sorted(others) if j < i) + ("x",)
            g.replace_node(Node(node.name, node.kind, inputs, node.outputs))
            for u in list(g.g.predecessors(node.name)):
                if g.g.edges[u, node.name]["reason"] == "value":
                    g.remove_edge(u, node.name)
            g.connect()
        elif what == "order":
            for j in others:
                if j < i:
                    g.add_order(f"n{j}", node.name)
        else:
            for u in [u for u in g.g.predecessors(node.name) if not g.g.edges[u, node.name]["values"]]:
                g.remove_edge(u, node.name)
        check_users(g.lint())


def test_nodes_and_values_change_only_through_the_graph():
    g = compiled()
    with pytest.raises(TypeError):
        g.nodes["report"] = g.nodes["report"]  # type: ignore[index]
    with pytest.raises(TypeError):
        g.values["report"] = g.values["report"]  # type: ignore[index]
    with pytest.raises(GraphError, match="no node %nope"):
        g.replace_node(Node("nope", "report"))
    with pytest.raises(GraphError, match="role 'kv_cache' is not one of"):
        Value("x", None, role="kv_cache")


def test_tables_are_built_once_per_version_of_the_graph():
    g = schedule(compiled(stage_fusion=True), "rollplex")
    first = run_tables(g)
    assert run_tables(g) is first and first.uses == {v: g.uses(v) for v in g.values}
    g.add_order("vit_p0", "report")
    assert run_tables(g) is not first and run_tables(g).in_degree["report"] == first.in_degree["report"] + 1


class NullHost:
    name = "null"

    def submit(self, stream, fn, host, node, iteration, inputs, values):
        done = Future()
        done.set_result(dict.fromkeys(node.outputs, node.name))
        return done

    def drain(self):
        return {"events": [], "peak_memory_bytes": 0, "alloc_retries": 0}


def test_the_local_executor_runs_every_node_once_its_inputs_are_there():
    g = schedule(distribute(compiled(stage_fusion=True), 2), "rollplex")
    result = LocalExecutor([NullHost(), NullHost()]).run(g, 0, g.feed([object()] * 8))
    assert result.output == {"report": "report"}  # the sink's outputs


# -- facts ---------------------------------------------------------------------------------------------
def test_every_compiled_value_says_what_it_is():
    g = compiled(stage_fusion=True, window_chunks=2)
    P = 8
    for v in g.values.values():
        assert v.role != "tensor", v
        if v.role in ("prompt", "vision", "kv", "responses", "rewards"):
            assert len(v.prompts) == 1, v
        if v.role in ("decode_state", "handoff", "finished"):
            assert v.chunk is not None and v.prompts == tuple(range(P)), v
    by = lambda **facts: sorted(v.name for v in g.values.values()  # noqa: E731
                                if all(getattr(v, k) == x for k, x in facts.items()))
    assert by(role="score", label="ref_logprobs", prompts=(3,)) == ["ref_logprobs_p3"]
    assert by(role="score", label="old_logprobs", prompts=(3,)) == ["old_logprobs_p3"]
    assert by(role="kv", model="ref", prompts=(3,)) == ["prefix_ref_p3"]
    assert g.feed(list("abcdefgh")) == {f"prompt_p{p}": "abcdefgh"[p] for p in range(P)}


@pytest.mark.parametrize("ranks, tp", [(2, 1), (4, 2)])
@pytest.mark.parametrize("kw", [dict(stage_fusion=True), dict(stage_fusion=True, train_fusion=True)])
def test_the_rank_split_keeps_each_values_facts_and_says_its_rank(ranks, tp, kw):
    single = compiled(**kw)
    g = distribute(single, ranks, tp)
    per_rank = 8 // ranks
    for v in g.values.values():
        if v.producer is not None:
            assert v.rank == g.nodes[v.producer].meta["rank"], v
        elif v.role == "prompt":
            assert v.rank == v.prompts[0] // per_rank, v
        if v.name in single.values:  # kept under its name: the same facts on its rank
            assert v.facts() == {**single.values[v.name].facts(), "rank": v.rank}, v
    for v in g.values.values():  # a rank's copy of a hand-off or a chunk's score covers its prompts
        if v.role in ("handoff", "finished") or (v.role == "score" and v.chunk is not None):
            assert v.prompts == tuple(range(v.rank * per_rank, (v.rank + 1) * per_rank)), v
    assert pickle.loads(pickle.dumps(g)).values == g.values


# -- the same plan under another naming ------------------------------------------------------------------
def renamed(g: IterationGraph) -> IterationGraph:
    """``g`` with every value and node under a new name that reads and sorts differently, in the same
    insertion order; value names inside args (a function's binding) follow."""
    n = len(g.values)
    value = {v: f"w{n - i:05d}" for i, v in enumerate(g.values)}
    node = {name: f"op{len(g) - i}_{name[::-1]}" for i, name in enumerate(g.nodes)}
    out = IterationGraph(g.name)
    out.meta = dict(g.meta)
    for v in g.values.values():
        if v.producer is None:
            out.add_input(value[v.name], **v.facts())
    for x in g:
        args = dict(x.args)
        if "bind" in args:
            args["bind"] = {k: [(value[v], group) for v, group in pairs] for k, pairs in args["bind"].items()}
        out.add(Node(node[x.name], x.kind, tuple(value[v] for v in x.inputs), tuple(value[v] for v in x.outputs),
                     x.model, x.engine, args, dict(x.meta)), **{value[o]: g.values[o] for o in x.outputs})
    out.connect()
    for u, v, data in g.g.edges(data=True):
        if not data["values"]:
            out.add_order(node[u], node[v], data["reason"])
    return out.lint()


def shape_of(g: IterationGraph) -> tuple:
    """The graph without names: each node as what it is, reads and makes (value facts), and where and
    when a pass put it; edges as pairs of those; the graph's meta."""
    def record(v: str) -> tuple:
        return tuple(g.values[v].facts().values())

    def of(name: str) -> str:
        x = g.nodes[name]
        args = dict(x.args)
        if "bind" in args:
            args["bind"] = {k: [(record(v), group) for v, group in pairs] for k, pairs in args["bind"].items()}
        meta = {k: x.meta[k] for k in ("rank", "placement", "stream", "priority", "lane", "gpus", "start", "finish")
                if k in x.meta}
        return repr((x.kind, x.model, x.engine, sorted(args.items()), sorted(meta.items()),
                     [record(v) for v in x.inputs], [record(v) for v in x.outputs]))

    nodes = sorted(of(n) for n in g.nodes)
    edges = sorted((of(u), of(v), d["reason"], sorted(record(x) for x in d["values"]))
                   for u, v, d in g.g.edges(data=True))
    return nodes, edges, {k: repr(v) for k, v in g.meta.items()}


@pytest.mark.parametrize("alg, kw, ranks, tp", [
    (grpo, {}, 2, 1), (grpo, dict(stage_fusion=True), 2, 1), (grpo, dict(stage_fusion=True, window_chunks=2), 4, 2),
    (grpo, dict(stage_fusion=True, train_fusion=True), 2, 1), (ppo, dict(prompts_per_node=2), 2, 1),
    ("dags/examples/reward_model.py", dict(stage_fusion=True), 2, 1)])
@pytest.mark.parametrize("policy", ["serial", "rollplex"])
def test_compile_distribute_and_schedule_give_the_same_graph_under_another_naming(alg, kw, ranks, tp, policy):
    g = compiled(load_algorithm(alg) if isinstance(alg, str) else alg, **kw)
    plain = schedule(distribute(g, ranks, tp), policy)
    other = schedule(distribute(renamed(g), ranks, tp), policy)
    assert shape_of(other) == shape_of(plain)


@pytest.mark.parametrize("train_fusion", [False, True])
def test_plans_are_the_same_under_another_naming(train_fusion):
    """The plan reads a node's costs and the values it hands on from facts and args: a stage-fused
    graph's per-chunk scoring (or, with train fusion, training) is priced the same under any names."""
    cluster, layout, cm, shape = planned_7b(train_fusion=train_fusion)
    fused = footprint.annotate(compile_iteration(grpo, shape, ENGINES, DIMS), cm)
    unfused = footprint.annotate(compile_iteration(grpo, replace(shape, stage_fusion=False), ENGINES, DIMS), cm)
    for policy, g in [("rollplex", fused)] + ([] if train_fusion else [("serial", unfused)]):
        plans = [plan(x, cluster, cm, policy, layout) for x in (g, renamed(g))]
        assert plans[0].makespan == plans[1].makespan
        assert shape_of(plans[1].graph) == shape_of(plans[0].graph)
