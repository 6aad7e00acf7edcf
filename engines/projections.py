"""How a decode step projects: cuBLAS (``F.linear``), or engines/skinny_linear.py's Triton kernel.

The kernel is a torch custom op, so ``torch.compile`` keeps it as one call in the compiled decoder
layer and a CUDA graph captures it like any kernel. ``linear_for`` gives the layer its projection:
None (``F.linear``) or one that sends every projection of ≤ 64 rows with contiguous weight rows
through the kernel at the tiling ``choose(n, k)`` names for its weight's shape, and anything else
(or a shape it gives None) to ``F.linear``. Triton is imported on first call only.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F


@torch.library.custom_op("rollplex::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], block_n: int, block_k: int,
                     warps: int, stages: int, split_k: int) -> torch.Tensor:
    from rollplex.engines.skinny_linear import skinny_linear

    return skinny_linear(x.contiguous(), w, b, (block_n, block_k, warps, stages, split_k))


@skinny_linear_op.register_fake
def _(x, w, b, block_n, block_k, warps, stages, split_k):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("rollplex::skinny_norm_linear", mutates_args=())
def skinny_norm_linear_op(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          w: torch.Tensor, b: Optional[torch.Tensor], silu_mul: bool, block_n: int, block_k: int,
                          warps: int, stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    from rollplex.engines.skinny_linear import skinny_norm_linear

    return skinny_norm_linear(x.contiguous(), residual.contiguous(), norm_weight, eps, w, b, silu_mul,
                              (block_n, block_k, warps, stages, 1))


@skinny_norm_linear_op.register_fake
def _(x, residual, norm_weight, eps, w, b, silu_mul, block_n, block_k, warps, stages):
    return x.new_empty(x.shape[0], w.shape[0] // 2 if silu_mul else w.shape[0]), torch.empty_like(x)


Tiling = tuple[int, int, int, int, int]


def linear_for(choose: Callable[[int, int], Tiling | None] | None, norm: bool = False):
    """The decode layer's projection: None for ``F.linear`` everywhere, or the kernel at
    ``choose(out_features, in_features)``'s tiling, ``F.linear`` where that is None. With ``norm``
    the function also has ``norm_linear(x, residual, norm_weight, eps, w, b, silu_mul)``: the
    residual add and RMS norm ahead of q|k|v and gate|up (and gate|up's SiLU product) in the
    projection's launch, returning (projection, x + residual), or None where the shape goes to cuBLAS."""
    if choose is None:
        return None

    def tiling_of(x: torch.Tensor, w: torch.Tensor) -> Tiling | None:
        return choose(*w.shape) if x.dim() == 2 and x.shape[0] <= 64 and w.stride(-1) == 1 else None

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        tiling = tiling_of(x, w)
        if tiling is None:
            return F.linear(x, w, b)
        return skinny_linear_op(x, w, b, *tiling)

    def norm_linear(x, residual, norm_weight, eps: float, w, b, silu_mul: bool):
        tiling = tiling_of(x, w)
        if tiling is None:
            return None
        return skinny_norm_linear_op(x, residual, norm_weight, eps, w, b, silu_mul, *tiling[:4])

    if norm:
        linear.norm_linear = norm_linear
    return linear
