"""Atomic, verifiable checkpoints and what resuming needs.

A checkpoint is written into a hidden temporary directory (model + optimizer from the train engine,
then ``state.json``, ``rng.pt`` and a ``manifest.json`` of sha256 checksums), fsynced, and renamed
into place. A kill at any moment leaves either the previous checkpoints or the new complete one;
``latest`` ignores temporaries and verifies checksums before trusting a directory (one under its final
name without a manifest is reported, never skipped; a file its manifest does not list is refused).
Directories leave the same way they arrive: renamed out of sight first (``.trash-*``), then deleted,
so a kill during retention never leaves a half-deleted directory that still looks complete.
``clean_stale`` removes what killed writers left behind.

Everything else a resume reads is checked too: the warmed-up reference has a manifest of its own
(``verify_reference``), state.json records the config the run had and the digest of metrics.jsonl as
it stood (``kept_metrics``), and config.yaml carries its own checksum (``rollplex.config``).
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

METRICS = "metrics.jsonl"
REFERENCE = "reference"
# Files beside the checkpoints that a resume reads (loggers.WANDB_ID): each checkpoint records their
# digests as they stood, since they are written once, when the run starts.
SIDE_FILES = ("wandb_id",)


@dataclass
class CheckpointState:
    iteration: int
    directory: Path
    loader: dict
    rng: dict
    reward: float | None
    config: dict | None = None  # the resolved config the run had reached (RunConfig.to_dict())
    metrics_sha256: str | None = None  # of metrics.jsonl as it stood: the rows a resume keeps
    side_sha256: dict | None = None  # {name in SIDE_FILES: sha256} of those the run directory held


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


def write_manifest(directory: Path, iteration: int | None = None) -> None:
    """``manifest.json``: sha256 and size of every file under ``directory``, each fsynced first."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {str(p.relative_to(directory)): {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in files}
    for p in files:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    record = {"iteration": iteration, "files": manifest, "sha256": _listing_digest(manifest)}
    atomic_write_text(directory / "manifest.json", json.dumps(record, indent=1))
    fsync_dir(directory)


def _listing_digest(files: dict) -> str:
    """The manifest's own checksum, over its listing: a damaged entry is named as the manifest's."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def save(run_dir: Path, iteration: int, save_model: Callable[[str], None], *, loader: dict,
         keep_last: int, reward: float | None, config: dict | None = None) -> Path:
    """``config``: the run's resolved config, which a resume compares its own against. The digest of
    metrics.jsonl as it stands goes in too: a resume keeps those rows and reads them back."""
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
        metrics = Path(run_dir) / METRICS
        state = {"iteration": iteration, "loader": loader, "reward": reward, "config": config,
                 "metrics_sha256": hashlib.sha256(metrics.read_bytes() if metrics.exists() else b"").hexdigest(),
                 "side_sha256": {name: _sha256(Path(run_dir) / name) for name in SIDE_FILES
                                 if (Path(run_dir) / name).is_file()}}
        (tmp / "state.json").write_text(json.dumps(state, sort_keys=True))
        write_manifest(tmp, iteration)
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


def _reward(directory: Path):
    """A checkpoint's reward, from its state.json checked against its manifest (not the whole
    checkpoint: retention reads only this file of the older ones)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        text = (directory / "state.json").read_bytes()
        if (manifest["sha256"] == _listing_digest(manifest["files"])
                and hashlib.sha256(text).hexdigest() == manifest["files"]["state.json"]["sha256"]):
            return json.loads(text).get("reward")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    raise CheckpointError(f"checkpoint {directory}: state.json or manifest.json is unreadable or fails its checksum; "
                          f"remove {directory} (retention reads its reward)")


