"""Triton source of the decode step's attention kernels (the ops that launch them and size their grids
are ``engines/decode_attention.py``).

Every kernel computes partial attention over a stretch of KV slots with one online-softmax loop,
``_attend``, and stores the stretch's unnormalised sum with its running maximum and total; a merge
kernel rescales a (row, head)'s stretches to their common maximum by log-sum-exp (flash-decoding).

- ``partial_attention``: one row's kv head over one stretch of the row's own cache.
- ``prefix_partial_attention``: one stretch of a prompt's KV held once in a prefix slot, for the
  queries of up to MEMBERS of its rows at once (cascade attention), so a group reads it once.
- ``layer_partials``: the decode layer's whole attention in one launch: it takes the q|k|v
  projection as it comes out of the matmul, rotates q and k (RoPE) itself, writes the step's k and v
  into the row's cache slot, and runs both kinds of stretch above (prefix programs first). What
  used to be a rotary kernel, two cache writes, two buffer fills and two partial launches per layer
  is one launch; a decode step at a few rows is bound by such launches, not by bytes.

Only the ops import this module, on first use: it needs Triton, which CPU installs may lack.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: tf32 would lose the precision the fp32 tests check
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)

@triton.jit
def _attend(q, k_base, v_base, sk_l, sv_l, start, end, scale, m, total, acc, d, new_pos, k_new, v_new,
            BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax of q [R, D] over slots [start, end) of one kv head's K/V (k_base + slot *
    sk_l + d). The slot ``new_pos`` takes ``k_new``/``v_new`` [D] from registers instead of memory
    (this step's token, written to the cache by the same launch). Returns (m, total, acc)."""
    for off in range(start, end, BLOCK):
        pos = off + tl.arange(0, BLOCK)
        valid = pos < end
        fresh = (pos == new_pos)[:, None]
        k = tl.load(k_base + pos[:, None] * sk_l + d[None, :], mask=valid[:, None], other=0.0)
        k = tl.where(fresh, k_new[None, :], k)
        s = _dot(q, tl.trans(k), IEEE) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + pos[:, None] * sv_l + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.where(fresh, v_new[None, :], v)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m = m_new
    return m, total, acc

@triton.jit
def _store_partial(acc_ptr, m_ptr, l_ptr, base, d, acc, m, total, keep, D: tl.constexpr):
    tl.store(acc_ptr + base[:, None] * D + d[None, :], acc, mask=keep[:, None])
    tl.store(m_ptr + base, m, mask=keep)
    tl.store(l_ptr + base, total, mask=keep)

