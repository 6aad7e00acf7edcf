"""Discrete-event timing of one iteration on GPU lanes: the engine under both the list scheduler
(``dispatch``) and the simulator (``replay``).

A job runs on one lane (``decode``, ``compute``, ``host``, ``copy``) of every GPU of its gang, for
``seconds`` of work at rate 1. Jobs on the decode and compute lanes of one GPU interfere
(``hardware.Interference``): beside decode at batch B, compute work progresses at
``compute_rate(B)``, and decode runs ``1/slowdown`` as fast while any compute job shares a GPU of
its gang. A gang job moves at the pace of its slowest GPU. Rates are constant between events, so
each event re-rates only the jobs on the GPUs it touched. With ``gate``, a compute lane stays
closed while the decode beside it is too heavy to hide anything (hidden < ``min_hidden``).

- ``dispatch``: list scheduling. Whenever lanes free, ready jobs are taken in priority order; a
  job either has a fixed gang (a TP group, a whole pool for SPMD work), follows the gang of the
  producer named by ``follow`` (so a prompt's prefix runs where its vision output lives), or takes
  the first free gang of its candidates. A high-priority job that cannot start holds the free GPUs
  of its gang, so that lower-priority work cannot starve it.
- ``replay``: each lane of each GPU runs its jobs in a given order on given gangs, as a plan says.

Both process lanes in the same fixed order at each instant, so replaying a dispatched plan with
the same seconds reproduces its times exactly.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from rollplex.errors import GraphError
from rollplex.pipeline.plan.hardware import Interference

LANES = ("decode", "compute", "host", "copy")  # processing order at one instant: decode first
EPS = 1e-12
_FINISH, _READY = 0, 1


@dataclass(frozen=True)
class Job:
    name: str
    lane: str
    seconds: float
    gangs: tuple[tuple[int, ...], ...]  # candidate gangs; one entry means a fixed gang
    batch: float = 0.0  # decode batch per GPU while it runs (decode lane)
    follow: int = -1  # run on the gang of this (finished) job when it is a candidate
    priority: float = 0.0
    tiebreak: int = 0


@dataclass
class Problem:
    jobs: list[Job]
    succs: list[list[tuple[int, float]]]  # (successor, delay before it may start)
    gpus: int
    interference: Interference
    gate: bool = False


@dataclass
class Timing:
    start: list[float]
    finish: list[float]
    gang: list[tuple[int, ...]]
    seq: list[int]  # the order in which jobs started (ties at one instant included)
    makespan: float = field(init=False)

    def __post_init__(self) -> None:
        self.makespan = max(self.finish, default=0.0)


class _Engine:
    def __init__(self, p: Problem) -> None:
        n = len(p.jobs)
        self.p, self.jobs = p, p.jobs
        self.start = [math.nan] * n
        self.finish = [math.nan] * n
        self.gang: list[tuple[int, ...]] = [()] * n
        self.left = [0.0] * n
        self.rate = [0.0] * n
        self.t_last = [0.0] * n
        self.version = [0] * n
        self.missing = [0] * n
        for succs in p.succs:
            for s, _ in succs:
                self.missing[s] += 1
        self.ready_at = [0.0] * n
        lanes = list(LANES) + sorted({j.lane for j in p.jobs} - set(LANES))
        self.lane_order = lanes
        self.busy = {lane: [-1] * p.gpus for lane in lanes}
        inter = p.interference
        self.crate = [inter.compute_rate(j.batch) for j in p.jobs]
        self.light = [inter.hidden(j.batch) >= inter.min_hidden for j in p.jobs]
        self.slow = 1.0 / inter.slowdown
        self.events: list[tuple] = []
        self.started = [-1] * n
        self.n_started = 0
        self.seq = 0
        self.now = 0.0
        self.done = 0

    # -- events ---------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, i: int, ver: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, i, ver))

    def run(self, bound: float = math.inf) -> Timing | None:
        """Times of every job; None as soon as the clock passes ``bound`` (a trial that lost)."""
        for i, m in enumerate(self.missing):
            if m == 0:
                self._push(0.0, _READY, i)
        while self.events:
            t = self.events[0][0]
            if t > bound:
                return None
            self.now = t
            touched: set[int] = set()
            dirty: set[str] = set()
            while self.events and self.events[0][0] <= t + EPS:
                _, _, kind, i, ver = heapq.heappop(self.events)
                if kind == _FINISH:
                    if ver == self.version[i] and math.isnan(self.finish[i]):
                        self._complete(i, touched, dirty)
                else:
                    self._ready(i)
                    dirty.add(self.jobs[i].lane)
            for lane in self.lane_order:
                if lane in dirty:
                    self._fill(lane, touched)
            self._rerate(touched)
        if self.done < len(self.jobs):
            stuck = [self.jobs[i].name for i in range(len(self.jobs)) if math.isnan(self.finish[i])][:5]
            raise GraphError(f"timing: {len(self.jobs) - self.done} node(s) never ran, e.g. "
                             + ", ".join(f"%{s}" for s in stuck) + "; the plan's lane orders contradict its edges")
        return Timing(self.start, self.finish, self.gang, self.started)

    def _complete(self, i: int, touched: set[int], dirty: set[str]) -> None:
        job = self.jobs[i]
        self.finish[i] = self.now
        self.done += 1
        for g in self.gang[i]:
            self.busy[job.lane][g] = -1
        if job.lane in ("decode", "compute"):
            touched.update(self.gang[i])
            dirty.add("compute")  # a finished decode may open gated compute lanes
        dirty.add(job.lane)
        for s, delay in self.p.succs[i]:
            self.ready_at[s] = max(self.ready_at[s], self.now + delay)
            self.missing[s] -= 1
            if self.missing[s] == 0:
                if self.ready_at[s] > self.now + EPS:
                    self._push(self.ready_at[s], _READY, s)
                else:
                    self._ready(s)
                    dirty.add(self.jobs[s].lane)

    def _start(self, i: int, gang: tuple[int, ...], touched: set[int]) -> None:
        job = self.jobs[i]
        self.start[i] = self.now
        self.started[i] = self.n_started
        self.n_started += 1
        self.gang[i] = gang
        for g in gang:
            self.busy[job.lane][g] = i
        self.left[i] = job.seconds
        self.t_last[i] = self.now
        if job.lane in ("decode", "compute"):
            self.rate[i] = 0.0  # set by _rerate, together with its neighbours'
            touched.update(gang)
        else:
            self.rate[i] = 1.0
            self._push(self.now + job.seconds, _FINISH, i, self.version[i])

    def _rerate(self, touched: set[int]) -> None:
        affected = {self.busy[lane][g] for g in touched for lane in ("decode", "compute")} - {-1}
        for i in sorted(affected):
            new = self._rate(i)
            if new == self.rate[i]:
                continue
            self.left[i] -= self.rate[i] * (self.now - self.t_last[i])
            self.left[i] = max(self.left[i], 0.0)
            self.t_last[i] = self.now
            self.rate[i] = new
            self.version[i] += 1
            self._push(self.now + self.left[i] / new, _FINISH, i, self.version[i])

    def _rate(self, i: int) -> float:
        lane = self.jobs[i].lane
        if lane == "decode":
            compute = self.busy["compute"]
            return self.slow if any(compute[g] >= 0 for g in self.gang[i]) else 1.0
        rate = 1.0
        decode = self.busy["decode"]
        for g in self.gang[i]:
            d = decode[g]
            if d >= 0 and self.crate[d] < rate:
                rate = self.crate[d]
        return rate

    def _open(self, lane: str, g: int) -> bool:
        if self.busy[lane][g] >= 0:
            return False
        if lane == "compute" and self.p.gate:
            d = self.busy["decode"][g]
            return d < 0 or self.light[d]
        return True

    # -- mode-specific --------------------------------------------------------------------------
    def _ready(self, i: int) -> None:
        raise NotImplementedError

    def _fill(self, lane: str, touched: set[int]) -> None:
        raise NotImplementedError


class _Dispatch(_Engine):
    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        self.queues: dict[str, dict[tuple, list]] = {lane: {} for lane in self.lane_order}
        self.ids: dict[tuple[tuple[int, ...], ...], int] = {}  # candidate lists, interned
        self.candidates: list[tuple[tuple[int, ...], ...]] = []

    def _ready(self, i: int) -> None:
        job = self.jobs[i]
        if len(job.gangs) == 1:
            key: tuple = ("g", job.gangs[0])
        elif job.follow >= 0 and self.gang[job.follow] in job.gangs:
            key = ("g", self.gang[job.follow])
        else:
            k = self.ids.get(job.gangs)
            if k is None:
                k = self.ids[job.gangs] = len(self.candidates)
                self.candidates.append(job.gangs)
            key = ("f", k)
        heapq.heappush(self.queues[job.lane].setdefault(key, []), (-job.priority, job.tiebreak, i))

    def _fill(self, lane: str, touched: set[int]) -> None:
        queues = self.queues[lane]
        if not queues:
            return
        free = {g for g in range(self.p.gpus) if self._open(lane, g)}
        if not free:
            return
        heads = [(q[0][0], q[0][1], key) for key, q in queues.items() if q]
        heapq.heapify(heads)
        while heads and free:
            _, _, key = heapq.heappop(heads)
            queue = queues[key]
            gang = None
            if key[0] == "g":
                if free.issuperset(key[1]):
                    gang = key[1]
                else:
                    free.difference_update(key[1])  # held for this higher-priority job
            else:
                gang = next((c for c in self.candidates[key[1]] if free.issuperset(c)), None)
            if gang is None:
                continue
            _, _, i = heapq.heappop(queue)
            self._start(i, gang, touched)
            free.difference_update(gang)
            if queue:
                heapq.heappush(heads, (queue[0][0], queue[0][1], key))
            else:
                del queues[key]


class _Replay(_Engine):
    def __init__(self, p: Problem, gangs: list[tuple[int, ...]], order: dict[tuple[int, str], list[int]]) -> None:
        super().__init__(p)
        self.planned = gangs
        self.order = order
        self.ptr = {key: 0 for key in order}
        self.is_ready = [False] * len(p.jobs)

    def _ready(self, i: int) -> None:
        self.is_ready[i] = True

    def _next(self, g: int, lane: str) -> int:
        seq = self.order.get((g, lane), ())
        k = self.ptr.get((g, lane), 0)
        return seq[k] if k < len(seq) else -1

    def _fill(self, lane: str, touched: set[int]) -> None:
        for g in range(self.p.gpus):
            i = self._next(g, lane)
            if i < 0 or not self.is_ready[i] or not math.isnan(self.start[i]):
                continue
            gang = self.planned[i]
            if all(self._next(h, lane) == i and self._open(lane, h) for h in gang):
                self._start(i, gang, touched)
                for h in gang:
                    self.ptr[(h, lane)] += 1


def dispatch(problem: Problem, bound: float = math.inf) -> Timing | None:
    """List-schedule ``problem``; with a ``bound``, None once the schedule would end later."""
    return _Dispatch(problem).run(bound)


def replay(problem: Problem, gangs: list[tuple[int, ...]], order: dict[tuple[int, str], list[int]]) -> Timing:
    """Run ``order[(gpu, lane)]`` (job indices) on ``gangs``; jobs missing from the order never run."""
    for i, job in enumerate(problem.jobs):
        if not gangs[i]:
            raise GraphError(f"replay: %{job.name} has no gang")
    return _Replay(problem, gangs, order).run()


def lane_orders(problem: Problem, timing: Timing) -> dict[tuple[int, str], list[int]]:
    """Each (gpu, lane)'s jobs in the order they started."""
    order: dict[tuple[int, str], list[int]] = {}
    ranked = sorted(range(len(problem.jobs)), key=timing.seq.__getitem__)
    for i in ranked:
        for g in timing.gang[i]:
            order.setdefault((g, problem.jobs[i].lane), []).append(i)
    return order
