"""The Qwen2.5-VL vision tower with transformers' per-window attention against one SDPA call per run
of equal windows (engines/vision_attention.py), side by side in one process.

    python benchmarks/vit_attention.py                       # 3B tower, 8 images of 1024 merged tokens, CUDA
    python benchmarks/vit_attention.py --device cpu --images 1 --merged 64 --model <config.json>   # smoke

Prints milliseconds per tower forward (median of --repeat after one warm-up) and the largest
difference between the two outputs.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def main() -> None:
    from rollplex.engines.vision_attention import batch_vision_attention
    from rollplex.pipeline.bench.bench import BenchConfig, build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-3b")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--merged", type=int, default=1024, help="merged vision tokens per image (a square)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model, _ = build_model(BenchConfig(model=args.model, device=args.device, dtype=dtype, layers=1))
    batched = model.model.visual
    plain = copy.deepcopy(batched)
    reverted = 0
    for m in plain.modules():  # back to transformers' class: the per-window loop
        if type(m).__name__ == "BatchedVisionAttention":
            m.__class__ = m.__class__.__mro__[1]
            reverted += 1
    assert reverted and batch_vision_attention(batched) == 0  # build_model switched every module
    side = int(args.merged ** 0.5) * 2
    grid = torch.tensor([[1, side, side]] * args.images, device=args.device)
    pixels = torch.randn(args.images * side * side, 3 * 2 * 14 * 14, dtype=getattr(torch, dtype), device=args.device)

    def timed(tower) -> tuple[float, torch.Tensor]:
        times = []
        with torch.no_grad():
            for i in range(args.repeat + 1):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                out = tower(pixels, grid_thw=grid)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t)
        out = out.pooler_output if hasattr(out, "pooler_output") else out
        return statistics.median(times) * 1e3, out

    ms_plain, a = timed(plain)
    ms_batched, b = timed(batched)
    diff = float((a.float() - b.float()).abs().max())
    print(f"vision tower, {args.images} images x {side * side} patches, {args.device} {dtype}: "
          f"per-window {ms_plain:.1f} ms, batched {ms_batched:.1f} ms ({ms_plain / ms_batched:.1f}x); "
          f"max |difference| {diff:.2e}")


if __name__ == "__main__":
    main()
