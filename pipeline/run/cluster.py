"""Start or join the Dask cluster, and install Rollplex's engines on its workers.

Without an address, a ``LocalCluster`` bound to loopback is started (and stopped with the run).
With ``--scheduler tcp://HOST:PORT`` Rollplex joins a cluster started by the stock ``dask scheduler``
and ``dask worker`` commands. Rollplex runs one thread per stream on each worker and gives each stream
one unit of a Dask resource of its name, so Dask never runs two tasks on one stream: ``decode`` (the
decode engine), ``compute`` (forward/backward work) and ``host`` (rewards, advantages, reports, which
then never wait behind model work). A stock worker (``dask worker ADDRESS --nthreads 1 --resources
GPU=1``) gets them from the plugin as it joins, and has its own back when the run ends.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import dask
from distributed import Worker
from distributed.diagnostics.plugin import WorkerPlugin

from rollplex.errors import EngineError, RollplexError
from rollplex.pipeline.run.worker import STREAMS, HostSpec

PLUGIN_NAME = "rollplex-engines"


class RollplexPlugin(WorkerPlugin):
    """Builds the engines when a worker starts (or joins later, e.g. after a restart)."""

    name = PLUGIN_NAME

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec
        self._lent: tuple | None = None  # what give_streams changed on this worker, for teardown

    async def setup(self, worker) -> None:
        from rollplex import runtime
        from rollplex.pipeline.run.worker import install_host

        from rollplex.pipeline.run.recovery import quiet_task_errors

        self._lent = await give_streams(worker)
        runtime.configure(threads=self.spec.threads, device=self.spec.device)
        quiet_task_errors()  # the driver reports a failed node once; the worker's log would repeat it
        if self.spec.world_size > 1:
            return  # ranks need a process group first: form_ranks builds the engines
        install_host(self.spec, name=worker.name if isinstance(worker.name, str) else f"worker{worker.name}")

    async def teardown(self, worker) -> None:
        from rollplex.pipeline.run.worker import uninstall_host

        uninstall_host()
        if self._lent is not None:
            await take_back_streams(worker, *self._lent)


async def give_streams(worker) -> tuple:
    """Make a worker able to run Rollplex's tasks: a thread per stream, and one unit of each stream's
    resource it does not declare (a declared one is checked by ``_check_worker_resources``). Returns
    (executor it had, its thread count, resources added) for ``take_back_streams``."""
    from distributed.threadpoolexecutor import ThreadPoolExecutor

    state = worker.state
    had_executor, had_threads = None, state.nthreads
    if state.nthreads < len(STREAMS):
        # The default executor's threads run tasks, and the worker starts at most nthreads at once.
        had_executor = worker.executors["default"]
        worker.executors["default"] = ThreadPoolExecutor(len(STREAMS), thread_name_prefix="Dask-Default-Threads")
        state.nthreads = len(STREAMS)
    added = [s for s in STREAMS if s not in state.total_resources]
    if added:
        await worker.set_resources(**{s: 1 for s in added})
    return had_executor, had_threads, added


async def take_back_streams(worker, executor, threads: int, added: list[str]) -> None:
    """Undo ``give_streams`` on a worker that outlives the run."""
    if executor is not None:
        ours, worker.executors["default"] = worker.executors["default"], executor
        worker.state.nthreads = threads
        ours.shutdown(wait=False)
    if added:
        await worker.set_resources(**{s: 0 for s in added})


def worker_process_environ(threads: int) -> dict:
    """The environment a local worker process starts with (Dask's nanny sets it before spawning).

    Dask's default sets ``MALLOC_TRIM_THRESHOLD_``, which turns off glibc's dynamic mmap threshold, so
    every large tensor became a fresh mmap of zeroed pages: 25 iterations of the default CPU job spent
    13 s of system time in a worker process against 4.5 s without it, and ran slower than the same
    job's in-process worker. OpenMP's thread count must be set here too; the nanny's ``env`` argument
    comes too late for it. A variable already in this process's environment still wins (Dask's rule).
    """
    # Dask's MKL_NUM_THREADS/OPENBLAS_NUM_THREADS=1 are left out: unset, they follow OpenMP's count.
    return {"distributed.nanny.pre-spawn-environ": {"MALLOC_TRIM_THRESHOLD_": None, "OMP_NUM_THREADS": str(threads)}}


class _InProcessWorker(Worker):
    """A worker in the driver's process. Its HTTP server (health, metrics) would take its host from
    the worker's address, which is inproc:// here, and so listen on every interface: loopback instead."""

    def __init__(self, *args, dashboard_address=None, **kwargs) -> None:
        super().__init__(*args, dashboard_address=dashboard_address or "127.0.0.1:0", **kwargs)


