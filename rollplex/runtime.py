"""Process environment for the engines, set before vLLM, torch threads or DeepSpeed start.

Everything here is a default (``setdefault``): a user's own environment wins.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ROLLPLEX_CACHE", Path.home() / ".cache" / "rollplex"))


def configure(threads: int | None = None) -> None:
    root = cache_root()
    # vLLM in-process: faster to start, no spawn guard needed, and the engine object can live in a
    # Dask worker's memory. It replaces torch.set_num_threads with a no-op, so threads come from OMP.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch_extensions"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("OMP_DYNAMIC", "false")  # fixed team sizes keep CPU reductions reproducible
    if threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
