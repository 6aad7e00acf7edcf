"""A decode step's projections as one Triton kernel: ``y = x @ w.T (+ b)`` for a few rows of x.

At 8 decode rows cuBLAS ran the 3B layer's small projections (q|k|v, o) at 42–46% of the H100's HBM
bandwidth and the MLP's at 67–74% (BENCHMARKS.md, dk8): at so few rows a projection is a pass over
its weights, and a grid sized for a square matmul leaves SMs idle or waits on a split-K reduction.
``skinny_linear`` gives each program ``block_n`` output columns for every row, streams their weight
rows once along K in ``block_k`` tiles (the rows padded to 16, the smallest ``tl.dot``), and writes
the result with the bias added: one launch. Where the output has too few columns to give every SM a
program (the 3B layer's o and down projections: 2,048 columns, 64 programs of 32), ``split_k`` > 1
cuts K into that many stretches, each program writes an fp32 partial, and a second launch sums them
and adds the bias. ``skinny_norm_linear`` also takes the layer's residual add and RMS norm ahead of
q|k|v and gate|up into the launch (and gate|up's SiLU product into its end). ``CONFIGS`` are the
tilings a GPU benchmark sweeps against cuBLAS per shape (``benchmarks/decode_linear.py``); the
decode step calls the kernels only with the torch-graph engine's ``linear: skinny`` or
``skinny-norm`` (engines/projections.py), off by default until that benchmark shows where they win.

Only callers import this module: it needs Triton, which CPU installs may lack. On the CPU the tests
run it through Triton's interpreter (fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (block_n, block_k, num_warps, num_stages, split_k) a benchmark may try; the first is the default.
CONFIGS = ((32, 128, 4, 4, 1), (16, 128, 4, 4, 1), (16, 256, 4, 3, 1), (32, 256, 4, 3, 1), (64, 128, 4, 4, 1),
           (64, 64, 4, 5, 1), (16, 512, 8, 3, 1), (32, 64, 2, 5, 1), (32, 128, 4, 4, 2), (32, 128, 4, 4, 4),
           (16, 256, 4, 3, 4), (64, 128, 4, 4, 4), (32, 256, 4, 3, 8))

# The tiling per weight shape (out features, in features) that benchmarks/decode_linear.py measured
# fastest summed over 8 and 64 rows, None where cuBLAS's sum was less; a shape not measured gets
# CONFIGS[0].
TILINGS: dict[tuple[int, int], tuple[int, int, int, int, int] | None] = {}


def tiling_for(n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """The kernel's tiling for a [n, k] weight, or None where cuBLAS projects it faster."""
    return TILINGS.get((n, k), CONFIGS[0])


@triton.jit
def _dot(a, b_t, IEEE: tl.constexpr):
    """a @ b_t.T, fp32 accumulate; IEEE for fp32 inputs (tf32 would lose the precision the fp32 tests check)."""
    if IEEE:
        out = tl.dot(a, tl.trans(b_t), input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(b_t))
    return out


@triton.jit
def _skinny_linear(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, K_PER, stride_xm, stride_wn, stride_ym, stride_ys,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
    """Columns ``program_id(0)``'s block over K stretch ``program_id(1)`` (K_PER long, a multiple of
    BLOCK_K): into y itself, bias added, when there is one stretch; else its fp32 partial at row
    ``program_id(1)`` of a [split, M, N] buffer (stride_ys apart), the bias left to the sum."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * K_PER
    k_end = tl.minimum(k_start + K_PER, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < k_end), other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                    mask=(cols[:, None] < N) & (ks[None, :] < k_end), other=0.0)
        acc += _dot(x, w, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + tl.program_id(1) * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sum_split(p_ptr, b_ptr, y_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = the SPLIT fp32 partials [SPLIT, M, N] summed, plus the bias, in y's dtype."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + s * MN + i, mask=i < MN, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=i < MN, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=i < MN)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                  config: tuple[int, int, int, int, int] = CONFIGS[0]) -> torch.Tensor:
    """``F.linear(x, w, b)`` for x [M, K] with M ≤ 64 rows (contiguous rows), w [N, K] contiguous."""
    m, k = x.shape
    n = w.shape[0]
    if m > 64 or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} (≤ 64 rows, contiguous rows), w {tuple(w.shape)}")
    block_n, block_k, warps, stages, split = config
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per)  # no empty stretch
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    _skinny_linear[(triton.cdiv(n, block_n), split)](
        x, w, b if b is not None else w, out, m, n, k, k_per, x.stride(0), w.stride(0), n, m * n,
        HAS_BIAS=b is not None and split == 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    if split > 1:
        _sum_split[(triton.cdiv(m * n, 1024),)](out, b if b is not None else w, y, m * n, n, SPLIT=split,
                                                HAS_BIAS=b is not None, BLOCK=1024)
    return y


@triton.jit
def _residual_sum(x_ptr, r_ptr, rows, ks, inside, stride_xm, stride_rm):
    """x + r over a [rows, ks] tile, rounded as x's dtype rounds it."""
    s = (tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=inside, other=0.0).to(tl.float32)
         + tl.load(r_ptr + rows[:, None] * stride_rm + ks[None, :], mask=inside, other=0.0).to(tl.float32))
    return s.to(x_ptr.dtype.element_ty)


