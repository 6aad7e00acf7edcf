"""Cross-iteration reference-prefix cache.

The reference model never changes, so its prefix KV and last-position logits for a prompt are the
same in every epoch. A worker keeps them in host memory (and, past a byte budget, on local disk),
keyed by a content hash of the prompt (token ids, image and video pixels, grids, frame timing) and
of the reference weights, so a second epoch loads them instead of recomputing them.

Hook (a frozen model's ``prefix`` task)::

    cache = ctx.refcache                                  # None when disabled
    if cache is not None and not node.args["grad"]:
        states = cache.lookup_or_compute(node.model, prompts, visions,
                                         lambda ps, vs: lm.prefix_forward_batch(model, ps, vs, grad=False))
    else:
        states = lm.prefix_forward_batch(model, prompts, visions, grad=bool(node.args["grad"]))

with, once per worker, ``cache = RefPrefixCache(...); cache.register("ref", ref_model)``.
Entries are CPU copies; ``get`` returns them on the device of the hit's first use. Only values
without autograd history can be cached (a graph kept for a backward is per iteration).
Disk files are written atomically with ``torch.save`` and read back with ``weights_only=False``:
only files this cache wrote itself, in a directory it owns.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollplex.errors import ConfigError

GiB = 1024**3
KEY_VERSION = b"rollplex.refcache/1"
PROMPT_FIELDS = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                 "second_per_grid_ts")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _feed(h, t: torch.Tensor) -> None:
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(_tensor_bytes(t))


def weights_digest(model: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """Hash of every parameter and buffer (name, dtype, shape, bytes), in name order. Reads all the
    weights once (about a minute for 60 GB); call it once per worker."""
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        h.update(name.encode() + b"\0")
        _feed(h, state[name])
    return h.hexdigest()


def prompt_digest(prompt: Any) -> str:
    """Hash of what a prefix forward reads from a prompt; the prompt id is not part of it. A prompt
    built from a task's item says what it holds (``meta["content"]``: the task's identity and the
    item, tasks.data.PromptStore), which spares hashing its pixels at every use."""
    content = getattr(prompt, "meta", {}).get("content")
    if content:
        return hashlib.blake2b(b"item|" + content.encode(), digest_size=16).hexdigest()
    h = hashlib.blake2b(digest_size=16)
    for name in PROMPT_FIELDS:
        value = getattr(prompt, name, None)
        h.update(name.encode() + b"=")
        if value is None:
            h.update(b"none;")
        elif isinstance(value, torch.Tensor):
            _feed(h, value)
        else:
            raise ConfigError(f"refcache: prompt field {name} is a {type(value).__name__}, expected a tensor")
    return h.hexdigest()


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` with every tensor inside (dataclasses, lists, tuples, dicts) replaced by ``fn(tensor)``."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: map_tensors(getattr(x, f.name), fn) for f in dataclasses.fields(x)
                                         if f.init})
    if isinstance(x, (list, tuple)):
        return type(x)(map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    return x


def tensor_nbytes(x: Any) -> int:
    total = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    map_tensors(x, count)
    return total


@dataclass(frozen=True)
class CacheStats:
    hits: int
    disk_hits: int
    misses: int
    puts: int
    evictions: int
    host_bytes: int
    disk_bytes: int

    @property
    def hit_rate(self) -> float:
        looked = self.hits + self.disk_hits + self.misses
        return (self.hits + self.disk_hits) / looked if looked else 0.0

    def line(self) -> str:
        return (f"refcache: hit rate {self.hit_rate:.0%} ({self.hits} host + {self.disk_hits} disk hits, "
                f"{self.misses} misses), {self.host_bytes / GiB:.2f} GiB in host memory, "
                f"{self.disk_bytes / GiB:.2f} GiB on disk, {self.evictions} evicted")


class RefPrefixCache:
    """LRU by bytes in host memory; entries evicted from host spill to ``directory`` when given."""

    def __init__(self, capacity_bytes: int = 64 * GiB, directory: str | os.PathLike | None = None,
                 disk_capacity_bytes: int | None = None) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"refcache: capacity_bytes must be ≥ 0, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.directory = Path(directory) if directory is not None else None
        self.disk_capacity = disk_capacity_bytes
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._host: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._disk: OrderedDict[str, int] = OrderedDict()
        self._digests: dict[str, str] = {}
        self._lock = threading.Lock()
        self._n = dict(hits=0, disk_hits=0, misses=0, puts=0, evictions=0)

    # -- keys ------------------------------------------------------------------------------------
    def register(self, model_name: str, weights: torch.nn.Module | dict | str) -> str:
        """Name a frozen model's weights (a module, a state dict, or a digest computed elsewhere)."""
        digest = weights if isinstance(weights, str) else weights_digest(weights)
        self._digests[model_name] = digest
        return digest

    def key(self, model_name: str, prompt: Any) -> str:
        if model_name not in self._digests:
            raise ConfigError(f"refcache: model {model_name!r} is not registered; registered: "
                              f"{', '.join(sorted(self._digests)) or 'none'} (call register first)")
        h = hashlib.blake2b(KEY_VERSION, digest_size=20)
        h.update(self._digests[model_name].encode() + b"|" + prompt_digest(prompt).encode())
        return h.hexdigest()

    # -- entries ---------------------------------------------------------------------------------
    def get(self, key: str, device: torch.device | str | None = None) -> Any | None:
        with self._lock:
            entry = self._host.get(key)
            if entry is not None:
                self._host.move_to_end(key)
                self._n["hits"] += 1
                value = entry[0]
            elif key in self._disk:
                value = None
            else:
                self._n["misses"] += 1
                return None
        if value is None:  # read outside the lock: disk is slow
            value = torch.load(self.directory / f"{key}.pt", weights_only=False)
            with self._lock:
                self._n["disk_hits"] += 1
                self._insert(key, value, tensor_nbytes(value))
        return value if device is None else map_tensors(value, lambda t: t.to(device, non_blocking=True))

    def put(self, key: str, value: Any) -> None:
        def to_host(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                raise ConfigError("refcache: a value with autograd history cannot be cached (grad prefixes are "
                                  "per iteration); compute it with grad=False")
            return t.detach().to("cpu", copy=True)
        host = map_tensors(value, to_host)
        with self._lock:
            self._n["puts"] += 1
            self._insert(key, host, tensor_nbytes(host))

    def _insert(self, key: str, value: Any, nbytes: int) -> None:
        old = self._host.pop(key, None)
        self._host[key] = (value, nbytes)
        del old
        while self._host and self._host_bytes() > self.capacity:
            victim, (vvalue, vbytes) = self._host.popitem(last=False)
            self._n["evictions"] += 1
            if self.directory is not None and victim not in self._disk:
                self._spill(victim, vvalue, vbytes)

    def _spill(self, key: str, value: Any, nbytes: int) -> None:
        if self.disk_capacity is not None:
            while self._disk and sum(self._disk.values()) + nbytes > self.disk_capacity:
                old, _ = self._disk.popitem(last=False)
                (self.directory / f"{old}.pt").unlink(missing_ok=True)
            if nbytes > self.disk_capacity:
                return
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
        os.close(fd)
        try:
            torch.save(value, tmp)
            os.replace(tmp, self.directory / f"{key}.pt")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._disk[key] = nbytes

    def _host_bytes(self) -> int:
        return sum(n for _, n in self._host.values())

    def lookup_or_compute(self, model_name: str, prompts: Sequence[Any], visions: Sequence[Any],
                          compute: Callable[[list, list], list], device: torch.device | str | None = None) -> list:
        """Prefix states for ``prompts``: hits from the cache, the misses computed in one call of
        ``compute(prompts, visions)`` and stored. Results are in the order of ``prompts``. A prompt
        the run has not visited before is not looked up, and one it will not visit again is not
        stored (``meta["seen_before"]``/``["seen_again"]``, tasks.data.PromptRef; unknown: both)."""
        meta = [getattr(p, "meta", {}) for p in prompts]
        keys = [self.key(model_name, p) for p in prompts]
        out: list[Any] = [self.get(k, device) if m.get("seen_before", True) else None for k, m in zip(keys, meta)]
        todo = [i for i, v in enumerate(out) if v is None]
        if todo:
            fresh = compute([prompts[i] for i in todo], [visions[i] for i in todo])
            if len(fresh) != len(todo):
                raise ConfigError(f"refcache: compute returned {len(fresh)} states for {len(todo)} prompts")
            for i, state in zip(todo, fresh):
                if meta[i].get("seen_again", True):
                    self.put(keys[i], state)
                out[i] = state
        return out

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._n, host_bytes=self._host_bytes(), disk_bytes=sum(self._disk.values()))
