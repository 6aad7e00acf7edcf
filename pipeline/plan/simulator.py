"""Simulate iterations: compile the GRPO DAG for a workload, plan it under each policy, plan its
memory, and report the makespan with a breakdown that sums to it, per-GPU timelines, the memory
timeline, and a Chrome trace in the format real runs write (pid per GPU, tid per lane, cat = kind).

``simulate(plan, costs)`` replays a plan (same placement, same lane orders) with other costs, e.g.
calibrated ones, which is how a prediction is compared with a measured trace node by node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rollplex.errors import MemoryPlanError
from rollplex.pipeline.plan import footprint
from rollplex.pipeline.plan import memory
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims
from rollplex.pipeline.compile.spec import IterationSpec
from rollplex.pipeline.plan.build import build_iteration
from rollplex.pipeline.plan.costs import Calibration, CostModel, Efficiency, Workload
from rollplex.pipeline.plan.hardware import Cluster, Layout
from rollplex.pipeline.compile.authoring import Algorithm
from rollplex.pipeline.compile.ir import IterationGraph
from rollplex.engines.modelspec import VLMSpec
from rollplex.pipeline.plan.schedule import Plan, plan, retime
from rollplex.pipeline.plan.trace import chrome_trace

GiB = 1024**3
ENGINES = EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"})
# name → (policy, prefix sharing). serial+prefix separates the prefix-sharing gain from overlap;
# disaggregated+prefix is the bench's disaggregated policy (split roles, prefix sharing on).
VARIANTS = {"serial": ("serial", False), "serial+prefix": ("serial", True),
            "disaggregated": ("disaggregated", False), "disaggregated+prefix": ("disaggregated", True),
            "rollplex": ("rollplex", True)}
PHASE_OF = {"vit_encode": "rollout", "decode_chunk": "rollout", "prefix": "prefix", "suffix_score": "scoring",
            "loss": "training", "optimizer_step": "training", "weight_sync": "sync", "offload": "memory",
            "prefetch": "memory"}
PHASE_ORDER = ("rollout", "training", "scoring", "prefix", "sync", "memory", "other")


@dataclass(frozen=True)
class Scenario:
    model: VLMSpec
    cluster: Cluster
    workload: Workload
    algorithm: Algorithm  # what the iteration runs: the costs model its kinds, not its formulas
    rollout_gpus: int | None = None  # disaggregated split; None: the best of the valid splits
    calibration: Calibration | None = None
    efficiency: Efficiency | None = None
    memory: bool = True
    budget: float | None = None  # bytes per GPU; None: the cluster's
    stage_fusion: bool = True  # rollplex hands finished groups on before the last decode chunk
    train_fusion: bool = False  # and trains on them then (the loss's normaliser deferred to the step)
    window_chunks: int = 0  # frozen scoring of chunks from this one on in one node after decode (0: per chunk)
    grad_prefix_lookahead: int = 0  # rollplex: the policy's prefix of micro-batch m waits for the loss of m - N


@dataclass
class Result:
    name: str
    policy: str
    layout: Layout
    costs: CostModel
    plan: Plan  # final (with offload/prefetch when memory planning succeeded)
    memory: memory.MemoryPlan | None = None
    error: str | None = None
    naive_terms: list[tuple[str, float]] = field(default_factory=list)
    naive_peak: float = 0.0

    @property
    def makespan(self) -> float:
        return self.plan.makespan

    @property
    def fits(self) -> bool:
        return self.error is None

    def phases(self) -> dict[str, float]:
        return exposed_phases(self.plan)


def spec_for(scn: Scenario, layout: Layout, prefix_sharing: bool, rollplex: bool = False) -> IterationSpec:
    """The ``IterationSpec`` of one simulated variant: the workload's batch with the layout's
    data-parallel micro-batches. Under rollplex it fuses stages as the runtime compiles them: the
    reference scores each decode chunk's finished samples (or, with train fusion, ``train_c``
    trains its finished groups); the cost model prices each such node from the sampled lengths
    (``costs.CostModel._handed_on``)."""
    w = scn.workload
    fused = scn.stage_fusion and prefix_sharing
    shape = BatchShape(prompts=w.prompts, samples=w.samples, max_new_tokens=w.max_new_tokens,
                       chunk_tokens=w.chunk_tokens, micro_batch_groups=w.micro_batch_groups or layout.train_dp,
                       prompt_tokens=w.prefix_tokens, vision_tokens=w.vision_total, prefix_sharing=prefix_sharing,
                       prompts_per_node=w.prompts_per_node, grad_prefix_lookahead=scn.grad_prefix_lookahead,
                       stage_fusion=fused, train_fusion=fused and scn.train_fusion, window_chunks=scn.window_chunks)
    return IterationSpec(shape, ENGINES, "rollplex" if rollplex else "serial")


def compile_for(scn: Scenario, layout: Layout, prefix_sharing: bool, rollplex: bool = False) -> IterationGraph:
    """The variant's iteration, expanded as a run builds it (``plan.build``); the simulator then
    places it on the cluster itself (``schedule.plan``)."""
    dims = ModelDims.of(scn.model, 2, scn.workload.checkpointing)  # the byte model the footprint reads too
    built = build_iteration(scn.algorithm, spec_for(scn, layout, prefix_sharing, rollplex), dims, until="distribute")
    return built.compiled


def layout_for(scn: Scenario, policy: str, rollout_gpus: int | None = None) -> Layout:
    w, c = scn.workload, scn.cluster
    if policy != "disaggregated":
        return Layout.colocate(c, w.tp_rollout, w.tp_train)
    return Layout.split(c, rollout_gpus or scn.rollout_gpus or c.gpus // 2, w.tp_rollout, w.tp_train)


def split_candidates(scn: Scenario) -> list[int]:
    c, w = scn.cluster, scn.workload
    step = math.lcm(w.tp_rollout, w.tp_train)
    out = []
    for r in range(step, c.gpus, step):
        try:
            Layout.split(c, r, w.tp_rollout, w.tp_train)
            out.append(r)
        except Exception:  # noqa: BLE001 - an invalid split is simply not a candidate
            continue
    return out


def run_variant(scn: Scenario, name: str, rollout_gpus: int | None = None) -> Result:
    policy, sharing = VARIANTS[name]
    layout = layout_for(scn, policy, rollout_gpus)
    rollplex = policy == "rollplex"
    cm = CostModel(scn.model, scn.cluster, scn.workload, layout, efficiency=scn.efficiency,
                   calibration=scn.calibration, weight_sharing=rollplex, prefix_sharing=sharing,
                   recompute_prefix=not rollplex)
    graph = footprint.annotate(compile_for(scn, layout, sharing, rollplex), cm)
    # The compiler chains the forwards a backward walks (bit-determinism on one worker). Across data-
    # parallel ranks that order only matters per rank, so it must not serialize the whole cluster.
    for u, v, data in list(graph.g.edges(data=True)):
        if data["reason"] == "accumulation order" and {graph.nodes[u].kind, graph.nodes[v].kind} <= {"prefix",
                                                                                                      "suffix_score"}:
            graph.remove_edge(u, v)
    if rollplex and scn.workload.ref_cache_hit > 0:
        h = scn.workload.ref_cache_hit
        graph = footprint.copy_with_cache_hits(graph, cm, lambda p: (p * 0.6180339887) % 1.0 < h)
    first = plan(graph, scn.cluster, cm, policy, layout)
    rs = footprint.residents(first.graph, cm)
    measured = memory.plan_memory(first, rs, scn.budget, enabled=False)
    g = max(measured.naive_peak, key=lambda k: (measured.naive_peak[k], -k))
    steps = measured.timeline(g)
    at = max(steps, key=lambda s: s[1])[0] if steps else 0.0
    terms = footprint.breakdown(measured.live_at(g, at), first.graph, rs)
    result = Result(name, policy, layout, cm, first, None, None, terms, measured.naive_peak[g])
    if not scn.memory:
        return result
    try:
        result.memory = memory.plan_memory(first, rs, scn.budget)
        result.plan = result.memory.plan
    except MemoryPlanError as exc:
        result.error = str(exc)
    return result


def run(scn: Scenario, names=tuple(VARIANTS)) -> dict[str, Result]:
    out = {}
    for name in names:
        if VARIANTS[name][0] == "disaggregated" and scn.rollout_gpus is None:
            tried = [run_variant(scn, name, r) for r in split_candidates(scn)]
            if not tried:
                continue
            out[name] = min(tried, key=lambda r: (not r.fits, r.makespan))
        else:
            out[name] = run_variant(scn, name)
    return out


def simulate(p: Plan, costs=None) -> Plan:
    """Replay ``p`` (placement and lane orders fixed) with ``costs`` (default: its own)."""
    return retime(p, costs=costs)


def exposed_phases(p: Plan) -> dict[str, float]:
    """Split the makespan by what GPUs were doing: each instant goes to the first phase of
    PHASE_ORDER running on any GPU's decode or compute lane (copies when nothing else runs), else
    to 'host/idle'. Work hidden under decode (rollplex's prefix) therefore counts 0 here."""
    ev = []
    for s in p.slots.values():
        if s.finish > s.start:
            phase = PHASE_OF.get(s.kind, "other")
            ev += [(s.start, 1, phase), (s.finish, -1, phase)]
    ev.sort(key=lambda e: (e[0], e[1]))
    count = {ph: 0 for ph in PHASE_ORDER}
    out = {ph: 0.0 for ph in PHASE_ORDER + ("host/idle",)}
    last = 0.0
    end = p.makespan
    for t, d, ph in ev:
        t = min(t, end)
        if t > last:
            now = next((q for q in PHASE_ORDER if count[q] > 0), "host/idle")
            out[now] += t - last
            last = t
        count[ph] += d
    out["host/idle"] += max(0.0, end - last)
    return {k: v for k, v in out.items() if v > 1e-9}


def chrome_trace_of(p: Plan, mem: memory.MemoryPlan | None = None) -> dict:
    """The plan as the runtime's trace: one event per node and GPU, plus an HBM counter per GPU."""
    width = len(str(max(p.cluster.gpus - 1, 0)))
    events = []
    for s in p.slots.values():
        node = p.graph.nodes[s.node]
        for g in s.gpus:
            events.append({"name": s.node, "cat": s.kind, "ph": "X", "ts": s.start * 1e6,
                           "dur": (s.finish - s.start) * 1e6, "pid": f"gpu{g:0{width}d}", "tid": s.lane,
                           "args": {"model": node.model, "engine": node.engine, "gpus": list(s.gpus)}})
    trace = chrome_trace(events, iteration=0, policy=p.policy)
    if mem is not None and events:
        pids = {w: i for i, w in enumerate(trace["otherData"]["workers"])}
        for g in range(p.cluster.gpus):
            pid = pids.get(f"gpu{g:0{width}d}")
            for t, used in (mem.timeline(g) if pid is not None else []):
                trace["traceEvents"].append({"name": "HBM GiB", "ph": "C", "ts": round(t * 1e6, 1), "pid": pid,
                                             "args": {"GiB": round(used / GiB, 3)}})
    trace["otherData"]["makespan_s"] = p.makespan
    return trace


def summary(results: dict[str, Result]) -> dict:
    """Plain data for --json."""
    out = {}
    for name, r in results.items():
        out[name] = {
            "policy": r.policy, "makespan_s": r.makespan, "fits": r.fits, "error": r.error,
            "layout": {"rollout_gpus": list(r.layout.rollout), "train_gpus": list(r.layout.train),
                       "tp_rollout": r.layout.tp_rollout, "tp_train": r.layout.tp_train},
            "exposed_s": r.phases(), "node_seconds_by_kind": r.plan.seconds_by_kind(),
            "naive_peak_gib": r.naive_peak / GiB,
            "naive_terms_gib": {k: v / GiB for k, v in r.naive_terms},
            "planned_peak_gib": (max(r.memory.peak.values()) / GiB) if r.memory else None,
            "memory_actions": ([{"tensor": a.tensor, "kind": a.kind, "gib_per_gpu": a.nbytes / GiB,
                                 "idle_from_s": a.gap.a, "idle_to_s": a.gap.b} for a in r.memory.actions]
                               if r.memory else []),
            "decode": {"replicas": r.costs.profile.replicas, "kv_pool_sequences": r.costs.profile.cap,
                       "chunk_seconds": r.costs.profile.chunk_seconds, "chunk_batch": r.costs.profile.chunk_batch},
            "nodes": len(r.plan.graph),
        }
    return out


def write_png(results: dict[str, Result], path: str, gpus_shown: int = 8) -> None:
    """Gantt (first GPUs, decode/compute/copy lanes) and HBM over time, one row per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollplex.pipeline.compile.svg import kind_colour

    rows = list(results.values())
    fig, axes = plt.subplots(len(rows), 2, figsize=(16, 2.6 * len(rows) + 0.6), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    horizon = max(r.makespan for r in rows) or 1.0
    for (gantt, mem_ax), r in zip(axes, rows):
        lay = r.layout
        half = gpus_shown // 2
        gpus = sorted(set(lay.rollout[:half]) | set(lay.train[:gpus_shown - half])) if not lay.colocated \
            else list(range(min(gpus_shown, r.plan.cluster.gpus)))
        lanes = [(g, lane) for g in gpus for lane in ("decode", "compute", "copy")]
        y = {key: i for i, key in enumerate(lanes)}
        for s in r.plan.slots.values():
            for g in s.gpus:
                if (g, s.lane) in y and s.finish > s.start:
                    gantt.broken_barh([(s.start, s.finish - s.start)], (y[(g, s.lane)] - 0.4, 0.8),
                                      facecolors=kind_colour(s.kind), edgecolors="none")
        gantt.set_yticks(range(len(lanes)), [f"gpu{g} {lane}" for g, lane in lanes], fontsize=6)
        gantt.invert_yaxis()
        gantt.set_xlim(0, horizon)
        status = "" if r.fits else "  — does NOT fit in memory"
        gantt.set_title(f"{r.name}: {r.makespan:.2f} s on {r.plan.cluster.gpus} GPUs "
                        f"(GPUs {', '.join(map(str, gpus))} shown){status}", fontsize=9, loc="left")
        budget = (r.memory.budget if r.memory else r.plan.cluster.hbm_budget) / GiB
        if r.memory:
            for g in gpus:
                steps = [st for st in r.memory.timeline(g) if st[0] < r.makespan - 1e-9]  # periodic: stop at T
                if steps:
                    ts, bs = zip(*steps)
                    mem_ax.step(ts, [b / GiB for b in bs], where="post", linewidth=0.8)
        mem_ax.axhline(budget, color="red", linestyle="--", linewidth=0.8, label="budget")
        mem_ax.set_ylim(0, max(budget, r.naive_peak / GiB) * 1.08)
        mem_ax.axhline(r.naive_peak / GiB, color="grey", linestyle=":", linewidth=0.8, label="naive peak")
        mem_ax.set_xlim(0, horizon)
        mem_ax.set_title("HBM per GPU (GiB)", fontsize=8)
        mem_ax.legend(fontsize=6, loc="lower right")
    kinds = sorted({s.kind for r in rows for s in r.plan.slots.values()})
    handles = [plt.Rectangle((0, 0), 1, 1, color=kind_colour(k)) for k in kinds]
    fig.legend(handles, kinds, loc="lower center", ncol=min(len(kinds), 8), fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def with_budget(scn: Scenario, gib: float | None) -> Scenario:
    return scn if gib is None else replace(scn, budget=gib * GiB)
