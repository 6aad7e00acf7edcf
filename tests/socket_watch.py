"""The inet sockets a set of process trees holds, sampled every few milliseconds (psutil reads
/proc/net/tcp*, udp* and each process's descriptors). Not a test module; shared by the tests that
check a run keeps to loopback."""
from __future__ import annotations

import threading
import time

import psutil

from rollplex.runtime import is_loopback


def sockets_of(*pids: int) -> dict[tuple, str]:
    """{(pid, status, local, remote): the process's command line} for the trees under ``pids`` now."""
    found: dict[tuple, str] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            try:
                conns = proc.net_connections(kind="inet")
                name = " ".join(proc.cmdline()[:3])
            except psutil.Error:
                continue
            for c in conns:
                remote = (c.raddr.ip, c.raddr.port) if c.raddr else None
                found.setdefault((proc.pid, c.status, (c.laddr.ip, c.laddr.port), remote), name)
    return found


class SocketWatch:
    """Every socket the trees under ``pids`` open while ``until`` runs, less those in ``before`` (what
    processes the run did not start, such as a stock Dask worker, held already)."""

    def __init__(self, *pids: int, until: int | None = None, before: dict | None = None) -> None:
        self.pids, self.until, self.before = pids, until or pids[0], set(before or ())
        self.seen: dict[tuple, str] = {}
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _running(self) -> bool:
        try:
            return psutil.Process(self.until).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _poll(self) -> None:
        while self._running():
            for key, name in sockets_of(*self.pids).items():
                if key not in self.before:
                    self.seen.setdefault(key, name)
            time.sleep(0.02)

    def listening(self) -> list[tuple]:
        return [k for k in self.seen if k[1] == psutil.CONN_LISTEN]

    def off_loopback(self) -> list[str]:
        return [f"{name}: {status} {local} -> {remote}" for (pid, status, local, remote), name in self.seen.items()
                if not is_loopback(local[0]) or (remote is not None and not is_loopback(remote[0]))]
