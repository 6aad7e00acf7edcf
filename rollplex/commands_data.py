"""`rollplex plot`, `rollplex export-task` and `rollplex init-model`: look at a run, write the embedded
task as a dataset, and write a random-weight model of a preset's architecture to train at scale.

Heavy imports (matplotlib, PIL, pyarrow) happen inside the commands, so `rollplex --help` stays fast.
"""
from __future__ import annotations

import argparse


def cmd_plot(args) -> int:
    from rollplex.pipeline.run.plot import plot_run

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


def cmd_init_model(args) -> int:
    from rollplex.engines.models import preset_spec, write_vlm
    from rollplex.errors import ConfigError
    from rollplex.tasks.data import SyntheticVisualTask, task_corpus

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: this machine has no CUDA device; draw the weights on --device cpu")
    spec = preset_spec(args.preset, task_corpus(SyntheticVisualTask()), layers=args.layers,
                       vision_layers=args.vision_layers, dtype=args.dtype, seed=args.seed)
    path = write_vlm(spec, args.out, args.device)
    layers = spec.num_hidden_layers
    print(f"wrote {path} ({args.preset} architecture, {layers} decoder layer{'s' * (layers != 1)}, random weights, "
          f"{args.dtype}; train on it with --set model.path={path} --set model.dtype={args.dtype})")
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

    m = sub.add_parser("init-model", help="write a random-weight Qwen2.5-VL of a preset's shape (HF format), "
                                          "with the embedded task's tokenizer, for runs at scale")
    m.add_argument("out", help="a new directory")
    m.add_argument("--preset", default="qwen2.5-vl-7b", help="qwen2.5-vl-3b, qwen2.5-vl-7b, qwen2.5-vl-32b")
    m.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    m.add_argument("--vision-layers", type=int, help="ViT blocks (default: the preset's)")
    m.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the random weights are drawn (cuda: seconds for a 7B model; the values differ "
                        "from the CPU's for the same seed)")
    m.set_defaults(fn=cmd_init_model)
