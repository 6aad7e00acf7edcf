"""Checks of a run configuration that span fields (``validate``), and the defaults that depend on the
prompt source (``resolve_task_defaults``). A failed check raises one ``ConfigError`` naming the field."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from rollplex.config.schema import ClusterConfig, RunConfig, check_type, did_you_mean
from rollplex.errors import ConfigError


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that a single field's range cannot express."""
    if isinstance(cfg.stop_at_reward, str) and cfg.stop_at_reward != "auto":
        raise ConfigError(f"stop_at_reward: expected a number in [0, 1], null or auto, got {cfg.stop_at_reward!r}")
    if cfg.task.image_size % 28:
        raise ConfigError(f"task.image_size: {cfg.task.image_size} is not a multiple of 28 "
                          "(Qwen2.5-VL merges 2×2 patches of 14 pixels)")
    for kind in cfg.task.kinds:
        if kind not in ("colour", "shape", "count"):
            raise ConfigError(f"task.kinds: {kind!r} is not one of colour, shape, count")
    if not cfg.task.kinds:
        raise ConfigError("task.kinds: needs at least one kind")
    if len(cfg.train.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.train.betas):
        raise ConfigError(f"train.betas: expected two numbers in [0, 1), got {cfg.train.betas!r}")
    if cfg.data.path is None and cfg.rollout.prompts_per_iteration > cfg.task.size:
        raise ConfigError(f"rollout.prompts_per_iteration: {cfg.rollout.prompts_per_iteration} exceeds task.size "
                          f"({cfg.task.size}): the dataset holds fewer prompts than one iteration needs")
    if cfg.cluster.scheduler is not None:
        _validate_address(cfg.cluster.scheduler)
    _validate_tls(cfg.cluster)
    if cfg.cluster.lowering == "iteration" and cfg.cluster.workers > 1:
        raise ConfigError(f"cluster.lowering: 'iteration' runs a whole iteration on one worker; with "
                          f"cluster.workers {cfg.cluster.workers} the ranks exchange values mid-iteration "
                          f"(use nodes or auto)")
    if cfg.cluster.compute_sms and not cfg.cluster.sm_partitions:
        raise ConfigError(f"cluster.compute_sms: {cfg.cluster.compute_sms} fences compute-stream work on an SM "
                          f"partition, which needs cluster.sm_partitions: true")
    if cfg.rollout.prompts_per_iteration % cfg.train.mini_batches:
        raise ConfigError(f"train.mini_batches: {cfg.train.mini_batches} does not divide "
                          f"rollout.prompts_per_iteration ({cfg.rollout.prompts_per_iteration}): each mini-batch "
                          f"takes an equal share of the prompt groups")
    _validate_rollout_is(cfg.train.rollout_is)
    if cfg.train.clip_ratio_c is not None and cfg.train.clip_ratio_c <= 1:
        raise ConfigError(f"train.clip_ratio_c: {cfg.train.clip_ratio_c} must be above 1 (the dual clip bounds a "
                          f"negative advantage's loss beyond the PPO clip's 1 + clip_eps)")
    cfg.train.lora = lora_options(cfg.train.lora)
    if cfg.train.lora is not None and not cfg.train.freeze_vision:
        raise ConfigError("train.freeze_vision: false trains the whole vision tower, which train.lora does not "
                          "adapt (its adapters are on the language model); pick one")
    if not cfg.train.freeze_vision and cfg.train.mini_batches * cfg.train.epochs > 1:
        raise ConfigError("train.freeze_vision: false trains the vision tower in one optimizer step per batch; "
                          "with train.mini_batches × train.epochs above 1 leave it true")
    if cfg.cluster.memory_plan and not cfg.train.freeze_vision:
        raise ConfigError("cluster.memory_plan: the plan sizes a frozen vision tower, not train.freeze_vision: "
                          "false; leave one of them off")
    if cfg.cluster.memory_plan and cfg.train.lora is not None:
        raise ConfigError("cluster.memory_plan: the plan sizes full fine-tuning (its reference a copy of its own), "
                          "not train.lora; leave one of them off")
    _validate_eval(cfg)
    _validate_turns(cfg)
    cfg.rollout.length_caps = length_caps(cfg.rollout.length_caps)
    if cfg.rollout.length_caps is not None and cfg.rollout.max_turns > 1:
        raise ConfigError(f"rollout.length_caps: caps single-turn responses; rollout.max_turns is "
                          f"{cfg.rollout.max_turns} (leave one of them at its default)")
    if cfg.rollout.chunk_tokens > cfg.rollout.max_new_tokens:
        raise ConfigError(f"rollout.chunk_tokens: {cfg.rollout.chunk_tokens} exceeds rollout.max_new_tokens "
                          f"({cfg.rollout.max_new_tokens})")


