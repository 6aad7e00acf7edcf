"""A run as a verl/TRL user starts one: their jsonl, their model (``model.path``), the defaults.

It does no warm-up, scores against their model as the reference, runs the iterations asked for
(the embedded task's reward stop stays off, though the reward here is always above 0.9), and writes
model folders that load alone in plain transformers; docs/run-directory.md's recompute example, run on its
rollouts, gives the logged log-probs back.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rollplex.config import load_config
from rollplex.pipeline.run.runner import train
from rollplex.tasks.dataset import export_synthetic

ITERATIONS = 11  # one more than the reward stop's window of 10
RUN_DIRECTORY_DOC = Path(__file__).resolve().parents[1] / "docs" / "run-directory.md"

# Never below 0.9, never constant within a group: advantages are not all zero.
REWARD = '''
def high(text, answer):
    return 1.0 - 0.1 * (len(text) % 2)
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> Path:
    tmp = tmp_path_factory.mktemp("user")
    data = export_synthetic(tmp / "data", size=8)
    (tmp / "rewards.py").write_text(REWARD)
    cfg = load_config(None, [f"data.path={data}", f"model.path={tiny_model_dir}", f"iterations={ITERATIONS}",
                             f"task.reward={tmp / 'rewards.py'}:high", "engines.decode=hf", "engines.train=torch",
                             "rollout.prompts_per_iteration=2", "rollout.samples_per_prompt=4",
                             "rollout.max_new_tokens=4", "rollout.chunk_tokens=2", "train.lr=1e-2",
                             "checkpoint.every=1"])
    train(cfg, tmp / "run", progress=False, log=lambda *a: None)
    return tmp / "run"


def _rows(run: Path, iteration: int) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts" / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_no_warmup_the_model_is_the_reference_and_every_iteration_runs(run):
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["phase"] for m in metrics] == ["rl"] * ITERATIONS
    assert min(m["reward_mean"] for m in metrics) >= 0.9  # the embedded task's stop would have ended it at 10
    saved = load_config(run / "config.yaml")
    assert saved.warmup.steps == 0 and saved.stop_at_reward is None
    assert not (run / "reference").exists() and not (run / "checkpoints" / "after_warmup").exists()
    # Before its first update the policy is the model, and so is the reference: they score alike.
    for row in _rows(run, 0):
        assert row["ref_logprobs"] == pytest.approx(row["old_logprobs"], abs=1e-5)
    # ... and later they part: the policy trained.
    assert any(r["ref_logprobs"] != pytest.approx(r["old_logprobs"], abs=1e-4) for r in _rows(run, ITERATIONS - 1))


@pytest.mark.slow
def test_rollouts_record_each_prompts_image_files(run):
    for row in _rows(run, 0):
        (image,) = row["images"]
        assert Path(image["path"]).is_file() and Path(image["path"]).parent.name == "images"


@pytest.mark.slow
def test_every_model_folder_loads_alone_in_transformers(run):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folders = [p for p in (run / "checkpoints").iterdir() if (p / "config.json").exists()]
    assert folders
    for folder in folders:
        processor = AutoProcessor.from_pretrained(folder)
        model = AutoModelForImageTextToText.from_pretrained(folder)
        assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


def _readme_example() -> str:
    text = RUN_DIRECTORY_DOC.read_text(encoding="utf-8")
    match = re.search(r"`tests/test_user_run.py`\s+runs this example:\n\n```python\n(.*?)```", text, re.S)
    assert match, "docs/run-directory.md: the recompute example is gone"
    return match.group(1)


@pytest.mark.slow
def test_the_readme_recompute_example_gives_the_logged_logprobs(run, capsys):
    code = _readme_example()
    assert len(code.strip().splitlines()) <= 15
    n = ITERATIONS - 1
    assert '"runs/my-run", 25' in code
    scope: dict = {}
    exec(code.replace('"runs/my-run", 25', f'"{run}", {n}'), scope)  # noqa: S102 - the project's own docs
    logged = torch.tensor(scope["row"]["old_logprobs"])
    assert float((scope["logprobs"] - logged).abs().max()) <= 1e-5
    printed = float(capsys.readouterr().out.strip())
    assert printed <= 1e-5
    # Without mm_token_type_ids the model takes 1-D positions, and the log-probs are visibly off.
    model, ids, pixels = scope["model"], scope["ids"], scope["pixels"]
    start = len(scope["row"]["prompt_token_ids"])
    with torch.no_grad():
        plain = model(input_ids=ids, **pixels).logits[0, start - 1:-1].float().log_softmax(-1)
    off = plain.gather(-1, ids[0, start:, None])[:, 0]
    assert float((off - logged).abs().max()) > 1e-3


@pytest.mark.slow
def test_the_progress_bar_starts_after_the_warmup(tmp_path, monkeypatch):
    """Its rate counts RL iterations: a bar started with the run showed start-up and warm-up as the
    first iteration's seconds ("78.72 s/it")."""
    import time

    import tqdm

    started: list[float] = []

    class Bar(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            started.append(time.monotonic())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    logged: list[tuple[float, str]] = []
    cfg = load_config(None, ["iterations=1", "warmup.steps=2", "warmup.batch_size=2", "stop_at_reward=null",
                             "task.size=8", "engines.decode=hf", "engines.train=torch",
                             "rollout.prompts_per_iteration=2", "rollout.samples_per_prompt=2",
                             "rollout.max_new_tokens=2", "rollout.chunk_tokens=2"])
    train(cfg, tmp_path / "run", progress=True, log=lambda line: logged.append((time.monotonic(), line)))
    (warmed,) = [t for t, line in logged if line.startswith("warm-up done")]
    assert len(started) == 1 and started[0] > warmed


@pytest.mark.slow
def test_a_ppo_critic_folder_loads_alone_and_rollplex_reads_its_value_head(tmp_path, tiny_model_dir):
    """The critic's folder in a checkpoint is its trained trunk with the LM head it started from (so
    plain transformers loads it, no flags) and its [1, hidden] value head in value_head.safetensors,
    which Rollplex reads back and the manifest covers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rollplex.engines.torch_train import VALUE_HEAD_FILE, load_hf_weights, with_value_head
    from rollplex.errors import CheckpointError
    from rollplex.pipeline.run.checkpoints import latest

    data = export_synthetic(tmp_path / "data", size=4)
    (tmp_path / "rewards.py").write_text(REWARD)
    cfg = load_config(None, [f"data.path={data}", f"model.path={tiny_model_dir}", "iterations=2", "algorithm=ppo",
                             f"task.reward={tmp_path / 'rewards.py'}:high", "engines.decode=hf",
                             "engines.train=torch", "rollout.prompts_per_iteration=2",
                             "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "rollout.chunk_tokens=2"])
    train(cfg, tmp_path / "run", progress=False, log=lambda *a: None)
    folder = tmp_path / "run" / "checkpoints" / "iter_000001" / "critic"
    processor = AutoProcessor.from_pretrained(folder)
    critic = AutoModelForImageTextToText.from_pretrained(folder)
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == critic.config.image_token_id
    base = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    assert torch.equal(critic.lm_head.weight, base.lm_head.weight)  # the LM head it replaced
    trunk = [(n, p) for n, p in critic.named_parameters() if "language_model" in n]
    base_params = dict(base.named_parameters())
    # The trunk trained (from the second step on: the value head starts at zero).
    assert any(not torch.equal(p, base_params[n]) for n, p in trunk)
    head = load_file(str(folder / VALUE_HEAD_FILE))["weight"]
    assert head.shape == (1, critic.config.get_text_config().hidden_size) and bool(head.abs().sum() > 0)
    # Rollplex's own loading: the trunk and the value head.
    mine = with_value_head(AutoModelForImageTextToText.from_pretrained(tiny_model_dir))
    load_hf_weights(mine, folder)
    assert torch.equal(mine.lm_head.weight, head)
    assert all(torch.equal(dict(mine.named_parameters())[n], p) for n, p in trunk)
    # A critic folder of the earlier layout (the value head as its LM head) still resumes.
    mine.save_pretrained(tmp_path / "earlier")
    earlier = with_value_head(AutoModelForImageTextToText.from_pretrained(tiny_model_dir))
    load_hf_weights(earlier, tmp_path / "earlier")
    assert torch.equal(earlier.lm_head.weight, head)
    # The value head is in the checkpoint's manifest: a flipped byte is refused by name.
    blob = bytearray((folder / VALUE_HEAD_FILE).read_bytes())
    blob[-1] ^= 1
    (folder / VALUE_HEAD_FILE).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=f"critic/{VALUE_HEAD_FILE} fails its checksum"):
        latest(tmp_path / "run")
