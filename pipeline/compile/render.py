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
from rollplex.pipeline.compile.overview import ALL, Overview, node_lines, overview, where

FORMATS = ("dot", "html", "json", "svg")
JSON_FORMAT = "rollplex.iteration-graph/2"  # 2: a value's facts (role, model, prompts, ...) replace "what"

# One fixed colour per builtin kind, so the same kind looks the same in every picture.
KIND_COLOURS = {
    "vit_encode": "#c6dbef", "prefix": "#9ecae1", "decode_chunk": "#fdd0a2", "suffix_score": "#a1d99b",
    "reward": "#fde68a", "advantage": "#fcbba1", "loss": "#dadaeb", "optimizer_step": "#bcbddc",
    "weight_sync": "#f4a6c6", "report": "#d9d9d9", "offload": "#c7e9c0", "prefetch": "#e0f3db",
    "env_step": "#fee391", "vit_observation": "#deebf7",
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
    return node_lines(node)


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


def to_svg(graph: IterationGraph, mode: str = "dag", wrap: int = 16, order: Iterable[str] | None = None,
           expand: Iterable[str] = ALL, edge_labels: bool = False) -> str:
    """Standalone SVG. ``mode="dag"``: layered drawing, one ``<g class="node">`` per node (``expand``:
    ``ALL``; else the groups it names are drawn node by node and the rest as one box per kind and model,
    ``<g class="group">``); ``edge_labels`` writes each edge's values, bytes and lifetime on it.
    ``mode="timeline"``: Gantt rows per placement/stream from ``meta["start"/"finish"]``."""
    if mode == "timeline":
        return _timeline_svg(graph)
    if mode != "dag":
        raise ConfigError(f"unknown SVG mode {mode!r}; choose one of dag, timeline")
    return _draw(graph, overview(graph, expand, order), wrap, order, edge_labels)


def _ports(ov: Overview, boxes) -> dict[tuple[str, str], tuple[float, float]]:
    """Where each edge leaves its source and enters its target: spread along the box's bottom and
    top in the order of the far ends, so a node that many edges enter (weight_sync, report) takes
    them side by side instead of in one point, where they tangled."""
    out: dict[tuple[str, str], list[float]] = {}
    for end, near, far in (("out", "src", "dst"), ("in", "dst", "src")):
        by: dict[str, list] = {}
        for e in ov.edges:
            by.setdefault(getattr(e, near), []).append(e)
        for key, edges in by.items():
            box = boxes[key]
            edges.sort(key=lambda e: boxes[getattr(e, far)].cx)
            for i, e in enumerate(edges):
                out.setdefault((e.src, e.dst), [0.0, 0.0])[end == "in"] = box.x + box.w * (i + 1) / (len(edges) + 1)
    return {k: (v[0], v[1]) for k, v in out.items()}


_MAX_LABELLED_EDGES = 400  # placing labels is quadratic in the edges; past this the tooltips carry them
_LABEL_CHAR_W = 6.0  # one 10px monospace character


class _LabelPlacer:
    """Puts each edge label at the first of a few points along its curve (the middle first) where it
    covers no box and no earlier label; a label with no such point is left to the edge's tooltip."""

    def __init__(self, boxes: list[tuple[float, float, float, float]]) -> None:
        self.taken = list(boxes)

    def place(self, text: str, *curve: tuple[float, float]) -> tuple[float, float] | None:
        w, h = len(text) * _LABEL_CHAR_W + 6, 13.0
        (ax, ay), (bx, by), (cx, cy), (dx, dy) = curve
        for side in (0.0, 0.5, -0.5, 1.0, -1.0):  # on the curve, else beside it
            for t in (0.5, 0.38, 0.62, 0.26, 0.74, 0.15, 0.85, 0.08, 0.92):
                u = 1 - t  # a point of the cubic Bezier the edge is drawn as
                x = u**3 * ax + 3 * u * u * t * bx + 3 * u * t * t * cx + t**3 * dx + side * (w + 4)
                y = u**3 * ay + 3 * u * u * t * by + 3 * u * t * t * cy + t**3 * dy
                rect = (x - w / 2, y - h / 2, w, h)
                if rect[0] >= 0 and not any(_overlap(rect, r) for r in self.taken):
                    self.taken.append(rect)
                    return x, y
        return None


def _overlap(a, b) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]


