"""The public API for writing an RL algorithm as a DAG, in about a page.

An algorithm names its models, says which model samples the rollouts, which models score them
(per token), and gives plain functions for the reward, the advantage and the loss. Function
parameters name the values they read (Hamilton-style); keyword parameters with defaults are
hyperparameters that ``algorithm.params`` in the config can override. Everything expensive (vision
encoding, prefix forwards, decode chunks, suffix scoring, backward, optimizer, weight sync) is placed
by the compiler; the author never writes a schedule.

    grpo = Algorithm("grpo")
    grpo.policy("actor")
    grpo.frozen("ref", copy_of="actor")
    grpo.score("ref", as_="ref_logprobs")
    grpo.score("actor", as_="logprobs", grad=True)

    @grpo.advantage(scope="group")
    def advantages(rewards, eps=1e-6): ...

    @grpo.loss(agg="token-mean")
    def loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, kl_coef=0.04): ...

A second trained model (PPO's critic) is declared with ``critic(name, copy_of=...)``, scored like any
model (``score("critic", as_="values", grad=True)``) and trained by ``@loss(model="critic")`` with an
optimizer step of its own. A model may name its own engine (``frozen(..., engine=...)``), and a node
of a kind registered outside pipeline/ is placed with ``node(kind=..., model=...)``.

Nothing is resolved by order: a second policy, reward, advantage, or loss for one model, two writers
of one value, two nodes of one name, and two defaults for one hyperparameter are refused when they
are declared, naming both; a hyperparameter named like a value is refused by ``validate()``.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollplex.errors import GraphError

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ADVANTAGE_SCOPES = ("group", "batch")
RUNTIME_VALUES = ("prompt", "vision", "responses", "rewards", "advantages", "mask")
# Read by the policy's loss alone: per token min(π_old/π_rollout, C) under ``train.rollout_is: {cap: C}``
# (π_rollout: the decode engine's log-probs), else 1. A loss multiplies its policy-gradient term by it.
POLICY_LOSS_VALUES = ("rollout_is_weights",)


def _site(fn: Callable[..., Any]) -> str:
    """``name()`` and where it is defined: two functions may share a name (a redefinition)."""
    code = getattr(fn, "__code__", None)
    where = f" at {Path(code.co_filename).name}:{code.co_firstlineno}" if code is not None else ""
    return f"{getattr(fn, '__name__', repr(fn))}(){where}"


def _same_default(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. a tensor's ambiguous truth value: not provably the same
        return False


@dataclass(frozen=True)
class ModelDecl:
    name: str
    trainable: bool
    copy_of: str | None = None  # starts from another model's initial weights
    path: str | None = None  # or its own checkpoint
    head: str = "lm"  # "lm": next-token logits; "value": one scalar per position (a critic)
    engine: str | None = None  # an engine of its own (registered name); None: the role's engine


@dataclass(frozen=True)
class ScoreDecl:
    """Per-token log-probs of the responses under ``model``; ``grad`` keeps the autograd graph.

    A scored model with ``grad`` also yields ``old_<as_>``: the same values, detached, which is
    the behaviour policy's log-probs for the single on-policy update.
    """

    model: str
    as_: str
    grad: bool = False


@dataclass(frozen=True)
class FunctionDecl:
    fn: Callable[..., Any]
    reads: tuple[str, ...]  # value names: parameters without defaults
    params: Mapping[str, Any]  # hyperparameters: parameters with defaults
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, fn: Callable[..., Any], **options: Any) -> "FunctionDecl":
        reads, params = [], {}
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise GraphError(f"{fn.__qualname__}: *args/**kwargs cannot name values; list them")
            if p.default is inspect.Parameter.empty:
                reads.append(p.name)
            else:
                params[p.name] = p.default
        return cls(fn, tuple(reads), params, options)

    @property
    def name(self) -> str:
        return self.fn.__name__

    def call(self, values: Mapping[str, Any], overrides: Mapping[str, Any]) -> Any:
        missing = [r for r in self.reads if r not in values]
        if missing:
            raise GraphError(f"{self.name}() reads {missing}, which this node does not receive; "
                             f"available: {sorted(values)}")
        kwargs = {r: values[r] for r in self.reads}
        kwargs.update({k: overrides.get(k, v) for k, v in self.params.items()})
        return self.fn(**kwargs)


class Algorithm:
    """A declarative RL algorithm. Decorators return the function unchanged and never mutate it."""

    def __init__(self, name: str, doc: str = "") -> None:
        self.name = name
        self.doc = doc
        self.models: dict[str, ModelDecl] = {}
        self.rollout_model: str | None = None
        self.scores: list[ScoreDecl] = []
        self.reward_fn: FunctionDecl | None = None
        self.advantage_fn: FunctionDecl | None = None
        self.loss_fn: FunctionDecl | None = None  # the policy's loss
        self.model_losses: dict[str, FunctionDecl] = {}  # losses of other trainable models (a critic)
        self.custom: list[FunctionDecl] = []

    # -- models --------------------------------------------------------------------------------
    def policy(self, name: str = "actor", path: str | None = None) -> str:
        """The trained model; rollouts sample from it."""
        if self.rollout_model is not None and self.rollout_model != name:
            raise GraphError(f"{self._where}: two policies, {self.rollout_model!r} and {name!r}; one model "
                             f"samples the rollouts: declare another trained model with critic({name!r}, ...)")
        self._add_model(ModelDecl(name, trainable=True, path=path))
        self.rollout_model = name
        early = self.model_losses.pop(name, None)  # @loss(model=name) before policy(name)
        if early is not None:
            if self.loss_fn is not None:
                raise self._two_losses(name, self.loss_fn, early)
            self.loss_fn = early
        return name

    def frozen(self, name: str, copy_of: str | None = None, path: str | None = None,
               engine: str | None = None) -> str:
        """A model that is never updated, e.g. the reference policy. ``engine`` names a registered
        score engine that hosts it (default: ``engines.score``)."""
        if (copy_of is None) == (path is None):
            raise GraphError(f"frozen model {name!r}: give exactly one of copy_of= or path=")
        self._add_model(ModelDecl(name, trainable=False, copy_of=copy_of, path=path, engine=engine))
        return name

    def critic(self, name: str = "critic", copy_of: str | None = None, path: str | None = None) -> str:
        """A trained value model: the architecture of ``copy_of`` (or ``path``) with its LM head
        replaced by a scalar value head. Its scores are values (one per response token, the value of
        the state before that token); it trains on its own ``@loss(model=name)`` and optimizer step."""
        if (copy_of is None) == (path is None):
            raise GraphError(f"critic {name!r}: give exactly one of copy_of= or path=")
        self._add_model(ModelDecl(name, trainable=True, copy_of=copy_of, path=path, head="value"))
        return name

    def _add_model(self, decl: ModelDecl) -> None:
        if decl.name in self.models:
            raise GraphError(f"{self._where}: model {decl.name!r} is declared twice; give the second "
                             "another name")
        self.models[decl.name] = decl

    @property
    def _where(self) -> str:
        return f"algorithm {self.name!r}"

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, model: str, as_: str, grad: bool = False) -> str:
        this = f"score({model!r}, as_={as_!r}{', grad=True' if grad else ''})"
        for value in (as_, f"old_{as_}") if grad else (as_,):
            self._claim(value, this)
        self.scores.append(ScoreDecl(model, as_, grad))
        return as_

    def writers(self) -> dict[str, str]:
        """Value name → what writes it: the runtime, a score, or a node of the algorithm's own."""
        out = dict.fromkeys(RUNTIME_VALUES, "the runtime")
        for s in self.scores:
            out[s.as_] = f"score({s.model!r}, as_={s.as_!r}{', grad=True' if s.grad else ''})"
            if s.grad:
                out[f"old_{s.as_}"] = out[s.as_]
        out.update({c.options["writes"]: f"node {_site(c.fn)}" for c in self.custom})
        return out

    def _claim(self, value: str, by: str) -> None:
        """One writer per value: with two, which one a reader gets would depend on graph order."""
        other = self.writers().get(value)
        if other is not None:
            fix = f"give {by} another name" if other == "the runtime" else "rename one of them"
            raise GraphError(f"{self._where}: value {value!r} is written by {other} and by {by}; {fix}")

    # -- functions -------------------------------------------------------------------------------
    def reward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Per-response reward: ``fn(text, answer, ...) -> float``. Default: the dataset's verifier."""
        decl = FunctionDecl.of(fn)
        if self.reward_fn is not None:
            raise GraphError(f"{self._where}: two reward functions, {_site(self.reward_fn.fn)} and {_site(fn)}; "
                             "an algorithm has one: keep one, or return the sum of both from one function")
        self._check_hyperparameters(decl)
        self.reward_fn = decl
        return fn

    def advantage(self, fn: Callable[..., Any] | None = None, *, scope: str = "group", min_samples: int = 1):
        """Advantages from rewards. scope="group": ``rewards`` is one prompt's [G] tensor;
        scope="batch": ``rewards`` is the whole batch's [P, G] tensor. ``min_samples``: the fewest
        samples per prompt it is defined for (2 for a group's std); a run with fewer is refused."""
        if scope not in ADVANTAGE_SCOPES:
            raise GraphError(f"advantage scope {scope!r} is not one of {ADVANTAGE_SCOPES}")
        if not isinstance(min_samples, int) or min_samples < 1:
            raise GraphError(f"advantage min_samples={min_samples!r}: expected an integer of at least 1")

        def register(f: Callable[..., Any]) -> Callable[..., Any]:
            decl = FunctionDecl.of(f, scope=scope, min_samples=min_samples)
            if self.advantage_fn is not None:
                raise GraphError(f"{self._where}: two advantage functions, {_site(self.advantage_fn.fn)} and "
                                 f"{_site(f)}; an algorithm has one: keep one, or compute a value the other "
                                 "reads with @node(writes=...)")
            self._check_hyperparameters(decl)
            self.advantage_fn = decl
            return f

        return register(fn) if fn is not None else register

    def loss(self, fn: Callable[..., Any] | None = None, *, agg: str = "token-mean", model: str | None = None):
        """Per-token loss [B, R] (or (loss, metrics)); the runtime aggregates it by ``agg``.
        ``model``: the trainable model it updates (default: the policy); each trainable model has
        one loss, its own backward per micro-batch and its own optimizer step."""
        if agg not in LOSS_AGGREGATIONS:
            raise GraphError(f"loss aggregation {agg!r} is not one of {LOSS_AGGREGATIONS}")

        def register(f: Callable[..., Any]) -> Callable[..., Any]:
            decl = FunctionDecl.of(f, agg=agg)
            policy = model is None or model == self.rollout_model
            first = self.loss_fn if policy else self.model_losses.get(model)
            if first is not None:
                raise self._two_losses(self.rollout_model if policy else model, first, decl)
            self._check_hyperparameters(decl)
            if policy:
                self.loss_fn = decl
            else:
                self.model_losses[model] = decl
            return f

        return register(fn) if fn is not None else register

    def node(self, fn: Callable[..., Any] | None = None, *, writes: str, per: str = "prompt",
             kind: str = "custom", model: str | None = None):
        """A node of your own: ``fn``'s parameters name the values it reads, ``writes`` the value it
        makes. per="prompt": one node per prompt group, each value is that group's (e.g. ``rewards``
        is a [G] tensor); per="batch": one node, each value is a list over the groups. Any later
        function (advantage, loss, another node) can read ``writes`` by name. ``kind`` defaults to the
        builtin host kind "custom"; a registered kind with its own task and engine works the same."""
        if per not in ("prompt", "batch"):
            raise GraphError(f"node {writes!r}: per={per!r} is not 'prompt' or 'batch'")

        def register(f: Callable[..., Any]) -> Callable[..., Any]:
            if not f.__name__.isidentifier():  # a lambda: its name would become the node's name
                raise GraphError(f"node {writes!r}: give a named function (def), not {f.__name__!r}; "
                                 "its name names the node")
            decl = FunctionDecl.of(f, writes=writes, per=per, kind=kind, model=model)
            self._claim(writes, f"node {_site(f)}")
            for other in self.custom:  # the graph and the runtime find a node's function by its name
                if other.name == f.__name__:
                    raise GraphError(f"{self._where}: two nodes are named {f.__name__!r}, {_site(other.fn)} "
                                     f"writing {other.options['writes']!r} and {_site(f)} writing {writes!r}; "
                                     "a node is named by its function: rename one")
            self._check_hyperparameters(decl)
            self.custom.append(decl)
            return f

        return register(fn) if fn is not None else register

    def produced_values(self) -> set[str]:
        """Per-group values functions can read by name."""
        return set(self.writers())

    def _check_hyperparameters(self, decl: FunctionDecl) -> None:
        """A hyperparameter is one name for the whole algorithm (``params.<name>`` sets it in every
        function that takes it), so two defaults for it would leave unclear which one runs."""
        for other in self._functions():
            for k in sorted(decl.params.keys() & other.params.keys()):
                if not _same_default(decl.params[k], other.params[k]):
                    raise GraphError(
                        f"{self._where}: hyperparameter {k!r} has two defaults, {other.params[k]!r} in "
                        f"{_site(other.fn)} and {decl.params[k]!r} in {_site(decl.fn)}; functions that take "
                        f"{k!r} share one value (params.{k}): give both the same default or rename one")

    def _functions(self) -> list[FunctionDecl]:
        return [d for d in (self.reward_fn, self.advantage_fn, self.loss_fn, *self.model_losses.values(),
                            *self.custom) if d is not None]

    def _two_losses(self, model: str | None, first: FunctionDecl, second: FunctionDecl) -> GraphError:
        who = "the policy" if model is None else f"model {model!r}"
        return GraphError(f"{self._where}: {who} has two losses, {_site(first.fn)} and "
                          f"{_site(second.fn)}; each trained model has one: keep one, or return the sum of "
                          "both from one function")

    # -- checks ----------------------------------------------------------------------------------
    @property
    def trainable(self) -> list[str]:
        return [m.name for m in self.models.values() if m.trainable]

    def losses(self) -> dict[str, FunctionDecl]:
        """Trainable model → its loss, the policy first."""
        return {self.rollout_model: self.loss_fn, **self.model_losses}

    @property
    def vision_model(self) -> str:
        """The frozen vision tower is shared; it runs on the first frozen copy of the policy."""
        for decl in self.models.values():
            if decl.copy_of == self.rollout_model and not decl.trainable:
                return decl.name
        return self.rollout_model or ""

    def policy_logprobs(self) -> str | None:
        """The policy's own log-probs scored with grad (``logprobs``; ``old_logprobs`` is their
        rollout-time copy), which the decode engine's log-probs are compared with; None if it scores none."""
        return next((s.as_ for s in self.scores if s.grad and s.model == self.rollout_model
                     and self.models[s.model].head == "lm"), None)

    def scored_values(self) -> dict[str, str]:
        """Per-token values the loss can read, mapped to the model that produces them."""
        out = {}
        for s in self.scores:
            out[s.as_] = s.model
            if s.grad:
                out[f"old_{s.as_}"] = s.model
        return out

    def validate(self) -> "Algorithm":
        where = self._where
        if self.rollout_model is None:
            raise GraphError(f"{where}: declare the policy with .policy(name)")
        for decl in self.models.values():
            if decl.copy_of is not None and decl.copy_of not in self.models:
                raise GraphError(f"{where}: model {decl.name!r} copies unknown model {decl.copy_of!r}")
            if decl.trainable and decl.name != self.rollout_model and decl.name not in self.model_losses:
                raise GraphError(f"{where}: trainable model {decl.name!r} has no loss; "
                                 f"add one with @{self.name}.loss(model={decl.name!r})")
        for model in self.model_losses:
            if model not in self.models or not self.models[model].trainable:
                raise GraphError(f"{where}: @loss(model={model!r}) names no trainable model; "
                                 f"trainable: {self.trainable}")
        for s in self.scores:
            if s.model not in self.models:
                raise GraphError(f"{where}: score() names unknown model {s.model!r}; "
                                 f"declared: {sorted(self.models)}")
            if s.grad and not self.models[s.model].trainable:
                raise GraphError(f"{where}: score({s.model!r}, grad=True) but {s.model!r} is frozen")
        if self.advantage_fn is None:
            raise GraphError(f"{where}: no @advantage function")
        if self.loss_fn is None:
            raise GraphError(f"{where}: no @loss function")
        readable = self.produced_values()
        for decl, what in ((self.loss_fn, "loss"), (self.advantage_fn, "advantage"),
                           *((d, f"loss of {m!r}") for m, d in self.model_losses.items()),
                           *((c, f"node {c.options['writes']!r}") for c in self.custom)):
            extra = POLICY_LOSS_VALUES if decl is self.loss_fn else ()
            unknown = [r for r in decl.reads if r not in readable and r not in extra]
            if unknown:
                raise GraphError(f"{where}: {what} function {decl.name}() reads {unknown}, which nothing "
                                 f"produces; it can read {sorted(readable)}")
            # A parameter with a default is a hyperparameter and never receives the value of its name.
            shadowed = sorted(decl.params.keys() & readable)
            if shadowed:
                k = shadowed[0]
                raise GraphError(f"{where}: {_site(decl.fn)} parameter {k!r} has a default, so it is a "
                                 f"hyperparameter, but {k!r} is also a value ({self.writers()[k]} writes it); "
                                 "drop the default to read the value, or rename the hyperparameter")
        if "rollout_is_weights" in self.loss_fn.reads and self.policy_logprobs() is None:
            raise GraphError(f"{where}: loss function {self.loss_fn.name}() reads 'rollout_is_weights', the ratio "
                             f"of the policy's old log-probs to the decode engine's, but no "
                             f"score({self.rollout_model!r}, grad=True) gives the policy's log-probs")
        if "advantages" in self.advantage_fn.reads:
            raise GraphError(f"{where}: advantage() cannot read its own output 'advantages'")
        return self

    def hyperparameters(self) -> dict[str, Any]:
        """Name → default; functions that share a name share its default (checked as they register)."""
        params: dict[str, Any] = {}
        for decl in self._functions():
            params.update(decl.params)
        return params

    def hyperparameter_types(self) -> dict[str, Any]:
        """Name → the annotation a function gives the hyperparameter (``clip_ratio_c: float | None``),
        for those annotated where it can be resolved; a default of None says nothing of the type."""
        import typing

        types: dict[str, Any] = {}
        for decl in self._functions():
            try:
                hints = typing.get_type_hints(decl.fn)
            except Exception:  # noqa: BLE001 - an annotation naming what the DAG file never imported
                continue
            for name in decl.params:
                if name in hints:
                    types.setdefault(name, hints[name])
        return types

    def __repr__(self) -> str:
        models = ", ".join(f"{m.name}{'' if m.trainable else ' (frozen)'}" for m in self.models.values())
        return f"<Algorithm {self.name}: models [{models}], scores {[s.as_ for s in self.scores]}>"


__all__ = ["Algorithm", "ModelDecl", "ScoreDecl", "FunctionDecl", "POLICY_LOSS_VALUES"]
