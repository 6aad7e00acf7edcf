"""The rollout–trainer mismatch: how far the decode engine's log-probs (π_rollout) are from the
trainer's at rollout time (π_old), and truncated importance sampling (``train.rollout_is``).

No sampling engine computes the trainer's log-probs bit for bit on CPU: hf decodes one token at a time
on a KV cache and takes log_softmax, the trainer scores each response in one packed forward and takes
logit − logsumexp (measured on the embedded model: |Δ| ≤ 9.5e-7, mean 1.9e-7, 60% of tokens unequal;
vLLM's differ too). Where the rollout's log-probs are the trainer's own code, here its old_logprobs
replayed as the decode engine's (the replay engine), the metrics are exactly 0 and the weights exactly
1, so the loss and the update are the unweighted ones bit for bit; where they differ, the loss does.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollplex.engines.base import FinishedSequence
from rollplex.tasks.mismatch import rollout_is_weights
from rollplex.tasks.nodes import Responses

G = 4


def test_the_weights_are_the_truncated_ratio_of_old_to_rollout_probabilities():
    """Δ = log π_old − log π_rollout = 0, log 3, log .5 → ratios 1, 3, .5; capped at 2: 1, 2, .5."""
    responses = Responses(0, [FinishedSequence("r", [5, 6, 7], [-1.0, -2.0, -0.5], "stop")])
    old = torch.tensor([[-1.0, -2.0 + math.log(3), -0.5 + math.log(0.5)]])
    assert torch.allclose(rollout_is_weights(2.0, old, [responses]), torch.tensor([[1.0, 2.0, 0.5]]))
    assert rollout_is_weights(2.0, old[:, :1], [Responses(0, [FinishedSequence("r", [5], [-1.0], "stop")])]).item() == 1.0
    assert torch.equal(rollout_is_weights(None, old, [responses]), torch.ones(1, 3))  # off: all 1
    # Two groups of different lengths, joined right-padded as the loss joins them.
    short = Responses(1, [FinishedSequence("s", [5], [-3.0], "stop")])
    both = torch.tensor([[-1.0, -2.0, -0.5], [-3.0 + math.log(4), 0.0, 0.0]])
    assert torch.allclose(rollout_is_weights(2.0, both, [responses, short]), torch.tensor([[1.0, 1.0, 1.0],
                                                                                          [2.0, 1.0, 1.0]]))


def _replay(rows: list[dict], logprobs_of) -> object:
    """A decode engine that hands back the rows' responses with ``logprobs_of(row)`` as its log-probs
    (rows come in prompt order, G per prompt)."""
    from rollplex.engines.replay_decode import ReplayDecodeEngine
    from rollplex.tasks.nodes import request_id

    recorded = {}
    for i, row in enumerate(rows):
        key = (request_id(0, i // G), row["sample"])
        recorded[key] = FinishedSequence(key[0], list(row["response_token_ids"]), list(logprobs_of(row)), "stop",
                                         row["sample"])
    return ReplayDecodeEngine(recorded)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from rollplex.config import load_config
    from rollplex.pipeline.run.session import Session

    tmp = tmp_path_factory.mktemp("mismatch")
    reward = Path(tmp / "length_reward.py")
    reward.write_text("def reward(text, answer):\n    return float(len(text) % 3) / 2\n")  # varies per sample
    base = ["seed=6", "warmup.steps=0", "stop_at_reward=null", "engines.decode=hf", "engines.train=torch",
            "rollout.prompts_per_iteration=4", f"rollout.samples_per_prompt={G}", "rollout.max_new_tokens=6",
            f"task.reward={reward}:reward"]
    # Serial: under stage fusion the reference scores each decode chunk's samples in batches that the
    # engine's hand-offs decide, so a replay's reference log-probs could differ from hf's by rounding.
    plain = Session(load_config(None, [*base, "schedule=serial"]), tmp / "plain")
    fused = Session(load_config(None, [*base, "schedule=rollplex", "train.train_fusion=true"]), tmp / "fused")
    return SimpleNamespace(plain=plain, fused=fused, batch=plain.loader.next_batch())


def _iteration(session, batch, decode=None, cap=None) -> tuple[dict, dict]:
    """Iteration 0 on fresh engines: its report and the policy's weights after it."""
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.worker import WorkerHost

    spec = session.host_spec()
    spec = dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, rollout_is_cap=cap))
    host = WorkerHost(spec, name="local", decode=decode)
    try:
        report = LocalExecutor(host).run(session.graph, 0, session.graph.feed(batch)).output["report"]
        weights = {k: v.clone() for k, v in host.train_engine("actor").module.state_dict().items()}
    finally:
        host.close()
    return report, weights


