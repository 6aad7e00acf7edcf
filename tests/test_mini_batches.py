"""Several optimizer steps per iteration: ``train.mini_batches`` M × ``train.epochs`` E.

GRPO, 4 prompts, M = 2, E = 2 (mini-batch 0 = p0 p1, mini-batch 1 = p2 p3):

    decode ─▶ prefix/suffix_actor p0 p1 (grad) ─▶ loss_s0_* ─▶ optimizer_step_s0
           └▶ prefix/suffix_actor p2 p3 (old only) ─────────────────┘ (rollout-time weights)
    optimizer_step_s0 ─▶ prefix/suffix_actor_s1 p2 p3 (grad) ─▶ loss_s1_* ─▶ optimizer_step_s1
    optimizer_step_s1 ─▶ … p0 p1 … ─▶ optimizer_step_s2 ─▶ … p2 p3 … ─▶ optimizer_step_s3 ─▶ weight_sync

Compile-level checks on the graph (an invariant: every node that reads or writes a trained model's
weights is ordered against every optimizer step of that model, so no schedule can change what it
sees), then runs: the loss of each step is its own mini-batch's mean, and the serial and rollplex
schedules end at the same checkpoints.
"""
from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import pytest
import torch

from rollplex.config import load_config
from rollplex.errors import ConfigError, GraphError
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration, train_fusable
from rollplex.pipeline.compile.ranks import check_data_parallel, distribute
from rollplex.pipeline.compile.spec import IterationSpec
from rollplex.pipeline.plan.build import build_iteration
from rollplex.pipeline.plan.schedule import schedule
from rollplex.pipeline.run.algorithms import load_algorithm

ENGINES = EngineChoice({"decode": "hf", "train": "torch", "score": "transformers"})
DIMS = ModelDims(64, 2, 2, 16, 1000, 10**6, 2)
ALGORITHMS = ("grpo", "ppo", "rloo", "dapo", "reinforce_pp")


def _shape(**kw) -> BatchShape:
    return BatchShape(**{**dict(prompts=4, samples=2, max_new_tokens=8, chunk_tokens=4, micro_batch_groups=1,
                                mini_batches=2, epochs=2), **kw})


def weight_users(graph, model: str) -> list[str]:
    """The nodes that read or write ``model``'s trained weights."""
    return [n.name for n in graph if n.model == model and n.kind in ("prefix", "suffix_score", "loss")]


def assert_steps_fence_the_weights(graph, model: str, rank: int | None = None) -> int:
    """Every node that uses ``model``'s weights (on ``rank``) lies before or after each of its steps;
    returns the number of steps."""
    def mine(name):
        return rank is None or graph.nodes[name].meta.get("rank") == rank
    steps = [n.name for n in graph.of_kind("optimizer_step") if n.model == model and mine(n.name)]
    users = [n for n in weight_users(graph, model) if mine(n)]
    for step in steps:
        before, after = nx.ancestors(graph.g, step), nx.descendants(graph.g, step)
        loose = [n for n in users if n not in before and n not in after]
        assert not loose, f"{loose} may run before or after %{step}"
    return len(steps)


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("sharing", [True, False])
def test_every_model_takes_m_times_e_steps_each_fenced_from_the_forwards_around_it(name, sharing):
    alg = load_algorithm(name)
    for policy in ("serial", "rollplex"):
        graph = build_iteration(alg, IterationSpec(_shape(prefix_sharing=sharing, stage_fusion=True), ENGINES,
                                                   policy), DIMS).graph
        for model in alg.trainable:
            assert assert_steps_fence_the_weights(graph, model) == 4, (policy, model)
        (sync,) = graph.of_kind("weight_sync")
        assert sync.inputs == ("step_s3",)


def test_each_step_trains_its_mini_batch_on_forwards_made_after_the_step_before():
    graph = compile_iteration(load_algorithm("grpo"), _shape(), ENGINES, DIMS)
    minis = [[0, 1], [2, 3]]
    for k in range(4):
        losses = [n for n in graph.of_kind("loss") if n.args["step"] == k]
        assert sorted(p for n in losses for p in n.args["prompts"]) == minis[k % 2]
        assert all(n.args["normalise"] == minis[k % 2] for n in losses)  # the mini-batch's own mean
        scores = {v for n in losses for v in n.inputs if graph.values[v].label == "logprobs"}
        olds = {v for n in losses for v in n.inputs if graph.values[v].label == "old_logprobs"}
        assert olds == {f"old_logprobs_p{p}" for p in minis[k % 2]}  # always the rollout-time policy's
        if k == 0:  # the forwards made at rollout time, the prefix in the decode window
            assert scores == {"logprobs_p0", "logprobs_p1"}
        else:
            assert scores == {f"logprobs_s{k}_p{p}" for p in minis[k % 2]}
            for v in scores:
                assert nx.has_path(graph.g, f"optimizer_step_s{k - 1}", graph.values[v].producer)
    # Mini-batch 1's rollout-time forwards keep no graph: they give its old log-probs only.
    assert graph.nodes["prefix_actor_p2"].args["grad"] is False
    assert graph.nodes["suffix_logprobs_p2"].outputs == ("old_logprobs_p2",)


