"""Draw an ``IterationGraph`` as SVG: the layered DAG (every node, or grouped per kind and model with
chosen groups expanded) and the timeline of a scheduled iteration.

Pure functions of the graph that return text, for ``render`` (``to_svg``, and the pictures its HTML
page inlines) and for the colours every picture shares (``kind_colour``). Nothing needs the graphviz
binary: boxes are placed by the pure-Python layered layout in ``rollplex.pipeline.compile.layout``.
"""
from __future__ import annotations

import html
import math
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from rollplex.errors import ConfigError
from rollplex.pipeline.compile.ir import IterationGraph, Node, format_bytes, registered_kinds
from rollplex.pipeline.compile.layout import layered_layout
from rollplex.pipeline.compile.overview import ALL, Overview, overview

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


def lane_of(node: Node) -> str:
    """Where a node runs, as a timeline lane and a DOT cluster: its stream, after its placement if any."""
    place = node.meta.get("placement")
    return f"{place}/{node.stream}" if place else node.stream


def seconds_of(node: Node) -> tuple[float, float] | None:
    """(start, finish) in seconds, where a scheduling pass timed the node."""
    start, finish = node.meta.get("start"), node.meta.get("finish")
    if isinstance(start, (int, float)) and isinstance(finish, (int, float)) and finish >= start:
        return float(start), float(finish)
    return None


def value_label(graph: IterationGraph, name: str, lifetimes: Mapping[str, tuple[str, str]]) -> str:
    return f"{name} {format_bytes(graph.values[name].nbytes)} live→%{lifetimes[name][1]}"


def escape(text: Any) -> str:
    """Text as SVG/HTML character data or an attribute value."""
    return html.escape(str(text), quote=True)


# -- the DAG -------------------------------------------------------------------------------------
def _fit(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: max(1, chars - 1)] + "…"


def _legend(graph: IterationGraph, y: float) -> tuple[list[str], float]:
    """Swatches for the kinds present, in registration order, plus the ordering-edge style."""
    present = {n.kind for n in graph}
    kinds = [k for k in registered_kinds() if k in present]
    out = ['<g class="legend">', f'<text x="16" y="{y + 14}" font-weight="bold">'
           f'{escape(graph.name)}: {len(graph)} nodes, {len(graph.values)} values</text>']
    x, y = 16.0, y + 26
    for k in kinds:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" rx="2" fill="{kind_colour(k)}" stroke="#444"/>'
                   f'<text x="{x + 16}" y="{y + 10}">{escape(k)}</text>')
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
        return draw_timeline(graph)
    if mode != "dag":
        raise ConfigError(f"unknown SVG mode {mode!r}; choose one of dag, timeline")
    return draw_dag(graph, overview(graph, expand, order), wrap, order, edge_labels)


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


