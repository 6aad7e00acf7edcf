"""``loss_m{j}`` under ``train.micro_batch_tokens``: a micro-batch's update in token-capped backwards.

Training after decode, a micro-batch's groups are otherwise a prefix node and a suffix node with grad
and a loss node, one backward over all of them, whatever the lengths of their responses. Here one
node does it all: once the responses are known, the groups are cut in order into backwards of at most
``micro_batch_tokens`` tokens (a group's prompt plus its responses; a group over it trains alone), as
verl's dynamic batch size packs micro-batches by tokens. Each backward runs the policy's prefix and
suffix forwards with grad and the loss of its groups, normalised to the whole batch as the loss node
normalises (the batch's token or response count is known from the rollout), so the backwards add up
to the uncapped micro-batch's gradient up to float rounding. Each one's graphs are freed before the
next is built: the peak holds one capped backward, not the micro-batch.
"""
from __future__ import annotations

import torch

from rollplex.engines import vlm
from rollplex.tasks import mismatch
from rollplex.tasks.fused_train import handoff_batches
from rollplex.tasks.nodes import by_prompt, the
from rollplex.tasks.returns import loss_values
from rollplex.tasks.updates import bound_values, count_of, join_groups, loss_metrics, normaliser, summed_loss


def train_capped(ctx, node, inputs) -> dict:
    s = ctx.settings
    decl, engine, model = ctx.algorithm.losses()[node.model], ctx.train_engine(node.model), ctx.model(node.model)
    as_, groups, budget = node.args["as"], node.args["prompts"], node.args["micro_batch_tokens"]
    stats = inputs[the(ctx, node.inputs, "rollout_stats")]
    prompt_of, vision_of = by_prompt(ctx, node.inputs, "prompt"), by_prompt(ctx, node.inputs, "vision")
    bound = bound_values(inputs, node.args["bind"])  # {parameter: [its value for each group, in order]}
    bound.pop("rollout_is_weights", None)  # bound to the responses; computed below
    responses = bound["responses"]
    tokens = {i: inputs[prompt_of[p]].num_tokens + sum(map(len, responses[i].token_ids)) for i, p in enumerate(groups)}
    agg = decl.options["agg"]
    count = normaliser(stats, count_of(agg), node.args.get("normalise"))
    world = int(node.args.get("world", 1))  # DeepSpeed averages ranks' gradients: scaled by R, it sums them
    record = {"loss": 0.0, "tokens": 0.0, "sums": {}, "scalars": {}, "step": node.args.get("step", 0)}
    scalars: dict[str, list[float]] = {}
    old_out = {}
    for batch in handoff_batches(list(range(len(groups))), tokens, len(groups), budget):
        prompts = [inputs[prompt_of[groups[i]]] for i in batch]
        prefixes = vlm.prefix_forward_batch(model, prompts, [inputs[vision_of[groups[i]]] for i in batch], grad=True)
        scored = vlm.suffix_logprobs_batch(model, prefixes, [responses[i].token_ids for i in batch], pad_id=s.pad_id,
                                           temperature=s.score_temperature, grad=True)
        logprobs = [lp for lp, _ in scored]
        values = {k: join_groups([v[i] for i in batch], "cat") for k, v in bound.items()}
        values["mask"] = join_groups([responses[i].mask() for i in batch], "cat")
        values = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in values.items()}
        values[as_] = join_groups(logprobs, "cat")
        values[f"old_{as_}"] = values[as_].detach()
        mask = values["mask"]
        if "rollout_is_weights" in decl.reads:
            values["rollout_is_weights"] = mismatch.rollout_is_weights(s.rollout_is_cap, values[f"old_{as_}"],
                                                                       [responses[i] for i in batch])
        per_token, metrics = loss_values(decl.fn, decl.call(values, ctx.params), mask)
        if "rollout_is_weights" in decl.reads and s.rollout_is_cap is not None:
            metrics = {**metrics, "rollout_is_weight": values["rollout_is_weights"]}
        contribution = summed_loss(per_token, mask, agg) / count
        if not torch.isfinite(contribution):
            raise FloatingPointError(f"non-finite loss {contribution.item()} in micro-batch {node.name}")
        engine.backward(contribution * world if world != 1 else contribution)
        record["loss"] += float(contribution.detach())
        record["tokens"] += float(mask.sum())
        sums, batch_scalars = loss_metrics(metrics, mask)
        for k, v in sums.items():
            record["sums"][k] = record["sums"].get(k, 0.0) + v
        for k, v in batch_scalars.items():
            scalars.setdefault(k, []).append(v)
        for i, lp in zip(batch, logprobs):
            old_out[groups[i]] = lp.detach().cpu()
    record["scalars"] = {k: sum(v) / len(v) for k, v in scalars.items()}
    olds = {ctx.values[name].prompts[0]: name for name in node.outputs[1:]}
    return {node.outputs[0]: record, **{name: old_out[p] for p, name in olds.items()}}
