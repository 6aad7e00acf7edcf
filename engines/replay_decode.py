"""Replay: a decode engine that returns recorded responses instead of sampling.

Two schedules of the same iteration must compute the same update. On a GPU they may not sample the
same responses: bf16 kernels on another SM partition round differently and flip a sample, and then
everything downstream differs. Recording one run's rollout (``Recorder`` around any decode engine) and
replaying it (``ReplayDecodeEngine``) holds the rollout fixed, so what is compared is the scoring,
the loss and the update, to bf16/fp32 tolerance. Also useful to re-train on a logged rollout.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from rollplex.engines.base import DecodeEngine, DecodeRequest, EngineContext, EngineSpec, FinishedSequence, \
    register_engine
from rollplex.errors import EngineError

Key = tuple[str, int]  # (request id, sample index)


class Recorder(DecodeEngine):
    """Any decode engine, with every finished sequence kept in ``recorded``."""

    def __init__(self, inner: DecodeEngine) -> None:
        self.inner = inner
        self.recorded: dict[Key, FinishedSequence] = {}

    def add_requests(self, requests: Sequence[DecodeRequest]) -> None:
        self.inner.add_requests(requests)

    def step(self, max_tokens: int) -> list[FinishedSequence]:
        done = self.inner.step(max_tokens)
        for seq in done:
            self.recorded[(seq.request_id, seq.index)] = seq
        return done

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.inner.load_weights(named_tensors)

    def __getattr__(self, name: str):  # counters and options of the engine it wraps
        return getattr(self.inner, name)


class ReplayDecodeEngine(DecodeEngine):
    """Returns ``recorded[(request_id, index)]`` for each requested sample, on the step in which a
    sampling engine would have finished it (after as many tokens as it has), so that decode chunks
    hand on the same groups as in the recorded run (stage fusion scores them in the same batches)."""

    def __init__(self, recorded: Mapping[Key, FinishedSequence]) -> None:
        self.recorded = dict(recorded)
        self._queue: list[Key] = []
        self._tokens = 0  # tokens every live sequence has advanced since the requests came

    def add_requests(self, requests: Sequence[DecodeRequest]) -> None:
        for r in requests:
            for i in range(r.n):
                if (r.request_id, i) not in self.recorded:
                    raise EngineError(f"replay: no recorded response for request {r.request_id!r} sample {i} "
                                      f"({len(self.recorded)} recorded)")
                self._queue.append((r.request_id, i))
        self._tokens = 0

    def step(self, max_tokens: int) -> list[FinishedSequence]:
        self._tokens += max_tokens
        done = [k for k in self._queue if len(self.recorded[k].token_ids) <= self._tokens]
        self._queue = [k for k in self._queue if len(self.recorded[k].token_ids) > self._tokens]
        return [self.recorded[k] for k in done]

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:  # the rollout is fixed; the weights only have to be consumed
            pass


def _factory(ctx: EngineContext) -> ReplayDecodeEngine:
    recorded = ctx.options.get("recorded")
    if recorded is None:
        raise EngineError("replay decode engine: options['recorded'] must map (request id, sample) to a "
                          "FinishedSequence (record one with engines.replay_decode.Recorder)")
    return ReplayDecodeEngine(recorded)


SPEC = register_engine(EngineSpec(
    name="replay",
    role="decode",
    factory=_factory,
    description="returns recorded responses (compares schedules on a fixed rollout; re-trains on logged ones)",
))