@triton.jit
def _skinny_norm_linear(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, y_ptr, s_ptr, M, N, K, eps, stride_xm, stride_rm,
                        stride_wn, stride_ym, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """The decoder layer's residual add and RMS norm ahead of a projection, in the projection's
    launch: s = x + r (rounded as the dtype rounds it; program 0 writes it out), h = norm(s) * g with
    the eager path's roundings, y = h @ w.T (+ b). With SILU_MUL, w is gate|up ([2N, K]) and
    y = silu(gate) * up, each rounded as the eager path rounds it. A first pass over K sums the
    squares; x and r are a few rows, so both passes read them from L2."""
    rows = tl.arange(0, BLOCK_M)
    pid = tl.program_id(0)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        inside = (rows[:, None] < M) & (ks[None, :] < K)
        s = _residual_sum(x_ptr, r_ptr, rows, ks, inside, stride_xm, stride_rm).to(tl.float32)
        squares += tl.sum(s * s, axis=1)
    rstd = 1.0 / tl.sqrt(squares / K + eps)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        inside = (rows[:, None] < M) & (ks[None, :] < K)
        s = _residual_sum(x_ptr, r_ptr, rows, ks, inside, stride_xm, stride_rm)
        if pid == 0:
            tl.store(s_ptr + rows[:, None] * K + ks[None, :], s, mask=inside)
        g = tl.load(g_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        h = ((s.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * g[None, :])
        h = h.to(x_ptr.dtype.element_ty)
        wmask = (cols[:, None] < N) & (ks[None, :] < K)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=wmask, other=0.0)
        acc += _dot(h, w, IEEE)
        if SILU_MUL:
            up = tl.load(w_ptr + (cols[:, None] + N) * stride_wn + ks[None, :], mask=wmask, other=0.0)
            acc_up += _dot(h, up, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
        acc = act * acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       w: torch.Tensor, b: torch.Tensor | None = None, silu_mul: bool = False,
                       config: tuple[int, int, int, int, int] = CONFIGS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """(projection, s) of s = x + residual: ``F.linear(rms_norm(s) * norm_weight, w, b)``, or with
    ``silu_mul`` (w gate|up stacked) ``silu(gate) * up``. x, residual [M ≤ 64, K] with contiguous
    rows; the tiling's split_k is not used (the norm needs all of K)."""
    m, k = x.shape
    if m > 64 or residual.shape != x.shape or w.shape[1] != k or x.stride(1) != 1 or residual.stride(1) != 1 \
            or w.stride(1) != 1 or (silu_mul and w.shape[0] % 2):
        raise ValueError(f"skinny_norm_linear: x {tuple(x.shape)}, residual {tuple(residual.shape)}, "
                         f"w {tuple(w.shape)}")
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    block_n, block_k, warps, stages, _ = config
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    s = torch.empty(m, k, dtype=x.dtype, device=x.device)
    _skinny_norm_linear[(triton.cdiv(n, block_n),)](
        x, residual, norm_weight, w, b if b is not None else w, y, s, m, n, k, eps, x.stride(0),
        residual.stride(0), w.stride(0), n, HAS_BIAS=b is not None, SILU_MUL=silu_mul,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return y, s
