"""The ``gather`` node of a data-parallel iteration (pipeline/compile/ranks.py): host records of the ranks merged.

``what="relay"``: one host value passed on as it is, so that a node on another rank reads it
without the device tensors of the node that made it. ``what="rollout_stats"``: the ranks' decode statistics summed, so every loss divides by the tokens (or
responses) of the global batch. ``what="report"``: the ranks' reports as the single-rank report would
have been: rows in prompt order (rank r holds the r-th block of prompts), rewards re-aggregated over
all rows, batch sums ("additive": the loss and per-token metric sums, already divided by the global
token count) added up, and per-rank means (grad norm and lr, equal on every rank after the all-reduce;
means over micro-batches, of which every rank has as many) averaged.
"""
from __future__ import annotations

import torch

from rollplex.tasks.registry import register_task


def merge_stats(parts: list[dict]) -> dict:
    merged = {"tokens": sum(p["tokens"] for p in parts), "sequences": sum(p["sequences"] for p in parts),
              "max_len": max((p["max_len"] for p in parts), default=0),
              "by_prompt": {k: v for p in parts for k, v in p.get("by_prompt", {}).items()}}
    if "prefill" in parts[0]:  # multi-turn: the decode engines' prefill counts, summed
        merged["prefill"] = {k: sum(p["prefill"][k] for p in parts) for k in parts[0]["prefill"]}
    return merged


def merge_reports(parts: list[dict]) -> dict:
    rows = [row for part in parts for row in part["rows"]]
    additive = set().union(*(p.get("additive", ()) for p in parts))
    keys = list(dict.fromkeys(k for p in parts for k in p["metrics"]))
    metrics = {}
    for k in keys:
        values = [p["metrics"][k] for p in parts if k in p["metrics"]]
        metrics[k] = sum(values) if k in additive else sum(values) / len(values)
    rewards = torch.tensor([float(r["reward"]) for r in rows])
    metrics["reward_mean"] = float(rewards.mean()) if len(rows) else 0.0
    metrics["reward_std"] = float(rewards.std()) if len(rows) > 1 else 0.0
    return {"rows": rows, "metrics": metrics, "additive": sorted(additive)}


@register_task("gather")
def gather(ctx, node, inputs):
    if node.args["what"] == "relay":
        return {node.outputs[0]: inputs[node.inputs[0]]}
    # A report's gather also reads the global rollout stats (which orders it after them), not a part.
    parts = [inputs[v] for v in node.inputs
             if ctx.values[v].role != "rollout_stats" or node.args["what"] == "rollout_stats"]
    merged = merge_stats(parts) if node.args["what"] == "rollout_stats" else merge_reports(parts)
    return {node.outputs[0]: merged}
