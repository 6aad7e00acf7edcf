"""Rendering an iteration graph as JSON, DOT, SVG and HTML; the layered layout behind the SVG. CPU only."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import networkx as nx
import pytest

from rollplex.dags.grpo import grpo
from rollplex.errors import ConfigError
from rollplex.pipeline.compile import render as R
from rollplex.pipeline.compile import svg as S
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
from rollplex.pipeline.compile.ir import IterationGraph, Node, format_bytes
from rollplex.pipeline.compile.layout import layered_layout, longest_path_layers

SVG = "{http://www.w3.org/2000/svg}"


def tiny_graph() -> IterationGraph:
    """Seven nodes, five layers, one ordering-only edge; a scheduler has filled in some meta.

                 (prompt)                 graph input: a value, not a node
                    |
                   vit
                  /    \\
            prefix      decode            decode: gpu0/decode, 0.0–0.5s
                 \\     /      \\
                 suffix       reward
                     \\       /
                        loss
                         :                ordering only ("barrier"), dashed
                        sync
    """
    g = IterationGraph("tiny")
    g.add_input("prompt", nbytes=100)
    dev = lambda n, role="tensor": dict(nbytes=n, device="device", role=role)  # noqa: E731
    g.add(Node("vit", "vit_encode", ("prompt",), ("vis",), "ref", "hf", {"prompt": 0},
               {"stream": "compute", "placement": "gpu0", "start": 0.0, "finish": 0.1}), vis=dev(8192, "vision"))
    g.add(Node("prefix", "prefix", ("prompt", "vis"), ("kv",), "ref", "hf", {}, {"start": 0.1, "finish": 0.3}),
          kv=dev(3 << 20, "kv"))
    g.add(Node("decode", "decode_chunk", ("vis",), ("resp",), "actor", "vllm", {"chunk": 0},
               {"stream": "decode", "placement": "gpu0", "start": 0.1, "finish": 0.5}), resp=dev(640))
    g.add(Node("suffix", "suffix_score", ("kv", "resp"), ("lp",), "ref", "hf", {},
               {"priority": 3, "handle": object()}), lp=dev(256))  # an object has no JSON form
    g.add(Node("reward", "reward", ("resp",), ("rw",)), rw=dev(32))
    g.add(Node("loss", "loss", ("lp", "rw"), ("l",), "actor", "ds"), l=dev(4))
    g.add(Node("sync", "weight_sync", (), (), "actor", "vllm"))
    g.connect().add_order("loss", "sync", reason="barrier")
    return g.lint()


def grpo_graph(prompts: int = 8) -> IterationGraph:
    dims = ModelDims(hidden=128, layers=2, kv_heads=2, head_dim=32, vocab=600, params=600_000)
    return compile_iteration(
        grpo, BatchShape(prompts=prompts, samples=8, max_new_tokens=8, chunk_tokens=4, micro_batch_groups=2),
        EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"}), dims)


def renamed(g: IterationGraph) -> IterationGraph:
    """The same graph with every node and value renamed and the nodes added in reverse order."""
    node_name = {n: f"z{len(g) - i}_{n[::-1]}" for i, n in enumerate(g.nodes)}
    value_name = {v: f"v_{v[::-1]}" for v in g.values}
    out = IterationGraph(g.name + "_renamed")
    for v in g.values.values():
        if v.producer is None:
            out.add_input(value_name[v.name], **v.facts())
    for node in reversed(list(g)):
        info = {value_name[o]: g.values[o] for o in node.outputs}
        out.add(Node(node_name[node.name], node.kind, tuple(value_name[i] for i in node.inputs),
                     tuple(value_name[o] for o in node.outputs), node.model, node.engine, node.args), **info)
    out.connect()
    for u, v, data in g.g.edges(data=True):
        if not data["values"]:
            out.add_order(node_name[u], node_name[v], data["reason"])
    return out.lint()


GRAPHS = {"tiny": tiny_graph, "grpo": grpo_graph}


@pytest.fixture(params=sorted(GRAPHS))
def graph(request) -> IterationGraph:
    return GRAPHS[request.param]()


def _svg_nodes(svg: str) -> list[ET.Element]:
    return [e for e in ET.fromstring(svg).iter(f"{SVG}g") if e.get("class") == "node"]


def test_every_node_appears_in_every_format(graph):
    names = set(graph.nodes)
    assert {n["name"] for n in R.to_json(graph)["nodes"]} == names
    dot = R.to_dot(graph)
    assert all(f'"{n}" [label=' in dot for n in names)
    assert {e.get("data-node") for e in _svg_nodes(R.to_svg(graph))} == names
    page = R.to_html(graph)
    assert all(f'class="node" data-node="{n}"' in page and f'<span data-node="{n}">' in page for n in names)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pydot's own grammar uses old pyparsing names
def test_dot_parses_back_with_the_same_nodes_and_edges(graph, tmp_path):
    pytest.importorskip("pydot")
    path = R.render(graph, "dot", tmp_path / "g.dot")
    parsed = nx.drawing.nx_pydot.read_dot(path)
    assert set(parsed.nodes) == set(graph.nodes)
    assert parsed.number_of_edges() == graph.g.number_of_edges()
    dashed = {(u, v) for u, v, d in parsed.edges(data=True) if "dashed" in d.get("style", "")}
    assert dashed == {(u, v) for u, v, d in graph.g.edges(data=True) if not d["values"]}
    for u, v, d in parsed.edges(data=True):
        for value in graph.g.edges[u, v]["values"][:4]:  # at most four values are spelled out per edge
            assert value in d["label"]


def test_dot_labels_bytes_lifetimes_and_clusters():
    g = tiny_graph()
    dot = R.to_dot(g)
    assert '"vit" -> "prefix" [label="vis 8.0KiB live→%decode"]' in dot  # lifetime ends at the last reader
    assert '"decode" [label="decode\\ndecode_chunk[actor]\\n@vllm · gpu0/decode\\n0.100–0.500s"' in dot
    assert '"suffix" [label="suffix\\nsuffix_score[ref]\\n@hf · rank0/compute · prio 3"' in dot  # placement always
    assert 'label="stream: gpu0/decode"' in dot  # placed graph: clustered by stream by default
    assert dot.count("subgraph") == len({S.lane_of(n) for n in g})
    by_phase = R.to_dot(g, cluster="phase")
    assert by_phase.count("subgraph") == len({n.kind_info.phase for n in g})
    assert "subgraph" not in R.to_dot(g, cluster="none")
    with pytest.raises(ConfigError, match="auto, phase, stream, none"):
        R.to_dot(g, cluster="engine")


def test_dot_quotes_awkward_names():
    g = IterationGraph('say "hi" \\ there')
    g.add(Node("a.b-c", "reward", (), ("x",), engine='e"1'), x=dict(label="a\nb"))
    dot = R.to_dot(g.connect())
    assert 'digraph "say \\"hi\\" \\\\ there" {' in dot
    assert '@e\\"1' in dot


def test_svg_is_well_formed_and_sized_to_its_content(graph):
    svg = R.to_svg(graph)
    root = ET.fromstring(svg)
    width, height = float(root.get("width")), float(root.get("height"))
    nodes = _svg_nodes(svg)
    assert len(nodes) == len(graph)
    edges = [e for e in root.iter(f"{SVG}g") if e.get("class") == "edge"]
    assert len(edges) == graph.g.number_of_edges()
    for g in nodes:
        x, y = map(float, re.fullmatch(r"translate\(([\d.]+),([\d.]+)\)", g.get("transform")).groups())
        rect = g.find(f"{SVG}rect")
        assert 0 <= x and x + float(rect.get("width")) <= width and 0 <= y and y + float(rect.get("height")) <= height
    legend = next(e for e in root.iter(f"{SVG}g") if e.get("class") == "legend")
    legend = [t.text for t in legend.iter(f"{SVG}text") if t.text in {n.kind for n in graph}]
    assert sorted(legend) == sorted({n.kind for n in graph})  # one legend entry per kind present


def test_layout_invariants_on_a_large_graph():
    """No two boxes overlap, every edge points down, layers are longest paths from the sources."""
    g = grpo_graph(prompts=32)
    lay = layered_layout(g.g, list(g.nodes), wrap=16)
    assert 200 <= len(g) and set(lay.boxes) == set(g.nodes)
    boxes = sorted(lay.boxes.values(), key=lambda b: (b.y, b.x))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if b.y >= a.bottom:
                break
            assert b.x >= a.x + a.w or a.x >= b.x + b.w, f"boxes overlap: {a} {b}"
    assert all(lay.boxes[u].bottom < lay.boxes[v].y for u, v in g.g.edges)
    assert len(lay.layers) == nx.dag_longest_path_length(g.g) + 1
    assert max(len(layer) for layer in lay.layers) > 16  # wide layers wrap instead of stretching
    assert lay.width < 17 * 200 + 100


def test_tiny_graph_layers():
    g = tiny_graph()
    layers = [set(layer) for layer in longest_path_layers(g.g, list(g.nodes))]
    assert layers == [{"vit"}, {"prefix", "decode"}, {"suffix", "reward"}, {"loss"}, {"sync"}]


def test_two_namings_lay_out_alike(graph):
    other = renamed(graph)
    a = layered_layout(graph.g, list(graph.nodes))
    b = layered_layout(other.g, list(other.nodes))
    assert len(a.layers) == len(b.layers)
    assert [len(layer) for layer in a.layers] == [len(layer) for layer in b.layers]
    assert (a.width, a.height) == (b.width, b.height)
    assert len(_svg_nodes(R.to_svg(other))) == len(other)


def test_html_is_self_contained_and_embeds_the_table(graph):
    page = R.to_html(graph)
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(link|iframe|img)\b|\s(src|href)=|@import|url\((?!#)", page)
    for line in str(graph).splitlines():
        assert line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in page
    data = json.loads(re.search(r'<script type="application/json" id="rp-data">(.*?)</script>', page, re.S).group(1))
    groups = data.pop("groups")
    assert data == json.loads(json.dumps(R.to_json(graph)))
    grouped = R.overview(graph)
    assert set(groups) == {k for k, b in grouped.boxes.items() if b.is_group}
    for key, facts in groups.items():
        assert facts["members"] == list(grouped.boxes[key].members)
    # One view with the groups, one per group expanded, one of every node; a timeline only when timed.
    views = 2 + len(groups)
    assert page.count("<svg") == views + (1 if any(S.seconds_of(n) for n in graph) else 0)


def test_json_round_trips_and_matches_lifetimes(graph):
    data = R.to_json(graph)
    text = json.dumps(data)
    assert json.loads(text) == data
    assert list(data) == ["format", "name", "meta", "dropped_meta", "nodes", "values", "edges"]
    assert json.dumps(R.to_json(graph)) == text  # stable
    lifetimes = graph.lifetimes()
    assert {v["name"]: tuple(v["lifetime"]) for v in data["values"]} == lifetimes
    assert len(data["edges"]) == graph.g.number_of_edges()
    rebuilt = R.from_json(json.loads(text))
    assert str(rebuilt) == str(graph)
    assert {(u, v, d["reason"]) for u, v, d in rebuilt.g.edges(data=True)} == \
        {(u, v, d["reason"]) for u, v, d in graph.g.edges(data=True)}


def test_json_keeps_serialisable_meta_and_lists_the_rest():
    nodes = {n["name"]: n for n in R.to_json(tiny_graph())["nodes"]}
    assert nodes["suffix"]["meta"] == {"priority": 3} and nodes["suffix"]["dropped_meta"] == ["handle"]
    assert nodes["decode"]["placement"] == "gpu0" and nodes["decode"]["stream"] == "decode"
    assert nodes["reward"]["stream"] == "host" and nodes["reward"]["placement"] is None
    shape = R.to_json(grpo_graph())["meta"]["shape"]  # a dataclass becomes a dict
    assert shape["prompts"] == 8 and shape["prefix_sharing"] is True
    with pytest.raises(ConfigError, match="not a rollplex graph dump"):
        R.from_json({"format": "other"})


def test_timeline_has_one_bar_per_timed_node():
    g = tiny_graph()
    root = ET.fromstring(R.to_svg(g, mode="timeline"))
    bars = [e.get("data-node") for e in root.iter(f"{SVG}g") if e.get("class") == "bar"]
    assert sorted(bars) == ["decode", "prefix", "vit"]
    assert "(4 unscheduled)" in root.find(f"{SVG}title").text
    with pytest.raises(ConfigError, match="start"):
        R.to_svg(grpo_graph(), mode="timeline")
    with pytest.raises(ConfigError, match="dag, timeline"):
        R.to_svg(g, mode="gantt")


def test_render_writes_atomically(tmp_path, monkeypatch):
    g = tiny_graph()
    for fmt in R.FORMATS:
        assert R.render(g, fmt, tmp_path / f"g.{fmt}") == tmp_path / f"g.{fmt}"
    R.render(g, "json", tmp_path / "g.json")  # overwriting is fine too
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"g.{fmt}" for fmt in R.FORMATS]
    before = (tmp_path / "g.json").read_text()

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(R.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        R.render(grpo_graph(), "json", tmp_path / "g.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"g.{fmt}" for fmt in R.FORMATS]  # temp removed
    assert (tmp_path / "g.json").read_text() == before  # the old file is untouched


def test_unknown_format_names_the_allowed_ones(tmp_path):
    with pytest.raises(ConfigError, match="'png'; choose one of dot, html, json, svg"):
        R.render(tiny_graph(), "png", tmp_path / "g.png")
    assert list(tmp_path.iterdir()) == []


def test_kind_colours_are_fixed():
    assert S.kind_colour("decode_chunk") == S.KIND_COLOURS["decode_chunk"]
    assert S.kind_colour("my_plugin_kind") == S.kind_colour("my_plugin_kind") in S._SPARE_COLOURS


def test_overview_groups_per_prompt_nodes_and_labels_edges_with_bytes_and_lifetime():
    """8 prompts: one box per kind and model with its count; single nodes stay themselves.

        vit ×8 ─▶ prefix[ref] ×8 ─▶ suffix_score[ref] ×8 ─▶ loss ×4 ─▶ optimizer_step ─▶ weight_sync ─▶ report
    """
    g = grpo_graph(8)
    ov = R.overview(g)
    titles = {b.lines[0] for b in ov.boxes.values()}
    assert {"reward ×8", "advantage ×8", "prefix[ref] ×8", "suffix_score[ref] ×8", "loss[actor] ×4",
            "optimizer_step", "weight_sync", "report"} <= titles
    assert sum(len(b.members) for b in ov.boxes.values()) == len(g)
    edge = next(e for e in ov.edges if ov.boxes[e.src].lines[0] == "prefix[ref] ×8")
    kv = sum(g.values[v].nbytes for v in edge.values)
    assert edge.label == f"8× {format_bytes(kv)} live→suffix_score[ref]"
    # The accumulation order (loss of micro-batch m before the suffix of m+1) would close a cycle
    # between groups: it is folded out of the grouped picture, which stays a DAG.
    assert [e.reasons for e in ov.folded] == [("accumulation order",)]
    assert nx.is_directed_acyclic_graph(ov.digraph())
    # Expanded, a group's nodes are boxes of their own; ALL draws every node.
    reward = next(k for k, b in ov.boxes.items() if b.lines[0] == "reward ×8")
    assert len(R.overview(g, {reward}).boxes) == len(ov.boxes) + 7
    assert set(R.overview(g, R.ALL).boxes) == set(g.nodes)
    # Two namings of one graph give the same picture.
    other = R.overview(renamed(g))
    assert sorted(b.lines[0].split(" ×")[-1] for b in other.boxes.values() if b.is_group) == \
        sorted(b.lines[0].split(" ×")[-1] for b in ov.boxes.values() if b.is_group)


def test_edges_into_one_node_enter_it_side_by_side():
    """weight_sync and report read many values: their edges once met in one point and tangled."""
    svg = R.to_svg(grpo_graph(8))
    ends: dict[str, list[float]] = {}
    for dst, path in re.findall(r'<g class="edge" data-src="[^"]*" data-dst="([^"]*)">.*?<path d="([^"]*)"', svg, re.S):
        ends.setdefault(dst, []).append(float(path.split()[-1].split(",")[0]))
    assert len(ends["report"]) > 10
    for dst, xs in ends.items():
        assert len(set(xs)) == len(xs), dst
