"""Print one markdown table row per run directory: how the reward moved, and PPO's value loss.

    python scripts/summarize_runs.py runs/ppo runs/rloo ...

Columns: the algorithm, RL iterations run, mean reward of the first and the last 10 iterations
(chance is the task's ``reward_chance``), the first iteration whose 10-iteration moving mean reached
0.9 (or "-"), the critic's value loss over the first and last 10 iterations where there is one, and
the median seconds per iteration.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summarize(run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    algorithm = (run_dir / "config.yaml").read_text().split("algorithm:", 1)[1].split()[0]
    reward = [r["reward_mean"] for r in rl]
    first, last = statistics.mean(reward[:10]), statistics.mean(reward[-10:])
    reached = next((i for i in range(9, len(reward)) if statistics.mean(reward[i - 9 : i + 1]) >= 0.9), None)
    value = [r["loss_critic"] for r in rl if "loss_critic" in r]
    vl = f"{statistics.mean(value[:10]):.3f} → {statistics.mean(value[-10:]):.3f}" if value else "-"
    seconds = statistics.median(r["iter_seconds"] for r in rl)
    return (f"| {algorithm} | {len(rl)} | {rl[0]['reward_chance']:.2f} | {first:.3f} | {last:.3f} | "
            f"{reached if reached is not None else '-'} | {vl} | {seconds:.2f} |")


if __name__ == "__main__":
    print("| algorithm | RL iterations | chance | reward, first 10 | reward, last 10 | 10-it mean ≥ 0.9 at | "
          "value loss, first 10 → last 10 | s/iteration |")
    print("|---|---|---|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))
