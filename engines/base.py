"""One small interface per engine role, and a registry that refuses duplicates.

Roles:
- ``decode``: owns a sampling engine with its own copy (or view) of the policy weights. It takes
  requests, advances them in chunks of tokens, and reloads weights in place.
- ``score``: owns a frozen model (reference, vision tower) and runs forward passes on it.
- ``train``: owns the trainable model, its optimizer and gradients.

Engines import their heavy libraries (vllm, deepspeed) inside their constructors, so listing them
and importing ``rollplex`` stay fast and work without those libraries.
"""
from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollplex.errors import EngineError

ROLES = ("decode", "score", "train")


# --------------------------------------------------------------------------------------------------
# decode
@dataclass
class DecodeRequest:
    """One sequence to sample. ``prompt_token_ids`` are the HF-expanded ids (one image pad per vision
    token), exactly what the scorer sees; ``image_embeds`` is the vit_encode output for the prompt.
    ``temperature == 0`` means greedy decoding in every engine (its log-probs are then those of the
    raw distribution); otherwise log-probs are under the temperature- and top-p-processed one."""

    request_id: str
    prompt_token_ids: list[int]
    image_embeds: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    max_tokens: int
    seed: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # samples of this prompt; sample i draws with seed + i. They finish together.
    # A video prompt's vit_encode output and grids (M-RoPE needs the frame timing too).
    video_embeds: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    # Multi-turn decode. ``keep_kv``: the request's samples will be continued, so an engine that can
    # keeps each finished sample's KV (``hf``: parked per sample; vLLM: its prefix cache keeps them).
    # ``continues``: the (request id, sample) whose finished sequence this one extends; its
    # ``prompt_token_ids`` (and image embeddings) are then the whole context, that sequence's prompt
    # and tokens first, and only the tokens past what the engine holds are prefilled.
    keep_kv: bool = False
    continues: tuple[str, int] | None = None


@dataclass
class FinishedSequence:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" | "length"
    index: int = 0  # which of the request's n samples
    # Prompt tokens whose KV the engine did not compute for this request (a prefix cache hit, or a
    # continued sequence's KV); None where the engine does not say.
    cached_tokens: int | None = None


class DecodeEngine(ABC):
    role = "decode"

    @abstractmethod
    def add_requests(self, requests: Sequence[DecodeRequest]) -> None:
        """Queue requests; prefill happens on the next ``step``."""

    @abstractmethod
    def step(self, max_tokens: int) -> list[FinishedSequence]:
        """Advance every live sequence by up to ``max_tokens`` tokens; return those that finished."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the policy weights in place (HF parameter names), without a restart."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


# --------------------------------------------------------------------------------------------------
# score and train
def move_tensors(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Re-home each tensor's storage on ``device`` in place (``.data``), so every holder of the
    tensor object (optimizer state, parameters, autograd) sees the move. Returns bytes moved."""
    moved = 0
    pin = device.type == "cpu" and torch.cuda.is_available()
    for t in tensors:
        if t.device == device:
            continue
        # Pinned host buffers make the later host→device prefetch an async DMA, not a staged copy.
        t.data = t.data.to("cpu", non_blocking=False).pin_memory() if pin else t.data.to(device, non_blocking=False)
        moved += t.numel() * t.element_size()
    return moved


class ScoreEngine(ABC):
    """A frozen model. Tasks run its forward passes; the engine decides device and dtype."""

    role = "score"
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    movable_parts = ("weights",)

    def offload(self, part: str) -> int:
        """Move the frozen weights to host memory between their uses (the memory plan's
        ``offload`` nodes); ``reload`` brings them back. Both return the bytes moved."""
        _check_part(self, part)
        return move_tensors(list(self.model.parameters()) + list(self.model.buffers()), torch.device("cpu"))

    def reload(self, part: str) -> int:
        _check_part(self, part)
        return move_tensors(list(self.model.parameters()) + list(self.model.buffers()), self.device)

    def close(self) -> None:  # noqa: B027
        pass


def _check_part(engine, part: str) -> None:
    if part not in engine.movable_parts:
        raise EngineError(f"{type(engine).__name__} cannot move {part!r} off the device; it moves "
                          f"{', '.join(engine.movable_parts)}")


@dataclass
class StepStats:
    grad_norm: float
    lr: float
    skipped: bool = False


