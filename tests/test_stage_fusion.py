"""Stage fusion: a frozen model scores the groups each decode chunk finished while decode goes on.

The graph: one suffix node per decode chunk for each frozen score, fed by that chunk's hand-off,
and a join that restores the per-prompt names. The decode task: a group is handed on by the chunk
in which its last sample finished, exactly once. End to end, the rollplex runs of test_e2e.py and
test_bench_cpu.py (long-tailed lengths, groups finishing in different chunks) compute the same
update as serial with these nodes in the graph.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollplex.dags.grpo import grpo
from rollplex.engines.base import FinishedSequence
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
from rollplex.pipeline.plan.schedule import schedule
from rollplex.pipeline.run.worker import IterationSettings
from rollplex.tasks.nodes import decode_chunk, join, request_id

ENGINES = EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"})
DIMS = ModelDims(64, 2, 2, 16, 1000, 10**6, 2)


def _graph(**kw):
    shape = BatchShape(prompts=4, samples=2, max_new_tokens=12, chunk_tokens=4, micro_batch_groups=2, **kw)
    return compile_iteration(grpo, shape, ENGINES, DIMS)


def test_each_chunk_feeds_a_suffix_node_of_the_frozen_model_and_a_join_restores_the_names():
    g = _graph(stage_fusion=True)
    fused = sorted(n.name for n in g if n.kind == "suffix_score" and n.model == "ref")
    assert fused == ["suffix_ref_logprobs_c0", "suffix_ref_logprobs_c1", "suffix_ref_logprobs_c2"]
    for c in range(3):  # chunk c's scoring waits for chunk c, not for the end of the rollout
        assert f"decode_c{c}" in g.g.predecessors(f"suffix_ref_logprobs_c{c}")
        assert "decode_c2" not in g.g.predecessors("suffix_ref_logprobs_c0")
    assert g.values["ref_logprobs_p3"].producer == "join_ref_logprobs"
    trained = [n for n in g if n.kind == "suffix_score" and n.model == "actor"]
    assert len(trained) == 4 and all("handoff_chunk" not in n.args for n in trained)  # graphs kept: per group
    for plan in ("serial", "rollplex"):
        schedule(g, plan).lint()


def test_chunks_past_the_window_are_scored_by_one_node_after_the_last_chunk():
    g = _graph(stage_fusion=True, window_chunks=1)  # 3 chunks: c0 alone, then c1 and c2 together
    fused = sorted(n.name for n in g if n.kind == "suffix_score" and n.model == "ref")
    assert fused == ["suffix_ref_logprobs_c0", "suffix_ref_logprobs_c1"]
    tail = g.nodes["suffix_ref_logprobs_c1"]
    assert [v for v in tail.inputs if v.startswith("finished_")] == ["finished_c1", "finished_c2"]
    assert "decode_c2" in g.g.predecessors("suffix_ref_logprobs_c1")
    assert g.nodes["join_ref_logprobs"].inputs == ("ref_logprobs_c0", "ref_logprobs_c1")
    # Out of range, or under train fusion (whose chunks read their groups' scores), one node per chunk.
    for kw in (dict(window_chunks=2), dict(window_chunks=1, train_fusion=True)):
        names = {n.name for n in _graph(stage_fusion=True, **kw) if n.kind == "suffix_score" and n.model == "ref"}
        assert "suffix_ref_logprobs_c2" in names
    for plan in ("serial", "rollplex"):
        schedule(g, plan).lint()


@pytest.mark.parametrize("kw", [dict(stage_fusion=False), dict(stage_fusion=True, prefix_sharing=False)])
def test_without_fusion_or_prefix_sharing_every_group_waits_for_the_last_chunk(kw):
    g = _graph(**kw)
    assert not g.of_kind("join") and not any(v.startswith("handoff_") for v in g.values)
    assert BatchShape(prompts=1, samples=1, max_new_tokens=4, chunk_tokens=4, stage_fusion=True).fused is False


class _Engine:
    """Sample g of prompt p finishes at step ``lengths[p][g]``; one step per token."""

    def __init__(self, lengths):
        self.lengths, self.t, self.live = lengths, 0, []

    def add_requests(self, requests):
        self.live = [(r.request_id, i) for r in requests for i in range(r.n)]

    def step(self, max_tokens):
        start, self.t = self.t, self.t + max_tokens
        done = []
        for rid, i in list(self.live):
            p = int(rid.rsplit("p", 1)[1])
            if self.lengths[p][i] <= self.t:
                self.live.remove((rid, i))
                done.append(FinishedSequence(rid, [7] * self.lengths[p][i], [0.0] * self.lengths[p][i], "stop", i))
        assert start < self.t
        return done

    def has_unfinished(self):
        return bool(self.live)


def test_a_group_is_handed_on_by_the_chunk_that_finished_its_last_sample_exactly_once():
    """Groups go to training when their last sample finishes; single samples go to the frozen
    models' scoring as soon as each finishes. Each is handed on exactly once."""
    g = _graph(stage_fusion=True)
    lengths = [[2, 3], [2, 9], [5, 12], [1, 1]]  # chunks of 4 tokens: p0, p3 → c0; p1 → c2; p2 → c2
    settings = IterationSettings(seed=0, samples=2, max_new_tokens=12, temperature=1.0, top_p=1.0, pad_id=0,
                                 stop_token_ids=())
    ctx = SimpleNamespace(decode_engine=_Engine(lengths), settings=settings, iteration=0, values=g.values)
    prompt = SimpleNamespace(input_ids=SimpleNamespace(tolist=lambda: [1, 2]), image_grid_thw=None, meta={},
                             prompt_id="x", video_grid_thw=None, second_per_grid_ts=None)
    vis = SimpleNamespace(image=None, video=None)
    inputs = {f"prompt_p{p}": prompt for p in range(4)} | {f"vis_p{p}": vis for p in range(4)}
    handed, samples = {}, {}
    for c in range(3):
        node = g.nodes[f"decode_c{c}"]
        out = decode_chunk(ctx, node, inputs)
        handed[c] = sorted(out[f"handoff_c{c}"])
        samples[c] = {p: sorted(gs) for p, gs in out[f"finished_c{c}"].items()}
        inputs = out
    assert handed == {0: [0, 3], 1: [], 2: [1, 2]}
    assert samples == {0: {0: [0, 1], 1: [0], 3: [0, 1]}, 1: {2: [0]}, 2: {1: [1], 2: [1]}}
    assert [len(t) for t in out["responses_p2"].token_ids] == [5, 12]
    assert request_id(0, 1) == "it0-p1"
    row = lambda n, x: torch.full((n,), float(x))  # noqa: E731
    chunks = {"ref_logprobs_c0": {0: {0: row(2, 1), 1: row(3, 2)}, 1: {0: row(2, 3)}, 3: {0: row(1, 4), 1: row(1, 5)}},
              "ref_logprobs_c1": {2: {0: row(5, 6)}},
              "ref_logprobs_c2": {1: {1: row(9, 7)}, 2: {1: row(12, 8)}}}
    merged = join(None, g.nodes["join_ref_logprobs"], chunks)
    assert merged["ref_logprobs_p1"].shape == (2, 9)  # a group's rows padded to its longest, as unfused
    assert merged["ref_logprobs_p1"][0].tolist() == [3.0] * 2 + [0.0] * 7
    assert merged["ref_logprobs_p1"][1].tolist() == [7.0] * 9
    del chunks["ref_logprobs_c2"][2]
    with pytest.raises(RuntimeError, match="prompts \\[2\\] lack some of their 2 samples' scores"):
        join(None, g.nodes["join_ref_logprobs"], chunks)
