"""Authoring refuses ambiguity: nothing in an algorithm is resolved by the order of its declarations.

Each case is refused with one line that names both sides (functions by name, file and line) and says
how to fix it; the first declaration stays as it was.
"""
from __future__ import annotations

import pytest

from rollplex import Algorithm
from rollplex.errors import GraphError


def refused(build) -> str:
    with pytest.raises(GraphError) as info:
        build()
    message = str(info.value)
    assert "\n" not in message and message.startswith("algorithm 't': "), message
    return message


def base() -> Algorithm:
    alg = Algorithm("t")
    alg.policy("actor")
    alg.score("actor", as_="logprobs", grad=True)
    return alg


def advantages(rewards):
    return rewards


def centred(rewards):
    return rewards - rewards.mean()


def policy_loss(logprobs, old_logprobs, advantages, kl_coef: float = 0.04):
    return -logprobs * advantages.unsqueeze(-1)


def reinforce(logprobs, advantages):
    return -logprobs * advantages.unsqueeze(-1)


def value_loss(values, advantages):
    return (values - advantages) ** 2


def here(fn) -> str:
    return f"{fn.__name__}() at test_authoring.py:{fn.__code__.co_firstlineno}"


# -- one of each -----------------------------------------------------------------------------------
def test_a_second_advantage_is_refused_naming_both():
    alg = base()
    alg.advantage(advantages)
    message = refused(lambda: alg.advantage(scope="batch")(centred))
    assert f"two advantage functions, {here(advantages)} and {here(centred)}" in message
    assert alg.advantage_fn.fn is advantages  # the first stays


def test_a_second_reward_is_refused_naming_both():
    def exact(text, answer):
        return float(text == answer)

    def partial(text, answer):
        return float(answer in text)

    alg = base()
    alg.reward(exact)
    assert f"two reward functions, {here(exact)} and {here(partial)}" in refused(lambda: alg.reward(partial))
    assert alg.reward_fn.fn is exact


@pytest.mark.parametrize("model", [None, "actor"])
def test_a_second_policy_loss_is_refused_naming_both_and_the_model(model):
    alg = base()
    alg.loss(policy_loss)
    message = refused(lambda: alg.loss(model=model)(reinforce))
    assert f"model 'actor' has two losses, {here(policy_loss)} and {here(reinforce)}" in message
    assert "keep one" in message
    assert alg.loss_fn.fn is policy_loss and alg.model_losses == {}


def test_a_policy_loss_declared_before_the_policy_is_its_loss_and_counts_as_one():
    alg = Algorithm("t")
    alg.loss(model="actor")(reinforce)
    alg.policy("actor")
    assert alg.loss_fn.fn is reinforce and alg.model_losses == {}
    alg.score("actor", as_="logprobs", grad=True)
    alg.advantage(advantages)
    assert alg.validate().losses() == {"actor": alg.loss_fn}

    alg = Algorithm("t")
    alg.loss(reinforce)  # the policy's, whichever it will be
    alg.loss(model="actor")(policy_loss)
    assert f"model 'actor' has two losses, {here(reinforce)} and {here(policy_loss)}" in refused(
        lambda: alg.policy("actor"))


def test_a_second_critic_loss_is_refused_naming_both_and_the_model():
    def clipped_value_loss(values, advantages):
        return (values - advantages) ** 2

    alg = base()
    alg.critic("critic", copy_of="actor")
    alg.loss(model="critic")(value_loss)
    message = refused(lambda: alg.loss(model="critic")(clipped_value_loss))
    assert f"model 'critic' has two losses, {here(value_loss)} and {here(clipped_value_loss)}" in message


def test_a_second_policy_is_refused_and_points_to_critic():
    alg = base()
    message = refused(lambda: alg.policy("actor2"))
    assert "two policies, 'actor' and 'actor2'" in message and "critic('actor2', ...)" in message
    assert alg.rollout_model == "actor" and list(alg.models) == ["actor"]


def test_a_model_declared_twice_is_refused():
    alg = base()
    alg.frozen("ref", copy_of="actor")
    assert "model 'ref' is declared twice" in refused(lambda: alg.critic("ref", copy_of="actor"))
