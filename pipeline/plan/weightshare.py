"""Weight sharing between the trainer and a colocated rollout engine: a pure planner.

``plan_gang(layouts, trainer, rollout)`` decides, for every GPU of one gang (``max(t_train, t_roll)``
GPUs holding one copy of both layouts) and every actor tensor, how the rollout engine's shard on that
GPU comes to exist:

- ``alias``: a view (element offset, shape, stride) into the trainer's storage on the same GPU. Needs
  the rows (and columns) the rollout rank holds to be local, the same dtype, and, for a fused tensor,
  its parts laid out back to back in the trainer's buffer. That holds when the trainer allocates each
  fused group's shard as one buffer with its HF parameters as views into it (``allocation="fused"``;
  DeepSpeed ZeRO-1/2's flat buffer is one when parameters are handed to it in fusion order). A
  column-parallel rollout shard at t_roll ≥ t_train is then a contiguous row range of the training
  shard; a row-parallel one is a column range: a strided view, an alias only for engines that accept
  non-contiguous weights (``strided_ok``).
- ``inplace``: t_train > t_roll. The rollout shard is larger than the training shard, which lies
  inside it as contiguous row blocks; the trainer's parameters are allocated as views into the
  rollout buffer, so only the peers' rows are gathered into it (column-parallel tensors only: a
  row-parallel training shard would be a strided parameter).
- ``rebuild``: a copy made locally (slice, concat of fused parts, dtype cast) or gathered from TP
  peers. ZeRO-3 partitions every parameter over data-parallel ranks, so nothing can be shared.

Bytes per decision feed the report (aliased vs rebuilt per tensor class, HBM saved against a second
copy), the weight_sync cost (only rebuilt bytes of trainable tensors move after an optimizer step;
aliased ones are current already; frozen ones never change) and ``rollplex graph``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rollplex.errors import ConfigError
from rollplex.engines.tensorlayouts import TensorLayout, unfuse

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAPPINGS = ("aligned", "contiguous")
ZERO3_NOTE = ("ZeRO-3 partitions every parameter over the data-parallel ranks: the rollout engine cannot "
              "share the trainer's storage; the rollout layout is gathered at every sync")


@dataclass(frozen=True)
class TrainerSide:
    tp: int = 1
    dtype: str = "bfloat16"  # dtype of the parameters forward runs on (bf16 under DeepSpeed bf16; fp32 masters aside)
    zero: int = 1
    allocation: str = "fused"  # fused: one buffer per fused group's shard | separate: one storage per HF tensor
    dp: int = 1  # data-parallel ranks ZeRO-3 partitions each parameter over


@dataclass(frozen=True)
class RolloutSide:
    tp: int = 1
    dtype: str = "bfloat16"
    strided_ok: bool = True  # the engine runs on non-contiguous weight views (F.linear does)
    fused: bool = True  # vLLM fuses qkv_proj and gate_up_proj; the torch engines run q/k/v, gate/up apart


@dataclass(frozen=True)
class View:
    offset: int  # elements from the start of the trainer's buffer for this tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        expect, out = 1, []
        for size in reversed(self.shape):
            out.append(expect)
            expect *= size
        return tuple(reversed(out)) == self.stride or len(self.shape) == 1 and self.stride == (1,)


@dataclass(frozen=True)
class Decision:
    tensor: str
    cls: str
    kind: str  # alias | inplace | rebuild
    how: str  # view | strided view | gather into | slice | concat | cast | gather
    nbytes: int  # the rollout shard, in the rollout dtype
    aliased: int  # bytes that are the trainer's own storage
    local: int  # bytes copied from this GPU's trainer storage
    gathered: int  # bytes received from TP peers
    trainable: bool
    view: View | None = None
    reason: str = ""

    @property
    def extra(self) -> int:
        """HBM the rollout side adds on this GPU beyond the trainer's storage."""
        return self.nbytes - self.aliased

    @property
    def refresh_bytes(self) -> tuple[int, int]:
        """(local, peer) bytes moved after an optimizer step: aliased bytes are current already."""
        return (self.local, self.gathered) if self.trainable else (0, 0)


@dataclass(frozen=True)
class GpuPlan:
    gpu: int
    train_rank: int
    roll_rank: int
    decisions: tuple[Decision, ...]

    def total(self, what: str, trainable: bool | None = None) -> int:
        return sum(getattr(d, what) for d in self.decisions if trainable is None or d.trainable == trainable)


