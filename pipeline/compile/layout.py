"""Layered (Sugiyama-style) layout of a DAG for drawing, in pure Python (no graphviz binary).

Three pure steps, each a function of the graph's structure and a tie-break order of its nodes, never
of node names, so two namings of one graph get the same picture:

1. layer: a node's layer is the length of the longest path from a source to it, so every edge
   points down and independent work lines up side by side.
2. order: within a layer, nodes are sorted by the barycentre of their neighbours' x positions,
   sweeping down (predecessors) then up (successors) a few times; the order with the fewest
   crossings between adjacent layers wins. There are no dummy nodes: an edge that skips layers is
   drawn as a curve, which keeps layers narrow and this module short.
3. place: a layer wider than ``wrap`` boxes is split into k staggered rows (node i of the layer goes
   to row i % k), which keeps the left-to-right order of the whole layer while bounding the width.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx


@dataclass(frozen=True)
class Box:
    x: float  # top-left corner
    y: float
    w: float
    h: float

    @property
    def cx(self) -> float:
        return self.x + self.w / 2

    @property
    def bottom(self) -> float:
        return self.y + self.h


@dataclass(frozen=True)
class Layout:
    layers: tuple[tuple[str, ...], ...]  # top to bottom, each left to right
    boxes: Mapping[str, Box]
    width: float
    height: float


def longest_path_layers(g: nx.DiGraph, order: Sequence[str] | None = None) -> list[list[str]]:
    """Layer of each node = longest path from any source; within a layer, nodes keep ``order``."""
    index = {n: i for i, n in enumerate(order if order is not None else g.nodes)}
    level: dict[str, int] = {}
    for n in nx.lexicographical_topological_sort(g, key=index.__getitem__):
        level[n] = max((level[p] + 1 for p in g.predecessors(n)), default=0)
    layers: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for n in sorted(level, key=index.__getitem__):
        layers[level[n]].append(n)
    return layers


def _rows(n: int, wrap: int) -> int:
    return max(1, math.ceil(n / wrap))


def _offsets(layers: list[list[str]], wrap: int) -> dict[str, float]:
    """x of each node in units of one box pitch, relative to the drawing's centre line."""
    out = {}
    for layer in layers:
        k = _rows(len(layer), wrap)
        for i, n in enumerate(layer):
            out[n] = (i - (len(layer) - 1) / 2) / k
    return out


def _crossings(g: nx.DiGraph, layers: list[list[str]]) -> int:
    total = 0
    for upper, lower in zip(layers, layers[1:]):
        pos_u = {n: i for i, n in enumerate(upper)}
        pos_l = {n: i for i, n in enumerate(lower)}
        edges = sorted((pos_u[u], pos_l[v]) for u in upper for v in g.successors(u) if v in pos_l)
        # Edges sorted by upper end: each later edge whose lower end is left of ours crosses it.
        total += sum(1 for i, (a, b) in enumerate(edges) for c, d in edges[i + 1:] if c > a and d < b)
    return total


def order_layers(g: nx.DiGraph, layers: list[list[str]], sweeps: int = 4, wrap: int = 16) -> list[list[str]]:
    """Barycentre sweeps (down, up, down, ...); returns the order with the fewest crossings."""
    current = [list(layer) for layer in layers]
    best, best_cross = [list(layer) for layer in current], _crossings(g, current)
    for sweep in range(sweeps):
        down = sweep % 2 == 0
        indices = range(1, len(current)) if down else range(len(current) - 2, -1, -1)
        for li in indices:
            x = _offsets(current, wrap)
            neighbours = g.predecessors if down else g.successors

            def key(n: str) -> float:
                near = [x[m] for m in neighbours(n)]
                return sum(near) / len(near) if near else x[n]

            current[li] = sorted(current[li], key=key)  # stable: ties keep the previous order
        cross = _crossings(g, current)
        if cross < best_cross:
            best, best_cross = [list(layer) for layer in current], cross
    return best


def layered_layout(
    g: nx.DiGraph,
    order: Sequence[str] | None = None,
    *,
    box_w: float = 180,
    box_h: float = 48,
    gap_x: float = 24,
    gap_y: float = 56,
    row_gap: float = 14,
    margin: float = 16,
    top: float = 0,
    wrap: int = 16,
    sweeps: int = 4,
) -> Layout:
    """Place every node of ``g`` in a box; ``top`` leaves room above the drawing (for a legend)."""
    wrap = max(1, wrap)
    layers = order_layers(g, longest_path_layers(g, order), sweeps, wrap)
    pitch = box_w + gap_x
    half = max(((len(layer) - 1) / 2 / _rows(len(layer), wrap) * pitch for layer in layers), default=0.0)
    centre = margin + half + box_w / 2
    x = _offsets(layers, wrap)
    boxes: dict[str, Box] = {}
    y = top + margin
    for layer in layers:
        k = _rows(len(layer), wrap)
        for i, n in enumerate(layer):
            boxes[n] = Box(centre + x[n] * pitch - box_w / 2, y + (i % k) * (box_h + row_gap), box_w, box_h)
        y += k * (box_h + row_gap) - row_gap + gap_y
    height = (y - gap_y + margin) if layers else top + 2 * margin
    return Layout(tuple(tuple(layer) for layer in layers), boxes, 2 * centre, height)
