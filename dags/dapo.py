"""DAPO (Yu et al., 2025): GRPO without KL, with four changes.

- Clip-higher: the ratio is clipped to [1 − ε_low, 1 + ε_high] with ε_high > ε_low.
- Dynamic sampling: a group whose G rewards are all equal has no signal; it is dropped. Rollplex
  compiles one static graph per iteration, so the batch is refilled by oversampling: decode
  ``rollout.prompts_per_iteration`` prompts and train on the first ``train_groups`` informative
  groups (0: all of them). A short batch is not topped up by a second rollout round; the share of
  tokens kept is logged as ``kept``. Dropped groups are weighted 0 (their forwards still run).
- Token-level loss: the mean over all kept tokens of the batch, not per response.
- Overlong shaping: responses longer than L_max − L_cache lose up to 1 reward, linearly, reaching
  −1 at L_max (``max_len`` should equal ``rollout.max_new_tokens``).
"""
import torch

from rollplex import Algorithm

dapo = Algorithm("dapo", doc=__doc__)
dapo.policy("actor")
dapo.score("actor", as_="logprobs", grad=True)  # also yields old_logprobs


def overlong_penalty(lengths, max_len: int, cache_len: int):
    """0 up to L_max − L_cache, then (L_max − L_cache − |y|)/L_cache, and −1 past L_max."""
    return ((max_len - cache_len - lengths) / cache_len).clamp(-1.0, 0.0)


@dapo.node(writes="shaped_rewards")
def overlong_shaping(rewards, mask, max_len: int = 8, cache_len: int = 4):
    return rewards + overlong_penalty(mask.sum(-1), max_len, cache_len)


@dapo.node(writes="keep", per="batch")
def dynamic_sampling(rewards, mask, train_groups: int = 0):
    """Per-group weight [G]: 0 for dropped groups; kept ones scaled so the runtime's mean over all
    tokens becomes the mean over kept tokens."""
    informative = [bool(r.max() > r.min()) for r in rewards]
    kept = [i for i, ok in enumerate(informative) if ok][: train_groups or None]
    tokens = [float(m.sum()) for m in mask]
    kept_tokens = sum(tokens[i] for i in kept)
    scale = sum(tokens) / kept_tokens if kept_tokens else 0.0
    return [torch.full((len(r),), scale if i in kept else 0.0) for i, r in enumerate(rewards)]


@dapo.advantage(scope="group", min_samples=2)  # the std of one reward is NaN
def advantages(shaped_rewards, eps: float = 1e-6):
    return (shaped_rewards - shaped_rewards.mean()) / (shaped_rewards.std() + eps)


@dapo.loss(agg="token-mean")
def policy_loss(logprobs, old_logprobs, advantages, keep, rollout_is_weights, eps_low: float = 0.2,
                eps_high: float = 0.28, clip_ratio_c: float | None = None):
    ratio = torch.exp(logprobs - old_logprobs)
    adv, weight = advantages.unsqueeze(-1), keep.unsqueeze(-1)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    metrics = {"kept": (weight > 0).float().expand_as(ratio), "clip_frac": (clipped < unclipped).float()}
    if clip_ratio_c is not None:  # dual clip: a negative advantage costs at most c·|Â|
        dual = torch.where(adv < 0, torch.maximum(surrogate, clip_ratio_c * adv), surrogate)
        surrogate, metrics["dual_clip_frac"] = dual, (dual > surrogate).float()
    return -surrogate * weight * rollout_is_weights, metrics


algorithm = dapo
