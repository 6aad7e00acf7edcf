"""One decode step's tensor functions for ``engines/graph_decode.py``: the counter-based noise, the
sampler, one decoder layer for one token per row, and the model's tensors they read.

Each is a function of tensors (no engine state), so ``torch.compile`` traces it once per shape and a
CUDA graph captures it as is. The layer reads the HF model's own parameters, as views: with tensor
parallelism each rank's share of the heads and MLP columns (``_TensorShare``); where q|k|v and
gate|up lie back to back in memory (``engines.sharing.fuse_for_rollout``), one tensor per group, so
each group is projected in one matmul.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from rollplex.engines.decode_attention import (
    decode_layer_attention,
    shared_prefix_attention,
    shared_prefix_attention_sdpa,
    split_kv_attention,
)
from rollplex.engines.sharing import adjacent_view
from rollplex.engines.torch_decode import _apply_top_p
from rollplex.errors import EngineError

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` sign-extends)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(seed: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) noise [B, V] from splitmix64 of (seed, token index, vocab id): a pure function of its
    inputs, so it is the same in a graph, eagerly, and whatever else shares the batch."""
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)
    x = seed.view(-1, 1) * _GOLDEN + index.view(-1, 1) * _MIX1 + ids.view(1, -1)
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 40).to(torch.float32) + 0.5) / float(1 << 24)