def test_ppos_critic_is_scored_anew_and_its_advantage_reads_the_rollout_time_values():
    graph = compile_iteration(load_algorithm("ppo"), _shape(epochs=1), ENGINES, DIMS)
    assert [n.name for n in graph.of_kind("optimizer_step") if n.model == "critic"] == [
        "optimizer_step_critic_s0", "optimizer_step_critic_s1"]
    assert "suffix_values_s1_p2" in graph.nodes
    # GAE's returns and the whitened advantages come from the rollout-time values, once
    assert {"old_values_p2", "old_logprobs_p2"} <= set(graph.nodes["gae_returns_p2"].inputs)
    assert {"returns_p2", "old_values_p2"} <= set(graph.nodes["advantage"].inputs)
    # the critic's later step regresses its new values on those returns
    assert {"values_s1_p2", "returns_p2"} <= set(graph.nodes["loss_critic_s1_m0"].inputs)


def test_one_step_compiles_the_iteration_it_always_did():
    alg = load_algorithm("grpo")
    one = compile_iteration(alg, _shape(mini_batches=1, epochs=1), ENGINES, DIMS)
    assert [n.name for n in one.of_kind("optimizer_step")] == ["optimizer_step"]
    assert "step" not in one.nodes["loss_m0"].args and "steps" not in one.nodes["report"].args


def test_two_ranks_each_take_every_step_on_their_share_of_each_mini_batch():
    """P = 8, two ranks: rank 0 holds p0-3, rank 1 p4-7; mini-batch 0 is p0 p1 p4 p5."""
    alg = load_algorithm("grpo")
    spec = IterationSpec(_shape(prompts=8, epochs=1), ENGINES, "rollplex", world=2)
    graph = build_iteration(alg, spec, DIMS).graph
    assert spec.compiled_shape.mini_batch_prompts() == [(0, 1, 4, 5), (2, 3, 6, 7)]
    for rank in (0, 1):
        assert assert_steps_fence_the_weights(graph, "actor", rank) == 2
        for k in (0, 1):
            step = graph.nodes[f"optimizer_step_s{k}_r{rank}"]
            assert step.inputs and all(graph.nodes[graph.values[v].producer].meta["rank"] == rank for v in step.inputs)
    with pytest.raises(GraphError, match="split for 1 rank"):
        distribute(compile_iteration(alg, _shape(prompts=8), ENGINES, DIMS), 2)


def test_micro_batches_never_span_two_ranks_shares():
    shape = _shape(prompts=8, ranks=2, micro_batch_groups=2)
    assert shape.micro_batches(0) == [(0, 1), (4, 5)] and shape.micro_batches(1) == [(2, 3), (6, 7)]
    assert shape.micro_batches() == [(0, 1), (4, 5), (2, 3), (6, 7)]
    with pytest.raises(GraphError, match="3 equal mini-batches"):
        _shape(mini_batches=3)


def test_train_fusion_says_it_takes_one_step():
    shape = _shape(stage_fusion=True, train_fusion=True, max_new_tokens=12)
    assert not train_fusable(load_algorithm("grpo"), shape)
    graph = compile_iteration(load_algorithm("grpo"), shape, ENGINES, DIMS)
    assert "one optimizer step per iteration" in graph.meta["train_fusion_off"] and "2 × 2" in graph.meta[
        "train_fusion_off"]


def test_an_advantage_that_reads_a_score_with_grad_is_refused_with_several_steps():
    from rollplex import Algorithm

    alg = Algorithm("reads_values")
    alg.policy("actor")
    alg.critic("critic", copy_of="actor")
    alg.score("critic", as_="values", grad=True)
    alg.score("actor", as_="logprobs", grad=True)
    alg.advantage(scope="group")(lambda rewards, values: rewards - values.mean(-1))
    alg.loss(agg="token-mean")(lambda logprobs, advantages: -logprobs * advantages.unsqueeze(-1))
    alg.loss(model="critic", agg="token-mean")(lambda values, rewards: (values - rewards.unsqueeze(-1)) ** 2)
    compile_iteration(alg, _shape(mini_batches=1, epochs=1), ENGINES, DIMS)
    with pytest.raises(GraphError, match=r"train.mini_batches × train.epochs > 1.*\['values'\].*old_values"):
        compile_iteration(alg, _shape(), ENGINES, DIMS)


