"""``x @ w.T (+ b)`` for a decode step's few rows, on CUDA: a Triton kernel that spreads the weight
over enough programs to keep HBM busy.

A decode step multiplies each weight by 8–64 rows, so its matmuls are weight reads. cuBLAS tiles
them for throughput: on an H200 the 3B model's q|k|v (10.5 MB) took 7.0 µs at 8 rows and o
(8.4 MB) 6.0 µs, where 4.3 TB/s reads them in 2.4 and 2.0 µs; down (45 MB) ran at 71% of it. Here
each program owns ``BLOCK_N`` output columns over one stretch of K, so even a 2048-column weight
makes about four programs per SM; with more than one stretch, a second kernel sums the stretches'
fp32 partials, adds the bias and casts.

``skinny_linear`` is a torch custom op, so ``torch.compile`` keeps it whole inside the compiled
decoder layer and CUDA graphs capture it. The decode engine uses it through its ``projections``
option; on CPU (or without Triton) the engine keeps ``F.linear``.
"""
from __future__ import annotations

import functools

import torch

# Output columns per program, K per inner iteration, warps and pipeline stages: module globals read
# at each call, so that `benchmarks/decode_profile.py --skinny-tiles` can time other settings.
BLOCK_N = 16
BLOCK_K = 256
NUM_WARPS = 4
NUM_STAGES = 4
MIN_PROGRAMS = 528  # four per SM on an H200 (132 SMs)
MAX_ROWS = 64  # more rows than this make the matmul compute-bound: cuBLAS's tiles are right there


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def splits_for(n_cols: int, k: int) -> int:
    """Stretches of K: enough programs to fill the GPU, none shorter than two inner iterations."""
    blocks = -(-n_cols // BLOCK_N)
    want = -(-MIN_PROGRAMS // blocks)
    return max(1, min(want, k // (2 * BLOCK_K)))


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_products(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, sx_m, sw_n, stretch,
                         M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                         ONE_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Columns [pid_n·BLOCK_N, +BLOCK_N) of x @ w.T over K in [split·stretch, +stretch): in fp32
        into out[split], or with one stretch the finished columns (bias added, cast) into out."""
        pid_n, split = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, M_PAD)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        start = split * stretch
        end = tl.minimum(start + stretch, K)
        acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
        for off in range(start, end, BLOCK_K):
            k = off + ks
            x = tl.load(x_ptr + rows[:, None] * sx_m + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < end),
                        other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * sw_n + k[:, None],
                        mask=(cols[None, :] < N) & (k[:, None] < end), other=0.0)
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        keep = (rows[:, None] < M) & (cols[None, :] < N)
        if ONE_SPLIT:
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
        else:
            tl.store(out_ptr + split * M * N + rows[:, None] * N + cols[None, :], acc, mask=keep)

    @triton.jit
    def sum_stretches(part_ptr, b_ptr, y_ptr, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
        """y = Σ_split part[split] (+ b), cast to y's dtype."""
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = at < M * N
        total = tl.zeros([BLOCK], tl.float32)
        for s in range(SPLITS):
            total += tl.load(part_ptr + s * M * N + at, mask=inside, other=0.0)
        if HAS_BIAS:
            total += tl.load(b_ptr + at % N, mask=inside, other=0.0).to(tl.float32)
        tl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=inside)

    return partial_products, sum_stretches


def usable(rows: int, weight: torch.Tensor) -> bool:
    """Few enough rows, and a weight whose K is contiguous (the kernel reads it by rows)."""
    return available() and rows <= MAX_ROWS and weight.dim() == 2 and weight.stride(1) == 1


@torch.library.custom_op("rollplex::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M ≤ 64), weight [N, K] with K contiguous, bias [N] or None → [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    splits = splits_for(n, k)
    stretch = -(-(-(-k // splits)) // BLOCK_K) * BLOCK_K  # whole inner iterations
    splits = -(-k // stretch)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else y  # not read without HAS_BIAS
    partial_products, sum_stretches = _kernels()
    partial_products[(-(-n // BLOCK_N), splits)](
        x, weight, b, part, m, n, k, x.stride(0), weight.stride(0), stretch,
        M_PAD=max(16, 1 << (m - 1).bit_length()), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32, ONE_SPLIT=splits == 1, HAS_BIAS=bias is not None,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if splits > 1:
        block = 1024
        sum_stretches[(-(-(m * n) // block),)](part, b, y, m, n, SPLITS=splits, HAS_BIAS=bias is not None,
                                               BLOCK=block)
    return y


@skinny_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0])
