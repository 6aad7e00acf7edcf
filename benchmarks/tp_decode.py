"""How rollout decode scales with tensor parallelism: the `torch-graph` engine on one GPU against
the same engine split over N GPUs (heads and MLP columns per rank, NCCL all-reduces captured in the
step graphs), in one script.

Two measurements per degree, both on the bench's model (random weights):
- ms per decode step at fixed batch sizes (graph replay, no rows leaving);
- one rollout of the bench's workload: P prompts × G samples, each sample capped at a long-tailed
  length as in `rollplex bench`, decoded in chunks until every row finished (prefill included).

    python benchmarks/tp_decode.py --model qwen2.5-vl-3b --tp 2 --json tp.json

Ranks run in processes of their own (torch.distributed needs one rank per process); the one-GPU
figures come from the parent process first, on cuda:0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _workload(args) -> list:
    from rollplex.engines.base import DecodeRequest
    from rollplex.pipeline.bench.bench import BenchConfig, hf_config, make_prompts

    cfg = BenchConfig(model=args.model, prompts=args.prompts, samples=args.samples, device="cpu")
    config, _ = hf_config(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    requests = []
    for p, prompt in enumerate(make_prompts(cfg, config, iteration=0)):
        ids = torch.randint(100, 100000, (args.prompt_len,), generator=gen).tolist()  # text only: no ViT here
        for g, cap in enumerate(prompt.meta["max_tokens"]):
            requests.append(DecodeRequest(f"p{p}-{g}", ids, None, None, max_tokens=cap, seed=100 * p + g))
    return requests


def _measure(engine, device, sizes: list[int], prompt_len: int, rollout: list, repeats: int) -> dict:
    """Step times per batch size, then the rollout's seconds (median of ``repeats``)."""
    from rollplex.engines.base import DecodeRequest

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    steps = {}
    ids = torch.randint(100, 100000, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    for n in sizes:
        engine.add_requests([DecodeRequest(f"s{n}-{i}", ids, None, None, max_tokens=200, seed=i) for i in range(n)])
        engine.step(4)  # prefill and capture
        sync()
        t = time.perf_counter()
        engine.step(64)
        sync()
        steps[n] = (time.perf_counter() - t) / 64
        while engine.has_unfinished():
            engine.step(200)
    seconds = []
    for _ in range(repeats + 1):  # the first captures the rollout's graph sizes: not counted
        sync()
        t = time.perf_counter()
        engine.add_requests(rollout)
        samples = {}
        while engine.has_unfinished():
            samples.update({f.request_id: list(f.token_ids) for f in engine.step(32)})
        sync()
        seconds.append(time.perf_counter() - t)
    return {"ms_per_step": {n: s * 1e3 for n, s in steps.items()}, "rollout_s": statistics.median(seconds[1:]),
            "rollout_runs_s": seconds[1:], "rollout_tokens": sum(map(len, samples.values())), "samples": samples}


def _engine(args, device, tp_group=None):
    from rollplex.engines.base import EngineContext
    from rollplex.engines.graph_decode import GraphDecodeEngine
    from rollplex.pipeline.bench.bench import BenchConfig, build_model

    # The same seed on every rank: the same weights.
    model, _ = build_model(BenchConfig(model=args.model, seed=args.seed, device=str(device), layers=args.layers))
    rows = max(args.prompts * args.samples, *args.sizes)
    return GraphDecodeEngine(EngineContext("", device, torch.bfloat16, args.seed, {
        "share_model": model, "max_num_seqs": rows, "max_model_len": args.prompt_len + 300,
        "compile": args.compile, "tp_group": tp_group}))


def _rank(rank: int, args, init: str, out: str) -> None:
    import faulthandler

    import torch.distributed as dist

    if args.stall_dump:  # where each rank is, if it is still running then
        faulthandler.dump_traceback_later(args.stall_dump, exit=True)
    if args.device == "cpu":  # a smoke run: gloo ranks
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=args.tp)
    else:
        device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=args.tp, device_id=device)
    engine = _engine(args, device, dist.group.WORLD)
    result = _measure(engine, device, args.sizes, args.prompt_len, _workload(args), args.repeats)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    # No destroy_process_group: on two H200s NCCL's teardown after graph-captured all-reduces hung
    # (faulthandler, 2026-11-30). The process exits; the driver frees the communicator.
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-vl-3b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=1090, help="as the bench's 1024 vision + 64 text + 2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="the decoder layer through torch.compile")
    ap.add_argument("--json", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run over gloo")
    ap.add_argument("--stall-dump", type=float, default=0, help="seconds after which each rank prints its stacks and exits")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's depth (smoke runs)")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp}: this machine has {torch.cuda.device_count()} CUDA devices")

    first = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    one = _measure(_engine(args, first), first, args.sizes, args.prompt_len, _workload(args), args.repeats)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args, f"file://{tmp}/rendezvous", f"{tmp}/rank0.pt"), nprocs=args.tp,
                           start_method="spawn")
        split = torch.load(f"{tmp}/rank0.pt")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.model}, prompt {args.prompt_len} tokens, {device_name}"
          f"{', compiled layer' if args.compile else ''}")
    print(f"{'':>22} {'TP=1':>9} {f'TP={args.tp}':>9} {'speed-up':>9}")
    for n in args.sizes:
        a, b = one["ms_per_step"][n], split["ms_per_step"][n]
        print(f"{f'step, batch {n} (ms)':>22} {a:9.2f} {b:9.2f} {a / b:8.2f}×")
    a, b = one["rollout_s"], split["rollout_s"]
    print(f"{f'rollout {args.prompts}×{args.samples} (s)':>22} {a:9.3f} {b:9.3f} {a / b:8.2f}×   "
          f"({one['rollout_tokens']} tokens; runs {one['rollout_runs_s']} / {split['rollout_runs_s']})")
    # The split step sums two partial products where one GPU sums one: a near-tie between two tokens
    # may flip, so sampled sequences are compared, not assumed equal.
    differ = [r for r, tokens in one["samples"].items() if split["samples"].get(r) != tokens]
    print(f"samples: {len(one['samples']) - len(differ)} of {len(one['samples'])} sequences the same under TP={args.tp}")
    if args.json:
        for result in (one, split):
            result["samples_differing"] = differ
            del result["samples"]
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device_name, "tp1": one,
                       f"tp{args.tp}": split}, f, indent=1)


if __name__ == "__main__":
    main()
