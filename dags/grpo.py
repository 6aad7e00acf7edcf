"""GRPO: group relative policy optimisation (Shao et al., 2024, DeepSeekMath §4.1).

Sample G responses per prompt from the current policy and score each with a verifiable reward.
A response's advantage is its reward normalised within its group, so no critic is needed. The
policy loss is PPO's clipped surrogate on that advantage plus β·KL(π‖π_ref), estimated per token
with k3 = exp(ref − logp) − (ref − logp) − 1, averaged over all tokens of the batch.
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
def policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, clip_eps: float = 0.2, kl_coef: float = 0.04):
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    log_ratio = ref_logprobs - logprobs
    kl = torch.exp(log_ratio) - log_ratio - 1
    return -(surrogate - kl_coef * kl), {"kl": kl, "clip_frac": ((ratio - 1).abs() > clip_eps).float()}


algorithm = grpo
