"""Split-KV decode attention on CUDA: one query token per row against that row's filled KV slots only.

The decode engine's cache is static, [rows, kv_heads, max_len, head_dim], so that a step's graph has
fixed shapes. SDPA under a length mask reads every slot of it: in the bench (prompts of 1088 tokens,
responses capped at 1024) most steps read 2112 slots per row where about 1100 are filled, and
cuDNN's kernel for it is a prefill kernel (one query row per sequence; 27 µs per layer at 64 rows
on an H200, a quarter of the step). Here each program reads one row's kv head over one stretch of
slots (flash-decoding: the stretches run in parallel, so a few long rows still fill the GPU) and
stops at the row's length; a second pass merges the stretches by their log-sum-exp. The grid is
fixed by the shapes, so the kernel is captured in CUDA graphs like the rest of the step.

``shared_prefix_attention`` is the same with a group's prompt KV held once (cascade attention, as
in Hydragen and FlashInfer's cascade kernels): a prefix program reads a stretch of one prompt's KV
for the queries of all of its live rows at once, so each step reads the prompt's KV once per group
instead of once per row, and the rows' own caches hold their responses only. Its stretches and the
rows' own stretches are merged by the same log-sum-exp pass. ``shared_prefix_attention_sdpa`` is
the reference (and the path on CPU): the row's prompt KV gathered before its own, under one mask.
One program per row reading its prompt slot (the group's repeats left to L2) was slower on an H200
at 8 and 64 rows (3B: 3.33 and 4.37 ms a step, against 3.18 and 4.06 with the prompt copied per row
and 3.44 and 3.84 by group tiles; 2026-12-02).

Both are torch custom ops: ``torch.compile`` keeps them whole inside the compiled decoder layer. On
CPU, or without Triton, the engine keeps SDPA (``available``).
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


def usable(head_dim: int, group: int, shared_prefix: bool = False) -> bool:
    """tl.dot wants power-of-two widths of at least 16: the head width, and the query heads of one kv
    head padded up to 16 (a prefix tile: PREFIX_MEMBERS rows' padded heads, at least 16)."""
    tile = PREFIX_MEMBERS * (1 << (group - 1).bit_length())
    return (available() and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and group <= 128
            and (not shared_prefix or 16 <= tile <= 256))


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
                          SPLITS: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
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
        base = (row * (tl.num_programs(1) * GROUP) + heads) * SPLITS + FIRST + split
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

    @triton.jit
    def prefix_partial_attention(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, members_ptr, acc_ptr, m_ptr, l_ptr,
                                 sq_n, sq_h, sk_s, sk_h, sk_l, sv_s, sv_h, sv_l, scale, stretch, heads_total,
                                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MEMBERS: tl.constexpr,
                                 D: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
        """One entry (a prompt's KV slot and up to MEMBERS of its rows), one kv head, one stretch of
        the prompt: every member's query heads of this kv head in one tile, so the stretch is read
        once for all of them. An unused entry has length 0 and writes nothing."""
        entry = tl.program_id(0)
        kvh, split = tl.program_id(1), tl.program_id(2)
        length = tl.load(len_ptr + entry)
        slot = tl.load(slot_ptr + entry).to(tl.int64)
        i = tl.arange(0, MEMBERS * GROUP_PAD)
        g = i % GROUP_PAD
        row = tl.load(members_ptr + entry * MEMBERS + i // GROUP_PAD)
        live = (row >= 0) & (g < GROUP) & (length > 0)
        row = tl.where(row >= 0, row, 0).to(tl.int64)
        d = tl.arange(0, D)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + row[:, None] * sq_n + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        start = split * stretch
        end = tl.minimum(start + stretch, length)
        m = tl.full([MEMBERS * GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([MEMBERS * GROUP_PAD], tl.float32)
        acc = tl.zeros([MEMBERS * GROUP_PAD, D], tl.float32)
        for off in range(start, end, BLOCK):
            pos = off + tl.arange(0, BLOCK)
            valid = pos < end
            k = tl.load(k_ptr + slot * sk_s + kvh * sk_h + pos[:, None] * sk_l + d[None, :], mask=valid[:, None],
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
            v = tl.load(v_ptr + slot * sv_s + kvh * sv_h + pos[:, None] * sv_l + d[None, :], mask=valid[:, None],
                        other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        base = (row * heads_total + heads) * SPLITS + split
        tl.store(acc_ptr + base[:, None] * D + d[None, :], acc, mask=live[:, None])
        tl.store(m_ptr + base, m, mask=live)
        tl.store(l_ptr + base, total, mask=live)

    return partial_attention, merge_stretches, prefix_partial_attention


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
    partial_attention, merge_stretches, _ = _kernel()
    partial_attention[(n, kv_heads, splits)](
        q, k_cache, v_cache, lengths, acc, m, total,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale, stretch,
        GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), D=dim, SPLITS=splits, FIRST=0, BLOCK=BLOCK,
        IEEE=q.dtype == torch.float32, num_warps=NUM_WARPS)
    out = torch.empty_like(q)
    merge_stretches[(n * heads,)](acc, m, total, out, SPLITS=splits, SPLITS_PAD=max(2, 1 << (splits - 1).bit_length()),
                                  D=dim)
    return out


@split_kv_attention.register_fake
def _(q, k_cache, v_cache, lengths, scale):
    return torch.empty_like(q)


# Rows per prefix program: with the 3B and 7B models' 8 (7, padded) query heads per kv head, a
# tile of 64 query rows; a group of more samples spans several entries.
PREFIX_MEMBERS = 8
# Stretches of a prompt: each writes its 64 query rows' fp32 partial sums, so at 16 stretches of a
# 1088-token prompt the writes equal the prompt's KV reads. The few stretches that keep them a
# quarter of it (PREFIX_TOKENS_PER_SPLIT each), and about one program per SM. Warps per program.
PREFIX_TOKENS_PER_SPLIT = 256
PREFIX_PROGRAMS = 132
PREFIX_WARPS = 4


def prefix_splits_for(entries: int, kv_heads: int, prefix_len: int) -> int:
    want = -(-PREFIX_PROGRAMS // max(1, entries * kv_heads))
    return max(1, min(want, prefix_len // PREFIX_TOKENS_PER_SPLIT, -(-prefix_len // BLOCK)))


def _stretch(length: int, splits: int) -> int:
    """Slots per stretch: ``length`` over ``splits``, in whole blocks."""
    per_split = -(-length // splits)
    return -(-per_split // BLOCK) * BLOCK


@torch.library.custom_op("rollplex::shared_prefix_attention", mutates_args=())
def shared_prefix_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, entry_slot: torch.Tensor,
                            entry_len: torch.Tensor, members: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, heads, head_dim]; prefix_k, prefix_v [slots, kv_heads, prefix_len, head_dim], one prompt's
    KV per slot; entry_slot, entry_len [entries] int32 (length 0: unused) and members [entries,
    PREFIX_MEMBERS] int32 (rows below n, -1 padding): which rows read which slot; k_cache, v_cache
    [n, kv_heads, max_len, head_dim], each row's own KV, ``lengths`` [n] int32 filled slots of it
    (this step's included). Every row of [0, n) that decodes is a member of one entry."""
    n, heads, dim = q.shape
    kv_heads, prefix_len, max_len = prefix_k.shape[1], prefix_k.shape[2], k_cache.shape[2]
    group = heads // kv_heads
    # Entries in use: at most one per PREFIX_MEMBERS rows, plus one per resident prompt (the table
    # lists them first), so the grid need not cover every row.
    entries = min(entry_slot.shape[0], n // PREFIX_MEMBERS + prefix_k.shape[0])
    prefix_splits = prefix_splits_for(-(-n // PREFIX_MEMBERS), kv_heads, prefix_len)
    row_splits = splits_for(n, kv_heads, max_len)
    splits = prefix_splits + row_splits
    acc = torch.empty(n, heads, splits, dim, dtype=torch.float32, device=q.device)
    # A row no entry lists (a padding row of the graph) keeps -inf there: its prefix weighs nothing.
    m = torch.full((n, heads, splits), float("-inf"), dtype=torch.float32, device=q.device)
    total = torch.zeros_like(m)
    q = q.contiguous()
    partial_attention, merge_stretches, prefix_partial_attention = _kernel()
    group_pad = 1 << (group - 1).bit_length()
    prefix_partial_attention[(entries, kv_heads, prefix_splits)](
        q, prefix_k, prefix_v, entry_slot, entry_len, members, acc, m, total,
        q.stride(0), q.stride(1), prefix_k.stride(0), prefix_k.stride(1), prefix_k.stride(2),
        prefix_v.stride(0), prefix_v.stride(1), prefix_v.stride(2), scale, _stretch(prefix_len, prefix_splits), heads,
        GROUP=group, GROUP_PAD=group_pad, MEMBERS=members.shape[1], D=dim, SPLITS=splits, BLOCK=BLOCK,
        IEEE=q.dtype == torch.float32, num_warps=PREFIX_WARPS)
    partial_attention[(n, kv_heads, row_splits)](
        q, k_cache, v_cache, lengths, acc, m, total,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale, _stretch(max_len, row_splits),
        GROUP=group, GROUP_PAD=max(16, group_pad), D=dim, SPLITS=splits, FIRST=prefix_splits, BLOCK=BLOCK,
        IEEE=q.dtype == torch.float32, num_warps=NUM_WARPS)
    out = torch.empty_like(q)
    merge_stretches[(n * heads,)](acc, m, total, out, SPLITS=splits, SPLITS_PAD=max(2, 1 << (splits - 1).bit_length()),
                                  D=dim)
    return out


@shared_prefix_attention.register_fake
def _(q, prefix_k, prefix_v, entry_slot, entry_len, members, k_cache, v_cache, lengths, scale):
    return torch.empty_like(q)


def shared_prefix_attention_sdpa(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                                 slot_of_row: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The same by SDPA: each row's prompt KV gathered (``slot_of_row`` [n]) ahead of its own, under
    the additive ``mask`` [n, 1, 1, prefix_len + max_len]. q [n, heads, head_dim]."""
    n, heads, dim = q.shape
    k = torch.cat([prefix_k.index_select(0, slot_of_row), k_cache], dim=2)
    v = torch.cat([prefix_v.index_select(0, slot_of_row), v_cache], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(q.view(n, heads, 1, dim), k, v, attn_mask=mask,
                                                           scale=scale, enable_gqa=True)
    return out.view(n, heads, dim)

