"""Render an ``IterationGraph`` for people and tools: JSON, Graphviz DOT, SVG and a one-file HTML viewer.

Everything here is a pure function of the graph (plus options) that returns text; ``render`` writes
that text atomically. Whatever scheduling passes put in ``node.meta`` (``stream``, ``placement``,
``priority``, ``start``/``finish`` in seconds, residency) is shown where present and ignored where
not. Nothing needs the graphviz binary: the SVG uses the pure-Python layered layout in
``rollplex.pipeline.compile.layout``, and the HTML inlines that SVG, the one-line-per-node table and a
small script, so the file opens offline and can be attached to a bug report as is.
"""
from __future__ import annotations

import dataclasses
import enum
import html
import json
import math
import os
import tempfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollplex.errors import ConfigError
from rollplex.pipeline.compile.ir import PHASES, IterationGraph, Node, Value, format_bytes, registered_kinds
from rollplex.pipeline.compile.layout import layered_layout

FORMATS = ("dot", "html", "json", "svg")
JSON_FORMAT = "rollplex.iteration-graph/2"  # 2: a value's facts (role, model, prompts, ...) replace "what"

# One fixed colour per builtin kind, so the same kind looks the same in every picture.
KIND_COLOURS = {
    "vit_encode": "#c6dbef", "prefix": "#9ecae1", "decode_chunk": "#fdd0a2", "suffix_score": "#a1d99b",
    "reward": "#fde68a", "advantage": "#fcbba1", "loss": "#dadaeb", "optimizer_step": "#bcbddc",
    "weight_sync": "#f4a6c6", "report": "#d9d9d9", "offload": "#c7e9c0", "prefetch": "#e0f3db",
}
_SPARE_COLOURS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5")
ORDER_EDGE_COLOUR = "#c0392b"
VALUE_EDGE_COLOUR = "#777777"
_SHOWN_META = {"stream", "placement", "start", "finish"}  # already in the box text or table line
_BOLD = ' font-weight="bold"'
_CHAR_W = 6.6  # width of one 11px monospace character, to size boxes without measuring text


def kind_colour(kind: str) -> str:
    # Plugin kinds: crc32 (not hash()) so the colour is the same in every process.
    return KIND_COLOURS.get(kind) or _SPARE_COLOURS[zlib.crc32(kind.encode()) % len(_SPARE_COLOURS)]


def _where(node: Node) -> str:
    place = node.meta.get("placement")
    return f"{place}/{node.stream}" if place else node.stream


def _seconds(node: Node) -> tuple[float, float] | None:
    start, finish = node.meta.get("start"), node.meta.get("finish")
    if isinstance(start, (int, float)) and isinstance(finish, (int, float)) and finish >= start:
        return float(start), float(finish)
    return None


def _node_lines(node: Node) -> list[str]:
    """name / kind[model] / @engine · placement/stream · priority / start–finish, as present."""
    prio = node.meta.get("priority")
    lines = [node.name, node.kind + (f"[{node.model}]" if node.model else ""),
             (f"@{node.engine} · " if node.engine else "") + _where(node)
             + (f" · prio {prio:g}" if isinstance(prio, (int, float)) else "")]
    if (times := _seconds(node)) is not None:
        lines.append(f"{times[0]:.3f}–{times[1]:.3f}s")
    if node.meta.get("weights"):  # weight_sync: what the sharing plan aliases and rebuilds (its first clause)
        short = str(node.meta["weights"]).split(";")[0]
        lines.append(short if len(short) <= 34 else short[:33] + "…")
    return lines


def _value_label(graph: IterationGraph, name: str, lifetimes: Mapping[str, tuple[str, str]]) -> str:
    return f"{name} {format_bytes(graph.values[name].nbytes)} live→%{lifetimes[name][1]}"


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
        return cluster, _where
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
            shown = [_value_label(graph, name, lifetimes) for name in vals[:4]]
            shown += [f"+{len(vals) - 4} more"] if len(vals) > 4 else []
            attrs = "label=" + _q("\n".join(shown))
        else:  # ordering only: no data moves, so draw it unlike a value edge
            attrs = f"label={_q(reason)}, style=dashed, color={_q(ORDER_EDGE_COLOUR)}"
        out.append(f"  {_q(u)} -> {_q(v)} [{attrs}];")
    out.append("}")
    return "\n".join(out) + "\n"