@contextlib.contextmanager
def connect(address: str | None, workers: int, threads: int, processes: bool = True,
            dashboard: bool = False, security=None) -> Iterator:
    from distributed import Client, LocalCluster

    logging.getLogger("distributed").setLevel(logging.WARNING)
    if address:
        try:
            client = Client(address, timeout="10s", security=security)
        except (OSError, TimeoutError) as exc:
            raise RollplexError(f"cannot reach the Dask scheduler at {address}: {exc}") from None
        try:
            _check_worker_resources(client)
            yield client
        finally:
            client.close()
        return
    import torch

    gpu = {"GPU": 1} if torch.cuda.is_available() else {}
    with dask.config.set(worker_process_environ(threads)):
        cluster = LocalCluster(
            n_workers=workers,
            threads_per_worker=len(STREAMS),
            resources={**{s: 1 for s in STREAMS}, **gpu},
            processes=processes,
            # Loopback only. In-process workers take the scheduler's inproc address, which refuses a host.
            **({"host": "127.0.0.1"} if processes else {"worker_class": _InProcessWorker}),
            # The scheduler serves HTTP (health, metrics) even without the dashboard; a random port keeps
            # two runs on one machine from fighting over 8787.
            dashboard_address="127.0.0.1:8787" if dashboard else "127.0.0.1:0",
            silence_logs=logging.ERROR,
        )
    client = Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def _check_worker_resources(client) -> None:
    """Refuse what the plugin cannot make work: no workers, or a worker that declares a stream's
    resource in another quantity (two units would let Dask run two tasks on one stream at once)."""
    workers = client.scheduler_info().get("workers", {})
    if not workers:
        raise RollplexError("the Dask cluster has no workers; start them with `dask worker ADDRESS`")
    for address, w in workers.items():
        wrong = {s: q for s in STREAMS if (q := w.get("resources", {}).get(s, 1)) != 1}
        if wrong:
            declared = ", ".join(f"{s}={q:g}" for s, q in wrong.items())
            raise RollplexError(f"Dask worker {address} declares {declared}; each stream runs one task at a "
                                f"time, so start it with 1 of each of {', '.join(STREAMS)} or none (Rollplex "
                                f"then adds them)")


def uninstall_engines(client) -> None:
    """Free the engines on a cluster that outlives the run (``--scheduler``)."""
    try:
        client.unregister_worker_plugin(PLUGIN_NAME)
    except Exception:  # noqa: BLE001 - best effort at shutdown; the workers may be gone already
        pass


def install_engines(client, spec: HostSpec) -> None:
    """Register the plugin; it builds the engines on every worker and reports failures here."""
    results = client.register_plugin(RollplexPlugin(spec), name=PLUGIN_NAME)
    failures = {addr: r for addr, r in (results or {}).items() if r.get("status") != "OK"}
    if failures:
        addr, res = next(iter(failures.items()))
        exc = res.get("exception")
        text = res.get("text") or str(exc)
        if isinstance(exc, RollplexError):
            raise exc
        raise EngineError(f"engine setup failed on worker {addr}: {text}")


# -- data-parallel ranks: one per worker ----------------------------------------------------------
RANK_TIMEOUT_S = 300  # gloo/NCCL: a collective whose peer died fails after this (the run then restarts)


def _host_of(address: str) -> str:
    return address.split("://")[-1].rsplit(":", 1)[0]


