"""The simulator against a measured ``rollplex bench`` run (issue 3: predictions within 10% per policy).

Reads the bench's JSON (``rollplex bench --out DIR`` writes ``DIR/bench.json``; the recorded runs are in
``benchmarks/results/``), builds the same workload for ``rollplex simulate`` (model preset, P, G,
vision and text tokens, the log-normal response lengths, chunk size, one GPU, torch AdamW, no
activation checkpointing, the actor's suffix graph kept for its loss; per policy its batching options
``ppn``/``mb`` and, under rollplex, stage fusion and ``tf``), and prints three predictions per policy
next to the measured median:

1. ``roofline``: the cost model as shipped (efficiencies from ROLLPLEX.md's H200 iteration).
2. ``kinds``: per kind, a per-node overhead and a factor on the roofline (``Calibration.fit``), fitted
   to the measured seconds per kind of the policies named by ``--calibrate-on`` (default: the serial
   ones in the run). Two batchings of serial (``serial`` and ``serial:ppn=8:mb=2``) pin the per-node
   overhead apart from the factor. Every policy is then predicted with them; the rollplex ones are out
   of sample: the fit never sees their times.
3. ``+contention``: also the decode/prefix contention measured between ``--contention-from``'s two
   policies (decode slowdown beside prefix work; the rate prefix work progresses at beside decode).
   In sample for that rollplex policy by construction; printed so the remaining error is attributable.

    python benchmarks/predict_bench.py benchmarks/results/2026-11-29-h200-bench-3b.json
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

# bench policy → simulator variant (simulate's "serial" scores full sequences, like verl/OpenRLHF)
VARIANT_OF = {"serial-noshare": "serial", "serial": "serial+prefix", "rollplex": "rollplex",
              "rollplex-nofusion": "rollplex"}
# Knobs of the bench that the simulator does not model (it chooses its own gate and partition).
IGNORED = ("iterations", "policies", "decode_sms", "gate_rows", "out", "layers")
GPU_KINDS = ("vit_encode", "prefix", "decode_chunk", "suffix_score", "loss", "optimizer_step", "weight_sync")


def scenario(cfg: dict, policy: str, calibration=None, cluster=None):
    """The simulator's scenario for one bench policy (``serial:ppn=8:mb=2``: its batching options)."""
    from rollplex.pipeline.bench.results import policy_shape
    from rollplex.pipeline.plan.costs import Workload
    from rollplex.pipeline.plan.hardware import hardware
    from rollplex.engines.modelspec import load_model
    from rollplex.pipeline.plan.simulator import Scenario

    shape = policy_shape(policy, prompts_per_node=cfg.get("prompts_per_node", 1),
                         stage_fusion=cfg.get("stage_fusion", False), train_fusion=cfg.get("train_fusion", False))
    w = Workload(prompts=cfg["prompts"], samples=cfg["samples"], text_tokens=cfg["text_tokens"] + 2,
                 vision_tokens=cfg["vision_tokens"], max_new_tokens=cfg["max_new_tokens"],
                 response=f"lognormal:{cfg['mean_new_tokens']}:0.8", chunk_tokens=cfg["chunk_tokens"],
                 zero=0 if cfg.get("train_engine", "torch") == "torch" else 2,
                 micro_batch_groups=shape["micro_batch_groups"], prompts_per_node=shape["prompts_per_node"],
                 checkpointing=False, actor_forward="keep", seed=cfg.get("seed", 0))
    from rollplex.dags.grpo import grpo

    return Scenario(load_model(cfg["model"]), cluster or hardware("h200", 1), w, grpo, calibration=calibration,
                    memory=False, stage_fusion=shape["stage_fusion"], window_chunks=shape["window_chunks"],
                    train_fusion=shape["train_fusion"], grad_prefix_lookahead=shape["grad_prefix_lookahead"])


def variant_of(policy: str) -> str | None:
    """The simulator variant of a bench policy; None for one it does not model (two GPUs) or whose
    options no longer exist (run 7's ``cudnn=0``)."""
    from rollplex.errors import RollplexError
    from rollplex.pipeline.bench.results import parse_policy

    try:
        return VARIANT_OF.get(parse_policy(policy)[0])
    except RollplexError:
        return None


