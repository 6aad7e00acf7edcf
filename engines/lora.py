"""LoRA adapters on the policy's language model (``train.lora``), through peft.

peft injects its LoRA layers into the HF model in place (``get_peft_model``), so the engines and
tasks keep running on the HF module itself (``module.model.language_model``, ``module.lm_head``)
with the adapters on; the ``PeftModel`` wrapper is kept beside it for saving and loading. Around
that, what the runtime needs:

- ``without_adapters``: the frozen reference, the base model with the adapters off, on the policy's
  own parameters (no second copy). peft's ``disable_adapter()`` turns the adapters off with a flag
  on the shared layers, which a decode engine running the same module inside the decode window
  would see too; this is the same module tree with each LoRA layer replaced by its base layer, which
  computes exactly what ``disable_adapter()`` does and leaves the policy's layers alone.
- ``merged_state``: the weights under the base model's names, W + (alpha/rank)·B·A on each target:
  what a decode engine without adapters loads at weight sync, and a checkpoint's HF export.
- ``fold``: the adapters merged into the base and B zeroed. At the end of a warm-up the warmed-up
  policy becomes the reference, which must be the base with the adapters off.
- ``export``/``save_adapter``/``load_adapter``: a checkpoint holds the merged export (``config.json``,
  ``model.safetensors``: plain transformers loads it) and ``adapter/`` (peft's
  ``adapter_config.json`` and ``adapter_model.safetensors``), not at the top level, where
  transformers would take the folder for an adapter to put on its base model.
- Dropout acts only in forwards that keep a graph (the training forwards): decoding and scoring
  stay deterministic, so rollout and reference log-probs match a plain forward.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from rollplex.errors import CheckpointError, ConfigError

ADAPTER_DIR = "adapter"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # peft's name for the one adapter


class TrainingDropout(torch.nn.Dropout):
    """Dropout where autograd records (the training forwards), identity in no-grad forwards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, training=torch.is_grad_enabled())


def target_names(model: torch.nn.Module, suffixes: list[str]) -> list[str]:
    """Full names of the language model's linear layers whose last name part is one of ``suffixes``.
    A suffix that names none of them is refused, listing those there are."""
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "visual" not in n]
    found = [n for n in linear if n.rsplit(".", 1)[-1] in suffixes]
    missing = [s for s in suffixes if not any(n.rsplit(".", 1)[-1] == s for n in found)]
    if missing:
        known = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ConfigError(f"train.lora.target_modules: {missing} name no linear layer of the language model; "
                          f"it has {', '.join(known)}")
    return found


def attach(model: torch.nn.Module, options: dict):
    """Put adapters on ``model`` in place and freeze everything else; returns peft's wrapper."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=int(options["rank"]), lora_alpha=float(options["alpha"]),
                        lora_dropout=float(options["dropout"]), bias="none",
                        target_modules=target_names(model, list(options["target_modules"])))
    # autocast_adapter_dtype=False: adapters in the model's dtype, as full fine-tuning trains it
    # (DeepSpeed's bf16 keeps the fp32 master copy); peft would make them fp32 next to bf16 weights.
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    for layer in lora_layers(model).values():
        dropout = layer.lora_dropout[ADAPTER_NAME]
        if isinstance(dropout, torch.nn.Dropout):
            layer.lora_dropout[ADAPTER_NAME] = TrainingDropout(dropout.p)
    return peft_model


def lora_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}


def has_adapters(module: torch.nn.Module) -> bool:
    return bool(lora_layers(module))


def without_adapters(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every LoRA layer replaced by its base layer: shallow copies of the modules on
    the way to a LoRA layer, the same objects (and parameters) everywhere else."""
    from peft.tuners.lora import LoraLayer

    def rebuild(m: torch.nn.Module) -> torch.nn.Module:
        if isinstance(m, LoraLayer):
            return m.get_base_layer()
        children = {n: rebuild(c) if c is not None else None for n, c in m._modules.items()}
        if all(children[n] is c for n, c in m._modules.items()):
            return m
        clone = object.__new__(type(m))
        clone.__dict__ = {**m.__dict__, "_modules": children}  # parameters and buffers: the same dicts
        return clone

    return rebuild(module)


