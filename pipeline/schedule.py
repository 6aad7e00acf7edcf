"""Schedule policies: pure functions from a compiled iteration to a placed, ordered one.

- ``serial``: today's runtimes. Phase barriers: rollout (vision + decode) → scoring (prefix and
  suffix of every model, rewards, advantages) → training (loss, backward, optimizer) → sync. No
  prefix work can run while decode runs.
- ``rollplex``: no barriers. The prefix and vision work of every model depend only on the prompt,
  so with decode on its own stream they run inside the decode window. Priorities follow the
  critical path, so decode and what feeds it are never starved.

Both return a copy of the graph whose nodes carry ``meta["stream"]`` and ``meta["priority"]``
(higher runs first on its stream) and, for serial, ordering edges with reason "barrier". The update
is the same under both: barriers only order work, they never change what a node computes.
"""
from __future__ import annotations

import copy

import networkx as nx

from rollplex.errors import GraphError
from rollplex.pipeline.ir import IterationGraph

POLICIES = ("serial", "rollplex")

SERIAL_PHASES = (
    ("vit_encode", "decode_chunk"),
    ("prefix", "suffix_score", "reward", "custom", "advantage"),
    ("loss", "optimizer_step"),
    ("weight_sync", "report"),
)

# Rough relative costs for priorities only; the cost model in the simulator replaces these.
_UNIT_COST = {"decode_chunk": 8.0, "prefix": 2.0, "suffix_score": 2.0, "loss": 3.0, "vit_encode": 1.0,
              "optimizer_step": 2.0, "weight_sync": 1.0}


def copy_graph(graph: IterationGraph) -> IterationGraph:
    new = IterationGraph(graph.name)
    new.g = graph.g.copy()
    new.values = dict(graph.values)
    new.meta = dict(graph.meta)
    new.nodes = {name: copy.copy(node) for name, node in graph.nodes.items()}
    for node in new.nodes.values():
        object.__setattr__(node, "meta", dict(node.meta))
    return new


def critical_path_priority(graph: IterationGraph) -> dict[str, float]:
    """Length of the costliest path from each node to a sink, including the node itself."""
    remaining: dict[str, float] = {}
    for name in reversed(graph.topological_order()):
        cost = _UNIT_COST.get(graph.nodes[name].kind, 0.1)
        remaining[name] = cost + max((remaining[s] for s in graph.g.successors(name)), default=0.0)
    return remaining


def _serial_barriers(graph: IterationGraph) -> None:
    phase_of = {}
    for i, kinds in enumerate(SERIAL_PHASES):
        for kind in kinds:
            phase_of[kind] = i
    by_phase: dict[int, list[str]] = {}
    for node in graph:
        # Kinds outside SERIAL_PHASES (offload, prefetch, plugins) sit between phases wherever their
        # data puts them; a barrier on them (e.g. a prefetch feeding a suffix_score) would be a cycle.
        if node.kind in phase_of:
            by_phase.setdefault(phase_of[node.kind], []).append(node.name)
    phases = [by_phase[k] for k in sorted(by_phase)]
    for before, after in zip(phases, phases[1:]):
        # Only the last nodes of a phase need an edge: everything else precedes them already.
        members = set(before)
        sinks = [n for n in before if not any(s in members for s in graph.g.successors(n))]
        heads = [n for n in after if not any(p in set(after) for p in graph.g.predecessors(n))]
        for s in sinks:
            for h in heads:
                graph.add_order(s, h, reason="barrier")


def schedule(graph: IterationGraph, policy: str) -> IterationGraph:
    if policy not in POLICIES:
        raise GraphError(f"unknown schedule policy {policy!r}; choose one of {', '.join(POLICIES)}")
    planned = copy_graph(graph)
    if policy == "serial":
        _serial_barriers(planned)
    if not nx.is_directed_acyclic_graph(planned.g):
        planned.lint()  # names the cycle
    priority = critical_path_priority(planned)
    for name, node in planned.nodes.items():
        node.meta.setdefault("stream", node.kind_info.stream)
        node.meta["priority"] = round(priority[name], 3)
    planned.meta["policy"] = policy
    return planned
