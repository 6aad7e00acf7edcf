"""Runtime overhead: Rollplex (Dask + vLLM + DeepSpeed) against a plain single-process GRPO trainer.

Both sides run the embedded default: the tiny Qwen2.5-VL, the synthetic colour task, 8 prompts x 8
samples, max_new_tokens 8, fp32 on CPU, 2 format warm-up steps (so both sample responses of the same
length), then GRPO. The plain trainer is what a TRL user would write by hand: ``model.generate`` on the
processor's batch, one padded forward for the reference and one for the policy, torch AdamW. The first
``--skip`` RL iterations (warm-up, compile) are dropped from both sides.

    python benchmarks/overhead.py --iterations 15 --threads 2,1 --json /tmp/overhead.json

Dask's own time per node (every Rollplex variant): from each RL iteration's trace, the time from the
moment a node could start (its last predecessor done and its stream free) to its start, against the
node's compute time (``pipeline/plan/trace.dispatch_gaps``). At the H200 scale (a 3B-wide model, bf16):

    python benchmarks/overhead.py --device cuda --scale h200 --variants rollplex-hf-deepspeed --iterations 8
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROLLPLEX_VARIANTS = {  # name -> config overrides on top of the embedded default
    "rollplex": ["engines.decode=vllm", "engines.train=deepspeed"],
    "rollplex-hf-torch": ["engines.decode=hf", "engines.train=torch"],
    "rollplex-worker-process": ["engines.decode=vllm", "engines.train=deepspeed", "cluster.processes=true"],
    "rollplex-vllm-torch": ["engines.decode=vllm", "engines.train=torch"],
    "rollplex-hf-deepspeed": ["engines.decode=hf", "engines.train=deepspeed"],
    # Dask's scheduler between every two nodes (the lowering of data-parallel runs), not per iteration
    "rollplex-nodes": ["engines.decode=vllm", "engines.train=deepspeed", "cluster.lowering=nodes"],
    "rollplex-hf-deepspeed-nodes": ["engines.decode=hf", "engines.train=deepspeed", "cluster.lowering=nodes"],
    "rollplex-graph-deepspeed": ["engines.decode=torch-graph", "engines.train=deepspeed"],  # the CUDA default
    "rollplex-graph-deepspeed-nodes": ["engines.decode=torch-graph", "engines.train=deepspeed",
                                       "cluster.lowering=nodes"],
}
P, G, MAX_NEW, WARMUP_STEPS = 8, 8, 8, 2


def summarize(seconds: list[float], skip: int) -> dict:
    steady = seconds[skip:] or seconds
    q = statistics.quantiles(steady, n=10, method="inclusive") if len(steady) > 1 else steady * 9
    return {"median": statistics.median(steady), "p90": q[8], "n": len(steady), "all": seconds}


# ------------------------------------------------------------------------------------------------
def plain_grpo(iterations: int, threads: int, seed: int = 0) -> dict:
    """Single-process GRPO, no Rollplex runtime; returns per-iteration seconds and stats."""
    import numpy as np
    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.models import ensure_tiny_vlm
    from rollplex.tasks.data import (PromptBuilder, PromptLoader, SyntheticVisualTask, default_model_spec,
                                     format_warmup_batch, warmup_target_ids)
    from rollplex.tasks.rewards import exact_match

    torch.set_num_threads(threads)
    if torch.get_num_threads() != threads:  # vLLM, once imported, turns set_num_threads into a no-op
        raise RuntimeError(f"torch runs {torch.get_num_threads()} threads, asked for {threads}")
    torch.manual_seed(seed)
    path = ensure_tiny_vlm(default_model_spec())
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"  # generate appends on the right
    tok = processor.tokenizer
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), pad]  # Rollplex's decode stops on both
    # HF's full-sequence forward takes every <|image_pad|>/<|video_pad|> id as a vision slot, so a
    # sampled one would fail the feature count check: keep them out of the responses.
    no_vision_ids = [tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")]
    policy = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()  # dropout is 0
    policy.model.visual.requires_grad_(False)
    task = SyntheticVisualTask(image_size=112, seed=seed)
    loader = PromptLoader(task, PromptBuilder(processor), P, seed)

    def encode(items):
        texts = [processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": it.question}]}],
            add_generation_prompt=True) for it in items]
        return processor(text=texts, images=[it.image for it in items], return_tensors="pt", padding=True)

    def repeat_images(enc, n: int) -> dict:
        """Vision inputs for n copies of each prompt (pixel_values are rows of patches, per image)."""
        sizes = enc["image_grid_thw"].prod(-1).tolist()
        chunks = enc["pixel_values"].split(sizes)
        return {"pixel_values": torch.cat([c for c in chunks for _ in range(n)]),
                "image_grid_thw": enc["image_grid_thw"].repeat_interleave(n, 0)}

    def token_logprobs(model, ids, mask, mm_types, vision, n_resp: int):
        """log p of the last n_resp tokens of each row; logits only where needed (as TRL does)."""
        out = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=mm_types, use_cache=False,
                    logits_to_keep=n_resp + 1, **vision)
        logits = out.logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, -n_resp:, None]).squeeze(-1)

    # Format warm-up as Rollplex does it (2 supervised steps, batch 32, lr 2e-3), batched here.
    rng = np.random.default_rng([seed, 7919])
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for _ in range(WARMUP_STEPS):
        pairs = format_warmup_batch(task, loader.builder, rng, 32)
        items = [task.item(p.meta["index"]) for p, _ in pairs]
        enc = encode(items)
        targets = [warmup_target_ids(tok, t) for _, t in pairs]
        T = max(map(len, targets))
        tgt = torch.tensor([t + [pad] * (T - len(t)) for t in targets])
        tmask = torch.tensor([[1] * len(t) + [0] * (T - len(t)) for t in targets])
        ids = torch.cat([enc["input_ids"], tgt], 1)
        logp = token_logprobs(policy, ids, torch.cat([enc["attention_mask"], tmask], 1),
                              torch.cat([enc["mm_token_type_ids"], torch.zeros_like(tgt)], 1),
                              repeat_images(enc, 1), T)
        loss = -(logp * tmask).sum() / tmask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    # Then, as in Rollplex: fresh optimizer state, and the reference is the warmed-up policy.
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref = copy.deepcopy(policy).requires_grad_(False)

    seconds, rewards_mean, lengths = [], [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        items = [task.item(i) for i in loader.next_indices()]
        enc = encode(items)
        L = enc["input_ids"].shape[1]
        with torch.no_grad():
            seqs = policy.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                   max_new_tokens=MAX_NEW, num_return_sequences=G,
                                   eos_token_id=stops, pad_token_id=pad, suppress_tokens=no_vision_ids)
        resp = seqs[:, L:]
        T = resp.shape[1]
        # Response mask: every token up to and including the first stop token.
        is_stop = torch.isin(resp, torch.tensor(stops))
        first = torch.where(is_stop.any(1), is_stop.int().argmax(1), torch.full((resp.shape[0],), T))
        rmask = (torch.arange(T)[None] <= first[:, None]).to(enc["attention_mask"].dtype)
        texts = tok.batch_decode([r[:n] for r, n in zip(resp, rmask.sum(1).tolist())], skip_special_tokens=True)
        answers = [it.answer for it in items for _ in range(G)]
        rewards = torch.tensor([exact_match(t, a) for t, a in zip(texts, answers)]).view(P, G)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        mask = torch.cat([enc["attention_mask"].repeat_interleave(G, 0), rmask], 1)
        mm = torch.cat([enc["mm_token_type_ids"].repeat_interleave(G, 0), torch.zeros_like(resp)], 1)
        vision = repeat_images(enc, G)
        with torch.no_grad():
            ref_logp = token_logprobs(ref, seqs, mask, mm, vision, T)
        logp = token_logprobs(policy, seqs, mask, mm, vision, T)
        ratio = torch.exp(logp - logp.detach())  # one optimizer step per batch: old = current
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1
        m = rmask.float()
        loss = (-(surrogate - 0.04 * kl) * m).sum() / m.sum()  # token-mean over the batch
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        rewards_mean.append(float(rewards.mean()))
        lengths.append(float(m.sum(1).mean()))
    return {"seconds": seconds, "reward_mean": statistics.mean(rewards_mean),
            "response_len_mean": statistics.mean(lengths), "threads": threads}


# ------------------------------------------------------------------------------------------------
def dask_time_per_node(cfg, run_dir: Path, skip: int) -> dict:
    """Per node of the RL iterations after ``skip``: Dask's dispatch time (median, mean, p90) against
    the node's compute time, and their per-iteration sums."""
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.plan.trace import dispatch_gaps

    graph = Session(cfg, run_dir).graph
    preds = {n: list(graph.g.predecessors(n)) for n in graph.nodes}
    gaps, compute, gap_sums, compute_sums = [], [], [], []
    traces = sorted((run_dir / "traces").glob("iter_*.json"))
    for path in traces[skip:] or traces:
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        g = dispatch_gaps(events, preds)
        gaps += g.values()
        compute += [e["dur"] / 1e6 for e in events]
        gap_sums.append(sum(g.values()))
        compute_sums.append(sum(e["dur"] for e in events) / 1e6)
    q = statistics.quantiles(gaps, n=10, method="inclusive") if len(gaps) > 1 else gaps * 9
    return {"nodes_per_iteration": len(graph), "dask_ms_median": 1e3 * statistics.median(gaps),
            "dask_ms_mean": 1e3 * statistics.mean(gaps), "dask_ms_p90": 1e3 * q[8],
            "node_ms_median": 1e3 * statistics.median(compute), "node_ms_mean": 1e3 * statistics.mean(compute),
            "dask_s_per_iteration": statistics.median(gap_sums),
            "compute_s_per_iteration": statistics.median(compute_sums)}


