"""Run a scheduled iteration in this process, on one ``WorkerHost``'s stream threads.

The same node semantics as the Dask path (``pipeline/run/executor.py``): a node starts once every
predecessor (value or ordering edge) has finished, each stream runs one node at a time and picks its
ready node of highest priority, each value is dropped after its last consumer, and every node leaves a
trace event. What it leaves out is the scheduler between nodes, so it serves benchmarks that compare
policies side by side in one process (``rollplex bench``) and single-device jobs where the few
milliseconds per Dask hop would matter.

Given several hosts (one per GPU), a node runs on ``hosts[node.meta["rank"]]``: the data-parallel
iteration of ``pipeline/compile/ranks.py`` in one process, each rank's streams its own threads.
"""
from __future__ import annotations

import heapq
import queue
import time
from typing import Any

from rollplex.pipeline.compile.ir import IterationGraph
from rollplex.pipeline.run.tables import run_tables
from rollplex.pipeline.run.execution import execute_node
from rollplex.pipeline.run.worker import IterationResult, WorkerHost


class LocalExecutor:
    def __init__(self, host: WorkerHost | list[WorkerHost]) -> None:
        self.hosts = list(host) if isinstance(host, (list, tuple)) else [host]
        self.host = self.hosts[0]

    def run(self, graph: IterationGraph, iteration: int, inputs: dict[str, Any]) -> IterationResult:
        tables = run_tables(graph)  # built once per graph; an iteration copies the counters it counts down
        order, successors, sinks = tables.position, tables.successors, tables.sinks
        waiting = dict(tables.in_degree)
        uses = dict(tables.uses)
        records = graph.values
        values: dict[str, Any] = dict(inputs)
        ready: dict[tuple[int, str], list] = {}
        busy: set[tuple[int, str]] = set()
        done_queue: queue.Queue = queue.Queue()
        start = time.time()

        def lane(node) -> tuple[int, str]:  # (rank, stream): one node at a time on each
            return int(node.meta.get("rank", 0)), node.stream

        def push(name: str) -> None:
            node = graph.nodes[name]
            heapq.heappush(ready.setdefault(lane(node), []), (-float(node.meta.get("priority", 0.0)),
                                                              order[name], name))

        def dispatch() -> None:
            for (rank, stream), heap in ready.items():
                if (rank, stream) in busy or not heap:
                    continue
                _, _, name = heapq.heappop(heap)
                node = graph.nodes[name]
                node_inputs = {v: values[v] for v in node.inputs}
                busy.add((rank, stream))
                host = self.hosts[rank]
                future = host.submit(stream, execute_node, host, node, iteration, node_inputs, records)
                future.add_done_callback(lambda f, name=name: done_queue.put((name, f)))

        for name in tables.order:
            if waiting[name] == 0:
                push(name)
        dispatch()
        finished = 0
        output = None
        while finished < len(graph.nodes):
            name, future = done_queue.get()
            node = graph.nodes[name]
            busy.discard(lane(node))
            if future.exception() is not None:
                # Let the nodes still running on other streams end before raising: one left behind
                # would go on writing (gradients, decode rows) into whatever runs next.
                for _ in range(len(busy)):
                    done_queue.get()
                future.result()  # re-raises the node's failure, naming it
            outputs = future.result()
            finished += 1
            values.update(outputs)
            for v in node.inputs:  # a value's lifetime ends with its last consumer
                uses[v] -= 1
                if uses[v] == 0:
                    values.pop(v, None)
            for succ in successors[name]:
                waiting[succ] -= 1
                if waiting[succ] == 0:
                    push(succ)
            if name in sinks:
                output = outputs
            dispatch()
        seconds = time.time() - start
        drained = [host.drain() for host in self.hosts]
        return IterationResult(output, [e for d in drained for e in d["events"]],
                               max(d["peak_memory_bytes"] for d in drained), seconds, started=start,
                               alloc_retries=sum(d["alloc_retries"] for d in drained))
