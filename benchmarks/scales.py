"""Model shapes for the benchmarks: the embedded tiny model, and an H200-scale one built the same way
(random weights, the embedded BPE tokenizer, so no download), wide as Qwen2.5-VL-3B's text model."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

SCALES = {
    "tiny": {},
    # Qwen2.5-VL-3B's text width (hidden 2048, MLP 11008, 16 heads, 2 KV heads), 8 of its 36 layers
    # and a vision tower of 8 blocks of width 1280: ~0.8B parameters with the small vocabulary. Every
    # run ends with a checkpoint (weights and ZeRO's fp32 optimizer state, ~10 GB at this size).
    "h200": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=2, vision_depth=8, vision_hidden_size=1280, vision_heads=16),
}


def model_path(scale: str, layers: int | None = None) -> Path:
    """Build (once, cached under ROLLPLEX_CACHE) and return the model directory of a scale."""
    from rollplex.engines.models import ensure_tiny_vlm
    from rollplex.tasks.data import default_model_spec

    if scale not in SCALES:
        raise SystemExit(f"--scale: {scale!r} unknown; choose one of {', '.join(SCALES)}")
    shape = dict(SCALES[scale], **({"num_hidden_layers": layers} if layers else {}))
    return ensure_tiny_vlm(replace(default_model_spec(), **shape))
