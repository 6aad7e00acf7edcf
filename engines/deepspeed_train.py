"""DeepSpeed train engine: ZeRO stage 0-3 around the same HF model and a client torch AdamW.

How the runtime's calls map onto DeepSpeed 0.19.8:
- The runtime runs forwards on submodules of ``module`` (tasks.lm), never through
  ``DeepSpeedEngine.forward``. ``backward`` therefore does that forward's bookkeeping itself: it marks
  a new micro-batch (``clear_backward_seen_flag``) and attaches the backward prologue to the loss
  (``register_output_backward_hooks``).
- Each loss is already normalised to the whole batch, so ``backward(loss, scale_wrt_gas=False)``:
  by default DeepSpeed divides every micro-batch loss by gradient_accumulation_steps again.
- ``managed_gradient_accumulation: false`` makes ``step()`` the accumulation boundary, so M
  backwards and one step apply one update. In the default (managed) mode DeepSpeed expects a
  ``step()`` after every micro-batch and applies on the M-th, which our interface has no place for.
- A client ``torch.optim.AdamW`` (``zero_allow_untested_optimizer``) needs no FusedAdam/CPUAdam build.

ZeRO-3 partitions the parameters, so this engine's weights cannot be shared by reference with a
rollout engine; ``state_dict_for_sync`` gathers full copies instead.

With LoRA (``train.lora``) DeepSpeed holds the adapters alone (ZeRO 0-2; ZeRO-3 would partition the
frozen base too, which the merged sync and export do not gather), and its checkpoint leaves the
frozen base out (``exclude_frozen_parameters``): the base is the reference the engine starts from.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from rollplex.engines.base import EngineContext, EngineSpec, StepStats, TrainEngine, register_engine
from rollplex.engines.torch_train import (
    adamw,
    first_nonfinite,
    in_param,
    export_model,
    is_vision_param,
    load_model,
    load_policy,
    nonfinite_error,
    save_adapter,
    sync_state,
)
from rollplex.errors import CheckpointError, ConfigError

DS_SUBDIR = "deepspeed"  # DeepSpeed's own checkpoint (optimizer state, fp32 master partitions)
DS_TAG = "state"


def init_distributed(device: torch.device) -> None:
    """One process group per process; a launcher's (or vLLM's) environment and group win."""
    import deepspeed

    if not torch.distributed.is_initialized():
        for var, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(var, default)
        if "MASTER_PORT" not in os.environ:
            # No launcher: a one-rank group on loopback, named here rather than in MASTER_PORT, which
            # every process this one starts (Dask workers) would inherit and try to listen on.
            from rollplex.runtime import init_local_group

            init_local_group(device.type)
    _skip_shared_memory_comm_build()
    # Idempotent; adopts an existing torch.distributed group instead of creating one.
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               auto_mpi_discovery=False, verbose=False)


def _skip_shared_memory_comm_build() -> None:
    """DeepSpeed's torch backend JIT-compiles its CPU shared-memory all-reduce (``deepspeed_shm_comm``)
    on first init: about a minute of both cores of a 2-core machine. Only DeepSpeed inference's
    all-reduce calls it, which Rollplex never does (training reduces through torch.distributed), so
    it is marked incompatible and the backend goes without it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def ds_config(ctx: EngineContext, stage: int) -> dict:
    grad_clip = float(ctx.options.get("grad_clip", 1.0))
    bf16 = ctx.dtype == torch.bfloat16
    if ctx.dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"deepspeed train engine: dtype {ctx.dtype} is not supported; use bfloat16 or float32")
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": int(ctx.options.get("accumulation_steps", 1)),
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        # check_grad_overflow makes ZeRO skip (not apply) a step whose norm is NaN/Inf in bf16 too.
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "fp16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainEngine(TrainEngine):
    name = "deepspeed"

    def __init__(self, ctx: EngineContext):
        import deepspeed

        self.device = torch.device(ctx.device)
        self.dtype = ctx.dtype
        self.stage = int(ctx.options.get("zero_stage", 2))
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed train engine: zero_stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.stage == 3 and ctx.options.get("lora"):
            raise ConfigError("train.lora: ZeRO-3 would partition the frozen base model as well, which the merged "
                              "weight sync and export do not gather; use train.zero_stage 0, 1 or 2 (the adapters "
                              "are small)")
        init_distributed(self.device)
        _forget_stale_cached_groups()
        model, self.peft = load_policy(ctx)
        params = [p for p in model.parameters() if p.requires_grad]
        if ctx.options.get("fusion_order") and self.peft is None:  # weight sharing: fused groups adjacent in ZeRO's flat buffer
            from rollplex.engines.sharing import fusion_order, layouts_for_module

            params = fusion_order(model, layouts_for_module(model))
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=adamw(params, ctx.options), config=ds_config(ctx, self.stage))
        self.module = self.ds.module
        if self.stage == 0 and self.dtype == torch.bfloat16:
            self._undo_state_init_step()
        self._trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._pending = 0  # backward calls since the last step

    def _undo_state_init_step(self) -> None:
        """bf16 without ZeRO wraps AdamW in FP16_UnfusedOptimizer, which builds the AdamW state by
        running one real step on zero gradients: AdamW's step count starts at 1 (the first real update
        came out 0.75x of torch's after bias correction) and weight decay has shrunk the fp32 masters.
        Restore both: an empty state and masters equal to the (bf16-exact) parameters."""
        wrapper = self.ds.optimizer
        wrapper.optimizer.state.clear()
        for masters, params in zip(wrapper.fp32_groups, wrapper.fp16_groups):
            for master, param in zip(masters, params):
                master.data.copy_(param.data)

    # ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        from deepspeed.runtime.utils import register_output_backward_hooks

        # What DeepSpeedEngine.forward does first: marks a new micro-batch. Without it ZeRO-3 copies
        # instead of accumulating (only the last micro-batch survives) and ZeRO-1/2 keep stale state.
        new_micro_batch = getattr(self.ds.optimizer, "clear_backward_seen_flag", None)
        if new_micro_batch is not None:
            new_micro_batch()
        # Keep the hook manager alive through the backward; it runs the prologue once per graph.
        hooks = register_output_backward_hooks(loss, preprocess_once_fn=self.ds._backward_prologue)
        self.ds.backward(loss, scale_wrt_gas=False)
        del hooks
        self._pending += 1

    def step(self) -> StepStats:
        lr = float(self.ds.get_lr()[0])
        if self._pending == 0:  # DeepSpeed's boundary code expects gradients; nothing to apply
            return StepStats(grad_norm=0.0, lr=lr, skipped=True)
        self._pending = 0
        what = f"deepspeed ZeRO-{self.stage} train engine"
        local_norm = self._check_param_grads(what) if self.stage <= 1 else None
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else local_norm
        # Stages 2-3 hold the gradients in ZeRO's flat partitions, where DeepSpeed's own norm check
        # skips the update (optimizer.overflow) and clears them, but the parameter is no longer known.
        if not self.ds.was_step_applied() or norm is None or not math.isfinite(norm):
            where = in_param(None) if self.stage <= 1 else (
                "somewhere in ZeRO's gradient partitions (which do not keep parameter names; "
                "train.zero_stage 1 or the torch engine name it)")
            raise nonfinite_error(what, norm, where)
        return StepStats(grad_norm=norm, lr=lr)

    def _check_param_grads(self, what: str) -> float:
        """Stages 0-1 keep gradients on the parameters until ds.step(): refuse a bad step here, where
        the parameter can still be named. Every rank joins the flag's all-reduce so all raise together.
        Returns this rank's norm (the global one on a single rank; stage 0 has no other)."""
        grads = [p.grad for _, p in self._trainable if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        bad = torch.tensor([0.0 if math.isfinite(norm) else 1.0])
        if torch.distributed.get_world_size() > 1:
            bad = bad.to(self.device)
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if float(bad.item()) > 0:
            name = first_nonfinite((n, p.grad) for n, p in self._trainable)
            for _, p in self._trainable:
                p.grad = None
            self.ds.optimizer.zero_grad()
            raise nonfinite_error(what, norm, in_param(name))
        return norm

    # ------------------------------------------------------------------------------------------
    # -- residency (the memory plan's offload/prefetch nodes) -----------------------------------
    # ZeRO-1/2/3 move their own fp32 partitions and moments (``offload_states``); gradients stay, as
    # moving them mid-accumulation would strand ZeRO's reduce buckets on the device.
    movable_parts = ("master", "adam")
    _DS_STATES = {"master": "hp_params", "adam": "optim_states"}

    def _part_tensors(self, part: str) -> list[torch.Tensor]:
        if self.stage in (1, 2) and part == "master":
            return list(self.ds.optimizer.single_partition_of_fp32_groups)
        if self.stage == 0 and part == "master" and hasattr(self.ds.optimizer, "fp32_groups"):
            return [m for group in self.ds.optimizer.fp32_groups for m in group]
        return super()._part_tensors(part)

    def offload(self, part: str) -> int:
        if self.stage == 0:  # no ZeRO optimizer: move the tensors themselves
            return super().offload(part)
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        moved = self._bytes_on_device([part])
        self.ds.offload_states(include=[OffloadStateTypeEnum(self._DS_STATES[part])],
                               pin_memory=self.device.type == "cuda")
        return moved

    def reload(self, part: str) -> int:
        if self.stage == 0:
            return super().reload(part)
        offloaded = {s.value for s in getattr(self.ds.optimizer, "offloaded_states", ())}
        if not offloaded:
            return 0
        # DeepSpeed brings every offloaded state back at once; a later prefetch finds nothing left.
        self.ds.reload_states()
        return self._bytes_on_device([p for p, state in self._DS_STATES.items() if state in offloaded])

    def _bytes_on_device(self, parts: list[str]) -> int:
        """Bytes of ``parts`` that a move between host and device copies (none when the device is
        the host), as ``move_tensors`` counts them."""
        if self.device.type == "cpu":
            return 0
        tensors = [t for p in parts for t in self._part_tensors(p)]
        return sum(t.numel() * t.element_size() for t in tensors if t.device == self.device)

    def state_dict_for_sync(self, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under module names (as TorchTrainEngine). ZeRO-3 gathers one parameter at a
        time, so the peak is one full tensor on top of the partitions."""
        if self.stage < 3:
            yield from sync_state(self.module, self.peft, trainable_only)
            return
        import deepspeed

        for name, p in self.module.named_parameters():
            if trainable_only and is_vision_param(name):
                continue
            with deepspeed.zero.GatheredParameters([p]):
                full = p.detach().clone()
            yield name, full
        persistent = set(self.module.state_dict())  # state_dict() leaves non-persistent buffers out
        for name, b in self.module.named_buffers():
            if name in persistent:
                yield name, b

    def save(self, directory: str) -> None:
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        rank0 = torch.distributed.get_rank() == 0
        self.export(str(root), is_main_process=rank0)
        if rank0:
            save_adapter(self.peft, str(root))
        # DeepSpeed's checkpoint holds the per-rank optimizer partitions and, in bf16, the fp32 master
        # weights, so a resume is exact. It repeats the module weights: accepted, it is the one format
        # that round-trips every stage and world size. Under LoRA only the adapters': the base is frozen.
        self.ds.save_checkpoint(str(root / DS_SUBDIR), tag=DS_TAG, save_latest=False,
                                exclude_frozen_parameters=self.peft is not None)

    def export(self, directory: str, is_main_process: bool = True) -> None:
        # ZeRO-3's own tensors are partitions: every rank joins the gathers of a full state dict.
        full = dict(self.state_dict_for_sync()) if self.stage == 3 else None
        export_model(self.module, self.peft, directory, is_main_process, state_dict=full)

    def fold_adapter(self) -> bool:
        if self.peft is None:
            return False
        from rollplex.engines import lora

        lora.fold(self.peft)
        # ZeRO-1/2 and bf16 keep fp32 copies of the adapters, which the next step would copy back.
        refresh = getattr(self.ds.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()
        return True

    def load(self, directory: str) -> None:
        ds_dir = Path(directory) / DS_SUBDIR / DS_TAG
        if not ds_dir.is_dir():
            raise CheckpointError(f"{ds_dir}: DeepSpeed state missing; was {directory} written by "
                                  f"DeepSpeedTrainEngine.save?")
        if self.peft is not None:  # refuses an adapter of another rank or targets by name first
            load_model(self.module, self.peft, directory)
        path, _ = self.ds.load_checkpoint(str(ds_dir.parent), tag=DS_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=False,
                                          load_module_strict=self.peft is None)  # LoRA: no frozen base in it
        if path is None:
            raise CheckpointError(f"{ds_dir}: DeepSpeed could not load this checkpoint")

    def close(self) -> None:
        self.ds.destroy()
        _forget_cached_groups()


def _forget_stale_cached_groups() -> None:
    """Forget DeepSpeed's cached groups if their world is gone: an engine of an earlier run in this
    process that was never closed (an exception, a notebook cell) leaves them behind, and
    ``deepspeed.initialize`` would fail on the dead group ("Group ... is not registered")."""
    from deepspeed.utils import groups
    from torch.distributed import distributed_c10d

    cached = groups._WORLD_GROUP
    # pg_map is torch's registry of live groups, the one its "is not registered" check reads.
    if cached is not None and cached not in distributed_c10d._world.pg_map:
        _forget_cached_groups()


def _forget_cached_groups() -> None:
    """DeepSpeed caches the groups it derives from the world (``deepspeed.utils.groups``) for the life of
    the process. A run whose worker shares the driver's process (cluster.processes: auto on CPU) ends
    with vLLM destroying the world group, and the next run in that process (a notebook, a test) would
    hand the dead group's clone to its new engine. Engines already built keep their own references."""
    from deepspeed.utils import groups

    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
                 "_MPU_TENSOR_MODEL_PARALLEL_RANK"):
        setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        getattr(groups, name).clear()


register_engine(EngineSpec(
    name="deepspeed",
    role="train",
    factory=DeepSpeedTrainEngine,
    requires=("deepspeed",),
    description="DeepSpeed ZeRO 0-3 (train.zero_stage) with a client torch AdamW",
))
