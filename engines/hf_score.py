"""Frozen Hugging Face Qwen2.5-VL for forward-only work: the reference policy, the vision tower.

Tasks (tasks.lm) run their forwards on ``.model``; this engine only decides device and dtype and
makes sure nothing in it can be trained.
"""
from __future__ import annotations

import torch

from rollplex.engines.base import EngineContext, EngineSpec, ScoreEngine, register_engine


class HFScoreEngine(ScoreEngine):
    name = "transformers"

    def __init__(self, ctx: EngineContext):
        from transformers import Qwen2_5_VLForConditionalGeneration

        from rollplex.engines.vision_attention import batch_vision_attention

        self.device = torch.device(ctx.device)
        self.dtype = ctx.dtype
        model = ctx.options.get("module")  # a model built by the caller (rollplex bench), used as is
        if model is None:
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ctx.model_path, dtype=ctx.dtype)
        batch_vision_attention(model)  # one SDPA call per run of equal vision windows, not one per window
        model.to(self.device).eval()
        model.requires_grad_(False)
        self.model = model
        # A model on another engine's weights (LoRA's reference: the policy's base) has none of its
        # own to move off the device.
        self.shares_weights = bool(ctx.options.get("shares_weights"))
        if self.shares_weights:
            self.movable_parts = ()

    def close(self) -> None:
        self.model = None


# "hf" names the transformers decode engine; engine names are global across roles.
register_engine(EngineSpec(
    name="transformers",
    role="score",
    factory=HFScoreEngine,
    requires=("transformers",),
    description="frozen Hugging Face model for reference log-probs and vision encoding",
))
