"""Environments for multi-turn rollouts: what answers the policy between its turns.

An environment is host-side Python, one instance per sample (trajectory), made by its registered
factory with the run's ``env.options``:

    reset(prompt) -> Observation | None     the episode starts on the dataset's prompt
    step(response) -> StepResult            the policy's turn, decoded to text; the environment
                                            answers with an observation (text and images),
                                            a reward and whether the episode is done

The first turn is the dataset's prompt, shared by the G samples of a group (so its prefix is
computed once); ``reset`` returns None, or an observation with nothing in it. ``step``'s
observation becomes the next user turn; a trajectory's reward is the sum of its steps' rewards
(an environment that judges the final answer gives it at the step that ends the episode). A step
that counts as a tool call says so (``StepResult.tool_calls``), for the log.

``step_all`` contains what an environment does wrong: an exception, a result that is not a
``StepResult``, a non-finite reward or a step slower than ``env.timeout_s`` ends that sample's
trajectory with a recorded reason (``Outcome.end_reason``); the run goes on. A step that times out
keeps its thread (Python cannot stop one); the episode no longer waits for it.

The registry refuses a second environment of one name and lists the names it knows, as the engine
registry does; ``Option`` tables check ``env.options`` by name before a worker starts.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as StepTimeout
from dataclasses import dataclass, field
from typing import Any

from rollplex.engines.base import Option
from rollplex.errors import ConfigError


@dataclass
class Observation:
    """What an environment shows the policy next: text and images (PIL), as one user turn."""

    text: str = ""
    images: list = field(default_factory=list)
    # Where each image came from (for the rollout log), e.g. {"zoom": 2, "of": "syn-000007"}.
    sources: list[dict] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.text and not self.images


@dataclass
class StepResult:
    observation: Observation | None
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0  # tool calls this step made (counted per trajectory in the log)
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EnvPrompt:
    """What ``reset`` sees of a sample's prompt."""

    prompt_id: str
    text: str  # the question
    answer: str
    images: tuple  # the prompt's images at their source resolution (PIL), before the processor
    meta: Mapping[str, Any]
    sample: int  # which of the group's G samples
    seed: int  # a seed of the sample's own, for an environment that draws


class Environment(ABC):
    """One sample's episode. Subclasses implement ``step``; ``reset`` keeps the prompt."""

    def reset(self, prompt: EnvPrompt) -> Observation | None:
        self.prompt = prompt
        return None

    @abstractmethod
    def step(self, response: str) -> StepResult: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


@dataclass(frozen=True)
class EnvSpec:
    name: str
    factory: Callable[[Mapping[str, Any]], Environment]  # called with the checked env.options
    options: Mapping[str, Option] = field(default_factory=dict)
    description: str = ""
    # The most tokens one observation takes (text and image placeholders), given the options: the
    # decode engine's context and the graph's byte estimates are sized with it.
    observation_tokens: Callable[[Mapping[str, Any]], int] = lambda options: 64
    observation_images: int = 1  # the most images one observation holds (vLLM reserves room per prompt)
    # Training-data helpers an environment may give: supervised examples of the turn format.
    warmup: Callable | None = None


_ENVIRONMENTS: dict[str, EnvSpec] = {}


def register_environment(spec: EnvSpec) -> EnvSpec:
    if spec.name in _ENVIRONMENTS:
        raise ConfigError(f"environment {spec.name!r} is registered already; pick another name")
    _ENVIRONMENTS[spec.name] = spec
    return spec


def get_environment(name: str) -> EnvSpec:
    _builtins()
    spec = _ENVIRONMENTS.get(name)
    if spec is None:
        known = ", ".join(sorted(_ENVIRONMENTS)) or "none"
        raise ConfigError(f"env.name: unknown environment {name!r}; registered environments: {known}")
    return spec


def environment_names() -> list[str]:
    _builtins()
    return sorted(_ENVIRONMENTS)


def _builtins() -> None:
    import rollplex.tasks.zoom  # noqa: F401 - registers the embedded task's zoom environment


