"""A fork server for `rollplex` commands: one process imports the stack once, then forks a child per
command that runs ``python -m rollplex.cli ARGS`` (or the ``rollplex`` console script) as a fresh
process would, in a session and process group of its own, with the caller's environment, working
directory, stdout and stderr.

A fresh interpreter spends about 3.5 s of CPU importing torch, transformers and the rest before a tiny
run's first line, most of such a run's cost; a forked child starts with them imported. The child's
memory holds nothing of any earlier run: the server itself never runs one. What a fork shares with its
siblings and a fresh process would not: the str-hash seed (fixed when the server started) and what
import time drew from the RNGs, which the child draws again (numpy's, torch's; the stdlib's
``random`` reseeds itself after a fork). A comparison across processes that must see different hash
seeds keeps one side fresh (``Launch(..., fresh=True)``).

Not a test module: ``reliability_harness.Launch`` uses it; run as a script, it is the server.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Imported once by the server; vLLM only where a launch uses it: what a run never imports stays out of
# its process. Not rollplex.cli itself, which the child runs as __main__ (as `-m` does), nor DeepSpeed,
# which picks its accelerator as it loads, after the run has set DS_ACCELERATOR.
WARM_HF = ("rollplex.pipeline.run.runner", "rollplex.pipeline.run.preflight", "rollplex.pipeline.run.cluster",
           "rollplex.pipeline.run.execution", "rollplex.engines", "rollplex.tasks.data",
           "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "transformers.models.auto.processing_auto",
           "transformers.models.qwen2_5_vl.processing_qwen2_5_vl", "transformers.tokenization_mistral_common")
WARM_DEFAULT = (*WARM_HF, "vllm")


def _serve(path: str):
    """Accept launch requests on ``path`` until the caller closes stdin; return (request, fds) in a
    forked child, None in the server when it is told to stop."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    conns: list[socket.socket] = []
    owner: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([0, listener, wake_r, *conns], [], [])
        if 0 in ready and not os.read(0, 1 << 16):
            return None
        if listener in ready:
            conns.append(listener.accept()[0])
        for conn in [c for c in conns if c in ready]:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            if not msg:  # the caller is done with this child
                conns.remove(conn)
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for s in (listener, *conns):
                    s.close()
                os.close(wake_r)
                os.close(wake_w)
                return json.loads(msg), fds
            for fd in fds:
                os.close(fd)
            owner[pid] = conn
            conn.send(json.dumps({"pid": pid}).encode())
        if wake_r in ready:
            try:
                os.read(wake_r, 1 << 16)
            except BlockingIOError:
                pass
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = owner.pop(pid, None)
                if conn is not None:
                    try:
                        conn.send(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode())
                    except OSError:
                        pass


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: what ``subprocess.Popen([python, "-m", "rollplex.cli", ...],
    start_new_session=True, env=..., cwd=...)`` would have set up."""
    import numpy as np
    import torch

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    # The server started with the request's environment (less the variables read only later, which
    # come from the request); what its imports set there (torch's TORCHINDUCTOR_CACHE_DIR, vLLM's
    # compile settings, cv2's LD_LIBRARY_PATH) is what a fresh process would hold at this point too.
    env = {k: v for k, v in os.environ.items() if not k.startswith(RUNTIME_ONLY)}
    env.update({k: v for k, v in request["env"].items() if k.startswith(RUNTIME_ONLY)})
    os.environ.clear()
    os.environ.update(env)
    script = request["script"]
    sys.argv = [script or "-m", *request["argv"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()  # as Python puts it
    assert "rollplex.cli" not in sys.modules, "the server imported rollplex.cli, which `-m` runs as __main__"
    np.random.seed()  # a fresh process's numpy state is its own
    torch.manual_seed(torch.initial_seed())  # and torch's is the default seed's, whatever imports drew
    exec(compile(request["setup"], "<setup>", "exec"), {})  # a test's patch (WarmCli's setup), before the CLI


def _run_cli(script: str | None) -> int:
    """``python -m rollplex.cli``'s (or ``python SCRIPT``'s) exit status, with what Python prints for
    an uncaught exception."""
    import runpy

    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module("rollplex.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return -signal.SIGINT  # Python dies of the signal itself
    except BaseException:  # noqa: BLE001 - reported as Python would, exit status 1
        sys.excepthook(*sys.exc_info())
    return 1


def main() -> None:
    for name in json.loads(sys.argv[2]):
        __import__(name)
    served = _serve(sys.argv[1])
    if served is None:
        return
    _become(*served)
    status = _run_cli(served[0]["script"])
    # Python's own exit less its last step: non-daemon threads joined, atexit handlers run, streams
    # flushed, but the server's modules not torn down (a second of copy-on-write page faults in the
    # child, for objects nothing else will read).
    import atexit

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status & 0xFF)


# -- the caller's side ---------------------------------------------------------------------------
class ForkedProcess:
    """What the tests use of a ``subprocess.Popen`` (text mode, stdout and stderr piped), for a child
    of the fork server: its exit status comes from the server, which reaps it."""

    def __init__(self, server: "ForkServer", argv: list[str], env: dict[str, str], cwd: str | None = None,
                 setup: str = "", script: str | None = None) -> None:
        self.args = argv
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(server.path)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "setup": setup, "script": script}
            socket.send_fds(self._conn, [json.dumps(request).encode()], [out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout = open(out_r)  # noqa: SIM115 - closed by its reader, as Popen's pipes are
        self.stderr = open(err_r)  # noqa: SIM115
        reply = self._conn.recv(1 << 16)
        if not reply:
            raise RuntimeError("the fork server closed the connection before starting the command")
        self.pid = json.loads(reply)["pid"]
        threading.Thread(target=self._wait_for_exit, daemon=True).start()

    def _wait_for_exit(self) -> None:
        reply = self._conn.recv(1 << 16)
        self._conn.close()
        self.returncode = json.loads(reply)["rc"] if reply else 255  # 255: the server itself died
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything the child (and what it started) wrote, once it has exited."""
        got: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=n, f=f: got.update({n: f.read()}), daemon=True)
                   for n, f in (("out", self.stdout), ("err", self.stderr))]
        for r in readers:
            r.start()
        self.wait(timeout)
        for r in readers:
            r.join(timeout)
            if r.is_alive():  # a process the child started still holds its pipes
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.stdout.close()
        self.stderr.close()
        return got["out"], got["err"]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The server process, started with ``env``; it imports ``warm`` while the caller goes on, and
    stops when the caller's process exits (its stdin closes) or when it is retired and its last child
    has exited."""

    def __init__(self, warm: tuple[str, ...], env: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="rollplex-fork-")
        self.path = os.path.join(self._dir, "socket")
        self.env = env
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), self.path, json.dumps(warm)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lock = threading.Lock()
        self._started = False
        self._running = 0
        self._retired = False

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None, setup: str = "",
              script: str | None = None) -> ForkedProcess:
        assert _started_with(env) == self.env, "a child's environment is its server's (see server())"
        with self._lock:
            if not self._started:
                line = self.proc.stdout.readline()
                if line != "ready\n":
                    raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()})")
                self._started = True
            self._running += 1
        try:
            child = ForkedProcess(self, argv, env, cwd, setup, script)
        except BaseException:
            self._exited()
            raise
        threading.Thread(target=lambda: (child.wait(), self._exited()), daemon=True).start()
        return child

    def _exited(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._retired and self._running == 0
        if last:
            self.close()

    def retire(self) -> None:
        """No more children: stop once those running have exited."""
        with self._lock:
            self._retired = True
            idle = self._running == 0
        if idle:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


# Read after start-up, so a child may be given other values than its server started with: the tests'
# fault and NaN switches, W&B's settings, pytest's name of the running test.
RUNTIME_ONLY = ("ROLLPLEX_TEST_", "WANDB_", "PYTEST_CURRENT_TEST")
_SERVERS: dict[tuple[str, ...], ForkServer] = {}


def _started_with(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(RUNTIME_ONLY)}

_LOCK = threading.Lock()


def server(warm: tuple[str, ...], env: dict[str, str] | None = None) -> ForkServer:
    """This process's server for ``warm`` whose children start as a fresh process with ``env`` would.
    A server imported its modules under the environment it started with, so another one starts when
    anything else in ``env`` differs (tests that run engines in the test process leave variables
    behind: vLLM's, DeepSpeed's RANK and WORLD_SIZE, Dask's PYTHONHASHSEED). Each stops with this
    process, or once a newer one has replaced it and its last child has exited."""
    import atexit

    env = _started_with(os.environ if env is None else env)
    with _LOCK:
        current = _SERVERS.get(warm)
        if current is None or current.env != env:
            if current is not None:
                current.retire()
            _SERVERS[warm] = current = ForkServer(warm, env)
            atexit.register(current.close)
        return current


def run(argv: list[str], warm: tuple[str, ...] = WARM_HF, env: dict[str, str] | None = None,
        timeout: float | None = None, script: str | None = None, cwd: str | Path | None = None
        ) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "rollplex.cli", *argv], capture_output=True, text=True, ...)``
    (``[script, *argv]`` with ``script``, e.g. the ``rollplex`` console script) through the fork
    server."""
    env = dict(os.environ if env is None else env)
    command = [script] if script else [sys.executable, "-m", "rollplex.cli"]
    proc = server(warm, env).spawn(argv, env, cwd=str(cwd) if cwd else None, script=script)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess([*command, *argv], proc.returncode, out, err)


if __name__ == "__main__":
    main()
