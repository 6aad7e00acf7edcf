"""A decode step's projections as one Triton kernel: ``y = x @ w.T (+ b)`` for a few rows of x.

At 8 decode rows cuBLAS ran the 3B layer's small projections (q|k|v, o) at 42–46% of the H100's HBM
bandwidth and the MLP's at 67–74% (BENCHMARKS.md, dk8): at so few rows a projection is a pass over
its weights, and a grid sized for a square matmul leaves SMs idle or waits on a split-K reduction.
``skinny_linear`` gives each program ``block_n`` output columns for every row, streams their weight
rows once along K in ``block_k`` tiles (the rows padded to 16, the smallest ``tl.dot``), and writes
the result with the bias added: one launch, no reduction pass. ``CONFIGS`` are the tilings a GPU
benchmark sweeps against cuBLAS per shape (``benchmarks/decode_linear.py``); the decode step calls
it only with the torch-graph engine's ``linear: skinny`` (engines/projections.py), off by default
until that benchmark shows where it wins.

Only callers import this module: it needs Triton, which CPU installs may lack. On the CPU the tests
run it through Triton's interpreter (fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (block_n, block_k, num_warps, num_stages) a benchmark may try; the first is the default.
CONFIGS = ((32, 128, 4, 4), (16, 128, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3), (64, 128, 4, 4),
           (64, 64, 4, 5), (16, 512, 8, 3), (32, 64, 2, 5))


@triton.jit
def _skinny_linear(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                    other=0.0)
        if IEEE:  # fp32 inputs: tf32 would lose the precision the fp32 tests check
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] = CONFIGS[0]) -> torch.Tensor:
    """``F.linear(x, w, b)`` for x [M, K] with M ≤ 64 rows (contiguous rows), w [N, K] contiguous."""
    m, k = x.shape
    n = w.shape[0]
    if m > 64 or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} (≤ 64 rows, contiguous rows), w {tuple(w.shape)}")
    block_n, block_k, warps, stages = config
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    _skinny_linear[(triton.cdiv(n, block_n),)](
        x, w, b if b is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=b is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return y
