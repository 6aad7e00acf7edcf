"""Plain PyTorch train engine: one HF Qwen2.5-VL, AdamW over what trains, no sharding.

What trains (``load_policy``): the language model, with the vision tower frozen unless the option
``freeze_vision`` is false; with ``lora`` (``train.lora``), the adapters alone (engines/lora.py).
Also holds the helpers the DeepSpeed engine shares: loading the policy, a critic's value head and the
file it is saved in, mapping checkpoint names to module names, the LoRA-aware sync, save and load,
and naming a non-finite gradient.

Parameter names. ``module.state_dict()`` (transformers 5.19) says ``model.language_model.*`` and
``model.visual.*``, while ``save_pretrained`` reverts to the original Qwen release names
(``model.layers.*``, ``visual.*``) in the safetensors file, checked on the tiny model. Sync
therefore yields module names: ``model.load_state_dict`` accepts only those, and vLLM's Qwen2.5-VL
loader maps both spellings. ``load`` maps file names back with transformers' own reversal.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rollplex.engines.base import EngineContext, EngineSpec, StepStats, TrainEngine, register_engine
from rollplex.errors import CheckpointError

OPTIMIZER_FILE = "optimizer.pt"


def is_vision_param(name: str) -> bool:
    return "visual" in name


def trains_vision(module) -> bool:
    """Whether any of ``module``'s vision-tower parameters trains (``train.freeze_vision: false``)."""
    return any(p.requires_grad and is_vision_param(n) for n, p in module.named_parameters())


VALUE_HEAD_FILE = "value_head.safetensors"  # a critic's value head, beside the folder's model.safetensors


class ValueHead(torch.nn.Linear):
    """A critic's scalar head in place of the LM head: every forward that produced next-token logits
    [.., V] now produces values [.., 1], so the prefix/suffix forwards serve a critic unchanged.
    Zero-initialised: the first values are 0 and the head learns before it moves the trunk.

    ``replaced`` keeps the LM head it took the place of (a plain tensor on the host: neither trained
    nor moved; None where that head was the tied input embedding) for the folder ``export_model``
    writes: the critic's trunk with that LM head, which plain transformers loads as it loads any
    Qwen2.5-VL, and this head in ``VALUE_HEAD_FILE`` beside it, which ``load_hf_weights`` reads."""

    def __init__(self, model: torch.nn.Module):
        lm_head = model.lm_head.weight
        super().__init__(model.config.get_text_config().hidden_size, 1, bias=False, dtype=lm_head.dtype,
                         device=lm_head.device)
        torch.nn.init.zeros_(self.weight)
        tied = lm_head is model.get_input_embeddings().weight
        self.replaced = None if tied else lm_head.detach().to("cpu")


