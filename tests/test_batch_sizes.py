"""`rollplex train` at a batch a recipe uses: 64 prompts × 8 samples per iteration on the default
engines (vLLM decode on CPU, DeepSpeed training), two iterations. Until whole prefills
(engines/vllm_decode.py), every batch above 8 prompts failed in its first decode chunk."""
from __future__ import annotations

import json

from rollplex.config import load_config
from rollplex.pipeline.run.runner import train

PROMPTS, SAMPLES = 64, 8


def test_train_runs_64_prompts_per_iteration_and_sends_no_pixels(tmp_path, monkeypatch):
    """The driver sends each iteration's prompts as item indices and the graph by name: what it
    submits stays far under Dask's large-graph warning (64 prompts' fp32 pixels alone are 19 MiB)."""
    import pickle

    import distributed

    sent: list[int] = []
    submit = distributed.Client.submit

    def measured(self, fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == "run_iteration":
            sent.append(len(pickle.dumps(args)))
        return submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(distributed.Client, "submit", measured)
    cfg = load_config(None, ["iterations=2", "warmup.steps=0", "stop_at_reward=null",
                             f"rollout.prompts_per_iteration={PROMPTS}", f"rollout.samples_per_prompt={SAMPLES}"])
    summary = train(cfg, tmp_path / "run", progress=False, log=lambda *a: None)
    assert len(sent) == 2 and max(sent) < 64 << 10, sent
    assert summary.iterations == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for it in range(2):
        rollouts = (tmp_path / "run" / "rollouts" / f"iter_{it:06d}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in rollouts]
        assert len(records) == PROMPTS * SAMPLES
        assert len({r["prompt_id"] for r in records}) == PROMPTS
        assert all(r["response_token_ids"] for r in records)
