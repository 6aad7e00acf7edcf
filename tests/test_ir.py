"""The iteration IR on hand-built tiny graphs: lint errors, the kind registry, pickling, lifetimes,
deterministic order and printing. CPU only, no engines."""
from __future__ import annotations

import pickle
import re

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollplex.errors import GraphError
from rollplex.pipeline.compile import ir
from rollplex.pipeline.compile.ir import IterationGraph, Node, NodeKind, get_kind, register_kind, registered_kinds


def diamond(names: dict[str, str] | None = None) -> IterationGraph:
    """A diamond fed by one graph input; ``names`` renames the nodes (values keep their names).

                 (prompt)            graph input
                /        \\
              a           |          a: x = vit_encode(prompt)
             / \\          |
        x  /     \\  x     |
          b       c <-----/          b: y = prefix(x)   c: z = decode_chunk(x, prompt)
           \\     /
          y \\   / z
              d                      d: loss(y, z)
    """
    n = {k: k for k in "abcd"} | dict(names or {})
    g = IterationGraph("diamond")
    g.add_input("prompt", nbytes=10)
    g.add(Node(n["a"], "vit_encode", ("prompt",), ("x",), "ref", "hf"), x=dict(nbytes=2048, role="vision"))
    g.add(Node(n["b"], "prefix", ("x",), ("y",), "ref", "hf"), y=dict(nbytes=3 << 20, role="kv"))
    g.add(Node(n["c"], "decode_chunk", ("x", "prompt"), ("z",), "actor", "vllm"), z=dict(nbytes=64))
    g.add(Node(n["d"], "loss", ("y", "z"), ("l",), "actor", "deepspeed"), l=dict(nbytes=4))
    return g.connect().lint()


CYCLE = re.compile(r"cycle: (%[\w.\-]+(?: -> %[\w.\-]+)+)")


def cycle_path(message: str) -> list[str]:
    """The node names of the cycle that a lint message spells out as ``%a -> %b -> %a``."""
    found = CYCLE.search(message)
    assert found, f"no cycle path in: {message}"
    return [part.strip().lstrip("%") for part in found.group(1).split("->")]


def assert_is_cycle_of(g: IterationGraph, path: list[str]) -> None:
    assert path[0] == path[-1], path
    for u, v in zip(path, path[1:]):
        assert g.g.has_edge(u, v), f"the error names {u} -> {v}, which is no edge"


# -- lint ------------------------------------------------------------------------------------------
def test_diamond_lints_clean_and_connects_the_value_edges():
    g = diamond()
    assert g.lint() is g
    assert {(u, v): d["values"] for u, v, d in g.g.edges(data=True)} == {
        ("a", "b"): ("x",), ("a", "c"): ("x",), ("b", "d"): ("y",), ("c", "d"): ("z",)}
    assert g.inputs == ["prompt"]


def test_cycle_error_spells_out_the_cycle_node_by_node():
    """a -> b -> c -> a through values; d hangs off the side and is not on the cycle.

        a --x--> b --y--> c --z--> d
        ^                 |
        '-------w---------'
    """
    g = IterationGraph()
    g.add(Node("a", "prefix", ("w",), ("x",)))
    g.add(Node("b", "suffix_score", ("x",), ("y",)))
    g.add(Node("c", "loss", ("y",), ("z", "w")))
    g.add(Node("d", "report", ("z",), ()))
    g.connect()
    with pytest.raises(GraphError, match="cycle") as err:
        g.lint()
    path = cycle_path(str(err.value))
    assert set(path) == {"a", "b", "c"}
    assert_is_cycle_of(g, path)
    # Printing or ordering a cyclic graph reports the same GraphError, not a networkx exception.
    with pytest.raises(GraphError, match="cycle"):
        g.topological_order()
    with pytest.raises(GraphError, match="cycle"):
        str(g)


def test_a_node_reading_its_own_output_is_a_cycle_of_one():
    """a --x--> a"""
    g = IterationGraph()
    g.add(Node("a", "advantage", ("x",), ("x",)))
    with pytest.raises(GraphError) as err:
        g.connect().lint()
    assert cycle_path(str(err.value)) == ["a", "a"]


