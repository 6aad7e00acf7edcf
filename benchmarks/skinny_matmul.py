"""A decode step's projections, cuBLAS (``F.linear``) against the skinny Triton kernel
(``engines/skinny_matmul.py``), per weight of a preset's decoder layer, each timed as 36 calls in one
CUDA graph (as a step replays them), with the HBM fraction (weight bytes / time).

    python benchmarks/skinny_matmul.py --model qwen2.5-vl-3b --rows 8,64 --tiles 16x256x4x4,32x128x4x4
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def graph_seconds(fn, calls: int = 36, replays: int = 50) -> float:
    """Seconds per call of ``fn`` captured ``calls`` times in one CUDA graph (median of 5 timings)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays / calls)
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-vl-3b")
    ap.add_argument("--rows", default="8,16,32,64")
    ap.add_argument("--tiles", default="", help="BLOCK_NxBLOCK_KxWARPSxSTAGES settings to time (default: the module's)")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="measured device copy bandwidth, B/s")
    args = ap.parse_args()

    from rollplex.engines import skinny_matmul as sm
    from rollplex.pipeline.modelspec import PRESETS

    spec = PRESETS[args.model]
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    shapes = {"q|k|v": (q + 2 * kv, spec.hidden, True), "o": (spec.hidden, q, False),
              "gate|up": (2 * spec.intermediate, spec.hidden, False), "down": (spec.hidden, spec.intermediate, False),
              "lm_head": (spec.vocab, spec.hidden, False)}
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",") if t]
    tiles = tiles or [(sm.BLOCK_N, sm.BLOCK_K, sm.NUM_WARPS, sm.NUM_STAGES)]
    print(f"{args.model}, bf16, µs per call (36 calls per graph), share of {args.bandwidth / 1e12:.1f} TB/s")
    print("rows  weight      MB     cuBLAS        " + "  ".join(f"{'x'.join(map(str, t)):>18}" for t in tiles))
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k, has_bias) in shapes.items():
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            b = torch.randn(n, device=dev, dtype=dt) if has_bias else None
            x = torch.randn(rows, k, device=dev, dtype=dt)
            mb = w.numel() * w.element_size() / 1e6
            want = F.linear(x, w, b)
            cells = []
            base = graph_seconds(lambda: F.linear(x, w, b))
            cells.append(f"{base * 1e6:6.1f} ({mb * 1e6 / base / args.bandwidth:4.0%})")
            for tile in tiles:
                sm.BLOCK_N, sm.BLOCK_K, sm.NUM_WARPS, sm.NUM_STAGES = tile
                got = sm.skinny_linear(x, w, b)
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                t = graph_seconds(lambda: sm.skinny_linear(x, w, b))
                cells.append(f"{t * 1e6:6.1f} ({mb * 1e6 / t / args.bandwidth:4.0%}) {base / t:4.2f}x"
                             + ("" if err < 2e-2 else f" ERR {err:.2g}"))
            print(f"{rows:4d}  {name:8s} {mb:6.1f}  " + "  ".join(cells), flush=True)
            del w, b, x


if __name__ == "__main__":
    main()
