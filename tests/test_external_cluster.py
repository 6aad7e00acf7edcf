"""`rollplex train --scheduler tcp://...` on a cluster started with the stock Dask commands: a worker
as `dask worker ADDRESS --nthreads 1 --resources GPU=1` starts it, which the run gives its stream
threads and resources while it runs and hands back afterwards."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_harness import worker_start_environment
from socket_watch import SocketWatch, sockets_of

BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _documented_worker_config() -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    return re.search(r"```yaml\n(.*?)```", text, re.S).group(1)


@pytest.fixture
def stock_cluster(tmp_path):
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    # The Dask config file docs/distributed.md gives for stock workers (glibc's own malloc tuning).
    (tmp_path / "dask-config").mkdir()
    (tmp_path / "dask-config" / "rollplex.yaml").write_text(_documented_worker_config())
    env = {**os.environ, "DASK_TEMPORARY_DIRECTORY": str(tmp_path), "DASK_CONFIG": str(tmp_path / "dask-config")}
    scheduler = subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                  "--no-dashboard"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([str(BIN / "dask"), "worker", address, "--nthreads", "1", "--resources", "GPU=1",
                               "--no-dashboard", "--host", "127.0.0.1"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from distributed import Client

        deadline = time.time() + 60
        with Client(address, timeout="30s") as client:
            while not client.scheduler_info()["workers"] and time.time() < deadline:
                time.sleep(0.2)
        yield address, (scheduler.pid, worker.pid)
    finally:
        _stop(worker, scheduler)


def _stop(worker: subprocess.Popen, scheduler: subprocess.Popen) -> None:
    """The worker first: with its scheduler gone, it spends 8 s trying to reach it before it exits."""
    for proc in (worker, scheduler):
        proc.terminate()
        proc.wait(timeout=30)


def test_train_on_a_stock_dask_cluster(stock_cluster, tmp_path):
    """The default engines (vLLM, DeepSpeed) train on the stock worker, and every socket the run opens
    there (DeepSpeed's process group, vLLM's) or in the driver stays on loopback, as the scheduler is."""
    address, cluster_pids = stock_cluster
    out = tmp_path / "run"
    driver = subprocess.Popen(
        [str(BIN / "rollplex"), "train", "--scheduler", address, "--iterations", "2", "--out", str(out),
         "--no-progress", "--set", "warmup.steps=1", "--set", "stop_at_reward=null"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = SocketWatch(driver.pid, *cluster_pids, before=sockets_of(*cluster_pids))
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr[-3000:]
    watch.thread.join(5)
    opened_by_worker = [k for k in watch.listening() if k[0] not in (driver.pid, cluster_pids[0])]
    assert opened_by_worker, watch.seen  # the watch saw the worker's process group store at least
    assert watch.off_loopback() == [], watch.off_loopback()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r["phase"] == "rl"] == [0, 1]
    from distributed import Client

    with Client(address, timeout="30s") as client:
        env = worker_start_environment(client)
        def threads_and_resources(dask_worker=None):  # nested: pickled by value, tests/ is not importable there
            return dask_worker.state.nthreads, dict(dask_worker.state.total_resources)

        [(threads, resources)] = client.run(threads_and_resources).values()
    assert "MALLOC_TRIM_THRESHOLD_" not in env  # the documented config reached the stock nanny
    assert env["OMP_NUM_THREADS"] == os.environ["OMP_NUM_THREADS"]
    assert threads == 1 and resources == {"GPU": 1, "decode": 0, "compute": 0, "host": 0}  # as it was started


def test_a_worker_with_two_units_of_a_stream_is_refused(tmp_path):
    """Two units of `decode` would let Dask run two decode tasks at once, which vLLM cannot take."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    scheduler = subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                  "--no-dashboard"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([str(BIN / "dask"), "worker", address, "--nthreads", "1", "--resources", "decode=2",
                               "--no-dashboard", "--host", "127.0.0.1"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        from distributed import Client

        with Client(address, timeout="30s") as client:  # the worker has joined: the run sees it
            client.wait_for_workers(1, timeout=60)
        result = subprocess.run([str(BIN / "rollplex"), "train", "--scheduler", address, "--iterations", "1",
                                 "--out", str(tmp_path / "run"), "--set", "warmup.steps=0"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "declares decode=2" in result.stderr, result.stderr
        assert not (tmp_path / "run").exists()  # nothing written
    finally:
        _stop(worker, scheduler)