# -- SVG -----------------------------------------------------------------------------------------
def _x(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _fit(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: max(1, chars - 1)] + "…"


def _legend(graph: IterationGraph, y: float) -> tuple[list[str], float]:
    """Swatches for the kinds present, in registration order, plus the ordering-edge style."""
    present = {n.kind for n in graph}
    kinds = [k for k in registered_kinds() if k in present]
    out = ['<g class="legend">', f'<text x="16" y="{y + 14}" font-weight="bold">'
           f'{_x(graph.name)}: {len(graph)} nodes, {len(graph.values)} values</text>']
    x, y = 16.0, y + 26
    for k in kinds:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" rx="2" fill="{kind_colour(k)}" stroke="#444"/>'
                   f'<text x="{x + 16}" y="{y + 10}">{_x(k)}</text>')
        x += 16 + len(k) * _CHAR_W + 14
    out.append(f'<path d="M{x},{y + 6} h28" stroke="{ORDER_EDGE_COLOUR}" stroke-dasharray="5,3"/>'
               f'<text x="{x + 34}" y="{y + 10}">ordering only</text></g>')
    return out, x + 34 + 13 * _CHAR_W + 16


_SVG_HEAD = ('<svg xmlns="http://www.w3.org/2000/svg" class="rollplex-{mode}" width="{w:.0f}" height="{h:.0f}" '
             'viewBox="0 0 {w:.0f} {h:.0f}" font-family="monospace" font-size="11">')
_DEFS = ('<defs>' + "".join(
    f'<marker id="rp-arrow-{name}" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" '
    f'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="{colour}"/></marker>'
    for name, colour in (("value", VALUE_EDGE_COLOUR), ("order", ORDER_EDGE_COLOUR))) + '</defs>')


def to_svg(graph: IterationGraph, mode: str = "dag", wrap: int = 16, order: Iterable[str] | None = None) -> str:
    """Standalone SVG. ``mode="dag"``: layered drawing, one ``<g class="node">`` per node.
    ``mode="timeline"``: Gantt rows per placement/stream from ``meta["start"/"finish"]``."""
    if mode == "timeline":
        return _timeline_svg(graph)
    if mode != "dag":
        raise ConfigError(f"unknown SVG mode {mode!r}; choose one of dag, timeline")
    lifetimes = graph.lifetimes(order)
    lines = {n.name: _node_lines(n) for n in graph}
    chars = min(36, max((len(s) for ls in lines.values() for s in ls), default=8))
    box_w, box_h = chars * _CHAR_W + 16, max(map(len, lines.values()), default=3) * 14 + 8
    legend, legend_w = _legend(graph, 8)
    lay = layered_layout(graph.g, list(graph.nodes), box_w=box_w, box_h=box_h, top=48, wrap=wrap)
    width = max(lay.width, legend_w)
    shift = (width - lay.width) / 2  # centre the drawing under a wider legend
    out = [_SVG_HEAD.format(mode="dag", w=width, h=lay.height), f"<title>{_x(graph.name)}</title>", _DEFS, *legend]
    out.append('<g class="edges" fill="none">')
    for u, v, vals, reason in _edges(graph):
        a, b = lay.boxes[u], lay.boxes[v]
        x1, y1, x2, y2 = a.cx + shift, a.bottom, b.cx + shift, b.y
        bend = min(60.0, max(20.0, (y2 - y1) / 2))
        kind, dash = ("value", "") if vals else ("order", ' stroke-dasharray="5,3"')
        colour = VALUE_EDGE_COLOUR if vals else ORDER_EDGE_COLOUR
        tip = "\n".join([f"{u} → {v}"] + ([_value_label(graph, n, lifetimes) for n in vals] or [f"order: {reason}"]))
        out.append(f'<g class="edge" data-src="{_x(u)}" data-dst="{_x(v)}"><title>{_x(tip)}</title>'
                   f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} {x2:.1f},{y2:.1f}" '
                   f'stroke="{colour}"{dash} marker-end="url(#rp-arrow-{kind})"/></g>')
    out.append('</g><g class="nodes">')
    for node in graph:
        box = lay.boxes[node.name]
        extra = [f"{k}={v!r}"[:100] for k, v in sorted(node.meta.items()) if k not in _SHOWN_META]
        tip = "\n".join(graph.format_node(node, lifetimes).split(" = ", 1) + extra)
        texts = "".join(
            f'<text x="8" y="{15 + 14 * i}"{_BOLD if i == 0 else ""}>{_x(_fit(s, chars))}</text>'
            for i, s in enumerate(lines[node.name]))
        out.append(f'<g class="node" data-node="{_x(node.name)}" '
                   f'transform="translate({box.x + shift:.1f},{box.y:.1f})"><title>{_x(tip)}</title>'
                   f'<rect width="{box.w:.1f}" height="{box.h:.1f}" rx="6" fill="{kind_colour(node.kind)}" '
                   f'stroke="#444"/>{texts}</g>')
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


