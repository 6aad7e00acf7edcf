"""``schedule: auto``'s choice as a pure function of the run's (schedule, seconds) history."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollplex.pipeline.plan.autoschedule import next_schedule


def run(times: dict[str, list[float]], trials: int, iterations: int) -> list[tuple[str, float]]:
    """Drive the chooser as the runner does: each schedule's iterations take the given times in turn."""
    history: list[tuple[str, float]] = []
    used = {name: 0 for name in times}
    for _ in range(iterations):
        name = next_schedule(history, trials).schedule
        history.append((name, times[name][min(used[name], len(times[name]) - 1)]))
        used[name] += 1
    return history


def test_the_schedules_alternate_then_the_faster_median_is_kept():
    # Each first run (5.0 s: captures) is not counted; serial's counted median is lower.
    history = run({"rollplex": [5.0, 0.40, 0.42, 0.41], "serial": [5.0, 0.38, 0.39, 0.50]}, trials=3, iterations=12)
    names = [name for name, _ in history]
    assert names[:8] == ["rollplex", "serial"] * 4
    assert names[8:] == ["serial"] * 4
    choice = next_schedule(history[:8], 3)
    assert choice.decided and choice.medians == {"rollplex": 0.41, "serial": 0.39}
    assert "serial 0.390 s" in choice.describe(3) and "→ serial" in choice.describe(3)


def test_the_first_run_of_each_schedule_is_not_counted():
    # Rollplex's first run is slow and serial's fast: counted, they would flip the choice.
    history = run({"rollplex": [9.0, 0.30], "serial": [0.01, 0.35]}, trials=1, iterations=6)
    assert [name for name, _ in history][4:] == ["rollplex", "rollplex"]


def test_later_iterations_of_the_kept_schedule_never_reopen_the_choice():
    history = [("rollplex", 1.0), ("serial", 1.0), ("rollplex", 0.3), ("serial", 0.4)]
    history += [("rollplex", 50.0)] * 5  # the kept schedule slows down later: still kept
    assert next_schedule(history, 1) == next_schedule(history[:4], 1)


def test_schedules_it_does_not_know_are_ignored():
    # An earlier stretch of the run under a fixed schedule name that is not a candidate.
    assert next_schedule([("other", 0.1)] * 3, 1).schedule == "rollplex"


def test_trials_must_be_positive():
    with pytest.raises(ValueError, match="trials"):
        next_schedule([], 0)


@settings(max_examples=60, deadline=None)
@given(trials=st.integers(1, 4), seconds=st.lists(st.floats(0.01, 10.0), min_size=30, max_size=30))
def test_invariants_for_any_timings(trials, seconds):
    """Whatever the timings: both schedules get trials + 1 runs before a decision, the decision comes
    right after, it is the lower median, and the history is never re-decided differently."""
    history: list[tuple[str, float]] = []
    decided_at = None
    for step, s in enumerate(seconds):
        choice = next_schedule(history, trials)
        if choice.decided and decided_at is None:
            decided_at = step
            first = choice
        if decided_at is not None:
            assert choice == first
        history.append((choice.schedule, s))
    assert decided_at == 2 * (trials + 1)
    assert first.medians[first.schedule] == min(first.medians.values())


def test_with_train_fusion_three_schedules_take_turns_and_the_fastest_is_kept():
    from rollplex.pipeline.plan.autoschedule import candidates, policy_of

    names = candidates(train_fusion=True)
    assert names == ("rollplex", "rollplex-unfused", "serial") and candidates(train_fusion=False) == ("rollplex", "serial")
    assert policy_of("rollplex-unfused")[:2] == ("rollplex", False) and policy_of("serial")[:2] == ("serial", True)
    assert policy_of("rollplex-unfused").grad_prefix_lookahead == 1 and policy_of("rollplex").grad_prefix_lookahead == 0
    times = {"rollplex": [9.0, 0.50, 0.52], "rollplex-unfused": [9.0, 0.40, 0.41], "serial": [9.0, 0.45, 0.44]}
    history: list[tuple[str, float]] = []
    used = dict.fromkeys(names, 0)
    for _ in range(9):
        name = next_schedule(history, 2, names).schedule
        history.append((name, times[name][used[name]] if used[name] < 3 else 0.4))
        used[name] += 1
    assert [n for n, _ in history] == list(names) * 3
    choice = next_schedule(history, 2, names)
    assert choice.decided and choice.schedule == "rollplex-unfused"



