"""Multi-turn prefix reuse in training: the zoom job with the trajectories scored on their shared
prefixes (the default) against each trajectory over its whole sequence (``train.prefix_sharing:
false``, the no-reuse baseline), and the default run again (A/A: the noise).

The three runs share one process, one seed and the same warm-up, so iteration i of each samples the
same prompts from nearly the same policy (their updates agree up to summation order,
tests/test_multiturn.py), and the ratios pair them by iteration. Prints per
run the median seconds per iteration and in the scoring and training nodes (prefix, suffix_score,
loss: the work that reuse changes), the scoring forwards' tokens, and the paired per-iteration
ratios baseline ÷ default with their 95% interval (pipeline/bench/results.median_interval).

    python benchmarks/multiturn_reuse.py --iterations 40 --json /tmp/multiturn_reuse.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

WORK_KINDS = ("prefix", "suffix_score", "loss")  # scoring forwards and the loss's backward through them


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--skip", type=int, default=2, help="first iterations of each run not compared")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--json")
    args = ap.parse_args()

    from rollplex.config import load_config
    from rollplex.pipeline.bench.results import median_interval
    from rollplex.pipeline.run.runner import train

    base = ["task.name=zoom", "rollout.max_turns=2", "engines.train=torch", f"iterations={args.iterations}",
            "stop_at_reward=null", "checkpoint.every=0", *args.set]
    variants = {"shared": [], "unshared": ["train.prefix_sharing=false"], "shared again": []}
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants.items():
            run_dir = Path(tmp) / name.replace(" ", "_")
            train(load_config(None, base + extra), run_dir, progress=False, log=lambda *a: None)
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            rows[name] = [r for r in map(json.loads, lines) if r["phase"] == "rl"][args.skip:]

    def work(r: dict) -> float:
        return sum(r["seconds_by_kind"].get(k, 0.0) for k in WORK_KINDS)

    result = {}
    print(f"{'run':13s} {'s/iteration':>11s} {'scoring+loss s':>14s} {'forward tokens':>14s}")
    for name, rs in rows.items():
        result[name] = {"iter_seconds": statistics.median(r["iter_seconds"] for r in rs),
                        "work_seconds": statistics.median(work(r) for r in rs),
                        "forward_tokens": statistics.median(r["forward_tokens"] for r in rs)}
        print(f"{name:13s} {result[name]['iter_seconds']:11.3f} {result[name]['work_seconds']:14.3f} "
              f"{result[name]['forward_tokens']:14.0f}")
    for label, (a, b) in (("unshared ÷ shared", ("unshared", "shared")), ("A/A", ("shared again", "shared"))):
        for what, of in (("iteration", lambda r: r["iter_seconds"]), ("scoring+loss", work)):
            ratios = [of(x) / of(y) for x, y in zip(rows[a], rows[b])]
            mid = median_interval(ratios)
            result[f"{label}: {what}"] = mid
            text = f"{mid[0]:.2f}× ({mid[1]:.2f}–{mid[2]:.2f})" if mid else "too few iterations for an interval"
            print(f"{label:18s} {what:13s} {text}   (n = {len(ratios)})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
