"""PPO with a critic (Schulman et al., 2017; as used for LLMs by Ouyang et al., 2022).

A critic V (the actor's architecture with a scalar value head, trained on its own loss and
optimizer) scores each response token's state. The per-token reward is the verifiable reward on
the last token minus β·KL(π_old‖π_ref) on every token; generalised advantage estimation turns it
into advantages  Â_t = Σ_l (γλ)^l δ_{t+l},  δ_t = r_t + γ·V_{t+1} − V_t,  and returns R_t = Â_t + V_t.
The actor's advantages are then whitened over every response token of the batch (masked mean and
unbiased std, as verl's ``masked_whiten``, TRL and OpenRLHF do; ``whiten_advantages``), while the
critic regresses on the unwhitened returns. The actor takes the clipped surrogate; the critic the clipped value loss
½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²). The critic's prefix, like the reference's,
runs inside the decode window. With one update per batch both clips are the formulas only; with
``train.mini_batches`` or ``train.epochs`` above 1 the later steps' ratios leave 1 and they bind.
"""
import torch

from rollplex import Algorithm

ppo = Algorithm("ppo", doc=__doc__)
ppo.policy("actor")
ppo.frozen("ref", copy_of="actor")
ppo.critic("critic", copy_of="actor")

ppo.score("ref", as_="ref_logprobs")
ppo.score("critic", as_="values", grad=True)  # also yields old_values (detached)
ppo.score("actor", as_="logprobs", grad=True)  # also yields old_logprobs


def gae(token_rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimates [G, R] over the policy's tokens (``mask`` 1); the state after the
    last one has value 0. Where ``mask`` is 0 (padding, or an environment's answer between two turns
    of a multi-turn trajectory) there is no step: each policy token's next state is the next policy
    token's, as verl's multi-turn GAE skips the gaps."""
    advantages = torch.zeros_like(token_rewards)
    running, next_value = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        step = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(step, delta + gamma * lam * running, running)
        next_value = torch.where(step, values[:, t], next_value)
        advantages[:, t] = running
    return advantages * mask


def masked_whiten(x, mask, eps: float = 1e-8):
    """(x − mean) / sqrt(var + eps) over the entries where ``mask`` is 1 (unbiased var); 0 elsewhere."""
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = ((x - mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


@ppo.node(writes="returns")
def gae_returns(rewards, old_values, old_logprobs, ref_logprobs, mask,
                gamma: float = 1.0, lam: float = 0.95, kl_coef: float = 0.02):
    """R_t = Â_t + V_t [G, R] of one group, from GAE on the per-token reward."""
    token_rewards = -kl_coef * (old_logprobs - ref_logprobs) * mask
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask > 0, positions, 0).amax(-1)  # the last policy token: the reward lands there
    token_rewards[torch.arange(len(rewards)), last] += rewards
    return gae(token_rewards, old_values, mask, gamma, lam) + old_values * mask


@ppo.advantage(scope="batch")  # [P, G, R]: whitening spans the whole batch
def advantages(returns, old_values, mask, whiten_advantages: bool = True):
    adv = (returns - old_values) * mask
    return masked_whiten(adv, mask) if whiten_advantages else adv


@ppo.loss(agg="token-mean")
def policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, rollout_is_weights, clip_eps: float = 0.2,
                clip_ratio_c: float | None = None):
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped, clipped = ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    metrics = {"kl": old_logprobs - ref_logprobs, "clip_frac": (clipped < unclipped).float()}
    if clip_ratio_c is not None:  # dual clip (Ye et al., 2020): a negative advantage costs at most c·|Â|
        dual = torch.where(advantages < 0, torch.maximum(surrogate, clip_ratio_c * advantages), surrogate)
        surrogate, metrics["dual_clip_frac"] = dual, (dual > surrogate).float()
    return -surrogate * rollout_is_weights, metrics


@ppo.loss(model="critic", agg="token-mean")
def value_loss(values, old_values, returns, clip_value: float = 0.2):
    clipped = old_values + (values - old_values).clamp(-clip_value, clip_value)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return loss, {"value_loss": loss.detach(), "value_mean": values.detach()}


algorithm = ppo
