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
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # else a thread posts to stats.vllm.ai: no socket leaves
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


# -- process groups whose sockets stay on the host asked for ----------------------------------------
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        address = ipaddress.ip_address(host.strip("[]"))
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too
    except ValueError:
        return host in LOOPBACK_HOSTS


def _loopback_interface() -> str | None:
    import socket

    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and is_loopback(a.address) for a in addresses):
            return name
    return None


def init_process_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout) -> None:
    """``torch.distributed.init_process_group`` whose sockets listen on ``host`` only. Rank 0 binds the
    store's socket itself and hands it over (``master_listen_fd``): given just an address, torch's store
    listens on every interface. On a loopback host, gloo's and NCCL's sockets take the loopback
    interface too (both otherwise pick the one the host name resolves to); a user's own setting wins."""
    import socket

    import torch.distributed as dist

    host = host.strip("[]")  # an IPv6 address as Dask writes it
    if is_loopback(host) and (interface := _loopback_interface()):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(world_size, 128))
        port = sock.getsockname()[1]
        listen_fd = sock.detach()
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, master_listen_fd=listen_fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def init_local_group(device_type: str) -> None:
    """A one-rank process group on loopback, unless this process has one (a launcher's, the ranks')."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if not dist.is_initialized():
        init_process_group("nccl" if device_type == "cuda" else "gloo", "127.0.0.1", 0, 0, 1, default_pg_timeout)
