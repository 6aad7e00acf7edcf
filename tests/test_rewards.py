"""Verifiable rewards and their registry (CPU, no model)."""
from __future__ import annotations

import pytest

from rollplex.errors import ConfigError
from rollplex.tasks import rewards
from rollplex.tasks.rewards import exact_match, get_reward, math_answer, register_reward


@pytest.mark.parametrize("text", ["red", "Red", "  RED \n", "red.", "red!", "Answer: red", "answer:red.",
                                  "ANSWER - Red", "The answer is red.", "**red**", '"red"', "**Red**."])
def test_exact_match_accepts_formatting_variants(text):
    assert exact_match(text, "red") == 1.0


@pytest.mark.parametrize("text", ["reddish", "red blue", "not red", "blue", "", "   ", "Answer:", "answers red"])
def test_exact_match_rejects_other_words(text):
    assert exact_match(text, "red") == 0.0


def test_exact_match_never_rewards_an_empty_response():
    assert exact_match("", "") == 0.0
    assert exact_match(".", "") == 0.0


@pytest.mark.parametrize("text, answer", [
    ("The result is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("so we get 3/4", "0.75"),
    ("total: 1,000 apples", "1000"),
    ("first 2, then 5", "5"),
    ("x = -3.0", "-3"),
    ("\\boxed{x + 1}", "x+1"),
    ("\\boxed{\\{1, 2\\}}", "\\boxed{\\{1,2\\}}"),  # nested braces; answer given boxed too
    ("\\boxed{7}", "$7$"),
])
def test_math_answer_matches(text, answer):
    assert math_answer(text, answer) == 1.0


@pytest.mark.parametrize("text, answer", [
    ("first 2, then 5", "2"),  # only the final number counts
    ("no numbers here", "3"),
    ("", "0"),
    ("\\boxed{41}", "42"),
    ("1,2", "12"),  # not a thousands separator
    ("\\boxed{}", ""),
])
def test_math_answer_rejects(text, answer):
    assert math_answer(text, answer) == 0.0


def test_registry_refuses_duplicates_and_lists_known_names(monkeypatch):
    monkeypatch.setattr(rewards, "_REWARDS", dict(rewards._REWARDS))
    assert get_reward("exact_match") is exact_match
    with pytest.raises(ConfigError, match="already registered"):
        register_reward("exact_match", lambda t, a: 0.0)

    @register_reward("always_one")
    def always_one(text, answer):
        return 1.0

    assert get_reward("always_one") is always_one
    with pytest.raises(ConfigError, match=r"unknown reward 'exact'.*'always_one'.*'exact_match'.*'math_answer'"):
        get_reward("exact")
    with pytest.raises(ConfigError, match="callable"):
        register_reward("not_a_fn", 3)