def check_env_options(spec: EnvSpec, options: Mapping[str, Any]) -> dict:
    """``env.options`` checked against the environment's option table, each problem naming its key."""
    from rollplex.engines.base import _has_kind

    for key, value in options.items():
        option = spec.options.get(key)
        if option is None:
            known = ", ".join(sorted(spec.options)) or "none"
            raise ConfigError(f"env.options.{key}: environment {spec.name!r} takes no option {key!r}; its options: "
                              f"{known}")
        kinds = option.kind if isinstance(option.kind, tuple) else (option.kind,)
        if not any(_has_kind(value, kind) for kind in kinds):
            raise ConfigError(f"env.options.{key}: expected {' or '.join(k.__name__ for k in kinds)}, got "
                              f"{type(value).__name__} {value!r}")
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and (not math.isfinite(value) or (option.lo is not None and value < option.lo)
                        or (option.hi is not None and value > option.hi)):
            raise ConfigError(f"env.options.{key}: {value} is not in [{option.lo}, {option.hi}]")
        if option.choices and value not in option.choices:
            raise ConfigError(f"env.options.{key}: {value!r} is not one of {', '.join(map(str, option.choices))}")
        problem = option.check(value) if option.check else None
        if problem:
            raise ConfigError(f"env.options.{key}: {problem}")
    return dict(options)


@dataclass
class Outcome:
    """One step of one sample's episode, as the runtime records it."""

    observation: Observation | None
    reward: float
    done: bool
    tool_calls: int = 0
    end_reason: str = ""  # why the episode ended here ("" while it goes on)
    seconds: float = 0.0


@dataclass
class Job:
    """One sample's step: its environment (None on its first turn: made and reset first) and the
    response it answers."""

    env: Environment | None
    prompt: EnvPrompt
    response: str


class StepPool:
    """The threads environments step on, made once per worker. A step past its timeout keeps its
    thread (Python cannot stop one), so a pool that timed out is left to finish alone and a fresh
    one takes its place."""

    def __init__(self, threads: int = 16) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rollplex-env")

    def submit(self, fn, *args):
        return self._pool.submit(fn, *args)

    def replace(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="rollplex-env")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def step_all(spec: EnvSpec, options: Mapping[str, Any], jobs: list[Job], timeout: float,
             pool: StepPool) -> list[tuple[Environment | None, Outcome]]:
    """Every job's step at once on ``pool``, each bounded by ``timeout`` seconds from the start; (its
    environment, its outcome) in order. Whatever goes wrong in one (an exception, something other
    than a ``StepResult``, a non-finite reward, a step past the timeout) ends that episode with its
    reason and no reward for the step; the others go on."""
    import time

    if not jobs:
        return []
    start = time.time()
    futures = [pool.submit(_run, spec, options, job) for job in jobs]
    out, timed_out = [], False
    for job, future in zip(jobs, futures):
        try:
            env, result = future.result(timeout=max(0.0, start + timeout - time.time()))
        except StepTimeout:
            timed_out = True
            out.append((job.env, Outcome(None, 0.0, True, end_reason=f"env_timeout: no answer within {timeout:g}s",
                                         seconds=time.time() - start)))
            continue
        except Exception as exc:  # noqa: BLE001 - the user's environment: contained, recorded
            out.append((job.env, Outcome(None, 0.0, True, end_reason=f"env_error: {type(exc).__name__}: {exc}",
                                         seconds=time.time() - start)))
            continue
        out.append((env, _outcome(result, time.time() - start)))
    if timed_out:
        pool.replace()
    return out


def _run(spec: EnvSpec, options: Mapping[str, Any], job: Job) -> tuple[Environment, Any]:
    env = job.env
    if env is None:
        env = spec.factory(options)
        first = env.reset(job.prompt)
        if first is not None and not first.empty:
            raise ValueError("reset returned an observation; the first turn is the dataset's prompt (return None)")
    return env, env.step(job.response)


def _outcome(result: Any, seconds: float) -> Outcome:
    if not isinstance(result, StepResult):
        return Outcome(None, 0.0, True, end_reason=f"env_error: step returned {type(result).__name__}, not a "
                                                   f"StepResult", seconds=seconds)
    try:
        reward = float(result.reward)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        return Outcome(None, 0.0, True, end_reason=f"env_error: step returned the reward {result.reward!r}",
                       seconds=seconds)
    obs = result.observation
    if not result.done and (obs is None or obs.empty):
        return Outcome(None, reward, True, int(result.tool_calls), "env_error: not done, but no observation", seconds)
    return Outcome(obs, reward, bool(result.done), int(result.tool_calls), "done" if result.done else "", seconds)
