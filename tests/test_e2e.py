"""End to end: the same 3 GRPO iterations under the serial and the rollplex schedule.

Each run starts a real LocalCluster (one worker, in-process on CPU, with a decode and a compute stream), vLLM
(decode), DeepSpeed ZeRO-2 (training) and the HF reference, exactly as ``rollplex train`` does.
The two schedules must agree: they only order work differently, never change what it computes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollplex.config import load_config
from rollplex.pipeline.run.runner import train
from rollplex.pipeline.plan.trace import overlap_seconds

ITERATIONS = 3
SEED = 3


def _run(tmp: Path, schedule: str) -> Path:
    cfg = load_config(None, [f"schedule={schedule}", f"iterations={ITERATIONS}", f"seed={SEED}",
                             "warmup.steps=3", "stop_at_reward=null", "checkpoint.every=1", "checkpoint.keep_last=5"])
    run_dir = tmp / schedule
    train(cfg, run_dir, progress=False, log=lambda *a: None)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("e2e")
    return {schedule: _run(tmp, schedule) for schedule in ("serial", "rollplex")}


def _rows(run_dir: Path, iteration: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_serial_and_rollplex_checkpoints_agree(runs):
    for iteration in range(ITERATIONS):
        name = f"checkpoints/iter_{iteration:06d}"
        a, b = _weights(runs["serial"] / name), _weights(runs["rollplex"] / name)
        assert a.keys() == b.keys()
        for key in a:
            scale = a[key].abs().max().clamp(min=1e-12)
            assert float((a[key] - b[key]).abs().max() / scale) <= 1e-5, (iteration, key)


def test_serial_and_rollplex_rollouts_agree(runs):
    for iteration in range(ITERATIONS):
        serial, rollplex = _rows(runs["serial"], iteration), _rows(runs["rollplex"], iteration)
        assert len(serial) == len(rollplex) == 64
        for a, b in zip(serial, rollplex):
            assert a["response_token_ids"] == b["response_token_ids"]
            assert a["reward"] == b["reward"]
            for field in ("rollout_logprobs", "ref_logprobs", "old_logprobs"):
                assert a[field] == pytest.approx(b[field], rel=1e-5, abs=1e-6), field


def test_ref_logprobs_equal_a_plain_transformers_forward(runs):
    """The logged ref log-probs (prefix once, suffixes on its KV) against one plain HF forward of the
    reference model over each full prompt+response, images included."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from rollplex.tasks.data import PromptBuilder, SyntheticVisualTask, build_item
    from rollplex.engines.vlm import mm_token_types

    run_dir = runs["rollplex"]
    cfg = load_config(run_dir / "config.yaml")
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(run_dir / "reference").eval()
    processor = AutoProcessor.from_pretrained(run_dir / "checkpoints" / "iter_000000")
    task = SyntheticVisualTask(kinds=tuple(cfg.task.kinds), image_size=cfg.task.image_size, size=cfg.task.size,
                               seed=cfg.seed)
    builder = PromptBuilder(processor)
    worst = 0.0
    for row in _rows(run_dir, ITERATIONS - 1)[::7]:
        prompt = build_item(task, builder, int(row["prompt_id"].split("-")[1]))
        assert prompt.input_ids.tolist() == row["prompt_token_ids"]
        ids = torch.tensor([row["prompt_token_ids"] + row["response_token_ids"]])
        with torch.no_grad():
            logits = reference(input_ids=ids, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                               mm_token_type_ids=mm_token_types(ids, reference.config)).logits[0].float()
        start = len(row["prompt_token_ids"])
        logp = torch.log_softmax(logits[start - 1:-1], dim=-1)
        expected = logp.gather(-1, torch.tensor(row["response_token_ids"]).view(-1, 1)).view(-1)
        worst = max(worst, float((expected - torch.tensor(row["ref_logprobs"])).abs().max()))
    assert worst <= 1e-5


def test_rollplex_runs_prefix_work_inside_the_decode_window_and_serial_does_not(runs):
    prefix_kinds, decode = {"prefix", "vit_encode"}, {"decode_chunk"}
    for iteration in range(ITERATIONS):
        serial = json.loads((runs["serial"] / "traces" / f"iter_{iteration:06d}.json").read_text())
        rollplex = json.loads((runs["rollplex"] / "traces" / f"iter_{iteration:06d}.json").read_text())
        assert overlap_seconds(serial, prefix_kinds, decode) == 0.0
        assert overlap_seconds(rollplex, prefix_kinds, decode) > 0.0


