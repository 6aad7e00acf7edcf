"""Lower a scheduled iteration to Dask tasks and run it on a Dask distributed cluster.

Lowering is the last step and is explicit: one ``dask._task_spec.Task`` per node, whose arguments
are ``TaskRef``s to the producers of its inputs (and, after them, to ordering-only predecessors such
as serial barriers). Each task carries a resource annotation for its stream (``{"decode": 1}`` or
``{"compute": 1}``): workers declare one unit of each and run one thread per stream, so Dask never
runs two tasks on one stream. The whole iteration is submitted as one graph, so Dask's optimiser
cannot drop the annotations, and only the report's future is held by the client.

With one worker the default is coarser (``cluster.lowering``): the whole iteration is one Dask task
on that worker, whose local executor (``pipeline/run/local.py``) runs the nodes on its stream threads
under the same rules. Dask's scheduler then sits between iterations, not between every two nodes,
which on a small job was a third of the iteration (4.75 ms per node, 38 nodes, on 2 CPU cores).
Data-parallel ranks keep one task per node: their host values cross workers through Dask.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import dask
from dask._task_spec import DataNode, Task, TaskRef

from rollplex.pipeline.compile.ir import IterationGraph
from rollplex.pipeline.run.tables import lowering_tables
from rollplex.pipeline.run.execution import provide_input, run_iteration, run_node
from rollplex.pipeline.run.worker import IterationResult


class KeyLookup:
    """A per-key annotation: Dask calls it with each key of the submitted graph (picklable)."""

    def __init__(self, table: dict[str, Any], default: Any = None) -> None:
        self.table = table
        self.default = default

    def __call__(self, key: str) -> Any:
        return self.table.get(key, self.default)


@dataclass
class LoweredIteration:
    graph: dict[str, Task]
    resources: dict[str, dict[str, int]]
    priority: dict[str, float]
    workers: dict[str, list[str]]
    output_key: str


def task_key(iteration: int, node: str) -> str:
    return f"it{iteration:06d}/{node}"


def _done(bundle: Any) -> None:
    """An ordering token: finishes after its producer, on the producer's worker, and carries nothing."""
    return None


def _check_inputs(graph: IterationGraph, inputs: dict[str, Any]) -> None:
    missing = [v for v in graph.inputs if v not in inputs]
    if missing:
        raise KeyError(f"iteration inputs missing: {missing}")


def lower(graph: IterationGraph, iteration: int, inputs: dict[str, Any],
          ranks: list[str] | None = None, installed: str | None = None) -> LoweredIteration:
    """``ranks``: worker address per rank of a data-parallel graph (``pipeline/compile/ranks.py``); each node
    is restricted to its rank's worker, and an ordering edge between ranks goes through a token task
    so that no output bundle moves for it. The graph's own tables (``tables.lowering_tables``) are
    built once per graph; an iteration only makes its tasks. ``installed``: the graph's name on the
    workers (their host spec holds it), so each task names its node instead of carrying it."""
    _check_inputs(graph, inputs)
    t = lowering_tables(graph, ranked=bool(ranks))
    dsk: dict[str, Task] = {}
    resources: dict[str, dict[str, int]] = {}
    priority: dict[str, float] = {}
    workers: dict[str, list[str]] = {}
    for name in graph.inputs:
        key = task_key(iteration, f"in/{name}")
        dsk[key] = Task(key, provide_input, DataNode(None, inputs[name]), name)
        resources[key] = {"host": 1}
        priority[key] = 1e6
        if ranks and t.readers_rank[name] is not None:
            workers[key] = [ranks[t.readers_rank[name]]]
    for node_name in t.run.order:
        node = graph.nodes[node_name]
        rank = t.rank[node_name]
        producers = [task_key(iteration, p if p is not None else f"in/{v}") for p, v in t.producers[node_name]]
        ordering = []
        for p in t.ordering[node_name]:
            ref = task_key(iteration, p)
            if t.rank[p] != rank:
                token = ref + "/done"
                if token not in dsk:
                    dsk[token] = Task(token, _done, TaskRef(ref))
                    workers[token] = [ranks[t.rank[p]]]
                    resources[token] = {}  # no stream: Dask asserts that a resources annotation is a dict
                ref = token
            ordering.append(ref)
        key = task_key(iteration, node_name)
        refs = [TaskRef(k) for k in producers + ordering]
        if installed:  # the worker reads the node and its values' records from its own copy
            dsk[key] = Task(key, run_node, (installed, node_name), iteration, t.uses[node_name], None,
                            len(producers), *refs)
        else:
            dsk[key] = Task(key, run_node, node, iteration, t.uses[node_name], t.records[node_name],
                            len(producers), *refs)
        resources[key] = {node.stream: 1}
        priority[key] = float(node.meta.get("priority", 0.0))
        if ranks:
            workers[key] = [ranks[rank]]
        elif "worker" in node.meta:
            workers[key] = [node.meta["worker"]]
    if len(t.run.sinks) != 1:
        raise ValueError(f"an iteration graph needs exactly one sink (the report); found {sorted(t.run.sinks)}")
    (sink,) = t.run.sinks
    return LoweredIteration(dsk, resources, priority, workers, task_key(iteration, sink))


