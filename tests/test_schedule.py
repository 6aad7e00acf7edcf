"""Schedule policies as pure functions, checked by invariants on the compiled GRPO iteration (and a few
hand-built graphs) under two namings and random batch shapes. CPU only, no engines, no model."""
from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollplex.dags.grpo import grpo
from rollplex.errors import GraphError
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
from rollplex.pipeline.compile.ir import IterationGraph, Node
from rollplex.pipeline.plan.schedule import POLICIES, SERIAL_PHASES, schedule

DIMS = ModelDims(hidden=128, layers=2, kv_heads=2, head_dim=32, vocab=600, params=600_000)
ENGINES = EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"})


def grpo_graph(prompts=8, samples=8, max_new_tokens=8, chunk_tokens=4, micro_batch_groups=2,
               prefix_sharing=True) -> IterationGraph:
    shape = BatchShape(prompts=prompts, samples=samples, max_new_tokens=max_new_tokens, chunk_tokens=chunk_tokens,
                       micro_batch_groups=micro_batch_groups, prefix_sharing=prefix_sharing)
    return compile_iteration(grpo, shape, ENGINES, DIMS)


def renamed(g: IterationGraph) -> tuple[IterationGraph, dict[str, str]]:
    """The same graph with every node renamed (names that sort differently) and added in reverse order."""
    new = {n: f"n{len(g) - i:03d}_{n[::-1]}" for i, n in enumerate(g.nodes)}
    out = IterationGraph(g.name)
    out.meta = dict(g.meta)
    for v in g.values.values():
        if v.producer is None:
            out.add_input(v.name, **v.facts())
    for node in reversed(list(g)):
        info = {o: g.values[o] for o in node.outputs}
        out.add(Node(new[node.name], node.kind, node.inputs, node.outputs, node.model, node.engine, node.args,
                     dict(node.meta)), **info)
    out.connect()
    for u, v, data in g.g.edges(data=True):
        if not data["values"]:
            out.add_order(new[u], new[v], data["reason"])
    return out.lint(), new


def snapshot(g: IterationGraph):
    return (str(g), sorted((u, v, d["values"], d["reason"]) for u, v, d in g.g.edges(data=True)),
            {n.name: dict(n.meta) for n in g}, dict(g.meta), list(g.nodes), dict(g.values))


def names_of(g: IterationGraph, *kinds: str) -> list[str]:
    return [n.name for n in g if n.kind in kinds]


def concurrent(g: IterationGraph, a: str, b: str) -> bool:
    """Two nodes may run at the same time iff neither reaches the other."""
    return not nx.has_path(g.g, a, b) and not nx.has_path(g.g, b, a)


# -- invariant checkers --------------------------------------------------------------------------------
def check_common(graph: IterationGraph, planned: IterationGraph, policy: str) -> None:
    assert planned is not graph and planned.meta["policy"] == policy
    assert nx.is_directed_acyclic_graph(planned.g)
    planned.lint()
    assert planned.nodes == graph.nodes  # same fields: a schedule never changes what a node computes
    assert planned.values == graph.values
    for u, v, data in graph.g.edges(data=True):  # every dependency survives ...
        assert planned.g.edges[u, v]["values"] == data["values"]
    for u, v, data in planned.g.edges(data=True):  # ... and anything new is ordering only
        if not graph.g.has_edge(u, v):
            assert data["values"] == () and data["reason"] == "barrier", (u, v, data)
    for node in planned:
        assert node.meta["stream"] == node.kind_info.stream, node.name
        assert isinstance(node.meta["priority"], float), node.name
        for succ in planned.g.successors(node.name):  # critical-path priorities fall along every edge
            assert node.meta["priority"] > planned.nodes[succ].meta["priority"], (node.name, succ)
    decode = [planned.nodes[n].meta["priority"] for n in names_of(planned, "decode_chunk")]
    prefix = [planned.nodes[n].meta["priority"] for n in names_of(planned, "prefix")]
    assert decode and min(decode) >= max(prefix, default=float("-inf"))


