"""A rollplex-schedule run on CPU does not depend on timing: held back on its decode, compute or host
stream, or resumed from a checkpoint while held back, it writes the bits an undisturbed run writes.

Holding a stream back (a sleep before each of its nodes, on its own thread) changes what the other
streams do meanwhile: the policy's prefix graphs are built before or after earlier micro-batches'
backwards, a decode chunk's samples are scored while the next chunk runs or after it. What keeps the
bits is that each stream has one OS thread for the life of a host (autograd orders a backward by the
creation order of its forward's ops, which is per thread), that every stream thread runs with
``cluster.threads`` intra-op threads (more or fewer split CPU reductions differently), and the
ordering edges of the micro-batches (pipeline/compile/updates.py). With the compute stream's nodes dealt
round-robin to three threads instead, three of the four comparisons below fail.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from rollplex.config import load_config
from rollplex.pipeline.run import local
from rollplex.pipeline.run.runner import train

# Four micro-batches of one group, four decode chunks that hand on the samples each finished, and a
# warm-up long enough that responses end at different lengths and the rewards differ within groups.
CONFIG = ["seed=7", "iterations=3", "warmup.steps=15", "warmup.batch_size=8", "stop_at_reward=null",
          "schedule=rollplex", "engines.decode=hf", "engines.train=torch", "train.lr=1e-2",
          "rollout.prompts_per_iteration=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
          "rollout.chunk_tokens=2", "train.micro_batch_groups=1", "checkpoint.every=1", "checkpoint.keep_last=5"]
TIMING = ("iter_seconds", "seconds_by_kind", "peak_memory_bytes")


class HeldBack:
    """Wraps the executor's node runner: sleeps before every node of ``stream`` and records, per node,
    the OS thread and the intra-op thread count it ran with, and the compute stream's node order."""

    def __init__(self, stream: str | None, seconds: float = 0.1) -> None:
        self.stream, self.seconds = stream, seconds
        self.threads: dict[str, set[int]] = {}
        self.intra_op: set[int] = set()
        self.compute_order: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def wrap(self, run):
        def held_back(host, node, iteration, inputs, values):
            if node.stream == self.stream:
                time.sleep(self.seconds)
            with self._lock:
                self.threads.setdefault(node.stream, set()).add(threading.get_ident())
                self.intra_op.add(torch.get_num_threads())
                if node.stream == "compute":
                    self.compute_order.append((iteration, node.name))
            return run(host, node, iteration, inputs, values)
        return held_back


def _train(run_dir: Path, monkeypatch, held: HeldBack, resume: bool = False) -> HeldBack:
    with monkeypatch.context() as m:
        m.setattr(local, "execute_node", held.wrap(local.execute_node))
        train(load_config(None, CONFIG), run_dir, resume=resume, progress=False, log=lambda *a: None)
    return held


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _state(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    return {**load_file(str(checkpoint / "model.safetensors")),
            **{f"adam/{i}/{k}": v for i, s in optimizer.items() for k, v in s.items()}}


def _assert_same(run: Path, reference: Path) -> None:
    assert _rows(run) == _rows(reference)
    for rollouts in sorted((reference / "rollouts").iterdir()):
        assert (run / "rollouts" / rollouts.name).read_bytes() == rollouts.read_bytes(), rollouts.name
    for checkpoint in sorted((reference / "checkpoints").glob("iter_*")):
        a, b = _state(checkpoint), _state(run / "checkpoints" / checkpoint.name)
        assert a.keys() == b.keys()
        assert [k for k in a if not torch.equal(a[k], b[k])] == [], checkpoint.name


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> tuple[Path, HeldBack]:
    run = tmp_path_factory.mktemp("timing") / "undisturbed"
    with pytest.MonkeyPatch.context() as m:
        return run, _train(run, m, HeldBack(None))


@pytest.mark.slow
def test_the_run_learns_and_each_stream_keeps_one_thread(undisturbed):
    run, held = undisturbed
    rl = [r for r in _rows(run) if r["phase"] == "rl"]
    assert all(r["grad_norm"] > 0 for r in rl) and any(r["reward_std"] > 0 for r in rl)
    assert {s: len(t) for s, t in held.threads.items()} == {"decode": 1, "compute": 1, "host": 1}
    assert held.intra_op == {load_config(None, CONFIG).cluster.threads}


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["decode", "compute", "host"])
def test_a_held_back_stream_changes_the_order_but_not_the_bits(undisturbed, stream, tmp_path, monkeypatch):
    reference, _ = undisturbed
    held = _train(tmp_path / "run", monkeypatch, HeldBack(stream))
    order = {}
    for iteration, name in held.compute_order:
        order.setdefault(iteration, []).append(name)
    for names in order.values():
        prefixes = [names.index(f"prefix_actor_p{p}") for p in range(4)]
        if stream == "decode":  # the compute stream ran ahead: every policy prefix before any chunk's scoring
            assert max(prefixes) < min(i for i, n in enumerate(names) if n.startswith("suffix_ref_logprobs_c"))
        if stream == "compute":  # decode ran ahead: later micro-batches' prefixes after earlier backwards
            assert prefixes[1] > names.index("loss_m0")
    _assert_same(tmp_path / "run", reference)


@pytest.mark.slow
def test_a_run_resumed_with_its_compute_stream_held_back_ends_as_the_undisturbed_one(undisturbed, tmp_path,
                                                                                   monkeypatch):
    reference, _ = undisturbed
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    for i in (1, 2):
        shutil.rmtree(run / "checkpoints" / f"iter_{i:06d}")
    _train(run, monkeypatch, HeldBack("compute"), resume=True)
    _assert_same(run, reference)
