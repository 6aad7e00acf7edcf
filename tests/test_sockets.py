"""Every socket a run opens stays on loopback when no remote scheduler is given.

A real `rollplex train` (the default engines: in-process vLLM, DeepSpeed) runs while a thread lists
the inet sockets of every process of its group (the driver, the nanny's worker processes) every
few milliseconds: Dask's comms and HTTP servers, torch's TCPStore, gloo's pairs, vLLM's.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
from reliability_harness import Launch

from rollplex.runtime import is_loopback


class SocketWatch:
    """The (pid, kind, local, remote) of every inet socket the process tree under ``pid`` holds,
    sampled until it exits."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[tuple, str] = {}
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while psutil.pid_exists(self.pid):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            for proc in procs:
                try:
                    conns = proc.net_connections(kind="inet")
                    name = " ".join(proc.cmdline()[:3])
                except psutil.Error:
                    continue
                for c in conns:
                    remote = (c.raddr.ip, c.raddr.port) if c.raddr else None
                    self.seen.setdefault((proc.pid, c.status, (c.laddr.ip, c.laddr.port), remote), name)
            time.sleep(0.02)

    def listening(self) -> list[tuple]:
        return [k for k in self.seen if k[1] == psutil.CONN_LISTEN]

    def off_loopback(self) -> list[str]:
        return [f"{name}: {status} {local} -> {remote}" for (pid, status, local, remote), name in self.seen.items()
                if not is_loopback(local[0]) or (remote is not None and not is_loopback(remote[0]))]


RUNS = {"in-process": [], "worker-process": ["--set", "cluster.processes=true"],
        "data-parallel ranks": ["--workers", "2"]}  # two worker processes in one process group


@pytest.mark.parametrize("where", list(RUNS))
def test_a_default_run_opens_no_socket_outside_loopback(tmp_path: Path, where: str):
    launch = Launch(tmp_path / "run", ["--iterations", "1", *RUNS[where]])
    watch = SocketWatch(launch.proc.pid)
    assert launch.finish() == 0, launch.log()
    watch.thread.join(5)
    # The watch saw the run: the scheduler and its HTTP server, the worker, the process group's store.
    pids = {k[0] for k in watch.listening()}
    assert len(watch.listening()) >= 5 and (where == "in-process") == (pids == {launch.proc.pid}), watch.seen
    assert watch.off_loopback() == [], watch.off_loopback()
