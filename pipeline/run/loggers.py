"""Where a run's metrics go besides metrics.jsonl, the record, always written (``logging.backends``):
TensorBoard event files in ``RUN_DIR/tensorboard`` and Weights & Biases.

Each metrics.jsonl row becomes scalars of its own names, grouped by what they measure: ``train/``
(loss, kl, grad_norm, clip_frac, lr and any other metric a loss returns), ``rollout/`` (rewards,
response lengths, the decode engine's log-probs against the trainer's), ``val/`` (the validation rows' names carry it already), ``time/``
(iter_seconds, eval_seconds, seconds_by_kind/<kind>), ``system/`` (memory, the prefix cache),
``data/`` and ``warmup/``. The step is the row's ``iteration``: RL iteration N at N, the warm-up's
rows at their negative iterations, and a validation at the iteration whose policy it runs.

A resumed run (or one rolled back after a lost worker) restarts the loggers at the first step it
runs again (``restart``): TensorBoard's writer starts with ``purge_step`` there, so its reader drops
what the earlier attempt logged from that step on, and the rows kept from it on are logged again.
W&B cannot drop history: a row it has seen (one of metrics.jsonl's before the restart) is not sent
again, so each step is there once, with the values first logged.
"""
from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
from pathlib import Path

from rollplex.errors import ConfigError
from rollplex.fsio import atomic_write_text

GROUPS = {
    "rollout": ("reward_mean", "reward_std", "reward_chance", "response_len_mean", "rollout_logprob_diff",
                "rollout_kl_k3"),
    "time": ("iter_seconds", "eval_seconds", "seconds_by_kind"),
    "system": ("peak_memory_bytes", "alloc_retries", "ref_cache_hit_rate", "ref_cache_bytes"),
    "data": ("data_skipped_rows",),
}
GROUP_OF = {key: group for group, keys in GROUPS.items() for key in keys}
NOT_SCALARS = ("iteration", "phase", "schedule", "warmup_step")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
WANDB_ID = "wandb_id"  # the W&B run a resumed run continues (checkpoints record its digest)


def check_installed(backends: list[str]) -> None:
    """Refuse a backend that cannot start, before anything does: its package missing, or W&B online
    without an API key (``wandb.init`` otherwise raised it once the engines had started)."""
    for name in backends:
        package = PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"logging.backends: {name} needs the {package} package (pip install {package})")
    if "wandb" in backends and os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun"):
        import wandb

        try:
            wandb.login(verify=False)  # the key from WANDB_API_KEY or netrc (a terminal may be asked); no network
        except Exception as exc:  # noqa: BLE001 - wandb's UsageError and whatever its login raises
            said = str(exc).strip().splitlines()
            raise ConfigError(f"logging.backends: wandb cannot log in ({type(exc).__name__}: "
                              f"{said[0] if said else ''}); run `wandb login`, set WANDB_API_KEY, or set "
                              "WANDB_MODE=offline") from None


def tag(key: str, phase: str) -> str:
    if "/" in key:
        return key
    if phase == "warmup":
        return f"warmup/{key}"
    return f"{GROUP_OF.get(key, 'train')}/{key}"


def scalars(row: dict) -> dict[str, float]:
    """A metrics.jsonl row as {tag: value}: its numbers, dicts of numbers flattened (time/seconds_by_kind/vit_encode)."""
    phase = row.get("phase", "rl")
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in NOT_SCALARS:
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[tag(key, phase) + (f"/{sub}" if sub is not None else "")] = float(v)
    return out


def row_key(row: dict) -> tuple[str, int]:
    return row.get("phase", "rl"), int(row["iteration"])


class TensorBoardLog:
    def __init__(self, run_dir: Path, fresh: bool) -> None:
        self.dir = run_dir / "tensorboard"
        if fresh:  # a run started from its beginning: an earlier attempt's events are not this run's
            shutil.rmtree(self.dir, ignore_errors=True)
        self.writer = None

    def restart(self, first_step: int, rows: list[dict]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        earlier = any(self.dir.glob("events.out.tfevents.*"))
        if self.writer is not None:
            self.writer.close()
        self.writer = SummaryWriter(str(self.dir), purge_step=first_step if earlier else None)
        for row in rows:  # without earlier events (first start, or TensorBoard asked for only now): all
            if not earlier or row["iteration"] >= first_step:
                self.log(row, flush=False)
        self.writer.flush()

    def log(self, row: dict, flush: bool = True) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, row["iteration"])
        if flush:
            self.writer.flush()

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbLog:
    def __init__(self, cfg, run_dir: Path, fresh: bool, logged: list[dict]) -> None:
        import wandb

        id_file = run_dir / WANDB_ID
        self.seen: set[tuple[str, int]] = set()
        if fresh or not id_file.is_file():  # a new W&B run; a resumed one continues its own
            run_id = secrets.token_hex(6)  # W&B ids: lowercase letters and digits
            atomic_write_text(id_file, run_id + "\n")
        else:
            run_id = id_file.read_text().strip()
            self.seen = {row_key(r) for r in logged}
        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(run_dir)}
        self.run = wandb.init(project=cfg.logging.wandb_project, name=run_dir.name, id=run_id, resume="allow",
                              config=cfg.to_dict(), **where)
        # A step axis of its own: W&B's _step only grows, while a run's iterations start below 0
        # (the warm-up) and a validation shares its step with an RL iteration.
        self.run.define_metric("iteration")
        self.run.define_metric("*", step_metric="iteration")

    def restart(self, first_step: int, rows: list[dict]) -> None:
        for row in rows:  # rows never sent (W&B asked for only now) are sent; seen ones are not
            self.log(row)

    def log(self, row: dict) -> None:
        key = row_key(row)
        if key in self.seen:
            return
        self.seen.add(key)
        self.run.log({**scalars(row), "iteration": row["iteration"]})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Loggers:
    """The run's backends besides jsonl. ``fresh``: the run starts from its beginning; ``logged``:
    metrics.jsonl's rows as an earlier attempt left them (what the backends were sent)."""

    def __init__(self, cfg, run_dir: Path, fresh: bool, logged: list[dict]) -> None:
        self.backends = []
        names = cfg.logging.backends
        if "tensorboard" in names:
            self.backends.append(TensorBoardLog(run_dir, fresh))
        if "wandb" in names:
            self.backends.append(WandbLog(cfg, run_dir, fresh, logged))

    def restart(self, first_step: int, rows: list[dict]) -> None:
        """The run goes on from step ``first_step``; ``rows``: metrics.jsonl as kept for it."""
        for backend in self.backends:
            backend.restart(first_step, rows)

    def log(self, row: dict) -> None:
        for backend in self.backends:
            backend.log(row)

    def close(self, failed: bool = False) -> None:
        for backend in self.backends:
            backend.close(failed)
