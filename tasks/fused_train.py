"""``train_c{c}``: the policy's update on the groups one decode chunk finished (train fusion).

The compiler emits these instead of per-prompt reward, advantage, suffix and loss nodes when every
step of the algorithm is per group (``compiler.train_fusable``). Each handed group runs reward →
advantage → the policy's suffix forward with grad on its prefix → the loss → backward, one group
after another, so a group's graphs are freed before the next is built. The batch's token (or
response) count is known only after the last chunk, so each group's loss is summed, not averaged;
the optimizer step divides the accumulated gradient by that count (``deferred_normaliser``), which
gives the gradient of the averaged loss up to float rounding.
"""
from __future__ import annotations

import torch

from rollplex.tasks import lm


def train_handoff(ctx, node, inputs) -> dict:
    s = ctx.settings
    alg = ctx.algorithm
    decl, engine = alg.loss_fn, ctx.train_engine(node.model)
    model = ctx.model(node.model)
    c, as_ = node.args["handoff_chunk"], node.args["as"]
    handoff = inputs[f"handoff_c{c}"]
    rewards_out, advantages_out, old_out = {}, {}, {}
    record = {"loss": 0.0, "tokens": 0.0, "sums": {}, "scalars": {}, "deferred": node.args["agg"]}
    scalars: dict[str, list[float]] = {}
    for p in sorted(handoff):
        responses, prompt = handoff[p], inputs[f"prompt_p{p}"]
        rewards = torch.tensor([float(ctx.reward_fn(ctx.decode_text(ids), prompt.answer))
                                for ids in responses.token_ids], dtype=torch.float32)
        mask = responses.mask()
        adv = alg.advantage_fn.call({"rewards": rewards, "responses": responses, "mask": mask}, ctx.params)
        adv = torch.as_tensor(adv, dtype=torch.float32).detach()
        adv = adv[..., : mask.shape[-1]] if adv.dim() == 2 else adv
        ((logprobs, _),) = lm.suffix_logprobs_batch(model, [inputs[f"prefix_{node.model}_p{p}"]],
                                                     [responses.token_ids], pad_id=s.pad_id,
                                                     temperature=s.score_temperature, grad=True)
        values = {"responses": [responses], "rewards": rewards, "advantages": adv, "mask": mask,
                  as_: logprobs, f"old_{as_}": logprobs.detach(),
                  **{name: inputs[f"{name}_c{c}"][p] for name in node.args["frozen"]}}
        values = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in values.items()}
        mask = values["mask"]
        result = decl.call(values, ctx.params)
        per_token, metrics = result if isinstance(result, tuple) else (result, {})
        if node.args["agg"] == "token-mean":
            contribution = (per_token * mask).sum()
        else:
            per_seq = (per_token * mask).sum(-1)
            if node.args["agg"] == "seq-mean-token-mean":
                per_seq = per_seq / mask.sum(-1).clamp(min=1)
            contribution = per_seq.sum()
        if not torch.isfinite(contribution):
            raise FloatingPointError(f"non-finite loss {contribution.item()} for prompt {p} in {node.name}")
        engine.backward(contribution)
        rewards_out[p], advantages_out[p], old_out[p] = rewards, adv, logprobs.detach().cpu()
        record["loss"] += float(contribution.detach())
        record["tokens"] += float(mask.sum())
        for k, v in metrics.items():
            if torch.is_tensor(v) and v.dim() == 2:
                record["sums"][k] = record["sums"].get(k, 0.0) + float((v.detach() * mask).sum())
            else:
                scalars.setdefault(k, []).append(float(v))
    record["scalars"] = {k: sum(v) / len(v) for k, v in scalars.items()}
    rewards_name, advantages_name, old_name, loss_name = node.outputs
    return {rewards_name: rewards_out, advantages_name: advantages_out, old_name: old_out, loss_name: record}


def normaliser(stats: dict, agg: str) -> float:
    """What a deferred loss divides by: the batch's response tokens, or its responses."""
    return float(max(stats["tokens"] if agg == "token-mean" else stats["sequences"], 1))