@triton.jit
def _rotary(x_ptr, rows, offset, cos_ptr, sin_ptr, s_cs, d, keep, D: tl.constexpr):
    """x_ptr[rows, offset + d] rotated by each row's cos/sin [*, D] (rotate-half RoPE), in fp32."""
    half = D // 2
    partner = (d + half) % D
    sign = tl.where(d < half, -1.0, 1.0)
    keep = keep & (d[None, :] >= 0)  # the full [*, D] shape: masks do not broadcast up to the pointers
    x = tl.load(x_ptr + offset + d[None, :], mask=keep, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + offset + partner[None, :], mask=keep, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + rows * s_cs + d[None, :], mask=keep, other=0.0)
    s = tl.load(sin_ptr + rows * s_cs + d[None, :], mask=keep, other=0.0)
    return x * c + sign[None, :] * xp * s

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
    keep = g < GROUP
    q = tl.load(q_ptr + row * sq_n + heads[:, None] * sq_h + d[None, :], mask=keep[:, None], other=0.0)
    m, total, acc = _attend(q, k_ptr + row * sk_n + kvh * sk_h, v_ptr + row * sv_n + kvh * sv_h, sk_l, sv_l,
                            start, end, scale, tl.full([GROUP_PAD], float("-inf"), tl.float32),
                            tl.zeros([GROUP_PAD], tl.float32), tl.zeros([GROUP_PAD, D], tl.float32), d, -1,
                            tl.zeros([D], q.dtype), tl.zeros([D], q.dtype), BLOCK, IEEE)
    base = (row * (tl.num_programs(1) * GROUP) + heads) * SPLITS + FIRST + split
    _store_partial(acc_ptr, m_ptr, l_ptr, base, d, acc, m, total, keep, D)

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
    row = tl.where(length > 0, tl.load(members_ptr + entry * MEMBERS + i // GROUP_PAD), -1)
    live = (row >= 0) & (g < GROUP)
    row = tl.where(row >= 0, row, 0).to(tl.int64)
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row[:, None] * sq_n + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
    start = split * stretch
    m, total, acc = _attend(q, k_ptr + slot * sk_s + kvh * sk_h, v_ptr + slot * sv_s + kvh * sv_h, sk_l, sv_l,
                            start, tl.minimum(start + stretch, length), scale,
                            tl.full([MEMBERS * GROUP_PAD], float("-inf"), tl.float32),
                            tl.zeros([MEMBERS * GROUP_PAD], tl.float32),
                            tl.zeros([MEMBERS * GROUP_PAD, D], tl.float32), d, -1,
                            tl.zeros([D], q.dtype), tl.zeros([D], q.dtype), BLOCK, IEEE)
    _store_partial(acc_ptr, m_ptr, l_ptr, (row * heads_total + heads) * SPLITS + split, d, acc, m, total, live,
                   D)

@triton.jit
def _prompt_stretch(pid, qkv_ptr, cos_ptr, sin_ptr, k_ptr, pk_ptr, pv_ptr, slot_ptr, elen_ptr, members_ptr,
                    acc_ptr, m_ptr, l_ptr, s_qkv, s_cs, spk_s, spk_h, spk_l, spv_s, spv_h, spv_l, scale, stretch,
                    HEADS: tl.constexpr, KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                    MEMBERS: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
                    BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """layer_partials' program ``pid`` of the prompts': (entry, kv head, prompt stretch)."""
    d = tl.arange(0, D)
    split = pid % PREFIX_SPLITS
    kvh = (pid // PREFIX_SPLITS) % KV
    entry = pid // (PREFIX_SPLITS * KV)
    length = tl.load(elen_ptr + entry)
    slot = tl.load(slot_ptr + entry).to(tl.int64)
    i = tl.arange(0, MEMBERS * GROUP_PAD)
    g = i % GROUP_PAD
    row = tl.where(length > 0, tl.load(members_ptr + entry * MEMBERS + i // GROUP_PAD), -1)
    live = (row >= 0) & (g < GROUP)
    row = tl.where(row >= 0, row, 0).to(tl.int64)
    heads = kvh * GROUP + g
    q = _rotary(qkv_ptr, row[:, None], row[:, None] * s_qkv + heads[:, None] * D, cos_ptr, sin_ptr, s_cs,
                d, live[:, None], D).to(k_ptr.dtype.element_ty)
    start = split * stretch
    m, total, acc = _attend(q, pk_ptr + slot * spk_s + kvh * spk_h, pv_ptr + slot * spv_s + kvh * spv_h,
                            spk_l, spv_l, start, tl.minimum(start + stretch, length), scale,
                            tl.full([MEMBERS * GROUP_PAD], float("-inf"), tl.float32),
                            tl.zeros([MEMBERS * GROUP_PAD], tl.float32),
                            tl.zeros([MEMBERS * GROUP_PAD, D], tl.float32), d, -1,
                            tl.zeros([D], q.dtype), tl.zeros([D], q.dtype), BLOCK, IEEE)
    _store_partial(acc_ptr, m_ptr, l_ptr, (row * HEADS + heads) * SPLITS + split, d, acc, m, total, live, D)


@triton.jit
def _own_stretch(pid, qkv_ptr, cos_ptr, sin_ptr, len_ptr, k_ptr, v_ptr, acc_ptr, m_ptr, l_ptr,
                 s_qkv, s_cs, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, scale, stretch,
                 HEADS: tl.constexpr, KV: tl.constexpr, GROUP: tl.constexpr, ROW_PAD: tl.constexpr,
                 D: tl.constexpr, SPLITS: tl.constexpr, FIRST: tl.constexpr, ROW_SPLITS: tl.constexpr,
                 BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """layer_partials' program ``pid`` of the rows': (row, kv head, own stretch); the one whose
    stretch holds the row's newest slot writes this step's k and v there."""
    d = tl.arange(0, D)
    split = pid % ROW_SPLITS
    kvh = (pid // ROW_SPLITS) % KV
    row = (pid // (ROW_SPLITS * KV)).to(tl.int64)
    length = tl.load(len_ptr + row)
    new_pos = length - 1
    g = tl.arange(0, ROW_PAD)
    keep = g < GROUP
    heads = kvh * GROUP + g
    rows = row + tl.zeros([ROW_PAD, 1], tl.int64)
    q = _rotary(qkv_ptr, rows, rows * s_qkv + heads[:, None] * D, cos_ptr, sin_ptr, s_cs, d, keep[:, None],
                D).to(k_ptr.dtype.element_ty)
    one = d[None, :] >= 0  # [1, D] all true: the k/v vectors load as one-row tiles
    k_new = tl.sum(_rotary(qkv_ptr, row, row * s_qkv + (HEADS + kvh) * D, cos_ptr, sin_ptr, s_cs, d, one,
                           D), 0).to(k_ptr.dtype.element_ty)
    v_new = tl.load(qkv_ptr + row * s_qkv + (HEADS + KV + kvh) * D + d).to(v_ptr.dtype.element_ty)
    start = split * stretch
    end = tl.minimum(start + stretch, length)
    at = new_pos + d * 0  # [D]: a scalar condition as a mask trips Triton's interpreter
    mine = (at >= start) & (at < end)
    k_base = k_ptr + row * sk_n + kvh * sk_h
    v_base = v_ptr + row * sv_n + kvh * sv_h
    tl.store(k_base + new_pos * sk_l + d, k_new, mask=mine)
    tl.store(v_base + new_pos * sv_l + d, v_new, mask=mine)
    m, total, acc = _attend(q, k_base, v_base, sk_l, sv_l, start, end, scale,
                            tl.full([ROW_PAD], float("-inf"), tl.float32), tl.zeros([ROW_PAD], tl.float32),
                            tl.zeros([ROW_PAD, D], tl.float32), d, new_pos, k_new, v_new, BLOCK, IEEE)
    _store_partial(acc_ptr, m_ptr, l_ptr, (row * HEADS + heads) * SPLITS + FIRST + split, d, acc, m, total,
                   keep, D)


@triton.jit
def layer_partials(qkv_ptr, cos_ptr, sin_ptr, len_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, slot_ptr, elen_ptr,
                   members_ptr, acc_ptr, m_ptr, l_ptr,
                   s_qkv, s_cs, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, spk_s, spk_h, spk_l, spv_s, spv_h, spv_l,
                   scale, row_stretch, prefix_stretch, prefix_programs,
                   HEADS: tl.constexpr, KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   ROW_PAD: tl.constexpr, MEMBERS: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                   PREFIX_SPLITS: tl.constexpr, FIRST: tl.constexpr, ROW_SPLITS: tl.constexpr,
                   BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """Programs [0, prefix_programs): (entry, kv head, prompt stretch), as prefix_partial_attention.
    The rest: (row, kv head, own stretch), as partial_attention, where the program whose stretch
    holds the row's newest slot (len - 1) writes this step's rotated k and its v there. q is
    rotated per program from the projection's output: qkv [n, (HEADS + 2 KV) * D]. A row's
    stretches lie at FIRST.. of its partials, after the PREFIX_SPLITS (FIRST of them, 0 without
    a prefix cache) of its prompt."""
    pid = tl.program_id(0)
    if pid < prefix_programs:
        _prompt_stretch(pid, qkv_ptr, cos_ptr, sin_ptr, k_ptr, pk_ptr, pv_ptr, slot_ptr, elen_ptr, members_ptr,
                        acc_ptr, m_ptr, l_ptr, s_qkv, s_cs, spk_s, spk_h, spk_l, spv_s, spv_h, spv_l, scale,
                        prefix_stretch, HEADS, KV, GROUP, GROUP_PAD, MEMBERS, D, SPLITS, PREFIX_SPLITS, BLOCK,
                        IEEE)
    else:
        _own_stretch(pid - prefix_programs, qkv_ptr, cos_ptr, sin_ptr, len_ptr, k_ptr, v_ptr, acc_ptr, m_ptr,
                     l_ptr, s_qkv, s_cs, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, scale, row_stretch, HEADS, KV, GROUP,
                     ROW_PAD, D, SPLITS, FIRST, ROW_SPLITS, BLOCK, IEEE)


@triton.jit
def merge_stretches(acc_ptr, m_ptr, l_ptr, out_ptr, prompt_ptr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    D: tl.constexpr, HEADS: tl.constexpr, PREFIX_SPLITS: tl.constexpr):
    """One (row, head): its stretches' sums rescaled to their common maximum, then normalised. A
    stretch past the row's length holds m = -inf and weighs nothing. With PREFIX_SPLITS, a row
    whose prompt length (prompt_ptr) is 0 has no prefix entry: its prefix stretches are not read
    (nothing wrote them this step)."""
    at = tl.program_id(0).to(tl.int64)  # row * heads + head
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    inside = s < SPLITS
    if PREFIX_SPLITS > 0:
        prompt = tl.load(prompt_ptr + at // HEADS) + s * 0  # [SPLITS_PAD], as in layer_partials
        inside = inside & ((s >= PREFIX_SPLITS) | (prompt > 0))
    m = tl.load(m_ptr + at * SPLITS + s, mask=inside, other=float("-inf"))
    total = tl.load(l_ptr + at * SPLITS + s, mask=inside, other=0.0)
    weight = tl.exp(m - tl.max(m, 0))
    acc = tl.load(acc_ptr + (at * SPLITS + s)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
    tl.store(out_ptr + at * D + d, out.to(out_ptr.dtype.element_ty))


def kernels():
    return partial_attention, merge_stretches, prefix_partial_attention, layer_partials
