"""Atomic, verifiable checkpoints and what resuming needs.

A checkpoint is written into a hidden temporary directory (model + optimizer from the train engine,
then ``state.json``, ``rng.pt`` and a ``manifest.json`` of sha256 checksums), fsynced, and renamed
into place. A kill at any moment leaves either the previous checkpoints or the new complete one;
``latest`` ignores temporaries and verifies checksums before trusting a directory. Directories leave
the same way they arrive: renamed out of sight first (``.trash-*``), then deleted, so a kill during
retention never leaves a half-deleted directory that still looks complete. ``clean_stale`` removes
what killed writers left behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rollplex.errors import CheckpointError
from rollplex.pipeline.run.faults import point
from rollplex.fsio import atomic_write_text, fsync_dir


@dataclass
class CheckpointState:
    iteration: int
    directory: Path
    loader: dict
    rng: dict
    reward: float | None


WARMUP = -1  # the iteration number of the checkpoint written after the supervised warm-up
WARMUP_NAME = "after_warmup"


def name_of(iteration: int) -> str:
    """iter_000042; the checkpoint after the warm-up, before RL iteration 0, is "after_warmup"."""
    return WARMUP_NAME if iteration == WARMUP else f"iter_{iteration:06d}"


def iteration_of(name: str) -> int | None:
    """The iteration a checkpoint directory's name stands for (None: not a checkpoint's name).
    Run directories written before the warm-up checkpoint had its name call it "iter_-00001"."""
    if name == WARMUP_NAME:
        return WARMUP
    try:
        return int(name.removeprefix("iter_")) if name.startswith("iter_") else None
    except ValueError:
        return None


def final_dirs(root: Path) -> list[Path]:
    """Directories under a checkpoint's final name (complete or not), by iteration."""
    found = [p for p in Path(root).glob("*") if p.is_dir() and iteration_of(p.name) is not None]
    return sorted(found, key=lambda p: iteration_of(p.name))


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
        point("checkpoint:staged")
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
        point("checkpoint:manifest")
        if final.exists():  # a run rolled back past this iteration replaces it
            _discard(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    point("checkpoint:renamed")
    _retain(root, keep_last)
    point("checkpoint:retained")
    return final


def _discard(directory: Path) -> None:
    """Rename out of sight (atomic), then delete: never a half-deleted directory under its real name."""
    trash = directory.with_name(f".trash-{directory.name}-{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(directory, trash)
    fsync_dir(directory.parent)
    shutil.rmtree(trash, ignore_errors=True)


def clean_stale(run_dir: Path) -> list[Path]:
    """Remove what writers killed mid-way left: temporary and trashed checkpoints, temporary files of
    atomic writes, the reference's staging directory. Returns what it removed."""
    run_dir = Path(run_dir)
    stale = [*(run_dir / "checkpoints").glob(".tmp-*"), *(run_dir / "checkpoints").glob(".trash-*"),
             *run_dir.glob(".reference-tmp*")]
    for sub in (run_dir, run_dir / "rollouts", run_dir / "traces"):
        stale += [p for p in sub.glob(".*.tmp") if p.is_file()]
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


def _complete(root: Path) -> list[Path]:
    """Renamed-into-place checkpoints, oldest first (by iteration: names stop sorting at 10^6)."""
    return [p for p in final_dirs(root) if (p / "manifest.json").exists()]


def retain(run_dir: Path, keep_last: int) -> None:
    """Apply retention now (a run killed between a checkpoint's rename and its retention kept one more)."""
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        _retain(root, keep_last)


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
            _discard(p)


def verify(directory: Path) -> dict:
    manifest_path = directory / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: unreadable manifest.json ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not {"state.json", "rng.pt"} <= set(files):
        raise CheckpointError(f"checkpoint {directory}: manifest.json does not list state.json and rng.pt")
    for rel, info in files.items():
        p = directory / rel
        if not isinstance(info, dict) or not {"bytes", "sha256"} <= set(info):
            raise CheckpointError(f"checkpoint {directory}: manifest.json entry for {rel} is malformed")
        if not p.is_file():
            raise CheckpointError(f"checkpoint {directory}: {rel} is missing")
        if p.stat().st_size != info["bytes"]:
            raise CheckpointError(f"checkpoint {directory}: {rel} is truncated "
                                  f"({p.stat().st_size} of {info['bytes']} bytes)")
        if _sha256(p) != info["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {rel} fails its checksum (corrupt)")
    return manifest


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def load_state(directory: Path) -> CheckpointState:
    verify(directory)
    try:
        state = json.loads((directory / "state.json").read_text())
        iteration, loader, reward = int(state["iteration"]), dict(state["loader"]), state.get("reward")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {directory}: state.json is malformed ({_first_line(exc)})") from None
    try:
        # weights_only: torch's restricted unpickler, which builds tensors and plain containers only.
        rng = torch.load(directory / "rng.pt", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"checkpoint {directory}: rng.pt cannot be read (UnpicklingError: it holds more than "
                              "tensors and plain values; refused, not unpickled)") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"checkpoint {directory}: rng.pt cannot be read ({_first_line(exc)})") from None
    return CheckpointState(iteration, directory, loader, rng, reward)


def latest(run_dir: Path) -> CheckpointState | None:
    """The newest complete checkpoint, verified. A corrupt one is refused, never skipped silently:
    the error says which earlier checkpoint removing it would fall back to."""
    done = _complete(Path(run_dir) / "checkpoints")
    if not done:
        return None
    try:
        return load_state(done[-1])
    except CheckpointError as exc:
        fallback = (f"; to resume from {done[-2].name} instead, remove {done[-1]}" if len(done) > 1
                    else "; it is the only checkpoint, so the run must start again")
        raise CheckpointError(f"{exc}{fallback}") from None


def latest_name(run_dir: Path) -> str | None:
    """The newest complete checkpoint's name, unverified (for messages)."""
    done = _complete(Path(run_dir) / "checkpoints")
    return done[-1].name if done else None


def metric_rows(path: Path) -> list[dict]:
    """Every metrics.jsonl row logged so far (a torn last line left out)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def rl_rows(path: Path) -> list[dict]:
    """The metrics.jsonl rows of the RL iterations logged so far (a torn last line left out)."""
    return [row for row in metric_rows(path) if row.get("phase") == "rl"]


def rl_rewards(path: Path) -> list[float]:
    """The mean reward of each RL iteration logged so far (a resumed run's stop_at_reward window)."""
    return [float(row["reward_mean"]) for row in rl_rows(path)]


def truncate_metrics(path: Path, iteration: int) -> None:
    """Keep warm-up rows, RL rows up to ``iteration`` and validation rows up to ``iteration + 1`` (the
    one after iteration N validates checkpoint N's policy); drop later rows and a torn last line."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        limit = iteration + 1 if row.get("phase") == "eval" else iteration
        if row.get("phase") == "warmup" or row.get("iteration", -1) <= limit:
            kept.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in kept))