def test_run_directory_has_every_artefact(runs):
    from transformers import Qwen2_5_VLForConditionalGeneration

    run_dir = runs["rollplex"]
    assert load_config(run_dir / "config.yaml").schedule == "rollplex"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    warmup = [r for r in rows if r["phase"] == "warmup"]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(warmup) == 3 and [r["iteration"] for r in rl] == list(range(ITERATIONS))
    for r in rl:
        for key in ("reward_mean", "reward_std", "kl", "loss", "grad_norm", "response_len_mean", "iter_seconds",
                    "seconds_by_kind", "peak_memory_bytes", "alloc_retries"):
            assert key in r, key
        assert r["seconds_by_kind"]["decode_chunk"] > 0 and r["peak_memory_bytes"] > 0
        assert r["alloc_retries"] == 0  # CUDA's caching allocator only
    row = _rows(run_dir, 0)[0]
    for key in ("prompt_id", "sample", "prompt_token_ids", "response_token_ids", "text", "reward", "advantage",
                "rollout_logprobs", "ref_logprobs", "old_logprobs"):
        assert key in row, key
    trace = json.loads((run_dir / "traces" / "iter_000000.json").read_text())
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert len(tracks) == 3  # one worker: decode, compute and host streams
    # Each node's thread CPU time beside its duration: how much of it the host spent working.
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(0 <= e["args"]["host_cpu_s"] <= e["dur"] / 1e6 + 0.05 for e in spans)
    assert sum(e["args"]["host_cpu_s"] for e in spans) > 0
    final = run_dir / "checkpoints" / f"iter_{ITERATIONS - 1:06d}"
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(final)
    assert sum(p.numel() for p in model.parameters()) > 0
    for name in ("state.json", "rng.pt", "manifest.json", "tokenizer_config.json"):
        assert (final / name).exists(), name


def test_every_model_folder_loads_alone_in_transformers(runs):
    """The reference, the checkpoint after the warm-up and the RL checkpoints: model, tokenizer, processor."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run_dir = runs["rollplex"]
    folders = [run_dir / "reference", run_dir / "checkpoints" / "after_warmup",
               *sorted((run_dir / "checkpoints").glob("iter_*"))]
    assert len(folders) == 2 + ITERATIONS
    for folder in folders:
        processor = AutoProcessor.from_pretrained(folder)
        model = AutoModelForImageTextToText.from_pretrained(folder)
        assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


def test_schedule_auto_alternates_keeps_the_faster_and_resumes_to_the_same_choice(runs, tmp_path):
    """schedule: auto with one counted trial each: rollplex, serial (first runs, not counted), rollplex,
    serial, then the lower of iterations 2 and 3 for good. Stopped after iteration 2 and resumed, the
    choice is made from metrics.jsonl as an uninterrupted run would make it, and every update equals
    the serial run's: both schedules apply the same synchronous step."""
    base = ["schedule=auto", "schedule_trials=1", f"seed={SEED}", "warmup.steps=3", "stop_at_reward=null",
            "checkpoint.every=1", "checkpoint.keep_last=10"]
    run_dir = tmp_path / "auto"
    train(load_config(None, base + ["iterations=3"]), run_dir, progress=False, log=lambda *a: None)
    said: list[str] = []
    train(load_config(None, base + ["iterations=6"]), run_dir, resume=True, progress=False,
          log=lambda *a: said.append(" ".join(map(str, a))))
    rl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["phase"] == "rl"]
    assert [r["iteration"] for r in rl] == list(range(6))
    ran = [r["schedule"] for r in rl]
    faster = min(rl[2:4], key=lambda r: r["iter_seconds"])["schedule"]
    assert ran == ["rollplex", "serial", "rollplex", "serial", faster, faster]
    assert any(f"→ {faster} for the rest of the run" in line for line in said)
    for iteration in range(ITERATIONS):
        name = f"checkpoints/iter_{iteration:06d}"
        a, b = _weights(runs["serial"] / name), _weights(run_dir / name)
        for key in a:
            scale = a[key].abs().max().clamp(min=1e-12)
            assert float((a[key] - b[key]).abs().max() / scale) <= 1e-5, (iteration, key)
