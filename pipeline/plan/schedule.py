"""Schedule policies: pure functions from a compiled iteration to a placed, ordered one.

- ``serial``: today's runtimes. Phase barriers: rollout (vision + decode) → scoring (prefix and
  suffix of every model, rewards, advantages) → training (loss, backward, optimizer) → sync. No
  prefix work can run while decode runs.
- ``rollplex``: no barriers. The prefix and vision work of every model depend only on the prompt,
  so with decode on its own stream they run inside the decode window. Priorities follow the
  critical path, so decode and what feeds it are never starved.

Both return a copy of the graph whose nodes carry ``meta["stream"]`` and ``meta["priority"]``
(higher runs first on its stream) and, for serial, ordering edges with reason "barrier". The update
is the same under both: barriers only order work, they never change what a node computes.

``plan(graph, cluster, costs, policy)`` goes further: a list scheduler (pipeline/plan/timing.py) places
every node on a GPU gang and a lane and predicts its start and finish, under three policies:

- ``serial``: colocated, phase barriers (verl/OpenRLHF today).
- ``disaggregated``: rollout GPUs apart from training GPUs (same total), phase barriers, weights
  shipped over the network after each step, vision output and responses shipped to the trainers.
- ``rollplex``: colocated, no barriers. Prefix and vision work run beside decode on SM partitions,
  but only while decode is light enough to leave compute idle (the long tail); a graph compiled
  with stage fusion scores (and with train fusion trains) what each decode chunk finished while
  the rest still decode.

Priorities are critical-path lengths in predicted seconds. Ties are broken by a structural
signature of each node (kind, model, args, cost, and those of its ancestors and descendants), never
by names or insertion order, so two namings of one graph get the same plan.
"""
from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import networkx as nx

from rollplex.errors import GraphError
from rollplex.pipeline.plan.hardware import Cluster, Layout
from rollplex.pipeline.compile.ir import IterationGraph, Node, gc_paused
from rollplex.pipeline.plan.timing import Job, Problem, Timing, dispatch, lane_orders, replay

POLICIES = ("serial", "rollplex")

SERIAL_PHASES = (
    ("vit_encode", "decode_chunk"),
    ("prefix", "suffix_score", "reward", "custom", "advantage"),
    ("loss", "optimizer_step"),
    ("weight_sync", "report"),
)

# Rough relative costs for priorities only; the cost model in the simulator replaces these.
_UNIT_COST = {"decode_chunk": 8.0, "prefix": 2.0, "suffix_score": 2.0, "loss": 3.0, "vit_encode": 1.0,
              "optimizer_step": 2.0, "weight_sync": 1.0}


def copy_graph(graph: IterationGraph) -> IterationGraph:
    return graph.copy()


def critical_path_priority(graph: IterationGraph) -> dict[str, float]:
    """Length of the costliest path from each node to a sink, including the node itself."""
    remaining: dict[str, float] = {}
    for name in reversed(graph.topological_order()):
        cost = _UNIT_COST.get(graph.nodes[name].kind, 0.1)
        remaining[name] = cost + max((remaining[s] for s in graph.g.successors(name)), default=0.0)
    return remaining


def _serial_barriers(graph: IterationGraph) -> None:
    phase_of = {}
    for i, kinds in enumerate(SERIAL_PHASES):
        for kind in kinds:
            phase_of[kind] = i
    by_phase: dict[int, list[str]] = {}
    for node in graph:
        # Kinds outside SERIAL_PHASES (offload, prefetch, plugins) sit between phases wherever their
        # data puts them; a barrier on them (e.g. a prefetch feeding a suffix_score) would be a cycle.
        if node.kind in phase_of:
            # The trained model's forwards belong to training: they keep graphs for the backward, so
            # serial runtimes run them per micro-batch right before it, not all in the scoring phase.
            # Unless the advantage reads them (a critic's values for GAE): then they are scoring, a
            # trained vision tower's forward for them too.
            graph_kept = node.kind in ("vit_encode", "prefix", "suffix_score") and node.args.get("grad")
            phase = phase_of[node.kind]
            if graph_kept:
                phase = phase_of["prefix"] if node.args.get("feeds_advantage") else phase_of["loss"]
            by_phase.setdefault(phase, []).append(node.name)
    phases = [by_phase[k] for k in sorted(by_phase)]
    for before, after in zip(phases, phases[1:]):
        # Only the last nodes of a phase need an edge: everything else precedes them already.
        members, later = set(before), set(after)
        sinks = [n for n in before if not any(s in members for s in graph.g.successors(n))]
        heads = [n for n in after if not any(p in later for p in graph.g.predecessors(n))]
        for s in sinks:
            for h in heads:
                graph.add_order(s, h, reason="barrier")


