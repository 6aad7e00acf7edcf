"""`rollplex plot` and `rollplex export-task`: look at a run, and write the embedded task as a dataset.

Heavy imports (matplotlib, PIL, pyarrow) happen inside the commands, so `rollplex --help` stays fast.
"""
from __future__ import annotations

import argparse


def cmd_plot(args) -> int:
    from rollplex.pipeline.plot import plot_run

    for path in plot_run(args.run_dir, args.out, args.iteration):
        print(f"wrote {path}")
    return 0


def cmd_export_task(args) -> int:
    from rollplex.tasks.dataset import export_synthetic

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    path = export_synthetic(args.out, size=args.size, kinds=kinds, image_size=args.image_size, seed=args.seed,
                            fmt=args.format, video_frames=args.video_frames)
    print(f"wrote {path} ({args.size} rows; train on it with --set data.path={path})")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="PNGs of a run: reward/KL/loss curves, time per node kind, an iteration's Gantt")
    p.add_argument("run_dir", help="a run directory written by `rollplex train`")
    p.add_argument("--out", help="output directory (default: RUN_DIR/plots)")
    p.add_argument("--iteration", type=int, help="the iteration of the Gantt chart (default: the last traced)")
    p.set_defaults(fn=cmd_plot)

    e = sub.add_parser("export-task", help="write the embedded synthetic task as a jsonl (or parquet) dataset")
    e.add_argument("out", help="output directory: train.jsonl and images/, or train.parquet")
    e.add_argument("--size", type=int, default=64, help="rows")
    e.add_argument("--kinds", default="colour", help="comma-separated: colour, shape, count")
    e.add_argument("--image-size", type=int, default=112, help="image side in pixels (a multiple of 28)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    e.add_argument("--video-frames", type=int, default=0,
                   help="> 0: each row holds a video of this many frames instead of an image")
    e.set_defaults(fn=cmd_export_task)
