"""The bench's scoring workload for the benchmarks that time or weigh one training node's forwards:
the random-weight preset, its prompts and their vision output, and fresh response token ids."""
from __future__ import annotations

import math

import torch


def scoring_setup(model: str, groups: int, max_new_tokens: int, vision_tokens: int, device: str,
                  layers: int | None = None, dtype: str = "bfloat16"):
    """(BenchConfig, model, prompts, their vision embeds) for ``groups`` prompt groups of the bench."""
    from rollplex.engines import vlm
    from rollplex.pipeline.bench.bench import BenchConfig, build_model, make_prompts

    cfg = BenchConfig(model=model, prompts=groups, max_new_tokens=max_new_tokens, vision_tokens=vision_tokens,
                      device=device, dtype=dtype, layers=layers)
    built, _ = build_model(cfg)
    prompts = make_prompts(cfg, built.config, 0)
    with torch.no_grad():
        visions = vlm.vision_embeds_batch(built, prompts)
    return cfg, built, prompts, visions


def draw_responses(cfg, groups: int, vocab: int, gen: torch.Generator, capped: bool) -> list[list[list[int]]]:
    """Each group's G responses of random ids: every one at ``cfg.max_new_tokens`` (``capped``), or
    the bench's long-tailed lengths (log-normal around its mean, at least 4 tokens, capped)."""
    out = []
    for _ in range(groups):
        if capped:
            n = [cfg.max_new_tokens] * cfg.samples
        else:
            n = torch.exp(math.log(cfg.mean_new_tokens) + 0.8 * torch.randn(cfg.samples, generator=gen)).tolist()
        out.append([torch.randint(100, vocab - 100, (int(min(cfg.max_new_tokens, max(4, x))),),
                                  generator=gen).tolist() for x in n])
    return out
