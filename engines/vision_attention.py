"""One SDPA call per run of equal windows in the Qwen2.5-VL vision tower.

Without flash-attention, transformers' ``Qwen2_5_VLVisionAttention`` reads ``cu_seqlens`` back to
the host in every layer and calls attention once per window: a 4096-patch image with 112-pixel
windows makes ~64 tiny calls per layer. Windows are contiguous in the sequence, so a run of
consecutive windows of one length is a view [n, heads, L, head_dim] and one
``scaled_dot_product_attention`` call (an image whose windows all fit needs one per layer; ragged
edge windows add a few). The lengths are read to the host once per ``cu_seqlens`` tensor, i.e. twice
per tower forward (full and window layers) instead of once per layer.

Measured with ``benchmarks/vit_attention.py`` (both variants side by side, one process): the 3B
tower on an H200, 8 images of 4096 patches, bf16: 899.9 -> 253.1 ms, identical output (BENCHMARKS.md).
On the 2-core CPU, the tiny model's tower, 8 images of 1024 patches, fp32 (``--device cpu --images 8
--merged 256 --model <tiny config.json>``): 61.4 -> 47.5 and 66.3 -> 59.3 ms in two runs, identical
output; so it is applied on every device. Models configured for flash attention are left alone (HF runs varlen
kernels there).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

# id(cu_seqlens) -> (weak reference to it, its version, its runs). The layers of one tower forward
# share two cu_seqlens tensors; the weak reference and the version make a reused id or a tensor
# changed in place a miss, never a stale hit.
_RUNS: dict[int, tuple[weakref.ref, int, list[tuple[int, int]]]] = {}


def window_runs(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """(window length, number of windows) for each run of consecutive equal window lengths."""
    hit = _RUNS.get(id(cu_seqlens))
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == cu_seqlens._version:
        return hit[2]
    bounds = cu_seqlens.tolist()  # the one host read for this tensor
    runs: list[list[int]] = []
    for start, end in zip(bounds, bounds[1:]):
        if runs and runs[-1][0] == end - start:
            runs[-1][1] += 1
        elif end > start:
            runs.append([end - start, 1])
    for key in [k for k, (ref, _, _) in _RUNS.items() if ref() is None]:
        del _RUNS[key]
    out = [(length, count) for length, count in runs]
    _RUNS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, out)
    return out


class BatchedVisionAttention(hf.Qwen2_5_VLVisionAttention):
    """``Qwen2_5_VLVisionAttention`` with one SDPA call per run of equal windows (module docstring)."""

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                max_seqlen: int | None = None, **kwargs) -> torch.Tensor:
        if hf.is_flash_attention_requested(self.config):
            return super().forward(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = hf.apply_rotary_pos_emb_vision(q, k, cos, sin)
        dropout = self.attention_dropout if self.training else 0.0
        outs, start = [], 0
        for length, count in window_runs(cu_seqlens):
            end = start + length * count
            # [count * L, heads, d] -> [count, heads, L, d]
            qb, kb, vb = (t[start:end].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=dropout, is_causal=False, scale=self.scaling)
            outs.append(o.transpose(1, 2).reshape(end - start, -1))
            start = end
        attn_output = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.proj(attn_output)


def batch_vision_attention(model: torch.nn.Module) -> int:
    """Switch every Qwen2.5-VL vision attention module in ``model`` (the whole model or its vision
    tower) to ``BatchedVisionAttention`` in place; the weights and state dict are unchanged.
    Returns how many modules it switched: 0 when called again, or when the model's config requests
    flash attention."""
    patched = 0
    for module in model.modules():
        if type(module) is hf.Qwen2_5_VLVisionAttention and not hf.is_flash_attention_requested(module.config):
            module.__class__ = BatchedVisionAttention
            patched += 1
    return patched
