"""LoRA end to end (train.lora), with the default CPU engines (vLLM decode on the trainer's storage,
DeepSpeed ZeRO-2 holding the adapters alone):

- serial and rollplex give the same adapters and merged checkpoints (1e-5);
- the run log measures the reference's own bytes (none: it is the base on the policy's weights);
- the logged log-probs equal plain transformers forwards of the merged export and of reference/;
- a run stopped after 2 iterations and resumed ends where the uninterrupted one does;
- a longer run (torch engine) learns the embedded task, and its export answers it in plain
  transformers, without peft.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from rollplex.config import load_config  # noqa: E402
from rollplex.pipeline.run.runner import train  # noqa: E402

ITERATIONS = 3
SEED = 3
# The embedded model is random: its frozen lm_head cannot make any answer likely, so it is a target.
LORA = "train.lora={rank: 8, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head]}"


def _config(schedule: str, iterations: int = ITERATIONS, extra: tuple[str, ...] = ()):
    return load_config(None, [f"schedule={schedule}", f"iterations={iterations}", f"seed={SEED}", "warmup.steps=3",
                              "stop_at_reward=null", "checkpoint.every=1", "checkpoint.keep_last=5", LORA, *extra])


def _run(run_dir: Path, cfg, resume: bool = False) -> list[str]:
    lines: list[str] = []
    train(cfg, run_dir, resume=resume, progress=False, log=lambda *a: lines.append(" ".join(map(str, a))))
    return lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    tmp = tmp_path_factory.mktemp("lora")
    out = {name: (tmp / name, _run(tmp / name, _config(name))) for name in ("serial", "rollplex")}
    _run(tmp / "resumed", _config("rollplex", iterations=2))
    out["resumed"] = (tmp / "resumed", _run(tmp / "resumed", _config("rollplex"), resume=True))
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    merged = load_file(str(folder / "model.safetensors"))
    adapter = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    return {**merged, **{f"adapter/{k}": v for k, v in adapter.items()}}


def _rows(run_dir: Path, iteration: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) > rtol]


@pytest.mark.slow
def test_serial_and_rollplex_give_the_same_adapters(runs):
    for iteration in range(ITERATIONS):
        name = f"checkpoints/iter_{iteration:06d}"
        a, b = _tensors(runs["serial"][0] / name), _tensors(runs["rollplex"][0] / name)
        assert any(k.startswith("adapter/") and "lora_B" in k for k in a)
        assert not _close(a, b, 1e-5), iteration


@pytest.mark.slow
def test_every_model_folder_of_a_lora_run_loads_alone_in_transformers(runs):
    """The reference (the base, the warm-up's adapters folded in), the checkpoint after the warm-up and
    the RL checkpoints (merged): model and processor, without peft."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run_dir = runs["rollplex"][0]
    folders = [run_dir / "reference", run_dir / "checkpoints" / "after_warmup",
               *sorted((run_dir / "checkpoints").glob("iter_*"))]
    assert len(folders) == 2 + ITERATIONS
    for folder in folders:
        processor = AutoProcessor.from_pretrained(folder)
        model = AutoModelForImageTextToText.from_pretrained(folder)
        assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
        assert not any("lora" in name for name, _ in model.named_parameters()), folder.name


@pytest.mark.slow
def test_the_run_log_shows_the_reference_holds_no_copy_of_the_weights(runs):
    run_dir, lines = runs["rollplex"]
    (line,) = [x for x in lines if x.startswith("lora:")]
    own, saved = map(lambda s: int(s.replace(",", "")),
                     re.search(r"ref is the base with the adapters off, on the policy's weights: ([\d,]+) bytes of "
                               r"its own, ([\d,]+) bytes", line).groups())
    assert own == 0
    # what it saves is a whole model: the size of the reference's own weights file, less its header
    file_bytes = (run_dir / "reference" / "model.safetensors").stat().st_size
    assert 0.99 * file_bytes <= saved <= file_bytes
    trained = sum(t.numel() for k, t in _tensors(run_dir / "checkpoints/iter_000000").items() if k.startswith("adapter/"))
    assert f"{trained:,} trainable parameters" in line


@pytest.mark.slow
def test_logged_logprobs_equal_plain_transformers_forwards_of_the_merged_export(runs):
    """old_logprobs of the last iteration against the previous checkpoint's merged export (the
    adapted policy, loaded without peft), ref_logprobs against reference/ (the base)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rollplex.engines.vlm import mm_token_types
    from rollplex.tasks.data import PromptBuilder, SyntheticVisualTask, build_item

    run_dir = runs["rollplex"][0]
    cfg = load_config(run_dir / "config.yaml")
    builder = PromptBuilder(AutoProcessor.from_pretrained(run_dir / "reference"))
    task = SyntheticVisualTask(kinds=tuple(cfg.task.kinds), image_size=cfg.task.image_size, size=cfg.task.size,
                               seed=cfg.seed)
    rows = _rows(run_dir, ITERATIONS - 1)[::9]
    for field, folder in (("old_logprobs", run_dir / f"checkpoints/iter_{ITERATIONS - 2:06d}"),
                          ("ref_logprobs", run_dir / "reference")):
        model = AutoModelForImageTextToText.from_pretrained(folder).eval()
        worst = 0.0
        for row in rows:
            prompt = build_item(task, builder, int(row["prompt_id"].split("-")[1]))
            ids = torch.tensor([row["prompt_token_ids"] + row["response_token_ids"]])
            with torch.no_grad():
                logits = model(input_ids=ids, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                               mm_token_type_ids=mm_token_types(ids, model.config)).logits[0].float()
            start = len(row["prompt_token_ids"])
            logp = logits[start - 1:-1].log_softmax(-1).gather(-1, torch.tensor(row["response_token_ids"])[:, None])
            worst = max(worst, float((logp[:, 0] - torch.tensor(row[field])).abs().max()))
        assert worst <= 1e-5, field
    # and the two differ: the adapters moved the policy away from its base
    assert any(r["old_logprobs"] != pytest.approx(r["ref_logprobs"], abs=1e-4) for r in rows)


@pytest.mark.slow
def test_a_resumed_lora_run_ends_where_the_uninterrupted_one_does(runs):
    resumed, lines = runs["resumed"]
    assert any("lora:" in x for x in lines)
    final = f"checkpoints/iter_{ITERATIONS - 1:06d}"
    a, b = _tensors(runs["rollplex"][0] / final), _tensors(resumed / final)
    assert a.keys() == b.keys() and not [k for k in a if not torch.equal(a[k], b[k])]
    assert _rows(runs["rollplex"][0], ITERATIONS - 1) == _rows(resumed, ITERATIONS - 1)


@pytest.mark.slow
def test_a_lora_run_learns_the_task_and_its_merged_export_answers_it_in_plain_transformers(tmp_path):
    """The embedded task with its warm-up and reward stop, the torch train engine. Greedy answers of
    the last checkpoint, from AutoModelForImageTextToText alone, on items the run drew from."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rollplex.tasks.data import SyntheticVisualTask
    from rollplex.tasks.rewards import exact_match

    cfg = load_config(None, [LORA, "engines.train=torch", "iterations=300"])
    summary = train(cfg, tmp_path / "run", progress=False, log=lambda *a: None)
    assert summary.final_reward >= 0.9 and summary.iterations < 300
    folder = tmp_path / "run" / f"checkpoints/iter_{summary.iterations - 1:06d}"
    model, processor = AutoModelForImageTextToText.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)
    task = SyntheticVisualTask(kinds=tuple(cfg.task.kinds), image_size=cfg.task.image_size, size=cfg.task.size,
                               seed=cfg.seed)
    hits = []
    for index in range(0, task.size, 16):
        item = task.item(index)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": item.question}]}]
        enc = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)], images=[item.image],
                        return_tensors="pt", return_mm_token_type_ids=True)
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
        hits.append(exact_match(processor.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True),
                                item.answer))
    assert sum(hits) / len(hits) >= 0.9, hits
