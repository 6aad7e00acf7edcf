"""The iteration IR: a small typed DAG of nodes and the values that flow between them.

A ``Node`` is one unit of work (one prompt's ref prefix, one decode chunk, ...). A ``Value`` is one
tensor bundle with a producer, a byte estimate, a device and fields that say what it is (``role``,
``model``, ``prompts``, ``chunk``, ``rank``, ``label``): passes and tasks read those, never the name,
which is only a key and what the table prints. ``IterationGraph`` holds both on a networkx DiGraph
whose edges carry the value names, keeps each value's users (the nodes that read it, filled as nodes
are added, like torch.fx ``Node.users``), prints as a one-line-per-node table, and ``lint()`` rejects
malformed graphs with errors that name the node. Passes never change a node's fields; what a pass
decides (stream, order, residency) goes into the node's ``meta`` dict or into a separate plan object
keyed by node name. A graph changes only through its methods (``add``, ``replace_node``,
``replace_value``, ``connect``, ``add_order``, ``remove_edge``), which keep the users index and the
tables cached on the graph (``memo``) in step; ``nodes`` and ``values`` are read-only views.
"""
from __future__ import annotations

import contextlib
import gc
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
    NodeKind("env_step", None, "host", "rollout", "environment steps of the samples a decode chunk ended a turn of"),
    NodeKind("vit_observation", "score", "compute", "rollout", "vision-tower forward of environments' new images"),
    NodeKind("offload", None, "compute", "sync", "move a value from HBM to host memory"),
    NodeKind("prefetch", None, "compute", "sync", "bring an offloaded value back to HBM"),
):
    register_kind(_kind)


# What a value can be. A role, not a name, tells passes and tasks what a value holds.
ROLES = {
    "prompt": "a prompt's tokens and images (a graph input)",
    "vision": "a prompt's vision-tower embeddings",
    "kv": "a model's prefix state of a prompt: KV cache and last logits",
    "decode_state": "the decode engine's progress after a chunk",
    "responses": "one prompt's G sampled responses",
    "handoff": "the groups a decode chunk finished (stage fusion)",
    "finished": "the single samples a decode chunk finished (stage fusion)",
    "turn": "the samples a decode chunk ended a turn of (multi-turn), for their environments",
    "observation": "environments' answers to a chunk's samples: the next user turn, reward, done",
    "rollout_stats": "the batch's response tokens and sequences",
    "score": "a scoring model's per-token outputs; ``label`` is the algorithm's name for them",
    "rewards": "verifiable rewards",
    "advantages": "advantages",
    "custom": "the output of a node of the algorithm's own; ``label`` is its name",
    "loss": "a loss record, after its backward",
    "step": "an optimizer step's record",
    "synced": "the decode engine's new weight version",
    "report": "the iteration's host records and metrics",
    "tensor": "anything else (plugin kinds, hand-built graphs)",
}


@dataclass(frozen=True, slots=True)
class Value:
    """A tensor bundle passed between nodes. ``nbytes`` is an estimate used by planning.

    ``prompts`` are the prompt (group) indices it covers, ``chunk`` the decode chunk it belongs to,
    ``rank`` the data-parallel rank that holds it (None: the single-rank graph), ``model`` the model
    that made it and ``label`` the algorithm's name for it where the role does not say it (a score's
    ``ref_logprobs`` or ``old_logprobs``, a custom node's output)."""

    name: str
    producer: str | None  # None for a graph input (fed by the executor, like an fx placeholder)
    nbytes: int = 0
    device: str = "device"  # "device" (GPU/worker memory) or "host"
    role: str = "tensor"
    model: str | None = None
    prompts: tuple[int, ...] = ()
    chunk: int | None = None
    rank: int | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise GraphError(f"value {self.name!r}: role {self.role!r} is not one of {', '.join(ROLES)}")
        if type(self.prompts) is not tuple:
            object.__setattr__(self, "prompts", tuple(self.prompts))

    def facts(self) -> dict[str, Any]:
        """Everything but the name and the producer: what ``IterationGraph.add`` takes per output."""
        return {f: getattr(self, f) for f in _FACTS}


_FACTS = tuple(f for f in Value.__dataclass_fields__ if f not in ("name", "producer"))


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


