"""``rollplex simulate``: predict an iteration per schedule policy from a model, a cluster and a workload.

Prints a table (makespan, where the time goes, speedups, peak HBM per GPU naive vs planned), the
naive-colocation memory terms, and every assumption; writes ``--json``, a ``--png`` Gantt + memory
plot and ``--trace`` Chrome traces in the format real runs write.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from rollplex.errors import ConfigError

GiB = 1024**3
PAPER = dict(model="qwen2.5-vl-32b", hardware="h800", gpus=32, prompts=256, samples=8, vision_tokens=1024,
             text_tokens=64, frames=0, max_new_tokens=1024, response_len="lognormal:256:0.6", tp_rollout=4,
             tp_train=8, zero=1)
PAPER_NAIVE_GIB = 165
PAPER_CLAIMS = "paper: 1.23–1.30× over serial colocation, 1.57–2.24× over disaggregation (32 H800, same budget)"


def add_parser(sub) -> None:
    s = sub.add_parser("simulate", help="predict an iteration's time and memory per schedule policy",
                       description=__doc__.splitlines()[0])
    s.add_argument("--preset", choices=("paper",), help="paper: Qwen2.5-VL-32B on 32 H800s (flags still override)")
    s.add_argument("--model", help="qwen2.5-vl-3b | qwen2.5-vl-7b | qwen2.5-vl-32b | path/to/config.json")
    s.add_argument("--gpus", type=int)
    s.add_argument("--hardware", choices=("h800", "h200"))
    s.add_argument("--schedule", default="serial,serial+prefix,disaggregated,disaggregated+prefix,rollplex",
                   help="comma-separated variants: serial, serial+prefix, disaggregated, disaggregated+prefix, "
                        "rollplex")
    w = s.add_argument_group("workload")
    w.add_argument("--prompts", type=int, help="P, prompts per iteration")
    w.add_argument("-G", "--samples", type=int, help="responses per prompt")
    w.add_argument("--vision-tokens", type=int, help="LM tokens per image (or per 2 video frames)")
    w.add_argument("--frames", type=int, help="video frames per prompt (0: one image)")
    w.add_argument("--text-tokens", type=int, help="text tokens per prompt")
    w.add_argument("--max-new-tokens", type=int)
    w.add_argument("--response-len", help="fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA")
    w.add_argument("--chunk-tokens", type=int, help="decode tokens per decode_chunk node")
    w.add_argument("--tp-rollout", type=int)
    w.add_argument("--tp-train", type=int)
    w.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage over data-parallel ranks")
    w.add_argument("--micro-batch-groups", type=int, help="prompts per loss node (0: one per DP rank)")
    w.add_argument("--prompts-per-node", type=int)
    w.add_argument("--no-checkpointing", action="store_true", help="keep all activations for the backward")
    w.add_argument("--actor-forward", choices=("recompute", "keep"))
    w.add_argument("--kv-pool-fraction", type=float, help="rollout engine HBM share (vLLM gpu_memory_utilization)")
    w.add_argument("--ref-cache-hit", type=float, help="share of reference prefixes served from the host cache")
    w.add_argument("--seed", type=int)
    x = s.add_argument_group("cluster and planning")
    x.add_argument("--rollout-gpus", type=int, help="disaggregated split (default: the best valid split)")
    x.add_argument("--budget-gib", type=float, help="HBM budget per GPU (default: HBM minus 3 GiB)")
    x.add_argument("--no-memory-plan", action="store_true", help="only measure memory, plan no offloads")
    x.add_argument("--sm-partitions", action="store_true",
                   help="decode and window work on SM partitions (cluster.sm_partitions: true); default: plain "
                        "streams, as a run's default")
    x.add_argument("--no-partition", action="store_true", help=argparse.SUPPRESS)  # the default since 2026-12-07
    x.add_argument("--train-fusion", action="store_true",
                   help="rollplex also trains on each chunk's finished groups in the decode window")
    x.add_argument("--window-chunks", type=int, default=0, metavar="N",
                   help="rollplex scores the samples of decode chunks N and later in one node after decode")
    x.add_argument("--grad-prefix-lookahead", type=int, default=0, metavar="N",
                   help="the policy's prefix of micro-batch m waits for the loss of m - N (0: no bound)")
    x.add_argument("--calibrate", metavar="TRACE", help="a run's traces/iter_N.json: per-kind factors")
    o = s.add_argument_group("output")
    o.add_argument("--json", metavar="PATH")
    o.add_argument("--png", metavar="PATH")
    o.add_argument("--trace", metavar="DIR", help="write <variant>.json Chrome traces here")
    s.set_defaults(fn=cmd_simulate)


def _workload_and_setup(args):
    from rollplex.pipeline.plan.costs import Workload

    base = dict(PAPER) if args.preset == "paper" else dict(model="qwen2.5-vl-7b", hardware="h200", gpus=8)

    def pick(name: str):
        value = getattr(args, name)
        return value if value is not None else base.get(name)

    fields = dict(prompts="prompts", samples="samples", vision_tokens="vision_tokens", frames="frames",
                  text_tokens="text_tokens", max_new_tokens="max_new_tokens", response="response_len",
                  chunk_tokens="chunk_tokens", tp_rollout="tp_rollout", tp_train="tp_train", zero="zero",
                  micro_batch_groups="micro_batch_groups", prompts_per_node="prompts_per_node",
                  actor_forward="actor_forward", kv_pool_fraction="kv_pool_fraction", ref_cache_hit="ref_cache_hit",
                  seed="seed")
    kw = {f: pick(a) for f, a in fields.items() if pick(a) is not None}
    if args.no_checkpointing:
        kw["checkpointing"] = False
    return Workload(**kw), pick("model"), pick("hardware"), pick("gpus")


def cmd_simulate(args) -> int:
    from rollplex.pipeline.plan import simulator as S
    from rollplex.pipeline.plan.costs import Calibration, measured_efficiency
    from rollplex.pipeline.plan.hardware import hardware
    from rollplex.engines.modelspec import load_model

    workload, model_name, hw, gpus = _workload_and_setup(args)
    names = [n.strip() for n in args.schedule.split(",") if n.strip()]
    unknown = [n for n in names if n not in S.VARIANTS]
    if unknown or not names:
        raise ConfigError(f"--schedule {args.schedule!r}: unknown {unknown}; choose from {', '.join(S.VARIANTS)}")
    model = load_model(model_name)
    cluster = hardware(hw, gpus, partitioned=args.sm_partitions)
    from rollplex.dags.grpo import grpo

    scn = S.Scenario(model, cluster, workload, grpo, rollout_gpus=args.rollout_gpus, memory=not args.no_memory_plan,
                     budget=args.budget_gib * GiB if args.budget_gib else None, train_fusion=args.train_fusion,
                     window_chunks=args.window_chunks, grad_prefix_lookahead=args.grad_prefix_lookahead)
    if args.calibrate:
        scn = replace(scn, calibration=_calibration(scn, names, Path(args.calibrate), Calibration))
    results = S.run(scn, names)
    print(_header(scn, measured_efficiency()))
    print(_table(results))
    print(_speedups(results))
    print(_memory_terms(results, scn, paper=args.preset == "paper"))
    print(_assumptions(scn, results))
    if args.json:
        data = {"scenario": {"model": model.name, "hardware": cluster.name, "gpus": cluster.gpus,
                             "workload": workload.__dict__, "calibration": scn.calibration.__dict__
                             if scn.calibration else None},
                "results": S.summary(results)}
        Path(args.json).write_text(json.dumps(data, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        S.write_png(results, args.png)
        print(f"wrote {args.png}")
    if args.trace:
        out = Path(args.trace)
        out.mkdir(parents=True, exist_ok=True)
        for name, r in results.items():
            (out / f"{name}.json").write_text(json.dumps(S.chrome_trace_of(r.plan, r.memory)) + "\n")
        print(f"wrote {len(results)} Chrome trace(s) to {out}/")
    return 0


def _calibration(scn, names, path: Path, Calibration):
    from rollplex.pipeline.plan import simulator as S

    try:
        trace = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--calibrate {path}: cannot read the trace: {exc}") from None
    r = S.run_variant(replace(scn, memory=False), names[-1])
    predicted = {n: r.costs(r.plan.graph.nodes[n], len(s.gpus)).seconds for n, s in r.plan.slots.items()}
    return Calibration.from_trace(trace, predicted, source=str(path))


def _header(scn, eff) -> str:
    w, c = scn.workload, scn.cluster
    resp = f"responses {w.response} (max {w.max_new_tokens})"
    vision = f"{w.vision_tokens} vision tokens" + (f" × {w.image_groups} frame pairs" if w.frames else "")
    return "\n".join([
        f"model     {scn.model.describe()}",
        f"cluster   {c.gpus} × {c.name.upper()} ({c.nodes} node(s)), budget {c.hbm_budget / GiB:.0f} GiB/GPU",
        f"workload  P={w.prompts} prompts × G={w.samples}, prefix {w.prefix_tokens} tokens ({vision} + {w.text_tokens} "
        f"text), {resp}; rollout TP {w.tp_rollout}, train TP {w.tp_train}, ZeRO-{w.zero}, "
        f"checkpointing {'on' if w.checkpointing else 'off'}",
        ""])


def _table(results) -> str:
    phases = ("rollout", "prefix", "scoring", "training", "sync", "memory", "host/idle")
    width = max([15, *(len(n) for n in results)])
    head = f"{'variant':<{width}} {'makespan':>9} " + " ".join(f"{p:>9}" for p in phases) + \
        f" {'HBM naive→planned GiB':>22}  fits"
    lines = ["time per iteration (s); each phase column is the time it alone kept GPUs busy (hidden work counts 0)",
             head, "-" * len(head)]
    for name, r in results.items():
        ph = r.phases()
        planned = f"{max(r.memory.peak.values()) / GiB:.1f}" if r.memory else "-"
        lines.append(f"{name:<{width}} {r.makespan:>9.2f} " + " ".join(f"{ph.get(p, 0.0):>9.2f}" for p in phases)
                     + f" {r.naive_peak / GiB:>12.1f} → {planned:>6}  {'yes' if r.fits else 'NO'}")
        if r.error:
            lines.append(f"    {r.error}")
        if r.policy == "disaggregated":
            lines.append(f"    split: {len(r.layout.rollout)} rollout GPUs + {len(r.layout.train)} training GPUs")
    return "\n".join(lines) + "\n"


def _speedups(results) -> str:
    r = results.get("rollplex")
    if r is None:
        return ""
    parts = [f"rollplex vs {n}: {o.makespan / r.makespan:.2f}×" for n, o in results.items() if n != "rollplex"]
    return "speedups  " + ", ".join(parts) + f"\n          ({PAPER_CLAIMS}; not used to set any constant)\n"


def _memory_terms(results, scn, paper: bool) -> str:
    from rollplex.pipeline.plan import simulator as S

    name = "rollplex" if "rollplex" in results else next(iter(results))
    r = results[name]
    lines = [f"naive colocation on the busiest GPU ({name} schedule, every tensor resident, no offload): "
             f"{r.naive_peak / GiB:.1f} GiB + {scn.cluster.reserve_bytes / GiB:.0f} GiB CUDA/NCCL reserve"]
    lines += [f"  {label:<48} {b / GiB:>7.1f} GiB" for label, b in r.naive_terms]
    for other in results.values():
        if other.memory:
            lines.append(f"  {other.name}: {other.memory.log}")
    if r.memory and r.memory.actions:
        for a in r.memory.actions[:8]:
            lines.append(f"    {a.kind:<7} {a.tensor:<28} {a.nbytes / GiB:6.2f} GiB/GPU idle "
                         f"{a.gap.a:.2f}–{a.gap.b:.2f}s")
        if len(r.memory.actions) > 8:
            lines.append(f"    ... {len(r.memory.actions) - 8} more (--json lists all)")
    cached = [n for n in r.plan.graph if n.kind == "prefix" and n.args.get("cached")]
    if cached:
        refs = [n for n in r.plan.graph if n.kind == "prefix" and n.model != r.plan.graph.meta.get("rollout_model")]
        loaded = sum(n.args["bytes_per_gpu"] for n in cached) * r.layout.tp_train
        lines.append(f"  reference-prefix cache: {len(cached)}/{len(refs)} reference prefix nodes load from host "
                     f"memory ({loaded / GiB:.1f} GiB per iteration over PCIe instead of recomputing)")
    if paper:
        lines.append(f"  paper: ~{PAPER_NAIVE_GIB} GiB per GPU. Same computation under other choices:")
        w = scn.workload
        for label, change in (("optimizer and master not sharded over DP (ZeRO-0)", dict(zero=0)),
                              ("no activation checkpointing", dict(checkpointing=False)),
                              ("rollout engine takes 90% of HBM (vLLM default)", dict(kv_pool_fraction=0.9)),
                              ("all three", dict(zero=0, checkpointing=False, kv_pool_fraction=0.9))):
            alt = replace(scn, workload=replace(w, **change), memory=False)
            peak = S.run_variant(alt, name).naive_peak + scn.cluster.reserve_bytes
            lines.append(f"    {label:<52} {peak / GiB:7.1f} GiB")
    return "\n".join(lines) + "\n"


def _assumptions(scn, results) -> str:
    from rollplex.pipeline.plan.costs import HOST_SECONDS, MEASURED_H200

    c, w = scn.cluster, scn.workload
    any_r = next(iter(results.values()))
    eff = any_r.costs.eff
    prof = results.get("rollplex", any_r).costs.profile
    rows = [("hardware: " + q, v, src) for q, v, src in c.describe()]
    rows += [
        ("efficiency: vision tower", f"{eff.vit:.2f} of achieved matmul", eff.source),
        ("efficiency: forward (prefill, scoring)", f"{eff.forward:.2f}", eff.source),
        ("efficiency: training fwd+bwd", f"{eff.train:.2f}", eff.source),
        ("decode step", f"{eff.decode_step_overhead * 1e3:.2f} ms + bytes at {eff.decode_bw:.2f} of copy bandwidth",
         f"fit to the measured torch engine {MEASURED_H200['decode_steps']} (vLLM would be faster)"),
        ("decode batching", f"{prof.replicas} replica(s); KV pool holds {prof.cap} sequences per replica, "
         "FIFO continuous batching", "vLLM-like"),
        ("TP communication", "2 all-reduces per layer and pass, ring, not overlapped", "upper bound"),
        ("vision tower", "frozen; one ViT output per prompt serves rollout, reference and actor", "common RL recipe"),
        ("actor forward", "loss re-runs the actor suffix with grad (verl-style)" if w.actor_forward == "recompute"
         else "suffix keeps its graph until the loss", "--actor-forward"),
        ("accumulation order", "the loss chain is kept; the chain of forwards a backward walks is per data-parallel "
         "rank, so it does not serialize prompts across the cluster", "compiler chains them on one worker"),
        ("serial/disaggregated", "score full sequences (no prefix sharing), like verl/OpenRLHF; serial+prefix "
         "and disaggregated+prefix add sharing (the bench's serial and disaggregated) to isolate the overlap gain",
         ""),
        ("rollplex", "prefix sharing, prefix work under light decode "
         + ("on SM partitions" if c.interference.partitioned else "on plain streams (--sm-partitions: partitions)")
         + " (gate chosen per plan), stage "
         "fusion (frozen models score single finished samples per decode chunk, as the runtime does; train "
         "fusion per finished group), rollout weights per the sharing plan (views of the training shard where "
         "layouts agree; `rollplex weights`)", ""),
        ("disaggregated", "same GPU budget, best valid split, weights shipped over the network each step", ""),
        ("host nodes", ", ".join(f"{k} {v * 1e3:g} ms" for k, v in HOST_SECONDS.items()), "assumed"),
        ("transfers", "on a copy lane per GPU at PCIe speed; the iteration ends when its last offload does", ""),
    ]
    width = max(len(r[0]) for r in rows)
    return "assumptions\n" + "\n".join(f"  {q:<{width}}  {v}" + (f"  [{src}]" if src else "") for q, v, src in rows)
