"""Where a decode step's time goes: graph replay time per batch size, its HBM-bandwidth fraction
(weights + KV bytes the step must read / step time), and the kernels of one eager step.

    python benchmarks/decode_profile.py --model qwen2.5-vl-3b --prompt-len 1090
    python benchmarks/decode_profile.py --samples 8 --prefix both    # a prompt's KV per group, or per row

With ``--samples G`` the rows are B / G prompts of G samples each. The bytes a step must read are the
weights, each prompt's KV once per group (``shared``) or once per row (``per-row``), and each row's
own response KV.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-vl-3b")
    ap.add_argument("--prompt-len", type=int, default=1090)
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="measured device copy bandwidth, B/s")
    ap.add_argument("--compile", default="off", choices=("off", "on", "both"),
                    help="the decoder layer through torch.compile; both: eager and compiled side by side")
    ap.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"),
                    help="torch.compile's mode for the compiled runs")
    ap.add_argument("--fuse", default="on", choices=("off", "on", "both"),
                    help="q|k|v and gate|up as one buffer each, projected in one matmul per group (what a "
                         "run sharing the trainer's weights does); both: separate first, then fused")
    ap.add_argument("--attention", default="split-kv",
                    help="the step's attention (engines/decode_attention.py), or several in turn, comma-separated: "
                         "sdpa, split-kv, fused (rotary and cache write in the kernel); both: sdpa,split-kv")
    ap.add_argument("--tilings", default="",
                    help="a JSON file of skinny tilings per weight shape, as decode_linear.py --tilings-out "
                         "writes it, in place of engines/skinny_linear.TILINGS")
    ap.add_argument("--linear", default="cublas",
                    help="the layer's projections, or several in turn, comma-separated: cublas, skinny, "
                         "skinny-norm (engines/skinny_linear.py)")
    ap.add_argument("--kernels", action="store_true",
                    help="per configuration, the kernels of replayed step graphs: launches and µs per step by name")
    ap.add_argument("--max-len", type=int, default=0,
                    help="KV slots per row (default prompt + 300); the bench's is prompt + max new tokens")
    ap.add_argument("--samples", type=int, default=1, help="rows per prompt (G); B / G distinct prompts")
    ap.add_argument("--prefix", default="shared", choices=("shared", "per-row", "both"),
                    help="the prompt's KV held once per group (shared_prefix) or copied into every row")
    ap.add_argument("--prefix-tiles", default="",
                    help="shared prefix only: TOKENSxWARPS settings (prompt tokens per stretch, warps per program) "
                         "to time in turn, e.g. 128x4,256x8 (default: the module's)")
    ap.add_argument("--split-kv-tiles", default="",
                    help="split-kv only: BLOCKxWARPS settings to time in turn, e.g. 64x4,128x8 (default: the module's)")
    args = ap.parse_args()

    from rollplex.engines.base import DecodeRequest, EngineContext
    from rollplex.engines.graph_decode import GraphDecodeEngine
    from rollplex.engines.sharing import fuse_for_rollout
    from rollplex.pipeline.bench.bench import BenchConfig, build_model

    model, spec = build_model(BenchConfig(model=args.model))
    device = torch.device("cuda")
    sizes = [int(x) for x in args.sizes.split(",")]
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "visual" not in n)
    kv_per_token = spec.kv_bytes_per_token(2)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    fusions = {"off": [False], "on": [True], "both": [False, True]}[args.fuse]
    from rollplex.engines import decode_attention

    tiles = [tuple(int(x) for x in t.split("x")) for t in args.split_kv_tiles.split(",") if t]
    tiles = tiles or [(decode_attention.BLOCK, decode_attention.NUM_WARPS)]
    names = ["sdpa", "split-kv"] if args.attention == "both" else args.attention.split(",")
    attentions = [(a, t) for a in names for t in ([None] if a == "sdpa" else tiles)]
    max_len = args.max_len or args.prompt_len + 300
    prefix_tiles = [tuple(int(x) for x in t.split("x")) for t in args.prefix_tiles.split(",") if t]
    prefix_tiles = prefix_tiles or [(decode_attention.PREFIX_TOKENS_PER_SPLIT, decode_attention.PREFIX_WARPS)]
    prefixes = {"shared": [], "per-row": [(False, None)], "both": [(False, None)]}[args.prefix]
    prefixes += [(True, t) for t in prefix_tiles] if args.prefix != "per-row" else []
    linears = args.linear.split(",")
    if args.tilings:
        from rollplex.engines import skinny_linear

        with open(args.tilings) as f:
            skinny_linear.TILINGS.clear()
            skinny_linear.TILINGS.update({tuple(row["shape"]): row["tiling"] and tuple(row["tiling"])
                                          for row in json.load(f)})
    for fused, n, compiled, (attention, tile), (shared, choice), linear in (
            (f, n, c, a, p, lin) for f in fusions for n in sizes for c in modes for a in attentions for p in prefixes
            for lin in linears):
        ptile = choice
        if ptile:
            decode_attention.PREFIX_TOKENS_PER_SPLIT, decode_attention.PREFIX_WARPS = ptile
        if tile:
            decode_attention.BLOCK, decode_attention.NUM_WARPS = tile
        if fused:
            fuse_for_rollout(model.requires_grad_(False))  # in place, once: separate runs go first
        g = min(args.samples, n)
        groups = n // g
        engine = GraphDecodeEngine(EngineContext("", device, torch.bfloat16, 0, {
            "share_model": model, "max_num_seqs": n, "max_model_len": max_len, "shared_prefix": shared, "prefix_slots": groups,
            "max_prompt_len": args.prompt_len, "max_response_len": max_len - args.prompt_len,
            "compile": args.compile_mode if compiled else False, "attention": attention, "linear": linear}))
        ids = torch.randint(100, 100000, (groups, args.prompt_len))
        engine.add_requests([DecodeRequest(f"r{i}", ids[i].tolist(), None, None, max_tokens=256, seed=i, n=g)
                             for i in range(groups)])
        engine.step(4)  # prefill, capture
        torch.cuda.synchronize()
        t = time.perf_counter()
        steps = 64
        engine.step(steps)
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - t) / steps
        prompt_reads = groups if shared else n  # prompt KV read per step, in prompts
        need = weights + (prompt_reads * args.prompt_len + n * 36) * kv_per_token
        label = (f"B={n:3d} G={g}{' shared' if shared else ' per-row'}{f' {ptile[0]}x{ptile[1]}' if ptile else ''}"
                 f"{' compiled' if compiled else ''}"
                 f"{' fused' if engine.w.fused else ''} {attention}"
                 f"{f' {tile[0]}x{tile[1]}' if tile else ''}{f' {linear}' if linear != 'cublas' else ''}")
        print(f"{label}: {per_step * 1e3:6.2f} ms/step, {need / per_step / 1e12:5.2f} TB/s = "
              f"{need / per_step / args.bandwidth:5.1%} of {args.bandwidth / 1e12:.1f} TB/s; "
              f"{n / per_step:8.0f} tok/s; KV cache {engine_kv_bytes(engine) / 2**30:.2f} GiB")
        if args.kernels:
            print(kernel_table(engine, per_step))
        if (not args.kernels and n == sizes[-1] and compiled == modes[-1] and fused == fusions[-1]
                and (attention, tile) == attentions[-1]
                and (shared, choice) == prefixes[-1] and linear == linears[-1]):
            engine.use_graphs = False
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                engine.step(2)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
        engine.close()


def kernel_table(engine, per_step: float, steps: int = 16) -> str:
    """The kernels of ``steps`` replayed step graphs (CUPTI records each node of a graph launch):
    launches and device µs per step by kernel name, and what of the step no kernel covers."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step(steps)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kernels.setdefault(e.name, []).append(e.device_time_total)
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    busy = sum(sum(v) for v in kernels.values()) / steps
    lines = [f"  {'µs/step':>8} {'launches/step':>13}  kernel"]
    lines += [f"  {sum(v) / steps:8.1f} {len(v) / steps:13.1f}  {name[:110]}" for name, v in rows[:40]]
    lines.append(f"  kernels busy {busy:.0f} µs of {per_step * 1e6:.0f} µs per step "
                 f"({sum(len(v) for v in kernels.values()) / steps:.0f} launches); gaps {per_step * 1e6 - busy:.0f} µs")
    return "\n".join(lines)


def engine_kv_bytes(engine) -> int:
    b = engine.batch
    caches = b.k + b.v + (b.pk + b.pv if engine.shared_prefix else [])
    return sum(t.numel() * t.element_size() for t in caches)


if __name__ == "__main__":
    main()
