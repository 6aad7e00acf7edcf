"""Process environment for the engines, set before vLLM, torch threads or DeepSpeed start.

Everything here is a default (``setdefault``): a user's own environment wins.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ROLLPLEX_CACHE", Path.home() / ".cache" / "rollplex"))


def configure(threads: int | None = None, device: str | None = None) -> None:
    root = cache_root()
    # vLLM in-process: faster to start, no spawn guard needed, and the engine object can live in a
    # Dask worker's memory. It replaces torch.set_num_threads with a no-op, so threads come from OMP.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch_extensions"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_DYNAMIC", "false")  # fixed team sizes keep CPU reductions reproducible
    if threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed otherwise probes and warns
    quiet()


def quiet() -> None:
    """Keep the console to Rollplex's own lines. vLLM warns on every decode step on CPU (its
    set_num_threads shim), and transformers/DeepSpeed draw progress bars for tiny loads; errors
    still show. ROLLPLEX_VERBOSE=1 keeps everything."""
    if os.environ.get("ROLLPLEX_VERBOSE"):
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("DS_LOG_LEVEL", "error")
    for name in ("distributed", "deepspeed", "DeepSpeed", "torch.distributed", "vllm"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(vllm|torch|deepspeed|transformers)\b")


ALLOCATOR_BACKENDS = {"native": "native", "async": "cudaMallocAsync"}


def request_cuda_allocator(choice: str, field: str = "cluster.cuda_allocator") -> None:
    """Ask for torch's CUDA allocator backend. torch reads PYTORCH_CUDA_ALLOC_CONF's backend once, as
    it loads, so "async" is set here for this process (before torch loads) and the workers it starts;
    once torch is loaded with another backend it cannot be honoured, and that is an error. "native"
    changes nothing: a backend the user's environment names still wins."""
    from rollplex.errors import ConfigError

    if choice not in ALLOCATOR_BACKENDS:
        raise ConfigError(f"{field}: {choice!r} is not one of {', '.join(ALLOCATOR_BACKENDS)}")
    if choice == "native":
        return
    if "torch" not in sys.modules:
        kept = [e for e in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if e and not e.startswith("backend:")]
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(["backend:cudaMallocAsync", *kept])
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.get_allocator_backend() != ALLOCATOR_BACKENDS[choice]:
        raise ConfigError(f"{field}: {choice!r} asks for the {ALLOCATOR_BACKENDS[choice]} allocator, but torch "
                          f"loaded with {torch.cuda.get_allocator_backend()!r}; set it before torch loads "
                          f"(the rollplex command does), or PYTORCH_CUDA_ALLOC_CONF")
