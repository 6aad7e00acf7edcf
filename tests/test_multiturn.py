"""Multi-turn runs end to end, on the embedded zoom task with GRPO.

Two runs of 2 iterations under the serial and the rollplex schedule (vLLM decode), with an
environment that zooms on every first turn (so every trajectory has an image between its turns),
must give the same checkpoints and rollouts; their logged reference log-probs must equal one plain
transformers forward over prompt and trajectory, every image included, at the policy's tokens. A
third run decodes with the torch engine, whose environment fails, hangs or answers per sample: the
failing samples end with their reason, the run goes on, and no earlier turn is prefilled again
(nor with vLLM in the first two).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from rollplex.config import load_config
from rollplex.pipeline.run.runner import train
from rollplex.tasks.environments import EnvSpec, StepResult, register_environment
from rollplex.tasks.zoom import ZoomEnv, ZoomTask, warmup_examples

ITERATIONS = 2
SEED = 3
BASE = ["task.name=zoom", "rollout.max_turns=2", f"iterations={ITERATIONS}", f"seed={SEED}", "warmup.steps=2",
        "stop_at_reward=null", "checkpoint.every=1", "checkpoint.keep_last=5", "rollout.prompts_per_iteration=4",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "rollout.chunk_tokens=3"]


class FirstZoom(ZoomEnv):
    """Zooms into the square's quarter on the first turn whatever the response says; the next turn's
    reward is its length modulo 3, halved, so that every group's advantages are rarely all zero and
    each update is a real one (the tiny model rarely answers right)."""

    def step(self, response):
        if not getattr(self, "zoomed", False):
            self.zoomed = True
            return super().step(f"zoom({self.prompt.meta['quadrant']})")
        return StepResult(None, float(len(response) % 3) / 2, done=True)


class Flaky(FirstZoom):
    """Sample 1 of each group fails at its first step, sample 2 hangs past the timeout."""

    def step(self, response):
        if self.prompt.sample == 1:
            raise RuntimeError("the zoom service is down")
        if self.prompt.sample == 2:
            time.sleep(3)
        return super().step(response)


register_environment(EnvSpec("first-zoom-test", FirstZoom, observation_tokens=lambda o: 40, warmup=warmup_examples))
register_environment(EnvSpec("flaky-zoom-test", Flaky, observation_tokens=lambda o: 40, warmup=warmup_examples))


def _run(tmp: Path, name: str, *extra: str) -> Path:
    run_dir = tmp / name
    train(load_config(None, BASE + list(extra)), run_dir, progress=False, log=lambda *a: None)
    return run_dir


EVAL = ["eval.every=1", "eval.before_train=true", "eval.prompts=3", "eval.samples=2", "eval.temperature=1.0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("multiturn")
    out = {s: _run(tmp, s, f"schedule={s}", "env.name=first-zoom-test") for s in ("serial", "rollplex")}
    out["noshare"] = _run(tmp, "noshare", "schedule=serial", "train.prefix_sharing=false", "env.name=first-zoom-test")
    for s in ("serial", "rollplex"):  # a vision tower that trains: the observations through each model's own
        out[f"vit-{s}"] = _run(tmp, f"vit-{s}", f"schedule={s}", "env.name=first-zoom-test",
                               "train.freeze_vision=false")
    return {**out, "validated": _run(tmp, "validated", "schedule=rollplex", "env.name=first-zoom-test", *EVAL)}


def _rows(run_dir: Path, iteration: int) -> list[dict]:
    text = (run_dir / "rollouts" / f"iter_{iteration:06d}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl"]


def _weights(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / name / "model.safetensors"))


@pytest.mark.parametrize("prefix", ["", "vit-"])
def test_serial_and_rollplex_give_the_same_checkpoints(runs, prefix):
    serial, rollplex = runs[f"{prefix}serial"], runs[f"{prefix}rollplex"]
    for iteration in range(ITERATIONS):
        a, b = (_weights(run, f"iter_{iteration:06d}") for run in (serial, rollplex))
        for key in a:
            scale = a[key].abs().max().clamp(min=1e-12)
            assert float((a[key] - b[key]).abs().max() / scale) <= 1e-5, (iteration, key)
        for x, y in zip(_rows(serial, iteration), _rows(rollplex, iteration), strict=True):
            assert x["response_token_ids"] == y["response_token_ids"] and x["reward"] == y["reward"]
            assert x["ref_logprobs"] == pytest.approx(y["ref_logprobs"], rel=1e-5, abs=1e-6)
    from safetensors.torch import load_file

    start, end = load_file(str(rollplex / "reference" / "model.safetensors")), _weights(rollplex, "iter_000001")
    moved = {k for k in end if "visual" in k and not torch.equal(start[k], end[k])}
    assert bool(moved) == (prefix == "vit-"), sorted(moved)[:3]  # the tower trains only when asked


def test_scoring_without_prefix_sharing_gives_the_same_update(runs):
    """``train.prefix_sharing: false`` scores every trajectory over its whole sequence, its prompt again
    per sample (the no-reuse baseline): the same log-probs to 1e-5 on the same weights, and an update
    equal up to summation order (‖Δ‖ ≤ 1% of the step's norm: Adam's g/√v makes rounding in a tiny
    gradient a share of lr, so an element-wise bound would not hold)."""
    for x, y in zip(_rows(runs["serial"], 0), _rows(runs["noshare"], 0), strict=True):
        assert x["response_token_ids"] == y["response_token_ids"] and x["reward"] == y["reward"]
        for key in ("ref_logprobs", "old_logprobs"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), key
    start, a, b = (_weights(runs[s], n) for s, n in (("serial", "after_warmup"), ("serial", "iter_000000"),
                                                      ("noshare", "iter_000000")))
    step = sum(float((a[k] - start[k]).norm()) ** 2 for k in a) ** 0.5
    assert step > 0 and sum(float((a[k] - b[k]).norm()) ** 2 for k in a) ** 0.5 <= 1e-2 * step
    assert _metrics(runs["noshare"])[0]["grad_norm"] == pytest.approx(_metrics(runs["serial"])[0]["grad_norm"],
                                                                      rel=1e-4)
    shared, unshared = _metrics(runs["serial"])[0], _metrics(runs["noshare"])[0]
    assert unshared["forward_tokens"] == unshared["forward_tokens_per_sample"] == shared["forward_tokens_per_sample"]
    assert shared["forward_tokens"] < shared["forward_tokens_per_sample"]


def test_every_trajectory_has_its_turns_and_the_log_says_so(runs):
    for run_dir in (runs["serial"], runs["rollplex"]):
        rows = _rows(run_dir, ITERATIONS - 1)
        assert len(rows) == 16
        for row in rows:
            mask = row["response_mask"]
            assert len(mask) == len(row["response_token_ids"]) == len(row["ref_logprobs"])
            first, second = row["turns"]
            assert first["tool_calls"] == 1 and first["sources"][0]["zoom"] >= 1
            start, end = first["observation"]
            assert mask[start:end] == [0] * (end - start) and 1 in mask[end:]  # a gap, then the policy again
            assert row["tool_calls"] == 1 and row["end_reason"] in ("done", "max_turns")
        m = _metrics(run_dir)[-1]
        assert m["tool_use_rate"] == 1.0 and m["turns_mean"] == 2.0
        assert m["forward_tokens"] < m["forward_tokens_per_sample"] < m["forward_tokens_per_turn"]
        # vLLM computed, for every continued turn, the tokens new since the sample's last turn alone.
        assert 0 < m["decode_prefill_tokens"] == m["decode_new_tokens"] < m["decode_continued_tokens"]
    graph = (runs["rollplex"] / "graph.txt").read_text()
    for node in ("%decode_t0_c0 ", "%env_t0_c1 ", "%vit_obs_t0_c0 ", "%decode_t1_c0 ", "%env_t1_c1 ", "%episodes "):
        assert node in graph, node


def test_validation_plays_whole_episodes_and_leaves_training_as_it_was(runs):
    """With eval.* on, each validation decodes the held-out prompts' episodes through the environment
    (a zoom, its image, the answer): eval/iter_N.jsonl holds trajectories like the rollouts', and the
    training rollouts and checkpoints are byte for byte those of the run without validation."""
    plain, validated = runs["rollplex"], runs["validated"]
    for i in range(ITERATIONS):
        for name in (f"rollouts/iter_{i:06d}.jsonl", f"checkpoints/iter_{i:06d}/model.safetensors"):
            assert (plain / name).read_bytes() == (validated / name).read_bytes(), name
    rows = [json.loads(line) for line in (validated / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["iteration"] for r in evals] == [0, 1, 2]
    for row in evals:
        episodes = [json.loads(line) for line in
                    (validated / "eval" / f"iter_{row['iteration']:06d}.jsonl").read_text().splitlines()]
        assert len(episodes) == 3 * 2 and len({e["prompt_id"] for e in episodes}) == 3
        for e in episodes:
            first = e["turns"][0]
            assert len(e["turns"]) == 2 and first["tool_calls"] == 1 and first["sources"][0]["zoom"] >= 1
            start, end = first["observation"]
            assert e["response_mask"][start:end] == [0] * (end - start) and 1 in e["response_mask"][end:]
            assert e["reward"] == sum(t.get("reward", 0.0) for t in e["turns"])
        assert row["val/tool_use_rate"] == 1.0 and row["val/turns_mean"] == 2.0
        assert row["val/reward_mean"] == pytest.approx(sum(e["reward"] for e in episodes) / len(episodes))
        assert row["val/response_len_mean"] == pytest.approx(
            sum(sum(e["response_mask"]) for e in episodes) / len(episodes))


def test_a_resumed_run_ends_where_the_uninterrupted_one_ends(runs, tmp_path):
    """Rolled back to checkpoint 0, the rollplex run replays iteration 1: the same trajectories (turns,
    zooms, rewards), the same metrics, the same weights."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["rollplex"], run)
    shutil.rmtree(run / "checkpoints" / f"iter_{ITERATIONS - 1:06d}")
    (run / "rollouts" / f"iter_{ITERATIONS - 1:06d}.jsonl").unlink()
    train(load_config(None, BASE + ["schedule=rollplex", "env.name=first-zoom-test"]), run, resume=True,
          progress=False, log=lambda *a: None)
    name = f"rollouts/iter_{ITERATIONS - 1:06d}.jsonl"
    assert (run / name).read_bytes() == (runs["rollplex"] / name).read_bytes()
    weights = f"checkpoints/iter_{ITERATIONS - 1:06d}/model.safetensors"
    assert (run / weights).read_bytes() == (runs["rollplex"] / weights).read_bytes()
    untimed = [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_bytes"} for r in _metrics(run)]
    assert untimed == [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_bytes"}
                       for r in _metrics(runs["rollplex"])]


def test_the_reference_scores_a_turn_while_the_next_one_decodes(runs):
    """The graph each run wrote (``rollplex graph``'s table, in topological order). Under rollplex the
    reference's node for each chunk of turn 0 reads turn 0's values alone and comes before turn 1's
    last decode chunk: it runs while turn 1 decodes. Serial runs the same nodes after that chunk (an
    ordering edge), so both schedules compute the same numbers (the checkpoints above)."""
    def lines(run: str) -> dict[str, tuple[int, str]]:
        text = (runs[run] / "graph.txt").read_text().splitlines()
        return {line.split(" ")[0]: (i, line) for i, line in enumerate(text) if line.startswith("%")}

    fused, serial = lines("rollplex"), lines("serial")
    last = "%decode_t1_c1"
    for c in range(2):
        name = f"%suffix_ref_logprobs_t0_c{c}"
        index, line = fused[name]
        assert index < fused[last][0] and "_t1_" not in line.split("(", 1)[1], line
        assert serial[name][0] > serial[last][0]


@pytest.mark.parametrize("run, model, logged", [("rollplex", "reference", "ref_logprobs"),
                                                ("vit-rollplex", "reference", "ref_logprobs"),
                                                ("vit-rollplex", "checkpoints/iter_000000", "old_logprobs")])
def test_ref_logprobs_equal_a_plain_forward_over_the_whole_trajectory(runs, run, model, logged):
    """Each logged row: prompt and trajectory through the reference model in one transformers forward,
    the prompt's image and the zoomed one (rebuilt from the logged source) as pixels; at every policy
    token its log-prob equals the logged one to 1e-5 (the environment's tokens are not the policy's).
    With a vision tower that trains, the reference's tower (the one it started with) reads both
    images, and the policy's old log-probs are those of the policy that sampled the iteration, its
    own tower (a step later than the reference's) included."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.vlm import mm_token_types
    from rollplex.tasks.data import PromptBuilder
    from rollplex.tasks.environments import EnvPrompt

    run_dir = runs[run]
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(run_dir / model).eval()
    processor = AutoProcessor.from_pretrained(run_dir / model)
    task = ZoomTask(seed=SEED)
    worst, checked = 0.0, 0
    pads = {processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
    for row in _rows(run_dir, ITERATIONS - 1)[::3]:
        if pads & {t for t, m in zip(row["response_token_ids"], row["response_mask"]) if m}:
            continue  # a placeholder the policy sampled is text to the decode engine, an image slot to transformers
        index = int(row["prompt_id"].split("-")[1])
        prompt = task.build(PromptBuilder(processor), index)
        assert prompt.input_ids.tolist() == row["prompt_token_ids"]
        env = ZoomEnv({})
        env.reset(EnvPrompt(prompt.prompt_id, prompt.text, prompt.answer, (), prompt.meta, 0, 0))
        crop = env.step(f"zoom({row['turns'][0]['sources'][0]['zoom']})").observation.images[0]
        zoomed = processor.image_processor(images=[crop], return_tensors="pt")
        ids = torch.tensor([row["prompt_token_ids"] + row["response_token_ids"]])
        with torch.no_grad():
            logits = reference(input_ids=ids, pixel_values=torch.cat([prompt.pixel_values, zoomed["pixel_values"]]),
                               image_grid_thw=torch.cat([prompt.image_grid_thw, zoomed["image_grid_thw"]]),
                               mm_token_type_ids=mm_token_types(ids, reference.config)).logits[0].float()
        start = len(row["prompt_token_ids"])
        response = torch.tensor(row["response_token_ids"]).view(-1, 1)
        logp = torch.log_softmax(logits[start - 1:-1], -1).gather(-1, response)
        mask = torch.tensor(row["response_mask"], dtype=torch.bool)
        diff = (logp.view(-1) - torch.tensor(row[logged]))[mask]
        worst, checked = max(worst, float(diff.abs().max())), checked + 1
    assert checked >= 5 and worst <= 1e-5


@pytest.fixture(scope="module")
def flaky_run(tmp_path_factory) -> Path:
    return _run(tmp_path_factory.mktemp("flaky"), "hf", "env.name=flaky-zoom-test", "env.timeout_s=1",
                "engines.decode=hf", "iterations=1")


def test_failing_and_slow_environments_end_their_samples_not_the_run(flaky_run):
    rows = _rows(flaky_run, 0)
    assert len(rows) == 16
    for row in rows:
        if row["sample"] == 1:
            assert row["end_reason"] == "env_error: RuntimeError: the zoom service is down"
        elif row["sample"] == 2:
            assert row["end_reason"].startswith("env_timeout")
        else:
            assert row["end_reason"] in ("done", "max_turns") and len(row["turns"]) == 2
        if row["sample"] in (1, 2):
            assert row["reward"] == 0.0 and len(row["turns"]) == 1 and set(row["response_mask"]) == {1}
    m = _metrics(flaky_run)[0]
    assert m["episodes_env_error"] == m["episodes_env_timeout"] == 0.25


def test_the_torch_engine_prefills_only_what_is_new(flaky_run):
    """Turn 2 of the 8 samples that got an answer: the engine computed exactly the tokens past what it
    held of turn 1 (the last sampled token and the environment's answer), never the earlier ones."""
    m = _metrics(flaky_run)[0]
    assert m["decode_prefill_tokens"] == m["decode_new_tokens"] > 0
    assert m["decode_continued_tokens"] > 2 * m["decode_new_tokens"]


def test_ppo_trains_its_actor_and_critic_on_trajectories(tmp_path):
    """PPO over two-turn trajectories: the critic's values cover the trajectory, the environment's
    tokens sit in the mask's gap, and both the actor and the critic (trunk and value head) move."""
    from safetensors.torch import load_file

    from rollplex.engines.torch_train import VALUE_HEAD_FILE

    run_dir = _run(tmp_path, "ppo", "algorithm=ppo", "engines.train=torch", "env.name=first-zoom-test")
    last = run_dir / "checkpoints" / f"iter_{ITERATIONS - 1:06d}"
    start = load_file(str(run_dir / "reference" / "model.safetensors"))  # the RL's start
    for model in ("model.safetensors", "critic/model.safetensors"):
        after = load_file(str(last / model))
        assert any(not torch.equal(after[k], start[k]) for k in after if ".layers." in k), model
    head = load_file(str(last / "critic" / VALUE_HEAD_FILE))["weight"]
    assert bool(head.abs().sum() > 0)
    m = _metrics(run_dir)[-1]
    assert m["turns_mean"] == 2.0 and "value_loss" in m and m["value_loss"] == m["value_loss"]  # finite
    for row in _rows(run_dir, ITERATIONS - 1):
        start, end = row["turns"][0]["observation"]
        assert row["response_mask"][start:end] == [0] * (end - start)
