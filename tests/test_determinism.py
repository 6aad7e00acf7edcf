"""Determinism on CPU with the default engines (vLLM decode, DeepSpeed ZeRO-2 training): two runs with
the same seed and config write byte-identical rollouts files and equal weights and optimizer state.

The same module kills a third run of that config at a decode, an optimizer-step and a checkpoint-write
moment (SIGKILL to the whole process group, see tests/test_kill.py) and resumes it each time; it must
end equal to the uninterrupted runs (compared once run a has finished).
All three start together. Runs a and b are fresh interpreters, each with its own str-hash seed; the
killed run's launches fork from a process that imported the stack once (tests/fork_server.py).
"""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from reliability_harness import CATEGORIES, ITERATIONS, Chain, assert_same_run, kinds_per_iteration, \
    run_concurrently, run_to_end

DEFAULT_ENGINES: list[str] = []  # engines.decode/train = auto: vllm and deepspeed where installed


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state dict, by path."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_tensors(v, f"{prefix}/{k}"))
    return out


def _state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Model weights plus DeepSpeed's optimizer partitions (this run's own files, so a full unpickle)."""
    from safetensors.torch import load_file

    state = {f"model/{k}": v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    for f in sorted((checkpoint / "deepspeed").rglob("*.pt")):
        state.update(_tensors(torch.load(f, weights_only=False), f.name))
    return state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("determinism")
    a, b = root / "a", root / "b"
    a_done = threading.Event()

    def first() -> None:
        try:
            run_to_end(a, DEFAULT_ENGINES, fresh=True)
        finally:
            a_done.set()

    def killed() -> Chain:
        while not (a / "graph.txt").exists() and not a_done.is_set():  # kill points are counted on a's graph
            time.sleep(0.5)
        chain = Chain(root / "killed", a, random.Random(8), kinds_per_iteration(a / "graph.txt"),
                      DEFAULT_ENGINES, reference_ready=a_done)
        chain.run(3, timer_share=0.0)
        return chain

    *_, chain = run_concurrently(first, lambda: run_to_end(b, DEFAULT_ENGINES, fresh=True), killed)
    return a, b, chain


def test_two_runs_with_the_same_seed_are_byte_identical(runs):
    a, b, _ = runs
    for i in range(ITERATIONS):
        name = f"rollouts/iter_{i:06d}.jsonl"
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for checkpoint in sorted((a / "checkpoints").iterdir()):
        sa, sb = _state(checkpoint), _state(b / "checkpoints" / checkpoint.name)
        assert sa.keys() == sb.keys() and len(sa) > 0
        unequal = [k for k in sa if not torch.equal(sa[k], sb[k])]
        assert not unequal, (checkpoint.name, unequal[:3])
    assert_same_run(a, b)


def test_killed_at_decode_optimizer_and_checkpoint_moments_resumes_to_the_same_run(runs):
    a, _, chain = runs
    points = [k.split("#")[0] for k in chain.kills]
    assert len(points) == 3 and all(any(p in CATEGORIES[c] for p in points) for c in ("decode", "optimizer")), points
    final = f"checkpoints/iter_{ITERATIONS - 1:06d}"
    sa, sk = _state(a / final), _state(chain.root / f"run{chain.runs - 1}" / final)
    assert sa.keys() == sk.keys()
    assert not [k for k in sa if not torch.equal(sa[k], sk[k])]
