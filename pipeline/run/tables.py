"""What the executors look up while they run an iteration, computed once per graph.

An iteration graph is scheduled once and run for many iterations, so the executors' per-graph facts
(topological order, in-degrees, successors, each value's readers, the sink; for the Dask lowering
each node's producers, ordering predecessors and value records) are built once, in time linear in
nodes + edges, and cached on the graph (``IterationGraph.memo``: a change to the graph rebuilds
them). Each iteration then only copies the counters it counts down. Node ``meta`` is not versioned,
so the tables hold structure only, plus ``meta["rank"]``, which ``ranks.distribute`` sets as it makes a
node and nothing changes after.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rollplex.pipeline.compile.ir import IterationGraph, Value


@dataclass(frozen=True)
class RunTables:
    order: tuple[str, ...]  # topological order
    position: Mapping[str, int]  # node -> its place in ``order`` (the ready queue's tie-break)
    in_degree: Mapping[str, int]  # node -> its predecessors (value and ordering edges)
    successors: Mapping[str, tuple[str, ...]]
    uses: Mapping[str, int]  # value -> the nodes that read it
    sinks: frozenset[str]


def run_tables(graph: IterationGraph) -> RunTables:
    return graph.memo("run.tables", _run_tables)


def _run_tables(graph: IterationGraph) -> RunTables:
    order = tuple(graph.topological_order())
    succ, pred = graph.g.succ, graph.g.pred
    return RunTables(
        order=order,
        position={name: i for i, name in enumerate(order)},
        in_degree={name: len(pred[name]) for name in order},
        successors={name: tuple(succ[name]) for name in order},
        uses={v: graph.uses(v) for v in graph.values},
        sinks=frozenset(name for name in order if not succ[name]),
    )


@dataclass(frozen=True)
class LoweringTables:
    """Per node of the Dask lowering: the producers of its inputs (node names, or None for a graph
    input, with the input's name), its ordering-only predecessors, its rank, how often its worker
    counts each input's use (``worker.WorkerHost.release``) and its value records."""

    run: RunTables
    producers: Mapping[str, tuple[tuple[str | None, str], ...]]  # node -> (producer, value), one per producer
    ordering: Mapping[str, tuple[str, ...]]
    rank: Mapping[str, int]  # 0 everywhere unless ranked
    uses: Mapping[str, Mapping[str, int]]  # node -> input -> readers on its worker (0: not counted)
    records: Mapping[str, Mapping[str, Value]]  # node -> its inputs' and outputs' records
    readers_rank: Mapping[str, int | None]  # graph input -> the rank of its first reader


def lowering_tables(graph: IterationGraph, ranked: bool) -> LoweringTables:
    """``ranked``: the graph runs on one worker per data-parallel rank (``ranks.distribute``)."""
    return graph.memo(f"run.lowering.{'ranked' if ranked else 'one'}", lambda g: _lowering_tables(g, ranked))


def _lowering_tables(graph: IterationGraph, ranked: bool) -> LoweringTables:
    run = run_tables(graph)
    values = graph.values
    rank = {name: int(node.meta.get("rank", 0)) if ranked else 0 for name, node in graph.nodes.items()}
    if ranked:
        from rollplex.pipeline.compile.ranks import rank_uses

        counted = rank_uses(graph)
    producers, ordering, uses, records = {}, {}, {}, {}
    for name in run.order:
        node = graph.nodes[name]
        seen: dict[str, tuple[str | None, str]] = {}
        for v in node.inputs:
            producer = values[v].producer
            seen.setdefault(producer if producer is not None else f"in/{v}", (producer, v))
        producers[name] = tuple(seen.values())
        ordering[name] = tuple(p for p in graph.g.pred[name] if p not in seen)
        uses[name] = {v: counted.get((v, rank[name]), 0) if ranked else run.uses[v] for v in node.inputs}
        records[name] = {v: values[v] for v in (*node.inputs, *node.outputs)}
    readers_rank = {}
    for name in graph.inputs:
        readers = graph.consumers(name)
        readers_rank[name] = rank[readers[0]] if readers else None
    return LoweringTables(run, producers, ordering, rank, uses, records, readers_rank)
