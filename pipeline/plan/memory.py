"""Phase-aware memory planning: the HBM residency of every tensor follows its use under a plan.

Two kinds of tensor live on a GPU:
- graph values on the device (vision embeddings, prefix KV, activations kept for a backward),
  from their producer's start to their last consumer's finish;
- ``Resident`` tensors outside the graph (weights, gradients, optimizer state, the decode engine's
  KV pool), needed while the nodes that use them run, iteration after iteration: their idle gap
  wraps around the iteration end.

Between two uses a tensor sits idle in a gap. The planner keeps it there, or frees it when the
next use overwrites it (a dead gap: gradients before the first micro-batch, the KV pool before
decode), or offloads it to host memory and prefetches it before its next use when the gap is long
enough for both copies (a frozen tensor keeps a host copy, so only its prefetch costs). Greedily,
at the worst moment of the worst GPU, it frees the largest dead tensor idle then, else offloads
the largest idle one, until every GPU fits its budget. Offloads and prefetches become ``offload``
/``prefetch`` nodes on the GPU's ``copy`` lane; the plan is then replayed (``schedule.retime``)
with them, and checked again on the new times. When nothing idle is left at an over-budget moment,
``MemoryPlanError`` names the GPU, the moment, the running nodes and the largest live tensors.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rollplex.errors import MemoryPlanError
from rollplex.pipeline.compile.ir import Node
from rollplex.pipeline.plan.schedule import Plan, rebuild, retime

GiB = 1024**3


def size(nbytes: float, digits: int = 1) -> str:
    """Bytes for people: GiB at GPU scale, MiB/KiB for the tiny models of tests and the CPU default."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20)):
        if nbytes >= scale / 10:
            return f"{nbytes / scale:.{digits if unit == 'GiB' else 2}f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"
EPS = 1e-9


@dataclass(frozen=True)
class Resident:
    """A tensor that outlives iterations: ``uses`` are (node name, "read" | "write")."""

    name: str
    gpus: tuple[int, ...]
    bytes_per_gpu: float
    uses: tuple[tuple[str, str], ...]
    frozen: bool = False  # a host copy always exists: offloading it costs nothing
    what: str = "weights"
    movable: bool = True  # False: stays resident (the runtime's engines cannot move or free it)
    model: str = ""  # whose engine holds it ("actor" for actor.adam): the one a move asks
    part: str = ""  # which of that engine's tensors ("adam")


@dataclass
class Gap:
    a: float
    b: float  # may exceed the period for a resident's wrap-around gap
    after: str  # node whose use ends before the gap ("" at the iteration start)
    before: str  # node whose use follows it
    dead: bool  # every next use overwrites the tensor
    wrap: bool = False  # from the last use of one iteration to the first use of the next
    before_all: tuple[str, ...] = ()  # every use starting when the gap ends (``before`` is one of them)

    @property
    def key(self) -> tuple[str, str]:
        return (self.after, self.before)


@dataclass
class Tensor:
    name: str
    gpus: tuple[int, ...]
    nbytes: float  # per GPU
    busy: list[tuple[float, float]]
    gaps: list[Gap]
    resident: bool
    frozen: bool = False
    what: str = ""
    rank: tuple[int, int] = (0, 0)  # name-independent tie-break: (0, producer's structural rank) | (1, index)
    movable: bool = True
    owner: tuple[str, str] = ("", "")  # a resident's (model, part)


@dataclass
class Action:
    tensor: str
    kind: str  # "free" | "offload"
    gap: Gap
    nbytes: float
    gpus: tuple[int, ...]