class _Weights:
    """The text model's tensors, referenced (not copied) from an HF Qwen2.5-VL model; with
    ``tp_size`` > 1, views of rank ``tp_rank``'s heads and MLP columns."""

    def __init__(self, model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1) -> None:
        lm = model.model.language_model
        cfg = model.config.get_text_config()
        self.embed = lm.embed_tokens.weight
        self.norm_w, self.eps = lm.norm.weight, lm.norm.variance_epsilon
        self.lm_head = model.lm_head.weight
        self.layers = lm.layers
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        for name, count in (("attention heads", heads), ("key/value heads", kv_heads),
                            ("MLP columns", cfg.intermediate_size)):
            if count % tp_size:
                raise EngineError(f"engine 'torch-graph': tensor parallel {tp_size} does not divide the model's "
                                  f"{count} {name}")
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.heads, self.kv_heads = heads // tp_size, kv_heads // tp_size  # this rank's
        self.kv_slice = slice(tp_rank * self.kv_heads, (tp_rank + 1) * self.kv_heads)
        share = _TensorShare(tp_rank, tp_size, cfg.intermediate_size // tp_size)
        # Per layer, the decoder layer's tensors and its two norms' eps, looked up once, not per step.
        self.layer_args = [(share.of(_layer_weights(layer)), (layer.input_layernorm.variance_epsilon,
                                                              layer.post_attention_layernorm.variance_epsilon))
                           for layer in lm.layers]
        # Where q|k|v and gate|up lie back to back (engines.sharing.fuse_parameters, or a trainer's flat
        # buffer in fusion order), a step projects each group in one matmul: a decode step is a few
        # skinny GEMMs per layer, and three of seven were the small k and v ones.
        fused = [_fused_weights(weights) for weights, _ in self.layer_args] if tp_size == 1 else [None]
        self.fused = all(f is not None for f in fused)
        if self.fused:
            self.layer_args = [(f, eps) for f, (_, eps) in zip(fused, self.layer_args)]
        self.inv_freq = lm.rotary_emb.inv_freq
        self.attn_scale = self.head_dim ** -0.5


@dataclasses.dataclass(frozen=True)
class _TensorShare:
    """Megatron's split of one decoder layer: q/k/v and gate/up by output rows (column-parallel),
    o and down by input columns (row-parallel, their outputs summed over ranks). Views, not copies."""

    rank: int
    size: int
    mlp: int  # MLP columns per rank

    def of(self, weights: tuple) -> tuple:
        if self.size == 1:
            return weights
        ln1, q_w, q_b, k_w, k_b, v_w, v_b, o_w, ln2, gate_w, up_w, down_w = weights

        def rows(t, per):
            return None if t is None else t.narrow(0, self.rank * per, per)

        q_rows, kv_rows = q_w.shape[0] // self.size, k_w.shape[0] // self.size
        o_cols = o_w.narrow(1, self.rank * q_rows, q_rows)
        down_cols = down_w.narrow(1, self.rank * self.mlp, self.mlp)
        return (ln1, rows(q_w, q_rows), rows(q_b, q_rows), rows(k_w, kv_rows), rows(k_b, kv_rows),
                rows(v_w, kv_rows), rows(v_b, kv_rows), o_cols, ln2, rows(gate_w, self.mlp),
                rows(up_w, self.mlp), down_cols)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _sample(logits, temp, top_p, seed, n_gen, use_top_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token and its log-prob: greedy where ``temp`` <= 0, else Gumbel-max over the
    temperature- (and with ``use_top_p``, nucleus-) processed logits with the row's counter noise.
    A function of tensors, so that ``torch.compile`` fuses the noise, softmax and argmax over the
    vocabulary instead of writing [rows, vocab] intermediates between a dozen kernels."""
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp).view(-1, 1)
    if use_top_p:  # vLLM's nucleus: mask the tail, keep the top token; log-probs are under what is drawn from
        scaled = _apply_top_p(scaled, torch.where(greedy, torch.ones_like(temp), top_p))
    logp = F.log_softmax(scaled, dim=-1)
    gumbel = -torch.log(-torch.log(counter_uniform(seed, n_gen, logits.shape[-1])))
    token = torch.where(greedy, _argmax_rows(logits), _argmax_rows(scaled + gumbel))
    return token, logp.gather(1, token.view(-1, 1)).view(-1)


def _argmax_rows(scores: torch.Tensor, chunks: int = 128) -> torch.Tensor:
    """``scores.argmax(-1)`` (the first of equal maxima, as argmax) over chunks of each row: compiled,
    a row's argmax is one program over the vocabulary, 90 µs for 152k scores; per chunk, many."""
    rows, vocab = scores.shape
    chunks = math.gcd(vocab, chunks)
    best, at = scores.view(rows, chunks, vocab // chunks).max(-1)
    pick = best.argmax(-1, keepdim=True)  # the first chunk holding the row's maximum
    return (pick * (vocab // chunks) + at.gather(1, pick)).view(-1)


def _advance(logits, temp, top_p, seed, n_gen, done, max_new, stop, tokens, logps, rope_pos, length, embed, inv_freq,
             use_top_p: bool, rotary_fp32: bool):
    """A step's work before the layers, for rows [0, n) (every argument a view of the batch's
    first n rows): sample each row's token from its logits and record it (tokens, logps, n_gen and
    done, in place; finished rows keep theirs), embed it, and its rotary angles. Returns (x, cos,
    sin, slot, filled): cos and sin [n, head_dim] fp32 with ``rotary_fp32`` (the layer kernel's), else
    [n, 1, 1, head_dim] in the model's dtype; slot, each row's cache slot for this token, and filled
    (int32), its filled slots counting this one. One function of tensors, so that ``torch.compile``
    fuses these few dozen small ops into a few kernels."""
    token, token_logp = _sample(logits, temp, top_p, seed, n_gen, use_top_p)
    active = ~done
    col = n_gen.clamp(max=tokens.shape[1] - 1).view(-1, 1)
    tokens.scatter_(1, col, torch.where(active, token, tokens.gather(1, col).view(-1)).view(-1, 1))
    logps.scatter_(1, col, torch.where(active, token_logp, logps.gather(1, col).view(-1)).view(-1, 1))
    counted = n_gen + active.long()
    n_gen.copy_(counted)
    stopped = (token.view(-1, 1) == stop).any(-1)
    done.copy_(done | (active & (stopped | (counted >= max_new))))
    # Forward the sampled token. Finished rows compute too (fixed shapes) but write nothing read.
    x = F.embedding(token, embed)
    angle = rope_pos.float().view(-1, 1) * inv_freq.view(1, -1)
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    if not rotary_fp32:
        n = x.shape[0]
        cos, sin = cos.to(x.dtype).view(n, 1, 1, -1), sin.to(x.dtype).view(n, 1, 1, -1)
    slot = length.clamp(max=tokens.shape[1] - 1)
    return x, cos, sin, slot, (slot + 1).to(torch.int32)


def _residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y``. Compiled, written through fp32 (the same single rounding as a bf16 add): Inductor
    turns ``x + mm(...)`` into cuBLAS's addmm, which first copies x into its output (two copies per
    layer and step); this way the add fuses into the RMS norm that reads the sum."""
    if torch.compiler.is_compiling():
        return (x.float() + y.float()).to(x.dtype)
    return x + y


def _head(x, residual, norm_w, eps: float, lm_head, logits, length, rope_pos) -> None:
    """After the layers: each row's next logits (fp32, in place) from the last layer's output (``x``
    plus its MLP's ``residual``), and its cache length and rotary position one further."""
    logits.copy_(F.linear(_rms(_residual(x, residual), norm_w, eps), lm_head).float())
    length.add_(1)
    rope_pos.add_(1)


def _norm_linear_of(linear):
    """(projection, x + residual) of the residual add, RMS norm and ``linear`` (and with ``silu_mul``
    gate|up's SiLU product) as separate ops; a fused ``norm_linear`` defers here where it returns None."""
    fused = getattr(linear, "norm_linear", None)

    def norm_linear(x, residual, norm_weight, eps: float, w, b, silu_mul: bool):
        got = fused(x, residual, norm_weight, eps, w, b, silu_mul) if fused is not None else None
        if got is not None:
            return got
        x = _residual(x, residual)
        y = linear(_rms(x, norm_weight, eps), w, b)
        if silu_mul:
            gate, up = y.chunk(2, -1)
            y = F.silu(gate) * up
        return y, x

    return norm_linear


def _decoder_layer(x, residual, cos, sin, visible, where, k_cache, v_cache, layer_weights, eps: tuple[float, float],
                   heads: int, kv_heads: int, head_dim: int, scale: float, reduce=None,
                   prefix=None, linear=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer for one token per row: writes this step's K/V into the row's slot and
    returns (its input plus attention's output, its MLP's output). The hidden state is the sum of
    the two; the next layer (or the head) adds them as it normalizes, so the add is no kernel of its
    own. ``residual``: the previous layer's MLP output (zeros before the first). A function of
    tensors, so that ``torch.compile`` makes one kernel set for every layer (same shapes) instead of
    tracing the 36-layer loop. ``visible``: the additive length mask [n, 1, 1, max_len] for SDPA, or
    each row's filled slot count [n] (int32) for the split-KV kernel (``engines/decode_attention.py``).
    ``reduce``: the sum over tensor-parallel ranks of a row-parallel projection's partial output
    (None: one rank). ``prefix``: the kernel's name
    (``groups`` or ``sdpa``) and the shared prefix cache's tensors it reads, None when each
    row's cache holds its prompt too; or ``layer``: ``decode_layer_attention`` rotates q and k,
    writes the step's k and v and attends in one launch (q|k|v fused weights, one rank), reading
    the prefix cache's tensors that follow (all None without one), with cos and sin [n, head_dim]
    fp32 and the whole caches, not their first n rows. ``linear``: the projections' function
    (``engines/projections.linear_for``; None: ``F.linear``)."""
    reduce = reduce or (lambda t: t)
    linear = linear or F.linear
    n = x.shape[0]
    group = heads // kv_heads
    if prefix is not None and prefix[0] == "layer":  # rotary, cache write and attention in the kernel
        ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w = layer_weights
        norm_linear = _norm_linear_of(linear)
        qkv, x = norm_linear(x, residual, ln1, eps[0], qkv_w, qkv_b, False)
        out = decode_layer_attention(qkv, cos, sin, visible, k_cache, v_cache, *prefix[1:], heads, scale)
        attended = reduce(linear(out.reshape(n, heads * head_dim), o_w))
        act, x = norm_linear(x, attended, ln2, eps[1], gate_up_w, None, True)
        return x, reduce(linear(act, down_w))
    x = _residual(x, residual)
    if len(layer_weights) == 7:  # q|k|v and gate|up each one tensor (_fused_weights)
        ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w = layer_weights
        h = _rms(x, ln1, eps[0])
        q, k, v = linear(h, qkv_w, qkv_b).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    else:
        ln1, q_w, q_b, k_w, k_b, v_w, v_b, o_w, ln2, gate_w, up_w, down_w = layer_weights
        h = _rms(x, ln1, eps[0])
        q, k, v = linear(h, q_w, q_b), linear(h, k_w, k_b), linear(h, v_w, v_b)
    q, k, v = (q.reshape(n, kv_heads, group, head_dim), k.reshape(n, kv_heads, 1, head_dim),
               v.reshape(n, kv_heads, head_dim))
    q, k = _rope(q, cos, sin), _rope(k, cos, sin).view(n, kv_heads, head_dim)
    k_cache.index_put_(where, k)  # this row's slot, every kv head
    v_cache.index_put_(where, v)
    if prefix is not None:
        kernel = {"groups": shared_prefix_attention, "sdpa": shared_prefix_attention_sdpa}[prefix[0]]
        out = kernel(q.reshape(n, heads, head_dim), *prefix[1:], k_cache[:n], v_cache[:n], visible, scale)
    elif visible.dtype == torch.int32:  # up to each row's length only
        out = split_kv_attention(q.reshape(n, heads, head_dim), k_cache[:n], v_cache[:n], visible, scale)
    else:
        # One query per row against its kv head's keys: SDPA's grouped-query mode reads each K/V head
        # once for its `group` query heads (no repeat), under the additive length mask.
        out = F.scaled_dot_product_attention(q.reshape(n, heads, 1, head_dim), k_cache[:n], v_cache[:n],
                                             attn_mask=visible, scale=scale, enable_gqa=True)
    x = _residual(x, reduce(linear(out.reshape(n, heads * head_dim), o_w)))
    h = _rms(x, ln2, eps[1])
    if len(layer_weights) == 7:
        gate, up = linear(h, gate_up_w).chunk(2, -1)
    else:
        gate, up = linear(h, gate_w), linear(h, up_w)
    return x, reduce(linear(F.silu(gate) * up, down_w))


def _fused_weights(weights: tuple) -> tuple | None:
    """(ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w) as views over one storage each, or None."""
    ln1, q_w, q_b, k_w, k_b, v_w, v_b, o_w, ln2, gate_w, up_w, down_w = weights
    if q_b is None or k_b is None or v_b is None:
        return None
    qkv_w, qkv_b = adjacent_view([q_w, k_w, v_w]), adjacent_view([q_b, k_b, v_b])
    gate_up = adjacent_view([gate_w, up_w])
    if qkv_w is None or qkv_b is None or gate_up is None:
        return None
    return ln1, qkv_w, qkv_b, o_w, ln2, gate_up, down_w


def _layer_weights(layer) -> tuple:
    a, m = layer.self_attn, layer.mlp
    return (layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
            a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, layer.post_attention_layernorm.weight,
            m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
