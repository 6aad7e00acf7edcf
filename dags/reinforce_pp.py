"""REINFORCE++ (Hu, 2025): REINFORCE with PPO's tricks and global advantage normalisation.

The per-token reward is the verifiable reward on the last token minus β·KL_t with the k1 estimate
KL_t = log π_old(y_t) − log π_ref(y_t) on every token. The return is the discounted sum of the
rewards that follow, G_t = Σ_{s≥t} γ^{s−t} r_s, and the advantage is G_t normalised over every
token of the whole batch (not per prompt group): Â = (G − mean) / (std + ε). The loss is PPO's
clipped surrogate, averaged over all tokens of the batch.
"""
import torch

from rollplex import Algorithm

rpp = Algorithm("reinforce_pp", doc=__doc__)
rpp.policy("actor")
rpp.frozen("ref", copy_of="actor")
rpp.score("ref", as_="ref_logprobs")
rpp.score("actor", as_="logprobs", grad=True)  # also yields old_logprobs


@rpp.advantage(scope="batch")
def advantages(rewards, old_logprobs, ref_logprobs, mask, kl_coef: float = 0.01, gamma: float = 1.0,
               eps: float = 1e-8):
    """rewards [P, G]; per-token inputs [P, G, R] (padded, see mask)."""
    token_rewards = -kl_coef * (old_logprobs - ref_logprobs) * mask
    last = (mask.sum(-1, keepdim=True).long() - 1).clamp(min=0)
    token_rewards = token_rewards.scatter_add(-1, last, rewards.unsqueeze(-1).to(token_rewards.dtype))
    returns, running = torch.zeros_like(token_rewards), 0.0
    for t in reversed(range(token_rewards.shape[-1])):
        running = token_rewards[..., t] + gamma * running
        returns[..., t] = running
    n = mask.sum()
    mean = (returns * mask).sum() / n
    std = (((returns - mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)).sqrt()
    return (returns - mean) / (std + eps) * mask


@rpp.loss(agg="token-mean")
def policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, rollout_is_weights, clip_eps: float = 0.2,
                clip_ratio_c: float | None = None):
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    metrics = {"kl": old_logprobs - ref_logprobs, "clip_frac": (clipped < unclipped).float()}
    if clip_ratio_c is not None:  # dual clip: a negative advantage costs at most c·|Â|
        dual = torch.where(advantages < 0, torch.maximum(surrogate, clip_ratio_c * advantages), surrogate)
        surrogate, metrics["dual_clip_frac"] = dual, (dual > surrogate).float()
    return -surrogate * rollout_is_weights, metrics


algorithm = rpp
