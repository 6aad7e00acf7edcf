"""Shared by the reliability tests: launch `rollplex train` as a process in its own process group (the
driver and its Dask worker processes; forked from a pre-imported server, tests/fork_server.py, or a
fresh interpreter), kill it, resume it, and compare run directories.

Not a test module (no ``test_`` prefix); the tests import it from their own directory.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import fork_server

DAG = Path(__file__).with_name("reliability_dag.py")
ITERATIONS = 6
WARMUP = 2
# A tiny run: 2 prompts × 2 samples × 2 tokens, two loss micro-batches, a checkpoint every iteration.
TINY = [
    "--seed", "5", "--iterations", str(ITERATIONS), "--no-progress",
    "--set", "rollout.prompts_per_iteration=2", "--set", "rollout.samples_per_prompt=2",
    "--set", "rollout.max_new_tokens=2", "--set", "rollout.chunk_tokens=1",
    "--set", f"warmup.steps={WARMUP}", "--set", "warmup.batch_size=2",
    "--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=2", "--set", "stop_at_reward=null",
    "--set", "train.micro_batch_groups=1",
]
HF_TORCH = ["--set", "engines.decode=hf", "--set", "engines.train=torch"]
# Metrics that are a function of the run's inputs (not of timing).
DETERMINISTIC = ("reward_mean", "reward_std", "loss", "grad_norm", "kl", "response_len_mean", "lr", "warmup_loss")


class Launch:
    """One `rollplex train` process group; its stdout lines are collected as they come.

    The process is forked from a server that imported the stack once (tests/fork_server.py: 2 s of a
    tiny run instead of 6.5 s), unless ``fresh``: a new interpreter, with a str-hash seed of its own,
    for a run that other launches are compared against or whose whole process is under watch."""

    def __init__(self, run_dir: Path, extra: list[str], env: dict[str, str] | None = None,
                 fresh: bool = False) -> None:
        argv = ["train", str(DAG), "--out", str(run_dir), "--resume", *TINY, *extra]
        env = {**os.environ, **(env or {})}
        if fresh:
            self.proc = subprocess.Popen([sys.executable, "-m", "rollplex.cli", *argv], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
        else:
            warm = fork_server.WARM_HF if {"engines.decode=hf", "engines.train=torch"} <= set(extra) else \
                fork_server.WARM_DEFAULT
            self.proc = fork_server.server(warm, env).spawn(argv, env)
        self.lines: list[str] = []
        self.err: list[str] = []
        self.ready = threading.Event()
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)]
        for t in self._readers:
            t.start()

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("engines ready") or line.startswith("workers ready"):
                self.ready.set()
        self.ready.set()

    def wait_for(self, pattern: str, timeout: float = 120) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(re.search(pattern, line) for line in self.lines):
                return True
            if self.proc.poll() is not None:
                self._readers[0].join(5)
                return any(re.search(pattern, line) for line in self.lines)
            time.sleep(0.02)
        return False

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = 300) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"rollplex train did not finish in {timeout} s:\n" + self.log()) from None
        for t in self._readers:
            t.join(5)
        return self.proc.returncode

    def log(self) -> str:
        return "\n".join(self.lines[-30:]) + "\n--- stderr ---\n" + self.stderr[-3000:]


def worker_start_environment(client) -> dict[str, str]:
    """The environment the cluster's one worker process started with (what glibc and OpenMP read),
    from /proc; ``read_bytes`` of an importable class travels to a worker that cannot import tests/."""
    [raw] = client.run(Path("/proc/self/environ").read_bytes).values()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def run_to_end(run_dir: Path, extra: list[str], env: dict[str, str] | None = None, fresh: bool = False) -> Launch:
    launch = Launch(run_dir, extra, env, fresh)
    rc = launch.finish()
    assert rc == 0, launch.log()
    return launch


def run_concurrently(*calls: Callable[[], Any]) -> list[Any]:
    """Each call in a thread of its own, all at once (a launch is mostly single-threaded imports);
    their results in order. The first exception any of them raised is raised here, in the caller's
    thread, once every thread has ended."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def group_gone(pgid: int, timeout: float = 10) -> bool:
    """True once no process of the group is left (the Dask workers die with the driver)."""
    import psutil

    def alive(p) -> bool:
        try:
            return _pgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(alive(p) for p in psutil.process_iter()):
            return True
        time.sleep(0.1)
    return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


# -- what a run directory must look like ----------------------------------------------------------
def assert_intact(run_dir: Path) -> None:
    """After any kill: every complete checkpoint verifies, none is half there, metrics parse."""
    from rollplex.pipeline.run import checkpoints

    root = run_dir / "checkpoints"
    if root.exists():
        for d in checkpoints.final_dirs(root):
            assert (d / "manifest.json").exists(), f"{d} is under its final name without a manifest"
            checkpoints.verify(d)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        lines = metrics.read_text().splitlines()
        for line in lines[:-1]:  # a kill mid-append may tear only the last line; resume drops it
            json.loads(line)


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {f"model/{k}": v for k, v in load_file(str(directory / "model.safetensors")).items()}
    optimizer = directory / "optimizer.pt"
    if optimizer.exists():
        state = torch.load(optimizer, weights_only=True)["state"]
        tensors.update({f"adam/{i}/{k}": v for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)})
    return tensors