def with_value_head(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a ValueHead in place of its LM head (a critic)."""
    model.lm_head = ValueHead(model)
    return model


def value_head_name(module: torch.nn.Module) -> str | None:
    """The state-dict name of ``module``'s ValueHead weight (``lm_head.weight``), None without one."""
    return next((f"{name}.weight" for name, m in module.named_modules() if isinstance(m, ValueHead)), None)


def load_policy(ctx: EngineContext):
    """(The HF model on ctx.device/dtype with its window attention batched (engines.vision_attention),
    peft's wrapper of it or None). ``options["module"]``: a model built by the caller, used as is
    otherwise, e.g. by ``rollplex bench``; ``options["head"] == "value"`` gives it a scalar value
    head instead of the LM head (a critic). The vision tower is frozen unless
    ``options["freeze_vision"]`` is false; ``options["lora"]`` puts adapters on the language model
    and freezes the rest; ``options["gradient_checkpointing"]`` recomputes the decoder layers'
    activations in training backwards (engines/recompute.py)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.vision_attention import batch_vision_attention

    torch.manual_seed(ctx.seed)
    model = ctx.options.get("module")
    if model is None:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ctx.model_path, dtype=ctx.dtype)
    batch_vision_attention(model)  # one SDPA call per run of equal vision windows, not one per window
    if ctx.options.get("head", "lm") == "value":
        with_value_head(model)
    model.to(ctx.device)
    freeze_vision = bool(ctx.options.get("freeze_vision", True))
    for name, p in model.named_parameters():
        if freeze_vision and is_vision_param(name):
            p.requires_grad_(False)
    if ctx.options.get("gradient_checkpointing"):
        from rollplex.engines.recompute import checkpoint_layers

        checkpoint_layers(model)
    peft_model = None
    if ctx.options.get("lora"):
        from rollplex.engines import lora

        peft_model = lora.attach(model, ctx.options["lora"])
    # Log-prob ratios need the same forward at rollout and at training time, so no dropout (LoRA's
    # acts in training forwards only: engines/lora.py).
    model.eval()
    return model, peft_model


def adamw(params: list[torch.nn.Parameter], options) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params,
        lr=float(options.get("lr", 2e-3)),
        betas=tuple(options.get("betas", (0.9, 0.999))),
        eps=float(options.get("eps", 1e-8)),
        weight_decay=float(options.get("weight_decay", 0.0)),
    )


def first_nonfinite(named_grads: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first gradient holding a NaN or Inf. Only called once a norm came out bad."""
    for name, g in named_grads:
        if g is not None and not bool(torch.isfinite(g).all()):
            return name
    return None


def nonfinite_error(engine: str, norm: float | None, where: str) -> FloatingPointError:
    return FloatingPointError(f"{engine}: gradient norm is {norm} (non-finite) {where}; the optimizer "
                              f"step was not applied and the gradients were cleared")


def in_param(name: str | None) -> str:
    return f"in parameter {name!r}" if name else "in the total (every gradient is finite; their norm overflows)"


def checkpoint_to_module_names(module: torch.nn.Module) -> dict[str, str]:
    """{name in a save_pretrained file: name in module.state_dict()}.

    save_pretrained renames through ``revert_weight_conversion``; that function passes the very tensor
    objects through, so their ids give the inverse map exactly, for whatever renames the model has.
    """
    state = module.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without conversion mappings saves module names
        return {k: k for k in state}
    by_id = {id(t): k for k, t in state.items()}
    reverted = revert_weight_conversion(module, dict(state))
    mapping = {saved: by_id[id(t)] for saved, t in reverted.items() if id(t) in by_id}
    if len(mapping) != len(state):
        raise CheckpointError(f"cannot map checkpoint names to {type(module).__name__} parameters: "
                              f"{len(mapping)} of {len(state)} tensors were passed through unchanged")
    return mapping


def read_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a save_pretrained directory, sharded or not, under their file names."""
    from safetensors.torch import load_file

    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (root / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{root}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(root / f)))
    return tensors


def load_hf_weights(module: torch.nn.Module, directory: str | Path) -> None:
    """Copy a save_pretrained checkpoint into ``module`` in place (strict: every tensor, no extras).
    A critic's value head comes from the folder's VALUE_HEAD_FILE instead of its LM head."""
    mapping = checkpoint_to_module_names(module)
    saved = read_safetensors(directory)
    head = value_head_name(module)
    if head is not None:
        saved_name = next(k for k, v in mapping.items() if v == head)
        saved[saved_name] = read_value_head(directory, saved.get(saved_name))
    unknown = sorted(set(saved) - set(mapping))
    missing = sorted(set(mapping) - set(saved))
    if unknown or missing:
        raise CheckpointError(f"{directory}: checkpoint does not match the model; "
                              f"unexpected {unknown[:5]}, missing {missing[:5]}")
    module.load_state_dict({mapping[k]: v for k, v in saved.items()}, strict=True)


def read_value_head(directory: str | Path, lm_head: torch.Tensor | None) -> torch.Tensor:
    """A critic folder's value head. A folder written before the head had a file of its own holds it
    as its [1, hidden] LM head, which is read instead, so such run directories still resume."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / VALUE_HEAD_FILE
    if not path.exists():
        if lm_head is not None and lm_head.shape[0] == 1:
            return lm_head
        raise CheckpointError(f"{path} is missing: a critic's folder holds its value head there")
    try:
        weight = load_file(str(path)).get("weight")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None
    if weight is None or weight.dim() != 2 or weight.shape[0] != 1:
        raise CheckpointError(f"{path}: holds no [1, hidden] tensor named 'weight'")
    return weight


class TorchTrainEngine(TrainEngine):
    """AdamW on one device. ``backward`` accumulates; ``step`` checks, clips, applies and zeroes.

    In bf16 the parameters and AdamW moments are bf16 too (no fp32 master copy, unlike DeepSpeed),
    so small updates round away; it is the reference in fp32 and a convenience in bf16.
    """

    name = "torch"

    def __init__(self, ctx: EngineContext):
        self.device = torch.device(ctx.device)
        self.dtype = ctx.dtype
        self.grad_clip = float(ctx.options.get("grad_clip", 1.0))
        self.module, self.peft = load_policy(ctx)
        self._trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.optimizer = adamw([p for _, p in self._trainable], ctx.options)
        # Data-parallel ranks (one per worker, in the process group the cluster formed): gradients are
        # averaged at the step, as DeepSpeed does, so every rank takes the same step.
        dist = torch.distributed
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def backward(self, loss: torch.Tensor) -> None:
        # The caller normalised the loss to the whole batch, so the M calls simply add up.
        loss.backward()

    def scale_gradients(self, factor: float) -> None:
        with torch.no_grad():
            for _, p in self._trainable:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def step(self) -> StepStats:
        if self.world > 1:
            self._average_gradients()
        grads = [p.grad for _, p in self._trainable if p.grad is not None]
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not grads:
            return StepStats(grad_norm=0.0, lr=lr, skipped=True)
        norm = torch.nn.utils.get_total_norm(grads)
        if not bool(torch.isfinite(norm)):
            bad = first_nonfinite((n, p.grad) for n, p in self._trainable)
            self.optimizer.zero_grad(set_to_none=True)
            raise nonfinite_error("torch train engine", float(norm), in_param(bad))
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_([p for _, p in self._trainable], self.grad_clip, norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(grad_norm=float(norm), lr=lr)

    def _average_gradients(self) -> None:
        """Every rank all-reduces every trainable parameter's gradient in one order (a rank whose
        groups left one unused reduces zeros), then divides by the ranks."""
        with torch.no_grad():
            for _, p in self._trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(self.world)

    def state_dict_for_sync(self, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        return sync_state(self.module, self.peft, trainable_only)

    def export(self, directory: str, is_main_process: bool = True) -> None:
        export_model(self.module, self.peft, directory, is_main_process)

    def fold_adapter(self) -> bool:
        if self.peft is None:
            return False
        from rollplex.engines import lora

        lora.fold(self.peft)
        return True

    def save(self, directory: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.export(directory)
        save_adapter(self.peft, directory)
        torch.save(self.optimizer.state_dict(), Path(directory) / OPTIMIZER_FILE)

    def load(self, directory: str) -> None:
        path = Path(directory) / OPTIMIZER_FILE
        if not path.exists():
            raise CheckpointError(f"{path}: optimizer state missing; was {directory} written by TrainEngine.save?")
        load_model(self.module, self.peft, directory)
        # AdamW's state is keyed by parameter order, which from_pretrained reproduces.
        self.optimizer.load_state_dict(torch.load(path, map_location=self.device, weights_only=True))


def sync_state(module: torch.nn.Module, peft_model, trainable_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights under module names (see the module docstring), for a decode engine. With LoRA
    under the base model's names, each target merged (lora.merged_state). ``trainable_only``: what
    training changes, less the vision tower, which no decode engine runs (vit_encode feeds them).
    Under LoRA that is the whole language model: a decode engine reloads a fused layer whole (vLLM's
    q|k|v and their biases), so a target's partners travel with it; a shared engine skips those
    it runs on the trainer's storage already."""
    if peft_model is not None:
        from rollplex.engines import lora

        for name, t in lora.merged_state(module):
            if not (trainable_only and is_vision_param(name)):
                yield name, t
        return
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    for name, t in module.state_dict().items():
        if not (trainable_only and (name in frozen or is_vision_param(name))):
            yield name, t


def export_model(module: torch.nn.Module, peft_model, directory: str, is_main_process: bool = True,
                 state_dict: dict | None = None) -> None:
    """The model alone in HF format (``save_pretrained``); with LoRA the merged weights; a critic
    as its trunk with the LM head it replaced, and its value head in VALUE_HEAD_FILE (see ValueHead)."""
    if peft_model is not None:
        from rollplex.engines import lora

        lora.export(module, directory, is_main_process)
        return
    head = value_head_name(module)
    if head is None:
        module.save_pretrained(directory, state_dict=state_dict, is_main_process=is_main_process)
        return
    from safetensors.torch import save_file

    state = dict(state_dict if state_dict is not None else module.state_dict())
    value = state.pop(head)
    replaced = module.get_submodule(head.removesuffix(".weight")).replaced
    if replaced is not None:  # else tied: save_pretrained leaves the LM head out, and loading ties it again
        state[head] = replaced
    module.save_pretrained(directory, state_dict=state, is_main_process=is_main_process)
    if is_main_process:
        save_file({"weight": value.detach().to("cpu").contiguous()}, str(Path(directory) / VALUE_HEAD_FILE))


def save_adapter(peft_model, directory: str) -> None:
    """A checkpoint's ``adapter/`` (LoRA only): what ``load_model`` reads back."""
    if peft_model is not None:
        from rollplex.engines import lora

        lora.save_adapter(peft_model, directory)


def load_model(module: torch.nn.Module, peft_model, directory: str) -> None:
    """What ``export_model`` wrote, back into ``module``: with LoRA the adapter alone (the base is the
    reference the engine was built from), else every weight."""
    if peft_model is not None:
        from rollplex.engines import lora

        lora.load_adapter(peft_model, directory)
    else:
        load_hf_weights(module, directory)


register_engine(EngineSpec(
    name="torch",
    role="train",
    factory=TorchTrainEngine,
    requires=("transformers",),
    description="plain PyTorch AdamW on one device; the reference the sharded engines are tested against",
))