def test_the_unfused_candidate_holds_one_micro_batch_of_prefix_graphs_ahead_unless_told(tmp_path):
    """schedule: auto's rollplex-unfused graph would otherwise forward every micro-batch's policy
    prefix with grad in the decode window and hold all their graphs (out of memory on an 80 GB GPU
    where serial fits): as a candidate, the prefix of micro-batch m waits for the loss of m - 1."""
    import networkx as nx

    from rollplex.config import load_config
    from rollplex.pipeline.run.session import Session

    def losses_before_prefixes(name: str, overrides: list[str]) -> list[int]:
        cfg = load_config(None, ["schedule=auto", "train.train_fusion=true", "engines.train=torch",
                                 "rollout.prompts_per_iteration=8", "train.micro_batch_groups=2",
                                 "train.prompts_per_node=2", *overrides])
        graph = Session(cfg, tmp_path / "-".join([name, *overrides])).graphs[name]
        return [sum(graph.nodes[a].kind == "loss" for a in nx.ancestors(graph.g, node.name))
                for node in graph if node.kind == "prefix" and node.args.get("grad")]

    assert losses_before_prefixes("rollplex-unfused", []) == [0, 1, 2, 3]
    assert losses_before_prefixes("rollplex-unfused", ["train.grad_prefix_lookahead=2"]) == [0, 0, 1, 2]
    assert all(n == 0 for n in losses_before_prefixes("serial", []))


def test_a_candidate_that_runs_out_of_memory_is_dropped_and_the_run_goes_on(tmp_path):
    """schedule: auto's first candidate (rollplex) runs out of device memory inside its first
    iteration's decode: the run restarts its worker, rolls back to the warm-up's checkpoint, times
    serial alone and finishes; the run directory keeps the drop, so a resumed run leaves it out too."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from reliability_harness import HF_TORCH, ITERATIONS, Launch, metric_rows

    from rollplex.config import load_config
    from rollplex.errors import RollplexError
    from rollplex.pipeline.plan.autoschedule import DROPPED_FILE
    from rollplex.pipeline.run.session import Session

    run_dir = tmp_path / "auto-oom"
    auto = ["--set", "schedule=auto", "--set", "schedule_trials=1", "--set", "cluster.processes=true"]
    launch = Launch(run_dir, HF_TORCH + auto, {"ROLLPLEX_TEST_FAULT": "task:decode_chunk:before",
                                               "ROLLPLEX_TEST_FAULT_KILL": "oom",
                                               "ROLLPLEX_TEST_FAULT_ONCE": str(tmp_path / "fired")})
    try:
        rc = launch.finish()
    finally:
        launch.signal_group(9)
    assert rc == 0, launch.log()
    dropped = [line for line in launch.lines if "ran out of device memory" in line]
    assert len(dropped) == 1 and "iteration 0: schedule auto's candidate rollplex" in dropped[0], launch.log()
    assert "timing serial without it" in dropped[0] and "rolling back to after_warmup" in dropped[0], dropped
    rows = [r for r in metric_rows(run_dir) if r.get("phase") == "rl"]
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS))
    assert {r["schedule"] for r in rows} == {"serial"}
    assert list(json.loads((run_dir / DROPPED_FILE).read_text())) == ["rollplex"]
    cfg = load_config(None, ["schedule=auto", "engines.decode=hf", "engines.train=torch"])
    assert Session(cfg, run_dir).schedules == ("serial",)
    assert Session(cfg, tmp_path / "elsewhere").schedules == ("rollplex", "serial")
    (run_dir / DROPPED_FILE).write_text("[rollplex")
    with pytest.raises(RollplexError, match=f"{DROPPED_FILE}: not the .* delete it"):
        Session(cfg, run_dir)
