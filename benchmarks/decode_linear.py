"""A decode step's projections at a few rows: cuBLAS (``F.linear``) against ``skinny_linear``'s tilings.

    scripts/on-device.sh python benchmarks/decode_linear.py --models qwen2.5-vl-3b --rows 8,64 --json $OUT/linear.json

Per model and row count, each projection of one decoder layer (q|k|v with its bias, o, gate|up, down)
and the LM head, in bf16: µs per call and the bandwidth its bytes (weights, input, output) make of that
time, for cuBLAS and for every tiling in ``engines/skinny_linear.CONFIGS``. Each is timed as a CUDA
graph of calls over enough copies of the weight that none is read from L2 (a decode step reads each
weight once), so the time is a step's, without launch gaps. Prints the best tiling per shape and its
ratio to cuBLAS, then the ``TILINGS`` table these timings give: a shape where the kernel does not win
keeps cuBLAS.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

L2_BYTES = 256 * 2**20  # copies of a weight are cycled until their bytes pass this (H100/H200 L2: 50 MB)


def shapes(model: str) -> list[tuple[str, int, int, bool]]:
    """(name, out features N, in features K, bias) of one layer's projections and the LM head."""
    from rollplex.engines.modelspec import PRESETS

    m = PRESETS[model]
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    return [("qkv", qkv, m.hidden, True), ("o", m.hidden, m.heads * m.head_dim, False),
            ("gate_up", 2 * m.intermediate, m.hidden, False), ("down", m.hidden, m.intermediate, False),
            ("lm_head", m.vocab, m.hidden, False)]


def per_call_seconds(call, copies: int, repeats: int = 5) -> float:
    """A CUDA graph of ``call(i)`` for each copy i, replayed: the median seconds of one call."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up: compiles the kernel, picks cuBLAS's algorithm
            call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(copies):
            call(i)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / copies)
    return sorted(times)[len(times) // 2]


def proposed_tilings(results: list[dict]) -> dict:
    """(n, k) -> the tiling with the least time summed over the measured row counts, or None where
    cuBLAS's sum is less."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for row in results:
        by_shape.setdefault((row["n"], row["k"]), []).append(row)
    chosen = {}
    for shape, rows in sorted(by_shape.items()):
        total = {c: sum(r["configs"][c] for r in rows) for c in rows[0]["configs"]}
        best = min(total, key=total.get)
        chosen[shape] = tuple(json.loads(best.replace("(", "[").replace(")", "]"))) \
            if total[best] < sum(r["cublas_s"] for r in rows) else None
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-vl-3b", help="presets, comma-separated")
    ap.add_argument("--rows", default="8,64", help="decode rows (M), comma-separated; at most 64")
    ap.add_argument("--json", default="", help="write every timing here")
    ap.add_argument("--tilings-out", default="", help="write the proposed tilings here, for decode_profile.py --tilings")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_linear.py times CUDA kernels: run it on the GPU machine")
    from rollplex.engines.skinny_linear import CONFIGS, skinny_linear

    device, rows_list, results = torch.device("cuda"), [int(r) for r in args.rows.split(",")], []
    print(f"{torch.cuda.get_device_name()}; bf16; µs per call (TB/s)")
    for model in args.models.split(","):
        for name, n, k, bias in shapes(model):
            weight_bytes = n * k * 2
            copies = max(2, -(-L2_BYTES // weight_bytes))
            ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            b = torch.randn(n, device=device, dtype=torch.bfloat16) if bias else None
            for m in rows_list:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                moved = weight_bytes + (m * k + m * n) * 2
                want = F.linear(x, ws[0], b)
                row = {"model": model, "name": name, "n": n, "k": k, "rows": m,
                       "cublas_s": per_call_seconds(lambda i: F.linear(x, ws[i], b), copies), "configs": {}}
                for config in CONFIGS:
                    got = skinny_linear(x, ws[0], b, config)
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    if err > 2e-2:
                        sys.exit(f"{model} {name} rows {m} config {config}: relative error {err:.2e}")
                    row["configs"][str(config)] = per_call_seconds(lambda i: skinny_linear(x, ws[i], b, config),
                                                                   copies)
                best = min(row["configs"], key=row["configs"].get)
                row["best"], row["best_s"] = best, row["configs"][best]
                results.append(row)
                cublas, mine = row["cublas_s"], row["best_s"]
                print(f"{model:14s} {name:8s} {n:6d}×{k:<6d} rows {m:3d}: cuBLAS {cublas * 1e6:7.1f} "
                      f"({moved / cublas / 1e12:4.2f}), skinny {mine * 1e6:7.1f} ({moved / mine / 1e12:4.2f}) "
                      f"{best}: {cublas / mine:4.2f}×")
            del ws
    print("engines/skinny_linear.TILINGS from this run (the tiling fastest over every row count, None where\n"
          "cuBLAS is faster in sum):")
    tilings = proposed_tilings(results)
    print(f"TILINGS = {tilings!r}")
    if args.tilings_out:
        with open(args.tilings_out, "w") as f:
            json.dump([{"shape": list(shape), "tiling": tiling} for shape, tiling in tilings.items()], f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
