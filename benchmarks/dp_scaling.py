"""Data-parallel scaling: iteration time with one Dask worker (rank) per GPU against one GPU, at the same
per-GPU batch (weak scaling: N GPUs take N times the prompts). Each run is a real `rollplex train` on a
LocalCluster with ``cluster.workers = N`` (DeepSpeed ZeRO-2 ranks over NCCL, one decode engine per
rank). Also reports Dask's own time per node (benchmarks/overhead.py) for each N.

    # on the 2-GPU machine (H200 x2), a 3B-wide model in bf16:
    python benchmarks/dp_scaling.py --gpus 1,2 --scale h200 --json dp_scaling.json
    # CPU dry run (two gloo ranks, the tiny model):
    python benchmarks/dp_scaling.py --gpus 1,2 --device cpu --iterations 4 --prompts-per-gpu 2 --samples 2

Needs only torch, transformers, deepspeed and dask/distributed (no vLLM: decode is the hf engine).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(n: int, args, model: str | None, root: Path) -> dict:
    from overhead import dask_time_per_node

    from rollplex.config import load_config
    from rollplex.pipeline.run.runner import train

    cuda = args.device == "cuda"
    overrides = [
        f"iterations={args.iterations}", "warmup.steps=0", "stop_at_reward=null", "checkpoint.every=0",
        f"cluster.workers={n}", f"cluster.threads={args.threads}",
        f"rollout.prompts_per_iteration={n * args.prompts_per_gpu}", f"rollout.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.chunk_tokens={args.chunk_tokens}",
        f"train.micro_batch_groups={args.micro_batch_groups}", "train.zero_stage=2",
        f"model.device={args.device}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
        "engines.decode=hf", "engines.train=deepspeed",
        *([f"model.path={model}"] if model else []),
    ]
    cfg = load_config(None, overrides)
    run_dir = root / f"gpus{n}"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.time()
    train(cfg, run_dir, progress=False, log=lambda line: print(f"[{n} GPU] {line}", flush=True))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    seconds = [r["iter_seconds"] for r in rows if r.get("phase") == "rl"]
    steady = seconds[args.skip:] or seconds
    median = statistics.median(steady)
    samples = n * args.prompts_per_gpu * args.samples
    return {"workers": n, "iter_seconds": seconds, "median_s": median, "samples_per_s": samples / median,
            "response_len_mean": statistics.mean(r["response_len_mean"] for r in rows if r.get("phase") == "rl"),
            "wall_s": time.time() - t0, "dask": dask_time_per_node(cfg, run_dir, args.skip)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,2", help="worker counts to run, comma-separated (one worker per GPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--scale", default="h200", help="model shape: tiny or h200 (benchmarks/scales.py)")
    ap.add_argument("--layers", type=int, help="override the scale's depth")
    ap.add_argument("--prompts-per-gpu", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=16)
    ap.add_argument("--micro-batch-groups", type=int, default=2, help="prompt groups per loss node")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="first iterations left out (allocator, autotune)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stream thread")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--runs-dir", type=Path, help="keep run directories here (default: temp, removed)")
    args = ap.parse_args()
    counts = [int(x) for x in args.gpus.split(",") if x]
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < max(counts):
            ap.error(f"--gpus {args.gpus}: only {torch.cuda.device_count()} CUDA devices visible")
    if args.scale == "tiny" and args.device == "cuda":
        print("note: the tiny model on a GPU measures dispatch, not scaling", flush=True)
    model = None
    if args.scale != "tiny" or args.layers:
        from scales import model_path

        t = time.time()
        model = str(model_path(args.scale, args.layers))
        print(f"model {model} ready in {time.time() - t:.0f}s", flush=True)
    root = args.runs_dir or Path(tempfile.mkdtemp(prefix="rollplex-dp-"))
    results = []
    try:
        for n in counts:
            results.append(run(n, args, model, root))
    finally:
        if args.runs_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    base = results[0]
    print(f"\nweak scaling, {args.prompts_per_gpu} prompts x {args.samples} samples per GPU, "
          f"max_new_tokens {args.max_new_tokens}, {args.device}, scale {args.scale}; first {args.skip} iterations "
          f"left out")
    print(f"{'GPUs':>5}{'median s/it':>13}{'vs 1 GPU':>10}{'samples/s':>11}{'speedup':>9}{'Dask ms/node':>14}"
          f"{'node ms':>9}")
    for r in results:
        r["time_ratio"] = r["median_s"] / base["median_s"]
        r["throughput_speedup"] = r["samples_per_s"] / base["samples_per_s"]
        print(f"{r['workers']:>5}{r['median_s']:>13.3f}{r['time_ratio']:>10.2f}{r['samples_per_s']:>11.1f}"
              f"{r['throughput_speedup']:>9.2f}{r['dask']['dask_ms_median']:>14.2f}{r['dask']['node_ms_median']:>9.2f}")
    if args.json:
        out = {"device": args.device, "scale": args.scale, "layers": args.layers, "args": vars(args) | {
            "json": str(args.json), "runs_dir": str(args.runs_dir)}, "results": results}
        from rollplex.fsio import atomic_write_text

        atomic_write_text(args.json, json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":  # LocalCluster workers re-import this file
    sys.exit(main())
