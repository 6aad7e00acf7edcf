"""How a decode step projects: cuBLAS (``F.linear``), or engines/skinny_linear.py's Triton kernel.

The kernel is a torch custom op, so ``torch.compile`` keeps it as one call in the compiled decoder
layer and a CUDA graph captures it like any kernel. ``linear_for`` gives the layer its projection:
None (``F.linear``) or one that sends every projection of ≤ 64 rows with contiguous weight rows
through the kernel at one tiling, and anything else to ``F.linear``. Triton is imported on first
call only.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


@torch.library.custom_op("rollplex::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], block_n: int, block_k: int,
                     warps: int, stages: int) -> torch.Tensor:
    from rollplex.engines.skinny_linear import skinny_linear

    return skinny_linear(x.contiguous(), w, b, (block_n, block_k, warps, stages))


@skinny_linear_op.register_fake
def _(x, w, b, block_n, block_k, warps, stages):
    return x.new_empty(x.shape[0], w.shape[0])


def linear_for(tiling: tuple[int, int, int, int] | None):
    """The decode layer's projection: None for ``F.linear``, or the kernel at ``tiling``."""
    if tiling is None:
        return None

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > 64 or w.stride(-1) != 1:
            return F.linear(x, w, b)
        return skinny_linear_op(x, w, b, *tiling)

    return linear
