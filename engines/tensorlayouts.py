"""Where every actor tensor lives on the rollout side and on the training side, per TP degree.

A rollout tensor is described once, in the rollout engine's (vLLM's) layout, as a ``TensorLayout``:
its tensor-parallel style and the HF tensors it fuses, in order along dim 0:

- ``column``: dim 0 (outputs) is split over ranks; each fused part is split on its own, so rank r's
  fused shard is ``[q_r; k_r; v_r]`` (vLLM's QKVParallelLinear) or ``[gate_r; up_r]``
  (MergedColumnParallelLinear). Parts split in units of heads (q, k, v) or of rows; a part with fewer
  units than ranks (KV heads at t > kv_heads) is replicated, one unit per group of t/units ranks.
- ``vocab``: a column split of the vocabulary padded to a multiple of 64 (VocabParallelEmbedding,
  ParallelLMHead).
- ``row``: dim 1 (inputs) is split evenly (RowParallelLinear: o_proj, down_proj); its bias is
  ``replicated``.
- ``replicated``: every rank holds the whole tensor (norms, biases of row-parallel layers, the
  vision patch embedding).

The training side shards the same way (Megatron's column/row parallelism). How the trainer
*allocates* its shard decides what can be shared; that is the planner's input (pipeline/plan/weightshare).

Names are canonical and relative to the language model (``layers.3.self_attn.qkv_proj.weight``,
``embed_tokens.weight``, ``lm_head.weight``) or to the vision tower (``visual.blocks.0.attn.qkv.weight``);
``hf_name`` maps them onto a transformers module's names.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from rollplex.errors import ConfigError
from rollplex.engines.modelspec import VLMSpec

STYLES = ("column", "row", "vocab", "replicated")
VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Part:
    """One HF tensor (or a row range of one: HF's already-fused vision qkv) inside a rollout tensor."""

    hf: str  # canonical HF name
    rows: int  # its size along dim 0 (the whole tensor for row/replicated styles)
    units: int  # shardable units along dim 0 (heads for q/k/v, else rows)
    hf_row0: int = 0  # first row inside the HF tensor (vision qkv: 0, h, 2h)


@dataclass(frozen=True)
class TensorLayout:
    name: str  # canonical rollout name
    cls: str  # tensor class for reports: attn.qkv, attn.o, mlp.gate_up, mlp.down, embed, lm_head, norm, bias
    style: str
    parts: tuple[Part, ...]
    cols: int  # trailing size (product of dims after 0); 0 for a 1-D tensor
    trainable: bool = True
    padded_rows: int = 0  # vocab style: rows after padding to VOCAB_PAD

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ConfigError(f"tensor {self.name}: style {self.style!r} is not one of {STYLES}")

    @property
    def rows(self) -> int:
        return self.padded_rows or sum(p.rows for p in self.parts)

    @property
    def numel(self) -> int:
        return self.rows * max(self.cols, 1)

    @property
    def fused(self) -> bool:
        return len(self.parts) > 1

    # -- sharding ------------------------------------------------------------------------------
    def check(self, t: int) -> None:
        """Raise if TP degree ``t`` cannot shard this tensor."""
        if self.style == "row" and self.cols % t:
            raise ConfigError(f"tensor {self.name}: {self.cols} input columns do not split over TP {t}")
        if self.style == "vocab" and self.rows % t:
            raise ConfigError(f"tensor {self.name}: padded vocabulary {self.rows} does not split over TP {t}")
        if self.style == "column":
            for p in self.parts:
                if (p.units >= t and p.units % t) or (p.units < t and t % p.units):
                    raise ConfigError(f"tensor {self.name}: part {p.hf} has {p.units} units, which neither "
                                      f"split over nor replicate across TP {t}")

    def part_units(self, part: Part, t: int, rank: int) -> tuple[int, int]:
        """Unit range [a, b) of ``part`` that TP rank ``rank`` of ``t`` holds."""
        if part.units >= t:
            per = part.units // t
            return rank * per, (rank + 1) * per
        unit = rank // (t // part.units)  # replicated: t/units ranks share one unit
        return unit, unit + 1

    def shard_rows(self, t: int, rank: int) -> list[tuple[int, int, int]]:
        """The rank's shard along dim 0 as (part index, first row in the part, rows), in fused order.
        Row-parallel and replicated tensors keep every row."""
        if self.style in ("row", "replicated"):
            return [(i, 0, p.rows) for i, p in enumerate(self.parts)]
        if self.style == "vocab":
            per = self.rows // t
            return [(0, rank * per, per)]
        out = []
        for i, p in enumerate(self.parts):
            a, b = self.part_units(p, t, rank)
            size = p.rows // p.units
            out.append((i, a * size, (b - a) * size))
        return out

    def shard_cols(self, t: int, rank: int) -> tuple[int, int]:
        """Column range [a, b) of the rank's shard (all columns unless row-parallel)."""
        if self.style != "row":
            return 0, self.cols
        per = self.cols // t
        return rank * per, (rank + 1) * per

    def shard_numel(self, t: int, rank: int) -> int:
        rows = sum(n for _, _, n in self.shard_rows(t, rank))
        a, b = self.shard_cols(t, rank)
        return rows * max(b - a, 1)


# --------------------------------------------------------------------------------------------------
def _linear(name: str, cls: str, style: str, parts: list[Part], cols: int, bias: bool, trainable: bool,
            bias_style: str | None = None) -> list[TensorLayout]:
    out = [TensorLayout(f"{name}.weight", cls, style, tuple(parts), cols, trainable)]
    if bias:
        bparts = tuple(Part(p.hf.rsplit(".", 1)[0] + ".bias", p.rows, p.units, p.hf_row0) for p in parts)
        out.append(TensorLayout(f"{name}.bias", cls, bias_style or ("replicated" if style == "row" else style),
                                bparts, 0, trainable))
    return out


def language_layouts(m: VLMSpec) -> list[TensorLayout]:
    h, d = m.hidden, m.head_dim
    vocab_padded = -(-m.vocab // VOCAB_PAD) * VOCAB_PAD
    out = [TensorLayout("embed_tokens.weight", "embed", "vocab", (Part("embed_tokens.weight", m.vocab, m.vocab),),
                        h, padded_rows=vocab_padded)]
    for i in range(m.layers):
        p = f"layers.{i}"
        a, f = f"{p}.self_attn", f"{p}.mlp"
        out.append(TensorLayout(f"{p}.input_layernorm.weight", "norm", "replicated",
                                (Part(f"{p}.input_layernorm.weight", h, h),), 0))
        out += _linear(f"{a}.qkv_proj", "attn.qkv", "column",
                       [Part(f"{a}.q_proj.weight", m.heads * d, m.heads), Part(f"{a}.k_proj.weight", m.kv_heads * d,
                                                                              m.kv_heads),
                        Part(f"{a}.v_proj.weight", m.kv_heads * d, m.kv_heads)], h, bias=True, trainable=True)
        out += _linear(f"{a}.o_proj", "attn.o", "row", [Part(f"{a}.o_proj.weight", h, h)], m.heads * d,
                       bias=False, trainable=True)
        out.append(TensorLayout(f"{p}.post_attention_layernorm.weight", "norm", "replicated",
                                (Part(f"{p}.post_attention_layernorm.weight", h, h),), 0))
        out += _linear(f"{f}.gate_up_proj", "mlp.gate_up", "column",
                       [Part(f"{f}.gate_proj.weight", m.intermediate, m.intermediate),
                        Part(f"{f}.up_proj.weight", m.intermediate, m.intermediate)], h, bias=False, trainable=True)
        out += _linear(f"{f}.down_proj", "mlp.down", "row", [Part(f"{f}.down_proj.weight", h, h)], m.intermediate,
                       bias=False, trainable=True)
    out.append(TensorLayout("norm.weight", "norm", "replicated", (Part("norm.weight", h, h),), 0))
    if not m.tied:
        out.append(TensorLayout("lm_head.weight", "lm_head", "vocab", (Part("lm_head.weight", m.vocab, m.vocab),),
                                h, padded_rows=vocab_padded))
    return out


def vision_layouts(m: VLMSpec) -> list[TensorLayout]:
    """Qwen2.5-VL's vision tower as vLLM shards it (frozen in training: never refreshed)."""
    if not m.vit_depth:
        return []
    h, i, heads = m.vit_hidden, m.vit_intermediate, m.vit_heads
    merged = h * m.spatial_merge ** 2
    out = [TensorLayout("visual.patch_embed.proj.weight", "vision.patch", "replicated",
                        (Part("visual.patch_embed.proj.weight", h, h),), 3 * 2 * 14 * 14, trainable=False)]
    for b in range(m.vit_depth):
        p = f"visual.blocks.{b}"
        out.append(TensorLayout(f"{p}.norm1.weight", "vision.norm", "replicated", (Part(f"{p}.norm1.weight", h, h),),
                                0, trainable=False))
        out.append(TensorLayout(f"{p}.norm2.weight", "vision.norm", "replicated", (Part(f"{p}.norm2.weight", h, h),),
                                0, trainable=False))
        # HF keeps q, k, v fused already ([3h, h]); vLLM splits each by heads, so under TP its shard
        # [q_r; k_r; v_r] takes three row ranges of the one HF tensor.
        qkv = [Part(f"{p}.attn.qkv.weight", h, heads, k * h) for k in range(3)]
        out += _linear(f"{p}.attn.qkv", "vision.attn.qkv", "column", qkv, h, bias=True, trainable=False)
        out += _linear(f"{p}.attn.proj", "vision.attn.o", "row", [Part(f"{p}.attn.proj.weight", h, h)], h,
                       bias=True, trainable=False)
        out += _linear(f"{p}.mlp.gate_up_proj", "vision.mlp.gate_up", "column",
                       [Part(f"{p}.mlp.gate_proj.weight", i, i), Part(f"{p}.mlp.up_proj.weight", i, i)], h,
                       bias=True, trainable=False)
        out += _linear(f"{p}.mlp.down_proj", "vision.mlp.down", "row", [Part(f"{p}.mlp.down_proj.weight", h, h)], i,
                       bias=True, trainable=False)
    out.append(TensorLayout("visual.merger.ln_q.weight", "vision.norm", "replicated",
                            (Part("visual.merger.ln_q.weight", h, h),), 0, trainable=False))
    out += _linear("visual.merger.mlp.0", "vision.merger", "column",
                   [Part("visual.merger.mlp.0.weight", merged, merged)], merged, bias=True, trainable=False)
    out += _linear("visual.merger.mlp.2", "vision.merger", "row", [Part("visual.merger.mlp.2.weight", m.vit_out,
                                                                        m.vit_out)], merged, bias=True, trainable=False)
    return out


def actor_layouts(m: VLMSpec, vision: bool = True) -> list[TensorLayout]:
    """Every actor tensor of a Qwen2/Qwen2.5-VL model, in the rollout engine's layout."""
    return language_layouts(m) + (vision_layouts(m) if vision else [])


def hf_name(canonical: str, lm_prefix: str = "model.language_model.", vision_prefix: str = "model.") -> str:
    """The transformers module name of a canonical name: Qwen2.5-VL in transformers 5 says
    ``model.language_model.layers.*`` / ``model.visual.*``; a plain Qwen2ForCausalLM takes
    ``lm_prefix="model."``."""
    if canonical.startswith("lm_head."):
        return canonical
    if canonical.startswith("visual."):
        return vision_prefix + canonical
    return lm_prefix + canonical


def unfuse(layouts: Sequence[TensorLayout]) -> list[TensorLayout]:
    """One layout per HF tensor, for an engine that runs fused groups as separate matmuls. Parts that
    are row ranges of one HF tensor (the vision tower's qkv) stay together: that is HF's own layout."""
    out = []
    for lay in layouts:
        if len({p.hf for p in lay.parts}) == 1:
            out.append(lay)
            continue
        for p in lay.parts:
            out.append(replace(lay, name=p.hf, parts=(replace(p, hf_row0=0),)))
    return out