def check_serial(planned: IterationGraph) -> None:
    decode = names_of(planned, "decode_chunk")
    later = names_of(planned, "prefix", "suffix_score", "loss")
    for d in decode:
        assert set(later) <= nx.descendants(planned.g, d), f"a barrier is missing after %{d}"
    for p in names_of(planned, "prefix"):
        assert not any(concurrent(planned, p, d) for d in decode), p
    # More generally: every node of a phase precedes every node of the next one. The trained
    # model's forwards (grad) belong to the training phase, right before their backward.
    def phase(node):
        train = node.kind in ("prefix", "suffix_score") and node.args.get("grad")
        return next(i for i, kinds in enumerate(SERIAL_PHASES) if ("loss" if train else node.kind) in kinds)

    phases = [[n.name for n in planned if n.kind in sum(SERIAL_PHASES, ()) and phase(n) == i]
              for i in range(len(SERIAL_PHASES))]
    for before, after in zip(phases, phases[1:]):
        for a in before:
            assert set(after) <= nx.descendants(planned.g, a), a


def check_rollplex(graph: IterationGraph, planned: IterationGraph) -> None:
    assert set(planned.g.edges) == set(graph.g.edges)  # no barriers
    decode = names_of(planned, "decode_chunk")
    early = set(names_of(planned, "prefix", "vit_encode"))
    for d in decode:
        assert not early & nx.descendants(planned.g, d), f"%{d} blocks vision or prefix work"
    first = [d for d in decode if planned.nodes[d].args["chunk"] == 0]
    assert len(first) == 1
    assert set(names_of(planned, "vit_encode")) <= nx.ancestors(planned.g, first[0])
    for p in names_of(planned, "prefix"):  # prefix work fits in the decode window
        assert all(concurrent(planned, p, d) for d in decode), p


def check_policy(graph: IterationGraph, policy: str) -> IterationGraph:
    before = snapshot(graph)
    planned = schedule(graph, policy)
    assert snapshot(graph) == before, "schedule() changed its input"
    check_common(graph, planned, policy)
    check_serial(planned) if policy == "serial" else check_rollplex(graph, planned)
    return planned


