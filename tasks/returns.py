"""What the algorithm's functions and the reward return, checked where a node takes it.

A loss that returned a float, or per-token values of the wrong shape, failed deep inside the loss
task's arithmetic with a traceback that named no function of the user's. These checks name the
function and where it is defined, and say what the node expected (``UserCodeError``; the worker
adds the node).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from rollplex.errors import UserCodeError, function_site


def _what(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__} {repr(value)[:60]}"


def loss_values(fn, result: Any, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(per-token values, metrics) from a loss function's result: values that broadcast to ``mask``'s
    [B, R] shape, optionally with a dict of metrics."""
    per_token, metrics = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
    expect = f"a loss returns per-token values shaped like mask {list(mask.shape)}, or (values, metrics dict)"
    if not isinstance(metrics, dict):
        raise UserCodeError(f"{function_site(fn)} returned metrics as {_what(metrics)}; {expect}")
    if not (torch.is_tensor(per_token) and per_token.is_floating_point()):
        raise UserCodeError(f"{function_site(fn)} returned {_what(per_token)}; {expect}")
    try:  # [B, R] or [B, 1]; a [B] would broadcast along the tokens when B == R
        fits = per_token.dim() == mask.dim() and torch.broadcast_shapes(per_token.shape, mask.shape) == mask.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise UserCodeError(f"{function_site(fn)} returned {_what(per_token)}; {expect}")
    return per_token, metrics


def advantage_tensor(fn, value: Any, leading: tuple[int, ...]) -> torch.Tensor:
    """An advantage function's result as a float tensor whose shape starts with ``leading`` (a group's
    [G] or a batch's [P, G]), with at most one more dimension (per token)."""
    expect = f"an advantage is a tensor of shape {list(leading)} (per response) or {list(leading) + ['R']} (per token)"
    try:
        adv = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise UserCodeError(f"{function_site(fn)} returned {_what(value)}; {expect}") from None
    if tuple(adv.shape[:len(leading)]) != leading or adv.dim() > len(leading) + 1:
        raise UserCodeError(f"{function_site(fn)} returned {_what(adv)}; {expect}")
    return adv


def reward_value(fn, value: Any) -> float:
    """A reward function's result as a finite float."""
    try:
        reward = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise UserCodeError(f"{function_site(fn)} returned {_what(value)}; a reward is a number") from None
    if not math.isfinite(reward):
        raise UserCodeError(f"{function_site(fn)} returned {reward}; a reward is a finite number")
    return reward
