"""Test-only fault injection: SIGKILL (or a CUDA out-of-memory error) at a named point of a run. Inert
unless ROLLPLEX_TEST_FAULT is set.

The reliability tests kill ``rollplex train`` at precise moments (inside decode, around the optimizer
step, between the steps of a checkpoint write), which a wall-clock timer hits only by luck.

    ROLLPLEX_TEST_FAULT=POINT#N        the N-th time this process reaches POINT (N defaults to 1)
    ROLLPLEX_TEST_FAULT_KILL=group     SIGKILL the whole process group: driver and Dask workers (default)
                           =self      SIGKILL only the process that reached it (a lost Dask worker)
                           =oom       raise torch.OutOfMemoryError there instead (a node that ran out of
                                      device memory; worker points only)
    ROLLPLEX_TEST_FAULT_ONCE=PATH      fire at most once across processes: a restarted worker or a
                                       resumed run counts afresh, and must not die at the same place

Points. Driver: ``warmup:step``, ``iteration:start``, ``iteration:written`` (rollouts and metrics row
written, checkpoint not yet), ``checkpoint:staged`` (model and state in the temporary directory),
``checkpoint:manifest``, ``checkpoint:renamed``, ``checkpoint:retained``. Worker: ``task:KIND:before``
and ``task:KIND:after`` for every node kind (``decode_chunk``, ``loss``, ``optimizer_step``, ...) and
``save:model`` (the train engine has written its files into the checkpoint's temporary directory).
"""
from __future__ import annotations

import os
import signal
import threading

ENV = "ROLLPLEX_TEST_FAULT"
_counts: dict[str, int] = {}
_lock = threading.Lock()


def active() -> bool:
    return bool(os.environ.get(ENV))


def point(name: str) -> None:
    """Called at each named point; a dictionary lookup when no fault is armed."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, nth = spec.partition("#")
    if target != name:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        if _counts[name] != int(nth or 1):
            return
    once = os.environ.get(f"{ENV}_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    how = os.environ.get(f"{ENV}_KILL", "group")
    if how == "oom":
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (test fault at {name})")
    if how == "self":
        os.kill(os.getpid(), signal.SIGKILL)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def install_task_hooks() -> None:
    """Wrap every registered node task with ``task:KIND:before/after`` points (run on each worker)."""
    from rollplex.tasks import registry

    registry.load_builtin_tasks()
    for kind, fn in list(registry._TASKS.items()):
        if getattr(fn, "_fault_points", False):
            continue

        def wrapped(ctx, node, inputs, _fn=fn, _kind=kind):
            point(f"task:{_kind}:before")
            out = _fn(ctx, node, inputs)
            point(f"task:{_kind}:after")
            return out

        wrapped._fault_points = True
        registry._TASKS[kind] = wrapped
