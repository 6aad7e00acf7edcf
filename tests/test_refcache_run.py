"""The reference-prefix cache in a real run: a second epoch hits it, and nothing it returns differs."""
from __future__ import annotations

import json

import torch

from rollplex.config import load_config
from rollplex.pipeline.run.runner import train


def test_second_epoch_hits_the_cache_and_the_run_is_unchanged(tmp_path):
    from safetensors.torch import load_file

    base = ["iterations=4", "seed=2", "warmup.steps=1", "stop_at_reward=null", "task.size=16",
            "engines.decode=hf", "engines.train=torch", "checkpoint.every=0"]  # 16 items, 8 per batch
    runs = {}
    for gib in (0.0, 1.0):
        out = tmp_path / f"cache{gib}"
        train(load_config(None, [*base, f"train.ref_cache_gib={gib}"]), out, progress=False, log=lambda *a: None)
        runs[gib] = out
    rows = [json.loads(line) for line in (runs[1.0] / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert rl[1]["ref_cache_hit_rate"] == 0.0  # epoch 0: every prompt new, so none is looked up
    assert rl[-1]["ref_cache_hit_rate"] == 1.0  # epoch 1: every lookup hits
    # Epoch 1 is the run's last: what it computes is never stored, since no later use could hit it.
    assert rl[1]["ref_cache_bytes"] == rl[-1]["ref_cache_bytes"] > 0
    assert "ref_cache_hit_rate" not in [r for r in
                                        (json.loads(x) for x in (runs[0.0] / "metrics.jsonl").read_text().splitlines())
                                        if r["phase"] == "rl"][0]
    for it in range(4):
        a = (runs[0.0] / "rollouts" / f"iter_{it:06d}.jsonl").read_bytes()
        b = (runs[1.0] / "rollouts" / f"iter_{it:06d}.jsonl").read_bytes()
        assert a == b, it
    wa = load_file(str(runs[0.0] / "checkpoints" / "iter_000003" / "model.safetensors"))
    wb = load_file(str(runs[1.0] / "checkpoints" / "iter_000003" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
