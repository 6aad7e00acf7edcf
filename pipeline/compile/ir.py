"""The iteration IR: a small typed DAG of nodes and the values that flow between them.

A ``Node`` is one unit of work (one prompt's ref prefix, one decode chunk, ...). A ``Value`` is one
tensor bundle with a producer, consumers, a byte estimate and a device. ``IterationGraph`` holds both
on a networkx DiGraph whose edges carry the value names, prints as a one-line-per-node table, and
``lint()`` rejects malformed graphs with errors that name the node. Passes never change a node's
fields; what a pass decides (stream, order, residency) goes into the node's ``meta`` dict or into a
separate plan object keyed by node name.
"""
from __future__ import annotations

import contextlib
import gc
import heapq
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import networkx as nx

from rollplex.errors import GraphError


@contextlib.contextmanager
def gc_paused():
    """Building, copying and planning a graph allocate many small acyclic objects next to a big
    heap (the graph); the cyclic collector would rescan that heap again and again for nothing
    (half of a 10k-node compile, 30–50% of its plan). Paused for the block, restored after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True)
class NodeKind:
    """What a node does, which engine role runs it, and where it runs by default.

    ``phase`` groups kinds into the serial runtime's phases (rollout → score → train → sync); the
    serial schedule puts barriers between phases, the rollplex schedule does not.
    """

    name: str
    role: str | None  # engine role that executes it: "decode" | "score" | "train" | None (host)
    stream: str  # default stream: "decode" | "compute" | "host" (small CPU work beside both)
    phase: str  # "rollout" | "prefix" | "score" | "train" | "sync"
    description: str = ""


PHASES = ("rollout", "prefix", "score", "train", "sync")

_KINDS: dict[str, NodeKind] = {}


def register_kind(kind: NodeKind) -> NodeKind:
    """Register a node kind. Refuses duplicates, so a plugin can never silently replace a builtin."""
    if kind.name in _KINDS:
        raise GraphError(f"node kind {kind.name!r} is registered already; pick another name")
    if kind.phase not in PHASES:
        raise GraphError(f"node kind {kind.name!r}: phase {kind.phase!r} is not one of {PHASES}")
    _KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> NodeKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise GraphError(f"unknown node kind {name!r}; registered kinds: {', '.join(sorted(_KINDS))}") from None


def registered_kinds() -> Mapping[str, NodeKind]:
    return MappingProxyType(_KINDS)


for _kind in (
    NodeKind("vit_encode", "score", "compute", "prefix", "vision-tower forward of one prompt's images"),
    NodeKind("prefix", "score", "compute", "prefix", "LM forward over one prompt: KV cache + last logits"),
    NodeKind("decode_chunk", "decode", "decode", "rollout", "advance live sequences by up to K tokens"),
    NodeKind("suffix_score", "score", "compute", "score", "per-token outputs of G responses on a prefix"),
    NodeKind("reward", None, "host", "score", "verifiable reward of one prompt's responses"),
    NodeKind("advantage", None, "host", "score", "advantages from rewards"),
    NodeKind("loss", "train", "compute", "train", "loss of one micro-batch, then its backward"),
    NodeKind("optimizer_step", "train", "compute", "train", "apply accumulated gradients"),
    NodeKind("weight_sync", "decode", "decode", "sync", "load the new actor weights into the decode engine"),
    NodeKind("report", None, "host", "sync", "gather host-side records and metrics of the iteration"),
    NodeKind("gather", None, "host", "sync", "merge the ranks' host-side records (data-parallel runs)"),
    NodeKind("custom", None, "host", "score", "a host function of the algorithm's own (Algorithm.node)"),
    NodeKind("join", None, "host", "score", "hand per-chunk scores on under per-prompt names (stage fusion)"),
    NodeKind("offload", None, "compute", "sync", "move a value from HBM to host memory"),
    NodeKind("prefetch", None, "compute", "sync", "bring an offloaded value back to HBM"),
):
    register_kind(_kind)


@dataclass(frozen=True)
class Value:
    """A tensor bundle passed between nodes. ``nbytes`` is an estimate used by planning."""

    name: str
    producer: str | None  # None for a graph input (fed by the executor, like an fx placeholder)
    nbytes: int = 0
    device: str = "device"  # "device" (GPU/worker memory) or "host"
    what: str = "tensor"  # e.g. "kv", "embeddings", "logprobs", "records"


@dataclass(frozen=True)
class Node:
    name: str
    kind: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    model: str | None = None  # which model the node runs: "actor", "ref", ...
    engine: str | None = None  # engine name chosen by config for this node's role
    args: Mapping[str, Any] = field(default_factory=dict)  # static parameters: prompt index, chunk, ...
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # pass results (stream, order, ...)

    def __post_init__(self) -> None:
        get_kind(self.kind)  # raises with the registered names if unknown
        if not isinstance(self.name, str) or not self.name or not all(c.isalnum() or c in "_-." for c in self.name):
            raise GraphError(f"node name {self.name!r} must be non-empty letters, digits, '_', '-' or '.'")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "args", MappingProxyType(dict(self.args)))

    @property
    def kind_info(self) -> NodeKind:
        return get_kind(self.kind)

    @property
    def stream(self) -> str:
        return self.meta.get("stream", self.kind_info.stream)

    def __reduce__(self):  # MappingProxyType does not pickle; Dask ships nodes to workers
        return (_rebuild_node, (self.name, self.kind, self.inputs, self.outputs, self.model, self.engine,
                                dict(self.args), dict(self.meta)))


def _rebuild_node(name, kind, inputs, outputs, model, engine, args, meta) -> Node:
    return Node(name, kind, inputs, outputs, model, engine, args, meta)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


class IterationGraph:
    """One RL iteration as a DAG. Nodes in insertion order; edges carry the value names they move.

    ``extra edges`` (``add_order``) are pure ordering constraints that a schedule adds, such as the
    serial runtime's phase barriers; they carry no value.
    """

    def __init__(self, name: str = "iteration") -> None:
        self.name = name
        self.g = nx.DiGraph()
        self.nodes: dict[str, Node] = {}
        self.values: dict[str, Value] = {}
        self.meta: dict[str, Any] = {}

    # -- building -----------------------------------------------------------------------------
    def add(self, node: Node, **value_info: Mapping[str, Any]) -> Node:
        """Add a node. ``value_info[out] = dict(nbytes=..., device=..., what=...)`` describes outputs."""
        if node.name in self.nodes:
            raise GraphError(f"duplicate node name %{node.name}; every node needs a unique name")
        self.nodes[node.name] = node
        self.g.add_node(node.name)
        for out in node.outputs:
            if out in self.values:
                raise GraphError(
                    f"value {out!r} is produced by both %{self.values[out].producer} and %{node.name}"
                )
            info = dict(value_info.get(out, {}))
            self.values[out] = Value(out, node.name, **info)
        return node

    def add_input(self, name: str, nbytes: int = 0, device: str = "host", what: str = "input") -> Value:
        if name in self.values:
            raise GraphError(f"graph input {name!r} duplicates a value of the same name")
        self.values[name] = Value(name, None, nbytes, device, what)
        return self.values[name]

    @property
    def inputs(self) -> list[str]:
        return [v.name for v in self.values.values() if v.producer is None]

    def add_order(self, before: str, after: str, reason: str = "order") -> None:
        for n in (before, after):
            if n not in self.nodes:
                raise GraphError(f"ordering edge names unknown node %{n}")
        if before == after:
            return
        data = self.g.get_edge_data(before, after)
        if data is None:
            self.g.add_edge(before, after, values=(), reason=reason)

    def connect(self) -> "IterationGraph":
        """Derive value edges producer → consumer from the nodes' declared inputs."""
        for node in self.nodes.values():
            for value_name in node.inputs:
                value = self.values.get(value_name)
                if value is None or value.producer is None:
                    continue  # graph inputs have no edge; lint reports dangling inputs by node
                data = self.g.get_edge_data(value.producer, node.name)
                if data is None:
                    self.g.add_edge(value.producer, node.name, values=(value_name,), reason="value")
                elif value_name not in data["values"]:
                    data["values"] = data["values"] + (value_name,)
                    data["reason"] = "value"
        return self

    # -- queries ------------------------------------------------------------------------------
    def consumers(self, value_name: str) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes.values() if value_name in n.inputs)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def of_kind(self, kind: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind == kind]

    def topological_order(self) -> list[str]:
        """Deterministic topological order: ties broken by insertion order, never by name."""
        # Kahn's algorithm over a heap of insertion indices: the order networkx's
        # lexicographical_topological_sort gives with that key, at a third of its cost on 10k nodes.
        names = list(self.nodes)
        index = {name: i for i, name in enumerate(names)}
        succ = self.g.succ
        waiting = {name: len(preds) for name, preds in self.g.pred.items()}
        ready = [index[n] for n in names if waiting[n] == 0]
        heapq.heapify(ready)
        order: list[str] = []
        while ready:
            name = names[heapq.heappop(ready)]
            order.append(name)
            for after in succ[name]:
                waiting[after] -= 1
                if waiting[after] == 0:
                    heapq.heappush(ready, index[after])
        if len(order) < len(names):
            self.lint()  # raises a GraphError that names the cycle
            raise nx.NetworkXUnfeasible("graph contains a cycle")
        return order

    def lifetimes(self, order: Iterable[str] | None = None) -> dict[str, tuple[str, str]]:
        """value → (produced by, last used by) under ``order`` (default: topological order)."""
        position = {n: i for i, n in enumerate(order or self.topological_order())}
        result = {}
        for value in self.values.values():
            users = self.consumers(value.name)
            first = value.producer or (min(users, key=position.__getitem__) if users else "")
            last = max(users, key=position.__getitem__) if users else first
            result[value.name] = (first, last)
        return result

    # -- validation ---------------------------------------------------------------------------
    def lint(self) -> "IterationGraph":
        """Raise ``GraphError`` naming the first problem: unknown kinds, dangling inputs, missing value
        edges (nodes added after ``connect()``), cycles."""
        for node in self.nodes.values():
            try:
                get_kind(node.kind)
            except GraphError as exc:
                raise GraphError(f"%{node.name}: {exc}") from None
            for value_name in node.inputs:
                if value_name not in self.values:
                    known = ", ".join(sorted(self.values)[:8])
                    raise GraphError(
                        f"%{node.name} reads value {value_name!r}, which no node produces "
                        f"(known values include: {known})"
                    )
                producer = self.values[value_name].producer
                if producer is not None and not self.g.has_edge(producer, node.name):
                    raise GraphError(
                        f"%{node.name} reads {value_name!r} from %{producer}, but the graph has no edge "
                        f"%{producer} -> %{node.name}; call connect() after adding nodes"
                    )
        if nx.is_directed_acyclic_graph(self.g):  # linear; find_cycle is far slower on big graphs
            return self
        try:
            cycle = nx.find_cycle(self.g)
        except nx.NetworkXNoCycle:
            return self
        path = " -> ".join(f"%{u}" for u, _ in cycle) + f" -> %{cycle[0][0]}"
        raise GraphError(f"the iteration graph has a cycle: {path}; a node cannot depend on its own output")

    # -- printing -----------------------------------------------------------------------------
    def format_node(self, node: Node, lifetimes: Mapping[str, tuple[str, str]] | None = None) -> str:
        kind = node.kind + (f"[model={node.model}]" if node.model else "")
        args = ", ".join(f"%{v}" for v in node.inputs)
        outs = sum(self.values[o].nbytes for o in node.outputs)
        place = node.meta.get("placement", "")
        stream = node.stream
        where = f"{place}/{stream}" if place else stream
        live = ""
        if lifetimes is not None and node.outputs:
            ends = sorted({lifetimes[o][1] for o in node.outputs})
            live = " live→" + ",".join(f"%{e}" for e in ends)
        engine = f" @{node.engine}" if node.engine else ""
        weights = f"  # {node.meta['weights']}" if node.meta.get("weights") else ""  # weight_sync: sharing plan
        return f"%{node.name} : {where}{live} {format_bytes(outs)} = {kind}{engine}({args}){weights}"

    def tabular(self) -> str:
        lifetimes = self.lifetimes()
        return "\n".join(self.format_node(self.nodes[n], lifetimes) for n in self.topological_order())

    def __str__(self) -> str:
        header = f"# {self.name}: {len(self.nodes)} nodes, {len(self.values)} values"
        return header + "\n" + self.tabular()

    def __repr__(self) -> str:
        return f"<IterationGraph {self.name!r}: {len(self.nodes)} nodes>"
