"""Running a node on the worker's installed host (``worker.current_host()``): the view of the worker
a task gets (``NodeContext``), the timed call of a node's task on its stream's thread
(``execute_node``), and the functions Dask runs: a node (``run_node``), a whole iteration
(``run_iteration``), a graph input (``provide_input``) and a host-level function (``call_on_host``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rollplex.errors import NodeFailure, RollplexError, UserCodeError
from rollplex.pipeline.compile.ir import Node, Value
from rollplex.pipeline.run.usercode import node_error
from rollplex.pipeline.run.worker import RELEASED, IterationResult, WorkerHost, current_host


class NodeContext:
    """The view of the worker a task gets for one node. ``values``: the records of (at least) the
    node's inputs and outputs by name, which say what each is (role, prompts, chunk, model)."""

    def __init__(self, host: WorkerHost, iteration: int, values: Mapping[str, Value]) -> None:
        self.host = host
        self.iteration = iteration
        self.values = values
        self.settings = host.spec.settings
        self.algorithm = host.algorithm
        self.reward_fn = host.reward_fn
        self.params = host.spec.settings.params
        self.decode_engine = host.decode
        self.model = host.model
        self.train_engine = host.train_engine
        self.refcache = host.refcache
        self.decode_text = host.decode_text

    # -- for the tasks of node kinds registered outside pipeline/ ---------------------------------
    def engine_for(self, node: Node):
        """The engine hosting the node's model (for a model declared with ``engine=``, that one)."""
        return self.host.engines[node.model]

    def arguments(self, node: Node, inputs: dict[str, Any]) -> dict[str, Any]:
        """The node function's parameters → their values (per="prompt": that group's; per="batch": a
        list over the groups), bound as the compiler wired them."""
        from rollplex.tasks.updates import bound_values

        values = bound_values(inputs, node.args["bind"])
        per_prompt = self._function(node).options["per"] == "prompt"
        return {k: v[0] for k, v in values.items()} if per_prompt else values

    def call(self, node: Node, inputs: dict[str, Any], **extra: Any) -> Any:
        """Call the algorithm function behind a node with its bound values, hyperparameters from the
        config, and ``extra`` keyword arguments the kind's task supplies (an engine, a model)."""
        return self._function(node).call(self.arguments(node, inputs), {**self.params, **extra})

    def _function(self, node: Node):
        return next(c for c in self.algorithm.custom if c.name == node.args["function"])


def execute_node(host: WorkerHost, node: Node, iteration: int, inputs: dict[str, Any],
                 values: Mapping[str, Value]) -> dict[str, Any]:
    """Run one node's task on the calling thread (its stream's thread), timed, errors naming the node.
    ``values``: the records of the node's values (``NodeContext.values``)."""
    from rollplex.tasks.registry import task_for

    if node.stream == "decode":
        host._decode_iteration = iteration
    elif node.kind in ("prefix", "suffix_score") and host.window.prefill_gate:  # vision feeds decode: never held
        host.wait_for_prefill(iteration)
    if node.kind == "prefix" and host.window.gate_rows:
        host.wait_for_light_decode()
    start, cpu = time.time(), time.thread_time()
    try:
        # Named after the kind so that a profile (rollplex bench --profile) sums device time per kind.
        keeps_graph = node.kind in ("vit_encode", "prefix", "suffix_score") and bool(node.args.get("grad"))
        with host.on_stream(node.stream, keeps_graph=keeps_graph) as sms, \
                torch.profiler.record_function(f"node:{node.kind}"):
            outputs = task_for(node.kind)(NodeContext(host, iteration, values), node, inputs)
    except UserCodeError as exc:
        raise node_error(node.name, node.kind, exc, host.user_files) from None
    except (RollplexError, NodeFailure):
        raise
    except Exception as exc:  # FloatingPointError from a non-finite loss or gradient included
        raise node_error(node.name, node.kind, exc, host.user_files) from exc
    end, cpu = time.time(), time.thread_time() - cpu
    waited = host.last_stream_wait()
    # host_cpu_s, this thread's CPU seconds: near the node's duration, it was host-bound; far below it
    # with little device_wait_s, the thread waited on the host (the GIL, a lock), not on the device.
    args = {"model": node.model, "engine": node.engine, "host_cpu_s": round(cpu, 6), **({"sms": sms} if sms else {}),
            **({"device_wait_s": round(waited, 6)} if waited is not None else {})}
    host.record({"name": node.name, "cat": node.kind, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                 "pid": host.name, "tid": node.stream, "args": args})
    return outputs


def run_node(node: Node | tuple[str, str], iteration: int, uses: dict[str, int], values: Mapping[str, Value] | None,
             n_values: int, *deps: Any) -> dict[str, Any]:
    """A Dask task: run one node, given as itself with its values' records, or as (installed graph's
    name, node name), read with its records from this worker's copy. ``deps[:n_values]`` are producer
    bundles; the rest only order it."""
    host = current_host()
    if isinstance(node, tuple):
        graph = host.spec.graphs[node[0]]
        node, values = graph.nodes[node[1]], graph.values
    inputs: dict[str, Any] = {}
    owners: dict[str, dict] = {}
    for bundle in deps[:n_values]:
        for name in node.inputs:
            if bundle.get(name, RELEASED) is not RELEASED and name not in inputs:
                inputs[name] = bundle[name]
                owners[name] = bundle
    missing = [v for v in node.inputs if v not in inputs]
    if missing:
        raise NodeFailure(node.name, node.kind, KeyError(f"inputs {missing} were released or never produced"))
    outputs = host.submit(node.stream, execute_node, host, node, iteration, inputs, values).result()
    inputs.clear()
    host.release(iteration, owners, uses)
    return outputs


def run_iteration(graph, iteration: int, inputs: dict[str, Any], prefetch: tuple = ()) -> IterationResult:
    """A Dask task: a whole iteration on this worker, its nodes run on the worker's streams by the
    local executor (``DaskExecutor`` with ``cluster.lowering`` iteration). ``graph``: an installed
    graph's name (or a graph); ``prefetch``: the next iteration's prompt indices, built meanwhile."""
    from rollplex.pipeline.run.local import LocalExecutor

    host = current_host()
    start = time.time()
    inputs = {name: host.prompt(value) for name, value in inputs.items()}
    if prefetch and host.prompts is not None:
        host.prompts.prefetch(prefetch)
    result = LocalExecutor(host).run(host.graph(graph), iteration, inputs)
    result.prepare_seconds = result.started - start
    return result


def provide_input(value: Any, name: str) -> dict[str, Any]:
    """A graph input entering the worker as a one-value bundle (a prompt built here from its ref)."""
    return {name: current_host().prompt(value)}


def call_on_host(fn: Callable[..., Any], *args: Any, stream: str = "compute") -> Any:
    """Run a host-level function (warm-up, checkpoint I/O) on this worker's engines, on a stream."""
    host = current_host()
    return host.run_on_stream(stream, fn, host, *args)
