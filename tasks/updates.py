"""What the update part of an iteration computes: rewards, advantages, nodes of the algorithm's own,
losses with their backwards, optimizer steps, the weight sync, and the iteration's report.

These are the tasks of the node kinds ``pipeline/compile/updates.py`` places after the rollout and its
scoring (``tasks/nodes.py``); each is ``fn(ctx, node, inputs) -> outputs`` as there.
"""
from __future__ import annotations

from typing import Any

import torch

from rollplex.tasks import mismatch
from rollplex.tasks.nodes import Responses, by_prompt, the, with_role
from rollplex.tasks.registry import register_task
from rollplex.tasks.returns import advantage_tensor, loss_values, reward_value


@register_task("reward")
def reward(ctx, node, inputs):
    prompt, responses = (inputs[v] for v in node.inputs)
    return {node.outputs[0]: group_rewards(ctx, prompt, responses)}


def group_rewards(ctx, prompt, responses: Responses) -> torch.Tensor:
    """[G]: the reward function on each decoded response of one prompt; a multi-turn trajectory's
    reward is its environment's (the sum of its steps' rewards)."""
    if responses.multi_turn:
        return torch.tensor([float(seq.reward) for seq in responses.sequences], dtype=torch.float32)
    texts = [ctx.decode_text(ids) for ids in responses.token_ids]
    return torch.tensor([reward_value(ctx.reward_fn, ctx.reward_fn(text, prompt.answer)) for text in texts],
                        dtype=torch.float32)


def group_advantages(ctx, values: dict[str, Any], width: int) -> torch.Tensor:
    """A group-scoped advantage function on one group's values: [G], or [G, R] cut to the group's
    own response width R."""
    decl = ctx.algorithm.advantage_fn
    adv = advantage_tensor(decl.fn, decl.call(values, ctx.params), (ctx.settings.samples,)).detach()
    return adv[..., :width] if adv.dim() == 2 else adv


def count_of(agg: str) -> str:
    """What a loss aggregation averages over: the batch's response tokens or its responses."""
    return "tokens" if agg == "token-mean" else "sequences"


def normaliser(stats: dict, count: str, prompts=None) -> int:
    """The batch's ``count`` (``count_of``) from its rollout stats, or that of ``prompts`` alone (a
    mini-batch), at least 1."""
    if prompts is None:
        return max(stats[count], 1)
    at = 0 if count == "tokens" else 1
    return max(sum(stats["by_prompt"][p][at] for p in prompts), 1)


