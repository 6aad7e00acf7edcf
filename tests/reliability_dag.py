"""GRPO whose reward varies with the sampled text, so that every iteration moves the tiny untrained
model's weights; ``nan_at`` makes the loss (or only its gradient) NaN at that loss call."""
import torch

from rollplex import Algorithm

algorithm = Algorithm("grpo_varied")
algorithm.policy("actor")
algorithm.frozen("ref", copy_of="actor")
algorithm.score("ref", as_="ref_logprobs")
algorithm.score("actor", as_="logprobs", grad=True)
CALLS = [0]


@algorithm.reward
def reward(text, answer):
    return float(len(text) % 3) / 2


@algorithm.advantage(scope="group")
def advantages(rewards, eps: float = 1e-6):
    return (rewards - rewards.mean()) / (rewards.std() + eps)


@algorithm.loss(agg="token-mean")
def policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, clip_eps: float = 0.2, kl_coef: float = 0.04,
                nan_at: int = -1, nan_in: str = "loss"):
    CALLS[0] += 1
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    log_ratio = ref_logprobs - logprobs
    kl = torch.exp(log_ratio) - log_ratio - 1
    loss = -(surrogate - kl_coef * kl)
    if CALLS[0] - 1 == nan_at:
        if nan_in == "loss":
            loss = loss * float("nan")
        else:  # a finite loss whose gradient is NaN: 0 * d/dx sqrt(x) at x = 0
            loss = loss + 0 * (logprobs - logprobs.detach()).sqrt()
    return loss, {"kl": kl}