@dataclass
class MemoryPlan:
    plan: Plan  # with offload/prefetch nodes, retimed
    budget: float
    residents: list[Resident]
    decisions: dict[tuple[str, str, str], str]  # (tensor, after, before) → free | offload
    actions: list[Action]
    naive_peak: dict[int, float]
    peak: dict[int, float]
    tensors: list[Tensor] = field(default_factory=list)

    def timeline(self, gpu: int) -> list[tuple[float, float]]:
        """(time, bytes in use from then on) on ``gpu``."""
        return _steps(_events(self.plan, self.tensors, self.decisions, gpu))

    def live_at(self, gpu: int, t: float) -> list[tuple[str, float]]:
        return _live(self.plan, self.tensors, self.decisions, gpu, t)

    @property
    def log(self) -> str:
        before, after = max(self.naive_peak.values(), default=0), max(self.peak.values(), default=0)
        kinds = {k: sum(1 for a in self.actions if a.kind == k) for k in ("free", "offload")}
        return (f"memory: peak {size(before)} → {size(after)} per GPU (budget "
                f"{size(self.budget)}): {kinds['offload']} offload/prefetch pair(s), {kinds['free']} free(s)")


# -- tensors and their gaps under a plan -------------------------------------------------------------
def _merge(uses: list[tuple[float, float, int, str]]) -> list[tuple[float, float, tuple[str, ...], str]]:
    """Union of use intervals (start, finish, rank, node) as (start, end, nodes starting at start,
    node ending last). Ties go by structural rank, never by name."""
    out: list[list] = []
    for a, b, _, node in sorted(uses):
        if out and a <= out[-1][1] + EPS:
            if abs(a - out[-1][0]) <= EPS:
                out[-1][2].append(node)
            if b > out[-1][1] + EPS:
                out[-1][1], out[-1][3] = b, node
        else:
            out.append([a, b, [node], node])
    return [(a, b, tuple(first), last) for a, b, first, last in out]


def tensors_of(plan: Plan, residents: list[Resident]) -> list[Tensor]:
    slots, graph = plan.slots, plan.graph
    period = plan.makespan
    tiebreak = {name: job.tiebreak for name, job in zip(plan.names, plan.problem.jobs)}
    out = []
    for v in graph.values.values():
        if v.device != "device" or v.nbytes <= 0:
            continue
        users = [slots[n] for n in graph.consumers(v.name)]
        if v.producer is not None:
            users.append(slots[v.producer])
            gpus = slots[v.producer].gpus
        elif users:
            gpus = users[0].gpus
        else:
            continue
        uses = [(s.start, s.finish, tiebreak[s.node], s.node) for s in users]
        if v.producer is None:  # a device input is there from the iteration's start
            uses.append((0.0, 0.0, -1, ""))
        busy = _merge(uses)
        gaps = [Gap(x[1], y[0], x[3], y[2][0], False, before_all=y[2]) for x, y in zip(busy, busy[1:])
                if y[0] - x[1] > EPS]
        # A forward with grad hands on tensors tied to its autograd graph, whose saved activations stay
        # on the device until the backward: a host copy would be detached and free nothing of them.
        kept_for_backward = v.producer is not None and bool(graph.nodes[v.producer].args.get("grad"))
        out.append(Tensor(v.name, tuple(gpus), v.nbytes / len(gpus), [(a, b) for a, b, *_ in busy], gaps, False,
                          what=v.role, rank=(0, tiebreak[v.producer or users[0].node]), movable=not kept_for_backward))
    for index, r in enumerate(residents):
        mode = dict(r.uses)
        unknown = [n for n in mode if n not in slots]
        if unknown:
            raise MemoryPlanError(f"resident {r.name}: its uses {unknown[:3]} are not nodes of the plan")
        busy = _merge([(slots[n].start, slots[n].finish, tiebreak[n], n) for n in mode])
        writes = lambda nodes: all(mode[n] == "write" for n in nodes)  # noqa: E731 - dead only if all overwrite
        gaps = [Gap(x[1], y[0], x[3], y[2][0], writes(y[2]), before_all=y[2]) for x, y in zip(busy, busy[1:])
                if y[0] - x[1] > EPS]
        if busy:
            first, last = busy[0], busy[-1]
            if period + first[0] - last[1] > EPS:
                gaps.append(Gap(last[1], period + first[0], last[3], first[2][0], writes(first[2]), wrap=True,
                                before_all=first[2]))
        else:
            gaps.append(Gap(0.0, period, "", "", True, wrap=True))
        out.append(Tensor(r.name, r.gpus, r.bytes_per_gpu, [(a, b) for a, b, *_ in busy], gaps, True, r.frozen,
                          r.what, rank=(1, index), movable=r.movable, owner=(r.model, r.part)))
    return out


