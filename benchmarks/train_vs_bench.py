"""`rollplex train` against `rollplex bench` at one shape, and how much of a train iteration falls
outside its nodes.

Both run the same work on one GPU: the 3B preset with random weights in bf16, P = 8 prompts (or
``--prompts``) of one 896×896 image (1,024 merged vision tokens) and about 64 text tokens, G = 8 samples of 256 tokens
each (random weights almost never stop early; the bench caps every sample at 256) or, with
``--mean-new-tokens``, of the bench's long-tailed lengths (train: ``rollout.length_caps``, each prompt's
caps drawn once; the bench is given the same caps through ``--lengths``), chunks of 32
tokens, the torch train engine, the compiled torch-graph decode engine, 8 prompts per vit/prefix/
suffix node and 2 per micro-batch. Train runs ``schedule: auto`` with train fusion asked for, so
serial, rollplex (train fusion) and rollplex-unfused (training after decode) take turns in one process
as the bench's policies do; its first iteration of each is dropped. Train's cross-iteration cache of
the reference's prefixes is off (``train.ref_cache_gib=0``): its prompts repeat every iteration, so
it would skip the reference's prefix forwards that the bench runs.

    python benchmarks/train_vs_bench.py --out $OUT/tvb            # on the GPU (scripts/on-device.sh --wheels)
    python benchmarks/train_vs_bench.py --bench-only --out $OUT/tvb   # a later call on the same machine:
        # the bench half against the train run the first call left in --work
    python benchmarks/train_vs_bench.py --device cpu --layers 1 --vision-layers 1 --side 112 --new-tokens 8 --chunk-tokens 4 \
        --trials 2 --bench-iterations 2 --out /tmp/tvb   # a smoke run of the script
        # (on a 2-core, 24 GB host the bench half, at the 3B preset's widths, was killed (SIGKILL) on
        # 2026-12-07; --bench-iterations 0 smokes the train half alone)

Prints, per policy: s/iteration (median of the timed iterations) in train and in the bench, their
ratio, and the share of each train iteration outside every node of its trace (the driver's view of
the iteration against the union of its nodes' intervals); then train's serial ÷ each rollplex
schedule over its sets of iterations (the same prompts and caps in each), and writes
``train_vs_bench.json`` and each schedule's last trace.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

TEXT = ("Describe the picture in detail: the objects, their colours, their positions, what each one is "
        "doing and how they relate to one another, and then answer the question about it in one word.")


def bench_twins() -> dict[str, str]:
    """The three schedules that ``schedule: auto`` with train fusion asked for times in turn
    (pipeline/plan/autoschedule.py), each with the bench's policy of the same work."""
    from rollplex.pipeline.plan.autoschedule import candidates, policy_of

    twins = {}
    for name in sorted(candidates(train_fusion=True), key=lambda name: name != "serial"):  # serial first
        policy, fusing, lookahead = policy_of(name)
        twins[name] = f"{policy}:ppn=8:mb=2" + (f":tf={int(fusing)}" if policy == "rollplex" else "") + (
            f":gl={lookahead}" if lookahead else "")
    return twins


SCHEDULES = bench_twins()


