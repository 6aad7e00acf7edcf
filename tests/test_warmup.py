"""The warm-up's examples are drawn and built on the worker from a seed; only the seed and the step
number cross Dask."""
from __future__ import annotations

import numpy as np
import torch


def _host(tmp_path, name: str):
    from rollplex.config import load_config
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.run.worker import WorkerHost

    cfg = load_config(None, ["seed=1", "warmup.steps=3", "engines.decode=hf", "engines.train=torch"])
    session = Session(cfg, tmp_path / name)
    return session, WorkerHost(session.host_spec(), name=name)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x[1] == y[1] and torch.equal(x[0].input_ids, y[0].input_ids) and torch.equal(x[0].pixel_values, y[0].pixel_values)
        for x, y in zip(a, b))


def test_each_step_draws_what_one_generator_draws_and_a_fresh_host_catches_up(tmp_path):
    from rollplex.pipeline.run.hostops import _warmup_examples
    from rollplex.tasks.data import format_warmup_batch

    session, first = _host(tmp_path, "first")
    _, fresh = _host(tmp_path, "fresh")
    try:
        rng = np.random.default_rng([1, 7919])
        expected = [format_warmup_batch(session.task, session.builder, rng, 4) for _ in range(3)]
        steps = [_warmup_examples(first, [1, 7919], step, 4) for step in range(3)]
        assert all(_same(a, b) for a, b in zip(steps, expected))
        assert not _same(steps[1], steps[2])
        # A worker that replaced a lost one mid-warm-up draws steps 0 and 1 again, then step 2.
        assert _same(_warmup_examples(fresh, [1, 7919], 2, 4), expected[2])
        # A new warm-up (step 0 again) starts the draws over.
        assert _same(_warmup_examples(first, [1, 7919], 0, 4), expected[0])
    finally:
        first.close()
        fresh.close()
