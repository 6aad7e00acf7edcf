"""Attention for packed suffixes without a dense mask: each response reads its prompt's KV and itself.

``vlm.suffix_forward_packed`` lays a prompt group's responses one after another in a row on top of
the prompt's KV. With a dense [width, prefix + width] mask, SDPA runs its masked kernel over every
pair, although a token may read only its prefix and its own response: at 8 responses of 1,024
tokens on a 1,088-token prompt that is 9,280 keys per query where about 1,600 count, and the masked
kernel is several times slower than flash attention besides.

Here the row is cut into its responses and each one attends as a sequence of its own (variable
length, flash attention's ``cu_seqlens`` layout): queries are the response's tokens, keys are the
prefix followed by those tokens, and causality is aligned to the end of the keys, so token t reads
the whole prefix and the response up to t. The prefix's keys are gathered once per response (its
KV is small: few KV heads), and the gather's backward sums their gradients back into the one prefix.

On CUDA in bf16/fp16 the kernel is PyTorch's flash attention (``aten._flash_attention_forward`` and
its backward); elsewhere a loop of SDPA calls per response computes the same thing, which is what
the CPU tests check the layout with.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "rollplex_packed"


@dataclass
class PackedLayout:
    """Where each response of a packed forward lies. Rows are ``rows`` × ``width`` query slots and
    ``rows`` × (``prefix`` + ``width``) key slots (the prefix padded to the longest prompt)."""

    q_index: torch.Tensor  # [Tq] long: query slot of every real token, response by response
    k_index: torch.Tensor  # [Tk] long: key slot of each response's prefix, then of its own tokens
    cu_q: torch.Tensor  # [S + 1] int32: response starts in q_index
    cu_k: torch.Tensor  # [S + 1] int32: response starts in k_index
    max_q: int
    max_k: int
    rows: int
    width: int
    prefix: int
    k_lengths: list[int]  # per response: its prefix's length plus its own tokens


def layout(segments: list[tuple[int, int, int, int]], rows: int, width: int, prefix: int,
           device: torch.device) -> PackedLayout:
    """``segments``: (row, start in the row, tokens, the row's prefix length) per response, in the
    order of the packed forward's real tokens."""
    seg = torch.tensor(segments, dtype=torch.long).view(-1, 4)
    row, start, n, plen = seg.unbind(1)
    klen = plen + n
    ids = torch.arange(len(segments))
    q_seg, k_seg = ids.repeat_interleave(n), ids.repeat_interleave(klen)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), klen.cumsum(0)])
    tq = torch.arange(int(cu_q[-1])) - cu_q[q_seg]
    tk = torch.arange(int(cu_k[-1])) - cu_k[k_seg]
    q_index = row[q_seg] * width + start[q_seg] + tq
    own = tk - plen[k_seg]  # < 0 inside the prefix
    k_index = row[k_seg] * (prefix + width) + torch.where(own < 0, tk, prefix + start[k_seg] + own)
    moved = torch.cat([q_index, k_index, cu_q, cu_k]).to(device)
    a, b, c = len(q_index), len(q_index) + len(k_index), len(q_index) + len(k_index) + len(cu_q)
    return PackedLayout(moved[:a], moved[a:b], moved[b:c].int(), moved[c:].int(), int(n.max()), int(klen.max()),
                        rows, width, prefix, klen.tolist())


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.shape = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        max_q, max_k, scale = ctx.shape
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused, scale=scale)
        return dq, dk, dv, None, None, None, None, None


def flash_ok(dtype: torch.dtype, device: torch.device) -> bool:
    return torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: PackedLayout, scale: float) -> torch.Tensor:
    """Causal attention of each response ([Tq, H, D] queries) on its keys ([Tk, Hkv, D]), causality
    aligned to the keys' end."""
    if flash_ok(q.dtype, q.device):
        return _FlashVarlen.apply(q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, scale)
    outs, qs, ks = [], 0, 0
    for klen, qn in zip(lay.k_lengths, (lay.cu_q[1:] - lay.cu_q[:-1]).tolist()):
        qi = q[qs: qs + qn].transpose(0, 1).unsqueeze(0)
        ki, vi = (x[ks: ks + klen].transpose(0, 1).unsqueeze(0) for x in (k, v))
        allowed = torch.ones(qn, klen, dtype=torch.bool, device=q.device).tril(klen - qn)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale,
                                                   enable_gqa=ki.shape[1] != qi.shape[1])[0].transpose(0, 1))
        qs, ks = qs + qn, ks + klen
    return torch.cat(outs)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              packed: PackedLayout | None = None, **kwargs):
    """transformers' attention interface: SDPA, unless the forward passes a ``packed`` layout."""
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    lay, heads, dim = packed, query.shape[1], query.shape[-1]
    q = query.transpose(1, 2).reshape(-1, heads, dim).index_select(0, lay.q_index)
    k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], dim).index_select(0, lay.k_index) for x in (key, value))
    scale = scaling if scaling is not None else dim ** -0.5
    out = varlen(q.contiguous(), k.contiguous(), v.contiguous(), lay, scale)
    full = out.new_zeros(lay.rows * lay.width, heads, dim).index_copy(0, lay.q_index, out)
    return full.view(lay.rows, lay.width, heads, dim), None


def enable(model: torch.nn.Module) -> bool:
    """Route the language model's attention through ``attention`` (SDPA for every other caller, so
    decode and prefix forwards are unchanged). False where the model runs another implementation
    (eager): the packed forward then keeps its dense mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config.get_text_config()
    if config._attn_implementation == NAME:
        return True
    if config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    config._attn_implementation = NAME
    return True