def prompt_text(model: Path, side: int, tokens: int) -> str:
    """Words of TEXT, as many as make the chat prompt of one ``side``-pixel image ``tokens`` long
    (or the nearest below): the bench's prompt is its vision tokens plus 66 ids."""
    from PIL import Image

    from rollplex.tasks.data import PromptBuilder
    from transformers import AutoProcessor

    builder = PromptBuilder(AutoProcessor.from_pretrained(model))
    image, words = Image.new("RGB", (side, side)), (TEXT + " ") * 8
    words = words.split()
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose prompt fits
        mid = (lo + hi + 1) // 2
        if builder.build("probe", image, " ".join(words[:mid])).num_tokens <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def write_dataset(out: Path, prompts: int, side: int, text: str) -> Path:
    """``prompts`` rows of one ``side``×``side`` random-noise image and the same question."""
    import numpy as np
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(prompts):
        name = f"img{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(out / name)
        rows.append(json.dumps({"prompt": f"<image>{text}", "images": [name], "answer": "red"}))
    path = out / "train.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def outside_share(trace: dict, seconds: float) -> float:
    """The share of an iteration's seconds that no node of its trace covers."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"] if e.get("ph") == "X")
    covered, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        covered += stop - max(start, end)
        end = stop
    return max(0.0, seconds - covered / 1e6) / seconds


def train(args, model: Path, data: Path, dtype: str, shape: list[str], train_dir: Path) -> None:
    """``rollplex train`` under ``schedule: auto`` at the shape, into a fresh ``train_dir``."""
    shutil.rmtree(train_dir, ignore_errors=True)
    run(["rollplex", "train", "--no-progress", "--schedule", "auto", "--out", str(train_dir),
         "--iterations", str(len(SCHEDULES) * args.trials),
         "--set", f"schedule_trials={args.trials}", "--set", f"model.path={model}", "--set", f"model.dtype={dtype}",
         "--set", f"model.device={args.device}", "--set", f"data.path={data}", "--set", "warmup.steps=0",
         "--set", "stop_at_reward=null", "--set", "engines.train=torch", "--set", "engines.decode=torch-graph",
         "--set", "engines.decode_options={compile: %s, attention: %s}" % (
             "true" if args.device == "cuda" else "false", args.decode_attention),
         "--set", "train.train_fusion=true", "--set", "checkpoint.every=0",
         # The same prompts every iteration would make the reference's prefixes cache hits from the
         # second on; the bench computes them each time, so train does too (same work, same bytes).
         "--set", "train.ref_cache_gib=0"]
        + (["--set", f"cluster.threads={args.threads}"] if args.threads else [])
        + (["--set", f"cluster.switch_interval_us={args.switch_interval_us}"] if args.switch_interval_us else [])
        + (["--set", f"train.fusion_batch_tokens={args.fusion_batch_tokens}"] if args.fusion_batch_tokens else [])
        + (["--set", f"train.micro_batch_tokens={args.micro_batch_tokens}"] if args.micro_batch_tokens else [])
        + (["--set", "train.gradient_checkpointing=true"] if args.gradient_checkpointing else [])
        + (["--set", "rollout.length_caps={mean: %d, sigma: 0.8}" % args.mean_new_tokens] if args.mean_new_tokens else [])
        + [x for s in shape for x in ("--set", s)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the result JSON and the runs' metrics go")
    ap.add_argument("--work", default="/tmp/rollplex-tvb", help="model, data and run directories")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="qwen2.5-vl-3b")
    ap.add_argument("--layers", type=int, default=None, help="fewer LM layers (smoke runs)")
    ap.add_argument("--vision-layers", type=int, default=None, help="fewer ViT blocks (smoke runs; train only)")
    ap.add_argument("--side", type=int, default=896, help="image side: (side/28)² merged vision tokens")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per iteration (P; G is 8)")
    ap.add_argument("--decode-attention", default="auto", help="the torch-graph engine's attention option")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mean-new-tokens", type=int, default=0,
                    help="responses of long-tailed lengths around this many tokens, capped at --new-tokens: train "
                         "draws each prompt's caps once (rollout.length_caps, sigma 0.8) and the bench runs the same "
                         "caps (--lengths); "
                         "0: every response at --new-tokens")
    ap.add_argument("--chunk-tokens", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5, help="train iterations per schedule (the first not timed)")
    ap.add_argument("--bench-iterations", type=int, default=6, help="0: train alone, no bench")
    ap.add_argument("--bench-only", action="store_true",
                    help="the bench alone, against the train run an earlier call left in --work (a call's time "
                         "limit may not hold both)")
    ap.add_argument("--bench-also", default="",
                    help="more bench policies beside the three schedules', e.g. plain:seq=4 (comma-separated)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="both runs recompute layer activations")
    ap.add_argument("--threads", type=int, default=0,
                    help="train's cluster.threads (0: its default; the bench's host uses 8)")
    ap.add_argument("--switch-interval-us", type=int, default=0,
                    help="Python's thread switch interval in µs for both runs (train: cluster.switch_interval_us, "
                         "the bench: each policy's gil=N); 0: Python's 5,000")
    ap.add_argument("--fusion-batch-tokens", type=int, default=0,
                    help="train fusion's backwards capped at this many tokens in both runs (train: "
                         "train.fusion_batch_tokens, the bench: ft=N on the fused policy); 0: no cap")
    ap.add_argument("--micro-batch-tokens", type=int, default=0,
                    help="every backward at most this many tokens in both runs (train: train.micro_batch_tokens, the "
                         "bench: mt=N, and ft=N on the fused policy unless --fusion-batch-tokens); 0: no cap")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    if args.bench_only and not (work / "train" / "metrics.jsonl").exists():
        sys.exit(f"--bench-only: {work / 'train'} holds no train run of an earlier call (same --work) to compare with")
    out.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        init = ["rollplex", "init-model", str(model), "--preset", args.preset,
                "--dtype", "bfloat16" if args.device == "cuda" else "float32", "--device", args.device]
        run(init + (["--layers", str(args.layers)] if args.layers else [])
            + (["--vision-layers", str(args.vision_layers)] if args.vision_layers else []))
    vision = (args.side // 28) ** 2
    data = write_dataset(work / "data", args.prompts, args.side, prompt_text(model, args.side, vision + 66))
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    shape = [f"rollout.prompts_per_iteration={args.prompts}", "rollout.samples_per_prompt=8",
             f"rollout.max_new_tokens={args.new_tokens}", f"rollout.chunk_tokens={args.chunk_tokens}", "train.prompts_per_node=8",
             "train.micro_batch_groups=2"]
    train_dir = work / "train"
    if not args.bench_only:
        train(args, model, data, dtype, shape, train_dir)
    shutil.copy(train_dir / "metrics.jsonl", out / "train_metrics.jsonl")  # kept should the bench not finish
    bench_dir = work / "bench"
    gil = f":gil={args.switch_interval_us}" if args.switch_interval_us else ""
    fused_cap = args.fusion_batch_tokens or args.micro_batch_tokens  # train's fallback (session.py)
    ft = f":ft={fused_cap}" if fused_cap else ""
    mt = f":mt={args.micro_batch_tokens}" if args.micro_batch_tokens else ""

    def bench_policy(schedule: str) -> str:
        """The bench's policy for one of train's schedules, with this run's options."""
        return SCHEDULES[schedule] + (ft if schedule == "rollplex" else mt) + gil

    policies = ",".join([bench_policy(s) for s in SCHEDULES] + [p for p in args.bench_also.split(",") if p])
    lengths = []
    if args.mean_new_tokens:  # the bench meets train's caps: those rollout.length_caps draws for its prompts
        from types import SimpleNamespace

        from rollplex.tasks.nodes import length_caps

        settings = SimpleNamespace(seed=0, samples=8, max_new_tokens=args.new_tokens,
                                   length_caps={"mean": args.mean_new_tokens, "sigma": 0.8})
        caps = [length_caps(settings, f"{data.stem}-{i:06d}") for i in range(args.prompts)]  # tasks/dataset.py's ids
        (out / "lengths.json").write_text(json.dumps(caps))
        lengths = ["--lengths", str(out / "lengths.json")]
    if args.bench_iterations:
        run(["rollplex", "bench", "--model", args.preset, "--device", args.device, "--dtype", dtype,
             "--prompts", str(args.prompts), "--decode-attention", args.decode_attention,
             "--policies", policies, "--iterations", str(args.bench_iterations), "--max-new-tokens", str(args.new_tokens),
             "--mean-new-tokens", str(args.mean_new_tokens or 1000000), "--chunk-tokens", str(args.chunk_tokens),
             "--vision-tokens", str(vision), "--train-engine", "torch", "--out", str(bench_dir)] + lengths
            + (["--layers", str(args.layers)] if args.layers else [])
            + (["--gradient-checkpointing"] if args.gradient_checkpointing else []))

    rows = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    bench = json.loads((bench_dir / "bench.json").read_text()) if args.bench_iterations else {"results": []}
    result = {}
    ran = [name for name in SCHEDULES if len([r for r in rows if r.get("schedule") == name]) > 1]
    from rollplex.pipeline.plan.autoschedule import DROPPED_FILE

    dropped = train_dir / DROPPED_FILE  # candidates that ran out of memory in train (pipeline/run/runner.py)
    if dropped.exists():
        print(f"train dropped: {dropped.read_text().strip()}")
    for schedule in ran:
        mine = [r for r in rows if r.get("schedule") == schedule][1:]  # its first iteration: compile, capture
        seconds = [r["iter_seconds"] for r in mine]
        outside = [outside_share(json.loads((train_dir / "traces" / f"iter_{r['iteration']:06d}.json").read_text()),
                                 r["iter_seconds"]) for r in mine]
        # A policy the bench could not run (out of memory) has no median: train's numbers still count.
        bench_s = next((r.get("median_s") for r in bench["results"] if r["policy"] == bench_policy(schedule)), None)
        result[schedule] = {"train_seconds": seconds, "train_median": statistics.median(seconds),
                            "bench_median": bench_s,
                            "train_over_bench": statistics.median(seconds) / bench_s if bench_s else None,
                            "outside_share": outside, "outside_median": statistics.median(outside),
                            "response_len_mean": statistics.mean(r["response_len_mean"] for r in mine)}
    # schedule: auto runs its schedules in turns on the same prompts: iteration i of each is one set.
    from rollplex.pipeline.bench.results import median_interval

    print(f"{'policy':16s} {'train s/it':>10s} {'bench s/it':>10s} {'train÷bench':>11s} {'outside nodes':>13s}")
    for schedule in ran:
        r = result[schedule]
        bench_s, ratio = ((f"{r['bench_median']:10.3f}", f"{r['train_over_bench']:11.3f}") if r["bench_median"]
                          else (f"{'-':>10s}", f"{'-':>11s}"))
        print(f"{schedule:16s} {r['train_median']:10.3f} {bench_s} {ratio} "
              f"{r['outside_median']:12.1%}   (train iterations: {', '.join(f'{s:.2f}' for s in r['train_seconds'])};"
              f" mean response {r['response_len_mean']:.0f} tokens)")
    for schedule in (name for name in ran if name != "serial" and "serial" in ran):
        pairs = [s / r for s, r in zip(result["serial"]["train_seconds"], result[schedule]["train_seconds"])]
        interval = median_interval(pairs)
        result[f"{schedule}_over_serial_paired"] = {"ratios": pairs, "median_low_high": interval}
        spread = (f"95% interval {interval[1]:.2f}–{interval[2]:.2f}" if interval
                  else f"range {min(pairs):.2f}–{max(pairs):.2f}" if pairs else "no pairs")
        print(f"train, serial ÷ {schedule} per set of iterations: "
              f"{statistics.median(pairs) if pairs else float('nan'):.3f}× ({spread}, n = {len(pairs)})")
    (out / "train_vs_bench.json").write_text(json.dumps(result, indent=1))
    if args.bench_iterations:
        shutil.copy(bench_dir / "bench.json", out / "bench.json")
        shutil.copy(bench_dir / "iterations.jsonl", out / "bench_iterations.jsonl")
    for schedule in ran:  # each schedule's last iteration, for trace_nodes.py
        last = max(r["iteration"] for r in rows if r.get("schedule") == schedule)
        shutil.copy(train_dir / "traces" / f"iter_{last:06d}.json", out / f"train_trace_{schedule}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
