"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al., 2019; Ahmadian et al., 2024).

Each of the G responses of a prompt is baselined by the mean reward of the other G − 1:
Â_i = r_i − (Σ_{j≠i} r_j)/(G − 1) = G/(G − 1)·(r_i − r̄). No critic and no std normalisation. The
loss is REINFORCE on the whole response, −Â_i·Σ_t log π(y_t), averaged over responses; the ratio
π/π_old (exactly 1 at an iteration's first optimizer step) carries the gradient, and at the later
steps of ``train.mini_batches``/``train.epochs`` weights it, unclipped.
"""
import torch

from rollplex import Algorithm

rloo = Algorithm("rloo", doc=__doc__)
rloo.policy("actor")
rloo.score("actor", as_="logprobs", grad=True)  # also yields old_logprobs


@rloo.advantage(scope="group")
def advantages(rewards):
    G = rewards.shape[0]
    baseline = (rewards.sum() - rewards) / max(G - 1, 1)
    return rewards - baseline


@rloo.loss(agg="seq-mean-token-sum")
def policy_loss(logprobs, old_logprobs, advantages, rollout_is_weights):
    ratio = torch.exp(logprobs - old_logprobs)
    return -ratio * advantages.unsqueeze(-1) * rollout_is_weights, {"logprob": old_logprobs}


algorithm = rloo
