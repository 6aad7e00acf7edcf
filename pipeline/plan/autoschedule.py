"""``schedule: auto``: choose between the rollplex and serial schedules by timing both (and, where
train fusion is asked for, rollplex with the training after decode).

Whether the decode window pays depends on the device and the batch: on the CPU and at one prompt
per node it does; on one H200 at 64 decode rows the window's work slows decode by about what it
hides (BENCHMARKS.md, runs 11–15), and the simulator's error there is as large as the margin. Both
schedules apply the same synchronous update, so a run may switch between them freely: the first
iterations alternate, and once each schedule has ``trials`` counted iterations the faster median is
kept for the rest of the run.

The choice is a pure function of the (schedule, seconds) history that metrics.jsonl records, so a
resumed or rolled-back run makes the same choice from the same lines. A candidate whose iteration ran
out of device memory is dropped (the runner restarts the workers and rolls back), and the run
directory's ``DROPPED_FILE`` keeps it out after a resume.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

CANDIDATES: tuple[str, ...] = ("rollplex", "serial")
# With train fusion asked for, the rollplex schedule with the policy's training after decode too: the
# window pays for train fusion only while its work fits beside decode (at 32 prompts × 8 on an H100
# it was twice decode's time, and the fused run 5% slower than serial; BENCHMARKS.md).
UNFUSED = "rollplex-unfused"
DROPPED_FILE = "schedule_auto_dropped.json"  # {candidate: why}, in the run directory


def candidates(train_fusion: bool) -> tuple[str, ...]:
    """The schedules ``schedule: auto`` times, in the order of their first runs."""
    return ("rollplex", UNFUSED, "serial") if train_fusion else CANDIDATES


class Candidate(NamedTuple):
    policy: str  # the iteration spec's policy
    train_fusion: bool  # whether the graph may fuse training
    # train.grad_prefix_lookahead where the user set none (0: unbounded). Unbounded, the unfused graph
    # forwards every micro-batch's policy prefix with grad in the window and holds their graphs until
    # the losses: out of memory on an 80 GB H100 at 3B, 8 × 8, responses up to 1,024, where the fused
    # and serial graphs fit. As a candidate beside them it holds one micro-batch ahead.
    grad_prefix_lookahead: int


def policy_of(schedule: str) -> Candidate:
    """How a candidate's name builds its graph."""
    return Candidate("rollplex", False, 1) if schedule == UNFUSED else Candidate(schedule, True, 0)


@dataclass(frozen=True)
class Choice:
    schedule: str  # the schedule of the next iteration
    decided: bool  # every candidate has its trials: ``schedule`` is kept from now on
    medians: dict[str, float] = field(default_factory=dict)  # per candidate, once decided

    def describe(self, trials: int) -> str:
        timed = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in self.medians.items())
        return (f"schedule auto: {timed} (median of {trials} iteration{'s' * (trials != 1)} each) "
                f"→ {self.schedule} for the rest of the run")


def next_schedule(history: list[tuple[str, float]], trials: int,
                  candidates: tuple[str, ...] = CANDIDATES) -> Choice:
    """``history``: (schedule, seconds) of the run's RL iterations so far, in order. Each
    candidate's first iteration pays its one-off costs (graph captures, allocator growth) and is
    not counted; only each candidate's next ``trials`` are, so later iterations of the kept
    schedule never reopen the choice."""
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    runs = {name: [seconds for ran, seconds in history if ran == name] for name in candidates}
    counted = {name: times[1:trials + 1] for name, times in runs.items()}
    if all(len(times) == trials for times in counted.values()):
        medians = {name: statistics.median(times) for name, times in counted.items()}
        return Choice(min(candidates, key=lambda name: medians[name]), True, medians)
    # The one with the fewest runs goes next: the schedules alternate, so a drift in the machine's
    # speed during the trials reaches both.
    return Choice(min(candidates, key=lambda name: len(runs[name])), False)