def schedule(graph: IterationGraph, policy: str, cluster: Cluster | None = None, costs: "Costs | None" = None,
             layout: Layout | None = None) -> IterationGraph:
    """Stream and priority per node (the runner's path). Given a cluster and costs, the full plan:
    placement, lane and predicted start/finish in ``node.meta`` as well (see ``plan``)."""
    if cluster is not None:
        return plan(graph, cluster, costs if costs is not None else {}, policy, layout).graph
    if policy not in POLICIES:
        raise GraphError(f"unknown schedule policy {policy!r}; choose one of {', '.join(POLICIES)}")
    with gc_paused():
        planned = copy_graph(graph)
        if policy == "serial":
            _serial_barriers(planned)
        priority = critical_path_priority(planned)  # its topological order names any cycle
    for name, node in planned.nodes.items():
        node.meta.setdefault("stream", node.kind_info.stream)
        node.meta["priority"] = round(priority[name], 3)
    planned.meta["policy"] = policy
    return planned


# -- plans: placement, lanes and predicted times ---------------------------------------------------
PLAN_POLICIES = ("serial", "disaggregated", "rollplex")
# Gates tried by rollplex: the least hidden share at which compute work may start beside decode.
# Overlapping heavy decode hides little yet fills the window, crowding out the light tail where
# most is hidden; 1.01 means never overlap, so rollplex is never worse than running phases apart.
GATE_LEVELS = (0.3, 0.6, 1.01)


@dataclass(frozen=True)
class PolicySpec:
    name: str
    barriers: bool  # serial phase barriers
    colocated: bool  # every GPU rolls out and trains
    gate: bool  # keep compute work out of decode too heavy to hide it
    partitioned: bool  # SM partitions for work beside decode (else plain streams)


POLICY_SPECS = {
    "serial": PolicySpec("serial", barriers=True, colocated=True, gate=False, partitioned=False),
    "disaggregated": PolicySpec("disaggregated", True, False, False, False),
    "rollplex": PolicySpec("rollplex", False, True, True, True),
}


def policy_spec(policy: str) -> PolicySpec:
    try:
        return POLICY_SPECS[policy]
    except KeyError:
        raise GraphError(f"unknown plan policy {policy!r}; choose one of {', '.join(PLAN_POLICIES)}") from None


def _as_cost(costs) -> Callable[[Node, int], tuple[float, float]]:
    """Costs as ``(node, gang size) -> (seconds, decode batch)`` from a cost model or a mapping."""
    def unpack(c) -> tuple[float, float]:
        if isinstance(c, (int, float)):
            return float(c), 0.0
        return float(c.seconds), float(getattr(c, "batch", 0.0))
    if isinstance(costs, Mapping):
        return lambda node, gang: unpack(costs.get(node.name, 0.0))
    return lambda node, gang: unpack(costs(node, gang))


def placement(node: Node, layout: Layout, cluster: Cluster) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """(lane, candidate gangs) of a node. One candidate gang means it is fixed (SPMD work over a
    pool, a transfer on the GPUs that hold its tensor)."""
    kind, stream = node.kind, node.stream
    if node.args.get("cached"):  # served from the host cache: a copy, on a training gang
        return "copy", layout.gangs(layout.train, layout.tp_train)
    if kind in ("offload", "prefetch") or stream == "copy":
        gpus = tuple(node.args.get("gpus", ()))
        if not gpus:
            raise GraphError(f"%{node.name}: a transfer node needs args['gpus'] (the GPUs holding its tensor)")
        return "copy", (gpus,)
    if kind == "weight_sync":
        return cluster.lane("decode"), (layout.gpus,)
    if stream == "decode":
        return cluster.lane("decode"), (layout.rollout,)
    if kind in ("loss", "optimizer_step") or "handoff_chunk" in node.args:
        # SPMD over the trainers: a stage-fused node scores (or trains) what one decode chunk handed
        # on, every data-parallel rank its own share of it, as the rank split runs it
        return cluster.lane("compute"), (layout.train,)
    if stream == "host":
        return "host", layout.gangs(layout.train, 1)
    if kind == "vit_encode" and not layout.colocated:  # decode needs it first
        return cluster.lane("compute"), layout.gangs(layout.rollout, layout.tp_rollout)
    return cluster.lane("compute"), layout.gangs(layout.train, layout.tp_train)