def _retain(root: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` checkpoints and the one with the best reward."""
    done = _complete(root)
    best = None
    best_reward = float("-inf")
    for p in done:
        reward = _reward(p)
        if reward is not None and reward > best_reward:
            best, best_reward = p, reward
    keep = set(done[-keep_last:]) | ({best} if best else set())
    for p in done:
        if p not in keep:
            _discard(p)


def verify(directory: Path, required: tuple[str, ...] = ("state.json", "rng.pt"), what: str = "checkpoint") -> dict:
    """Check every file ``manifest.json`` lists (size and sha256), and that it lists ``required``."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.exists():
        raise CheckpointError(f"{what} {directory} has no manifest.json, so nothing in it can be verified")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{what} {directory}: unreadable manifest.json ({type(exc).__name__})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("sha256") != _listing_digest(files):
        raise CheckpointError(f"{what} {directory}: manifest.json fails its checksum (corrupt)")
    if not set(required) <= set(files):
        raise CheckpointError(f"{what} {directory}: manifest.json does not list {' and '.join(required)}")
    for rel, info in files.items():
        p = directory / rel
        if not isinstance(info, dict) or not {"bytes", "sha256"} <= set(info):
            raise CheckpointError(f"{what} {directory}: manifest.json entry for {rel} is malformed")
        if not p.is_file():
            raise CheckpointError(f"{what} {directory}: {rel} is missing")
        if p.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{what} {directory}: {rel} is truncated "
                                  f"({p.stat().st_size} of {info['bytes']} bytes)")
        if _sha256(p) != info["sha256"]:
            raise CheckpointError(f"{what} {directory}: {rel} fails its checksum (corrupt)")
    # A loader may read what the manifest does not list (DeepSpeed globs its partitions): refused too.
    unlisted = sorted(rel for p in directory.rglob("*")
                      if p.is_file() and (rel := p.relative_to(directory).as_posix()) not in files
                      and rel != "manifest.json")
    if unlisted:
        raise CheckpointError(f"{what} {directory}: {unlisted[0]} is not in manifest.json (added after it was "
                              "written, so it cannot be verified); remove it")
    return manifest


def verify_states(run_dir: Path) -> None:
    """Every complete checkpoint's state.json against its manifest: retention reads their rewards."""
    for directory in _complete(Path(run_dir) / "checkpoints"):
        _reward(directory)


def verify_reference(run_dir: Path) -> None:
    """The warmed-up reference that a resumed run's frozen models load (written with its manifest)."""
    verify(Path(run_dir) / REFERENCE, ("config.json",), what="reference model")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def load_state(directory: Path) -> CheckpointState:
    verify(directory)
    try:
        state = json.loads((directory / "state.json").read_text())
        iteration, loader, reward = int(state["iteration"]), dict(state["loader"]), state.get("reward")
        config, metrics, side = state.get("config"), state.get("metrics_sha256"), state.get("side_sha256")
        if not all(isinstance(v, (t, type(None))) for v, t in ((config, dict), (metrics, str), (side, dict))):
            raise TypeError("config, metrics_sha256 or side_sha256 has the wrong type")
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
    return CheckpointState(iteration, directory, loader, rng, reward, config, metrics, side)


def verify_side_files(run_dir: Path, state: CheckpointState, read: set[str]) -> None:
    """Of ``read`` (the SIDE_FILES this resume reads), each one ``state`` recorded is there as it was."""
    for name, digest in sorted((state.side_sha256 or {}).items()):
        if name not in read:
            continue
        path = Path(run_dir) / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing; {state.directory.name} recorded it, and a resume reads it "
                                  "back; restore it")
        if _sha256(path) != digest:
            raise CheckpointError(f"{path} fails its checksum against {state.directory.name} (edited or damaged); "
                                  "restore it")


def latest(run_dir: Path) -> CheckpointState | None:
    """The newest complete checkpoint, verified. A corrupt one is refused, never skipped silently:
    the error says which earlier checkpoint removing it would fall back to."""
    root = Path(run_dir) / "checkpoints"
    done = _complete(root)
    # Only a complete checkpoint is renamed into place, so one without its manifest lost it afterwards.
    bare = [p for p in final_dirs(root) if p not in done]  # after_warmup too
    if bare:
        raise CheckpointError(f"checkpoint {bare[0]} has no manifest.json, so nothing in it can be verified; "
                              f"remove it to resume from {done[-1].name if done else 'the beginning'}")
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


def kept_metrics(path: Path, iteration: int, sha256: str | None = None, checkpoint: str = "") -> str:
    """The metrics.jsonl a resume from ``iteration`` keeps: warm-up rows, RL rows up to it and
    validation rows up to ``iteration + 1`` (the one after iteration N validates checkpoint N's
    policy); later rows and a torn last line dropped. With the ``sha256`` its checkpoint recorded,
    refused unless they are the rows that checkpoint saw. The validation of its own policy is written
    after it, so it is kept outside that digest (a resume runs it again when its row is missing)."""
    kept, seen = [], []
    for line in (path.read_text(encoding="utf-8", errors="replace") if path.exists() else "").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict):
            continue
        after = row.get("phase") == "eval" and row.get("iteration") == iteration + 1
        if after or row.get("phase") == "warmup" or row.get("iteration", -1) <= iteration:
            kept.append(line)
            if not after:
                seen.append(line)
    if sha256 is not None and hashlib.sha256("".join(f"{line}\n" for line in seen).encode()).hexdigest() != sha256:
        raise CheckpointError(f"{path}: its rows up to {checkpoint or name_of(iteration)} are not the ones that "
                              "checkpoint recorded (edited, damaged or missing); a resume reads them back")
    return "".join(line + "\n" for line in kept)


def truncate_metrics(path: Path, iteration: int, sha256: str | None = None, checkpoint: str = "") -> None:
    """Keep the rows ``kept_metrics`` keeps (checked against ``sha256`` when given)."""
    text = kept_metrics(path, iteration, sha256, checkpoint)
    if path.exists() or text:
        atomic_write_text(path, text)
