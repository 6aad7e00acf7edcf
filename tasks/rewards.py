"""Verifiable rewards: ``fn(text, answer) -> float`` in [0, 1], looked up by name.

A reward reads only the decoded response and the dataset's answer, so it is a pure function that
any worker can run. New rewards join the registry with ``register_reward``; a name is never
silently replaced, so a typo in a config cannot pick up some other reward.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable

from rollplex.errors import ConfigError

RewardFn = Callable[[str, str], float]

_REWARDS: dict[str, RewardFn] = {}

# "Answer: red", "answer - red", "The answer is red": the model may echo the question's wording.
_ANSWER_PREFIX = re.compile(r"^\s*(?:the\s+)?answer\b\s*(?:is\b|[:\-=])?\s*", re.IGNORECASE)
_EDGE_JUNK = " \t\r\n\"'`*_"  # quotes and markdown emphasis around a word carry no meaning
_TRAILING_PUNCT = ".,;:!?"


def normalize_answer(text: str) -> str:
    """Lower-case, drop an "Answer:" prefix, surrounding quotes/emphasis and trailing punctuation."""
    out = _ANSWER_PREFIX.sub("", text.strip(_EDGE_JUNK), count=1)
    prev = None
    while prev != out:  # "**red**." needs punctuation and emphasis stripped in turn
        prev = out
        out = out.strip(_EDGE_JUNK).rstrip(_TRAILING_PUNCT)
    return out.lower()


def exact_match(text: str, answer: str) -> float:
    """1.0 when the response is the answer, up to case, whitespace, trailing punctuation and an
    "Answer:" prefix. An empty response never matches, even an empty answer."""
    got = normalize_answer(text)
    return float(bool(got) and got == normalize_answer(answer))


# Thousands separators only in groups of three, so "1,2" reads as two numbers, not 12.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}``, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


def _parse_number(text: str) -> Fraction | None:
    """Exact value of "1,000", "-2.5", "3/4" or "\\frac{3}{4}"; None for anything else."""
    s = _LATEX_FRAC.sub(r"(\1)/(\2)", text).replace("$", "").replace(",", "").replace(" ", "")
    s = s.replace("(", "").replace(")", "").rstrip(".")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


# "the answer is 3/4.", "Final answer: x+1": the rest of that line is the committed answer.
_ANSWER_IS = re.compile(r"answer\s*(?:is\b|[:=])\s*:?\s*([^\n]+)", re.IGNORECASE)


def extract_math_answer(text: str) -> str | None:
    """The final answer a response commits to: its last ``\\boxed{}``, else what follows its last
    "answer is"/"answer:" (the number it starts with, when it starts with one), else its last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    stated = _ANSWER_IS.findall(text)
    if stated:
        phrase = stated[-1].strip().rstrip(".").strip()
        if phrase and _parse_number(phrase) is None:
            lead = _NUMBER.match(phrase.replace("$", ""))
            phrase = lead.group(0) if lead else phrase
        if phrase:
            return phrase
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def math_answer(text: str, answer: str) -> float:
    """1.0 when the response's final answer equals ``answer``: numerically when both parse as
    numbers (so "0.5" == "1/2" == "\\frac{1}{2}"), else as whitespace-free strings."""
    got = extract_math_answer(text)
    if got is None:
        return 0.0
    want = extract_math_answer(answer) if _last_boxed(answer) is not None else answer.strip()
    a, b = _parse_number(got), _parse_number(want or "")
    if a is not None and b is not None:
        return float(a == b)
    squash = lambda s: re.sub(r"\s+", "", s).rstrip(".")  # noqa: E731
    return float(bool(squash(got)) and squash(got) == squash(want or ""))


def register_reward(name: str, fn: RewardFn | None = None):
    """Add ``fn`` under ``name``; usable as ``@register_reward("name")``. Refuses duplicates."""
    if fn is None:
        return lambda f: register_reward(name, f)
    if not callable(fn):
        raise ConfigError(f"reward {name!r}: expected a callable fn(text, answer) -> float, got {type(fn).__name__}")
    if name in _REWARDS:
        raise ConfigError(f"reward {name!r} is already registered ({_REWARDS[name].__qualname__}); pick another name")
    _REWARDS[name] = fn
    return fn


def get_reward(name: str) -> RewardFn:
    """A registered reward by name, or a function of your own as ``module:function`` (importable in the
    driver and the workers) or ``path/to/file.py:function``."""
    if name in _REWARDS:
        return _REWARDS[name]
    if ":" in name:
        return _import_reward(name)
    raise ConfigError(f"unknown reward {name!r}; known rewards: {sorted(_REWARDS)} (or give module:function)")


def _import_reward(ref: str) -> RewardFn:
    import hashlib
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    where, _, attr = ref.rpartition(":")
    if not where or not attr.isidentifier():
        raise ConfigError(f"reward {ref!r}: expected module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.exists():
                raise ConfigError(f"reward {ref!r}: {path} does not exist")
            if not path.is_file():
                raise ConfigError(f"reward {ref!r}: {path} is a directory, not a Python file")
            key = "rollplex_user_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
            module = sys.modules.get(key)
            if module is None:
                spec = importlib.util.spec_from_file_location(key, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules[key] = module
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: one line naming the reward
        raise ConfigError(f"reward {ref!r}: importing {where} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward {ref!r}: {where} has no function {attr!r}")
    return fn


def reward_names() -> list[str]:
    return sorted(_REWARDS)


register_reward("exact_match", exact_match)
register_reward("math_answer", math_answer)