def test_mini_batches_that_do_not_split_the_batch_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^train.mini_batches: 3 does not divide rollout.prompts_per_iteration"):
        load_config(None, ["train.mini_batches=3"])
    with pytest.raises(ConfigError, match=r"^train.mini_batches \(4\) must divide the prompts per rank \(2\)"):
        check_data_parallel(4, 8, 1, "torch", 2, "hf", mini_batches=4)
    with pytest.raises(ConfigError, match=r"train.micro_batch_groups \(2\) must divide each rank's share of a mini"):
        check_data_parallel(2, 8, 2, "torch", 2, "hf", mini_batches=4)


# -- runs ------------------------------------------------------------------------------------------------
REWARD = "def reward(text, answer):\n    return float(len(text) % 3) / 2\n"  # varies with the sample


def _reward_file(tmp_path: Path) -> str:
    path = tmp_path / "length_reward.py"
    path.write_text(REWARD)
    return f"{path}:reward"


@pytest.mark.slow
def test_each_steps_loss_is_the_mean_over_its_own_mini_batch(tmp_path):
    """With lr 0 every step sees the rollout-time weights (ratio 1) and the reference is the policy
    (KL 0), so a token's GRPO loss is −Â and step k's loss is −Σ Â·|y| / Σ |y| over its mini-batch's
    responses. The logged loss is the mean over the M × E steps; normalised over the whole batch
    instead, it would come out otherwise on these unequal mini-batches."""
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.run.worker import WorkerHost

    cfg = load_config(None, ["seed=2", "warmup.steps=0", "stop_at_reward=null", "engines.decode=hf",
                             "engines.train=torch", "train.lr=0", "rollout.prompts_per_iteration=4",
                             "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "train.micro_batch_groups=1",
                             "train.mini_batches=2", "train.epochs=2", f"task.reward={_reward_file(tmp_path)}"])
    session = Session(cfg, tmp_path / "run")
    host = WorkerHost(session.host_spec(), name="local")
    try:
        report = LocalExecutor(host).run(session.graph, 0, session.graph.feed(session.loader.next_batch())).output[
            "report"]
    finally:
        host.close()
    rows, metrics = report["rows"], report["metrics"]
    sums = [[0.0, 0], [0.0, 0]]  # per mini-batch: Σ −Â·|y|, Σ |y|; rows come in prompt order, 4 per prompt
    for i, row in enumerate(rows):
        n = len(row["response_token_ids"])
        sums[i // 4 // 2][0] -= row["advantage"] * n
        sums[i // 4 // 2][1] += n
    assert sums[0][1] != sums[1][1] and any(r["advantage"] for r in rows)  # the two means are told apart
    per_mini = (sums[0][0] / sums[0][1] + sums[1][0] / sums[1][1]) / 2
    whole = (sums[0][0] + sums[1][0]) / (sums[0][1] + sums[1][1])
    assert metrics["loss"] == pytest.approx(per_mini, rel=1e-5, abs=1e-7)
    assert abs(per_mini - whole) > 1e-3
    assert metrics["clip_frac"] == 0.0  # the weights never moved


def _run(tmp: Path, schedule: str, reward: str) -> Path:
    cfg = load_config(None, [f"schedule={schedule}", "iterations=2", "seed=3", "warmup.steps=0", "stop_at_reward=null",
                             "checkpoint.every=1", "train.mini_batches=4", "train.epochs=2", f"task.reward={reward}"])
    run_dir = tmp / schedule
    from rollplex.pipeline.run.runner import train

    train(cfg, run_dir, progress=False, log=lambda *a: None)
    return run_dir


@pytest.mark.slow
def test_serial_and_rollplex_take_the_same_steps_to_the_same_checkpoints(tmp_path):
    """The default engines (vLLM decode, DeepSpeed ZeRO-2), as tests/test_e2e.py runs them, taking
    4 × 2 steps per iteration: the schedules order the work differently, the update stays the same."""
    from safetensors.torch import load_file

    reward = _reward_file(tmp_path)
    runs = {schedule: _run(tmp_path, schedule, reward) for schedule in ("serial", "rollplex")}
    for iteration in range(2):
        name = f"checkpoints/iter_{iteration:06d}/model.safetensors"
        a, b = load_file(str(runs["serial"] / name)), load_file(str(runs["rollplex"] / name))
        assert a.keys() == b.keys()
        for key in a:
            scale = a[key].abs().max().clamp(min=1e-12)
            assert float((a[key] - b[key]).abs().max() / scale) <= 1e-5, (iteration, key)
        trace = json.loads((runs["rollplex"] / "traces" / f"iter_{iteration:06d}.json").read_text())
        kinds = [e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"]
        assert kinds.count("optimizer_step") == 8 and kinds.count("weight_sync") == 1
    rows = [json.loads(line) for line in (runs["rollplex"] / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert any(r["clip_frac"] > 0 for r in rows)  # later steps' ratios left the clip range
    before = load_file(str(runs["rollplex"] / "checkpoints/iter_000000/model.safetensors"))
    after = load_file(str(runs["rollplex"] / "checkpoints/iter_000001/model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