def rollplex_run(overrides: list[str], iterations: int, skip: int, run_dir: Path, echo) -> dict:
    """One `rollplex train` in this process; executor seconds from metrics.jsonl, wall from the log."""
    from rollplex.config import load_config
    from rollplex.pipeline.run.runner import train

    cfg = load_config(None, [f"iterations={iterations}", f"warmup.steps={WARMUP_STEPS}", "stop_at_reward=null",
                             "checkpoint.every=0", *overrides])  # no mid-run checkpoints: plain has none
    stamps: list[float] = []

    def log(line: str) -> None:
        # Timestamps of the per-iteration lines give driver wall time: loader, graph run, trace and
        # rollout files. iter_seconds covers only the executor's run of the graph.
        stamps.append(time.perf_counter())
        if not line.startswith("it "):
            echo(line)

    train(cfg, run_dir, progress=False, log=log)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rl = [r for r in rows if r.get("phase") == "rl"]
    wall = [b - a for a, b in zip(stamps[-len(rl) - 1:], stamps[-len(rl):])]
    kinds = sorted({k for r in rl for k in r["seconds_by_kind"]})
    by_kind = {k: statistics.median(r["seconds_by_kind"].get(k, 0.0) for r in rl[skip:] or rl) for k in kinds}
    return {"seconds": [r["iter_seconds"] for r in rl], "wall_seconds": wall,
            "reward_mean": statistics.mean(r["reward_mean"] for r in rl),
            "response_len_mean": statistics.mean(r["response_len_mean"] for r in rl),
            "seconds_by_kind_median": by_kind, "overrides": overrides,
            "dask": dask_time_per_node(cfg, run_dir, skip)}



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=20, help="RL iterations per variant")
    ap.add_argument("--skip", type=int, default=3, help="first iterations left out of the statistics")
    ap.add_argument("--threads", default="2,1",
                    help="torch threads for the plain trainer, comma-separated; the first is the baseline")
    ap.add_argument("--variants", default="plain,rollplex,rollplex-hf-torch",
                    help=f"comma-separated: plain, {', '.join(ROLLPLEX_VARIANTS)}")
    ap.add_argument("--json", type=Path, help="write the results here (atomically)")
    ap.add_argument("--runs-dir", type=Path, help="keep the Rollplex run directories here (default: temp, removed)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: Rollplex variants only (bf16), for Dask time per node at GPU scale")
    ap.add_argument("--scale", default="tiny", help="model shape: tiny (embedded) or h200 (benchmarks/scales.py)")
    ap.add_argument("--layers", type=int, help="override the scale's depth")
    args = ap.parse_args()
    if args.iterations <= args.skip:
        ap.error(f"--iterations must exceed --skip ({args.skip})")
    threads = [int(t) for t in args.threads.split(",") if t]
    variants = [v for v in args.variants.split(",") if v]
    extra: list[str] = []
    if args.device == "cuda":
        if "plain" in variants:
            ap.error("--device cuda: the plain trainer is the CPU baseline; pass --variants without plain")
        extra += ["model.device=cuda", "model.dtype=bfloat16"]
    if args.scale != "tiny" or args.layers:
        from scales import model_path

        extra.append(f"model.path={model_path(args.scale, args.layers)}")
    unknown = [v for v in variants if v != "plain" and v not in ROLLPLEX_VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: plain, {', '.join(ROLLPLEX_VARIANTS)}")

    results: dict[str, dict] = {}
    load_before = os.getloadavg()[0]  # other work on these cores skews every number below
    # Plain first: once vLLM is imported in this process, torch.set_num_threads stops working.
    if "plain" in variants:
        for n in threads:
            name = f"plain-t{n}"
            print(f"[{name}] running", flush=True)
            results[name] = plain_grpo(args.iterations, n)
    runs_root = args.runs_dir or Path(tempfile.mkdtemp(prefix="rollplex-overhead-"))
    try:
        for v in variants:
            if v == "plain":
                continue
            run_dir = runs_root / v
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"[{v}] running ({' '.join(ROLLPLEX_VARIANTS[v])})", flush=True)
            results[v] = rollplex_run(ROLLPLEX_VARIANTS[v] + extra, args.iterations, args.skip, run_dir,
                                      lambda line, v=v: print(f"[{v}] {line}", flush=True))
            # The run's last checkpoint is not read here; at the H200 scale one DeepSpeed checkpoint
            # of a 3B model is tens of GB, and the next variant's would not fit beside it.
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    finally:
        if args.runs_dir is None:
            shutil.rmtree(runs_root, ignore_errors=True)

    for r in results.values():
        r.update({k: v for k, v in summarize(r["seconds"], args.skip).items() if k != "all"})
        if "wall_seconds" in r:
            r["wall_median"] = summarize(r["wall_seconds"], args.skip)["median"]
    base_name = f"plain-t{threads[0]}" if "plain" in variants else None
    base = results[base_name]["median"] if base_name else None
    print(f"\n{args.iterations} iterations, first {args.skip} excluded; ratio = median / "
          f"{base_name or 'n/a'} median; wall = driver wall time per iteration (Rollplex); "
          f"load avg {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"{'variant':<24}{'median s/it':>12}{'p90':>8}{'ratio':>8}{'wall':>8}{'resp len':>10}{'reward':>8}")
    for name, r in results.items():
        r["ratio"] = r["median"] / base if base else None
        wall = f"{r['wall_median']:.3f}" if "wall_median" in r else "-"
        ratio = f"{r['ratio']:.2f}" if base else "-"
        print(f"{name:<24}{r['median']:>12.3f}{r['p90']:>8.3f}{ratio:>8}{wall:>8}"
              f"{r['response_len_mean']:>10.2f}{r['reward_mean']:>8.3f}")
    for name, r in results.items():
        if "seconds_by_kind_median" in r:  # summed over both stream threads, so can exceed s/it
            parts = ", ".join(f"{k} {s:.3f}" for k, s in sorted(r["seconds_by_kind_median"].items(),
                                                                  key=lambda kv: -kv[1]))
            print(f"{name} busy s/it by node kind (median): {parts}")
    for name, r in results.items():
        if "dask" in r:
            d = r["dask"]
            print(f"{name} Dask time per node: median {d['dask_ms_median']:.2f} ms, mean {d['dask_ms_mean']:.2f}, "
                  f"p90 {d['dask_ms_p90']:.2f}; node compute median {d['node_ms_median']:.2f} ms, mean "
                  f"{d['node_ms_mean']:.2f}; per iteration {d['dask_s_per_iteration']:.3f} s Dask against "
                  f"{d['compute_s_per_iteration']:.3f} s compute ({d['nodes_per_iteration']} nodes)")

    if args.json:
        out = {"iterations": args.iterations, "skip": args.skip, "baseline": base_name, "cpus": os.cpu_count(),
               "device": args.device, "scale": args.scale,
               "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
               "python": sys.version.split()[0], "variants": results}
        from rollplex.fsio import atomic_write_text

        atomic_write_text(args.json, json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":  # Dask's LocalCluster spawns worker processes that re-import this file
    sys.exit(main())
