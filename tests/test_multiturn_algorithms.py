"""The algorithms on multi-turn trajectories, whose masks have gaps (the environment's tokens)."""
from __future__ import annotations

import torch

from rollplex.dags import ppo

T = torch.tensor


def test_gae_skips_the_environments_tokens():
    """Policy tokens at 0, 1 and 4, the environment's at 2 and 3 (values 9 there must not count):
    the estimates at 0, 1, 4 are those of the three tokens side by side, and 0 in the gap."""
    gapped_mask = T([[1.0, 1.0, 0.0, 0.0, 1.0]])
    rewards = T([[0.1, 0.0, 0.0, 0.0, 1.0]])
    values = T([[0.5, 0.6, 9.0, 9.0, 0.7]])
    got = ppo.gae(rewards, values, gapped_mask, gamma=0.9, lam=0.5)
    side_by_side = ppo.gae(T([[0.1, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=0.9, lam=0.5)
    assert torch.allclose(got[0, [0, 1, 4]], side_by_side[0])
    assert not got[0, 2:4].any()
    # δ2 = 1 − .7 = .3; δ1 = .9·.7 − .6 = .03; δ0 = .1 + .9·.6 − .5 = .14 → A = [.14 + .45·.165, .165, .3]
    assert torch.allclose(side_by_side, T([[0.14 + 0.45 * 0.165, 0.165, 0.3]]))


def test_the_reward_lands_on_the_last_policy_token():
    """A trajectory that ends with the environment's tokens (padding after it) gets its reward on its
    last sampled token, not at mask.sum() - 1 (which falls in the gap)."""
    mask = T([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    returns = ppo.gae_returns(rewards=T([1.0]), old_values=torch.zeros(1, 6), old_logprobs=torch.zeros(1, 6),
                              ref_logprobs=torch.zeros(1, 6), mask=mask, gamma=1.0, lam=1.0, kl_coef=0.0)
    assert torch.allclose(returns, T([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]]))
