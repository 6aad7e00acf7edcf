"""SM partitions of one GPU for decode beside compute work, re-chosen at every decode chunk.

ROLLPLEX.md's probe on an H200: a small-batch decode (B ≤ 32) keeps its HBM bandwidth on 32–64 of
the 132 SMs, and up to 70% of a prefill then runs hidden beside it; at B = 128 nothing hides. So the
split follows the live decode batch: the fewer rows decode, the fewer SMs it keeps and the more the
compute stream gets. The split is chosen when a decode chunk starts (within a chunk the batch only
shrinks), and compute work started during that chunk takes the complement.

Each split is a pair of CUDA green contexts with a stream each (``make``); a decode engine captures
its CUDA graphs per stream, so each split has graphs of its own. Where the engine times each graph
as it captures it (``step_seconds_on``), the split is chosen from those timings instead of the
table: the fewest decode SMs that step within ``tolerance`` of the widest split. Alone, each stream
still runs on the whole GPU (``WorkerHost.on_stream`` asks for a partition only while the other
stream is busy).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

@dataclass(frozen=True)
class WindowSharing:
    """How work beside decode shares the GPU with it, as the worker host reads it. A run's config sets
    ``partitions`` (``cluster.sm_partitions``, under the rollplex schedule); a bench policy's options
    set any field, so variants compare under one runtime rather than through knobs of their own."""

    partitions: bool = False  # SM partitions (green contexts) while both GPU streams are busy
    decode_sms: int = 0  # decode's SMs then; 0: re-chosen per chunk from the live batch
    # Compute's SMs then; 0: the GPU's less decode's. Set alone, decode keeps the whole GPU and only
    # compute is fenced in, so a decode kernel always finds SMs that no compute tile holds.
    compute_sms: int = 0
    sm_target: bool = True  # a partition's matmuls target its SMs (sm_target)
    grad_on_partition: bool = False  # forwards kept for a backward may take a partition (on_stream)
    prefill_gate: bool = True  # prefix and scoring work wait out decode's prefill (wait_for_prefill)
    # Prefix work joins the decode window only once decode is light (at most this many live rows):
    # heavy decode leaves little idle compute, and sharing SMs then slows it more than the hidden
    # prefix saves. 0 disables the gate.
    gate_rows: int = 0
    # Without partitions: while decode runs, compute's matmuls leave this many SMs free (cuBLASLt's
    # SM target). cuBLAS sizes a Hopper matmul's grid to every SM and its CTAs fill an SM's shared
    # memory, so a decode kernel launched beside it waits for whole tiles to finish; decode's own
    # kernels still run on any SM. 0: none spared.
    compute_spare: int = 0
    # The interpreter's thread switch interval in the worker's process, µs (0: Python's 5,000): how long
    # a compute thread running eager Python may hold the GIL that the decode thread wants back after
    # each graph launch, while a decode step is ~3-4 ms of GPU time.
    switch_interval_us: int = 0


def compute_sms(window: WindowSharing, decode_busy: bool, total: int) -> int | None:
    """SMs that compute's matmuls target on plain streams: all but ``compute_spare`` while decode
    runs, else None (no target)."""
    if not decode_busy or not window.compute_spare or not total:
        return None
    return max(1, total - window.compute_spare)


# (live decode rows at most, SMs decode keeps); the last row (None) covers any batch.
AUTO_SPLITS: tuple[tuple[int | None, int], ...] = ((8, 32), (32, 64), (None, 96))


def decode_sms_for(live_rows: int | None, splits=AUTO_SPLITS) -> int:
    """The split for a decode chunk starting with ``live_rows`` rows. None (nothing admitted yet, as
    at the first chunk, whose prefill admits the whole batch) gets the widest decode share."""
    if live_rows:
        for rows, sms in splits:
            if rows is None or live_rows <= rows:
                return sms
    return splits[-1][1]


def fewest_sms_within(measured: dict[int, dict[int, float]], live_rows: int, tolerance: float) -> int:
    """The fewest decode SMs whose measured step, for the graph that holds ``live_rows`` rows, is at
    most (1 + tolerance) times the fastest split's: the rest of the GPU goes to compute work."""
    def step(sms: int) -> float:
        sizes = measured[sms]
        fits = [n for n in sizes if n >= live_rows]
        return sizes[min(fits)] if fits else sizes[max(sizes)]

    fastest = min(step(sms) for sms in measured)
    return min(sms for sms in measured if step(sms) <= (1 + tolerance) * fastest)


