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


@pytest.mark.parametrize("text, answer, expected", [
    # Hand-checked: what each response commits to, and whether it equals the answer.
    ("The answer is 3/4.", "0.75", 1.0),          # "answer is" phrase, fraction == decimal
    ("I count them: 2, 4, 6. So the answer is 12 apples", "12", 1.0),  # the number it starts with
    ("The answer is 12, not 3", "12", 1.0),        # the stated answer, not the last number
    ("Final answer: x + 1", "x+1", 1.0),           # symbolic: compared without spaces
    ("So the answer is $\\frac{1}{2}$.", "0.5", 1.0),
    ("answer: 0.50", "1/2", 1.0),
    ("Answer = -2", "-2.0", 1.0),
    ("The answer is 7. Wait, \\boxed{8}", "8", 1.0),  # a box outranks an earlier statement
    ("The answer is 3/4.", "3", 0.0),
    ("the answer is unclear, maybe 5", "5", 0.0),  # commits to a phrase, not to 5
])
def test_math_answer_reads_stated_answers(text, answer, expected):
    assert math_answer(text, answer) == expected


def test_reward_by_module_function_or_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def longer_is_better(text, answer):\n    return min(1.0, len(text) / 10)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_reward("my_rewards:longer_is_better")("abcde", "") == 0.5
    by_path = get_reward(f"{tmp_path / 'my_rewards.py'}:longer_is_better")
    assert by_path("a" * 20, "") == 1.0
    assert get_reward("rollplex.tasks.rewards:math_answer") is math_answer
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        get_reward("my_rewards:nope")
    with pytest.raises(ConfigError, match="importing no_such_module failed: ModuleNotFoundError"):
        get_reward("no_such_module:fn")
    with pytest.raises(ConfigError, match="missing.py does not exist"):
        get_reward(f"{tmp_path / 'missing.py'}:fn")
    with pytest.raises(ConfigError, match="expected module:function"):
        get_reward(":fn")