def assert_same_run(expected: Path, actual: Path) -> None:
    """Equal weights and optimizer state, byte-identical rollouts, the same metrics sequence with no gap
    or duplicate, the same checkpoints kept, nothing stale left behind."""
    rows = metric_rows(actual)
    ref = metric_rows(expected)
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in ref] == \
        list(range(-WARMUP, 0)) + list(range(ITERATIONS)), [r["iteration"] for r in rows]
    for a, b in zip(ref, rows):
        assert {k: a.get(k) for k in DETERMINISTIC} == {k: b.get(k) for k in DETERMINISTIC}, (a, b)
    for i in range(ITERATIONS):
        name = f"iter_{i:06d}.jsonl"
        assert (actual / "rollouts" / name).read_bytes() == (expected / "rollouts" / name).read_bytes(), name
    kept = sorted(p.name for p in (actual / "checkpoints").iterdir())
    assert kept == sorted(p.name for p in (expected / "checkpoints").iterdir()), kept
    final = f"checkpoints/iter_{ITERATIONS - 1:06d}"
    a, b = checkpoint_tensors(expected / final), checkpoint_tensors(actual / final)
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[:3]}"
    stale = [p for p in actual.rglob("*") if p.name.startswith((".tmp-", ".trash-", ".reference-tmp"))
             or p.name.endswith(".tmp")]
    assert not stale, stale


# -- kill points ----------------------------------------------------------------------------------
CATEGORIES = {
    "decode": ["task:decode_chunk:before", "task:decode_chunk:after"],
    "optimizer": ["task:loss:after", "task:optimizer_step:before", "task:optimizer_step:after"],
    "checkpoint": ["save:model", "checkpoint:staged", "checkpoint:manifest", "checkpoint:renamed",
                   "checkpoint:retained"],
    "other": ["warmup:step", "iteration:start", "iteration:written", "task:weight_sync:after", "task:reward:after"],
}


def kinds_per_iteration(graph_txt: Path) -> Counter:
    return Counter(re.findall(r" = (\w+)\[", graph_txt.read_text()))


def occurrences(point: str, remaining: int, warmup_pending: bool, per_iteration: Counter) -> int:
    """How often a launch that still has ``remaining`` iterations (and perhaps the warm-up) reaches it."""
    checkpoints = remaining + (1 if warmup_pending else 0)
    if point == "warmup:step":
        return WARMUP if warmup_pending else 0
    if point.startswith("iteration:"):
        return remaining
    if point.startswith("task:"):
        return remaining * per_iteration[point.split(":")[1]]
    return checkpoints  # save:model, checkpoint:*


def progress(run_dir: Path) -> tuple[int, bool]:
    """(iterations still to run, warm-up still to run) for the next --resume of ``run_dir``."""
    from rollplex.pipeline.run import checkpoints

    name = checkpoints.latest_name(run_dir)
    if name is None:
        return ITERATIONS, True
    return ITERATIONS - (checkpoints.iteration_of(name) + 1), False