class _Ctx:
    """What every sweep over one plan needs, computed once."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.period = max(plan.makespan, EPS)
        self.done = _materialized(plan)
        self.workspace: dict[int, list[tuple[float, float, str]]] = {}
        for s in plan.slots.values():
            ws = plan.graph.nodes[s.node].meta.get("workspace", 0)
            if ws and s.finish > s.start:
                for g in s.gpus:
                    self.workspace.setdefault(g, []).extend(
                        [(round(s.start, 9), ws, f"workspace of %{s.node}"),
                         (round(s.finish, 9), -ws, f"workspace of %{s.node}")])


_CTX: dict[int, _Ctx] = {}


def _ctx(plan: Plan) -> _Ctx:
    c = _CTX.get(id(plan))
    if c is None or c.plan is not plan:
        _CTX.clear()  # one plan at a time is enough; keeps no stale plans alive
        c = _CTX[id(plan)] = _Ctx(plan)
    return c


def _transfer_times(plan: Plan, t: Tensor) -> tuple[float, float]:
    """(offload, prefetch) seconds; a frozen tensor only needs its prefetch."""
    copy = t.nbytes / plan.cluster.pcie_bw
    return (0.0 if t.frozen else copy), copy


def _materialized(plan: Plan) -> dict[tuple[str, str, str], tuple[str, str]]:
    """(tensor, after, before) → (offload node, prefetch node) for resident transfers in the graph."""
    out: dict[tuple[str, str, str], list[str]] = {}
    for node in plan.graph:
        if node.kind in ("offload", "prefetch") and node.args.get("resident"):
            key = (node.args["tensor"], node.args["after"], node.args["before"])
            out.setdefault(key, ["", ""])[0 if node.kind == "offload" else 1] = node.name
    return {k: (a, b) for k, (a, b) in out.items()}


def _occupancy(plan: Plan, t: Tensor, decisions: dict) -> list[tuple[float, float]]:
    """HBM intervals of ``t`` under ``decisions``, folded into one period."""
    ctx = _ctx(plan)
    period = ctx.period
    spans = list(t.busy)
    done = ctx.done if t.resident else {}
    t_off, t_pre = _transfer_times(plan, t)
    for gap in t.gaps:
        d = decisions.get((t.name, gap.after, gap.before))
        if d is None:
            spans.append((gap.a, gap.b))
        elif d == "offload":
            nodes = done.get((t.name, gap.after, gap.before))
            if nodes and all(nodes):
                off, pre = (plan.slots[n] for n in nodes)
                spans += [(gap.a, max(gap.a, off.finish if off.finish >= gap.a else off.finish + period)),
                          (min(gap.b, pre.start if pre.start + EPS >= gap.a else pre.start + period), gap.b)]
            else:
                spans += [(gap.a, gap.a + t_off), (gap.b - t_pre, gap.b)]
    folded = []
    for a, b in spans:
        if b - a <= EPS:
            continue
        if a >= period - EPS:  # wholly past the period (a prefetch before next iteration's use)
            a, b = a - period, b - period
        if b > period + EPS:  # across the period's end: the part past it sits at the start
            folded += [(a, period), (0.0, b - period)]
        else:
            folded.append((a, b))
    return folded


def _events(plan: Plan, tensors: list[Tensor], decisions: dict, gpu: int) -> list[tuple[float, float, str]]:
    ev = []
    for t in tensors:
        if gpu in t.gpus:
            for a, b in _occupancy(plan, t, decisions):
                ev += [(round(a, 9), t.nbytes, t.name), (round(b, 9), -t.nbytes, t.name)]
    ev += _ctx(plan).workspace.get(gpu, [])
    ev.sort()  # times rounded to 1 ns, so frees sort before allocations at one instant
    return ev


def _steps(ev: list[tuple[float, float, str]]) -> list[tuple[float, float]]:
    out, used = [], 0.0
    for t, d, _ in ev:
        used += d
        if out and abs(out[-1][0] - t) <= EPS:
            out[-1] = (t, used)
        else:
            out.append((t, used))
    return out


def _peak(ev) -> tuple[float, float]:
    best, at, used = 0.0, 0.0, 0.0
    for t, d, _ in ev:
        used += d
        if used > best + 1.0:
            best, at = used, t
    return best, at


def _live(plan: Plan, tensors: list[Tensor], decisions: dict, gpu: int, t: float) -> list[tuple[str, float]]:
    live = {}
    for x in tensors:
        if gpu in x.gpus and any(a - EPS <= t < b - EPS for a, b in _occupancy(plan, x, decisions)):
            live[x.name] = x.nbytes
    for s in plan.slots.values():
        ws = plan.graph.nodes[s.node].meta.get("workspace", 0)
        if ws and gpu in s.gpus and s.start - EPS <= t < s.finish - EPS:
            live[f"workspace of %{s.node}"] = ws
    return sorted(live.items(), key=lambda kv: (-kv[1], kv[0]))


# -- the greedy decisions ----------------------------------------------------------------------------
def _in_gap(gap: Gap, t: float, period: float) -> bool:
    return gap.a - EPS <= t < gap.b - EPS or gap.a - EPS <= t + period < gap.b - EPS


def _decide(plan: Plan, tensors: list[Tensor], decisions: dict, budget: float) -> list[Action]:
    period = plan.makespan
    by_gpu: dict[int, list[Tensor]] = {}
    for t in tensors:
        for g in t.gpus:
            by_gpu.setdefault(g, []).append(t)
    peaks = {g: _peak(_events(plan, by_gpu.get(g, []), decisions, g)) for g in range(plan.cluster.gpus)}
    actions = []
    while True:
        g = max(peaks, key=lambda k: (peaks[k][0], -k))
        used, at = peaks[g]
        if used <= budget:
            return actions
        cands = []
        for t in by_gpu.get(g, []):
            if not t.movable:
                continue
            t_off, t_pre = _transfer_times(plan, t)
            for gap in t.gaps:
                if (t.name, gap.after, gap.before) in decisions or not _in_gap(gap, at, period):
                    continue
                if gap.dead:
                    cands.append((0, -t.nbytes, gap.a, t.rank, t, gap, "free"))
                else:
                    tt = at if gap.a - EPS <= at else at + period
                    if gap.b - gap.a >= t_off + t_pre and gap.a + t_off <= tt + EPS and tt < gap.b - t_pre - EPS:
                        cands.append((1, -t.nbytes, gap.a, t.rank, t, gap, "offload"))
        if not cands:
            raise MemoryPlanError(_explain(plan, tensors, decisions, g, at, used, budget))
        *_, t, gap, kind = min(cands, key=lambda c: c[:4])
        decisions[(t.name, gap.after, gap.before)] = kind
        actions.append(Action(t.name, kind, gap, t.nbytes, t.gpus))
        for h in t.gpus:
            peaks[h] = _peak(_events(plan, by_gpu.get(h, []), decisions, h))


def _explain(plan: Plan, tensors: list[Tensor], decisions: dict, gpu: int, at: float, used: float,
             budget: float) -> str:
    running = sorted(s.node for s in plan.slots.values() if gpu in s.gpus and s.start - EPS <= at < s.finish - EPS)
    period = plan.makespan
    by_name = {t.name: t for t in tensors}
    parts = []
    for name, nbytes in _live(plan, tensors, decisions, gpu, at)[:5]:
        t = by_name.get(name)
        why = "transient"
        if t is not None:
            gap = next((g for g in t.gaps if _in_gap(g, at, period)), None)
            t_off, t_pre = _transfer_times(plan, t)
            tt = at if gap is None or gap.a - EPS <= at else at + period
            if gap is None:
                why = "in use"
            elif (t.name, gap.after, gap.before) in decisions:
                why = "already moving"
            elif gap.b - gap.a < t_off + t_pre:
                why = f"idle {gap.b - gap.a:.3g}s, too short for {t_off + t_pre:.3g}s of copies"
            elif gap.a + t_off > tt + EPS:
                why = f"idle only since t={gap.a:.3f}s; its copy to host takes {t_off:.3g}s"
            else:
                why = f"needed again at t={gap.b % period:.3f}s; its prefetch takes {t_pre:.3g}s"
        parts.append(f"{name} {size(nbytes, 2)} ({why})")
    now = ", ".join(f"%{n}" for n in running[:4]) or "nothing"
    return (f"gpu{gpu} needs {size(used)} at t={at:.3f}s of the {plan.policy} plan (while {now} run) but "
            f"the budget is {size(budget)}; largest live tensors: " + "; ".join(parts)
            + ". Raise the budget, shard more (zero stage, TP) or use smaller batches.")


# -- materialise decisions as offload/prefetch nodes -------------------------------------------------
def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _trigger(plan: Plan, gpus: tuple[int, ...], deadline: float, before: str) -> str | None:
    """The latest node on ``gpus`` (not a transfer) to finish by ``deadline`` and start before
    ``before`` does: the prefetch waits for it, so it starts late enough but not too late."""
    start = plan.slots[before].start
    best = None
    for s in plan.slots.values():
        if s.lane != "copy" and set(s.gpus) & set(gpus) and s.finish <= deadline + EPS and s.start < start - EPS:
            if best is None or (s.finish, s.start) > (best.finish, best.start):
                best = s
    return best.node if best else None


def _materialize(plan: Plan, tensors: list[Tensor], actions: list[Action]):
    graph, period = plan.graph, plan.makespan
    inputs = {n.name: list(n.inputs) for n in graph}
    extra: list[Node] = []
    infos: dict[str, dict] = {}
    order: list[tuple[str, str]] = []
    by_name = {t.name: t for t in tensors}
    current: dict[str, str] = {}  # value → the name its later consumers read
    readers: dict[str, list[str]] = {}  # value (or a copy) → the nodes that read it now
    taken = set(graph.nodes) | set(graph.values)

    def fresh(stem: str) -> int:
        k = 0
        while any(f"{x}{k}" in taken for x in (f"offload_{_safe(stem)}_", f"{stem}@host", f"{stem}@dev")):
            k += 1
        taken.update({f"offload_{_safe(stem)}_{k}", f"prefetch_{_safe(stem)}_{k}", f"{stem}@host{k}", f"{stem}@dev{k}"})
        return k

    for act in sorted((a for a in actions if a.kind == "offload"), key=lambda a: (a.tensor, a.gap.a)):
        t = by_name[act.tensor]
        k = fresh(t.name)
        t_off, t_pre = _transfer_times(plan, t)
        deadline = act.gap.b - t_pre
        if act.gap.wrap:  # the prefetch belongs before the first use of the iteration
            deadline -= period
        deadline = max(0.0, deadline)
        base = {"tensor": t.name, "gpus": list(t.gpus), "after": act.gap.after, "before": act.gap.before}
        if t.resident:  # the engine a move asks, and what it moves
            base.update(model=t.owner[0], part=t.owner[1])
        off_name, pre_name = f"offload_{_safe(t.name)}_{k}", f"prefetch_{_safe(t.name)}_{k}"
        if t.resident:
            off = Node(off_name, "offload", (), (), args={**base, "bytes_per_gpu": t.nbytes * (not t.frozen),
                                                          "resident": True}, meta={"at": act.gap.a})
            pre = Node(pre_name, "prefetch", (), (), args={**base, "bytes_per_gpu": t.nbytes, "resident": True},
                       meta={"at": deadline})
            if not act.gap.wrap:
                order.append((off_name, pre_name))
        else:
            value = graph.values[t.name]
            src = current.get(t.name, t.name)
            host, dev = f"{t.name}@host{k}", f"{t.name}@dev{k}"
            off = Node(off_name, "offload", (src,), (host,), args={**base, "bytes_per_gpu": t.nbytes},
                       meta={"at": act.gap.a})
            pre = Node(pre_name, "prefetch", (host,), (dev,), args={**base, "bytes_per_gpu": t.nbytes},
                       meta={"at": deadline})
            infos[host] = replace(value, device="host")  # the same value, for a while on the host
            infos[dev] = value
            before = readers.pop(src) if src in readers else list(graph.consumers(src))
            readers[src] = [n for n in before if plan.slots[n].start < act.gap.b - EPS]
            readers[dev] = [n for n in before if plan.slots[n].start >= act.gap.b - EPS]
            for n in readers[dev]:  # consumers after the gap read the prefetched copy
                inputs[n] = [dev if v == src else v for v in inputs[n]]
            current[t.name] = dev
        if act.gap.after:
            order.append((act.gap.after, off_name))
        trigger = _trigger(plan, t.gpus, deadline, act.gap.before)
        if trigger:
            order.append((trigger, pre_name))
        order += [(pre_name, n) for n in (act.gap.before_all or (act.gap.before,))]
        extra += [off, pre]
    rebuilt = [Node(n.name, n.kind, tuple(inputs[n.name]), n.outputs, n.model, n.engine, n.args, dict(n.meta))
               for n in graph] + extra
    new = rebuild(graph, rebuilt, infos)
    for u, v in order:
        new.add_order(u, v, reason="residency")
    return new.lint()


def _write_residency(plan: Plan, residents: list[Resident], decisions: dict) -> None:
    """``meta["residency"]`` of each producing node: its device outputs → keep | offload (by
    %node); graph ``meta["residency"]``: each resident → its decided gaps."""
    offloaded = {n.inputs[0]: n.name for n in plan.graph if n.kind == "offload" and n.inputs}
    for node in plan.graph:
        outs = {o: (f"offload by %{offloaded[o]}" if o in offloaded else "keep") for o in node.outputs
                if plan.graph.values[o].device == "device"}
        if outs:
            node.meta["residency"] = outs
    plan.graph.meta["residency"] = {
        r.name: [f"{d} between %{after or 'start'} and %{before}" for (t, after, before), d in sorted(decisions.items())
                 if t == r.name] or ["keep"] for r in residents}


def plan_memory(plan: Plan, residents: list[Resident], budget: float | None = None, *, enabled: bool = True,
                rounds: int = 4, log: Callable[[str], None] | None = None) -> MemoryPlan:
    """Residency for every tensor so that no GPU exceeds ``budget`` (default: the cluster's). Pure:
    returns a new plan with offload/prefetch nodes; ``enabled=False`` only measures."""
    budget = plan.cluster.hbm_budget if budget is None else budget
    gpus = range(plan.cluster.gpus)
    tensors = tensors_of(plan, residents)
    naive = {g: _peak(_events(plan, tensors, {}, g))[0] for g in gpus}
    decisions: dict[tuple[str, str, str], str] = {}
    actions: list[Action] = []
    current = plan
    for _ in range(rounds if enabled else 0):
        new = _decide(current, tensors, decisions, budget)
        if not new:
            break
        actions += new
        fresh = [a for a in new if a.kind == "offload"]
        if fresh:
            current = retime(current, _materialize(current, tensors, fresh))
            tensors = tensors_of(current, residents)
    else:
        if enabled:
            g = max(gpus, key=lambda h: _peak(_events(current, tensors, decisions, h))[0])
            used, at = _peak(_events(current, tensors, decisions, g))
            if used > budget:
                raise MemoryPlanError(_explain(current, tensors, decisions, g, at, used, budget))
    peak = dict(naive) if current is plan and not decisions else \
        {g: _peak(_events(current, tensors, decisions, g))[0] for g in gpus}
    if current is not plan or decisions:
        _write_residency(current, residents, decisions)
    result = MemoryPlan(current, budget, list(residents), decisions, actions, naive, peak, tensors)
    if log is not None:
        log(result.log)
    return result