def test_ordering_edges_can_close_a_cycle_too():
    """a --x--> b, and a barrier b ..> a."""
    g = IterationGraph()
    g.add(Node("a", "decode_chunk", (), ("x",)))
    g.add(Node("b", "prefix", ("x",), ()))
    g.connect().add_order("b", "a", reason="barrier")
    with pytest.raises(GraphError) as err:
        g.lint()
    assert_is_cycle_of(g, cycle_path(str(err.value)))


def test_dangling_input_names_the_node_and_the_value():
    """(prompt) -> a -x-> b <- ghost (nothing produces it)"""
    g = IterationGraph()
    g.add_input("prompt")
    g.add(Node("a", "vit_encode", ("prompt",), ("x",)))
    g.add(Node("b", "prefix", ("x", "ghost"), ("kv",)))
    with pytest.raises(GraphError, match=r"%b reads value 'ghost', which no node produces") as err:
        g.connect().lint()
    assert "x" in str(err.value) and "prompt" in str(err.value)  # lists known values as a hint


def test_nodes_added_after_connect_are_caught_by_lint():
    """a -x-> b, but b was added after connect(): the edge is missing, so the order would be wrong."""
    g = IterationGraph()
    g.add(Node("a", "prefix", (), ("x",)))
    g.connect()
    g.add(Node("b", "suffix_score", ("x",), ()))
    with pytest.raises(GraphError, match=r"%b reads 'x' from %a.*connect\(\)"):
        g.lint()
    g.connect().lint()


def test_duplicate_node_name_is_refused_with_its_name():
    g = IterationGraph()
    g.add(Node("twin", "reward", (), ("r1",)))
    with pytest.raises(GraphError, match=r"duplicate node name %twin"):
        g.add(Node("twin", "advantage", (), ("r2",)))
    assert list(g.nodes) == ["twin"] and g.nodes["twin"].kind == "reward"


def test_two_producers_of_one_value_are_named():
    g = IterationGraph()
    g.add(Node("first", "reward", (), ("r",)))
    with pytest.raises(GraphError, match=r"'r' is produced by both %first and %second"):
        g.add(Node("second", "reward", (), ("r",)))
    with pytest.raises(GraphError, match="graph input 'r'"):
        g.add_input("r")


def test_unknown_kind_lists_the_registered_kinds():
    with pytest.raises(GraphError, match="unknown node kind 'prefx'") as err:
        Node("p0", "prefx")
    for name in registered_kinds():
        assert name in str(err.value)


def test_lint_names_the_node_whose_kind_is_unknown():
    """A kind can go missing after construction (e.g. a plugin kind in another process); lint names
    the node that has it."""
    g = IterationGraph()
    node = g.add(Node("odd", "reward", (), ()))
    object.__setattr__(node, "kind", "plugin_kind")
    with pytest.raises(GraphError, match=r"%odd: unknown node kind 'plugin_kind'; registered kinds: .*prefix"):
        g.connect().lint()


@pytest.mark.parametrize("name", ["", "a b", "x\ny", "%p", "a/b", "décode:1"])
def test_bad_node_names_are_refused(name):
    with pytest.raises(GraphError, match="node name"):
        Node(name, "reward")


@pytest.mark.parametrize("name", ["a", "prefix_ref_p3", "x-1.2", "_", "__", "Δt"])
def test_good_node_names_are_accepted(name):
    assert Node(name, "reward").name == name


def test_ordering_edge_to_an_unknown_node_is_named():
    g = diamond()
    with pytest.raises(GraphError, match="%nowhere"):
        g.add_order("a", "nowhere")


