"""``rollplex weights``: what a colocated rollout engine can share with the trainer, per TP pair.

For a model (preset or config.json) and pairs of training/rollout TP degrees, prints the planner's
report (pipeline/plan/weightshare): aliased, locally copied and gathered bytes per tensor class, HBM saved
per GPU against a second copy, and the bytes each sync still moves; then one summary row per pair.
"""
from __future__ import annotations

import json
from pathlib import Path

from rollplex.errors import ConfigError

DEFAULT_PAIRS = ((1, 1), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4), (4, 8))


def add_parser(sub) -> None:
    w = sub.add_parser("weights", help="weight sharing between trainer and rollout: aliased/rebuilt bytes per TP pair",
                       description=__doc__.splitlines()[0])
    w.add_argument("--model", default="qwen2.5-vl-7b", help="qwen2.5-vl-3b | -7b | -32b | path/to/config.json")
    w.add_argument("--tp-train", help="training TP degree(s), comma-separated (with --tp-roll: every pair)")
    w.add_argument("--tp-roll", help="rollout TP degree(s), comma-separated")
    w.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="trainer's ZeRO stage")
    w.add_argument("--dp", type=int, default=4, help="training data-parallel degree (what ZeRO-3 partitions over)")
    w.add_argument("--train-dtype", default="bfloat16", help="dtype of the trainer's parameters")
    w.add_argument("--dtype", default="bfloat16", help="rollout dtype")
    w.add_argument("--allocation", default="fused", choices=("fused", "separate"),
                   help="fused: the trainer allocates each fused group as one buffer; separate: HF's own")
    w.add_argument("--engine", default="vllm", choices=("vllm", "torch"),
                   help="vllm fuses qkv and gate_up; the torch engines run them apart")
    w.add_argument("--mapping", default="aligned", choices=("aligned", "contiguous"))
    w.add_argument("--no-vision", action="store_true", help="leave the vision tower out")
    w.add_argument("--detail", action="store_true", help="per tensor class tables for every pair")
    w.add_argument("--json", help="write the summary rows here")
    w.set_defaults(fn=cmd_weights)


def _degrees(text: str | None, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")] if text else []
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers") from None


def cmd_weights(args) -> int:
    from rollplex.fsio import atomic_write_text
    from rollplex.engines.modelspec import load_model
    from rollplex.engines.tensorlayouts import actor_layouts
    from rollplex.pipeline.plan.weightshare import RolloutSide, TrainerSide, format_plan, plan_gang

    spec = load_model(args.model)
    tt, tr = _degrees(args.tp_train, "--tp-train"), _degrees(args.tp_roll, "--tp-roll")
    if bool(tt) != bool(tr):
        raise ConfigError("--tp-train and --tp-roll go together (or leave both out for the default pairs)")
    pairs = [(a, b) for a in tt for b in tr] if tt else list(DEFAULT_PAIRS)
    layouts = actor_layouts(spec, vision=not args.no_vision)
    rows, skipped = [], []
    for a, b in pairs:
        try:
            plan = plan_gang(layouts, TrainerSide(a, args.train_dtype, args.zero, args.allocation, args.dp),
                             RolloutSide(b, args.dtype, fused=args.engine == "vllm"), args.mapping)
        except ConfigError as exc:
            if tt:  # asked for explicitly: say why not
                raise
            skipped.append(f"{a}→{b}: {exc}")
            continue
        if args.detail or tt:
            print("\n".join(format_plan(plan, spec.name)))
            print()
        sync_local = max(sum(d.refresh_bytes[0] for d in g.decisions) for g in plan.gpus)
        sync_peer = max(sum(d.refresh_bytes[1] for d in g.decisions) for g in plan.gpus)
        rows.append({"model": spec.name, "tp_train": a, "tp_roll": b, "gpus": len(plan.gpus),
                     "copy_bytes_per_gpu": max(g.total("nbytes") for g in plan.gpus),
                     "aliased_bytes_per_gpu": plan.saved_per_gpu(), "extra_bytes_per_gpu": plan.per_gpu("extra"),
                     "sync_local_bytes": sync_local, "sync_peer_bytes": sync_peer,
                     "full_sync_bytes": plan.per_gpu("nbytes", trainable=True), "notes": list(plan.notes)})
    print(f"{spec.describe()}\n{args.engine} rollout, ZeRO-{args.zero}, {args.allocation} trainer allocation, "
          f"{args.mapping} rank mapping; GiB per GPU (worst GPU of the gang)")
    print(f"  {'train→roll':>10s} {'2nd copy':>9s} {'shared':>8s} {'saved':>8s} {'sync copy':>10s} "
          f"{'sync gather':>12s} {'full sync':>10s}")
    for r in rows:
        g = 2**30
        print(f"  {r['tp_train']:>4d} → {r['tp_roll']:<3d} {r['copy_bytes_per_gpu'] / g:9.2f} "
              f"{r['extra_bytes_per_gpu'] / g:8.2f} {r['aliased_bytes_per_gpu'] / g:8.2f} "
              f"{r['sync_local_bytes'] / g:10.2f} {r['sync_peer_bytes'] / g:12.2f} {r['full_sync_bytes'] / g:10.2f}")
    notes = sorted({n for r in rows for n in r["notes"]})
    for n in notes:
        print(f"  note: {n}")
    for s in skipped:
        print(f"  skipped {s}")
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(rows, indent=1))
    return 0
