"""`rollplex train` at growing batches: seconds per iteration against prompts per iteration.

The embedded default (the tiny Qwen2.5-VL, the colour task, vLLM decode on CPU, DeepSpeed ZeRO-2,
G = 8 samples of up to 8 tokens), without the warm-up, for each P in ``--prompts``; the first
iteration of each run (allocator growth, first steps) is dropped. Also the bytes each iteration's
Dask submission weighs (prompt indices and the graph's name, not pixels). Linear growth keeps the
``s per prompt`` column flat.

    python benchmarks/batch_scaling.py --prompts 16 64 256 --iterations 4 --json /tmp/batch_scaling.json
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json")
    args = ap.parse_args()

    import distributed

    from rollplex.config import load_config
    from rollplex.pipeline.run.runner import train

    sent: list[int] = []
    submit = distributed.Client.submit

    def measured(self, fn, *a, **kw):
        if getattr(fn, "__name__", "") == "run_iteration":
            sent.append(len(pickle.dumps(a)))
        return submit(self, fn, *a, **kw)

    distributed.Client.submit = measured
    rows = []
    print(f"{'P':>5} {'sequences':>9} {'s/iteration':>11} {'s per prompt':>12} {'submitted KiB':>13}")
    for P in args.prompts:
        sent.clear()
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(None, [f"iterations={args.iterations}", "warmup.steps=0", "stop_at_reward=null",
                                     f"rollout.prompts_per_iteration={P}", *args.set])
            train(cfg, Path(tmp) / "run", progress=False, log=lambda *a: None)
            metrics = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        seconds = [m["iter_seconds"] for m in metrics][1:]
        row = {"prompts": P, "sequences": P * cfg.rollout.samples_per_prompt, "iter_seconds": seconds,
               "median_s": statistics.median(seconds), "submitted_bytes": max(sent)}
        rows.append(row)
        print(f"{P:5d} {row['sequences']:9d} {row['median_s']:11.3f} {row['median_s'] / P:12.4f} "
              f"{row['submitted_bytes'] / 1024:13.1f}")
    lo, hi = rows[0], rows[-1]
    print(f"{hi['prompts'] / lo['prompts']:.0f}x the prompts: {hi['median_s'] / lo['median_s']:.1f}x the seconds")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