def _draw(graph: IterationGraph, ov: Overview, wrap: int, order, edge_labels: bool) -> str:
    lifetimes = graph.lifetimes(order)
    lines = {k: list(b.lines) for k, b in ov.boxes.items()}
    chars = min(44, max((len(s) for ls in lines.values() for s in ls), default=8))
    box_w, box_h = chars * _CHAR_W + 16, max(map(len, lines.values()), default=3) * 14 + 8
    legend, legend_w = _legend(graph, 8)
    order_of = list(ov.boxes)
    g = ov.digraph()
    # Edge labels need room between the layers.
    lay = layered_layout(g, order_of, box_w=box_w, box_h=box_h, top=48, wrap=wrap, gap_y=64 if edge_labels else 56)
    width = max(lay.width, legend_w)
    shift = (width - lay.width) / 2  # centre the drawing under a wider legend
    ports = _ports(ov, lay.boxes)
    placer = (_LabelPlacer([(b.x + shift, b.y, b.w, b.h) for b in lay.boxes.values()])
              if edge_labels and len(ov.edges) <= _MAX_LABELLED_EDGES else None)
    out = [_SVG_HEAD.format(mode="dag", w=width, h=lay.height), f"<title>{_x(graph.name)}</title>", _DEFS, *legend]
    out.append('<g class="edges" fill="none">')
    labels = []
    for e in ov.edges:
        a, b = lay.boxes[e.src], lay.boxes[e.dst]
        (px1, px2), y1, y2 = ports[(e.src, e.dst)], a.bottom, b.y
        x1, x2 = px1 + shift, px2 + shift
        bend = min(60.0, max(20.0, (y2 - y1) / 2))
        kind, dash = ("value", "") if e.values else ("order", ' stroke-dasharray="5,3"')
        colour = VALUE_EDGE_COLOUR if e.values else ORDER_EDGE_COLOUR
        shown = [_value_label(graph, n, lifetimes) for n in e.values[:12]]
        shown += [f"+{len(e.values) - 12} more"] if len(e.values) > 12 else []
        tip = "\n".join([f"{e.src} → {e.dst}: {e.label}"] + (shown or [f"order: {', '.join(e.reasons)}"]))
        out.append(f'<g class="edge" data-src="{_x(e.src)}" data-dst="{_x(e.dst)}"><title>{_x(tip)}</title>'
                   f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} {x2:.1f},{y2:.1f}" '
                   f'stroke="{colour}"{dash} marker-end="url(#rp-arrow-{kind})"/></g>')
        spot = placer.place(e.label, (x1, y1), (x1, y1 + bend), (x2, y2 - bend), (x2, y2)) if placer else None
        if spot is not None:  # over a white halo, so crossing lines don't hide it
            labels.append(f'<text class="edge-label" data-src="{_x(e.src)}" data-dst="{_x(e.dst)}" '
                          f'x="{spot[0]:.1f}" y="{spot[1] + 3.5:.1f}" text-anchor="middle" font-size="10" '
                          f'fill="{colour}" stroke="#fff" stroke-width="3" paint-order="stroke">{_x(e.label)}</text>')
    out.append("</g>")
    if labels:
        out += ['<g class="edge-labels">', *labels, "</g>"]
    out.append('<g class="nodes">')
    for key, box_info in ov.boxes.items():
        box = lay.boxes[key]
        if box_info.is_group:
            names = box_info.members
            tip = "\n".join([f"{len(names)} {box_info.lines[0].rsplit(' ×', 1)[0]} nodes (double-click to expand):",
                             *names[:20], *([f"… {len(names) - 20} more"] if len(names) > 20 else [])])
            attrs = f'class="group" data-box="{_x(key)}"'
        else:
            node = graph.nodes[key]
            extra = [f"{k}={v!r}"[:100] for k, v in sorted(node.meta.items()) if k not in _SHOWN_META]
            tip = "\n".join(graph.format_node(node, lifetimes).split(" = ", 1) + extra)
            attrs = f'class="node" data-node="{_x(key)}" data-box="{_x(key)}"'
        texts = "".join(
            f'<text x="8" y="{15 + 14 * i}"{_BOLD if i == 0 else ""}>{_x(_fit(s, chars))}</text>'
            for i, s in enumerate(lines[key]))
        stack = (f'<rect x="4" y="4" width="{box.w:.1f}" height="{box.h:.1f}" rx="6" fill="{kind_colour(box_info.kind)}" '
                 f'stroke="#444"/>' if box_info.is_group else "")  # a group: a second card behind it
        out.append(f'<g {attrs} transform="translate({box.x + shift:.1f},{box.y:.1f})"><title>{_x(tip)}</title>'
                   f'{stack}<rect width="{box.w:.1f}" height="{box.h:.1f}" rx="6" fill="{kind_colour(box_info.kind)}" '
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
    parts = [f'<div class="view" data-view="{_x(name)}"{" hidden" if name != "groups" else ""}>'
             + strip(_draw(graph, overview(graph, expand, order), wrap, order, edge_labels=True)) + "</div>"
             for name, expand in views]
    if any(_seconds(n) is not None for n in graph):
        parts += ["<h2>timeline</h2>", strip(_timeline_svg(graph))]
    header, *rows = str(graph).splitlines()
    # Rows follow str(graph), i.e. topological order; tag each with its node for highlighting.
    table = [_x(header)] + [f'<span data-node="{_x(name)}">{_x(row)}</span>'
                            for name, row in zip(graph.topological_order(), rows)]
    data = dict(to_json(graph, order), groups=_group_facts(graph, grouped))
    data = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")  # can't close <script>
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_x(graph.name)} — rollplex iteration graph</title><style>{_CSS}</style></head><body>",
        f"<header><b>{_x(graph.name)}</b> {len(graph)} nodes, {len(graph.values)} values · "
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
