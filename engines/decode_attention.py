"""Split-KV decode attention on CUDA: one query token per row against that row's filled KV slots only.

The decode engine's cache is static, [rows, kv_heads, max_len, head_dim], so that a step's graph has
fixed shapes. SDPA under a length mask reads every slot of it: in the bench (prompts of 1088 tokens,
responses capped at 1024) most steps read 2112 slots per row where about 1100 are filled, and
cuDNN's kernel for it is a prefill kernel (one query row per sequence; 27 µs per layer at 64 rows
on an H200, a quarter of the step). Here each program reads one row's kv head over one stretch of
slots (flash-decoding: the stretches run in parallel, so a few long rows still fill the GPU) and
stops at the row's length; a second pass merges the stretches by their log-sum-exp. The grid is
fixed by the shapes, so the kernel is captured in CUDA graphs like the rest of the step.

``split_kv_attention`` is a torch custom op: ``torch.compile`` keeps it whole inside the compiled
decoder layer. On CPU, or without Triton, the engine keeps SDPA (``available``).
"""
from __future__ import annotations

import functools

import torch

# Slots per inner iteration, and warps per program: read at each call, so that
# `benchmarks/decode_profile.py --split-kv-tiles` can time other settings.
BLOCK = 64
NUM_WARPS = 4
MIN_PROGRAMS = 512  # about four per SM on an H200: enough stretches that a small batch fills it


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def usable(head_dim: int, group: int) -> bool:
    """tl.dot wants power-of-two widths of at least 16: the head width, and the query heads of one kv
    head padded up to 16."""
    return available() and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and group <= 128


def splits_for(rows: int, kv_heads: int, max_len: int) -> int:
    """Stretches per (row, kv head): enough programs to fill the GPU, none shorter than a block."""
    want = -(-MIN_PROGRAMS // max(1, rows * kv_heads))
    return max(1, min(want, -(-max_len // BLOCK)))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_attention(q_ptr, k_ptr, v_ptr, len_ptr, acc_ptr, m_ptr, l_ptr,
                          sq_n, sq_h, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, scale, stretch,
                          GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                          SPLITS: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * its cache stride passes 2**31 in large caches
        kvh, split = tl.program_id(1), tl.program_id(2)
        length = tl.load(len_ptr + row)
        start = split * stretch
        end = tl.minimum(start + stretch, length)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + row * sq_n + heads[:, None] * sq_h + d[None, :], mask=g[:, None] < GROUP, other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for off in range(start, end, BLOCK):
            pos = off + tl.arange(0, BLOCK)
            valid = pos < end
            k = tl.load(k_ptr + row * sk_n + kvh * sk_h + pos[:, None] * sk_l + d[None, :], mask=valid[:, None],
                        other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + row * sv_n + kvh * sv_h + pos[:, None] * sv_l + d[None, :], mask=valid[:, None],
                        other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        base = (row * (tl.num_programs(1) * GROUP) + heads) * SPLITS + split
        keep = g < GROUP
        tl.store(acc_ptr + base[:, None] * D + d[None, :], acc, mask=keep[:, None])
        tl.store(m_ptr + base, m, mask=keep)
        tl.store(l_ptr + base, total, mask=keep)

    @triton.jit
    def merge_stretches(acc_ptr, m_ptr, l_ptr, out_ptr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                        D: tl.constexpr):
        """One (row, head): its stretches' sums rescaled to their common maximum, then normalised. A
        stretch past the row's length holds m = -inf and weighs nothing."""
        at = tl.program_id(0).to(tl.int64)  # row * heads + head
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, D)
        inside = s < SPLITS
        m = tl.load(m_ptr + at * SPLITS + s, mask=inside, other=float("-inf"))
        total = tl.load(l_ptr + at * SPLITS + s, mask=inside, other=0.0)
        weight = tl.exp(m - tl.max(m, 0))
        acc = tl.load(acc_ptr + (at * SPLITS + s)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
        tl.store(out_ptr + at * D + d, out.to(out_ptr.dtype.element_ty))

    return partial_attention, merge_stretches


@torch.library.custom_op("rollplex::split_kv_attention", mutates_args=())
def split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [n, heads, head_dim]; k_cache, v_cache [n, kv_heads, max_len, head_dim] (last dim contiguous);
    lengths [n] int32, each row's filled slots (this step's included). Returns [n, heads, head_dim]."""
    n, heads, dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    splits = splits_for(n, kv_heads, max_len)
    per_split = -(-max_len // splits)
    stretch = -(-per_split // BLOCK) * BLOCK  # whole blocks
    acc = torch.empty(n, heads, splits, dim, dtype=torch.float32, device=q.device)
    m = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    q = q.contiguous()
    partial_attention, merge_stretches = _kernel()
    partial_attention[(n, kv_heads, splits)](
        q, k_cache, v_cache, lengths, acc, m, total,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale, stretch,
        GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), D=dim, SPLITS=splits, BLOCK=BLOCK,
        IEEE=q.dtype == torch.float32, num_warps=NUM_WARPS)
    out = torch.empty_like(q)
    merge_stretches[(n * heads,)](acc, m, total, out, SPLITS=splits, SPLITS_PAD=max(2, 1 << (splits - 1).bit_length()),
                                  D=dim)
    return out


@split_kv_attention.register_fake
def _(q, k_cache, v_cache, lengths, scale):
    return torch.empty_like(q)
