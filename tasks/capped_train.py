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

from rollplex.engines import vlm
from rollplex.tasks.fused_train import handoff_batches
from rollplex.tasks.nodes import by_prompt, the
from rollplex.tasks.updates import add_loss, backward_of, count_of, join_groups, joined_on, loss_inputs, normaliser


def train_capped(ctx, node, inputs) -> dict:
    s = ctx.settings
    decl, engine, model = ctx.algorithm.losses()[node.model], ctx.train_engine(node.model), ctx.model(node.model)
    as_, groups, budget = node.args["as"], node.args["prompts"], node.args["micro_batch_tokens"]
    stats = inputs[the(ctx, node.inputs, "rollout_stats")]
    prompt_of, vision_of = by_prompt(ctx, node.inputs, "prompt"), by_prompt(ctx, node.inputs, "vision")
    bound = loss_inputs(inputs, node)  # {parameter: [its value for each group, in order]}
    responses = bound["responses"]
    tokens = {i: inputs[prompt_of[p]].num_tokens + sum(map(len, responses[i].token_ids)) for i, p in enumerate(groups)}
    count = normaliser(stats, count_of(decl.options["agg"]), node.args.get("normalise"))
    record = {"loss": 0.0, "tokens": 0.0, "sums": {}, "scalars": {}, "step": node.args.get("step", 0)}
    scalars: dict[str, list[float]] = {}
    old_out = {}
    for batch in handoff_batches(list(range(len(groups))), tokens, len(groups), budget):
        prompts = [inputs[prompt_of[groups[i]]] for i in batch]
        prefixes = vlm.prefix_forward_batch(model, prompts, [inputs[vision_of[groups[i]]] for i in batch], grad=True)
        scored = vlm.suffix_logprobs_batch(model, prefixes, [responses[i].token_ids for i in batch], pad_id=s.pad_id,
                                           temperature=s.score_temperature, grad=True)
        logprobs = [lp for lp, _ in scored]
        values = joined_on(bound, batch, engine.device)
        values[as_] = join_groups(logprobs, "cat")
        values[f"old_{as_}"] = values[as_].detach()
        loss, metrics = backward_of(ctx, node, decl, engine, values, [responses[i] for i in batch], count)
        add_loss(record, scalars, loss, values["mask"], metrics)
        for i, lp in zip(batch, logprobs):
            old_out[groups[i]] = lp.detach().cpu()
    record["scalars"] = {k: sum(v) / len(v) for k, v in scalars.items()}
    olds = {ctx.values[name].prompts[0]: name for name in node.outputs[1:]}
    return {node.outputs[0]: record, **{name: old_out[p] for p, name in olds.items()}}