def _free_port_here(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _join_group(spec: HostSpec, rank: int, world: int, master: str, port: int, local_rank: int) -> int:
    """On a worker: join the process group as ``rank``, then build its engines (DeepSpeed adopts the
    group). On CUDA with several visible GPUs, local rank i takes GPU i (a worker per GPU)."""
    import dataclasses
    import datetime
    import os

    import torch

    from rollplex.pipeline.run.worker import install_host
    from rollplex.runtime import init_process_group

    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_rank))
    device = spec.device
    if device.startswith("cuda") and torch.cuda.device_count() > 1:
        device = f"cuda:{local_rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    init_process_group("nccl" if device.startswith("cuda") else "gloo", master, port, rank, world,
                       datetime.timedelta(seconds=RANK_TIMEOUT_S))
    install_host(dataclasses.replace(spec, device=device), name=f"rank{rank}")
    return os.getpid()


def _in_group() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_order(workers: dict[str, dict]) -> list[str]:
    """Worker addresses in rank order: by host, then worker name, so ranks on one host are adjacent
    (local ranks 0, 1, ... map to its GPUs) and the order does not depend on start-up timing."""
    return sorted(workers, key=lambda a: (_host_of(a), str(workers[a].get("name", "")), a))


def form_ranks(client, spec: HostSpec, world: int, timeout: float = 120) -> list[str]:
    """Make each of ``world`` workers a rank: one torch.distributed group across them (rendezvous on
    rank 0's host, a free port there), engines built inside it. Returns the addresses by rank."""
    try:
        client.wait_for_workers(world, timeout=timeout)
    except TimeoutError:
        have = len(client.scheduler_info(n_workers=-1)["workers"])
        raise RollplexError(f"cluster.workers is {world} but only {have} Dask worker(s) joined within "
                            f"{timeout:.0f} s; start one `dask worker` per GPU (or rank)") from None
    if any(client.run(_in_group).values()):
        # An earlier run's ranks (a cluster that outlives its runs): DeepSpeed caches groups made from
        # the old one, so fresh processes are the clean way to a new group.
        client.restart(timeout=timeout)
        client.wait_for_workers(world, timeout=timeout)
    workers = client.scheduler_info(n_workers=-1)["workers"]
    if len(workers) != world:
        raise RollplexError(f"the Dask cluster has {len(workers)} workers but cluster.workers is {world}; "
                            f"a data-parallel run uses one worker per rank (set --workers {len(workers)})")
    addresses = rank_order(workers)
    master = _host_of(addresses[0])
    port = client.run(_free_port_here, master, workers=[addresses[0]])[addresses[0]]
    hosts: dict[str, int] = {}
    futures = []
    for rank, address in enumerate(addresses):
        local = hosts.setdefault(_host_of(address), 0)
        hosts[_host_of(address)] += 1
        futures.append(client.submit(_join_group, spec, rank, world, master, port, local, workers=[address],
                                     allow_other_workers=False, pure=False, key=f"rollplex-rank{rank}-{port}"))
    try:
        client.gather(futures)
    except RollplexError:
        raise
    except Exception as exc:  # noqa: BLE001 - name the failure once, on the driver
        raise EngineError(f"forming {world} data-parallel ranks failed: {type(exc).__name__}: {exc}") from None
    return addresses


def restart_workers(client, log) -> None:
    """Every worker process afresh, each plugin rebuilding its engines, without waiting for them: the
    caller waits (``WorkerWatch.await_replacements``, ``form_ranks``) and names a failure there."""
    from rollplex.pipeline.run.recovery import REPLACEMENT_TIMEOUT_S

    try:
        client.restart(timeout=REPLACEMENT_TIMEOUT_S, wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - a worker may be mid-restart already; the wait covers it
        log(f"restarting the workers: {type(exc).__name__}: {exc}")


def reform_ranks(client, spec: HostSpec, world: int, watch, log) -> list[str]:
    """After a rank was lost: restart every worker, then form the group anew. The survivors cannot keep
    their engines: one may be blocked in a collective with the dead rank, and a torch.distributed group
    takes no newcomer. Every rank then starts fresh and the runner restores them all from the last
    checkpoint (or replays from the beginning before the first one)."""
    from rollplex.pipeline.run.recovery import REPLACEMENT_TIMEOUT_S

    restart_workers(client, log)
    addresses = form_ranks(client, spec, world, timeout=REPLACEMENT_TIMEOUT_S)
    watch.known = watch.identities()
    watch.expected = len(watch.known)
    watch.survived = set()
    log(f"{world} data-parallel ranks formed again: {', '.join(addresses)}")
    return addresses
