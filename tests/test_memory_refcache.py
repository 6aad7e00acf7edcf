"""The cross-iteration reference-prefix cache: content keys, LRU by bytes with disk spill, batched
lookup, statistics. CPU only, tiny tensors."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rollplex.errors import ConfigError
from rollplex.pipeline.run.refcache import RefPrefixCache, prompt_digest, tensor_nbytes, weights_digest
from reliability_harness import run_concurrently


@dataclass
class Prompt:  # the fields a prefix forward reads (tasks.lm.PromptInputs has these and more)
    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    prompt_id: str = "p"


@dataclass
class State:  # shaped like tasks.lm.PrefixState
    kv: list
    last_logits: torch.Tensor
    rope_delta: int
    length: int


def prompt(seed: int, pixels: float = 0.0) -> Prompt:
    g = torch.Generator().manual_seed(seed)
    return Prompt(torch.randint(0, 100, (6,), generator=g), torch.full((4, 3), pixels), torch.tensor([[1, 2, 2]]))


def state(value: float) -> State:
    return State([(torch.full((1, 2, 6, 4), value), torch.full((1, 2, 6, 4), -value))], torch.full((10,), value), 3, 6)


def make(capacity=1 << 20, **kw) -> RefPrefixCache:
    cache = RefPrefixCache(capacity, **kw)
    cache.register("ref", {"w": torch.ones(3)})
    return cache


def test_keys_follow_content_and_weights_not_ids():
    a, b = prompt(0), prompt(0)
    b.prompt_id = "another id"
    assert prompt_digest(a) == prompt_digest(b)
    assert prompt_digest(a) != prompt_digest(prompt(0, pixels=1.0))  # a different image
    assert prompt_digest(a) != prompt_digest(prompt(1))  # different text
    cache = make()
    other = RefPrefixCache()
    other.register("ref", {"w": torch.ones(3) * 2})  # other reference weights
    assert cache.key("ref", a) == cache.key("ref", b) != other.key("ref", a)
    assert weights_digest(torch.nn.Linear(2, 2).requires_grad_(False)) != weights_digest({"w": torch.ones(3)})
    with pytest.raises(ConfigError, match="model 'actor' is not registered; registered: ref"):
        cache.key("actor", a)


def test_a_second_epoch_hits_and_reports_rate_and_bytes():
    cache = make()
    calls = []

    def compute(prompts, visions):
        calls.append(len(prompts))
        return [state(float(p.input_ids[0])) for p in prompts]

    prompts = [prompt(i) for i in range(4)]
    first = cache.lookup_or_compute("ref", prompts, [None] * 4, compute)
    second = cache.lookup_or_compute("ref", prompts[::-1] + [prompt(9)], [None] * 5, compute)
    assert calls == [4, 1]  # only the new prompt is computed, in one batch
    assert torch.equal(second[0].last_logits, first[3].last_logits) and second[0].rope_delta == 3
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.puts) == (4, 5, 5)
    assert stats.hit_rate == pytest.approx(4 / 9)
    assert stats.host_bytes == 5 * tensor_nbytes(state(0.0))
    assert "hit rate 44%" in stats.line()


def test_entries_are_host_copies_and_graphs_are_refused():
    cache = make()
    s = state(1.0)
    cache.put("k", s)
    s.last_logits.add_(5)  # the caller's tensor changes; the cached copy does not
    assert cache.get("k").last_logits[0] == 1.0
    with pytest.raises(ConfigError, match="autograd history cannot be cached"):
        cache.put("g", State([], torch.ones(2, requires_grad=True) * 2, 0, 0))


def test_lru_eviction_by_bytes_spills_to_disk_and_reads_back(tmp_path):
    one = tensor_nbytes(state(0.0))
    cache = make(capacity=2 * one, directory=tmp_path)
    for i in range(3):
        cache.put(f"k{i}", state(float(i)))
    assert cache.stats().evictions == 1 and cache.stats().disk_bytes == one
    back = cache.get("k0")  # the oldest went to disk
    assert back.kv[0][1][0, 0, 0, 0] == -0.0 and cache.stats().disk_hits == 1
    assert not list(tmp_path.glob("*.tmp"))
    no_disk = make(capacity=one)
    no_disk.put("a", state(1.0))
    no_disk.put("b", state(2.0))
    assert no_disk.get("a") is None and no_disk.get("b") is not None


def test_concurrent_lookups_are_safe():
    cache = make(capacity=1 << 30)
    prompts = [prompt(i) for i in range(16)]

    def worker():
        for _ in range(5):
            cache.lookup_or_compute("ref", prompts, [None] * 16, lambda ps, vs: [state(1.0) for _ in ps])

    run_concurrently(*[worker] * 4)  # raises the first error any thread met
    assert cache.stats().host_bytes == 16 * tensor_nbytes(state(1.0))
