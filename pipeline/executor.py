"""Lower a scheduled iteration to Dask tasks and run it on a Dask distributed cluster.

Lowering is the last step and is explicit: one ``dask._task_spec.Task`` per node, whose arguments
are ``TaskRef``s to the producers of its inputs (and, after them, to ordering-only predecessors such
as serial barriers). Each task carries a resource annotation for its stream (``{"decode": 1}`` or
``{"compute": 1}``): workers declare one unit of each and run one thread per stream, so Dask never
runs two tasks on one stream. The whole iteration is submitted as one graph, so Dask's optimiser
cannot drop the annotations, and only the report's future is held by the client.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import dask
from dask._task_spec import DataNode, Task, TaskRef

from rollplex.pipeline.ir import IterationGraph
from rollplex.pipeline.worker import IterationResult, provide_input, run_node


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


def lower(graph: IterationGraph, iteration: int, inputs: dict[str, Any]) -> LoweredIteration:
    missing = [v for v in graph.inputs if v not in inputs]
    if missing:
        raise KeyError(f"iteration inputs missing: {missing}")
    dsk: dict[str, Task] = {}
    resources: dict[str, dict[str, int]] = {}
    priority: dict[str, float] = {}
    workers: dict[str, list[str]] = {}
    uses = {v: len(graph.consumers(v)) for v in graph.values}
    for name in graph.inputs:
        key = task_key(iteration, f"in/{name}")
        dsk[key] = Task(key, provide_input, DataNode(None, inputs[name]), name)
        resources[key] = {"host": 1}
        priority[key] = 1e6
    for node_name in graph.topological_order():
        node = graph.nodes[node_name]
        producers: list[str] = []
        for value in node.inputs:
            producer = graph.values[value].producer
            ref = task_key(iteration, producer if producer is not None else f"in/{value}")
            if ref not in producers:
                producers.append(ref)
        ordering = [task_key(iteration, p) for p in graph.g.predecessors(node_name)
                    if task_key(iteration, p) not in producers]
        key = task_key(iteration, node_name)
        refs = [TaskRef(k) for k in producers + ordering]
        dsk[key] = Task(key, run_node, node, iteration, {v: uses[v] for v in node.inputs}, len(producers), *refs)
        resources[key] = {node.stream: 1}
        priority[key] = float(node.meta.get("priority", 0.0))
        if "worker" in node.meta:
            workers[key] = [node.meta["worker"]]
    sinks = [n for n in graph.nodes if graph.g.out_degree(n) == 0]
    if len(sinks) != 1:
        raise ValueError(f"an iteration graph needs exactly one sink (the report); found {sinks}")
    return LoweredIteration(dsk, resources, priority, workers, task_key(iteration, sinks[0]))


class DaskExecutor:
    """Runs lowered iterations on a ``distributed.Client`` whose workers host Rollplex engines."""

    def __init__(self, client) -> None:
        self.client = client

    def run(self, graph: IterationGraph, iteration: int, inputs: dict[str, Any]) -> IterationResult:
        from rollplex.pipeline.worker import current_host  # noqa: F401 - fail early if misinstalled

        lowered = lower(graph, iteration, inputs)
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
        return IterationResult(output, events, peak, seconds)

    def call(self, fn, *args, stream: str = "compute") -> Any:
        """Run ``fn(host, *args)`` on a worker's engines, on one of its streams."""
        from rollplex.pipeline.worker import call_on_host

        future = self.client.submit(call_on_host, fn, *args, stream=stream, resources={stream: 1}, pure=False)
        return future.result()


def _drain(dask_worker=None) -> dict:
    from rollplex.pipeline.worker import current_host

    return current_host().drain()