def draw_dag(graph: IterationGraph, ov: Overview, wrap: int, order, edge_labels: bool) -> str:
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
    out = [_SVG_HEAD.format(mode="dag", w=width, h=lay.height), f"<title>{escape(graph.name)}</title>", _DEFS, *legend]
    out.append('<g class="edges" fill="none">')
    labels = []
    for e in ov.edges:
        a, b = lay.boxes[e.src], lay.boxes[e.dst]
        (px1, px2), y1, y2 = ports[(e.src, e.dst)], a.bottom, b.y
        x1, x2 = px1 + shift, px2 + shift
        bend = min(60.0, max(20.0, (y2 - y1) / 2))
        kind, dash = ("value", "") if e.values else ("order", ' stroke-dasharray="5,3"')
        colour = VALUE_EDGE_COLOUR if e.values else ORDER_EDGE_COLOUR
        shown = [value_label(graph, n, lifetimes) for n in e.values[:12]]
        shown += [f"+{len(e.values) - 12} more"] if len(e.values) > 12 else []
        tip = "\n".join([f"{e.src} → {e.dst}: {e.label}"] + (shown or [f"order: {', '.join(e.reasons)}"]))
        out.append(f'<g class="edge" data-src="{escape(e.src)}" data-dst="{escape(e.dst)}"><title>{escape(tip)}</title>'
                   f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} {x2:.1f},{y2:.1f}" '
                   f'stroke="{colour}"{dash} marker-end="url(#rp-arrow-{kind})"/></g>')
        spot = placer.place(e.label, (x1, y1), (x1, y1 + bend), (x2, y2 - bend), (x2, y2)) if placer else None
        if spot is not None:  # over a white halo, so crossing lines don't hide it
            labels.append(f'<text class="edge-label" data-src="{escape(e.src)}" data-dst="{escape(e.dst)}" '
                          f'x="{spot[0]:.1f}" y="{spot[1] + 3.5:.1f}" text-anchor="middle" font-size="10" '
                          f'fill="{colour}" stroke="#fff" stroke-width="3" paint-order="stroke">{escape(e.label)}</text>')
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
            attrs = f'class="group" data-box="{escape(key)}"'
        else:
            node = graph.nodes[key]
            extra = [f"{k}={v!r}"[:100] for k, v in sorted(node.meta.items()) if k not in _SHOWN_META]
            tip = "\n".join(graph.format_node(node, lifetimes).split(" = ", 1) + extra)
            attrs = f'class="node" data-node="{escape(key)}" data-box="{escape(key)}"'
        texts = "".join(
            f'<text x="8" y="{15 + 14 * i}"{_BOLD if i == 0 else ""}>{escape(_fit(s, chars))}</text>'
            for i, s in enumerate(lines[key]))
        stack = (f'<rect x="4" y="4" width="{box.w:.1f}" height="{box.h:.1f}" rx="6" fill="{kind_colour(box_info.kind)}" '
                 f'stroke="#444"/>' if box_info.is_group else "")  # a group: a second card behind it
        out.append(f'<g {attrs} transform="translate({box.x + shift:.1f},{box.y:.1f})"><title>{escape(tip)}</title>'
                   f'{stack}<rect width="{box.w:.1f}" height="{box.h:.1f}" rx="6" fill="{kind_colour(box_info.kind)}" '
                   f'stroke="#444"/>{texts}</g>')
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


# -- the timeline --------------------------------------------------------------------------------
def _nice_step(span: float, ticks: int = 8) -> float:
    raw = span / ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def draw_timeline(graph: IterationGraph, px: float = 1200) -> str:
    timed = [(n, t) for n in graph if (t := seconds_of(n)) is not None]
    if not timed:
        raise ConfigError(f"timeline needs node.meta['start'] and ['finish'] (seconds) from a scheduling pass; "
                          f"none of the {len(graph)} nodes of {graph.name!r} has them")
    lanes = sorted({lane_of(n) for n, _ in timed})
    t0, t1 = min(t[0] for _, t in timed), max(t[1] for _, t in timed)
    span = max(t1 - t0, 1e-9)
    scale, left, lane_h, top = px / span, max(len(s) for s in lanes) * _CHAR_W + 24, 26, 56
    width, height = left + px + 24, top + lane_h * len(lanes) + 16
    untimed = len(graph) - len(timed)
    title = f"{graph.name}: timeline of {len(timed)} nodes, {span:.3f}s"
    title += f" ({untimed} unscheduled)" if untimed else ""
    out = [_SVG_HEAD.format(mode="timeline", w=width, h=height), f"<title>{escape(title)}</title>",
           f'<text x="16" y="20" font-weight="bold">{escape(title)}</text>']
    step = _nice_step(span)
    for i in range(int(span / step) + 1):
        x = left + i * step * scale
        out.append(f'<path d="M{x:.1f},{top - 6} V{height - 16}" stroke="#ddd"/>'
                   f'<text x="{x:.1f}" y="{top - 10}" text-anchor="middle">{i * step:g}s</text>')
    for row, lane in enumerate(lanes):
        out.append(f'<text x="8" y="{top + row * lane_h + 17}">{escape(lane)}</text>')
    for node, (start, finish) in timed:
        x, y = left + (start - t0) * scale, top + lanes.index(lane_of(node)) * lane_h + 3
        w = max(2.0, (finish - start) * scale)
        label = escape(node.name) if len(node.name) * _CHAR_W + 6 < w else ""
        out.append(f'<g class="bar" data-node="{escape(node.name)}"><title>{escape(node.name)} {node.kind} '
                   f'{start:.3f}–{finish:.3f}s</title><rect x="{x:.1f}" y="{y}" width="{w:.1f}" '
                   f'height="{lane_h - 6}" fill="{kind_colour(node.kind)}" stroke="#444" stroke-width="0.5"/>'
                   f'<text x="{x + 3:.1f}" y="{y + 14}">{label}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
