"""What a picture of an iteration draws: boxes and edges, with the per-prompt nodes grouped.

``overview(graph)`` is a pure function of the graph: nodes of one kind and model (``reward`` × 8,
``prefix[ref]`` × 8, ...) become one box with a count, so an iteration of any batch size reads at a
glance; ``expand`` names groups to draw node by node, and ``expand=ALL`` draws every node. An edge
carries the values that cross it, their bytes and their lifetime (the node that reads them last);
an edge without values is an ordering. Boxes say where their nodes run: engine, placement (``rank0``
when the graph is not split over ranks: one worker runs it all) and stream.

Grouping can close a cycle. Through an ordering edge (the accumulation order runs ``suffix_score``
and ``loss`` of one micro-batch before the next one's) the grouped picture leaves that edge out and
lists it as ``Overview.folded``: the expanded picture shows it. Through values alone, the groups on
the cycle are drawn node by node. Either way the picture stays a DAG the layered layout can draw.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx

from rollplex.pipeline.compile.ir import IterationGraph, Node, format_bytes

ALL = frozenset({"*"})  # expand every group: one box per node


@dataclass(frozen=True)
class Box:
    key: str                  # the box's id in a drawing: a node's name, or "group:<kind>[<model>]"
    kind: str
    members: tuple[str, ...]  # the nodes it stands for, in insertion order
    lines: tuple[str, ...]    # its text, the title first

    @property
    def is_group(self) -> bool:
        return self.key.startswith("group:")


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    values: tuple[str, ...]   # the values that cross it (none: an ordering edge)
    nbytes: int
    reasons: tuple[str, ...]  # why, for an ordering edge
    label: str                # what a picture writes on it


@dataclass(frozen=True)
class Overview:
    name: str
    boxes: dict[str, Box]     # in the graph's insertion order
    edges: tuple[Edge, ...]   # sorted by the boxes' order
    group_of: dict[str, str]  # node -> its box's key
    folded: tuple[Edge, ...] = ()  # ordering edges left out: each closed a cycle between groups

    def digraph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        g.add_nodes_from(self.boxes)
        g.add_edges_from((e.src, e.dst) for e in self.edges)
        return g


def placement(node: Node) -> str:
    return node.meta.get("placement") or "rank0"


def where(node: Node) -> str:
    return f"{placement(node)}/{node.stream}"


def _span(items: Iterable[str]) -> str:
    """Distinct items in first-seen order, shortened past three: "rank0/decode, rank1/decode"."""
    seen = list(dict.fromkeys(items))
    return ", ".join(seen) if len(seen) <= 3 else f"{seen[0]} … {seen[-1]} ({len(seen)})"


def node_lines(node: Node) -> list[str]:
    """name / kind[model] / @engine · placement/stream · priority / start–finish, as present."""
    prio = node.meta.get("priority")
    lines = [node.name, node.kind + (f"[{node.model}]" if node.model else ""),
             (f"@{node.engine} · " if node.engine else "") + where(node)
             + (f" · prio {prio:g}" if isinstance(prio, (int, float)) else "")]
    start, finish = node.meta.get("start"), node.meta.get("finish")
    if isinstance(start, (int, float)) and isinstance(finish, (int, float)) and finish >= start:
        lines.append(f"{start:.3f}–{finish:.3f}s")
    if node.meta.get("weights"):  # weight_sync: what the sharing plan aliases and rebuilds (its first clause)
        short = str(node.meta["weights"]).split(";")[0]
        lines.append(short if len(short) <= 34 else short[:33] + "…")
    return lines


def _group_lines(graph: IterationGraph, members: list[str]) -> list[str]:
    first = graph.nodes[members[0]]
    nodes = [graph.nodes[m] for m in members]
    engines = _span(f"@{n.engine}" for n in nodes if n.engine)
    return [f"{first.kind}{f'[{first.model}]' if first.model else ''} ×{len(members)}",
            f"{first.kind_info.phase}" + (f" · {engines}" if engines else ""), _span(where(n) for n in nodes)]


def _cluster(graph: IterationGraph, expand: frozenset[str]) -> dict[str, str]:
    """node -> box key: one box per (kind, model) of two or more nodes, unless expanded or on a cycle."""
    members: dict[tuple, list[str]] = {}
    for node in graph:
        members.setdefault((node.kind, node.model), []).append(node.name)
    keys = {k: f"group:{k[0]}" + (f"[{k[1]}]" if k[1] else "") for k in members}
    open_ = set() if expand != ALL else set(members)
    open_ |= {k for k, key in keys.items() if key in expand}
    while True:
        box = {n: (keys[k] if len(ns) > 1 and k not in open_ else n) for k, ns in members.items() for n in ns}
        g = nx.DiGraph()
        g.add_nodes_from(set(box.values()))
        g.add_edges_from((box[u], box[v]) for u, v, d in graph.g.edges(data=True) if box[u] != box[v] and d.get("values"))
        cyclic = {b for scc in nx.strongly_connected_components(g) if len(scc) > 1 for b in scc}
        closing = {k for k, key in keys.items() if key in cyclic and k not in open_}
        if not closing:
            return box
        open_ |= closing


def overview(graph: IterationGraph, expand: Iterable[str] = (), order: Iterable[str] | None = None) -> Overview:
    """The boxes and edges of a picture of ``graph``; ``expand``: group keys to draw node by node, or ``ALL``."""
    expand = ALL if expand == ALL else frozenset(expand)
    box_of = _cluster(graph, expand)
    lifetimes = graph.lifetimes(order)
    members: dict[str, list[str]] = {}
    for name in graph.nodes:
        members.setdefault(box_of[name], []).append(name)
    boxes = {}
    for key, ms in members.items():
        node = graph.nodes[ms[0]]
        lines = _group_lines(graph, ms) if key.startswith("group:") else node_lines(node)
        boxes[key] = Box(key, node.kind, tuple(ms), tuple(lines))
    crossing: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    for u, v, data in graph.g.edges(data=True):
        a, b = box_of[u], box_of[v]
        if a == b:
            continue
        values, reasons = crossing.setdefault((a, b), ([], []))
        values += [x for x in data.get("values", ()) if x not in values]
        if not data.get("values"):
            reasons.append(data.get("reason", "order"))
    index = {k: i for i, k in enumerate(boxes)}
    position = {n: i for i, n in enumerate(order or graph.topological_order())}
    edges = []
    for (a, b), (values, reasons) in sorted(crossing.items(), key=lambda kv: (index[kv[0][0]], index[kv[0][1]])):
        nbytes = sum(graph.values[x].nbytes for x in values)
        if values:
            last = max((lifetimes[x][1] for x in values), key=position.__getitem__)
            end = boxes[box_of[last]].lines[0].rsplit(" ×", 1)[0] if box_of[last].startswith("group:") else last
            what = f"%{values[0]}" if len(values) == 1 else f"{len(values)}×"
            label = f"{what} {format_bytes(nbytes)} live→{end}"
        else:
            label = "order: " + ", ".join(dict.fromkeys(reasons))
        edges.append(Edge(a, b, tuple(values), nbytes, tuple(dict.fromkeys(reasons)), label))
    folded = []
    g = nx.DiGraph((e.src, e.dst, {"edge": e}) for e in edges)
    while True:  # value edges alone are acyclic (_cluster): an ordering edge closes each cycle left
        try:
            cycle = nx.find_cycle(g)
        except nx.NetworkXNoCycle:
            break
        u, v = next((u, v) for u, v in cycle if not g.edges[u, v]["edge"].values)
        folded.append(g.edges[u, v]["edge"])
        g.remove_edge(u, v)
    kept = tuple(e for e in edges if e not in folded)
    return Overview(graph.name, boxes, kept, box_of, tuple(folded))
