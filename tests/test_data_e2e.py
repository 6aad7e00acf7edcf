"""End to end on a file dataset: one GRPO iteration on video prompts (HF decode, torch AdamW), with a
bad row left out and counted. Video needs the hf decode engine (the vllm one takes no video embeds)."""
from __future__ import annotations

import json
from itertools import groupby

import pytest

from rollplex.config import load_config
from rollplex.pipeline.run.runner import train
from rollplex.tasks.dataset import export_synthetic

G = 2


@pytest.mark.slow
def test_one_iteration_on_video_prompts_with_a_skipped_bad_row(tmp_path, tiny_model_dir):
    from transformers import AutoConfig

    data = export_synthetic(tmp_path / "data", size=6, video_frames=4)
    with open(data, "a") as f:  # line 7: a frame that is not there
        f.write(json.dumps({"prompt": "<video>What colour?", "videos": [["images/gone.png"] * 4],
                            "answer": "red"}) + "\n")
    cfg = load_config(None, [f"data.path={data}", "data.on_bad_row=skip", "engines.decode=hf", "engines.train=torch",
                             "warmup.steps=0", "iterations=1", "stop_at_reward=null", "rollout.prompts_per_iteration=2",
                             f"rollout.samples_per_prompt={G}", "rollout.max_new_tokens=2", "rollout.chunk_tokens=2"])
    logged: list[str] = []
    train(cfg, tmp_path / "run", progress=False, log=logged.append)
    assert any("line 7: video 0 frame 0" in line and "gone.png does not exist" in line for line in logged), logged
    (metrics,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["data_skipped_rows"] == 1 and 0.0 <= metrics["reward_mean"] <= 1.0
    assert metrics["seconds_by_kind"]["vit_encode"] > 0 and metrics["seconds_by_kind"]["suffix_score"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "iter_000000.jsonl").read_text().splitlines()]
    # G samples of a prompt stay together, and each prompt carries its 4 frames' 32 video tokens.
    groups = [(pid, len(list(g))) for pid, g in groupby(rows, key=lambda r: r["prompt_id"])]
    assert len(groups) == 2 and all(n == G for _, n in groups) and len({p for p, _ in groups}) == 2
    video_pad = AutoConfig.from_pretrained(tiny_model_dir).video_token_id
    assert all(r["prompt_token_ids"].count(video_pad) == 32 for r in rows)
    assert all(len(r["ref_logprobs"]) == len(r["response_token_ids"]) > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("on_bad_row", ["skip", "reject"])
def test_a_row_that_fails_on_the_worker_is_skipped_or_rejected(tmp_path, on_bad_row):
    """Prompts are built on the worker from their item indices. A row past the first 32 whose prompt
    is longer than the probed cap fails only there: under skip the batch is taken again without it
    (counted, never in a rollout); under reject the run ends with one line naming the row."""
    from rollplex.errors import DataError

    data = export_synthetic(tmp_path / "data", size=40)
    rows = data.read_text().splitlines()
    long = json.loads(rows[35])
    long["prompt"] += " Look closely at every corner of the image before you answer." * 4
    rows[35] = json.dumps(long)
    data.write_text("\n".join(rows) + "\n")
    cfg = load_config(None, [f"data.path={data}", f"data.on_bad_row={on_bad_row}", "engines.decode=hf",
                             "engines.train=torch", "warmup.steps=0", "iterations=5", "stop_at_reward=null",
                             "rollout.prompts_per_iteration=8", f"rollout.samples_per_prompt={G}",
                             "rollout.max_new_tokens=2", "rollout.chunk_tokens=2"])
    if on_bad_row == "reject":
        with pytest.raises(DataError, match="line 36: the prompt has .* tokens, more than data.max_prompt_tokens"):
            train(cfg, tmp_path / "run", progress=False, log=lambda *a: None)
        return
    logged: list[str] = []
    train(cfg, tmp_path / "run", progress=False, log=logged.append)
    assert sum("line 36" in line for line in logged) == 1, logged
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["data_skipped_rows"] == 1
    seen = []
    for it in range(5):
        ids = {json.loads(r)["prompt_id"] for r in (tmp_path / "run" / "rollouts" / f"iter_{it:06d}.jsonl")
               .read_text().splitlines()}
        assert len(ids) == 8
        seen += ids
    assert "train-000035" not in seen
    assert len(set(seen[:32])) == 32  # epoch 0's four full batches: no row twice
