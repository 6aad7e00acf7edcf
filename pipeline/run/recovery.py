"""Stopping and recovering a run: SIGINT/SIGTERM between iterations, and lost Dask workers.

Signals. The first SIGINT or SIGTERM only sets a flag; the runner finishes the iteration in flight,
writes a checkpoint and stops (``Interrupted``). A second one stops at once. LocalCluster workers are
started with SIGINT ignored (the disposition survives spawn's exec), so a Ctrl-C sent to the
terminal's whole process group reaches only the driver and cannot kill the engines mid-iteration.

Lost workers. Engines are state (weights, optimizer moments, decode queues) that lives in a worker
process. When a worker dies, its nanny starts a fresh one whose plugin rebuilds the engines from the
model files, so Dask re-running the lost tasks would silently compute on the initial weights. The
runner therefore never trusts an iteration during which the set of worker processes changed
(``WorkerWatch``): it waits for the replacement, loads the last checkpoint into every host, and
replays the iterations since that checkpoint, which are deterministic. No update is applied twice
(the engines restart from the checkpoint) and none is lost (each is recomputed).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

from rollplex.errors import RollplexError, WorkerLost

REPLACEMENT_TIMEOUT_S = float(os.environ.get("ROLLPLEX_WORKER_TIMEOUT", "300"))


# -- signals ----------------------------------------------------------------------------------------
class StopSignals:
    """The first SIGINT/SIGTERM requests a stop at the next iteration boundary."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal: stop now
            self.uninstall()
            raise KeyboardInterrupt
        self.signum = signum

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may handle signals (train() called from a thread: no handling)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started inside inherit SIG_IGN for SIGINT (Python keeps an inherited SIG_IGN)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# -- lost workers -----------------------------------------------------------------------------------
def _pid() -> int:
    return os.getpid()


def quiet_task_errors() -> None:
    """Run on each worker: a failed node is re-raised in the driver, which reports it once (one line
    for a user error); the worker's own multi-line "Compute Failed" log would only repeat it."""
    import logging

    logging.getLogger("distributed.worker").setLevel(logging.CRITICAL)


def _has_engines() -> bool:
    from rollplex.pipeline.run import worker

    return worker._HOST is not None


def _keys_left(prefix: str, dask_scheduler=None) -> int:
    return sum(1 for k in dask_scheduler.tasks if isinstance(k, str) and k.startswith(prefix))


# Out of device memory, in the words torch, a kernel launch and cuBLAS (a new thread's handle; bench run
# 27) say it: none leaves the CUDA context unusable.
MEMORY_FAILURES = ("OutOfMemoryError", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def out_of_memory_text(exc: BaseException | None) -> str | None:
    """The text of the CUDA out-of-memory error in ``exc`` or its causes, raised directly or inside a
    node (NodeFailure keeps its text); None if there is none."""
    from rollplex.errors import NodeFailure

    while exc is not None:
        text = exc.detail if isinstance(exc, NodeFailure) else f"{type(exc).__name__}: {exc}"
        if any(m in text for m in MEMORY_FAILURES):  # torch.OutOfMemoryError's name is the first
            return text
        exc = exc.__cause__
    return None


def out_of_memory(exc: BaseException | None) -> bool:
    """A CUDA out-of-memory error, raised directly or inside a node."""
    return out_of_memory_text(exc) is not None


def drop_tracebacks(exc: BaseException | None) -> None:
    """distributed re-raises the exception object its FutureState keeps, so the traceback (whose frames
    hold the Future) makes a cycle reachable from ``client.futures``: the failed iteration's tasks
    would never be released. Cut it, along the chain of causes."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


class WorkerWatch:
    """Which worker processes host the engines whose state the run relies on."""

    def __init__(self, client) -> None:
        self.client = client
        self.known = self.identities()
        self.expected = len(self.known)
        self.survived: set[int] = set()  # pids that outlived the last loss, engines and state intact

    def identities(self) -> dict[str, int]:
        return dict(self.client.run(_pid))

    def lost(self) -> str | None:
        """What changed since the baseline (a dead or replaced worker), or None."""
        try:
            now = self.identities()
        except Exception as exc:  # noqa: BLE001 - the cluster itself is unreachable
            return f"the cluster cannot be reached ({type(exc).__name__})"
        gone = sorted(set(self.known.items()) - set(now.items()))
        if not gone:
            return None
        return ", ".join(f"{addr} (pid {pid})" for addr, pid in gone) + " died or was replaced"

    def check(self) -> None:
        what = self.lost()
        if what:
            raise WorkerLost(what)

    def await_replacements(self, log) -> None:
        """Wait until as many workers as before are up, each with its engines built (a worker's plugin
        runs after it registers with the scheduler, so registration alone is not enough)."""
        deadline = time.time() + REPLACEMENT_TIMEOUT_S
        while True:
            try:
                ready = self.client.run(_has_engines)
            except Exception:  # noqa: BLE001 - a worker may be between death and restart
                ready = {}
            if len(ready) >= self.expected and all(ready.values()):
                break
            if time.time() > deadline:
                raise RollplexError(f"no replacement worker with engines joined within {REPLACEMENT_TIMEOUT_S:.0f} s "
                                 f"({sum(map(bool, ready.values()))} of {self.expected} ready); "
                                 "restart the cluster and continue with --resume")
            time.sleep(0.2)
        before, self.known = set(self.known.values()), self.identities()
        self.survived = before & set(self.known.values())
        log(f"workers ready again: {', '.join(f'{a} (pid {p})' for a, p in sorted(self.known.items()))}")

    def forget(self, prefix: str, timeout: float = 30.0) -> None:
        """Wait until the scheduler has released every task of a failed iteration, so that replaying
        it (same keys) cannot pick up a stale erred result."""
        deadline = time.time() + timeout
        while self.client.run_on_scheduler(_keys_left, prefix):
            if time.time() > deadline:
                raise RuntimeError(f"the scheduler still holds tasks {prefix}* of the failed iteration after "
                                   f"{timeout:.0f} s; cannot replay it")
            time.sleep(0.05)

    def on_each(self, fn, *args) -> None:
        """Run ``fn(host, *args)`` on every worker's engines, on its compute stream."""
        from rollplex.pipeline.run.execution import call_on_host

        futures = [self.client.submit(call_on_host, fn, *args, workers=[addr], resources={"compute": 1},
                                      pure=False, allow_other_workers=False)
                   for addr in sorted(self.known)]
        for f in futures:
            f.result()


def expect_host(pids: set[int]) -> None:
    """Called inside a host function whose result depends on engine state: refuse to run on a worker
    that replaced one the run knew (its engines hold the initial weights, not the run's)."""
    if os.getpid() not in pids:
        raise WorkerLost(f"worker pid {os.getpid()} is a replacement; its engines do not hold the run's state")
