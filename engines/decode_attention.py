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

``decode_layer_attention`` is a layer's whole attention from its q|k|v projection: it rotates q and
k, writes the step's k and v into the row's cache and runs the prompt's and the row's own stretches
in one launch, then merges; the engine's ``attention: fused``. A decode step at a few rows is bound
by its launches, and this one replaces a rotary kernel, two cache writes,
two buffer fills and two partial launches per layer.

All are torch custom ops: ``torch.compile`` keeps them whole inside the compiled decoder layer. On
CPU, or without Triton, the engine keeps SDPA (``available``). The Triton source is
``engines/decode_kernels.py``.
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


def _kernel():
    from rollplex.engines.decode_kernels import kernels

    return kernels()


def _pad(splits: int) -> int:
    return max(2, 1 << (splits - 1).bit_length())


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
    partial_attention, merge_stretches, _, _ = _kernel()
    partial_attention[(n, kv_heads, splits)](
        q, k_cache, v_cache, lengths, acc, m, total,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), scale, stretch,
        GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), D=dim, SPLITS=splits, FIRST=0, BLOCK=BLOCK,
        IEEE=q.dtype == torch.float32, num_warps=NUM_WARPS)
    out = torch.empty_like(q)
    merge_stretches[(n * heads,)](acc, m, total, out, lengths, SPLITS=splits, SPLITS_PAD=_pad(splits), D=dim,
                                  HEADS=heads, PREFIX_SPLITS=0)
    return out


@split_kv_attention.register_fake
def _(q, k_cache, v_cache, lengths, scale):
    return torch.empty_like(q)


# Rows per prefix program: with the 3B and 7B models' 8 (7, padded) query heads per kv head, a
# tile of 64 query rows; a group of more samples spans several entries.
PREFIX_MEMBERS = 8
# Stretches of a prompt: about one program per SM, each at least PREFIX_TOKENS_PER_SPLIT slots long.
# A stretch writes its live query rows' fp32 partial sums (up to 56 of 128 floats, about a half of
# what a 64-slot stretch reads), which at 64 rows made 256-slot stretches 1% faster; but a group of
# a few rows then had 8 programs for its prompt: 14.4 µs a layer for 1.1 MB at one row on an H100
# (2026-12-06), a seventh of the step. So stretches are as short as a block where rows are few.
PREFIX_TOKENS_PER_SPLIT = 64
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
    partial_attention, merge_stretches, prefix_partial_attention, _ = _kernel()
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
    merge_stretches[(n * heads,)](acc, m, total, out, lengths, SPLITS=splits, SPLITS_PAD=_pad(splits), D=dim,
                                  HEADS=heads, PREFIX_SPLITS=0)
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



@torch.library.custom_op("rollplex::decode_layer_attention", mutates_args=("k_cache", "v_cache"))
def decode_layer_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_k: torch.Tensor | None,
                           prefix_v: torch.Tensor | None, entry_slot: torch.Tensor | None,
                           entry_len: torch.Tensor | None, members: torch.Tensor | None,
                           prompt_len: torch.Tensor | None, heads: int, scale: float) -> torch.Tensor:
    """A decode layer's attention from its q|k|v projection, in two launches (``layer_partials``, then
    the merge). qkv [n, (heads + 2 kv_heads) * head_dim], q, k, v back to back per row as the fused
    projection leaves them, not yet rotated; cos, sin [n, head_dim] fp32, each row's rotary angles;
    lengths [n] int32, each row's filled slots of its own cache counting this step's, which the
    kernel writes at slot length - 1 (rotated k, and v). With a prefix cache (``prefix_k`` ...
    ``members`` as in ``shared_prefix_attention``, ``prompt_len`` [n] each row's prompt, 0 for a row
    no entry lists) each row also attends to its prompt's slot first. Returns [n, heads, head_dim]."""
    n, dim = qkv.shape[0], k_cache.shape[3]
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    row_splits = splits_for(n, kv_heads, max_len)
    prefix_splits, prefix_programs, entries = 0, 0, 0
    if prefix_k is not None:
        entries = min(entry_slot.shape[0], n // PREFIX_MEMBERS + prefix_k.shape[0])
        prefix_splits = prefix_splits_for(-(-n // PREFIX_MEMBERS), kv_heads, prefix_k.shape[2])
        prefix_programs = entries * kv_heads * prefix_splits
    else:  # the kernel's prefix pointers are never read: any tensors of the cache's dtype do
        prefix_k = prefix_v = k_cache
        entry_slot = entry_len = members = prompt_len = lengths
    splits = prefix_splits + row_splits
    acc = torch.empty(n, heads, splits, dim, dtype=torch.float32, device=qkv.device)
    m = torch.empty(n, heads, splits, dtype=torch.float32, device=qkv.device)
    total = torch.empty_like(m)
    _, merge_stretches, _, layer_partials = _kernel()
    group_pad = 1 << (group - 1).bit_length()
    layer_partials[(prefix_programs + n * kv_heads * row_splits,)](
        qkv, cos, sin, lengths, k_cache, v_cache, prefix_k, prefix_v, entry_slot, entry_len, members, acc, m, total,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), prefix_k.stride(0), prefix_k.stride(1),
        prefix_k.stride(2), prefix_v.stride(0), prefix_v.stride(1), prefix_v.stride(2), scale,
        _stretch(max_len, row_splits), _stretch(prefix_k.shape[2], max(1, prefix_splits)), prefix_programs,
        HEADS=heads, KV=kv_heads, GROUP=group, GROUP_PAD=group_pad, ROW_PAD=max(16, group_pad),
        MEMBERS=PREFIX_MEMBERS, D=dim, SPLITS=splits, PREFIX_SPLITS=max(1, prefix_splits), FIRST=prefix_splits,
        ROW_SPLITS=row_splits, BLOCK=BLOCK,
        IEEE=k_cache.dtype == torch.float32, num_warps=NUM_WARPS)
    out = torch.empty(n, heads, dim, dtype=qkv.dtype, device=qkv.device)
    merge_stretches[(n * heads,)](acc, m, total, out, prompt_len, SPLITS=splits, SPLITS_PAD=_pad(splits), D=dim,
                                  HEADS=heads, PREFIX_SPLITS=prefix_splits)
    return out


@decode_layer_attention.register_fake
def _(qkv, cos, sin, lengths, k_cache, v_cache, prefix_k, prefix_v, entry_slot, entry_len, members, prompt_len,
      heads, scale):
    return qkv.new_empty(qkv.shape[0], heads, k_cache.shape[3])
