"""``train.micro_batch_tokens``: training after decode in token-capped backwards (verl's dynamic batch size).

A micro-batch's loss node runs the policy's prefix and suffix forwards with grad itself, cut once the
responses are known into backwards of at most that many tokens. The graph loses the policy's prefix
and suffix nodes; the update is the uncapped one up to float rounding.
"""
from __future__ import annotations

import json
import re

import networkx as nx
import pytest

from rollplex.config import load_config
from rollplex.dags.grpo import grpo
from rollplex.dags.ppo import ppo
from rollplex.errors import GraphError
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
from rollplex.pipeline.run.runner import train
from rollplex.pipeline.run.session import Session

ENGINES = EngineChoice({"decode": "hf", "train": "torch", "score": "transformers"})
DIMS = ModelDims(64, 2, 2, 16, 1000, 10**6, 2)
OVERRIDES = ["iterations=2", "seed=4", "warmup.steps=10", "stop_at_reward=null", "checkpoint.every=0",
             "engines.train=torch", "engines.decode=hf", "rollout.max_new_tokens=8", "rollout.chunk_tokens=2",
             "rollout.prompts_per_iteration=4", "train.micro_batch_groups=2"]


def _shape(**kw) -> BatchShape:
    return BatchShape(**{**dict(prompts=4, samples=2, max_new_tokens=12, chunk_tokens=4, micro_batch_groups=2), **kw})


def test_the_loss_node_makes_the_policys_forwards_and_its_old_log_probs():
    capped = compile_iteration(grpo, _shape(micro_batch_tokens=512), ENGINES, DIMS)
    plain = compile_iteration(grpo, _shape(), ENGINES, DIMS)
    policy_forwards = {n.name for n in plain if n.model == "actor" and n.kind in ("prefix", "suffix_score")}
    assert policy_forwards and not {n.name for n in capped if n.model == "actor" and n.kind in ("prefix", "suffix_score")}
    loss = capped.nodes["loss_m1"]
    assert loss.args["micro_batch_tokens"] == 512 and loss.args["prompts"] == [2, 3] and loss.args["as"] == "logprobs"
    assert {"prompt_p2", "vis_p3", "ref_logprobs_p2", "advantages_p3"} <= set(loss.inputs)
    assert "logprobs_p2" not in loss.inputs and "old_logprobs_p2" not in loss.inputs
    assert list(loss.outputs) == ["loss_m1", "old_logprobs_p2", "old_logprobs_p3"]
    assert capped.values["old_logprobs_p3"].producer == "loss_m1"
    # The reference still scores in nodes of its own, and the micro-batches accumulate in order.
    assert {"prefix_ref_p0", "suffix_ref_logprobs_p3"} <= set(capped.nodes)
    assert "loss_m0" in nx.ancestors(capped.g, "loss_m1")


@pytest.mark.parametrize("alg, kw, why", [
    (ppo, {}, "trains ['actor', 'critic']"),
    (grpo, {"mini_batches": 2}, "2 optimizer steps"),
    (grpo, {"prefix_sharing": False}, "prefix sharing"),
    (grpo, {"trains_vision": True}, "vision tower trains"),
])
def test_what_cannot_train_in_capped_backwards_is_named(alg, kw, why):
    with pytest.raises(GraphError, match=f"train.micro_batch_tokens: .*{re.escape(why)}"):
        compile_iteration(alg, _shape(micro_batch_tokens=512, **kw), ENGINES, DIMS)


def test_the_bench_names_the_cap_mt():
    from rollplex.pipeline.bench.results import policy_shape

    shape = policy_shape("serial:mb=4:mt=300", prompts_per_node=1, stage_fusion=True, train_fusion=False)
    assert shape["micro_batch_tokens"] == 300 and shape["micro_batch_groups"] == 4
    assert policy_shape("serial", prompts_per_node=1, stage_fusion=True, train_fusion=False)["micro_batch_tokens"] == 0


def test_one_cap_serves_training_after_decode_and_in_the_window(tmp_path):
    fused = compile_iteration(grpo, _shape(micro_batch_tokens=512, stage_fusion=True, train_fusion=True),
                              ENGINES, DIMS)
    assert not any("micro_batch_tokens" in n.args for n in fused)  # train fusion's nodes take their own
    auto = Session(load_config(None, [*OVERRIDES, "schedule=auto", "train.train_fusion=true",
                                      "train.micro_batch_tokens=64"]), tmp_path / "a")
    caps = {name: {n.args.get("micro_batch_tokens", n.args.get("batch_tokens")) for n in graph
                   if n.kind == "loss"} for name, graph in auto.graphs.items()}
    assert caps == {"rollplex": {64}, "rollplex-unfused": {64}, "serial": {64}}
    assert not auto.fusion_cap_unused
    apart = Session(load_config(None, [*OVERRIDES, "schedule=rollplex", "train.train_fusion=true",
                                       "train.micro_batch_tokens=64", "train.fusion_batch_tokens=999"]), tmp_path / "b")
    assert {n.args["batch_tokens"] for n in apart.graphs["rollplex"] if n.kind == "loss"} == {999}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_capped_backwards_give_the_uncapped_loss_and_gradient(tmp_path, engine):
    """Serial with one backward per micro-batch of two groups against backwards of one group each
    (a 1-token cap): the same sampled responses, the same loss and gradient norm up to rounding, in
    iterations that sample after one update; on both train engines (DeepSpeed marks each backward a
    micro-batch of its own). A supervised warm-up first, so that rewards vary and the
    gradient is not zero (the embedded task rewards nothing before its format is learned)."""
    runs = {}
    for name, extra in (("whole", []), ("capped", ["train.micro_batch_tokens=1"])):
        cfg = load_config(None, [*OVERRIDES, "schedule=serial", f"engines.train={engine}", *extra])
        train(cfg, tmp_path / name, progress=False, log=lambda *a: None)
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [r for r in rows if r["phase"] == "rl"]
    trace = json.loads((tmp_path / "capped" / "traces" / "iter_000001.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert "loss_m1" in names and not any(n.startswith(("prefix_actor", "suffix_logprobs")) for n in names)
    for whole, capped in zip(runs["whole"], runs["capped"], strict=True):
        assert capped["response_len_mean"] == whole["response_len_mean"]
        for key in ("loss", "grad_norm", "kl", "reward_mean"):
            assert capped[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
        assert whole["grad_norm"] > 0
