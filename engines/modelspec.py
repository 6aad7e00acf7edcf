"""Model shapes for planning: a VLM's language model and vision tower as the few numbers that fix
its parameters, FLOPs and bytes. Presets for Qwen2.5-VL 3B/7B/32B; any HF ``config.json`` of the
Qwen2/Qwen2.5-VL family reads the same way (plain JSON, no transformers import).

FLOP counts are multiply-adds × 2 over the matmuls, plus attention (QKᵀ and AV, 4·n·ctx·d per
layer, where ctx is the mean number of keys a query attends to: L/2 for a causal prefill).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rollplex.errors import ConfigError


@dataclass(frozen=True)
class VLMSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    vit_depth: int = 0
    vit_hidden: int = 0
    vit_intermediate: int = 0
    vit_heads: int = 16
    vit_out: int = 0
    vit_full_layers: int = 4  # full-attention blocks; the rest attend within windows
    vit_window: int = 64  # patches per window (112 px / 14 px)²
    spatial_merge: int = 2

    # -- parameters ----------------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + (q + 2 * kv) + q * self.hidden  # qkv (+bias), o
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def lm_params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embeddings + self.hidden

    @property
    def vit_params(self) -> int:
        if not self.vit_depth:
            return 0
        h, i = self.vit_hidden, self.vit_intermediate
        block = 4 * h * h + 4 * h + 3 * h * i + 2 * i + h + 2 * h
        merged = h * self.spatial_merge**2
        merger = merged * merged + merged + merged * self.vit_out + self.vit_out + h
        return self.vit_depth * block + merger + 3 * 2 * 14 * 14 * h

    @property
    def params(self) -> int:
        return self.lm_params + self.vit_params

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    # -- FLOPs ---------------------------------------------------------------------------------
    def lm_flops(self, tokens: float, context: float, logits: float) -> float:
        """Forward FLOPs of ``tokens`` new tokens attending to ``context`` keys on average, with
        vocabulary logits for ``logits`` of them."""
        matmul = tokens * 2 * self.layers * (self.layer_params - 2 * self.hidden)
        attention = 4 * self.layers * tokens * context * self.heads * self.head_dim
        return matmul + attention + 2 * logits * self.vocab * self.hidden

    def prefill_flops(self, length: float, logits: float = 1) -> float:
        return self.lm_flops(length, length / 2, logits)

    def vit_flops(self, patches: float, per_image: float) -> float:
        """Vision tower forward over ``patches`` 14×14 patches, in images of ``per_image`` patches."""
        if not self.vit_depth:
            return 0.0
        h, i = self.vit_hidden, self.vit_intermediate
        dense = patches * 2 * (4 * h * h + 3 * h * i) * self.vit_depth
        windowed = self.vit_depth - self.vit_full_layers
        attention = 4 * patches * h * (windowed * min(self.vit_window, per_image) + self.vit_full_layers * per_image)
        merged = h * self.spatial_merge**2
        merger = patches / self.spatial_merge**2 * 2 * (merged * merged + merged * self.vit_out)
        return dense + attention + merger

    def describe(self) -> str:
        return (f"{self.name}: {self.params / 1e9:.2f}B params (LM {self.lm_params / 1e9:.2f}B, vision "
                f"{self.vit_params / 1e9:.2f}B), {self.layers} layers × {self.hidden}, {self.heads} heads / "
                f"{self.kv_heads} KV, KV {self.kv_bytes_per_token() / 1024:.0f} KiB/token (bf16)")


_QWEN_VIT = dict(vit_depth=32, vit_hidden=1280, vit_intermediate=3420, vit_heads=16)

PRESETS = {
    "qwen2.5-vl-3b": VLMSpec("qwen2.5-vl-3b", 2048, 36, 16, 2, 128, 11008, 151936, True, vit_out=2048, **_QWEN_VIT),
    "qwen2.5-vl-7b": VLMSpec("qwen2.5-vl-7b", 3584, 28, 28, 4, 128, 18944, 152064, False, vit_out=3584, **_QWEN_VIT),
    "qwen2.5-vl-32b": VLMSpec("qwen2.5-vl-32b", 5120, 64, 40, 8, 128, 27648, 152064, False, vit_out=5120,
                              **_QWEN_VIT),
}


def from_config(path: str | Path, arg: str = "--model") -> VLMSpec:
    """Read an HF config.json (text fields at the top or under ``text_config``); errors name ``arg``,
    the flag or field that gave the path."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{arg} {path}: no such preset ({', '.join(PRESETS)}) or config file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{arg} {p}: cannot read config.json: {exc}") from None
    return from_dict(data, p, arg)


def from_dict(data: dict, p: Path | str = "config.json", arg: str = "--model") -> VLMSpec:
    """An HF config as a dict (``config.to_dict()`` or a parsed config.json); ``p`` names it in errors."""
    p = Path(p)
    text = data.get("text_config") or data
    vision = data.get("vision_config") or {}

    def need(section: dict, key: str, where: str):
        value = section.get(key, data.get(key))
        if value is None:
            raise ConfigError(f"{arg} {p}: {where}{key} is missing")
        return value

    heads = need(text, "num_attention_heads", "")
    hidden = need(text, "hidden_size", "")
    vit = {}
    if vision:
        vit = dict(vit_depth=vision.get("depth", 32), vit_hidden=vision.get("hidden_size", 1280),
                   vit_intermediate=vision.get("intermediate_size", 3420), vit_heads=vision.get("num_heads", 16),
                   vit_out=vision.get("out_hidden_size", hidden),
                   vit_full_layers=len(vision.get("fullatt_block_indexes", [0] * 4)),
                   vit_window=(vision.get("window_size", 112) // vision.get("patch_size", 14)) ** 2,
                   spatial_merge=vision.get("spatial_merge_size", 2))
    return VLMSpec(
        name=(p.parent.name if p.name == "config.json" else p.stem) or str(p), hidden=hidden,
        layers=need(text, "num_hidden_layers", ""), heads=heads,
        kv_heads=text.get("num_key_value_heads", heads), head_dim=text.get("head_dim") or hidden // heads,
        intermediate=need(text, "intermediate_size", ""), vocab=need(text, "vocab_size", ""),
        tied=bool(text.get("tie_word_embeddings", data.get("tie_word_embeddings", False))), **vit)


def load_model(name_or_path: str, arg: str = "--model") -> VLMSpec:
    """A preset by name, or an HF config.json; errors name ``arg``, the flag that gave it."""
    key = name_or_path.lower()
    if key in PRESETS:
        return PRESETS[key]
    if not Path(name_or_path).exists():
        raise ConfigError(f"{arg} {name_or_path!r}: not a preset ({', '.join(PRESETS)}) and no such file")
    return from_config(name_or_path, arg)


def vision_patches(vision_tokens: int, spec: VLMSpec) -> int:
    """14×14 patches behind ``vision_tokens`` merged LM tokens."""
    return vision_tokens * spec.spatial_merge**2


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else 0