@dataclass
class Chain:
    """Kill a run over and over, resuming each time; when a run is complete, compare it with the
    uninterrupted ``reference`` and start the next one in a fresh directory. Records every kill."""

    root: Path
    reference: Path
    rng: random.Random
    per_iteration: Counter
    extra: list[str]
    kills: list[str] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)
    runs: int = 0
    seconds: float = 0.0
    reference_ready: threading.Event | None = None  # set once ``reference`` has finished

    @property
    def run_dir(self) -> Path:
        return self.root / f"run{self.runs}"

    def _launch(self, env: dict[str, str] | None = None) -> Launch:
        remaining, warmup = progress(self.run_dir)
        if remaining == 0 and not warmup:  # complete: compare, then carry on with a new run
            self.complete()
        return Launch(self.run_dir, self.extra, env)

    def complete(self) -> None:
        launch = run_to_end(self.run_dir, self.extra)
        assert group_gone(launch.proc.pid)
        if self.reference_ready is not None:
            assert self.reference_ready.wait(600), "the reference run never finished"
        assert_same_run(self.reference, self.run_dir)
        self.runs += 1

    def fault_kill(self, category: str) -> None:
        remaining, warmup = progress(self.run_dir)
        if remaining == 0 and not warmup:
            self.complete()
            remaining, warmup = progress(self.run_dir)
        options = []
        for p in CATEGORIES[category]:
            n = occurrences(p, remaining, warmup, self.per_iteration)
            if p in ("checkpoint:renamed", "checkpoint:retained"):
                n -= 1  # after the last checkpoint's rename the run is complete: nothing left to kill
            if n > 0:
                options.append((p, n))
        if not options:  # e.g. warm-up points once it is done: a checkpoint point is always there
            return self.fault_kill("checkpoint")
        point, most = self.rng.choice(options)
        nth = self.rng.randint(1, most)
        launch = self._launch({"ROLLPLEX_TEST_FAULT": f"{point}#{nth}"})
        rc = launch.finish()
        assert rc == -signal.SIGKILL, f"{point}#{nth} did not kill the run (rc {rc}):\n{launch.log()}"
        assert group_gone(launch.proc.pid), "a process of the killed group survived"
        self.kills.append(f"{point}#{nth}")

    def timer_kill(self) -> None:
        """SIGKILL at a random wall-clock moment of the work (start-up writes nothing worth a kill)."""
        remaining, warmup = progress(self.run_dir)
        launch = self._launch()
        remaining, warmup = progress(self.run_dir)
        launch.ready.wait(120)
        delay = self.rng.uniform(0, 0.15 * remaining + (0.4 if warmup else 0.05))
        time.sleep(delay)
        launch.signal_group(signal.SIGKILL)
        rc = launch.finish()
        assert rc in (-signal.SIGKILL, 0), launch.log()
        assert group_gone(launch.proc.pid)
        if rc == -signal.SIGKILL:  # else the run finished first: not a kill
            self.kills.append(f"timer+{delay:.2f}s")

    def graceful(self, sig: int) -> None:
        """SIGINT to the whole group (a Ctrl-C) or SIGTERM to the driver alone (a job scheduler)."""
        launch = self._launch()
        remaining, _ = progress(self.run_dir)
        launch.ready.wait(120)
        time.sleep(self.rng.uniform(0, 0.1 * remaining))
        if sig == signal.SIGINT:
            launch.signal_group(sig)
        else:
            launch.proc.send_signal(sig)
        rc = launch.finish()
        assert group_gone(launch.proc.pid), "the Dask workers outlived a stopped driver"
        if rc == 0:
            return
        name = signal.Signals(sig).name
        lines = launch.stderr.strip().splitlines()
        assert rc == 128 + sig and lines and lines[-1].startswith(f"rollplex: {name}: stopped"), launch.log()
        assert "Traceback" not in launch.stderr, launch.log()
        done = re.search(r"after iteration (-?\d+), checkpoint (iter_\S+) written", lines[-1])
        printed = [int(m.group(1)) for line in launch.lines if (m := re.match(r"it +(\d+) ", line))]
        if done and printed:  # the checkpoint is of the last iteration the run printed
            assert int(done.group(1)) == printed[-1], (lines[-1], printed)
        if done:
            assert (self.run_dir / "checkpoints" / done.group(2) / "manifest.json").exists(), lines[-1]
        self.signals.append(f"{name}: {lines[-1].split('stopped ')[1].split(';')[0]}")

    def run(self, n_kills: int, timer_share: float, graceful: tuple[int, ...] = ()) -> None:
        start = time.time()
        plan = ["decode", "optimizer", "checkpoint", "timer"][:max(3, n_kills)]  # each kind at least once
        self.rng.shuffle(plan)
        while len(plan) < n_kills:
            plan.append("timer" if self.rng.random() < timer_share else self.rng.choice(list(CATEGORIES)))
        steps: list = list(plan)
        for sig in graceful:
            steps.insert(self.rng.randint(1, len(steps)), sig)
        for step in steps:
            if step == "timer":
                self.timer_kill()
            elif isinstance(step, int):
                self.graceful(step)
            else:
                self.fault_kill(step)
            assert_intact(self.run_dir)
        while len(self.kills) < n_kills:  # timer kills that came after the end did not count
            self.fault_kill(self.rng.choice(list(CATEGORIES)))
            assert_intact(self.run_dir)
        self.complete()
        self.seconds = time.time() - start


# -- the CLI in a pre-imported process ------------------------------------------------------------
@dataclass
class CliResult:
    rc: int
    stdout: str
    stderr: str
    changed: list[str]  # files created, modified or removed under the working directory


class WarmCli:
    """`rollplex ARGS` in a child forked from one process that imported everything once
    (tests/fork_server.py, the server Launch uses): each case is its own process (exit code, file
    descriptors, working directory) without paying for torch and transformers imports again.
    ``setup`` is Python run in the child first (e.g. to feed the dataset a bad image)."""

    def __call__(self, cwd: Path, argv: list[str], setup: str = "") -> CliResult:
        before = snapshot(cwd)
        env = dict(os.environ)
        proc = fork_server.server(fork_server.WARM_HF, env).spawn(argv, env, cwd=str(cwd), setup=setup)
        out, err = proc.communicate(timeout=300)
        after = snapshot(cwd)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        return CliResult(proc.returncode, out, err, changed)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() or p.is_dir()}