def _copy_digraph(g: nx.DiGraph) -> nx.DiGraph:
    """``g.copy()`` at a third of the cost: the same adjacency rebuilt with dict comprehensions.

    ``DiGraph.copy`` re-adds every edge through ``add_edges_from`` and its checks, which is most of
    what scheduling a 10k-node graph costs. Assigning ``_succ``/``_pred``/``_node`` is what
    networkx's own descriptors support (they reset the cached views). Each edge's data dict is
    copied once and shared by both directions, as networkx does, so edits stay in step.
    """
    h = g.__class__()
    h.graph.update(g.graph)
    succ = {u: {v: dict(data) for v, data in nbrs.items()} for u, nbrs in g._succ.items()}
    h._node = {n: dict(attrs) for n, attrs in g._node.items()}
    h._pred = {v: {u: succ[u][v] for u in nbrs} for v, nbrs in g._pred.items()}
    h._succ = succ  # also sets _adj
    return h


def _shallow(node: Node) -> Node:
    """A copy of a (validated, frozen) node with its own meta dict, without re-validating it."""
    twin = object.__new__(Node)
    twin.__dict__.update(node.__dict__)
    object.__setattr__(twin, "meta", dict(node.meta))
    return twin


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
        self.meta: dict[str, Any] = {}
        self._init_index({}, {})

    def _init_index(self, nodes: dict[str, Node], values: dict[str, Value]) -> None:
        self._nodes, self._values = nodes, values
        self.nodes: Mapping[str, Node] = MappingProxyType(nodes)
        self.values: Mapping[str, Value] = MappingProxyType(values)
        self._index = {name: i for i, name in enumerate(nodes)}  # insertion position: users' order
        self._users: dict[str, dict[str, None]] = {}  # value -> the nodes that read it, in insertion order
        for node in nodes.values():
            self._read(node)
        self._version = 0  # bumped by every change; ``memo`` tables of an older version are stale
        self._memo: dict[str, tuple[int, Any]] = {}

    def _read(self, node: Node) -> None:
        for v in node.inputs:
            self._users.setdefault(v, {})[node.name] = None

    def _changed(self) -> None:
        self._version += 1

    # -- building -----------------------------------------------------------------------------
    def add(self, node: Node, **value_info: Mapping[str, Any] | Value) -> Node:
        """Add a node. ``value_info[out]`` describes an output: a ``Value`` whose facts it takes, or
        ``dict(nbytes=..., device=..., role=..., model=..., prompts=..., chunk=..., rank=..., label=...)``."""
        if node.name in self._nodes:
            raise GraphError(f"duplicate node name %{node.name}; every node needs a unique name")
        for out in node.outputs:
            if out in self._values:
                raise GraphError(
                    f"value {out!r} is produced by both %{self._values[out].producer} and %{node.name}"
                )
        made = {}
        for out in node.outputs:
            info = value_info.get(out, {})
            made[out] = Value(out, node.name, **(info.facts() if isinstance(info, Value) else info))
        self._values.update(made)
        self._index[node.name] = len(self._nodes)
        self._nodes[node.name] = node
        self.g.add_node(node.name)
        self._read(node)
        self._changed()
        return node

    def add_input(self, name: str, nbytes: int = 0, device: str = "host", role: str = "tensor",
                  **facts: Any) -> Value:
        if name in self._values:
            raise GraphError(f"graph input {name!r} duplicates a value of the same name")
        self._values[name] = Value(name, None, nbytes, device, role, **facts)
        self._changed()
        return self._values[name]

    def replace_node(self, node: Node) -> Node:
        """Put ``node`` in the place of the node of its name (same position). Values and edges are the
        caller's to update (``replace_value``, ``connect``, ``remove_edge``)."""
        old = self._nodes.get(node.name)
        if old is None:
            raise GraphError(f"replace_node: the graph has no node %{node.name}")
        self._nodes[node.name] = node
        if old.inputs != node.inputs:
            for v in set(old.inputs) - set(node.inputs):
                del self._users[v][node.name]
            for v in set(node.inputs) - set(old.inputs):
                users = self._users.setdefault(v, {})
                users[node.name] = None
                if len(users) > 1:  # keep the users in insertion order, as if built so
                    self._users[v] = dict.fromkeys(sorted(users, key=self._index.__getitem__))
        self._changed()
        return node

    def replace_value(self, value: Value) -> Value:
        """Put ``value`` in the place of the value of its name (a new producer, new facts)."""
        if value.name not in self._values:
            raise GraphError(f"replace_value: the graph has no value {value.name!r}")
        self._values[value.name] = value
        self._changed()
        return value

    @property
    def inputs(self) -> list[str]:
        return [v.name for v in self._values.values() if v.producer is None]

    def feed(self, prompts: Sequence[Any]) -> dict[str, Any]:
        """The graph inputs of one batch: each prompt input gets ``prompts[i]``, i its prompt index."""
        return {v.name: prompts[v.prompts[0]] for v in self._values.values()
                if v.producer is None and v.role == "prompt"}

    def add_order(self, before: str, after: str, reason: str = "order") -> None:
        for n in (before, after):
            if n not in self._nodes:
                raise GraphError(f"ordering edge names unknown node %{n}")
        if before == after:
            return
        data = self.g.get_edge_data(before, after)
        if data is None:
            self.g.add_edge(before, after, values=(), reason=reason)
            self._changed()

    def add_edge(self, before: str, after: str, values: tuple[str, ...], reason: str = "value") -> None:
        """An edge with its data (passes that move values between producers); replaces one there."""
        self.g.add_edge(before, after, values=tuple(values), reason=reason)
        self._changed()

    def remove_edge(self, before: str, after: str) -> None:
        self.g.remove_edge(before, after)
        self._changed()

    def connect(self) -> "IterationGraph":
        """Derive value edges producer → consumer from the nodes' declared inputs."""
        for node in self._nodes.values():
            for value_name in node.inputs:
                value = self._values.get(value_name)
                if value is None or value.producer is None:
                    continue  # graph inputs have no edge; lint reports dangling inputs by node
                data = self.g.get_edge_data(value.producer, node.name)
                if data is None:
                    self.g.add_edge(value.producer, node.name, values=(value_name,), reason="value")
                elif value_name not in data["values"]:
                    data["values"] = data["values"] + (value_name,)
                    data["reason"] = "value"
        self._changed()
        return self

    def copy(self) -> "IterationGraph":
        """An independent copy: its own nodes' meta dicts, edges, meta and users; nodes and values
        (frozen) are shared."""
        new = IterationGraph.__new__(IterationGraph)
        new.name, new.meta = self.name, dict(self.meta)
        new.g = _copy_digraph(self.g)
        new._nodes, new._values = {name: _shallow(node) for name, node in self._nodes.items()}, dict(self._values)
        new.nodes, new.values = MappingProxyType(new._nodes), MappingProxyType(new._values)
        new._index = dict(self._index)
        new._users = {v: dict(users) for v, users in self._users.items()}
        new._version, new._memo = 0, {}
        return new

    def __getstate__(self) -> dict[str, Any]:  # read-only views do not pickle; the index is rebuilt
        return {"name": self.name, "g": self.g, "meta": self.meta, "nodes": self._nodes, "values": self._values}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name, self.g, self.meta = state["name"], state["g"], state["meta"]
        self._init_index(state["nodes"], state["values"])

    def memo(self, key: str, build: Callable[["IterationGraph"], Any]) -> Any:
        """``build(self)``, computed once per version of the graph (any change through its methods
        makes a new version). For tables of the graph's structure only: ``meta`` is not versioned."""
        hit = self._memo.get(key)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        value = build(self)
        self._memo[key] = (self._version, value)
        return value

    # -- queries ------------------------------------------------------------------------------
    def consumers(self, value_name: str) -> tuple[str, ...]:
        """The nodes that read ``value_name``, in insertion order (a lookup in the users index)."""
        return tuple(self._users.get(value_name, ()))

    def uses(self, value_name: str) -> int:
        return len(self._users.get(value_name, ()))

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def of_kind(self, kind: str) -> list[Node]:
        return [n for n in self._nodes.values() if n.kind == kind]

    def of_role(self, role: str) -> list[Value]:
        return [v for v in self._values.values() if v.role == role]

    def topological_order(self) -> list[str]:
        """Deterministic topological order: ties broken by insertion order, never by name."""
        return list(self.memo("topological_order", IterationGraph._topological_order))

    def _topological_order(self) -> list[str]:
        # Kahn's algorithm over a heap of insertion indices: the order networkx's
        # lexicographical_topological_sort gives with that key, at a third of its cost on 10k nodes.
        names = list(self._nodes)
        index = self._index
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
        at = position.__getitem__
        result = {}
        for value in self._values.values():
            users = self._users.get(value.name)
            first = value.producer or (min(users, key=at) if users else "")
            last = max(users, key=at) if users else first
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