def _validate_turns(cfg: RunConfig) -> None:
    """What a multi-turn run (rollout.max_turns > 1) needs, and what it does not combine with yet."""
    turns, env = cfg.rollout.max_turns, cfg.env
    if cfg.task.name == "zoom" and cfg.data.path is not None:
        raise ConfigError(f"task.name: zoom is an embedded task, but data.path ({cfg.data.path}) gives the prompts; "
                          "leave one of them out")
    if turns == 1:
        if env.name is not None:
            raise ConfigError(f"env.name: {env.name!r} answers between turns, but rollout.max_turns is 1; set "
                              "rollout.max_turns ≥ 2")
        return
    if env.name is None and not (cfg.task.name == "zoom" and cfg.data.path is None):
        raise ConfigError(f"rollout.max_turns: {turns} turns need an environment to answer between them; set "
                          "env.name (zoom is built in)")
    refused = {
        "cluster.memory_plan": (cfg.cluster.memory_plan, "the memory plan (it sizes one turn)"),
    }
    for name, (bad, what) in refused.items():
        if bad:
            raise ConfigError(f"{name}: a multi-turn run (rollout.max_turns {turns}) does not take {what} yet; "
                              "leave it at its default")


_ADDRESS = re.compile(r"(?:(?P<scheme>[a-z0-9]+)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>[0-9]+)")


def _validate_address(address: str) -> None:
    """A scheduler address as Dask takes it: [tcp:// or tls://]HOST:PORT."""
    m = _ADDRESS.fullmatch(address)
    if m is None:
        raise ConfigError(f"cluster.scheduler: {address!r} is not a Dask address; expected tcp://HOST:PORT "
                          "(or tls://HOST:PORT)")
    if m["scheme"] not in (None, "tcp", "tls"):
        raise ConfigError(f"cluster.scheduler: {address!r}: protocol {m['scheme']!r} is not one of tcp, tls")
    if not 1 <= int(m["port"]) <= 65535:
        raise ConfigError(f"cluster.scheduler: {address!r}: port {int(m['port'])} is not in 1..65535")


def length_caps(value: dict | None) -> dict | None:
    """``rollout.length_caps`` checked key by key: {mean: tokens > 0, sigma: ≥ 0 (default 0.8)}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"rollout.length_caps: expected {{mean: N, sigma: S}} or null, got {value!r}")
    for key in value:
        if key not in ("mean", "sigma"):
            raise ConfigError(f"unknown field rollout.length_caps.{key}{did_you_mean(str(key), ['mean', 'sigma'])}")
    if "mean" not in value:
        raise ConfigError("rollout.length_caps.mean: missing (the draw's median length in tokens, e.g. 96)")
    mean = check_type("rollout.length_caps.mean", value["mean"], float)
    if not 0 < mean <= 2**20:
        raise ConfigError(f"rollout.length_caps.mean: {mean} is not in (0, 1048576]")
    sigma = check_type("rollout.length_caps.sigma", value.get("sigma", 0.8), float)
    if not 0 <= sigma <= 10:
        raise ConfigError(f"rollout.length_caps.sigma: {sigma} is not in [0, 10]")
    return {"mean": float(mean), "sigma": float(sigma)}


LORA_DEFAULTS = {"rank": 8, "alpha": 16.0, "dropout": 0.0,
                 "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def lora_options(value: dict | None) -> dict | None:
    """``train.lora`` with its missing keys filled in, each key checked by name (None: LoRA off)."""
    if value is None:
        return None
    for key in value:
        if key not in LORA_DEFAULTS:
            raise ConfigError(f"unknown field train.lora.{key}{did_you_mean(str(key), list(LORA_DEFAULTS))}")
    out = {**LORA_DEFAULTS, **value}
    rank = check_type("train.lora.rank", out["rank"], int)
    if rank < 1:
        raise ConfigError(f"train.lora.rank: {rank} is below the minimum 1")
    if rank > 65536:
        raise ConfigError(f"train.lora.rank: {rank} is above the maximum 65536")
    alpha = check_type("train.lora.alpha", out["alpha"], float)
    if alpha <= 0:
        raise ConfigError(f"train.lora.alpha: {alpha} must be above 0 (the adapter's update is scaled by alpha/rank)")
    if alpha > 1e6:
        raise ConfigError(f"train.lora.alpha: {alpha} is above the maximum 1000000.0")
    dropout = check_type("train.lora.dropout", out["dropout"], float)
    if not 0 <= dropout < 1:
        raise ConfigError(f"train.lora.dropout: {dropout} is not in [0, 1)")
    targets = check_type("train.lora.target_modules", out["target_modules"], list)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"train.lora.target_modules: expected a non-empty list of module names such as q_proj, "
                          f"got {targets!r}")
    return {"rank": rank, "alpha": alpha, "dropout": dropout, "target_modules": list(targets)}


# The embedded task's walk-through (README): a warm-up that teaches the answer format and a stop once
# GRPO has solved it. A user's data and model get RL from their model for the iterations asked.
EMBEDDED_WARMUP_STEPS = 40
# The zoom task's warm-up also teaches which zoom call the question's quarter asks for (README).
ZOOM_WARMUP_STEPS = 100
EMBEDDED_STOP_AT_REWARD = 0.9


def resolve_task_defaults(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``warmup.steps: null`` and ``stop_at_reward: auto`` made concrete for its prompt source."""
    embedded = cfg.data.path is None
    default = (ZOOM_WARMUP_STEPS if cfg.task.name == "zoom" else EMBEDDED_WARMUP_STEPS) if embedded else 0
    steps = cfg.warmup.steps if cfg.warmup.steps is not None else default
    stop = cfg.stop_at_reward
    if stop == "auto":
        stop = EMBEDDED_STOP_AT_REWARD if embedded else None
    return dataclasses.replace(cfg, warmup=dataclasses.replace(cfg.warmup, steps=steps), stop_at_reward=stop)