# -- the kind registry -----------------------------------------------------------------------------
@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations in a test never leak into the process-wide registry."""
    monkeypatch.setattr(ir, "_KINDS", dict(ir._KINDS))
    return ir._KINDS


def test_register_kind_refuses_duplicates_and_keeps_the_builtin(scratch_registry):
    builtin = get_kind("prefix")
    with pytest.raises(GraphError, match="'prefix' is registered already"):
        register_kind(NodeKind("prefix", "train", "decode", "train", "an impostor"))
    assert get_kind("prefix") is builtin and builtin.role == "score"

    mine = register_kind(NodeKind("critic_value", "score", "compute", "score", "value head"))
    assert registered_kinds()["critic_value"] is mine
    assert Node("v0", "critic_value").kind_info is mine
    with pytest.raises(GraphError, match="'critic_value' is registered already"):
        register_kind(NodeKind("critic_value", "score", "compute", "score"))


def test_register_kind_refuses_an_unknown_phase(scratch_registry):
    with pytest.raises(GraphError, match=r"phase 'warmup' is not one of"):
        register_kind(NodeKind("warm", None, "compute", "warmup"))
    assert "warm" not in registered_kinds()


def test_registry_view_is_read_only():
    with pytest.raises(TypeError):
        registered_kinds()["x"] = NodeKind("x", None, "compute", "sync")  # type: ignore[index]


# -- nodes -------------------------------------------------------------------------------------------
def test_node_pickles_and_unpickles_equal_with_args_and_meta():
    node = Node("prefix_ref_p3", "prefix", ("prompt_p3", "vis_p3"), ("kv",), "ref", "transformers",
                {"prompt": 3, "grad": False}, {"stream": "compute", "priority": 10.1})
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(node, protocol=protocol))
        assert back == node
        assert back.meta == node.meta and back.meta is not node.meta
        assert dict(back.args) == {"prompt": 3, "grad": False}
        assert back.stream == "compute"
        with pytest.raises(TypeError):
            back.args["prompt"] = 4  # args stay read-only after the round trip


def test_node_is_frozen_and_meta_is_not_part_of_equality():
    a = Node("n", "reward", args={"p": 1})
    with pytest.raises(AttributeError):
        a.name = "m"  # type: ignore[misc]
    b = Node("n", "reward", args={"p": 1}, meta={"stream": "decode"})
    assert a == b and b.stream == "decode" and a.stream == "host"


# -- lifetimes -------------------------------------------------------------------------------------
def test_lifetimes_on_the_diamond():
    """See ``diamond``: x is read by b and c, y and z by d; the input by a and c."""
    g = diamond()
    assert g.topological_order() == ["a", "b", "c", "d"]
    assert g.lifetimes() == {
        "prompt": ("a", "c"),  # a graph input lives from its first to its last reader
        "x": ("a", "c"),
        "y": ("b", "d"),
        "z": ("c", "d"),
        "l": ("d", "d"),  # nobody reads the loss: it dies where it is made
    }


def test_lifetimes_follow_the_given_order():
    g = diamond()
    life = g.lifetimes(["a", "c", "b", "d"])
    assert life["x"] == ("a", "b") and life["prompt"] == ("a", "c")


# -- order -----------------------------------------------------------------------------------------
def test_topological_order_ties_follow_insertion_not_names():
    """Same diamond, names that sort the other way round: the order of positions is the same."""
    plain = diamond()
    names = {"a": "zz_a", "b": "yy_b", "c": "aa_c", "d": "00_d"}
    renamed = diamond(names)
    position = {name: i for i, name in enumerate("abcd")}
    back = {v: k for k, v in names.items()}
    assert [position[n] for n in plain.topological_order()] == [position[back[n]] for n in renamed.topological_order()]
    assert renamed.topological_order() == ["zz_a", "yy_b", "aa_c", "00_d"]


# -- printing --------------------------------------------------------------------------------------
def test_printing_is_one_line_per_node():
    g = diamond()
    g.nodes["c"].meta.update(stream="decode", placement="gpu0")
    lines = str(g).splitlines()
    assert lines[0] == "# diamond: 4 nodes, 5 values"
    assert len(lines) == 1 + len(g)
    by_node = {line.split(" : ")[0]: line for line in lines[1:]}
    assert set(by_node) == {"%a", "%b", "%c", "%d"}
    assert by_node["%a"] == "%a : compute live→%c 2.0KiB = vit_encode[model=ref] @hf(%prompt)"
    assert by_node["%b"] == "%b : compute live→%d 3.0MiB = prefix[model=ref] @hf(%x)"
    assert by_node["%c"] == "%c : gpu0/decode live→%d 64B = decode_chunk[model=actor] @vllm(%x, %prompt)"
    assert "= loss[model=actor] @deepspeed(%y, %z)" in by_node["%d"]
    assert g.tabular().splitlines() == lines[1:]


def test_a_node_without_model_or_engine_prints_neither():
    g = IterationGraph("host")
    g.add(Node("r", "reward", (), ("rw",)), rw=dict(nbytes=32))
    assert g.tabular() == "%r : host live→%r 32B = reward()"


# -- hypothesis: random DAGs under two namings -----------------------------------------------------
KINDS = sorted(ir._KINDS)


@st.composite
def random_dags(draw, min_nodes=1):
    n = draw(st.integers(min_nodes, 12))
    edges = draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda e: e[0] < e[1]),
                         max_size=3 * n))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
    names = draw(st.lists(st.from_regex(r"[A-Za-z0-9_.\-]{1,8}", fullmatch=True), min_size=n, max_size=n,
                          unique=True))
    return n, sorted(edges), kinds, names


def build(n, edges, kinds, names, back_edge=None, order_edge=False) -> IterationGraph:
    """Node i outputs v{i} and reads v{j} for every edge j -> i; ``back_edge`` (j, i) makes i read v{j}
    (or, with ``order_edge``, adds an ordering edge j -> i) with i <= j."""
    reads = {i: [f"v{u}" for u, v in edges if v == i] for i in range(n)}
    if back_edge is not None and not order_edge:
        reads[back_edge[1]].append(f"v{back_edge[0]}")
    g = IterationGraph("random")
    for i in range(n):
        g.add(Node(names[i], kinds[i], tuple(reads[i]), (f"v{i}",)))
    g.connect()
    if back_edge is not None and order_edge:
        g.add_order(names[back_edge[0]], names[back_edge[1]])
    return g


@settings(max_examples=60, deadline=None)
@given(random_dags(), st.data())
def test_random_dags_lint_clean_and_order_the_same_under_two_namings(dag, data):
    n, edges, kinds, names = dag
    other = data.draw(st.permutations(names))  # the same names, dealt out differently
    first = build(n, edges, kinds, names).lint()
    second = build(n, edges, kinds, [f"q{x}" for x in other]).lint()
    pos1 = {name: i for i, name in enumerate(names)}
    pos2 = {f"q{x}": i for i, x in enumerate(other)}
    order1 = [pos1[x] for x in first.topological_order()]
    order2 = [pos2[x] for x in second.topological_order()]
    assert order1 == order2
    assert sorted(order1) == list(range(n))
    assert all(order1.index(u) < order1.index(v) for u, v in edges)
    assert first.lifetimes().keys() == {f"v{i}" for i in range(n)}
    assert len(str(first).splitlines()) == n + 1


@settings(max_examples=60, deadline=None)
@given(random_dags(min_nodes=2), st.data(), st.booleans())
def test_an_injected_back_edge_always_raises_naming_the_cycle(dag, data, order_edge):
    n, edges, kinds, names = dag
    reach = nx.DiGraph(edges)
    reach.add_nodes_from(range(n))
    # j -> i closes a cycle whenever i reaches j (i == j: a node reading its own output).
    candidates = [(j, i) for i in range(n) for j in range(i, n) if i == j or nx.has_path(reach, i, j)]
    if order_edge:
        candidates = [(j, i) for j, i in candidates if i != j]  # add_order ignores a self-edge
    back = data.draw(st.sampled_from(candidates)) if candidates else (0, 0)
    if not candidates:  # only with order_edge and no path: use a value self-loop instead
        order_edge = False
    g = build(n, edges, kinds, names, back_edge=back, order_edge=order_edge)
    with pytest.raises(GraphError) as err:
        g.lint()
    path = cycle_path(str(err.value))
    assert set(path) <= set(names)
    assert_is_cycle_of(g, path)  # every node it names is on a cycle, spelled out edge by edge
