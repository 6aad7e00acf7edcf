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