@dataclass
class Partitions:
    """``streams[decode_sms] = {"decode": stream, "compute": stream}``, one entry per split."""

    streams: dict[int, dict[str, Any]]
    splits: tuple[tuple[int | None, int], ...] = AUTO_SPLITS
    current: int | None = None  # the decode SMs chosen at the last decode chunk's start
    total_sms: int = 0  # the GPU's; a partition's matmuls target their share of it (sm_target)
    # decode SMs -> {graph batch size: seconds per decode step}, timed by the decode engine on each
    # split's stream when it captured its graphs (WorkerHost.use_partitions). With it, the split is
    # chosen from measurements instead of the AUTO_SPLITS table.
    measured: dict[int, dict[int, float]] = field(default_factory=dict)
    tolerance: float = 0.10  # decode may step this much slower than on the widest split

    def choose(self, live_rows: int | None) -> int:
        """Called as a decode chunk starts. With one split (a fixed ``--decode-sms``) it is that one."""
        if len(self.streams) == 1:
            self.current = next(iter(self.streams))
        elif live_rows and set(self.measured) >= set(self.streams):
            self.current = fewest_sms_within(self.measured, live_rows, self.tolerance)
        else:
            self.current = decode_sms_for(live_rows, self.splits)
        return self.current

    def stream(self, name: str) -> Any:
        if self.current is None:
            self.choose(None)
        return self.streams[self.current][name]

    def decode_streams(self) -> list[tuple[Any, int]]:
        """(decode stream, its SMs) of every split: a decode engine captures its graphs on each."""
        return [(pair["decode"], pair.get("decode_sms", sms)) for sms, pair in self.streams.items()]

    def sms_of(self, name: str) -> int | None:
        """SMs of the named stream's partition in the current split (a trace records it per node)."""
        split = self.streams.get(self.current) if self.current is not None else None
        return split.get(f"{name}_sms", self.current if name == "decode" else None) if split else None


def _immortal(context):
    """Keep a green context until the process ends. A tensor used on a context's stream records an
    event there when it is freed; once the context is destroyed that record aborts the process
    (``cudaErrorContextIsDestroyed``), and such tensors can outlive any owner we could name (a
    finished test's engines, interpreter shutdown). A handful per process; the driver frees them."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(context))
    return context


def split_sizes(total: int, decode_sms: int = 0, compute_sms: int = 0) -> list[tuple[int, int]]:
    """(decode SMs, compute SMs) of each split. Without ``compute_sms`` the two are disjoint and fill
    the GPU: the one split ``decode_sms`` names, or with 0 one per row of ``AUTO_SPLITS``. With it,
    compute gets that many and decode its named share, or all ``total`` SMs where none is named (the
    partitions then overlap)."""
    if compute_sms:
        return [(min(decode_sms or total, total), min(compute_sms, total))]
    if decode_sms:
        return [(decode_sms, total - decode_sms)]
    return [(sms, total - sms) for _, sms in AUTO_SPLITS]


def make(device_index: int, decode_sms: int = 0, compute_sms: int = 0) -> Partitions | None:
    """Green-context streams for each split (``split_sizes``), or None where the torch build or driver
    has none."""
    import torch

    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError:
        return None
    total = torch.cuda.get_device_properties(device_index).multi_processor_count
    try:
        streams: dict[int, dict[str, Any]] = {}
        for sms, rest in split_sizes(total, decode_sms, compute_sms):
            pair = {}
            for name, n in (("decode", sms), ("compute", rest)):
                ctx = GreenContext.create(num_sms=n, device_id=device_index)
                if hasattr(ctx, "Stream"):
                    pair[name] = ctx.Stream()
                else:  # torch 2.10/2.11: make the context current, create a stream in it, pop it
                    with torch.cuda.device(device_index):
                        ctx.set_context()
                        pair[name] = torch.cuda.Stream()
                        ctx.pop_context()
                pair[f"{name}_context"] = _immortal(ctx)
                pair[f"{name}_sms"] = n
            streams[sms] = pair
        return Partitions(streams, total_sms=total)
    except Exception as exc:  # noqa: BLE001 - a driver or build without green contexts: plain streams
        print(f"green contexts unavailable ({type(exc).__name__}: {exc}); plain streams")
        return None


# cuBLAS sizes a matmul's grid for the whole GPU. On a green context with a third of the SMs, such a
# kernel runs in several waves, and a stream-K kernel's CTAs may wait on CTAs that cannot be resident.
# ROLLPLEX.md's probe therefore ran matmuls through cuBLASLt with an SM-count target. Both settings
# are process-wide in torch, so they are counted: set while any partitioned node runs, restored after.
_target_lock = threading.Lock()
_target_users = 0
_target_saved: tuple[Any, Any] | None = None


@contextmanager
def sm_target(sms: int | None, total: int):
    """Matmuls launched in the body target ``sms`` of the GPU's ``total`` SMs (None: no change)."""
    global _target_users, _target_saved
    if not sms or sms >= total:
        yield
        return
    import torch

    with _target_lock:
        if _target_users == 0:
            _target_saved = (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental())
            if torch.cuda.is_available():  # a CPU build has no cuBLASLt to prefer
                torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(total - sms)
        _target_users += 1
    try:
        yield
    finally:
        with _target_lock:
            _target_users -= 1
            if _target_users == 0 and _target_saved is not None:
                library, carveout = _target_saved
                if torch.cuda.is_available():
                    torch.backends.cuda.preferred_blas_library(library)
                torch._C._set_sm_carveout_experimental(carveout)
