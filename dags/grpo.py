"""GRPO: group relative policy optimisation (Shao et al., 2024, DeepSeekMath §4.1).

Sample G responses per prompt from the current policy and score each with a verifiable reward.
A response's advantage is its reward normalised within its group, so no critic is needed. The
policy loss is PPO's clipped surrogate on that advantage plus β·KL(π‖π_ref), estimated per token
with k3 = exp(ref − logp) − (ref − logp) − 1, averaged over all tokens of the batch. ``clip_ratio_c``
(``train.clip_ratio_c``) adds the dual clip: the surrogate of a negative advantage is at least c·Â.
``rollout_is_weights`` (1, or min(π_old/π_rollout, C) under ``train.rollout_is``) weighs the surrogate
term alone, as in verl.
"""
import torch

from rollplex import Algorithm

grpo = Algorithm("grpo", doc=__doc__)
grpo.policy("actor")
grpo.frozen("ref", copy_of="actor")

grpo.score("ref", as_="ref_logprobs")  # its prefix runs inside the decode window
grpo.score("actor", as_="logprobs", grad=True)  # also yields old_logprobs (detached)


@grpo.advantage(scope="group", min_samples=2)  # the std of one reward is NaN
def advantages(rewards, eps: float = 1e-6):
    """Â_i = (r_i − mean(r)) / (std(r) + ε) over the G responses of one prompt."""
    return (rewards - rewards.mean()) / (rewards.std() + eps)


@grpo.loss(agg="token-mean")
def policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, rollout_is_weights, clip_eps: float = 0.2,
                kl_coef: float = 0.04, clip_ratio_c: float | None = None):
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    surrogate = torch.minimum(unclipped, clipped)
    metrics = {"clip_frac": (clipped < unclipped).float()}  # where the clip binds (its gradient is 0)
    if clip_ratio_c is not None:  # dual clip (Ye et al., 2020): a negative advantage costs at most c·|Â|
        dual = torch.where(adv < 0, torch.maximum(surrogate, clip_ratio_c * adv), surrogate)
        surrogate, metrics["dual_clip_frac"] = dual, (dual > surrogate).float()
    log_ratio = ref_logprobs - logprobs
    kl = torch.exp(log_ratio) - log_ratio - 1
    return -surrogate * rollout_is_weights + kl_coef * kl, {"kl": kl, **metrics}


algorithm = grpo
