"""Errors inside the user's code, told apart from Rollplex's own.

A node's task calls functions of the algorithm's DAG file (advantage, losses, nodes of its own) and
the reward. When one raises, ``node_error`` turns the exception into a ``UserCodeError``: one line
naming the node and the innermost frame of that code (the DAG file's, a builtin algorithm's in
dags/, the reward's file), the traceback kept for the run directory's errors.log. An exception with
no such frame is Rollplex's own and stays a ``NodeFailure``, traceback and all.
"""
from __future__ import annotations

import os
import traceback

from rollplex.errors import NodeFailure, UserCodeError, user_frame


def user_files(algorithm, reward_fn) -> frozenset[str]:
    """Real paths of the files that define the algorithm's functions and the reward."""
    fns = [decl.fn for decl in (algorithm.reward_fn, algorithm.advantage_fn, *algorithm.losses().values(),
                                *algorithm.custom) if decl is not None]
    reward = getattr(reward_fn, "func", reward_fn)
    if not getattr(reward, "__module__", "").startswith("rollplex."):  # a registered one is Rollplex's own
        fns.append(reward)
    return frozenset(os.path.realpath(fn.__code__.co_filename) for fn in fns if hasattr(fn, "__code__"))


def _builtin_dags() -> tuple[str, ...]:
    import rollplex.dags

    return tuple(os.path.realpath(p) + os.sep for p in rollplex.dags.__path__)


def node_error(name: str, kind: str, exc: BaseException, files: frozenset[str]) -> BaseException:
    """What to raise for ``exc`` from node ``%name``: a ``UserCodeError`` naming the node and, where
    the user's code (``files``) raised, its file and line; a ``NodeFailure`` for Rollplex's own."""
    trace = "".join(traceback.format_exception(exc))
    if isinstance(exc, UserCodeError):  # a task refused what a user function returned
        return UserCodeError(f"%{name} ({kind}): {exc}", exc.trace or trace)
    site = user_frame(exc.__traceback__, files, _builtin_dags())
    if site is None:
        return NodeFailure(name, kind, exc)
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
    return UserCodeError(f"%{name} ({kind}): {site} raised {detail}", trace)