class TrainEngine(ABC):
    """The trainable model and its optimizer. ``module`` is the model tasks run forward on."""

    role = "train"
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer  # param_groups are where set_lr writes
    device: torch.device
    dtype: torch.dtype

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (already normalised to the whole batch)."""

    @abstractmethod
    def step(self) -> StepStats:
        """Clip, apply and zero the accumulated gradients."""

    def scale_gradients(self, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` before ``step``: training fused into the
        decode window (compiler.train_fusable) learns the batch's normaliser only at the end. Engines
        that keep gradients in buffers of their own do not offer it."""
        raise EngineError(f"train engine {type(self).__name__} cannot rescale accumulated gradients; "
                          f"train.train_fusion needs engines.train: torch")

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group (warm-up uses its own rate)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # What the memory plan may move to host memory between uses. The weights stay: the decode engine
    # and every forward read them in place.
    movable_parts = ("grads", "master", "adam")

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        inner = self.optimizer
        while hasattr(inner, "optimizer"):  # DeepSpeed's ZeRO wrappers hold the torch optimizer
            inner = inner.optimizer
        return inner

    def _part_tensors(self, part: str) -> list[torch.Tensor]:
        if part == "adam":
            return [v for state in self._inner_optimizer().state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]
        if part == "grads":
            return [p.grad for p in self.module.parameters() if p.grad is not None]
        return []  # "master": plain torch trains the parameters themselves; there is no master copy

    def offload(self, part: str) -> int:
        """Move optimizer moments, master weights or gradients to host memory between their uses
        (the memory plan's ``offload`` nodes); ``reload`` brings them back. Bytes moved."""
        _check_part(self, part)
        return move_tensors(self._part_tensors(part), torch.device("cpu"))

    def reload(self, part: str) -> int:
        _check_part(self, part)
        return move_tensors(self._part_tensors(part), self.device)

    def reset_optimizer_state(self) -> None:
        """Forget the optimizer's moments, as a fresh optimizer would (used after the warm-up).

        Adam's second moments from supervised warm-up gradients are orders of magnitude larger than
        RL policy gradients and decay with β2 over ~1000 steps, which would stall RL for as long.
        """
        self._inner_optimizer().state.clear()

    @abstractmethod
    def state_dict_for_sync(self, trainable_only: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
        """The current weights under HF parameter names, for ``DecodeEngine.load_weights``;
        ``trainable_only`` leaves out what never changes (frozen weights) and the vision tower, which
        no decode engine runs (``vit_encode`` feeds them its output). With LoRA adapters: the base
        model's names, the adapters merged."""

    def export(self, directory: str, is_main_process: bool = True) -> None:
        """The model alone in HF format, loadable by plain transformers (with adapters: merged)."""
        self.module.save_pretrained(directory, is_main_process=is_main_process)

    def fold_adapter(self) -> bool:
        """Merge LoRA adapters into the base weights and restart them from zero, so that the base (the
        reference) equals the policy now; False where the engine trains no adapters."""
        return False

    @abstractmethod
    def save(self, directory: str) -> None:
        """Write the model (HF ``save_pretrained``) and optimizer state into ``directory``."""

    @abstractmethod
    def load(self, directory: str) -> None:
        """Restore what ``save`` wrote."""

    def close(self) -> None:  # noqa: B027
        pass


# --------------------------------------------------------------------------------------------------
# registry
@dataclass(frozen=True)
class Option:
    """One option a user may give an engine (``engines.decode_options`` / ``train_options``): its type,
    bounds or choices, and ``check(value) -> problem or None`` for what those cannot say."""

    kind: type | tuple[type, ...]
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    check: Callable[[Any], str | None] | None = None


@dataclass(frozen=True)
class EngineSpec:
    name: str
    role: str
    factory: Callable[..., Any]  # called with (EngineContext) on the worker that hosts the engine
    requires: tuple[str, ...] = ()  # importable modules the engine needs
    description: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    options: Mapping[str, Option] = field(default_factory=dict)  # what users may set; nothing else is taken

    def installed(self) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in self.requires)

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


@dataclass
class EngineContext:
    """What a factory needs to build an engine on a worker."""

    model_path: str
    device: torch.device
    dtype: torch.dtype
    seed: int
    options: Mapping[str, Any] = field(default_factory=dict)


_ENGINES: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec) -> EngineSpec:
    if spec.role not in ROLES:
        raise EngineError(f"engine {spec.name!r}: role {spec.role!r} is not one of {ROLES}")
    if spec.name in _ENGINES:
        raise EngineError(f"engine {spec.name!r} is registered already (role {_ENGINES[spec.name].role})")
    _ENGINES[spec.name] = spec
    return spec


def check_options(spec: EngineSpec, options: Mapping[str, Any], where: str,
                  elsewhere: Mapping[str, str] | None = None) -> None:
    """Refuse a user's options for ``spec`` by name (``where``.key): an option the engine does not take
    (``elsewhere``: keys that are set by another field, which it names), a value of another type, out
    of bounds, not one of the choices, or not finite."""
    import math

    from rollplex.errors import ConfigError

    for key, value in options.items():
        option = spec.options.get(key)
        if option is None:
            if elsewhere and key in elsewhere:
                raise ConfigError(f"{where}.{key}: set {elsewhere[key]} instead (it is the one the engine reads)")
            known = ", ".join(sorted(spec.options)) or "none"
            raise ConfigError(f"{where}.{key}: engine {spec.name!r} takes no option {key!r}; its options: {known}")
        kinds = option.kind if isinstance(option.kind, tuple) else (option.kind,)
        if not any(_has_kind(value, kind) for kind in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise ConfigError(f"{where}.{key}: expected {names}, got {type(value).__name__} {value!r}")
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and not math.isfinite(value):
            raise ConfigError(f"{where}.{key}: expected a finite number, got {value}")
        if numeric and option.lo is not None and value < option.lo:
            raise ConfigError(f"{where}.{key}: {value} is below the minimum {option.lo}")
        if numeric and option.hi is not None and value > option.hi:
            raise ConfigError(f"{where}.{key}: {value} is above the maximum {option.hi}")
        if option.choices and value not in option.choices:
            raise ConfigError(f"{where}.{key}: {value!r} is not one of {', '.join(map(str, option.choices))}")
        problem = option.check(value) if option.check else None
        if problem:
            raise ConfigError(f"{where}.{key}: {problem}")


def _has_kind(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):  # YAML's true is not a number here
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def get_engine(name: str, role: str | None = None) -> EngineSpec:
    spec = _ENGINES.get(name)
    if spec is None:
        raise EngineError(f"unknown engine {name!r}; registered engines: {_describe(role)}")
    if role is not None and spec.role != role:
        raise EngineError(f"engine {name!r} serves role {spec.role!r}, not {role!r}; "
                          f"engines for {role!r}: {_describe(role)}")
    return spec


def engines_for(role: str | None = None) -> list[EngineSpec]:
    return [s for s in _ENGINES.values() if role is None or s.role == role]


def _describe(role: str | None) -> str:
    return ", ".join(f"{s.name} ({s.role})" for s in engines_for(role)) or "none"