# -- tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_invariants_on_compiled_grpo(policy):
    check_policy(grpo_graph(), policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_two_namings_give_the_same_schedule(policy):
    graph = grpo_graph(prompts=5, max_new_tokens=9, chunk_tokens=2, micro_batch_groups=2)
    other, new = renamed(graph)
    assert sorted(new.values()) != sorted(new)  # really different names ...
    assert list(other.nodes) != [new[n] for n in graph.nodes]  # ... and a different insertion order
    a, b = check_policy(graph, policy), check_policy(other, policy)
    assert {new[n.name]: n.meta for n in a} == {n.name: n.meta for n in b}
    assert {(new[u], new[v]) for u, v in a.g.edges} == set(b.g.edges)


def test_serial_adds_barriers_rollplex_does_not():
    graph = grpo_graph()
    serial, overlap = schedule(graph, "serial"), schedule(graph, "rollplex")
    barriers = {(u, v) for u, v, d in serial.g.edges(data=True) if d["reason"] == "barrier"}
    assert barriers and all(u in names_of(graph, "decode_chunk") for u, v in barriers
                            if graph.nodes[v].kind == "prefix" and not graph.nodes[v].args["grad"])
    assert not any(d["reason"] == "barrier" for _, _, d in overlap.g.edges(data=True))
    # In rollplex, every prefix can start before the last decode chunk ends; in serial none can.
    last = max(names_of(graph, "decode_chunk"), key=lambda n: graph.nodes[n].args["chunk"])
    assert all(nx.has_path(serial.g, last, p) for p in names_of(graph, "prefix"))
    assert not any(nx.has_path(overlap.g, last, p) for p in names_of(graph, "prefix"))


def test_the_schedule_is_a_copy_whose_meta_does_not_leak_back():
    graph = grpo_graph(prompts=2)
    before = snapshot(graph)
    for policy in POLICIES:
        planned = schedule(graph, policy)
        for node in planned:
            node.meta["stream"] = "elsewhere"
        planned.meta["touched"] = True
        planned.add_order("report", "vit_p0", reason="barrier")  # even a cycle in the copy stays there
    assert snapshot(graph) == before


def test_rescheduling_a_schedule_changes_nothing_more():
    graph = grpo_graph(prompts=3)
    once = schedule(graph, "serial")
    twice = schedule(once, "serial")
    assert snapshot(once) == snapshot(twice)


def test_unknown_policy_names_the_choices():
    with pytest.raises(GraphError, match=r"unknown schedule policy 'overlap'; choose one of serial, rollplex"):
        schedule(grpo_graph(prompts=1), "overlap")


@pytest.mark.parametrize("policy", POLICIES)
def test_offload_and_prefetch_between_phases_do_not_make_a_cycle(policy):
    """A memory planner parks a prefix's KV in host memory until its suffix runs. Offload and prefetch
    belong to no serial phase; they are ordered by their data only.

        (prompt) -> vit -> decode ----------------.
                      \\                           v
                       prefix -> offload -> prefetch -> suffix -> loss
    """
    g = IterationGraph("parked")
    g.add_input("prompt")
    g.add(Node("vit", "vit_encode", ("prompt",), ("vis",)))
    g.add(Node("decode", "decode_chunk", ("vis",), ("resp",), args={"chunk": 0}))
    g.add(Node("prefix", "prefix", ("vis",), ("kv",)))
    g.add(Node("offload", "offload", ("kv",), ("kv_host",)))
    g.add(Node("prefetch", "prefetch", ("kv_host",), ("kv_back",)))
    g.add(Node("suffix", "suffix_score", ("kv_back", "resp"), ("lp",)))
    g.add(Node("loss", "loss", ("lp",), ("l",)))
    planned = check_policy(g.connect().lint(), policy)
    if policy == "serial":
        assert not concurrent(planned, "prefix", "decode")


def test_a_cyclic_input_is_reported_with_its_cycle():
    """a -x-> b -y-> a"""
    g = IterationGraph()
    g.add(Node("a", "prefix", ("y",), ("x",)))
    g.add(Node("b", "suffix_score", ("x",), ("y",)))
    g.connect()
    for policy in POLICIES:
        with pytest.raises(GraphError, match=r"cycle: %a -> %b -> %a|cycle: %b -> %a -> %b"):
            schedule(g, policy)


@settings(max_examples=25, deadline=None)
@given(prompts=st.integers(1, 6), samples=st.integers(1, 4), max_new_tokens=st.integers(1, 12),
       chunk_tokens=st.integers(1, 12), micro=st.integers(1, 6), prefix_sharing=st.booleans(),
       policy=st.sampled_from(POLICIES))
def test_invariants_hold_for_random_batch_shapes(prompts, samples, max_new_tokens, chunk_tokens, micro,
                                                 prefix_sharing, policy):
    graph = grpo_graph(prompts, samples, max_new_tokens, chunk_tokens, micro, prefix_sharing)
    planned = check_policy(graph, policy)
    other, new = renamed(graph)
    assert {new[n.name]: n.meta for n in planned} == {n.name: n.meta for n in schedule(other, policy)}


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_grad_prefix_lookahead_bounds_the_policy_prefixes_ahead_of_training(lookahead):
    """With lookahead k, the policy's prefix of micro-batch m (m ≥ k) follows the loss of m − k, so at
    most k micro-batches of its graphs wait beside the one training; frozen prefixes stay free to
    run in the decode window, and the rollplex schedule stays acyclic. k = 0 adds nothing."""
    shape = BatchShape(prompts=8, samples=2, max_new_tokens=8, chunk_tokens=4, micro_batch_groups=2,
                       prompts_per_node=2, grad_prefix_lookahead=lookahead)
    g = schedule(compile_iteration(grpo, shape, ENGINES, DIMS), "rollplex")
    losses = [n.name for n in g if n.kind == "loss"]
    assert len(losses) == 4
    for node in g:
        if node.kind != "prefix":
            continue
        ancestors = nx.ancestors(g.g, node.name)
        m = node.args["prompts"][0] // 2
        if node.args.get("grad"):
            after = set(losses[:m - lookahead + 1]) if lookahead and m >= lookahead else set()
            assert {l for l in losses if l in ancestors} == after, node.name
        else:
            assert not any(l in ancestors for l in losses), node.name
    assert nx.is_directed_acyclic_graph(g.g)