@pytest.mark.slow
def test_mismatch_is_zero_where_the_log_probs_are_the_trainers_and_rollout_is_changes_only_where_they_differ(session):
    sampled, sampled_weights = _iteration(session.plain, session.batch)  # hf decode, no reweighting
    rows, metrics = sampled["rows"], sampled["metrics"]
    assert any(r["advantage"] for r in rows)  # a loss with a gradient
    deltas = [o - r for row in rows for o, r in zip(row["old_logprobs"], row["rollout_logprobs"])]
    assert metrics["rollout_logprob_diff"] == pytest.approx(sum(map(abs, deltas)) / len(deltas), rel=1e-5)
    k3 = sum(math.expm1(d) - d for d in deltas) / len(deltas)  # ≈ Δ²/2: e^Δ − 1 would cancel
    assert metrics["rollout_kl_k3"] == pytest.approx(k3, rel=1e-6) and k3 > 0
    assert metrics["rollout_logprob_diff"] > 0  # hf and the trainer are not the same code

    # The trainer's own log-probs as the rollout's: no mismatch, weights 1, the same loss and update.
    same, same_weights = _iteration(session.plain, session.batch, _replay(rows, lambda r: r["old_logprobs"]), cap=2.0)
    assert same["metrics"]["rollout_logprob_diff"] == 0.0 and same["metrics"]["rollout_kl_k3"] == 0.0
    assert same["metrics"]["rollout_is_weight"] == 1.0
    assert same["metrics"]["loss"] == metrics["loss"] and same["metrics"]["grad_norm"] == metrics["grad_norm"]
    assert all(torch.equal(sampled_weights[k], same_weights[k]) for k in sampled_weights)

    # hf's own log-probs, reweighted: the gradient moves with the tokens whose log-probs differ. (Every
    # response runs to the length cap, so the group-normalised token-mean loss is 0 up to rounding,
    # while its gradient is not: the gradient norm, logged before clipping, tells the updates apart.)
    natural, natural_weights = _iteration(session.plain, session.batch,
                                          _replay(rows, lambda r: r["rollout_logprobs"]), cap=2.0)
    assert natural["metrics"]["rollout_logprob_diff"] == metrics["rollout_logprob_diff"]
    assert natural["metrics"]["grad_norm"] != metrics["grad_norm"]
    assert any(not torch.equal(sampled_weights[k], natural_weights[k]) for k in sampled_weights)

    # π_rollout e times lower everywhere: every ratio is above e, every weight the cap 2, the gradient twice.
    lower = _replay(rows, lambda r: [x - 1.0 for x in r["old_logprobs"]])
    shifted, _ = _iteration(session.plain, session.batch, lower, cap=2.0)
    assert shifted["metrics"]["rollout_is_weight"] == 2.0
    assert shifted["metrics"]["grad_norm"] == pytest.approx(2 * metrics["grad_norm"], rel=1e-6)
    assert shifted["metrics"]["rollout_logprob_diff"] == pytest.approx(1.0, rel=1e-6)

    # Train fusion weighs each chunk's groups the same way (its gradient summed, normalised at the step).
    lower = _replay(rows, lambda r: [x - 1.0 for x in r["old_logprobs"]])
    fused, _ = _iteration(session.fused, session.batch, lower, cap=2.0)
    assert fused["metrics"]["rollout_is_weight"] == 2.0
    assert fused["metrics"]["grad_norm"] == pytest.approx(2 * metrics["grad_norm"], rel=1e-4)


def test_only_the_policy_loss_reads_the_weights_and_only_beside_the_policys_log_probs():
    from rollplex import Algorithm
    from rollplex.errors import GraphError

    def algorithm(score_grad: bool, advantage_reads: bool):
        alg = Algorithm("weighted")
        alg.policy("actor")
        alg.score("actor", as_="logprobs", grad=score_grad)
        if advantage_reads:
            alg.advantage(scope="group")(lambda rewards, rollout_is_weights: rewards)
        else:
            alg.advantage(scope="group")(lambda rewards: rewards)
        alg.loss(agg="token-mean")(lambda logprobs, advantages, rollout_is_weights: -logprobs * rollout_is_weights)
        return alg

    assert algorithm(True, False).validate().policy_logprobs() == "logprobs"
    with pytest.raises(GraphError, match=r"reads 'rollout_is_weights'.*no score\('actor', grad=True\)"):
        algorithm(False, False).validate()
    with pytest.raises(GraphError, match=r"advantage function .* reads \['rollout_is_weights'\], which nothing"):
        algorithm(True, True).validate()
