"""``train_c{c}``: the policy's update on the groups one decode chunk finished (train fusion).

The compiler emits these instead of per-prompt reward, advantage, suffix and loss nodes when every
step of the algorithm is per group (``compiler.train_fusable``). Each handed group runs reward →
advantage → the policy's prefix and suffix forwards with grad → the loss → backward. The groups
of one micro-batch (``train.micro_batch_groups``) share one prefix forward, one suffix forward and
one backward (``train.fusion_batch_tokens`` also bounds a backward's tokens), and each batch's
graphs are freed before the next is built, so no prefix graph outlives its group's backward. The
batch's token (or response) count is known only after the last chunk, so each group's loss is
summed, not averaged; the optimizer step divides the accumulated gradient by that count
(``deferred_normaliser``), which gives the gradient of the averaged loss up to float rounding.
Rewards, advantages, the loss's sum and its metrics are the per-prompt tasks' own helpers
(tasks/updates.py).
"""
from __future__ import annotations

import torch

from rollplex.engines import vlm
from rollplex.tasks import mismatch
from rollplex.tasks.returns import loss_values
from rollplex.tasks.nodes import by_prompt, join_samples, the, with_role
from rollplex.tasks.updates import add_loss, count_of, group_advantages, group_rewards, summed_loss


def frozen_scores(chunks: list, p: int, width: int) -> torch.Tensor:
    """Group p's [G, width] scores of a frozen model: its samples were scored one chunk at a time,
    ``chunks`` holds its per-chunk scores of this chunk and every earlier one."""
    rows: dict[int, torch.Tensor] = {}
    for scored in chunks:
        rows.update(scored.get(p, {}))
    return join_samples(rows, width)


def handoff_batches(groups: list, tokens: dict, most: int, budget: int = 0) -> list[list]:
    """``groups`` in order, cut into backwards of at most ``most`` groups and, with a ``budget``, at
    most that many ``tokens`` (a group's prompt plus its responses); a group over the budget trains
    alone. A chunk's groups finish together where they are longest, so a count alone would put the
    run's longest groups into one backward."""
    runs = vlm.consecutive_runs([tokens[g] if budget else 0 for g in groups], budget or None, most)
    return [[groups[i] for i in run] for run in runs]


def train_handoff(ctx, node, inputs) -> dict:
    s = ctx.settings
    decl, engine = ctx.algorithm.loss_fn, ctx.train_engine(node.model)
    model = ctx.model(node.model)
    as_, agg = node.args["as"], node.args["agg"]
    handoff = inputs[the(ctx, node.inputs, "handoff")]
    prompt_of, vision_of = by_prompt(ctx, node.inputs, "prompt"), by_prompt(ctx, node.inputs, "vision")
    frozen = {name: [inputs[v] for v in with_role(ctx, node.inputs, "score", label=name)]
              for name in node.args["frozen"]}
    rewards_out, advantages_out, old_out = {}, {}, {}
    record = {"loss": 0.0, "tokens": 0.0, "sums": {}, "scalars": {}, "deferred": count_of(agg)}
    scalars: dict[str, list[float]] = {}
    ready = sorted(handoff)
    # Groups share a forward and a backward in the run's micro-batches, as serial's loss nodes do:
    # eager scoring is host-bound, and each group's loss sums into one backward that reaches every
    # group's prefix. The micro-batch bounds a backward's graphs; the logits do not need a budget of
    # their own, as the LM head runs in checkpointed pieces (vlm.head_logprobs) whatever the length.
    most, budget = node.args.get("micro_batch_groups") or 1, node.args.get("batch_tokens", 0)
    tokens = ({p: inputs[prompt_of[p]].num_tokens + sum(map(len, handoff[p].token_ids)) for p in ready}
              if budget else {})
    for batch in handoff_batches(ready, tokens, most, budget):
        prompts = [inputs[prompt_of[p]] for p in batch]
        # A vision tower that trains (vision_grad): its forward with grad, freed with this batch's graphs.
        visions = (vlm.vision_embeds_batch(model, prompts, grad=True) if node.args.get("vision_grad")
                   else [inputs[vision_of[p]] for p in batch])
        prefixes = vlm.prefix_forward_batch(model, prompts, visions, grad=True)
        scored = vlm.suffix_logprobs_batch(model, prefixes,
                                          [handoff[p].token_ids for p in batch], pad_id=s.pad_id,
                                          temperature=s.score_temperature, grad=True)
        total, parts = None, []
        for p, (logprobs, _) in zip(batch, scored):
            responses, prompt = handoff[p], inputs[prompt_of[p]]
            rewards = group_rewards(ctx, prompt, responses)
            mask = responses.mask()
            adv = group_advantages(ctx, {"rewards": rewards, "responses": responses, "mask": mask}, mask.shape[-1])
            values = {"responses": [responses], "rewards": rewards, "advantages": adv, "mask": mask,
                      as_: logprobs, f"old_{as_}": logprobs.detach(),
                      **{name: frozen_scores(chunks, p, mask.shape[-1]) for name, chunks in frozen.items()}}
            values = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in values.items()}
            if "rollout_is_weights" in decl.reads:
                values["rollout_is_weights"] = mismatch.rollout_is_weights(s.rollout_is_cap, values[f"old_{as_}"],
                                                                           [responses])
            per_token, metrics = loss_values(decl.fn, decl.call(values, ctx.params), values["mask"])
            if "rollout_is_weights" in decl.reads and s.rollout_is_cap is not None:
                metrics = {**metrics, "rollout_is_weight": values["rollout_is_weights"]}
            contribution = summed_loss(per_token, values["mask"], agg)
            total = contribution if total is None else total + contribution
            parts.append((p, contribution.detach(), values["mask"], metrics))
            rewards_out[p], advantages_out[p], old_out[p] = rewards, adv, logprobs.detach().cpu()
        # One host sync per batch, not per group: the finiteness check and the loss read share it.
        losses = torch.stack([c for _, c, _, _ in parts]).float().cpu()
        if not torch.isfinite(losses).all():
            bad = next(p for (p, _, _, _), v in zip(parts, losses) if not torch.isfinite(v))
            raise FloatingPointError(f"non-finite loss {float(losses.sum())} for prompt {bad} in {node.name}")
        # With R data-parallel ranks the engine averages their gradients: scaled by R, it sums them.
        world = int(node.args.get("world", 1))
        engine.backward(total * world if world != 1 else total)
        for (_, _, mask, metrics), loss_value in zip(parts, losses.tolist()):
            add_loss(record, scalars, loss_value, mask, metrics)
    record["scalars"] = {k: sum(v) / len(v) for k, v in scalars.items()}
    out = node.outputs
    return {the(ctx, out, "rewards"): rewards_out, the(ctx, out, "advantages"): advantages_out,
            the(ctx, out, "score"): old_out, the(ctx, out, "loss"): record}
