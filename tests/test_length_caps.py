"""rollout.length_caps: `rollplex train` on the bench's long-tailed response lengths.

Random-weight models never stop on their own, so without caps every response runs to
max_new_tokens and no group finishes before another. With caps each prompt's samples stop at
lengths drawn once per prompt (log-normal around ``mean``), the same in every iteration.
"""
from __future__ import annotations

import json
import re
import statistics

import pytest

from rollplex.config import load_config
from rollplex.errors import ConfigError
from rollplex.pipeline.run.runner import train
from rollplex.pipeline.run.worker import IterationSettings
from rollplex.tasks.nodes import length_caps


def _settings(mean: float, sigma: float, cap: int = 1024, samples: int = 8, seed: int = 0) -> IterationSettings:
    return IterationSettings(seed=seed, samples=samples, max_new_tokens=cap, temperature=1.0, top_p=1.0, pad_id=0,
                             stop_token_ids=(), length_caps={"mean": mean, "sigma": sigma})


def test_a_prompts_caps_are_one_draw_within_bounds_around_the_mean():
    s = _settings(96, 0.8)
    assert length_caps(s, "p0") == length_caps(s, "p0")  # the same workload every iteration
    assert length_caps(s, "p0") != length_caps(s, "p1")
    assert length_caps(s, "p0") != length_caps(_settings(96, 0.8, seed=1), "p0")
    drawn = [c for i in range(500) for c in length_caps(s, f"p{i}")]
    assert all(1 <= c <= 1024 for c in drawn)
    assert 86 <= statistics.median(drawn) <= 106  # log-normal: the median is the mean parameter
    assert max(drawn) > 500 and min(drawn) < 30  # long-tailed both ways at sigma 0.8
    assert set(length_caps(_settings(96, 0.8, cap=64), "p0")) <= set(range(1, 65))
    assert set(length_caps(_settings(3, 0.0), "p0")) == {3}


@pytest.mark.parametrize("value, says", [
    ({"sigma": 0.5}, "rollout.length_caps.mean: missing"),
    ({"mean": 0}, "rollout.length_caps.mean: 0.0 is not in"),
    ({"mean": 96, "sigma": -1}, "rollout.length_caps.sigma: -1.0 is not in"),
    ({"mean": 96, "sigmma": 1}, "unknown field rollout.length_caps.sigmma"),
    ({"mean": "long"}, "rollout.length_caps.mean"),
    (96, "rollout.length_caps: expected dict, got int 96"),
])
def test_bad_caps_name_the_field(value, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(None, [f"rollout.length_caps={json.dumps(value)}"])


def test_caps_are_single_turn():
    with pytest.raises(ConfigError, match="rollout.length_caps: caps single-turn responses; rollout.max_turns is 2"):
        load_config(None, ["rollout.length_caps={mean: 4}", "rollout.max_turns=2", "task.name=zoom"])


@pytest.mark.slow
def test_a_run_with_caps_stops_each_sample_at_its_cap(tmp_path):
    """Responses of the untrained default model, which rarely stops before 8 tokens, end at their
    prompt's caps: every logged response at most its cap, and the batch's mean length that of the caps."""
    overrides = ["iterations=2", "seed=3", "warmup.steps=0", "stop_at_reward=null", "engines.train=torch",
                 "engines.decode=hf", "rollout.max_new_tokens=8", "rollout.chunk_tokens=2",
                 "rollout.prompts_per_iteration=4", "rollout.samples_per_prompt=4"]
    plain = tmp_path / "plain"
    train(load_config(None, overrides), plain, progress=False, log=lambda *a: None)
    capped = tmp_path / "capped"
    cfg = load_config(None, [*overrides, "rollout.length_caps={mean: 3, sigma: 0.6}"])
    train(cfg, capped, progress=False, log=lambda *a: None)

    def lengths(run):  # {(iteration file, prompt): its samples' response lengths}
        out: dict = {}
        for path in sorted((run / "rollouts").glob("iter_*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                out.setdefault((path.name, row["prompt_id"]), []).append(len(row["response_token_ids"]))
        return out

    free, short = lengths(plain), lengths(capped)
    assert statistics.mean(n for v in free.values() for n in v) > 6
    settings = _settings(3, 0.6, cap=8, samples=4, seed=3)
    for (_, prompt_id), got in short.items():
        assert all(n <= cap for n, cap in zip(sorted(got), sorted(length_caps(settings, prompt_id))))
    assert statistics.mean(n for v in short.values() for n in v) < 5
