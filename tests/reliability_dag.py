"""GRPO whose reward varies with the sampled text, so that every iteration moves the tiny untrained
model's weights. ``ROLLPLEX_TEST_NAN_AT=N`` makes the loss (or, with ``ROLLPLEX_TEST_NAN_IN=grad``,
only its gradient) NaN at its call N, counting from 0: from the environment, not params, so that a
resume without the fault keeps the run's config."""
import os

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
def policy_loss(logprobs, old_logprobs, ref_logprobs, advantages, clip_eps: float = 0.2, kl_coef: float = 0.04):
    CALLS[0] += 1
    nan_at, nan_in = int(os.environ.get("ROLLPLEX_TEST_NAN_AT", -1)), os.environ.get("ROLLPLEX_TEST_NAN_IN", "loss")
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
