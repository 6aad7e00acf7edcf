"""Every socket a run opens stays on loopback when no remote scheduler is given.

A real `rollplex train` (the default engines: in-process vLLM, DeepSpeed) runs while a thread lists
the inet sockets of every process of its group (the driver, the nanny's worker processes) every
few milliseconds: Dask's comms and HTTP servers, torch's TCPStore, gloo's pairs, vLLM's.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from reliability_harness import Launch
from socket_watch import SocketWatch


RUNS = {"in-process": [], "worker-process": ["--set", "cluster.processes=true"],
        "data-parallel ranks": ["--workers", "2"]}  # two worker processes in one process group


@pytest.mark.parametrize("where", list(RUNS))
def test_a_default_run_opens_no_socket_outside_loopback(tmp_path: Path, where: str):
    launch = Launch(tmp_path / "run", ["--iterations", "1", *RUNS[where]], fresh=True)  # a whole process of its own
    watch = SocketWatch(launch.proc.pid)
    assert launch.finish() == 0, launch.log()
    watch.thread.join(5)
    # The watch saw the run: the scheduler and its HTTP server, the worker, the process group's store.
    # A child forked by the driver (a subprocess between fork and exec) holds the driver's own
    # listeners for a moment; only a listener on an address the driver does not hold is a child's.
    listening = watch.listening()
    driver = {local for pid, _, local, _ in listening if pid == launch.proc.pid}
    childrens = {local for pid, _, local, _ in listening if pid != launch.proc.pid and local not in driver}
    assert len(listening) >= 5 and (where == "in-process") == (not childrens), watch.seen
    assert watch.off_loopback() == [], watch.off_loopback()