def predicted_by_kind(result) -> dict[str, tuple[int, float]]:
    """kind → (nodes, predicted seconds summed over them)."""
    out: dict[str, tuple[int, float]] = {}
    for name, slot in result.plan.slots.items():
        node = result.plan.graph.nodes[name]
        n, sec = out.get(node.kind, (0, 0.0))
        out[node.kind] = (n + 1, sec + result.costs(node, len(slot.gpus)).seconds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a bench JSON (benchmarks/results/*.json)")
    ap.add_argument("--calibrate-on", nargs="+", help="policies whose kinds the fit sees (default: every "
                    "serial one in the run: serial-noshare, serial, serial:ppn=8:mb=2, ...)")
    ap.add_argument("--contention-from", nargs=2, metavar=("ROLLPLEX", "SERIAL"), default=["rollplex", "serial"],
                    help="a rollplex policy and the serial one of the same batching, both in the run")
    ap.add_argument("--also", nargs="+", default=[], metavar="POLICY",
                    help="policies the run did not measure, predicted with the same calibration (what-ifs)")
    ap.add_argument("--fit-from", help="another bench JSON to calibrate on (default: RESULTS itself)")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args()

    from rollplex.pipeline.plan import simulator as S
    from rollplex.pipeline.plan.costs import Calibration
    from rollplex.pipeline.plan.hardware import hardware

    data = json.load(open(args.results))
    cfg, measured = data["config"], {r["policy"]: r for r in data["results"]}
    policies = [p for p in measured if variant_of(p)]
    for p in args.also:
        if not variant_of(p):
            raise SystemExit(f"--also {p}: not a one-GPU bench policy with known options")
    policies += [p for p in args.also if p not in policies]
    fit_data = json.load(open(args.fit_from)) if args.fit_from else data
    if fit_data["config"] != cfg and {k: v for k, v in fit_data["config"].items() if k not in IGNORED} != \
            {k: v for k, v in cfg.items() if k not in IGNORED}:
        raise SystemExit(f"--fit-from {args.fit_from}: another workload than {args.results}")
    fit_measured = {r["policy"]: r for r in fit_data["results"]}
    calibrate_on = args.calibrate_on or [p for p in fit_measured if (variant_of(p) or "").startswith("serial")]

    def predict(calibration=None, cluster=None, which=policies) -> dict[str, tuple[float, dict]]:
        out = {}
        for p in which:
            r = S.run_variant(scenario(cfg, p, calibration, cluster), variant_of(p))
            out[p] = (r.makespan, predicted_by_kind(r))
        return out

    rows = {"roofline": predict()}
    fit_roofline = predict(which=[p for p in calibrate_on if p in fit_measured])
    samples = [(kind, *fit_roofline[p][1][kind], fit_measured[p]["seconds_by_kind"][kind])
               for p in fit_roofline for kind in GPU_KINDS
               if kind in fit_roofline[p][1] and kind in fit_measured[p]["seconds_by_kind"]]
    cal = Calibration.fit(samples, source=f"{args.fit_from or args.results}: {', '.join(calibrate_on)}")
    rows["kinds"] = predict(cal)
    pair = args.contention_from
    if all(p in measured for p in pair):
        # Contention measured in the rollplex run, relative to the same kinds run alone (serial).
        rx, sx = measured[pair[0]]["seconds_by_kind"], measured[pair[1]]["seconds_by_kind"]
        slowdown = rx["decode_chunk"] / sx["decode_chunk"]
        rate = (sx.get("prefix", 0) + sx.get("vit_encode", 0)) / (rx.get("prefix", 0) + rx.get("vit_encode", 0))
        hidden = 1 - (1 - 1 / slowdown) / rate  # the Interference identity H = 1 − (1 − 1/s)/r
        c = hardware("h200", 1)
        fitted = replace(c.interference, decode_slowdown=slowdown,
                         hidden_table=tuple((b, max(0.0, min(hidden, 0.99))) for b, _ in c.interference.hidden_table))
        rows["+contention"] = predict(cal, replace(c, interference=fitted))
        contention = (f"{pair[0]} against {pair[1]}: decode slowdown {slowdown:.2f}×, prefix/vision rate beside "
                      f"decode {rate:.2f} (H = {hidden:.2f})")
    else:
        contention = f"no {pair[0]} + {pair[1]} pair in the run to measure contention"

    print(f"bench: {args.results}\n  {cfg['model']}, P={cfg['prompts']} × G={cfg['samples']}, "
          f"{cfg['vision_tokens']} vision tokens, responses log-normal median {cfg['mean_new_tokens']} "
          f"(max {cfg['max_new_tokens']})")
    print(f"  calibration on {args.fit_from or 'this run'}, {', '.join(calibrate_on)}: " + ", ".join(
        f"{k} {cal.overheads.get(k, 0) * 1e3:.1f} ms/node + {v:.2f}× roofline" for k, v in sorted(cal.factors.items())))
    print("  contention: " + contention + "\n")
    width = max(16, *(len(p) + 2 for p in policies))
    head = f"{'policy':<{width}}{'measured':>10}" + "".join(f"{k:>22}" for k in rows)
    print(head + "\n" + "-" * len(head))
    table = []
    for p in policies:
        m = measured[p]["median_s"] if p in measured else None  # --also: a prediction only
        cells = []
        for k, pred in rows.items():
            err = pred[p][0] / m - 1 if m else None
            cells.append(f"{pred[p][0]:>8.2f} s " + (f"({err:+6.1%})" if m else "(what-if)"))
            table.append({"policy": p, "prediction": k, "predicted_s": pred[p][0], "measured_s": m, "error": err})
        print(f"{p:<{width}}" + (f"{m:>8.2f} s" if m else f"{'—':>10}") + "".join(f"{c:>22}" for c in cells))
    worst = {k: max(abs(t["error"]) for t in table if t["prediction"] == k and t["error"] is not None) for k in rows}
    print("\nworst |error|: " + ", ".join(f"{k} {v:.1%}" for k, v in worst.items()))
    if args.json:
        from rollplex.fsio import atomic_write_text

        atomic_write_text(args.json, json.dumps({"bench": args.results, "fit_from": args.fit_from or args.results,
                                                 "factors": cal.factors, "overheads": cal.overheads,
                                                 "contention": contention, "rows": table}, indent=1))
    if not all(math.isfinite(t["predicted_s"]) for t in table):
        raise SystemExit("a prediction is not finite")


if __name__ == "__main__":
    main()
