"""User-facing errors. The CLI prints any ``RollplexError`` as one line and exits with its
``exit_code``: 2 for bad input, 3 when a NaN/Inf stopped training, 4 when an iteration ran out of
device memory, 128 + N after signal N stopped it.

Each message names the field, node, tensor, file or row at fault and, where it can, how to fix it.
"""
from __future__ import annotations


class RollplexError(Exception):
    """Bad input or an impossible request: reported as one clear line, never a traceback."""

    exit_code = 2


class ConfigError(RollplexError):
    """A config file or override is malformed, unknown, or out of range."""


class GraphError(RollplexError):
    """An iteration DAG is malformed: a cycle, a dangling input, an unknown kind or a duplicate name."""


class EngineError(RollplexError):
    """An engine name is unknown, not installed, or cannot serve the model."""


class DataError(RollplexError):
    """A dataset, row or image is missing, unreadable or of the wrong shape."""


class CheckpointError(RollplexError):
    """A checkpoint is corrupt, truncated, or from an incompatible run."""


class MemoryPlanError(RollplexError):
    """No residency plan fits the memory budget."""


class NonFiniteError(RollplexError):
    """A NaN/Inf loss or gradient stopped an iteration before its update was applied. Not bad input,
    so a distinct exit code; the last checkpoint is untouched and ``--resume`` continues from it."""

    exit_code = 3


class DeviceMemoryError(RollplexError):
    """An iteration ran out of device memory (and no ``schedule: auto`` candidate was left to drop).
    The message names the node and the settings that hold less at once; the last checkpoint is
    untouched and ``--resume`` with one of them changed continues from it."""

    exit_code = 4


class Interrupted(RollplexError):
    """SIGINT/SIGTERM: the run stopped between iterations (after a checkpoint where there was state to
    keep). Exit code 128 + the signal number, as a shell reports a death by that signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum

    def __reduce__(self):
        return (Interrupted, (str(self), self.exit_code - 128))


class UserCodeError(RollplexError):
    """A function of the algorithm's DAG file (or a reward of the user's) raised, or returned what its
    node cannot use. One line names the node and the function's file and line; ``trace`` keeps the
    traceback, which the runner writes to the run directory's errors.log."""

    def __init__(self, message: str, trace: str = "") -> None:
        super().__init__(message)
        self.trace = trace

    def __reduce__(self):  # crosses process boundaries through Dask; keep only plain data
        return (UserCodeError, (str(self), self.trace))


def function_site(fn) -> str:
    """``name() at file.py:line`` of a function (a ``functools.partial``'s too)."""
    import os

    fn = getattr(fn, "func", fn)
    code = getattr(fn, "__code__", None)
    where = f" at {os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code is not None else ""
    return f"{getattr(fn, '__name__', type(fn).__name__)}(){where}"


def user_frame(tb, files: frozenset[str], directories: tuple[str, ...] = ()) -> str | None:
    """``file.py:line in function()`` of the innermost traceback frame in one of ``files`` or under one
    of ``directories`` (real paths): the user's code. None when no frame is."""
    import os

    found = None
    while tb is not None:
        path = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if path in files or path.startswith(directories):
            found = f"{os.path.basename(path)}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}()"
        tb = tb.tb_next
    return found


class WorkerLost(RuntimeError):
    """A Dask worker that hosted engines died or was replaced; its engine state is gone (internal:
    the runner rolls back to the last checkpoint and replays)."""


class NodeFailure(RuntimeError):
    """An exception inside a node's task, re-raised with the node that ran it (not a user error)."""

    def __init__(self, node: str, kind: str, cause: BaseException | str) -> None:
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"while executing %{node} ({kind}): {detail}")
        self.node = node
        self.kind = kind
        self.detail = detail

    def __reduce__(self):  # crosses process boundaries through Dask; keep only plain data
        return (NodeFailure, (self.node, self.kind, self.detail))
