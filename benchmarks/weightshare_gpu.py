"""Weight sharing on one GPU: peak memory and weight-sync time, shared against copied.

A Qwen2.5-VL-architecture model with random weights (default the 3B preset: 3.75B parameters) is
the trainer (torch AdamW, bf16); the torch-graph decode engine either runs on a second copy, synced
by ``load_weights`` after every optimizer step (``copied``), or on the trainer's own parameters
(``shared``: the sync copies nothing). Each mode runs in its own process so peak memory is its own.
Per mode: a decode round, then ``--steps`` × (train step + weight sync); the sync is timed with the
device synchronised. Prints a table and writes JSON to ``--out``.

    python benchmarks/weightshare_gpu.py --out weightshare.json            # H200, ~2 min
    python benchmarks/weightshare_gpu.py --device cpu --layers 2 --model <tiny config.json> --out x.json  # dry run
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time


def run_mode(mode: str, args, queue) -> None:
    import torch

    from rollplex.engines.base import DecodeRequest, EngineContext, get_engine
    from rollplex.pipeline.bench.bench import BenchConfig, build_model

    import rollplex.engines  # noqa: F401

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    model, spec = build_model(BenchConfig(model=args.model, device=args.device, layers=args.layers,
                                          dtype=str(dtype).split(".")[1]))
    params = sum(p.numel() for p in model.parameters())
    train = get_engine("torch", "train").factory(EngineContext("", device, dtype, 0, {"module": model, "lr": 1e-5}))
    if mode == "copied":
        import copy

        rollout = copy.deepcopy(model).requires_grad_(False)
    else:
        rollout = train.module
    decode = get_engine("torch-graph", "decode").factory(EngineContext("", device, dtype, 0, {
        "share_model": rollout, "max_num_seqs": args.batch, "max_model_len": args.prompt_len + args.new_tokens + 8}))
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab - 100, (args.prompt_len,), generator=gen).tolist()
    ids = torch.tensor([prompt[:args.train_len]], device=device)
    sync_s, tokens = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        decode.add_requests([DecodeRequest(f"s{step}r{i}", prompt, None, None, args.new_tokens, seed=i,
                                           temperature=0.0) for i in range(args.batch)])
        out = []
        while decode.has_unfinished():
            out += decode.step(16)
        tokens.append([f.token_ids for f in sorted(out, key=lambda f: f.request_id)])
        logits = train.module(ids).logits
        loss = -logits[0, :-1].float().log_softmax(-1).gather(1, ids[0, 1:, None]).mean()
        train.backward(loss)
        train.step()
        del logits, loss
        sync()
        t = time.perf_counter()
        decode.load_weights(train.state_dict_for_sync(trainable_only=True))
        sync()
        sync_s.append(time.perf_counter() - t)
    lm = [p for n, p in train.module.named_parameters() if "visual" not in n]
    shared = sum(1 for n, p in rollout.named_parameters() if any(p.data_ptr() == q.data_ptr() for q in lm))
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:  # this process's peak resident memory (each mode runs in its own process)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put({"mode": mode, "model": spec.name, "params": params,
               "layers": model.config.get_text_config().num_hidden_layers, "peak_bytes": int(peak),
               "sync_seconds": sync_s, "sync_median_s": statistics.median(sync_s[1:] or sync_s),
               "rollout_params_on_trainer_storage": shared, "greedy_tokens_first": tokens[0][0][:8]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-3b", help="preset or config.json (≥1B parameters on the GPU)")
    ap.add_argument("--layers", type=int, default=None, help="override the depth (CPU dry runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--train-len", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for mode in ("copied", "shared"):
        queue = ctx.Queue()
        proc = ctx.Process(target=run_mode, args=(mode, args, queue))
        proc.start()
        rows.append(queue.get())
        proc.join()
    print(f"{rows[0]['model']} ({rows[0]['params'] / 1e9:.2f}B parameters, {rows[0]['layers']} layers), "
          f"torch AdamW trainer + torch-graph decode, {args.device}")
    peak = "peak GiB" if args.device == "cuda" else "peak RSS"
    print(f"{'mode':8s} {peak:>9s} {'sync ms (median)':>17s} {'rollout params on trainer storage':>34s}")
    for r in rows:
        print(f"{r['mode']:8s} {r['peak_bytes'] / 2**30:9.2f} {r['sync_median_s'] * 1e3:17.2f} "
              f"{r['rollout_params_on_trainer_storage']:34d}")
    if rows[0]["greedy_tokens_first"] != rows[1]["greedy_tokens_first"]:
        print("note: the first greedy tokens differ between modes (they decode the same weights)")
    from rollplex.fsio import atomic_write_text

    atomic_write_text(args.out, json.dumps({"rows": rows, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