def _plain(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(isinstance(x, (int, float, str, bool)) for x in v)
    return v is None or isinstance(v, (int, float, str, bool))


def _digest(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"\x00".join(parts), digest_size=12).digest()


def structural_ranks(graph: IterationGraph, order: list[str], seconds: list[float],
                     succs: list[list[tuple[int, float]]]) -> list[int]:
    """A rank per node from what it is and what surrounds it, independent of names: the node's
    kind, model, plain args, cost and output bytes, hashed with its ancestors' (downward) and descendants'
    (upward) signatures. Only nodes with equal signatures fall back to their position."""
    n = len(order)
    preds: list[list[int]] = [[] for _ in range(n)]
    for i, ss in enumerate(succs):
        for s, _ in ss:
            preds[s].append(i)
    base = []
    for i, name in enumerate(order):
        node = graph.nodes[name]
        args = json.dumps({k: v for k, v in node.args.items() if _plain(v)}, sort_keys=True, default=str)
        out = sorted((graph.values[o].nbytes, graph.values[o].device) for o in node.outputs)
        base.append(f"{node.kind}|{node.model}|{args}|{seconds[i]:.9g}|{out}".encode())
    def edge(u: int, v: int) -> bytes:  # a value edge and an ordering-only edge are not the same
        return b"v" if graph.g.edges[order[u], order[v]]["values"] else b"o"

    down: list[bytes] = [b""] * n
    for i in range(n):
        down[i] = _digest(base[i], *sorted(down[p] + edge(p, i) for p in preds[i]))
    up: list[bytes] = [b""] * n
    for i in reversed(range(n)):
        up[i] = _digest(base[i], *sorted(up[s] + edge(i, s) for s, _ in succs[i]))
    ranked = sorted(range(n), key=lambda i: (down[i], up[i], i))
    rank = [0] * n
    for r, i in enumerate(ranked):
        rank[i] = r
    return rank


def build_problem(graph: IterationGraph, cluster: Cluster, layout: Layout, costs, spec: PolicySpec
                  ) -> tuple[Problem, list[str]]:
    order = graph.topological_order()
    index = {name: i for i, name in enumerate(order)}
    cost_of = _as_cost(costs)
    lanes, gangs, seconds, batch = [], [], [], []
    for name in order:
        node = graph.nodes[name]
        lane, cands = placement(node, layout, cluster)
        sec, b = cost_of(node, len(cands[0]))
        if not sec >= 0:
            raise GraphError(f"%{name}: cost {sec!r} seconds is not a non-negative number")
        lanes.append(lane)
        gangs.append(cands)
        seconds.append(sec)
        batch.append(b)
    pools = [frozenset(g for c in cands for g in c) for cands in gangs]
    succs: list[list[tuple[int, float]]] = [[] for _ in order]
    moved_in: list[list[tuple[int, int]]] = [[] for _ in order]  # (bytes, producer) per consumer
    for u, v, data in graph.g.edges(data=True):
        iu, iv = index[u], index[v]
        moved = sum(graph.values[x].nbytes for x in data.get("values", ()) if graph.values[x].device == "device")
        delay = 0.0
        if moved and pools[iu].isdisjoint(pools[iv]):  # e.g. vision output to disaggregated trainers
            link = cluster.link_bw(sorted(pools[iu] | pools[iv])) * min(len(pools[iu]), len(pools[iv]))
            delay = moved / link
        succs[iu].append((iv, delay))
        if moved and len(gangs[iv]) > 1 and gangs[iu] == gangs[iv]:
            moved_in[iv].append((moved, iu))
    for ss in succs:
        ss.sort()
    rank = structural_ranks(graph, order, seconds, succs)
    bottom = [0.0] * len(order)
    for i in reversed(range(len(order))):
        bottom[i] = seconds[i] + max((d + bottom[s] for s, d in succs[i]), default=0.0)
    jobs = []
    for i, name in enumerate(order):
        follow = max(moved_in[i], key=lambda m: (m[0], -rank[m[1]]))[1] if moved_in[i] else -1
        jobs.append(Job(name, lanes[i], seconds[i], gangs[i], batch[i], follow, bottom[i], rank[i]))
    inter = cluster.interference
    if inter.partitioned and not spec.partitioned:
        inter = replace(inter, partitioned=False)
    return Problem(jobs, succs, cluster.gpus, inter, gate=spec.gate), order


@functools.lru_cache(maxsize=4096)
def gpus_label(gpus: tuple[int, ...]) -> str:
    if len(gpus) > 1 and list(gpus) == list(range(gpus[0], gpus[-1] + 1)):
        return f"gpu{gpus[0]}-{gpus[-1]}"
    return "gpu" + "+".join(map(str, gpus))


@dataclass(frozen=True)
class Slot:
    node: str
    kind: str
    lane: str
    gpus: tuple[int, ...]
    start: float
    finish: float
    priority: float


@dataclass
class Plan:
    """Where and when every node runs. ``graph`` is the planned copy whose nodes carry the same facts
    in ``meta`` (stream, lane, gpus, placement, priority, start, finish)."""

    policy: str
    cluster: Cluster
    layout: Layout
    graph: IterationGraph
    problem: Problem
    names: list[str]
    timing: Timing
    costs: object = None
    slots: dict[str, Slot] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t, jobs = self.timing, self.problem.jobs
        for i, name in enumerate(self.names):
            job = jobs[i]
            self.slots[name] = Slot(name, self.graph.nodes[name].kind, job.lane, t.gang[i], t.start[i], t.finish[i],
                                    job.priority)
            node = self.graph.nodes[name]
            node.meta.update(stream="copy" if job.lane == "copy" else node.stream, lane=job.lane,
                             priority=round(job.priority, 6), gpus=list(t.gang[i]), placement=gpus_label(t.gang[i]),
                             start=t.start[i], finish=t.finish[i])
        self.graph.meta.update(policy=self.policy, makespan=self.makespan)

    @property
    def makespan(self) -> float:
        """Latest finish, transfers included: the next iteration starts when this one's last
        offload is done (it may need that memory at once, e.g. decode's KV pool)."""
        return self.timing.makespan

    def lanes(self) -> dict[tuple[int, str], list[str]]:
        return {key: [self.names[i] for i in seq] for key, seq in lane_orders(self.problem, self.timing).items()}

    def seconds_by_kind(self) -> dict[str, float]:
        """Wall seconds of each kind's nodes (as placed, interference included), summed."""
        out: dict[str, float] = {}
        for s in self.slots.values():
            out[s.kind] = out.get(s.kind, 0.0) + s.finish - s.start
        return dict(sorted(out.items()))

    def table(self, limit: int | None = 40) -> str:
        rows = sorted(self.slots.values(), key=lambda s: (s.start, s.finish, s.priority))
        head = (f"# plan {self.policy}: {len(rows)} nodes on {self.cluster.gpus} GPU(s), "
                f"makespan {self.makespan:.3f}s")
        shown = rows if limit is None else rows[:limit]
        lines = [f"%{s.node} : {gpus_label(s.gpus)}/{s.lane} {s.start:.3f}–{s.finish:.3f}s = {s.kind}" for s in shown]
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} more")
        return "\n".join([head, *lines])


