"""Start or join the Dask cluster, and install Rollplex's engines on its workers.

Without an address, a ``LocalCluster`` bound to loopback is started (and stopped with the run).
With ``--scheduler tcp://HOST:PORT`` Rollplex joins a cluster started by the stock
``dask scheduler`` and ``dask worker --nthreads 3 --resources "decode=1,compute=1,host=1"`` commands.
Each worker declares one unit of resource per stream and runs one thread per stream: ``decode`` (the
decode engine), ``compute`` (forward/backward work) and ``host`` (rewards, advantages, reports, which
then never wait behind model work).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from distributed.diagnostics.plugin import WorkerPlugin

from rollplex.errors import EngineError, RollplexError
from rollplex.pipeline.worker import STREAMS, HostSpec

WORKER_FLAGS = '--nthreads 3 --resources "decode=1,compute=1,host=1"'
PLUGIN_NAME = "rollplex-engines"


class RollplexPlugin(WorkerPlugin):
    """Builds the engines when a worker starts (or joins later, e.g. after a restart)."""

    name = PLUGIN_NAME

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec

    def setup(self, worker) -> None:
        from rollplex import runtime
        from rollplex.pipeline.worker import install_host

        from rollplex.pipeline.recovery import quiet_task_errors

        runtime.configure(threads=self.spec.threads, device=self.spec.device)
        quiet_task_errors()  # the driver reports a failed node once; the worker's log would repeat it
        install_host(self.spec, name=worker.name if isinstance(worker.name, str) else f"worker{worker.name}")

    def teardown(self, worker) -> None:
        from rollplex.pipeline.worker import uninstall_host

        uninstall_host()


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
    cluster = LocalCluster(
        n_workers=workers,
        threads_per_worker=len(STREAMS),
        resources={s: 1 for s in STREAMS},
        processes=processes,
        # Loopback only. In-process workers take the scheduler's inproc address, which refuses a host.
        **({"host": "127.0.0.1"} if processes else {}),
        # The scheduler serves HTTP (health, metrics) even without the dashboard; a random port keeps
        # two runs on one machine from fighting over 8787.
        dashboard_address="127.0.0.1:8787" if dashboard else "127.0.0.1:0",
        env={"OMP_NUM_THREADS": str(threads)} if processes else None,
        silence_logs=logging.ERROR,
    )
    client = Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def _check_worker_resources(client) -> None:
    info = client.scheduler_info()
    workers = info.get("workers", {})
    if not workers:
        raise RollplexError("the Dask cluster has no workers; start them with "
                            f"`dask worker ADDRESS {WORKER_FLAGS}`")
    for address, w in workers.items():
        missing = [s for s in STREAMS if w.get("resources", {}).get(s, 0) < 1]
        if missing:
            raise RollplexError(f"Dask worker {address} lacks resources {missing}; start it with "
                                f"{WORKER_FLAGS}")


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
