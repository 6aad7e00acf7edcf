"""Validation (eval.*) and the loggers (logging.backends), end to end on the embedded task.

Two tiny runs differ only in validation: with it, metrics.jsonl holds "phase": "eval" rows whose
val/* numbers are those of eval/iter_N.jsonl's responses, and the training rollouts and
checkpoints are byte for byte those of the run without it (validation changes no weight and leaves
the decode engine as it found it). TensorBoard's own event reader loads the scalars the run wrote,
and a resumed run's event files and W&B history continue without a step missing or twice.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from pathlib import Path

import fork_server
import pytest

from rollplex.config import load_config
from rollplex.pipeline.run import evaluation
from rollplex.pipeline.run.loggers import scalars

TINY = ["seed=5", "iterations=3", "rollout.prompts_per_iteration=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=2", "rollout.chunk_tokens=1", "warmup.steps=2", "warmup.batch_size=2",
        "stop_at_reward=null", "train.micro_batch_groups=1", "checkpoint.every=1", "checkpoint.keep_last=5",
        "engines.decode=hf", "engines.train=torch"]
EVAL = ["eval.every=2", "eval.before_train=true", "eval.prompts=3", "eval.samples=2", "eval.temperature=1.0",
        "logging.backends=[jsonl, tensorboard]"]
TIMING = ("iter_seconds", "eval_seconds", "seconds_by_kind", "peak_memory_bytes")


def _train(run_dir: Path, *extra: str) -> Path:
    from rollplex.pipeline.run.runner import train

    train(load_config(None, [*TINY, *extra]), run_dir, progress=False, log=lambda *a: None)
    return run_dir


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series as TensorBoard's own reader loads it (no sampling: size_guidance 0)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    reader.Reload()
    return {t: [(e.step, e.value) for e in reader.Scalars(t)] for t in reader.Tags()["scalars"]}


def _expected_scalars(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in scalars(row).items():
            series.setdefault(name, []).append((row["iteration"], value))
    return series


def _assert_tensorboard_holds(run_dir: Path, rows: list[dict]) -> None:
    loaded, expected = _tensorboard(run_dir), _expected_scalars(rows)
    assert loaded.keys() == expected.keys()
    for name, points in expected.items():
        steps = [s for s, _ in loaded[name]]
        assert steps == sorted(steps) and len(steps) == len(set(steps)), (name, steps)  # each step once
        assert [s for s, _ in points] == steps, name
        assert [v for _, v in loaded[name]] == pytest.approx([v for _, v in points], rel=1e-6), name


# -- pass@k and when validation runs --------------------------------------------------------------------
def test_pass_at_k_is_the_unbiased_estimator():
    """By hand, n = 4 samples of which c = 1 passes: pass@1 = 1/4; pass@2 = 1 − C(3,2)/C(4,2) = 1 − 3/6;
    pass@4 = 1. And on every (n, c, k) up to 6 it is the chance that k of the n drawn without
    replacement hold a passing one, by enumeration."""
    assert evaluation.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert evaluation.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert evaluation.pass_at_k(4, 1, 4) == 1.0
    assert evaluation.pass_at_k(4, 0, 4) == 0.0
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                draws = list(itertools.combinations([True] * c + [False] * (n - c), k))
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(sum(map(any, draws)) / len(draws)), (n, c, k)


def test_validation_follows_every_nth_iteration_and_the_last_and_a_resume_runs_a_missing_one():
    cfg = load_config(None, ["iterations=7", "eval.every=3", "eval.before_train=true"])
    after = [i for i in range(7) if evaluation.due_after(cfg, i, last=i == 6)]
    assert after == [2, 5, 6]
    rows = [{"phase": "eval", "iteration": 3}, {"phase": "rl", "iteration": 6}]
    assert [first for first in range(8) if evaluation.pending(cfg, first, rows)] == [0, 6, 7]
    assert not evaluation.pending(load_config(None, ["eval.every=3"]), 0, [])  # no before_train asked


def test_held_out_items_lie_beyond_the_training_items_and_are_the_same_task():
    from rollplex.tasks.data import SyntheticVisualTask
    from rollplex.tasks.dataset import make_eval_task

    cfg = load_config(None, ["task.size=16", "eval.every=1", "eval.prompts=4"])
    task = SyntheticVisualTask(size=16, seed=3)
    held = make_eval_task(cfg, task, 0)
    assert len(held) == 4 and [held.prompt_id(i) for i in range(4)] == [f"syn-{i:06d}" for i in range(16, 20)]
    larger = SyntheticVisualTask(size=20, seed=3)
    assert larger.item(17).answer == held.base.item(17).answer
    assert [larger.item(i).answer for i in range(16)] == [task.item(i).answer for i in range(16)]


class _Ranks:
    """An executor of ``ranks`` data-parallel workers that records what each rank is asked to validate
    and answers with one row per prompt."""

    def __init__(self, ranks: int) -> None:
        self.ranks, self.asked = [f"tcp://127.0.0.1:{9000 + r}" for r in range(ranks)], []

    def call_each(self, fn, args_of_rank, stream):
        self.asked.append([[ref.index for ref in args[0]] for args in args_of_rank])
        return [{"rows": [{"prompt_id": ref.prompt_id, "reward": 1.0, "response_token_ids": [1]} for ref in args[0]],
                 "skipped": []} for args in args_of_rank]


@pytest.mark.parametrize("ranks, tp", [(2, 1), (4, 1), (4, 2)])
def test_each_rank_validates_its_share_and_the_rows_keep_prompt_order(tmp_path, ranks, tp):
    """Ranks split the validation prompts (a tensor-parallel group's ranks take one share together),
    so no prompt is decoded twice, and eval/iter_N.jsonl lists them as one worker would."""
    cfg = load_config(None, ["rollout.prompts_per_iteration=4", "rollout.samples_per_prompt=2", "eval.every=1",
                             "eval.prompts=10", "eval.samples=2", "eval.temperature=1.0",
                             f"cluster.tp_rollout={tp}"])
    from rollplex.tasks.data import SyntheticVisualTask

    (tmp_path / "eval").mkdir()
    validation = evaluation.Validation(cfg, SyntheticVisualTask(size=10, seed=0), tmp_path)
    executor = _Ranks(ranks)
    validation.run(executor, 1, set())
    decoded = [i for call in executor.asked for r, share in enumerate(call) if r % tp == 0 for i in share]
    assert sorted(decoded) == list(range(10))  # each prompt once
    for call in executor.asked:  # a group's ranks decode the same share
        assert all(call[r] == call[r - r % tp] for r in range(ranks))
    written = _jsonl(tmp_path / "eval" / "iter_000001.jsonl")
    assert [r["prompt_id"] for r in written] == [f"syn-{i:06d}" for i in range(10)]


# -- end to end -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("evaluation")
    return {"plain": _train(tmp / "plain"), "eval": _train(tmp / "eval", *EVAL)}


@pytest.mark.slow
def test_eval_every_writes_val_rows_and_eval_rollouts(runs):
    run = runs["eval"]
    rows = _rows(run)
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["iteration"] for r in evals] == [0, 2, 3]  # before training, after iteration 1, after the last
    assert sorted(p.name for p in (run / "eval").iterdir()) == [f"iter_{i:06d}.jsonl" for i in (0, 2, 3)]
    # rows in the order written: an evaluation follows the RL row of the iteration before it
    order = [(r["phase"], r["iteration"]) for r in rows if r["phase"] != "warmup"]
    assert order == [("eval", 0), ("rl", 0), ("rl", 1), ("eval", 2), ("rl", 2), ("eval", 3)]
    for row in evals:
        responses = _jsonl(run / "eval" / f"iter_{row['iteration']:06d}.jsonl")
        assert len(responses) == 3 * 2 and {r["prompt_id"] for r in responses} == {"syn-000512", "syn-000513",
                                                                                      "syn-000514"}
        rewards = [r["reward"] for r in responses]
        assert row["val/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        by_prompt = {}
        for r in responses:
            by_prompt.setdefault(r["prompt_id"], []).append(r["reward"] >= 1.0)
        for k in (1, 2):
            expected = sum(evaluation.pass_at_k(2, sum(g), k) for g in by_prompt.values()) / 3
            assert row[f"val/pass@{k}"] == pytest.approx(expected)
        assert all(len(r["response_token_ids"]) <= 2 for r in responses)


@pytest.mark.slow
def test_validation_leaves_training_exactly_as_it_was(runs):
    plain, with_eval = runs["plain"], runs["eval"]
    for i in range(3):
        name = f"rollouts/iter_{i:06d}.jsonl"
        assert (plain / name).read_bytes() == (with_eval / name).read_bytes(), name
        weights = f"checkpoints/iter_{i:06d}/model.safetensors"
        assert (plain / weights).read_bytes() == (with_eval / weights).read_bytes(), weights
    assert _untimed([r for r in _rows(plain)]) == _untimed([r for r in _rows(with_eval) if r["phase"] != "eval"])


@pytest.mark.slow
def test_tensorboards_event_reader_loads_the_scalars_the_run_wrote(runs):
    rows = _rows(runs["eval"])
    loaded = _tensorboard(runs["eval"])
    for name in ("train/loss", "train/kl", "train/grad_norm", "train/clip_frac", "rollout/reward_mean",
                 "rollout/response_len_mean", "rollout/rollout_logprob_diff", "rollout/rollout_kl_k3",
                 "val/reward_mean", "val/pass@2", "time/iter_seconds",
                 "time/seconds_by_kind/decode_chunk", "warmup/warmup_loss"):
        assert name in loaded, (name, sorted(loaded))
    assert [s for s, _ in loaded["val/reward_mean"]] == [0, 2, 3]
    assert [s for s, _ in loaded["warmup/warmup_loss"]] == [-2, -1]
    _assert_tensorboard_holds(runs["eval"], rows)
    assert not (runs["plain"] / "tensorboard").exists()  # jsonl alone by default


@pytest.mark.slow
def test_a_resumed_run_continues_its_validation_and_tensorboard_steps(runs, tmp_path):
    """Rolled back to checkpoint 0 (later checkpoints deleted), with the last validation's row lost as
    if killed inside it: `rollplex train --resume RUN_DIR` replays iterations 1 and 2, validates
    again, and ends with the uninterrupted run's rows (timings aside), each step once in TensorBoard."""
    run = tmp_path / "run"
    shutil.copytree(runs["eval"], run)
    for i in (1, 2):
        shutil.rmtree(run / "checkpoints" / f"iter_{i:06d}")
    done = fork_server.run(["train", "--resume", str(run), "--no-progress"], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval    2" in done.stdout and "eval    3" in done.stdout
    assert _untimed(_rows(run)) == _untimed(_rows(runs["eval"]))
    _assert_tensorboard_holds(run, _rows(run))
    # a validation lost after its checkpoint is owed: the resumed run runs it, then nothing else
    rows = _rows(run)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    (run / "eval" / "iter_000003.jsonl").unlink()
    done = fork_server.run(["train", "--resume", str(run), "--no-progress"], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _untimed(_rows(run)) == _untimed(rows)
    assert (run / "eval" / "iter_000003.jsonl").read_bytes() == (runs["eval"] / "eval" / "iter_000003.jsonl").read_bytes()
    _assert_tensorboard_holds(run, _rows(run))
    # resumed once more from its last checkpoint (iteration 2), whose validation is kept: nothing to do
    done = fork_server.run(["train", "--resume", str(run), "--no-progress"], timeout=600)
    assert done.returncode == 0 and "eval " not in done.stdout, (done.stdout, done.stderr[-3000:])
    assert _untimed(_rows(run)) == _untimed(rows)
    _assert_tensorboard_holds(run, _rows(run))


def _wandb_history(root: Path) -> list[dict]:
    """Every history record of the offline W&B runs under ``root``, read from their .wandb files
    (LevelDB-log records of wandb's protobuf Record: 32 KiB blocks, a 7-byte header each)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(root.glob("wandb/offline-run-*/run-*.wandb")):
        data, records, pending, at = path.read_bytes(), [], b"", 7  # ":W&B" + magic + version
        while at + 7 <= len(data):
            block_left = 32768 - at % 32768
            if block_left < 7:
                at += block_left
                continue
            length, kind = int.from_bytes(data[at + 4:at + 6], "little"), data[at + 6]
            chunk, at = data[at + 7:at + 7 + length], at + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):  # FULL or LAST
                records.append(pending)
        for raw in records:
            record = pb.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                out.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return out


@pytest.mark.slow
def test_wandb_offline_logs_every_row_once_and_a_resumed_run_continues_it(tmp_path):
    """Two iterations, then rolled back to checkpoint 0 and resumed to three: W&B (offline, into
    WANDB_DIR) gets the replayed steps once, the new ones once, in the same W&B run."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb_dir"), "WANDB_SILENT": "true"}
    (tmp_path / "wandb_dir").mkdir()
    run = tmp_path / "run"
    cli = ["train", "--no-progress"]
    done = fork_server.run([*cli, "--out", str(run), "--iterations", "2", *[f"--set={s}" for s in TINY],
                            "--set=eval.every=2", "--set=eval.prompts=2", "--set=logging.backends=[wandb]"],
                           timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(run / "checkpoints" / "iter_000001")
    done = fork_server.run([*cli, "--resume", str(run), "--iterations", "3"], timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "wandb_dir").glob("wandb/offline-run-*"))
    run_id = (run / "wandb_id").read_text().strip()
    assert len(runs) == 2 and all(p.name.endswith(run_id) for p in runs)  # one W&B run, resumed
    rows = _rows(run)
    assert [(r["phase"], r["iteration"]) for r in rows if r["phase"] != "warmup"] == [
        ("rl", 0), ("rl", 1), ("eval", 2), ("rl", 2), ("eval", 3)]
    expected = _expected_scalars(rows)
    logged: dict[str, list[tuple[int, float]]] = {}
    for record in _wandb_history(tmp_path / "wandb_dir"):
        for name, value in record.items():
            if name != "iteration" and not name.startswith("_"):
                logged.setdefault(name, []).append((record["iteration"], value))
    assert logged.keys() == expected.keys()
    for name, points in expected.items():
        assert sorted(s for s, _ in logged[name]) == [s for s, _ in points], name  # each step once
    for name in ("train/loss", "rollout/reward_mean", "val/reward_mean", "val/pass@1", "warmup/warmup_loss"):
        assert [v for _, v in sorted(logged[name])] == pytest.approx([v for _, v in expected[name]]), name
