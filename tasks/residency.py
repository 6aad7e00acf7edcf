"""The memory plan's ``offload`` and ``prefetch`` nodes (pipeline/plan/memory.py inserts them).

A graph value's offload takes its device tensors to host memory and its prefetch brings them back;
consumers after the gap read the prefetched copy, so the device copy dies with the offload.
A resident's offload/prefetch (``args["resident"]``) asks the engine of the model it belongs to
(``args["model"]``, e.g. ``actor``) to move that part (``args["part"]``, e.g. ``adam``); the engine says
what it can move, and a plan asking for more is an error naming the tensor.
"""
from __future__ import annotations

from typing import Any

import torch

from rollplex.errors import GraphError
from rollplex.tasks.registry import register_task


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples, dataclass-free containers) on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        pin = device.type == "cpu" and torch.cuda.is_available()
        return value.detach().to("cpu").pin_memory() if pin else value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        moved = [to_device(v, device) for v in value]
        return type(value)(moved) if not hasattr(value, "_fields") else type(value)(*moved)
    if hasattr(value, "__dict__") and any(isinstance(v, torch.Tensor) for v in vars(value).values()):
        twin = object.__new__(type(value))
        twin.__dict__.update({k: to_device(v, device) for k, v in vars(value).items()})
        return twin
    return value


def _resident_engine(ctx, node) -> tuple[Any, str]:
    tensor, model, part = node.args["tensor"], node.args["model"], node.args["part"]
    engine = ctx.host.engines.get(model)
    if engine is None or not hasattr(engine, "offload"):
        raise GraphError(f"%{node.name}: the memory plan moves {tensor!r}, but this worker has no engine for "
                         f"model {model!r} that can move it (engines: {', '.join(sorted(ctx.host.engines))})")
    return engine, part


def _move(ctx, node, inputs, to_host: bool) -> dict[str, Any]:
    if node.args.get("resident"):
        engine, part = _resident_engine(ctx, node)
        (engine.offload if to_host else engine.reload)(part)
        return {}
    (src,), (dst,) = node.inputs, node.outputs
    return {dst: to_device(inputs[src], torch.device("cpu") if to_host else ctx.host.device)}


@register_task("offload")
def offload(ctx, node, inputs):
    return _move(ctx, node, inputs, to_host=True)


@register_task("prefetch")
def prefetch(ctx, node, inputs):
    return _move(ctx, node, inputs, to_host=False)
