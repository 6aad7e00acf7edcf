"""Authoring refuses ambiguity: nothing in an algorithm is resolved by the order of its declarations.

Each case is refused with one line that names both sides (functions by name, file and line) and says
how to fix it; the first declaration stays as it was.
"""
from __future__ import annotations

import pytest
import torch

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


# -- hyperparameters ---------------------------------------------------------------------------------
def test_two_defaults_for_one_hyperparameter_are_refused_naming_both():
    def kl_shaped(rewards, kl_coef: float = 0.1):
        return rewards

    alg = base()
    alg.loss(policy_loss)
    message = refused(lambda: alg.advantage(kl_shaped))
    assert (f"hyperparameter 'kl_coef' has two defaults, 0.04 in {here(policy_loss)} and 0.1 in "
            f"{here(kl_shaped)}") in message
    assert "params.kl_coef" in message and "same default" in message
    assert alg.advantage_fn is None


def scaled_reward(text, answer, tau: float = 1.0):
    return tau * float(text == answer)


def scaled_advantages(rewards, tau: float = 1.0):
    return tau * rewards


def scaled_loss(logprobs, advantages, tau: float = 1.0):
    return -tau * logprobs * advantages.unsqueeze(-1)


def scaled_value_loss(values, advantages, tau: float = 1.0):
    return tau * (values - advantages) ** 2


def scaled(rewards, tau: float = 1.0):
    return tau * rewards


SECOND = {  # every way a function registers: each checks the defaults before it
    "reward": (lambda alg, fn: alg.reward(fn), scaled_reward),
    "advantage": (lambda alg, fn: alg.advantage(fn), scaled_advantages),
    "loss": (lambda alg, fn: alg.loss(fn), scaled_loss),
    "critic loss": (lambda alg, fn: alg.loss(model="critic")(fn), scaled_value_loss),
    "node": (lambda alg, fn: alg.node(fn, writes="scaled"), scaled),
}


@pytest.mark.parametrize("second", list(SECOND))
def test_two_defaults_are_refused_whichever_function_registers_second(second):
    def smooth(rewards, tau: float = 0.5):
        return rewards

    alg = base()
    alg.critic("critic", copy_of="actor")
    alg.node(smooth, writes="smoothed")
    register, fn = SECOND[second]
    message = refused(lambda: register(alg, fn))
    assert f"hyperparameter 'tau' has two defaults, 0.5 in {here(smooth)} and 1.0 in {here(fn)}" in message
    assert alg.hyperparameters() == {"tau": 0.5}  # the first stays


def test_one_default_in_two_functions_is_one_hyperparameter():
    seen = {}

    def kl_shaped(rewards, kl_coef: float = 0.04):
        seen["advantage"] = kl_coef
        return rewards

    def kl_loss(logprobs, advantages, kl_coef: float = 0.04):
        seen["loss"] = kl_coef
        return -logprobs * advantages.unsqueeze(-1)

    alg = base()
    alg.advantage(kl_shaped)
    alg.loss(kl_loss)
    assert alg.validate().hyperparameters() == {"kl_coef": 0.04}
    ones = torch.ones(1)
    alg.advantage_fn.call({"rewards": ones}, {"kl_coef": 0.5})  # params.kl_coef=0.5 reaches both
    alg.loss_fn.call({"logprobs": ones, "advantages": ones}, {"kl_coef": 0.5})
    assert seen == {"advantage": 0.5, "loss": 0.5}


def test_defaults_that_cannot_be_compared_count_as_two():
    def a(rewards, weights=torch.tensor([1.0, 2.0])):
        return rewards

    def b(rewards, weights=torch.tensor([1.0, 2.0])):
        return rewards

    alg = base()
    alg.node(a, writes="x")
    assert "hyperparameter 'weights' has two defaults" in refused(lambda: alg.node(b, writes="y"))


# -- values and nodes --------------------------------------------------------------------------------
def test_a_node_writing_what_a_later_score_writes_is_refused():
    def bonus(rewards):
        return rewards

    alg = Algorithm("t")
    alg.policy("actor")
    alg.node(bonus, writes="logprobs")
    message = refused(lambda: alg.score("actor", as_="logprobs", grad=True))
    assert (f"value 'logprobs' is written by node {here(bonus)} and by "
            "score('actor', as_='logprobs', grad=True)") in message


def test_a_score_named_like_another_scores_old_values_is_refused():
    alg = base()
    alg.frozen("ref", copy_of="actor")
    message = refused(lambda: alg.score("ref", as_="old_logprobs"))
    assert ("value 'old_logprobs' is written by score('actor', as_='logprobs', grad=True) and by "
            "score('ref', as_='old_logprobs')") in message
    alg = Algorithm("t")
    alg.policy("actor")
    alg.score("actor", as_="old_logprobs")
    assert "value 'old_logprobs' is written by score('actor', as_='old_logprobs')" in refused(
        lambda: alg.score("actor", as_="logprobs", grad=True))


def test_a_score_or_a_node_may_not_write_a_runtime_value():
    def reshaped(rewards):
        return rewards

    alg = base()
    alg.frozen("ref", copy_of="actor")
    message = refused(lambda: alg.score("ref", as_="rewards"))
    assert "value 'rewards' is written by the runtime and by score('ref', as_='rewards')" in message
    assert "give score('ref', as_='rewards') another name" in message
    assert "value 'mask' is written by the runtime" in refused(lambda: alg.node(reshaped, writes="mask"))


def test_two_nodes_writing_one_value_are_refused_naming_both():
    def bonus(rewards):
        return rewards

    def bonus2(rewards):
        return -rewards

    alg = base()
    alg.node(bonus, writes="bonus")
    message = refused(lambda: alg.node(bonus2, writes="bonus", per="batch"))
    assert f"value 'bonus' is written by node {here(bonus)} and by node {here(bonus2)}" in message


def test_two_nodes_of_one_function_name_are_refused():
    def bonus(rewards):
        return rewards

    alg = base()
    alg.node(bonus, writes="b1")
    message = refused(lambda: alg.node(bonus, writes="b2"))
    assert f"two nodes are named 'bonus', {here(bonus)} writing 'b1' and {here(bonus)} writing 'b2'" in message


def test_a_hyperparameter_named_like_a_value_is_refused_at_validate():
    def weighted(logprobs, advantages, rewards=0.0):  # would never receive the rewards
        return -logprobs * advantages.unsqueeze(-1)

    alg = base()
    alg.advantage(advantages)
    alg.loss(weighted)
    message = refused(alg.validate)
    assert f"{here(weighted)} parameter 'rewards' has a default" in message and "the runtime writes it" in message

    def kl(rewards):
        return rewards

    alg = base()
    alg.node(kl, writes="kl_coef")
    alg.advantage(advantages)
    alg.loss(policy_loss)
    assert (f"{here(policy_loss)} parameter 'kl_coef' has a default, so it is a hyperparameter, but 'kl_coef' "
            f"is also a value (node {here(kl)} writes it)") in refused(alg.validate)


@pytest.mark.parametrize("min_samples", [0, 1.5, "2"])
def test_an_advantage_min_samples_must_be_a_positive_integer(min_samples):
    alg = Algorithm("g")
    with pytest.raises(GraphError, match=r"advantage min_samples=.*expected an integer of at least 1"):
        alg.advantage(lambda rewards: rewards, min_samples=min_samples)
