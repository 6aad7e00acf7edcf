"""Typed run configuration: YAML in, validated dataclasses out, every error naming its field.

``load_config(path, overrides)`` reads a YAML file (or the embedded defaults), applies ``--set a.b=c``
overrides, and checks every field's type and range. Unknown fields get a did-you-mean. The resolved
config is written to the run directory as ``config.yaml`` and reloads to the same object.

The sections and fields are ``config/schema.py``, the checks that span fields ``config/checks.py``;
this module reads, writes and compares configs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rollplex.config.checks import LORA_DEFAULTS, lora_options, resolve_task_defaults, rollout_is_cap, validate
from rollplex.config.schema import RunConfig, build, describe_fields, format_fields
from rollplex.errors import ConfigError
from rollplex.yamlio import AmbiguousYAML, Dumper, Loader

__all__ = ["LORA_DEFAULTS", "MAY_CHANGE_ON_RESUME", "RunConfig", "apply_overrides", "config_changes",
           "describe_fields", "dump_config", "format_fields", "load_config", "lora_options", "read_yaml",
           "resolve_task_defaults", "rollout_is_cap", "run_config_text", "validate"]


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set rollout.temperature=0.7")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.load(raw, Loader=Loader) if raw.strip() else ""
    except AmbiguousYAML as exc:
        raise ConfigError(f"--set {item!r}: {exc.problem}") from None
    except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: e.g. 2001-13-01 looks like a date
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = node[k] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {k!r} is a value, not a section")
            node = child
        node[keys[-1]] = value
    return data


def read_yaml(path: str | Path, checksummed: bool = False) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    if p.is_dir():
        raise ConfigError(f"config file {p} is a directory, not a YAML file")
    try:
        text = p.read_text(encoding="utf-8")  # dump_config's files are written as UTF-8
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} cannot be read: {exc}") from None
    if checksummed:
        header, _, body = text.partition("\n")
        if header != _checksum_header(body):
            raise ConfigError(f"{p} fails its checksum: it was edited or damaged since the run wrote it; restore "
                              "it, or give the run's config file as the first argument")
    try:
        data = yaml.load(text, Loader=Loader)
    except (ValueError, RecursionError) as exc:  # a constructor failed, e.g. the date 2001-13-01
        raise ConfigError(f"{p}: malformed YAML: {exc or type(exc).__name__}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        what = "ambiguous" if isinstance(exc, AmbiguousYAML) else "malformed"
        raise ConfigError(f"{p}: {what} YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of fields, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                checksummed: bool = False) -> RunConfig:
    """``checksummed``: ``path`` is a run's config.yaml (``run_config_text``), refused unless its
    checksum holds."""
    data = read_yaml(path, checksummed) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    cfg = build(RunConfig, data, "")
    validate(cfg)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    return yaml.dump(cfg.to_dict(), Dumper=Dumper, sort_keys=False)


def _checksum_header(body: str) -> str:
    import hashlib

    return f"# rollplex run config; sha256 of the lines below: {hashlib.sha256(body.encode()).hexdigest()}"


def run_config_text(cfg: RunConfig) -> str:
    """A run directory's config.yaml: the resolved config under a checksum line, which a resume
    verifies before it reads the rest (``load_config(..., checksummed=True)``)."""
    body = dump_config(cfg)
    return f"{_checksum_header(body)}\n{body}"


# Fields a resume may change: how long a run goes on, how often it checkpoints, how it reaches its
# cluster, how its device memory is held (the memory plan, the allocator, recomputed activations and
# token-capped backwards: the same update, summed in another order) and where its metrics are sent
# besides metrics.jsonl; none enters what an iteration computes (validation may: it samples from the
# engines' generators). A run that ran out of device memory resumes with one of them. Every other field
# defines the run, and a resume refuses a change to it by name (a new learning rate would be recorded
# while the optimizer kept the old one; a new batch size would change the batch mid-run).
MAY_CHANGE_ON_RESUME = frozenset({
    "iterations", "stop_at_reward", "checkpoint.every", "checkpoint.keep_last", "cluster.scheduler",
    "cluster.dashboard", "cluster.tls_ca_file", "cluster.tls_cert", "cluster.tls_key", "cluster.processes",
    "cluster.cuda_allocator", "cluster.memory_budget_gib", "cluster.memory_plan", "logging.backends",
    "logging.wandb_project", "train.gradient_checkpointing", "train.micro_batch_tokens", "train.fusion_batch_tokens",
})


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves (a dict field's own keys too: params.kl_coef); an empty dict adds none."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def config_changes(before: dict, after: dict) -> dict[str, tuple[Any, Any]]:
    """{field: (before, after)} of the fields whose values differ between two ``to_dict()`` configs. A
    field ``before`` lacks (it was written before the field existed) counts as its default, which is
    what such a run computed (rollout.max_turns: 1, one turn)."""
    a, b = _flat(before), _flat(after)
    defaults = _flat(RunConfig().to_dict())
    a.update({k: defaults[k] for k in b.keys() - a.keys() if k in defaults})
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