def summed_loss(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """The loss summed over the batch's tokens (token-mean) or responses (the seq-mean modes): divided
    by ``normaliser`` it is the batch's mean, so micro-batches (or groups) add up."""
    if agg == "token-mean":
        return (per_token * mask).sum()
    per_seq = (per_token * mask).sum(-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    return per_seq.sum()


def loss_metrics(metrics: dict, mask: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
    """Per-token metrics [B, R] summed over the mask (token means over the batch in report) and
    scalar metrics (means over micro-batches in report)."""
    sums = {k: float((v.detach() * mask).sum()) for k, v in metrics.items() if torch.is_tensor(v) and v.dim() == 2}
    return sums, {k: float(v) for k, v in metrics.items() if k not in sums}


def bound_values(inputs: dict[str, Any], binding: dict) -> dict[str, list]:
    """Each function parameter's value for each prompt group of the node (see compiler ``bind``)."""
    out = {}
    for param, pairs in binding.items():
        values = []
        for value_name, group in pairs:
            value = inputs[value_name]
            if group is not None:  # a batch-level value, indexed by prompt group
                value = value[group]
            values.append(value.mask() if param == "mask" else value)
        out[param] = values
    return out


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def join_groups(values: list, how: str) -> Any:
    """Tensors of several groups as one: ``cat`` along responses or ``stack`` per group; 2-D
    per-token tensors are right-padded to a common length first. Other values stay a list."""
    if not all(torch.is_tensor(v) for v in values):
        return values
    if values[0].dim() >= 2:
        width = max(v.shape[-1] for v in values)
        values = [_pad_to(v, width) for v in values]
    return torch.cat(values) if how == "cat" else torch.stack(values)


@register_task("custom")
def custom(ctx, node, inputs):
    decl = next(c for c in ctx.algorithm.custom if c.name == node.args["function"])
    values = bound_values(inputs, node.args["bind"])
    if decl.options["per"] == "prompt":
        args = {k: v[0] for k, v in values.items()}
    else:
        args = values
    return {node.outputs[0]: decl.call(args, ctx.params)}


@register_task("advantage")
def advantage(ctx, node, inputs):
    decl = ctx.algorithm.advantage_fn
    values = bound_values(inputs, node.args["bind"])
    # Per-response advantages are [G]; per-token ones [G, R] come back at each group's own width R
    # (batch-scope inputs are padded to the batch's longest response).
    widths = [r.mask().shape[-1] for r in values["responses"]]
    if decl.options["scope"] == "group":
        return {node.outputs[0]: group_advantages(ctx, {k: v[0] for k, v in values.items()}, widths[0])}
    adv = advantage_tensor(decl.fn, decl.call({k: join_groups(v, "stack") for k, v in values.items()}, ctx.params),
                           (len(node.args["prompts"]), ctx.settings.samples))
    return {node.outputs[0]: {p: (adv[i][..., : widths[i]] if adv.dim() == 3 else adv[i]).detach().float()
                              for i, p in enumerate(node.args["prompts"])}}


@register_task("loss")
def loss(ctx, node, inputs):
    """The micro-batch's loss, normalised to the whole batch, then its backward.

    token-mean divides by the batch's total response tokens, the seq-mean modes by its number of
    responses, so the M micro-batch backwards add up to exactly the full-batch gradient.
    """
    if "handoff_chunk" in node.args:  # train fusion: the groups one decode chunk finished
        from rollplex.tasks.fused_train import train_handoff

        return train_handoff(ctx, node, inputs)
    if "micro_batch_tokens" in node.args:  # the policy's forwards with grad too, in token-capped backwards
        from rollplex.tasks.capped_train import train_capped

        return train_capped(ctx, node, inputs)
    decl, engine = ctx.algorithm.losses()[node.model], ctx.train_engine(node.model)
    stats = inputs[the(ctx, node.inputs, "rollout_stats")]
    bound = loss_inputs(inputs, node)
    values = joined_on(bound, range(len(bound["responses"])), engine.device)
    agg = decl.options["agg"]
    loss, metrics = backward_of(ctx, node, decl, engine, values, bound["responses"],
                                normaliser(stats, count_of(agg), node.args.get("normalise")))
    sums, scalars = loss_metrics(metrics, values["mask"])
    return {node.outputs[0]: {"loss": loss, "tokens": float(values["mask"].sum()),
                              "sums": sums, "scalars": scalars, "step": node.args.get("step", 0)}}


def loss_inputs(inputs: dict[str, Any], node) -> dict[str, list]:
    """The loss function's bound values, per group, without the importance weights (bound to the
    responses, they are computed from the old log-probs: ``backward_of``)."""
    bound = bound_values(inputs, node.args["bind"])
    bound.pop("rollout_is_weights", None)
    return bound


def joined_on(bound: dict[str, list], groups, device) -> dict[str, Any]:
    """The values of ``groups`` (indices into each bound list) as one batch, with the responses'
    mask, their tensors on ``device``."""
    values = {k: join_groups([v[i] for i in groups], "cat") for k, v in bound.items()}
    values["mask"] = join_groups([bound["responses"][i].mask() for i in groups], "cat")
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in values.items()}


def backward_of(ctx, node, decl, engine, values: dict[str, Any], responses: list, count: int) -> tuple[float, dict]:
    """The loss over ``values`` (one batch of groups, ``joined_on``), summed and divided by the whole
    batch's ``count`` (``normaliser``), and its backward: (that loss, its metrics). A non-finite loss
    is refused before any gradient moves."""
    mask, weighted = values["mask"], "rollout_is_weights" in decl.reads
    if weighted:
        old = values[f"old_{ctx.algorithm.policy_logprobs()}"]
        values["rollout_is_weights"] = mismatch.rollout_is_weights(ctx.settings.rollout_is_cap, old, responses)
    per_token, metrics = loss_values(decl.fn, decl.call(values, ctx.params), mask)
    if weighted and ctx.settings.rollout_is_cap is not None:
        metrics = {**metrics, "rollout_is_weight": values["rollout_is_weights"]}
    contribution = summed_loss(per_token, mask, decl.options["agg"]) / count
    if not torch.isfinite(contribution):
        raise FloatingPointError(f"non-finite loss {contribution.item()} in micro-batch {node.name}")
    # With R data-parallel ranks DeepSpeed averages the ranks' gradients; each rank's share of the
    # global-batch loss is scaled by R so that the all-reduce yields their sum.
    world = int(node.args.get("world", 1))
    engine.backward(contribution * world if world != 1 else contribution)
    return float(contribution.detach()), metrics


def add_loss(record: dict, scalars: dict[str, list[float]], loss: float, mask: torch.Tensor, metrics: dict) -> None:
    """One backward's loss, token count and per-token metric sums added into a node's loss ``record``;
    its scalar metrics appended to ``scalars`` (the node averages them)."""
    record["loss"] += loss
    record["tokens"] += float(mask.sum())
    sums, batch_scalars = loss_metrics(metrics, mask)
    for k, v in sums.items():
        record["sums"][k] = record["sums"].get(k, 0.0) + v
    for k, v in batch_scalars.items():
        scalars.setdefault(k, []).append(v)


@register_task("optimizer_step")
def optimizer_step(ctx, node, inputs):
    engine = ctx.train_engine(node.model)
    if "deferred_normaliser" in node.args:  # train fusion summed the losses: divide by the batch's count now
        stats = inputs[the(ctx, node.inputs, "rollout_stats")]
        engine.scale_gradients(1.0 / normaliser(stats, node.args["deferred_normaliser"]))
    stats = engine.step()
    return {node.outputs[0]: {"grad_norm": stats.grad_norm, "lr": stats.lr}}


@register_task("weight_sync")
def weight_sync(ctx, node, inputs):
    # Only what training changes travels (with LoRA adapters: the targets, merged), less the vision
    # tower, which decode engines never run: vit_encode feeds them.
    weights = ctx.train_engine(node.model).state_dict_for_sync(trainable_only=True)
    ctx.decode_engine.load_weights(weights)
    return {node.outputs[0]: {"version": ctx.iteration + 1}}


@register_task("report")
def report(ctx, node, inputs):
    """Host-side records of the iteration: one row per response, plus the batch metrics. With several
    optimizer steps (``args["steps"]``, passing ``epochs`` times over the batch) a loss is the mean of
    the steps' losses, a per-token metric the mean over every token of every step, a grad norm the
    mean of the steps'."""
    alg = ctx.algorithm
    read = node.inputs
    steps, epochs = node.args.get("steps", 1), node.args.get("epochs", 1)
    stats = inputs[the(ctx, read, "rollout_stats")]
    rows, rewards, losses, sums, scalars = [], [], 0.0, {}, {}
    # The policy's loss is "loss"; another trained model's (a critic's) is "loss_<model>". Metrics
    # its loss function returns are merged by name.
    extra_losses = {}
    for model in (alg.rollout_model, *alg.model_losses):
        micro_batches = [inputs[v] for v in with_role(ctx, read, "loss", model=model)]
        micro_batches = [v for v in micro_batches if not (v.get("deferred") and not v["tokens"])]  # a fused
        for value in micro_batches:  # chunk that trained no group has nothing to report
            if value.get("deferred"):  # train fusion: a sum, divided by the batch's count only now
                value = dict(value, loss=value["loss"] / normaliser(stats, value["deferred"]))
            if model == alg.rollout_model:
                losses += value["loss"]
            else:
                extra_losses[f"loss_{model}"] = extra_losses.get(f"loss_{model}", 0.0) + value["loss"]
            for k, v in value["sums"].items():
                sums[k] = sums.get(k, 0.0) + v
            for k, v in value["scalars"].items():
                scalars[k] = scalars.get(k, 0.0) + v / len(micro_batches)
    prompts, responses_of = by_prompt(ctx, read, "prompt"), by_prompt(ctx, read, "responses")
    rewards_of = by_prompt(ctx, read, "rewards")
    advantages: dict[int, torch.Tensor] = {}
    for v in with_role(ctx, read, "advantages"):  # a group's, or a batch's (by prompt)
        value = inputs[v]
        advantages.update(value if isinstance(value, dict) else {ctx.values[v].prompts[0]: value})
    scores = {s.as_: by_prompt(ctx, read, "score", label=f"old_{s.as_}" if s.grad else s.as_) for s in alg.scores}
    policy_lp = alg.policy_logprobs()
    gap = dict.fromkeys(mismatch.METRICS, 0.0)  # the decode engine's log-probs against old_<policy_lp>
    for p in sorted(responses_of):
        prompt, responses, r = inputs[prompts[p]], inputs[responses_of[p]], inputs[rewards_of[p]]
        adv = advantages[p]
        scored = {name: inputs[of[p]] for name, of in scores.items()}
        sampled = mismatch.sampled_logprobs(responses) if policy_lp is not None else None
        policy_mask = responses.mask() if responses.multi_turn else None
        for g, seq in enumerate(responses.sequences):
            n = len(seq.token_ids)
            row = {
                "prompt_id": prompt.prompt_id,
                "sample": g,
                "prompt_token_ids": prompt.input_ids.tolist(),
                # where each image came from (a path, a sha256, or the embedded task's seed and index),
                # so a log-prob can be recomputed without the run
                "images": prompt.meta.get("images", []),
                **({"videos": prompt.meta["videos"]} if prompt.meta.get("videos") else {}),
                "response_token_ids": list(seq.token_ids),
                "text": ctx.decode_text(seq.token_ids),
                "answer": prompt.answer,
                "reward": float(r[g]),
                # a per-token advantage [G, R] (GAE, REINFORCE++) is logged as its mean over the policy's tokens
                "advantage": (float(adv[g, :max(n, 1)].mean()) if policy_mask is None else
                              float((adv[g, :n] * policy_mask[g, :n]).sum() / policy_mask[g, :n].sum().clamp(min=1)))
                if adv.dim() == 2 else float(adv[g]),
                "rollout_logprobs": [float(x) for x in seq.logprobs],
            }
            if policy_mask is not None:  # a multi-turn trajectory: which tokens are the policy's, and its turns
                from rollplex.tasks.turns import turn_row

                row.update(turn_row(ctx, seq))
            for s in alg.scores:
                key = f"old_{s.as_}" if s.grad else s.as_
                row[key] = [float(x) for x in scored[s.as_][g, :n].tolist()]
            if policy_lp is not None:
                own = slice(None) if policy_mask is None else policy_mask[g, :n].bool()
                for k, v in mismatch.mismatch_sums(scored[policy_lp][g, :n][own], sampled[g, :n][own]).items():
                    gap[k] += v
            rows.append(row)
            rewards.append(float(r[g]))
    tokens = max(stats["tokens"], 1)
    if steps > 1:
        losses, extra_losses = losses / steps, {k: v / steps for k, v in extra_losses.items()}
        tokens *= epochs  # each epoch visits every token once more

    def steps_of(model: str) -> list[dict]:
        return [inputs[v] for v in with_role(ctx, read, "step", model=model)]

    def grad_norm(records: list[dict]) -> float:
        return records[0]["grad_norm"] if len(records) == 1 else sum(r["grad_norm"] for r in records) / len(records)

    policy_steps = steps_of(alg.rollout_model)
    rt = torch.tensor(rewards)
    metrics = {
        "reward_mean": float(rt.mean()) if rewards else 0.0,
        "reward_std": float(rt.std()) if len(rewards) > 1 else 0.0,
        "loss": losses,
        "grad_norm": grad_norm(policy_steps),
        "lr": policy_steps[-1]["lr"],
        "response_len_mean": stats["tokens"] / max(stats["sequences"], 1),
    }
    metrics.update(extra_losses)
    for model in alg.model_losses:
        metrics[f"grad_norm_{model}"] = grad_norm(steps_of(model))
    metrics.update({k: v / tokens for k, v in sums.items()})
    if policy_lp is not None:  # over the rollout's tokens, once each
        metrics.update({k: v / max(stats["tokens"], 1) for k, v in gap.items()})
    if ctx.refcache is not None:
        cache = ctx.refcache.stats()
        metrics.update(ref_cache_hit_rate=cache.hit_rate, ref_cache_bytes=cache.host_bytes + cache.disk_bytes)
    metrics.update(scalars)
    turn_sums: list[str] = []
    if "prefill" in stats:  # a multi-turn rollout
        from rollplex.tasks.turns import TURN_SUMS, turn_metrics

        turned = turn_metrics(rows, stats, [inputs[prompts[p]].num_tokens for p in sorted(responses_of)],
                              ctx.settings.samples, shared=node.args.get("prefix_sharing", True))
        metrics.update(turned)
        turn_sums = [k for k in turned if k in TURN_SUMS or k.startswith("episodes_")]
    if "kl" not in metrics:
        metrics["kl"] = 0.0
    # "additive": metrics that are sums over the batch, which a data-parallel gather adds up.
    additive = ["loss", *sums, *(gap if policy_lp is not None else ()), *turn_sums]
    return {node.outputs[0]: {"rows": rows, "metrics": metrics, "additive": additive}}