@dataclass(frozen=True)
class GangPlan:
    trainer: TrainerSide
    rollout: RolloutSide
    mapping: str
    gpus: tuple[GpuPlan, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def shared(self) -> bool:
        return any(g.total("aliased") for g in self.gpus)

    def by_class(self) -> dict[str, dict[str, int]]:
        """Bytes per tensor class, summed over the gang's GPUs."""
        out: dict[str, dict[str, int]] = {}
        for g in self.gpus:
            for d in g.decisions:
                row = out.setdefault(d.cls, {"nbytes": 0, "aliased": 0, "local": 0, "gathered": 0})
                for k in row:
                    row[k] += getattr(d, k)
        return out

    def per_gpu(self, what: str, trainable: bool | None = None) -> int:
        """The worst GPU's bytes (the one that sets the memory budget or the sync time)."""
        return max(g.total(what, trainable) for g in self.gpus)

    def saved_per_gpu(self) -> int:
        """HBM saved on the worst GPU against a second, separate rollout copy."""
        return min(g.total("aliased") for g in self.gpus)

    def sync_seconds(self, hbm_bw: float, link_bw: float, latency: float = 0.0, tensors: int = 0) -> float:
        """Refresh after an optimizer step on the slowest GPU: local copies read and write HBM,
        gathers cross the TP link."""
        worst = 0.0
        for g in self.gpus:
            local = sum(d.refresh_bytes[0] for d in g.decisions)
            peer = sum(d.refresh_bytes[1] for d in g.decisions)
            worst = max(worst, 2 * local / hbm_bw + peer / link_bw)
        moved = any(d.refresh_bytes != (0, 0) for g in self.gpus for d in g.decisions)
        return worst + (latency * tensors if moved else 0.0)


# --------------------------------------------------------------------------------------------------
def rank_mapping(t_train: int, t_roll: int, mapping: str = "aligned") -> list[tuple[int, int]]:
    """(train TP rank, rollout TP rank) per GPU of a gang of max(t_train, t_roll) GPUs.

    ``aligned``: GPU g holds rank g·t/G on each side, so the smaller TP degree's shard on a GPU
    contains the larger degree's (its TP groups are strided: {0, 2}, {1, 3} for t=2 of 4 GPUs).
    ``contiguous``: Megatron's default, TP groups of consecutive GPUs (rank g mod t on each side).
    """
    for t in (t_train, t_roll):
        if t < 1:
            raise ConfigError(f"weight sharing: TP degree {t} must be >= 1")
    big, small = max(t_train, t_roll), min(t_train, t_roll)
    if big % small:
        raise ConfigError(f"weight sharing: TP degrees {t_train} (train) and {t_roll} (rollout) must divide "
                          "one another")
    if mapping == "aligned":
        return [(g * t_train // big, g * t_roll // big) for g in range(big)]
    if mapping == "contiguous":
        return [(g % t_train, g % t_roll) for g in range(big)]
    raise ConfigError(f"weight sharing: mapping {mapping!r} is not one of {MAPPINGS}")


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def decide(layout: TensorLayout, trainer: TrainerSide, rollout: RolloutSide, train_rank: int, roll_rank: int,
           data_parallel: int = 1) -> Decision:
    """How the rollout shard ``roll_rank`` of one tensor comes to exist on a GPU whose trainer holds
    shard ``train_rank``. Pure."""
    tt, tr = trainer.tp, rollout.tp
    layout.check(tt)
    layout.check(tr)
    rb = DTYPE_BYTES[rollout.dtype]
    numel = layout.shard_numel(tr, roll_rank)
    nbytes = numel * rb

    def make(kind, how, aliased=0, local=0, gathered=0, view=None, reason=""):
        return Decision(layout.name, layout.cls, kind, how, nbytes, aliased, local, gathered, layout.trainable,
                        view, reason)

    if trainer.zero >= 3:
        local = nbytes // max(1, data_parallel)
        return make("rebuild", "gather", local=local, gathered=nbytes - local, reason="ZeRO-3 partitions")
    roll_rows = layout.shard_rows(tr, roll_rank)
    train_rows = layout.shard_rows(tt, train_rank)
    rc, tc = layout.shard_cols(tr, roll_rank), layout.shard_cols(tt, train_rank)
    width = max(rc[1] - rc[0], 1)
    col_local = _overlap(rc, tc) if layout.cols else 1
    local_numel = sum(_overlap((a, a + n), (ta, ta + tn)) * col_local
                      for (i, a, n), (ti, ta, tn) in zip(roll_rows, train_rows) if i == ti)
    local = local_numel * rb
    gathered = nbytes - local
    same_dtype = trainer.dtype == rollout.dtype
    # One buffer per fused group, or a group that is one HF tensor anyway (the vision tower's qkv).
    one_buffer = trainer.allocation == "fused" or len({p.hf for p in layout.parts}) == 1
    if local_numel < numel:  # rows or columns live on peers
        train_inside = all(ta >= a and ta + tn <= a + n for (a, n), (ta, tn)
                           in zip(((a, n) for _, a, n in roll_rows), ((ta, tn) for _, ta, tn in train_rows)))
        if (same_dtype and one_buffer and layout.style in ("column", "vocab") and train_inside):
            return make("inplace", "gather into", aliased=local, gathered=gathered,
                        reason="trainer's shard allocated inside the rollout buffer; peers' rows gathered")
        return make("rebuild", "gather", local=local, gathered=gathered,
                    reason="rows or columns live on TP peers")
    if not same_dtype:
        return make("rebuild", "cast", local=nbytes, reason=f"trainer {trainer.dtype} vs rollout {rollout.dtype}")
    # Every element is local: is the rollout shard one view of the trainer's buffer?
    if one_buffer:
        starts, base = [], 0
        for (i, a, n), (ti, ta, tn) in zip(roll_rows, train_rows):
            starts.append(base + a - ta)
            base += tn
        back_to_back = all(starts[k] + roll_rows[k][2] == starts[k + 1] for k in range(len(starts) - 1))
    else:
        back_to_back = len(roll_rows) == 1
        starts = [roll_rows[0][1] - train_rows[0][1]] if back_to_back else []
    if not back_to_back:
        return make("rebuild", "concat", local=nbytes, reason="fused parts are not adjacent in the trainer's storage")
    rows = sum(n for _, _, n in roll_rows)
    if not layout.cols:
        view = View(starts[0], (rows,), (1,))
    else:
        tw = tc[1] - tc[0]
        view = View(starts[0] * tw + (rc[0] - tc[0]), (rows, width), (tw, 1))
    if not view.contiguous and not rollout.strided_ok:
        return make("rebuild", "slice", local=nbytes, reason="a column slice, and the engine needs contiguous weights")
    return make("alias", "view" if view.contiguous else "strided view", aliased=nbytes, view=view)


def _replicate_unsplittable_vision(layouts: Sequence[TensorLayout], degrees: Sequence[int]):
    """Frozen vision tensors whose shapes do not split over a TP degree (Qwen2.5-VL's 3420-wide MLP
    over 8) become replicated, all of them together: a tower is either sharded or replicated."""
    try:
        for lay in layouts:
            if lay.name.startswith("visual."):
                for t in degrees:
                    lay.check(t)
        return list(layouts), 0
    except ConfigError:
        vis = [lay for lay in layouts if lay.name.startswith("visual.")]
        return [replace(lay, style="replicated") if lay.name.startswith("visual.") else lay
                for lay in layouts], len(vis)


def plan_gang(layouts: Sequence[TensorLayout], trainer: TrainerSide, rollout: RolloutSide,
              mapping: str = "aligned") -> GangPlan:
    """Decisions for every GPU of one gang and every tensor; ``notes`` say what cannot be shared and why."""
    for side, dtype in (("trainer", trainer.dtype), ("rollout", rollout.dtype)):
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"weight sharing: {side} dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if trainer.allocation not in ("fused", "separate"):
        raise ConfigError(f"weight sharing: trainer allocation {trainer.allocation!r} is not fused or separate")
    if not rollout.fused:
        layouts = unfuse(layouts)
    pairs = rank_mapping(trainer.tp, rollout.tp, mapping)
    dp = max(trainer.dp, len(pairs) // trainer.tp)
    notes = []
    layouts, replicated = _replicate_unsplittable_vision(layouts, (trainer.tp, rollout.tp))
    if replicated:
        notes.append(f"{replicated} vision tensors do not split over TP {max(trainer.tp, rollout.tp)}: the vision "
                     f"tower is replicated on both sides (vLLM's data-parallel encoder mode)")
    gpus = tuple(GpuPlan(g, rt, rr, tuple(decide(lay, trainer, rollout, rt, rr, dp) for lay in layouts))
                 for g, (rt, rr) in enumerate(pairs))
    if trainer.zero >= 3:
        notes.append(ZERO3_NOTE)
    if trainer.dtype != rollout.dtype:
        notes.append(f"the trainer's parameters are {trainer.dtype} and the rollout runs {rollout.dtype}: every "
                     f"tensor is cast, nothing is shared")
    if trainer.allocation == "separate" and trainer.zero < 3:
        notes.append("the trainer keeps one storage per HF tensor: fused rollout tensors (qkv_proj, gate_up_proj) "
                     "are concatenated copies; allocate fused groups as one buffer to share them")
    return GangPlan(trainer, rollout, mapping, gpus, tuple(notes))


# --------------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:8.2f}"


def format_plan(plan: GangPlan, title: str = "") -> list[str]:
    """The report: bytes per tensor class (summed over the gang), HBM saved per GPU, sync bytes."""
    t, r = plan.trainer, plan.rollout
    head = (f"weight sharing{': ' + title if title else ''}  train TP {t.tp} ({t.dtype}, ZeRO-{t.zero}, "
            f"{t.allocation} allocation) → rollout TP {r.tp} ({r.dtype}); {len(plan.gpus)} GPUs, "
            f"{plan.mapping} rank mapping")
    lines = [head, f"  {'tensor class':20s} {'rollout GiB':>11s} {'aliased':>8s} {'copied':>8s} {'gathered':>8s}  "
                   f"decisions"]
    kinds: dict[str, dict[str, int]] = {}
    for g in plan.gpus:
        for d in g.decisions:
            c = kinds.setdefault(d.cls, {})
            c[d.how] = c.get(d.how, 0) + 1
    for cls, row in sorted(plan.by_class().items()):
        how = ", ".join(f"{k} ×{v}" for k, v in sorted(kinds[cls].items()))
        lines.append(f"  {cls:20s} {_gib(row['nbytes']):>11s} {_gib(row['aliased'])} {_gib(row['local'])} "
                     f"{_gib(row['gathered'])}  {how}")
    total = sum(row["nbytes"] for row in plan.by_class().values())
    aliased = sum(row["aliased"] for row in plan.by_class().values())
    lines.append(f"  {'total':20s} {_gib(total):>11s} {_gib(aliased)}  ({aliased / total:.0%} of the rollout "
                 f"bytes are the trainer's own storage)" if total else "  (no tensors)")
    second = max(g.total("nbytes") for g in plan.gpus)
    saved = plan.saved_per_gpu()
    lines.append(f"  HBM per GPU: a second copy needs {second / 2**30:.2f} GiB; shared, the rollout adds "
                 f"{plan.per_gpu('extra') / 2**30:.2f} GiB: {saved / 2**30:.2f} GiB saved")
    local = max(sum(d.refresh_bytes[0] for d in g.decisions) for g in plan.gpus)
    peer = max(sum(d.refresh_bytes[1] for d in g.decisions) for g in plan.gpus)
    lines.append(f"  after each optimizer step (worst GPU): {local / 2**30:.2f} GiB copied locally, "
                 f"{peer / 2**30:.2f} GiB gathered from peers (full sync: "
                 f"{plan.per_gpu('nbytes', trainable=True) / 2**30:.2f} GiB)")
    lines += [f"  note: {n}" for n in plan.notes]
    return lines


# --------------------------------------------------------------------------------------------------
SHARING_ENGINES = {"vllm": True, "hf": False, "torch-graph": False}  # decode engine -> runs fused tensors


def run_sides(decode_engine: str, train_engine: str, dtype: str, zero_stage: int) -> tuple[TrainerSide, RolloutSide]:
    """The one-GPU (TP 1) sides of a ``rollplex train`` run: the torch trainer has no ZeRO; the
    train engines allocate fused groups as one buffer (or hand DeepSpeed its parameters in fusion order)."""
    zero = zero_stage if train_engine == "deepspeed" else 0
    return (TrainerSide(1, dtype, zero, "fused"),
            RolloutSide(1, dtype, fused=SHARING_ENGINES.get(decode_engine, True)))


def sharing_refusal(decode_engine: str, train_engine: str, zero_stage: int, lora: bool = False) -> str | None:
    """Why a run cannot share weights between these engines, or None."""
    if decode_engine not in SHARING_ENGINES:
        return f"decode engine {decode_engine!r} cannot run on the trainer's storage (engines that can: " \
               f"{', '.join(SHARING_ENGINES)})"
    if train_engine == "deepspeed" and zero_stage >= 3:
        return ZERO3_NOTE
    if lora and decode_engine == "torch-graph":
        return ("with train.lora, torch-graph reads the trainer's weights by name, not through the adapters: it "
                "decodes its own copy, the adapters merged at each sync")
    return None


def with_lora(plan: GangPlan, layouts: Sequence[TensorLayout], targets: Sequence[str], decode_engine: str) -> GangPlan:
    """A plan under LoRA adapters on ``targets`` (module names such as q_proj). An engine that runs the
    trainer's module (hf) serves the adapters on the shared base: nothing changes. vLLM keeps its own
    copy of every tensor a target is part of (a fused group, its bias): the trainer renames the
    target's layer. Those are reloaded at each sync, the targets' weights merged; the rest, aliased,
    never changes."""
    if decode_engine == "hf":  # torch-graph shares nothing under LoRA (sharing_refusal)
        return plan
    wanted = set(targets)

    def module(hf: str) -> str:
        parts = hf.split(".")
        return parts[-2] if len(parts) > 1 else ""

    touched = {lay.name: any(module(p.hf) in wanted and p.hf.endswith(".weight") for p in lay.parts)
               for lay in layouts if not lay.name.startswith("visual.") and any(module(p.hf) in wanted for p in lay.parts)}
    gpus = []
    for g in plan.gpus:
        decisions = []
        for d in g.decisions:
            if d.tensor in touched:
                merged = touched[d.tensor]
                d = replace(d, kind="rebuild", how="merge" if merged else "copy", aliased=0, local=d.nbytes,
                            gathered=0, trainable=True, view=None,
                            reason="a LoRA target: the adapters merged at each sync" if merged else
                            "beside a LoRA target in one fused layer: reloaded with it at each sync")
            elif d.trainable:
                d = replace(d, trainable=False)  # frozen under LoRA
            decisions.append(d)
        gpus.append(replace(g, decisions=tuple(decisions)))
    note = f"LoRA on {', '.join(targets)}: those tensors are the decode engine's own copies, the adapters merged"
    return replace(plan, gpus=tuple(gpus), notes=plan.notes + (note,))


def annotate(graph, plan: GangPlan | None, reason: str = "") -> None:
    """Write the weight_sync nodes' bytes into ``meta['weights']`` (printed by ``rollplex graph``)."""
    for node in graph:
        if node.kind != "weight_sync":
            continue
        if plan is None:
            node.meta["weights"] = f"copy (weight sharing off{': ' + reason if reason else ''})"
            continue
        aliased = plan.per_gpu("aliased")
        local = max(sum(d.refresh_bytes[0] for d in g.decisions) for g in plan.gpus)
        peer = max(sum(d.refresh_bytes[1] for d in g.decisions) for g in plan.gpus)
        node.meta["weights"] = (f"aliased {aliased / 2**20:.1f}MiB, rebuilt {(plan.per_gpu('extra')) / 2**20:.1f}MiB; "
                                f"sync copies {local / 2**20:.1f}MiB, gathers {peer / 2**20:.1f}MiB")


def annotate_run(graphs, model_path: str, decode_engine: str, train_engine: str, dtype: str, zero_stage: int,
                 mode: str, lora_targets: Sequence[str] = ()) -> GangPlan | None:
    """Plan a ``rollplex train`` run's sharing (one GPU, TP 1) once and annotate the weight_sync
    nodes of each of its ``graphs`` (one per schedule it may run); ``lora_targets``: train.lora's."""
    from rollplex.engines.modelspec import from_config
    from rollplex.engines.tensorlayouts import actor_layouts

    why = "engines.weight_sharing is off" if mode == "off" else sharing_refusal(decode_engine, train_engine,
                                                                                zero_stage, bool(lora_targets))
    plan = None
    if not why:
        trainer, rollout = run_sides(decode_engine, train_engine, dtype, zero_stage)
        layouts = actor_layouts(from_config(model_path))
        plan = plan_gang(layouts, trainer, rollout)
        if lora_targets:
            plan = with_lora(plan, unfuse(layouts) if not rollout.fused else layouts, lora_targets, decode_engine)
    for graph in graphs:
        annotate(graph, plan, why or "")
    return plan
