"""The memory plan, executed: a run's graph gets the planner's offload/prefetch nodes.

``rollplex simulate`` plans residency for clusters that are not there; this module does it for the
device a run is on. It sizes every tensor from the run's own model config (``modelspec.from_config``)
and batch shape, times the iteration with the cost model, and lets ``memory.plan_memory`` choose what
leaves the device between uses so that the device fits ``budget``. Only what the run's engines can
really move is offered to the planner (each engine class declares ``movable_parts``); the rest stays
resident and counts against the budget, so a plan that fits here fits the run. The result is the same
graph plus ``offload``/``prefetch`` nodes (tasks/residency.py runs them), ordered by residency edges.

Response lengths are taken at their cap (``max_new_tokens``): the plan must fit the longest rollout.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from rollplex.errors import ConfigError
from rollplex.pipeline.plan import footprint
from rollplex.pipeline.plan import memory
from rollplex.pipeline.compile.compiler import BatchShape
from rollplex.pipeline.plan.costs import CostModel, Workload
from rollplex.pipeline.plan.hardware import Layout, hardware
from rollplex.pipeline.compile.ir import IterationGraph
from rollplex.engines.modelspec import from_config
from rollplex.pipeline.plan.schedule import plan

GiB = 1024**3


@dataclass(frozen=True)
class ResidencyPlan:
    graph: IterationGraph  # the input graph plus offload/prefetch nodes, not yet scheduled
    memory: memory.MemoryPlan

    @property
    def moves(self) -> list[str]:
        return [n.name for n in self.graph if n.kind in ("offload", "prefetch")]

    def describe(self) -> str:
        mp = self.memory
        moved = sorted({a.tensor for a in mp.actions if a.kind == "offload"})
        return (f"memory plan: peak {memory.size(max(mp.naive_peak.values()))} → {memory.size(max(mp.peak.values()))} "
                f"(budget {memory.size(mp.budget)}); offloaded between uses: {', '.join(moved) or 'nothing'}")


def movable_parts(engine_name: str, role: str) -> tuple[str, ...]:
    from rollplex.engines.base import get_engine

    return tuple(getattr(get_engine(engine_name, role).factory, "movable_parts", ()))


def plan_residency(graph: IterationGraph, policy: str, *, model_path: str, shape: BatchShape, budget_bytes: float,
                   train_engine: str, score_engine: str, zero_stage: int, device: str = "cpu",
                   weight_sharing: bool = True) -> ResidencyPlan:
    """``graph`` (compiled, not scheduled) with the offload/prefetch nodes that make one device of
    ``budget_bytes`` hold the iteration; ``MemoryPlanError`` names the tensors when nothing can."""
    if budget_bytes <= 0:
        raise ConfigError(f"cluster.memory_budget_gib must be > 0 to plan memory, got {budget_bytes / GiB:g}")
    spec = from_config(model_path)
    # One device with the H200's measured rates (the lent GPU; on CPU the rates only decide which idle
    # gaps are long enough to hide a copy) and the budget as its memory.
    cluster = replace(hardware("h200", 1), name=device, hbm_bytes=int(budget_bytes), reserve_bytes=0)
    w = Workload(prompts=shape.prompts, samples=shape.samples, vision_tokens=max(1, shape.vision_tokens),
                 text_tokens=max(1, shape.prompt_tokens - shape.vision_tokens), max_new_tokens=shape.max_new_tokens,
                 response=f"fixed:{shape.max_new_tokens}", chunk_tokens=shape.chunk_tokens,
                 zero=min(zero_stage, 3) if train_engine == "deepspeed" else 0,
                 micro_batch_groups=shape.micro_batch_groups, prompts_per_node=shape.prompts_per_node,
                 checkpointing=False, actor_forward="keep")
    layout = Layout.colocate(cluster)
    # weight_sharing=False: the decode engine's own copy of the policy is resident too.
    cm = CostModel(spec, cluster, w, layout, weight_sharing=weight_sharing, prefix_sharing=shape.prefix_sharing)
    first = plan(footprint.annotate(graph, cm), cluster, cm, policy, layout)
    trained = first.graph.meta.get("rollout_model", "actor")
    train_parts, score_parts = movable_parts(train_engine, "train"), movable_parts(score_engine, "score")
    residents = []
    for r in footprint.residents(first.graph, cm):
        ok = (r.model == trained and r.part in train_parts) or (
            r.frozen and r.model not in (trained, "vision", "rollout") and r.part in score_parts)
        residents.append(replace(r, movable=ok))
    mp = memory.plan_memory(first, residents, budget_bytes)
    planned = _strip_plan_meta(mp.plan.graph)
    # An offload after a tensor's last use is a new sink; the iteration ends when it is done (the
    # next iteration's prefetch must find the state where it left it), so the report waits for it.
    ends = [n for n in graph.nodes if graph.g.out_degree(n) == 0]
    for name in [n for n in planned.nodes if planned.g.out_degree(n) == 0 and n not in ends]:
        for end in ends:
            planned.add_order(name, end, reason="residency")
    return ResidencyPlan(planned, mp)


def _strip_plan_meta(graph: IterationGraph) -> IterationGraph:
    """The runtime schedules the graph itself (``schedule``): drop the simulated placement so the
    run's own streams and priorities decide (copies run on the compute stream: a worker has no copy
    stream yet), but keep the residency notes for ``rollplex graph``."""
    for node in graph:
        for key in ("gpus", "lane", "placement", "at", "start", "finish", "priority", "stream"):
            node.meta.pop(key, None)
    return graph

