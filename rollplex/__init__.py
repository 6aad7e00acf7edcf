"""Rollplex: synchronous on-policy RL for vision-language models, compiled to a DAG per iteration.

The public API:
- ``Algorithm``: write an RL algorithm as a DAG (see ``rollplex.dags.grpo`` and its siblings);
- ``NodeKind``, ``register_kind``, ``register_task``: add a node kind of your own and what it
  computes; ``ScoreEngine``, ``TrainEngine``, ``DecodeEngine``, ``EngineSpec``, ``EngineContext``,
  ``register_engine``: add an engine that hosts a model (see ``dags/examples/reward_model.py``);
- ``rollplex.engines.vlm``: the prefix/suffix forward passes tasks are built from;
- ``Environment``, ``Observation``, ``StepResult``, ``EnvSpec``, ``register_environment``: what answers
  the policy between the turns of a multi-turn rollout (``rollout.max_turns``, ``env.name``).
The extension names import on first use, so ``import rollplex`` stays light (no torch).
"""
from rollplex.errors import RollplexError
from rollplex.pipeline.compile.authoring import Algorithm

_LAZY = {
    "NodeKind": "rollplex.pipeline.compile.ir", "register_kind": "rollplex.pipeline.compile.ir",
    "register_task": "rollplex.tasks.registry",
    "ScoreEngine": "rollplex.engines.base", "TrainEngine": "rollplex.engines.base",
    "DecodeEngine": "rollplex.engines.base", "EngineSpec": "rollplex.engines.base",
    "EngineContext": "rollplex.engines.base", "register_engine": "rollplex.engines.base",
    "Environment": "rollplex.tasks.environments", "Observation": "rollplex.tasks.environments",
    "StepResult": "rollplex.tasks.environments", "EnvSpec": "rollplex.tasks.environments",
    "register_environment": "rollplex.tasks.environments",
}

__all__ = ["Algorithm", "RollplexError", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rollplex' has no attribute {name!r}")
