"""Render an ``IterationGraph`` for people and tools: JSON, Graphviz DOT, SVG and a one-file HTML viewer.

Everything here is a pure function of the graph (plus options) that returns text; ``render`` writes
that text atomically. Whatever scheduling passes put in ``node.meta`` (``stream``, ``placement``,
``priority``, ``start``/``finish`` in seconds, residency) is shown where present and ignored where
not. The pictures are drawn in ``rollplex.pipeline.compile.svg`` (no graphviz binary needed); the
HTML page inlines them, the one-line-per-node table and a small script, so the file opens offline
and can be attached to a bug report as is.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollplex.errors import ConfigError
from rollplex.pipeline.compile.ir import PHASES, IterationGraph, Node, Value
from rollplex.pipeline.compile.overview import ALL, Overview, node_lines, overview, where
from rollplex.pipeline.compile.svg import (
    ORDER_EDGE_COLOUR,
    VALUE_EDGE_COLOUR,
    draw_dag,
    draw_timeline,
    escape,
    kind_colour,
    lane_of,
    seconds_of,
    to_svg,
    value_label,
)

FORMATS = ("dot", "html", "json", "svg")
JSON_FORMAT = "rollplex.iteration-graph/2"  # 2: a value's facts (role, model, prompts, ...) replace "what"


def _node_lines(node: Node) -> list[str]:
    return node_lines(node)


def _edges(graph: IterationGraph) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(src, dst, values, reason), sorted by the nodes' insertion order so output is stable."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    rows = [(u, v, tuple(d.get("values", ())), d.get("reason", "value")) for u, v, d in graph.g.edges(data=True)]
    return sorted(rows, key=lambda e: (index[e[0]], index[e[1]]))


# -- JSON ----------------------------------------------------------------------------------------
_DROP = object()


def _jsonable(x: Any) -> Any:
    """A JSON-safe copy of ``x``, or ``_DROP`` when some part of it has no faithful JSON form."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else _DROP  # NaN/inf are not JSON; strict parsers reject them
    if isinstance(x, enum.Enum):
        return _jsonable(x.value)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        items = {str(k): _jsonable(v) for k, v in x.items() if isinstance(k, (str, int))}
        if len(items) != len(x) or any(v is _DROP for v in items.values()):
            return _DROP
        return dict(sorted(items.items()))
    if isinstance(x, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in (sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x)]
        return _DROP if any(v is _DROP for v in items) else items
    return _DROP


