"""Which function computes each node kind. Adding a node kind = ``register_kind`` + ``register_task``.

A task is ``fn(ctx, node, inputs) -> outputs``: ``inputs`` maps the node's input value names to
their values, and the result maps each of the node's output value names to a value.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollplex.errors import GraphError

TaskFn = Callable[[Any, Any, dict[str, Any]], dict[str, Any]]
_TASKS: dict[str, TaskFn] = {}


def register_task(kind: str) -> Callable[[TaskFn], TaskFn]:
    def decorate(fn: TaskFn) -> TaskFn:
        if kind in _TASKS:
            raise GraphError(f"a task for node kind {kind!r} is registered already ({_TASKS[kind].__qualname__})")
        _TASKS[kind] = fn
        return fn

    return decorate


def task_for(kind: str) -> TaskFn:
    if kind not in _TASKS:
        import rollplex.tasks.nodes  # noqa: F401 - registers the builtin tasks on first use
        import rollplex.tasks.residency  # noqa: F401 - the memory plan's offload/prefetch
        import rollplex.tasks.gather  # noqa: F401 - data-parallel merges (pipeline/compile/ranks.py)
        import rollplex.tasks.turns  # noqa: F401 - multi-turn rollouts' environment and observation nodes

    try:
        return _TASKS[kind]
    except KeyError:
        raise GraphError(f"no task registered for node kind {kind!r}; known: {', '.join(sorted(_TASKS))}") from None