def plan(graph: IterationGraph, cluster: Cluster, costs, policy: str = "rollplex", layout: Layout | None = None) -> Plan:
    """Place and time every node of ``graph`` under ``policy``. Pure: the input is not modified.

    ``costs`` is ``(node, gang size) -> NodeCost | seconds`` or a mapping node name → seconds. Stage
    fusion is the graph's own: a graph compiled with it hands each decode chunk's finished samples
    or groups on (``compiler.compile_iteration``), and the cost model prices what each chunk handed.
    """
    with gc_paused():
        return _plan(graph, cluster, costs, policy, layout)


def _plan(graph, cluster, costs, policy, layout) -> Plan:
    spec = policy_spec(policy)
    if layout is None:
        layout = Layout.colocate(cluster) if spec.colocated else Layout.split(cluster, max(1, cluster.gpus // 2))
    layout.check(cluster)
    if spec.colocated != layout.colocated:
        raise GraphError(f"policy {policy} needs a {'colocated' if spec.colocated else 'split'} layout; got rollout "
                         f"GPUs {layout.rollout} and training GPUs {layout.train}")
    planned = copy_graph(graph)
    if not nx.is_directed_acyclic_graph(planned.g):
        planned.lint()  # names the cycle of the input
    if spec.barriers:
        _serial_barriers(planned)
        if not nx.is_directed_acyclic_graph(planned.g):
            try:
                planned.lint()
            except GraphError as exc:
                raise GraphError(f"policy {policy}: the graph's data flow contradicts the serial phases "
                                 f"{SERIAL_PHASES}, so phase barriers close a cycle ({exc})") from None
    problem, names = build_problem(planned, cluster, layout, costs, spec)
    timing = dispatch(problem)
    if spec.gate:  # which decode is light enough to share: try stricter gates, keep the fastest
        for level in GATE_LEVELS:
            if level > problem.interference.min_hidden:
                trial = replace(problem, interference=replace(problem.interference, min_hidden=level))
                t = dispatch(trial, bound=timing.makespan)
                if t is not None and t.makespan < timing.makespan - 1e-9:
                    problem, timing = trial, t
    return Plan(policy, cluster, layout, planned, problem, names, timing, costs)


def retime(old: Plan, graph: IterationGraph | None = None, costs=None) -> Plan:
    """Replay ``old``'s placement and lane orders, with other ``costs`` or on a ``graph`` that adds
    nodes (offload/prefetch): a new node runs on its fixed gang, in its lane at ``meta['at']``."""
    with gc_paused():
        return _retime(old, graph, costs)


def _retime(old: Plan, graph: IterationGraph | None, costs) -> Plan:
    graph = graph if graph is not None else copy_graph(old.graph)
    costs = costs if costs is not None else old.costs
    problem, names = build_problem(graph, old.cluster, old.layout, costs, policy_spec(old.policy))
    problem = replace(problem, interference=old.problem.interference)  # the gate the plan chose
    old_seq = {old.names[i]: (old.timing.start[i], 0, old.timing.seq[i]) for i in range(len(old.names))}
    gangs, keys = [], []
    for i, name in enumerate(names):
        job = problem.jobs[i]
        if name in old.slots:
            gangs.append(old.slots[name].gpus)
            keys.append(old_seq[name])
        elif len(job.gangs) == 1:
            gangs.append(job.gangs[0])
            keys.append((float(graph.nodes[name].meta.get("at", 0.0)), 1, job.tiebreak))
        else:
            raise GraphError(f"retime: new node %{name} has no fixed gang; give it args['gpus']")
    order: dict[tuple[int, str], list[int]] = {}
    for i in sorted(range(len(names)), key=keys.__getitem__):
        for g in gangs[i]:
            order.setdefault((g, problem.jobs[i].lane), []).append(i)
    return Plan(old.policy, old.cluster, old.layout, graph, problem, names, replay(problem, gangs, order), costs)


def rebuild(graph: IterationGraph, nodes: list[Node], infos: Mapping[str, dict] | None = None) -> IterationGraph:
    """A new graph of ``nodes`` with ``graph``'s inputs, its value facts (or ``infos``) and its
    ordering-only edges between surviving nodes."""
    infos = infos or {}
    new = IterationGraph(graph.name)
    new.meta = dict(graph.meta)
    for v in graph.values.values():
        if v.producer is None:
            new.add_input(v.name, **v.facts())
    for node in nodes:
        info = {out: infos.get(out) or graph.values[out] for out in node.outputs}
        new.add(Node(node.name, node.kind, node.inputs, node.outputs, node.model, node.engine, node.args,
                     dict(node.meta)), **info)
    new.connect()
    for u, v, data in graph.g.edges(data=True):
        if not data["values"] and u in new.nodes and v in new.nodes:
            new.add_order(u, v, data["reason"])
    return new
