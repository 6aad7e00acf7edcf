"""``build_iteration``: an ``IterationSpec`` to the graph a run executes, through passes in order.

    expand ──▶ distribute ──▶ plan memory (when asked) ──▶ schedule

- expand (pipeline/compile/compiler.py): the algorithm for P prompts × G samples, in fine-grained
  nodes; stage fusion (and train fusion where the algorithm allows it) is part of the expansion,
  under the rollplex policy only.
- distribute (pipeline/compile/ranks.py): the nodes over data-parallel ranks (a no-op on one).
- plan memory (pipeline/plan/residency.py, via the caller's function): offload and prefetch nodes
  so one device fits its budget.
- schedule (pipeline/plan/schedule.py): streams, priorities and, for serial, phase barriers.

Each pass says what it requires of the graph and what it ensures, as in torch.fx's passes, and the
builder checks both, so a pass run out of order or one that breaks its promise fails naming itself.
``rollplex train``, ``rollplex bench``, the simulator and benchmarks/build_scale.py all build here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollplex.errors import GraphError
from rollplex.pipeline.compile.compiler import compile_iteration
from rollplex.pipeline.compile.ir import IterationGraph
from rollplex.pipeline.compile.ranks import distribute
from rollplex.pipeline.compile.spec import IterationSpec
from rollplex.pipeline.plan.schedule import schedule


@dataclass
class Built:
    spec: IterationSpec
    compiled: IterationGraph  # expanded and distributed: what the memory plan and the simulator read
    memory_plan: Any  # residency.ResidencyPlan, or None
    graph: IterationGraph  # scheduled: what the executor runs


def _ranked(graph: IterationGraph, spec: IterationSpec) -> bool:
    return spec.world == 1 or all("rank" in n.meta for n in graph)


def _scheduled(graph: IterationGraph, spec: IterationSpec) -> bool:
    return all("stream" in n.meta and "priority" in n.meta for n in graph)


CHECKS: dict[str, Callable[[IterationGraph, IterationSpec], bool]] = {
    "expanded": lambda g, s: len(g) > 0 and g.meta.get("shape") is not None,
    "distributed": _ranked,
    "memory planned": lambda g, s: True,  # the plan's own replay checks its budget (residency.py)
    "scheduled": _scheduled,
}


@dataclass(frozen=True)
class Pass:
    name: str
    requires: tuple[str, ...]
    ensures: tuple[str, ...]
    run: Callable[[IterationGraph | None, IterationSpec], IterationGraph]


def build_iteration(algorithm, spec: IterationSpec, dims, plan_memory: Callable | None = None,
                    until: str | None = None) -> Built:
    """Build ``spec`` for ``algorithm`` with the byte estimates of ``dims`` (compiler.ModelDims).
    ``plan_memory(graph, policy) -> plan`` adds the memory pass; ``until`` stops after the named
    pass (the simulator plans its own placement after ``distribute``)."""
    memory: dict[str, Any] = {"plan": None}

    def planned(graph, s):
        memory["plan"] = plan_memory(graph, s.policy)
        return memory["plan"].graph

    passes = [
        Pass("expand", (), ("expanded",), lambda g, s: compile_iteration(algorithm, s.compiled_shape, s.engines, dims)),
        Pass("distribute", ("expanded",), ("distributed",), lambda g, s: distribute(g, s.world, s.tp_rollout)),
        *([Pass("plan memory", ("distributed",), ("memory planned",), planned)] if plan_memory else []),
        Pass("schedule", ("distributed",), ("scheduled",), lambda g, s: schedule(g, s.policy)),
    ]
    if until is not None and until not in {p.name for p in passes}:
        raise GraphError(f"build_iteration: no pass {until!r}; passes: {', '.join(p.name for p in passes)}")
    graph, done, compiled = None, set(), None
    for p in passes:
        missing = [f for f in p.requires if f not in done]
        if missing:
            raise GraphError(f"build pass {p.name!r} requires {missing}, which no earlier pass ensured")
        graph = p.run(graph, spec)
        broken = [f for f in p.ensures if not CHECKS[f](graph, spec)]
        if broken:
            raise GraphError(f"build pass {p.name!r} did not ensure {broken}")
        done.update(p.ensures)
        if p.name == "distribute":
            compiled = graph
        if p.name == until:
            break
    return Built(spec, compiled if compiled is not None else graph, memory["plan"], graph)