class DaskExecutor:
    """Runs lowered iterations on a ``distributed.Client`` whose workers host Rollplex engines."""

    def __init__(self, client, ranks: list[str] | None = None, lowering: str = "auto",
                 installed: dict[str, IterationGraph] | None = None) -> None:
        self.client = client
        self.ranks = ranks  # worker address per data-parallel rank; None: one worker
        self.installed = dict(installed or {})  # graphs the workers hold by name (HostSpec.graphs)
        if lowering not in ("auto", "nodes", "iteration"):
            raise ValueError(f"lowering {lowering!r} is not one of auto, nodes, iteration")
        if lowering == "iteration" and ranks:
            raise ValueError("lowering 'iteration' needs one worker: data-parallel ranks exchange values mid-iteration")
        self.whole_iterations = lowering == "iteration" or (lowering == "auto" and not ranks)

    def _name_of(self, graph: IterationGraph) -> str | None:
        return next((name for name, g in self.installed.items() if g is graph), None)

    def run(self, graph: IterationGraph, iteration: int, inputs: dict[str, Any],
            prefetch: tuple = ()) -> IterationResult:
        """``prefetch``: the next iteration's prompt indices, which the worker builds meanwhile."""
        from rollplex.pipeline.run.worker import current_host  # noqa: F401 - fail early if misinstalled

        if self.whole_iterations:
            return self._run_whole(graph, iteration, inputs, prefetch)
        lowered = lower(graph, iteration, inputs, self.ranks, self._name_of(graph))
        start = time.time()
        annotations = {"resources": KeyLookup(lowered.resources), "priority": KeyLookup(lowered.priority, 0.0)}
        if lowered.workers:
            annotations["workers"] = KeyLookup(lowered.workers)
        with dask.annotate(**annotations):
            (future,) = self.client.get(lowered.graph, [lowered.output_key], sync=False)
        try:
            output = future.result()
        finally:
            del future
        seconds = time.time() - start
        drained = self.client.run(_drain)
        events = [e for d in drained.values() for e in d["events"]]
        peak = max((d["peak_memory_bytes"] for d in drained.values()), default=0)
        retries = sum(d["alloc_retries"] for d in drained.values())
        return IterationResult(output, events, peak, seconds, alloc_retries=retries)

    def _run_whole(self, graph: IterationGraph, iteration: int, inputs: dict[str, Any],
                   prefetch: tuple) -> IterationResult:
        _check_inputs(graph, inputs)
        start = time.time()
        future = self.client.submit(run_iteration, self._name_of(graph) or graph, iteration, inputs, tuple(prefetch),
                                    key=task_key(iteration, "iteration"), pure=False)
        try:
            result = future.result()
        finally:
            del future
        result.seconds = time.time() - start  # the driver's view, as for a lowered graph
        return result

    def call(self, fn, *args, stream: str = "compute") -> Any:
        """Run ``fn(host, *args)`` on a worker's engines, on one of its streams. With ranks, on every
        rank at once (their engines step together: collectives inside), returning rank 0's result."""
        from rollplex.pipeline.run.execution import call_on_host

        if not self.ranks:
            future = self.client.submit(call_on_host, fn, *args, stream=stream, resources={stream: 1}, pure=False)
            return future.result()
        futures = [self.client.submit(call_on_host, fn, *args, stream=stream, resources={stream: 1}, pure=False,
                                      workers=[address], allow_other_workers=False) for address in self.ranks]
        results = self.client.gather(futures)
        return results[0]

    def call_each(self, fn, args_of_rank: list[tuple], stream: str = "compute") -> list:
        """``fn(host, *args_of_rank[r])`` on every rank r at once (one worker: rank 0's); each result."""
        from rollplex.pipeline.run.execution import call_on_host

        if not self.ranks:
            return [self.call(fn, *args_of_rank[0], stream=stream)]
        futures = [self.client.submit(call_on_host, fn, *args, stream=stream, resources={stream: 1}, pure=False,
                                      workers=[address], allow_other_workers=False)
                   for address, args in zip(self.ranks, args_of_rank, strict=True)]
        return self.client.gather(futures)


def _drain(dask_worker=None) -> dict:
    from rollplex.pipeline.run.worker import current_host

    return current_host().drain()
