"""The rollout–trainer mismatch: the decode engine samples from π_rollout, which another engine
(vLLM, other kernels, another precision) computes differently from the trainer's π_old at the same
weights. Per iteration the report logs how far the two are apart on the sampled tokens, and
``train.rollout_is: {cap: C}`` gives the policy's loss verl's truncated importance weights
min(π_old/π_rollout, C) (``rollout_is_weights``, detached) to multiply its policy-gradient term by.

With Δ = log π_old − log π_rollout per sampled token:
  ``rollout_logprob_diff``  mean |Δ|
  ``rollout_kl_k3``         mean e^Δ − 1 − Δ, the k3 estimate of KL(π_rollout‖π_old) on π_rollout's samples
"""
from __future__ import annotations

import math

import torch

from rollplex.engines import vlm
from rollplex.errors import EngineError

METRICS = ("rollout_logprob_diff", "rollout_kl_k3")


def sampled_logprobs(responses) -> torch.Tensor:
    """[G, R] like the group's mask: the decode engine's log-prob of each sampled token, 0 past a
    response's end."""
    out = torch.zeros(vlm.pad_responses(responses.token_ids, 0)[1].shape, dtype=torch.float32)
    for row, seq in enumerate(responses.sequences):
        if len(seq.logprobs) != len(seq.token_ids):
            raise EngineError(f"{seq.request_id} sample {seq.index}: the decode engine gave {len(seq.logprobs)} "
                              f"log-probs for {len(seq.token_ids)} tokens")
        out[row, : len(seq.logprobs)] = torch.tensor(seq.logprobs, dtype=torch.float32)
    return out


def rollout_is_weights(cap: float | None, old: torch.Tensor, responses: list) -> torch.Tensor:
    """min(π_old/π_rollout, cap) per token of the groups ``responses`` (``old`` their old log-probs,
    [B, R]); all 1 when ``cap`` is None. Exactly 1 where the two log-probs are equal (cap ≥ 1)."""
    if cap is None:
        return torch.ones_like(old)
    parts = [sampled_logprobs(r) for r in responses]
    width = old.shape[-1]
    rollout = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts]).to(old.device)
    return torch.exp(torch.clamp(old.detach().float() - rollout, max=math.log(cap))).to(old.dtype)


def mismatch_sums(old: torch.Tensor, sampled: torch.Tensor) -> dict[str, float]:
    """Σ|Δ| and Σ k3 over one response's tokens (1-D, its own length). In float64 with expm1: k3 ≈ Δ²/2
    is ~1e-13 for the differences kernels make, below float32's rounding of e^Δ − 1."""
    delta = old.double() - sampled.double()
    return {"rollout_logprob_diff": float(delta.abs().sum()), "rollout_kl_k3": float((torch.expm1(delta) - delta).sum())}