def _nice_step(span: float, ticks: int = 8) -> float:
    raw = span / ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _timeline_svg(graph: IterationGraph, px: float = 1200) -> str:
    timed = [(n, t) for n in graph if (t := _seconds(n)) is not None]
    if not timed:
        raise ConfigError(f"timeline needs node.meta['start'] and ['finish'] (seconds) from a scheduling pass; "
                          f"none of the {len(graph)} nodes of {graph.name!r} has them")
    lanes = sorted({_where(n) for n, _ in timed})
    t0, t1 = min(t[0] for _, t in timed), max(t[1] for _, t in timed)
    span = max(t1 - t0, 1e-9)
    scale, left, lane_h, top = px / span, max(len(s) for s in lanes) * _CHAR_W + 24, 26, 56
    width, height = left + px + 24, top + lane_h * len(lanes) + 16
    untimed = len(graph) - len(timed)
    title = f"{graph.name}: timeline of {len(timed)} nodes, {span:.3f}s"
    title += f" ({untimed} unscheduled)" if untimed else ""
    out = [_SVG_HEAD.format(mode="timeline", w=width, h=height), f"<title>{_x(title)}</title>",
           f'<text x="16" y="20" font-weight="bold">{_x(title)}</text>']
    step = _nice_step(span)
    for i in range(int(span / step) + 1):
        x = left + i * step * scale
        out.append(f'<path d="M{x:.1f},{top - 6} V{height - 16}" stroke="#ddd"/>'
                   f'<text x="{x:.1f}" y="{top - 10}" text-anchor="middle">{i * step:g}s</text>')
    for row, lane in enumerate(lanes):
        out.append(f'<text x="8" y="{top + row * lane_h + 17}">{_x(lane)}</text>')
    for node, (start, finish) in timed:
        x, y = left + (start - t0) * scale, top + lanes.index(_where(node)) * lane_h + 3
        w = max(2.0, (finish - start) * scale)
        label = _x(node.name) if len(node.name) * _CHAR_W + 6 < w else ""
        out.append(f'<g class="bar" data-node="{_x(node.name)}"><title>{_x(node.name)} {node.kind} '
                   f'{start:.3f}–{finish:.3f}s</title><rect x="{x:.1f}" y="{y}" width="{w:.1f}" '
                   f'height="{lane_h - 6}" fill="{kind_colour(node.kind)}" stroke="#444" stroke-width="0.5"/>'
                   f'<text x="{x + 3:.1f}" y="{y + 14}">{label}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# -- HTML ----------------------------------------------------------------------------------------
_CSS = """
body{font:13px system-ui,sans-serif;margin:0;display:grid;grid-template-columns:1fr 380px;height:100vh}
header{grid-column:1/3;padding:6px 10px;border-bottom:1px solid #ccc;display:flex;gap:12px;align-items:center}
main{overflow:auto;padding:8px} aside{overflow:auto;border-left:1px solid #ccc;padding:8px;background:#fafafa}
body.fit main svg{width:100%;height:auto} [data-node]{cursor:pointer} pre{font-size:12px}
body.focus .node,body.focus .edge,body.focus .bar{opacity:.2}
body.focus .hl-self,body.focus .hl-in,body.focus .hl-out{opacity:1}
.hl-self rect{stroke:#000;stroke-width:3} .edge.hl-in path,.node.hl-in rect{stroke:#1f77b4;stroke-width:2.5}
.edge.hl-out path,.node.hl-out rect{stroke:#d62728;stroke-width:2.5}
pre .hl-self{background:#ffe58a} pre .hl-in{background:#d6e9f8} pre .hl-out{background:#f8d6d6}
aside table{border-collapse:collapse;font-size:12px}
aside td,aside th{padding:1px 6px 1px 0;text-align:left;vertical-align:top}
.in{color:#1f77b4} .out{color:#d62728}
"""

# Plain DOM calls (textContent, never innerHTML) so names and meta can't inject markup.
_JS = """
(() => {
const data = JSON.parse(document.getElementById("rp-data").textContent);
const nodes = Object.fromEntries(data.nodes.map(n => [n.name, n]));
const values = Object.fromEntries(data.values.map(v => [v.name, v]));
const panel = document.getElementById("rp-details");
const all = sel => document.querySelectorAll(sel);
const at = name => all(`[data-node="${CSS.escape(name)}"]`);
let pinned = null;
function fmt(n) { const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < 4) { n /= 1024; i++; } return i ? n.toFixed(1) + u[i] : n + "B"; }
function add(parent, tag, text, cls) { const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text; if (cls) e.className = cls; parent.appendChild(e); return e; }
function valueRows(title, cls, names, other) {
  if (!names.length) return;
  add(panel, "h4", title, cls); const t = add(panel, "table");
  for (const name of names) { const v = values[name], r = add(t, "tr");
    const cells = ["%" + name, fmt(v.nbytes), v.device + "/" + v.role, other(v), "live " + v.lifetime.join("→")];
    for (const s of cells) add(r, "td", s); }
}
function mark(cls, edges, end) {
  edges.forEach(e => { e.classList.add(cls); at(e.dataset[end]).forEach(x => x.classList.add(cls)); }); }
function clear() { all(".hl-self,.hl-in,.hl-out").forEach(e => e.classList.remove("hl-self", "hl-in", "hl-out"));
  document.body.classList.remove("focus"); }
function show(name) {
  clear(); panel.replaceChildren();
  if (!name || !nodes[name]) return void add(panel, "p", "Hover or click a node; click again or Esc to unpin.");
  const n = nodes[name], q = CSS.escape(name);
  document.body.classList.add("focus"); at(name).forEach(e => e.classList.add("hl-self"));
  mark("hl-in", all(`.edge[data-dst="${q}"]`), "src"); mark("hl-out", all(`.edge[data-src="${q}"]`), "dst");
  add(panel, "h3", "%" + n.name + (pinned ? " (pinned)" : ""));
  const facts = add(panel, "table");
  const rows = [["kind", n.kind + " (" + n.phase + ")"], ["model", n.model], ["engine", n.engine],
    ["stream", n.stream], ["placement", n.placement], ["args", JSON.stringify(n.args)],
    ...Object.entries(n.meta).filter(([k]) => k !== "stream" && k !== "placement")
      .map(([k, v]) => [k, JSON.stringify(v)])];
  for (const [k, v] of rows) if (v !== null && v !== undefined) {
    const r = add(facts, "tr"); add(r, "th", k); add(r, "td", v); }
  valueRows("inputs", "in", n.inputs, v => "from " + (v.producer ? "%" + v.producer : "graph input"));
  valueRows("outputs", "out", n.outputs, v => "to " + (v.consumers.map(c => "%" + c).join(", ") || "nobody"));
}
all("[data-node]").forEach(e => {
  e.addEventListener("mouseenter", () => { if (!pinned) show(e.dataset.node); });
  e.addEventListener("mouseleave", () => { if (!pinned) show(null); });
  e.addEventListener("click", () => { pinned = pinned === e.dataset.node ? null : e.dataset.node; show(pinned); });
});
document.addEventListener("keydown", ev => { if (ev.key === "Escape") { pinned = null; show(null); } });
document.getElementById("rp-fit").addEventListener("click", () => document.body.classList.toggle("fit"));
document.getElementById("rp-find").addEventListener("input", ev => {
  pinned = null; show(null); const q = ev.target.value.trim(); if (!q) return;
  document.body.classList.add("focus");
  all(".node,.bar").forEach(e => { if (e.dataset.node.includes(q)) e.classList.add("hl-self"); });
});
show(null);
})();
"""


def to_html(graph: IterationGraph, order: Iterable[str] | None = None, wrap: int = 16) -> str:
    """One self-contained page: the SVG, the timeline when timed, the table, and a details panel."""
    # Inline SVG needs no xmlns in HTML5; dropping it keeps the file free of any URL.
    strip = lambda svg: svg.replace(' xmlns="http://www.w3.org/2000/svg"', "", 1)  # noqa: E731
    parts = [strip(to_svg(graph, wrap=wrap, order=order))]
    if any(_seconds(n) is not None for n in graph):
        parts += ["<h2>timeline</h2>", strip(_timeline_svg(graph))]
    header, *rows = str(graph).splitlines()
    # Rows follow str(graph), i.e. topological order; tag each with its node for highlighting.
    table = [_x(header)] + [f'<span data-node="{_x(name)}">{_x(row)}</span>'
                            for name, row in zip(graph.topological_order(), rows)]
    data = json.dumps(to_json(graph, order), ensure_ascii=False).replace("<", "\\u003c")  # can't close <script>
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_x(graph.name)} — rollplex iteration graph</title><style>{_CSS}</style></head><body>",
        f"<header><b>{_x(graph.name)}</b> {len(graph)} nodes, {len(graph.values)} values"
        '<input id="rp-find" placeholder="find node…"><button id="rp-fit">fit width</button>'
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
