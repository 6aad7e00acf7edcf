"""Atomic, verifiable checkpoints and what resuming needs.

A checkpoint is written into a hidden temporary directory (model + optimizer from the train engine,
then ``state.json``, ``rng.pt`` and a ``manifest.json`` of sha256 checksums), fsynced, and renamed
into place. A kill at any moment leaves either the previous checkpoints or the new complete one;
``latest`` ignores temporaries and verifies checksums before trusting a directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rollplex.errors import CheckpointError
from rollplex.pipeline.fsio import atomic_write_text, fsync_dir


@dataclass
class CheckpointState:
    iteration: int
    directory: Path
    loader: dict
    rng: dict
    reward: float | None


def name_of(iteration: int) -> str:
    """iter_000042; the post-warm-up checkpoint is iteration -1, "iter_-00001", which sorts first."""
    return f"iter_{iteration:06d}"


def due(iteration: int, cfg) -> bool:
    every = cfg.checkpoint.every
    return iteration == cfg.iterations - 1 or (every > 0 and (iteration + 1) % every == 0)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def capture_rng() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def restore_rng(rng: dict) -> None:
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    torch.set_rng_state(rng["torch"])


def save(run_dir: Path, iteration: int, save_model: Callable[[str], None], *, loader: dict,
         keep_last: int, reward: float | None) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / name_of(iteration)
    tmp = root / f".tmp-{name_of(iteration)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_model(str(tmp))
        torch.save(capture_rng(), tmp / "rng.pt")
        state = {"iteration": iteration, "loader": loader, "reward": reward}
        (tmp / "state.json").write_text(json.dumps(state, sort_keys=True))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {str(p.relative_to(tmp)): {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in files}
        for p in files:
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        atomic_write_text(tmp / "manifest.json", json.dumps({"iteration": iteration, "files": manifest}, indent=1))
        fsync_dir(tmp)
        if final.exists():  # a resumed run re-reaching the same iteration replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _retain(root, keep_last)
    return final


def _complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("iter_*") if (p / "manifest.json").exists())


def _retain(root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints and the one with the best reward."""
    done = _complete(root)
    best = None
    best_reward = float("-inf")
    for p in done:
        reward = json.loads((p / "state.json").read_text()).get("reward")
        if reward is not None and reward > best_reward:
            best, best_reward = p, reward
    keep = set(done[-keep_last:]) | ({best} if best else set())
    for p in done:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)


def verify(directory: Path) -> dict:
    manifest_path = directory / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: unreadable manifest.json ({exc})") from None
    for rel, info in manifest.get("files", {}).items():
        p = directory / rel
        if not p.exists():
            raise CheckpointError(f"checkpoint {directory}: {rel} is missing")
        if p.stat().st_size != info["bytes"]:
            raise CheckpointError(f"checkpoint {directory}: {rel} is truncated "
                                  f"({p.stat().st_size} of {info['bytes']} bytes)")
        if _sha256(p) != info["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {rel} fails its checksum (corrupt)")
    return manifest


def load_state(directory: Path) -> CheckpointState:
    verify(directory)
    state = json.loads((directory / "state.json").read_text())
    try:
        rng = torch.load(directory / "rng.pt", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"checkpoint {directory}: rng.pt cannot be read ({exc})") from None
    return CheckpointState(state["iteration"], directory, state["loader"], rng, state.get("reward"))


def latest(run_dir: Path) -> CheckpointState | None:
    done = _complete(Path(run_dir) / "checkpoints")
    return load_state(done[-1]) if done else None


def truncate_metrics(path: Path, iteration: int) -> None:
    """Keep warm-up rows and RL rows up to ``iteration``; drop later rows and a torn last line."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("phase") == "warmup" or row.get("iteration", -1) <= iteration:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))