def _validate_rollout_is(options: dict) -> None:
    unknown = sorted(set(options) - {"cap"})
    if unknown:
        raise ConfigError(f"train.rollout_is: unknown key {unknown[0]!r}; expected {{cap: C}} with C ≥ 1, or {{}} for off")
    cap = options.get("cap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1
                            or math.isinf(cap)):
        raise ConfigError(f"train.rollout_is.cap: expected a finite number ≥ 1 (the largest importance weight), "
                          f"got {cap!r}")


def rollout_is_cap(cfg: RunConfig) -> float | None:
    """``train.rollout_is``'s cap as a float, or None when off."""
    cap = cfg.train.rollout_is.get("cap")
    return None if cap is None else float(cap)


LOGGING_BACKENDS = ("jsonl", "tensorboard", "wandb")


def _validate_eval(cfg: RunConfig) -> None:
    for name in cfg.logging.backends:
        if name not in LOGGING_BACKENDS:
            raise ConfigError(f"logging.backends: {name!r} is not one of {', '.join(LOGGING_BACKENDS)}")
    e = cfg.eval
    if e.samples > 1 and e.temperature == 0:
        raise ConfigError(f"eval.samples: {e.samples} greedy responses (eval.temperature 0) are one response "
                          "repeated; set eval.temperature above 0 or eval.samples: 1")
    batch = cfg.rollout.prompts_per_iteration * cfg.rollout.samples_per_prompt
    if e.samples > batch:  # the decode engine is sized for one rollout batch of sequences
        raise ConfigError(f"eval.samples: {e.samples} exceeds the {batch} sequences of a rollout batch "
                          "(rollout.prompts_per_iteration × rollout.samples_per_prompt) the decode engine holds")
    if (e.every or e.before_train) and cfg.cluster.memory_plan:
        raise ConfigError("eval.every: validation runs between iterations, which cluster.memory_plan does not "
                          "plan for (it may free the KV pool and offload weights across them); turn one off")
    if (e.every or e.before_train) and cfg.data.val_path is None:
        if cfg.data.path is not None:
            asked = "eval.every" if e.every else "eval.before_train"
            raise ConfigError(f"{asked}: validation on data.path needs data.val_path (a held-out file; only the "
                              "embedded task holds out items of its own)")
        if e.prompts == 0:
            raise ConfigError("eval.prompts: 0 (all rows) needs data.val_path; on the embedded task give the "
                              "number of held-out items")


def _validate_tls(c: ClusterConfig) -> None:
    given = {name: getattr(c, name) for name in ("tls_ca_file", "tls_cert", "tls_key")}
    if not any(given.values()):
        if (c.scheduler or "").startswith("tls://"):
            raise ConfigError(f"cluster.scheduler: {c.scheduler} is a TLS address; give cluster.tls_ca_file, "
                              "tls_cert and tls_key")
        return
    missing = [f"cluster.{n}" for n, v in given.items() if not v]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: TLS needs all of cluster.tls_ca_file, tls_cert and tls_key")
    for name, value in given.items():
        if not Path(value).exists():
            raise ConfigError(f"cluster.{name}: {value} does not exist")
        if not Path(value).is_file():
            raise ConfigError(f"cluster.{name}: {value} is not a file (a PEM file is expected)")
    if not (c.scheduler or "").startswith("tls://"):
        raise ConfigError(f"cluster.scheduler: TLS options need a tls://HOST:PORT scheduler address, got "
                          f"{c.scheduler!r} (a LocalCluster stays on loopback and needs no TLS)")