def _merged_weight(layer) -> torch.Tensor:
    base = layer.get_base_layer().weight
    return base.detach() + layer.get_delta_weight(ADAPTER_NAME).to(base.dtype)


def merged_state(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the base model's module names, each target's weight merged."""
    layers = lora_layers(module)
    with torch.no_grad():
        merged = {f"{name}.base_layer.weight": name for name in layers}
        for key, tensor in module.state_dict().items():
            if ".lora_" in key:
                continue
            if key in merged:
                yield f"{merged[key]}.weight", _merged_weight(layers[merged[key]])
            else:
                yield key.replace(".base_layer.", "."), tensor


def fold(peft_model) -> None:
    """W += (alpha/rank)·B·A on every target, then B = 0: the policy's function is unchanged and its
    base model (the reference) now equals it. The caller refreshes any copy an optimizer keeps."""
    with torch.no_grad():
        for layer in lora_layers(peft_model.base_model.model).values():
            base = layer.get_base_layer().weight
            base.add_(layer.get_delta_weight(ADAPTER_NAME).to(base.dtype))
            layer.lora_B[ADAPTER_NAME].weight.zero_()
    # The base is no longer the folder it was loaded from.
    peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = None


def export(module: torch.nn.Module, directory: str | Path, is_main_process: bool = True) -> None:
    """The merged model in HF format: plain transformers loads it without peft."""
    module.save_pretrained(directory, state_dict=dict(merged_state(module)), is_main_process=is_main_process)


def save_adapter(peft_model, directory: str | Path) -> None:
    """The adapter alone, in peft's format, in ``directory/adapter``."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter = Path(directory) / ADAPTER_DIR
    adapter.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config[ADAPTER_NAME].save_pretrained(str(adapter))
    # save_embedding_layers=False: with lm_head among the targets peft would also store the whole base
    # head, which the base model (the reference a resume starts from) holds already.
    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(state, str(adapter / ADAPTER_FILE))


def load_adapter(peft_model, directory: str | Path) -> None:
    """Restore the adapter ``save`` wrote, refusing one of another rank, alpha or targets."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter = Path(directory) / ADAPTER_DIR
    if not (adapter / ADAPTER_FILE).exists():
        raise CheckpointError(f"{adapter / ADAPTER_FILE}: no LoRA adapter; was {directory} written by a run with "
                              f"train.lora?")
    saved = json.loads((adapter / "adapter_config.json").read_text())
    ours = peft_model.peft_config[ADAPTER_NAME]
    for key, mine in (("r", ours.r), ("lora_alpha", ours.lora_alpha), ("target_modules", ours.target_modules)):
        theirs = saved.get(key)
        if key == "target_modules":
            theirs, mine = sorted(theirs or []), sorted(mine)
        if theirs != mine:
            raise CheckpointError(f"{adapter}: the adapter has {key}={theirs}, this run's train.lora gives {mine}")
    result = set_peft_model_state_dict(peft_model, load_file(str(adapter / ADAPTER_FILE)))
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{adapter}: the adapter does not fit the model; missing {missing[:3]}, "
                              f"unexpected {list(result.unexpected_keys)[:3]}")


def sizes(module: torch.nn.Module) -> dict[str, int]:
    """Adapter parameters, base parameters and the base's bytes (what a reference copy would hold)."""
    adapter = base = nbytes = 0
    for name, p in module.named_parameters():
        if ".lora_" in name:
            adapter += p.numel()
        else:
            base += p.numel()
            nbytes += p.numel() * p.element_size()
    return {"adapter_params": adapter, "base_params": base, "base_bytes": nbytes,
            "targets": len(lora_layers(module))}


def own_bytes(module: torch.nn.Module, of: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers that live outside ``of``'s storage: what a frozen
    copy holds of its own (0 for ``without_adapters(of)``)."""
    tensors = lambda m: [*m.parameters(), *m.buffers()]  # noqa: E731
    theirs = {t.untyped_storage().data_ptr() for t in tensors(of)}
    return sum(t.numel() * t.element_size() for t in tensors(module) if t.untyped_storage().data_ptr() not in theirs)
