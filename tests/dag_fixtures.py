"""User DAG files that tests write to disk: each one is wrong in one named way."""

CYCLIC_DAG = '''\
"""Two nodes of the user's own, each reading what the other writes: a cycle.

    bonus_p ──writes bonus──▶ penalty_p
       ▲                          │
       └──────writes penalty──────┘
"""
from rollplex import Algorithm

algorithm = Algorithm("cyclic")
algorithm.policy("actor")
algorithm.score("actor", as_="logprobs", grad=True)


@algorithm.node(writes="bonus")
def bonus(rewards, penalty):
    return rewards - penalty


@algorithm.node(writes="penalty")
def penalty(bonus):
    return 0.1 * bonus


@algorithm.advantage(scope="group")
def advantages(rewards, bonus):
    return rewards + bonus


@algorithm.loss(agg="token-mean")
def policy_loss(logprobs, advantages):
    return -(logprobs * advantages.unsqueeze(-1))
'''

TWO_DEFAULTS_DAG = '''\
"""The advantage and the loss give one hyperparameter, kl_coef, different defaults."""
from rollplex import Algorithm

algorithm = Algorithm("two_defaults")
algorithm.policy("actor")
algorithm.frozen("ref", copy_of="actor")
algorithm.score("ref", as_="ref_logprobs")
algorithm.score("actor", as_="logprobs", grad=True)


@algorithm.advantage(scope="group")
def advantages(rewards, old_logprobs, ref_logprobs, kl_coef: float = 0.1):
    return rewards - kl_coef * (old_logprobs - ref_logprobs).sum(-1)


@algorithm.loss(agg="token-mean")
def policy_loss(logprobs, ref_logprobs, advantages, kl_coef: float = 0.01):
    return -(logprobs * advantages.unsqueeze(-1)) + kl_coef * (logprobs - ref_logprobs)
'''

TWO_LOSSES_DAG = '''\
"""Two losses for the policy: the second would silently replace the first."""
from rollplex import Algorithm

algorithm = Algorithm("two_losses")
algorithm.policy("actor")
algorithm.score("actor", as_="logprobs", grad=True)


@algorithm.advantage(scope="group")
def advantages(rewards):
    return rewards - rewards.mean()


@algorithm.loss(agg="token-mean")
def policy_loss(logprobs, advantages):
    return -(logprobs * advantages.unsqueeze(-1))


@algorithm.loss(agg="token-mean")
def entropy_bonus(logprobs):
    return logprobs.exp() * logprobs
'''