def _json_meta(meta: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    kept = {str(k): _jsonable(v) for k, v in sorted(meta.items(), key=lambda kv: str(kv[0]))}
    return {k: v for k, v in kept.items() if v is not _DROP}, [k for k, v in kept.items() if v is _DROP]


def to_json(graph: IterationGraph, order: Iterable[str] | None = None) -> dict[str, Any]:
    """A plain dict (fixed key order) of nodes, values with lifetimes under ``order``, and edges.

    Meta entries with no JSON form (an object, NaN) are left out and listed under ``dropped_meta``.
    """
    lifetimes = graph.lifetimes(order)
    meta, dropped = _json_meta(graph.meta)
    nodes = []
    for node in graph:
        node_meta, node_dropped = _json_meta(node.meta)
        args, bad_args = _json_meta(node.args)
        nodes.append({
            "name": node.name, "kind": node.kind, "phase": node.kind_info.phase, "model": node.model,
            "engine": node.engine, "stream": node.stream, "placement": node.meta.get("placement"),
            "inputs": list(node.inputs), "outputs": list(node.outputs),
            "args": args, "meta": node_meta, "dropped_meta": node_dropped + [f"args.{k}" for k in bad_args],
        })
    values = [{
        "name": v.name, "producer": v.producer, "consumers": list(graph.consumers(v.name)),
        **{k: list(x) if isinstance(x, tuple) else x for k, x in v.facts().items()},
        "lifetime": list(lifetimes[v.name]),
    } for v in graph.values.values()]
    edges = [{"src": u, "dst": v, "values": list(vals), "reason": reason} for u, v, vals, reason in _edges(graph)]
    return {"format": JSON_FORMAT, "name": graph.name, "meta": meta, "dropped_meta": dropped,
            "nodes": nodes, "values": values, "edges": edges}


def from_json(data: Mapping[str, Any]) -> IterationGraph:
    """Rebuild a graph from ``to_json`` output (dropped meta stays dropped)."""
    if data.get("format") != JSON_FORMAT:
        raise ConfigError(f"not a rollplex graph dump: format is {data.get('format')!r}, expected {JSON_FORMAT!r}")
    graph = IterationGraph(data["name"])
    graph.meta.update(data["meta"])
    facts = {v["name"]: {k: v[k] for k in Value(v["name"], None).facts()} for v in data["values"]}
    for v in data["values"]:
        if v["producer"] is None:
            graph.add_input(v["name"], **facts[v["name"]])
    for n in data["nodes"]:
        info = {o: facts[o] for o in n["outputs"]}
        graph.add(Node(n["name"], n["kind"], tuple(n["inputs"]), tuple(n["outputs"]), n["model"], n["engine"],
                       n["args"], dict(n["meta"])), **info)
    graph.connect()
    for e in data["edges"]:
        if not e["values"]:
            graph.add_order(e["src"], e["dst"], e["reason"])
    return graph


# -- DOT -----------------------------------------------------------------------------------------
def _q(text: str) -> str:
    """A DOT double-quoted string; newlines become DOT's centred line break."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _cluster_key(graph: IterationGraph, cluster: str) -> tuple[str, Any]:
    if cluster == "auto":  # once a pass has placed nodes, streams say more than phases
        placed = any("stream" in n.meta or "placement" in n.meta for n in graph)
        cluster = "stream" if placed else "phase"
    if cluster == "phase":
        return cluster, lambda n: n.kind_info.phase
    if cluster == "stream":
        return cluster, lane_of
    if cluster == "none":
        return cluster, None
    raise ConfigError(f"unknown DOT clustering {cluster!r}; choose one of auto, phase, stream, none")


def to_dot(graph: IterationGraph, cluster: str = "auto", order: Iterable[str] | None = None) -> str:
    """Graphviz DOT text: boxes coloured by kind, clustered by phase or stream, edges labelled.

    Node statements come first at top level (so pydot/networkx readers see every node with its
    attributes); clusters then only list names, which Graphviz reads as cluster membership.
    """
    cluster, key = _cluster_key(graph, cluster)
    lifetimes = graph.lifetimes(order)
    out = [f"digraph {_q(graph.name)} {{",
           f"  graph [rankdir=TB, newrank=true, labelloc=t, fontname=Helvetica, "
           f"label={_q(f'{graph.name}: {len(graph)} nodes, {len(graph.values)} values')}];",
           '  node [shape=box, style="rounded,filled", fontname=monospace, fontsize=10];',
           f"  edge [fontname=monospace, fontsize=8, color={_q(VALUE_EDGE_COLOUR)}];"]
    for node in graph:
        label = "\n".join(_node_lines(node))
        out.append(f"  {_q(node.name)} [label={_q(label)}, fillcolor={_q(kind_colour(node.kind))}];")
    if key is not None:
        groups: dict[str, list[str]] = {}
        for node in graph:
            groups.setdefault(key(node), []).append(node.name)
        rank = {p: i for i, p in enumerate(PHASES)}
        for i, label in enumerate(sorted(groups, key=lambda k: (rank.get(k, len(rank)), k))):
            members = " ".join(f"{_q(n)};" for n in groups[label])
            out.append(f"  subgraph {_q(f'cluster_{i}')} {{ label={_q(f'{cluster}: {label}')}; "
                       f'style="rounded,dashed"; color="#999999"; {members} }}')
    for u, v, vals, reason in _edges(graph):
        if vals:
            shown = [value_label(graph, name, lifetimes) for name in vals[:4]]
            shown += [f"+{len(vals) - 4} more"] if len(vals) > 4 else []
            attrs = "label=" + _q("\n".join(shown))
        else:  # ordering only: no data moves, so draw it unlike a value edge
            attrs = f"label={_q(reason)}, style=dashed, color={_q(ORDER_EDGE_COLOUR)}"
        out.append(f"  {_q(u)} -> {_q(v)} [{attrs}];")
    out.append("}")
    return "\n".join(out) + "\n"


# -- HTML ----------------------------------------------------------------------------------------
_CSS = """
body{font:13px system-ui,sans-serif;margin:0;display:grid;grid-template-columns:1fr 360px;
  grid-template-rows:auto 1fr;height:100vh}
header{grid-column:1/3;padding:6px 10px;border-bottom:1px solid #ccc;display:flex;gap:10px;align-items:center;
  flex-wrap:wrap}
main{overflow:auto;padding:8px;min-width:0} aside{overflow:auto;border-left:1px solid #ccc;padding:8px;background:#fafafa}
.view svg{display:block;margin:0 auto} [data-box],[data-node]{cursor:pointer} pre{font-size:12px}
body.focus .node,body.focus .group,body.focus .edge,body.focus .edge-label,body.focus .bar{opacity:.2}
body.focus .hl-self,body.focus .hl-in,body.focus .hl-out{opacity:1}
.hl-self>rect{stroke:#000;stroke-width:3} .edge.hl-in path,.hl-in>rect{stroke:#1f77b4;stroke-width:2.5}
.edge.hl-out path,.hl-out>rect{stroke:#d62728;stroke-width:2.5}
pre .hl-self{background:#ffe58a} pre .hl-in{background:#d6e9f8} pre .hl-out{background:#f8d6d6}
aside table{border-collapse:collapse;font-size:12px}
aside td,aside th{padding:1px 6px 1px 0;text-align:left;vertical-align:top}
.in{color:#1f77b4} .out{color:#d62728} #rp-view{font-weight:bold}
"""

# Plain DOM calls (textContent, never innerHTML) so names and meta can't inject markup. One view is
# shown at a time: the groups, one group expanded, or every node; each is laid out beforehand.
_JS = """
(() => {
const data = JSON.parse(document.getElementById("rp-data").textContent);
const nodes = Object.fromEntries(data.nodes.map(n => [n.name, n]));
const values = Object.fromEntries(data.values.map(v => [v.name, v]));
const groups = data.groups;
const panel = document.getElementById("rp-details"), main = document.querySelector("main");
const views = Object.fromEntries([...document.querySelectorAll(".view")].map(v => [v.dataset.view, v]));
let view = "groups", pinned = null, actual = false;
const all = sel => document.querySelectorAll(sel);
const here = sel => views[view].querySelectorAll(sel);
const box = key => here(`[data-box="${CSS.escape(key)}"]`);
function fmt(n) { const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < 4) { n /= 1024; i++; } return i ? n.toFixed(1) + u[i] : n + "B"; }
function add(parent, tag, text, cls) { const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text; if (cls) e.className = cls; parent.appendChild(e); return e; }
function fit() {  // the whole view in the window, never enlarged past 1.25 nor shrunk past 0.75 (text stays readable)
  const svg = views[view].querySelector("svg"), w = +svg.getAttribute("width"), h = +svg.getAttribute("height");
  const s = actual ? 1 : Math.max(0.75, Math.min(1.25, (main.clientWidth - 20) / w, (main.clientHeight - 20) / h));
  svg.style.width = (w * s) + "px"; svg.style.height = (h * s) + "px";
  document.getElementById("rp-fit").textContent = actual ? "fit to window" : "actual size";
}
function show(v) {
  view = views[v] ? v : "groups"; pinned = null;
  for (const [k, e] of Object.entries(views)) e.hidden = k !== view;
  document.getElementById("rp-view").textContent = view === "groups" ? "grouped" : view === "all" ? "every node"
    : groups[view].title + " expanded";
  fit(); details(null);
}
function valueRows(title, cls, names, other) {
  if (!names.length) return;
  add(panel, "h4", title, cls); const t = add(panel, "table");
  for (const name of names) { const v = values[name], r = add(t, "tr");
    const cells = ["%" + name, fmt(v.nbytes), v.device + "/" + v.role, other(v), "live " + v.lifetime.join("→")];
    for (const s of cells) add(r, "td", s); }
}
function mark(cls, edges, end) {
  edges.forEach(e => { e.classList.add(cls); box(e.dataset[end]).forEach(x => x.classList.add(cls)); }); }
function clear() { all(".hl-self,.hl-in,.hl-out").forEach(e => e.classList.remove("hl-self", "hl-in", "hl-out"));
  document.body.classList.remove("focus"); }
function highlight(key, members) {
  document.body.classList.add("focus"); box(key).forEach(e => e.classList.add("hl-self"));
  members.forEach(m => all(`pre [data-node="${CSS.escape(m)}"]`).forEach(e => e.classList.add("hl-self")));
  const q = CSS.escape(key);
  mark("hl-in", here(`.edge[data-dst="${q}"],.edge-label[data-dst="${q}"]`), "src");
  mark("hl-out", here(`.edge[data-src="${q}"],.edge-label[data-src="${q}"]`), "dst");
}
function facts(rows) { const t = add(panel, "table");
  for (const [k, v] of rows) if (v !== null && v !== undefined) { const r = add(t, "tr"); add(r, "th", k); add(r, "td", v); } }
function details(key) {
  clear(); panel.replaceChildren();
  if (key && groups[key]) {
    const g = groups[key]; highlight(key, g.members);
    add(panel, "h3", g.title + (pinned ? " (pinned)" : ""));
    const b = add(panel, "button", "expand: one box per node"); b.onclick = () => show(key);
    facts([["kind", g.kind + " (" + g.phase + ")"], ["model", g.model], ["runs on", g.where.join(", ")],
           ["reads", fmt(g.bytes_in)], ["writes", fmt(g.bytes_out)]]);
    if (g.folded.length) add(panel, "p", "also ordered: " + g.folded.join("; "));
    add(panel, "h4", g.members.length + " nodes"); const ul = add(panel, "ul");
    for (const m of g.members) add(ul, "li", "%" + m);
    return;
  }
  if (!key || !nodes[key]) return void add(panel, "p",
    "Hover or click a box; double-click a group to expand it; Esc unpins.");
  const n = nodes[key]; highlight(key, [key]);
  add(panel, "h3", "%" + n.name + (pinned ? " (pinned)" : ""));
  facts([["kind", n.kind + " (" + n.phase + ")"], ["model", n.model], ["engine", n.engine],
    ["stream", n.stream], ["placement", n.placement || "rank0"], ["args", JSON.stringify(n.args)],
    ...Object.entries(n.meta).filter(([k]) => k !== "stream" && k !== "placement")
      .map(([k, v]) => [k, JSON.stringify(v)])]);
  valueRows("inputs", "in", n.inputs, v => "from " + (v.producer ? "%" + v.producer : "graph input"));
  valueRows("outputs", "out", n.outputs, v => "to " + (v.consumers.map(c => "%" + c).join(", ") || "nobody"));
}
all("[data-box],pre [data-node]").forEach(e => {
  const key = () => e.dataset.box || e.dataset.node;
  e.addEventListener("mouseenter", () => { if (!pinned) details(key()); });
  e.addEventListener("mouseleave", () => { if (!pinned) details(null); });
  e.addEventListener("click", () => { pinned = pinned === key() ? null : key(); details(pinned); });
  e.addEventListener("dblclick", () => { if (groups[key()]) show(key()); });
});
document.addEventListener("keydown", ev => { if (ev.key === "Escape") { pinned = null; details(null); } });
document.getElementById("rp-fit").addEventListener("click", () => { actual = !actual; fit(); });
document.getElementById("rp-groups").addEventListener("click", () => show("groups"));
document.getElementById("rp-all").addEventListener("click", () => show("all"));
window.addEventListener("resize", fit);
document.getElementById("rp-find").addEventListener("input", ev => {
  pinned = null; details(null); const q = ev.target.value.trim(); if (!q) return;
  document.body.classList.add("focus");
  here(".node,.group").forEach(e => { const g = groups[e.dataset.box];
    if ((g ? g.members : [e.dataset.box]).some(m => m.includes(q))) e.classList.add("hl-self"); });
});
show("groups");
})();
"""


def _group_facts(graph: IterationGraph, ov: Overview) -> dict[str, dict[str, Any]]:
    """What the page's side panel says of each group box."""
    out = {}
    for key, box in ov.boxes.items():
        if not box.is_group:
            continue
        first = graph.nodes[box.members[0]]
        inside = set(box.members)
        reads = {v for m in box.members for v in graph.nodes[m].inputs if graph.values[v].producer not in inside}
        writes = {v for m in box.members for v in graph.nodes[m].outputs}
        folded = [f"{e.reasons[0] if e.reasons else 'order'} from {ov.boxes[e.src].lines[0]}"
                  for e in ov.folded if e.dst == key] + [
                  f"{e.reasons[0] if e.reasons else 'order'} before {ov.boxes[e.dst].lines[0]}"
                  for e in ov.folded if e.src == key]
        out[key] = {"title": box.lines[0], "kind": first.kind, "model": first.model, "phase": first.kind_info.phase,
                    "members": list(box.members), "where": list(dict.fromkeys(where(graph.nodes[m]) for m in box.members)),
                    "bytes_in": sum(graph.values[v].nbytes for v in reads),
                    "bytes_out": sum(graph.values[v].nbytes for v in writes), "folded": folded}
    return out


def to_html(graph: IterationGraph, order: Iterable[str] | None = None, wrap: int = 16) -> str:
    """One self-contained page that opens on the grouped iteration, fitted to the window: one box per
    kind and model with its count, each edge labelled with its values' bytes and lifetime. A group
    expands in place (a second view, laid out beforehand); "every node" shows the full graph; then the
    timeline when timed, the one-line-per-node table, and a details panel."""
    # Inline SVG needs no xmlns in HTML5; dropping it keeps the file free of any URL.
    strip = lambda svg: svg.replace(' xmlns="http://www.w3.org/2000/svg"', "", 1)  # noqa: E731
    grouped = overview(graph, (), order)
    views = [("groups", ())] + [(key, (key,)) for key, box in grouped.boxes.items() if box.is_group] + [("all", ALL)]
    parts = [f'<div class="view" data-view="{escape(name)}"{" hidden" if name != "groups" else ""}>'
             + strip(draw_dag(graph, overview(graph, expand, order), wrap, order, edge_labels=True)) + "</div>"
             for name, expand in views]
    if any(seconds_of(n) is not None for n in graph):
        parts += ["<h2>timeline</h2>", strip(draw_timeline(graph))]
    header, *rows = str(graph).splitlines()
    # Rows follow str(graph), i.e. topological order; tag each with its node for highlighting.
    table = [escape(header)] + [f'<span data-node="{escape(name)}">{escape(row)}</span>'
                            for name, row in zip(graph.topological_order(), rows)]
    data = dict(to_json(graph, order), groups=_group_facts(graph, grouped))
    data = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")  # can't close <script>
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(graph.name)} — rollplex iteration graph</title><style>{_CSS}</style></head><body>",
        f"<header><b>{escape(graph.name)}</b> {len(graph)} nodes, {len(graph.values)} values · "
        '<span id="rp-view"></span><button id="rp-groups">grouped</button><button id="rp-all">every node</button>'
        '<button id="rp-fit">actual size</button><input id="rp-find" placeholder="find node…">'
        '<span class="in">■ inputs</span><span class="out">■ outputs</span></header>',
        "<main>", *parts, "<h2>table</h2>", '<pre id="rp-table">' + "\n".join(table) + "</pre>", "</main>",
        '<aside id="rp-details"></aside>',
        f'<script type="application/json" id="rp-data">{data}</script>', f"<script>{_JS}</script>",
        "</body></html>", ""])


# -- files ---------------------------------------------------------------------------------------
def _json_text(graph: IterationGraph, **options: Any) -> str:
    return json.dumps(to_json(graph, **options), indent=1, ensure_ascii=False) + "\n"


_MAKERS = {"dot": to_dot, "html": to_html, "json": _json_text, "svg": to_svg}


def render(graph: IterationGraph, fmt: str, path: str | os.PathLike, **options: Any) -> Path:
    """Write ``graph`` as ``fmt`` to ``path`` atomically: readers see the old file or the new, never half.

    ``options`` go to the format's function (``cluster=`` for dot, ``mode=``/``wrap=`` for svg, ...).
    """
    if fmt not in _MAKERS:
        raise ConfigError(f"unknown render format {fmt!r}; choose one of {', '.join(FORMATS)}")
    text = _MAKERS[fmt](graph, **options)
    path = Path(path)
    # The temp file sits in the target's directory so os.replace is a same-filesystem rename.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a rendered report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
