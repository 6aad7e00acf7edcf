"""Train fusion: the policy trains on each decode chunk's finished groups inside the decode window.

The graph: one ``train_c`` node per chunk (reward, advantage, the policy's suffix with grad, loss and
backward for the groups that chunk handed on), joins for the per-prompt values the report reads, and
an optimizer step that divides the summed gradient by the batch's token count. Only algorithms whose
every step is per group qualify; the others compile as before. End to end, the update equals the
serial one up to float rounding (the gradients are summed in another order and scaled once).
"""
from __future__ import annotations

import json

import pytest
import torch

from rollplex.config import load_config
from rollplex.dags.grpo import grpo
from rollplex.dags.ppo import ppo
from rollplex.errors import ConfigError
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration, train_fusable
from rollplex.pipeline.run.runner import train
from rollplex.pipeline.plan.schedule import schedule
from rollplex.pipeline.run.session import Session

ENGINES = EngineChoice({"decode": "hf", "train": "torch", "score": "transformers"})
DIMS = ModelDims(64, 2, 2, 16, 1000, 10**6, 2)


def _shape(**kw) -> BatchShape:
    base = dict(prompts=4, samples=2, max_new_tokens=12, chunk_tokens=4, micro_batch_groups=1,
                stage_fusion=True, train_fusion=True)
    return BatchShape(**{**base, **kw})


def test_each_chunk_trains_the_groups_it_finished_and_the_step_normalises():
    g = compile_iteration(grpo, _shape(), ENGINES, DIMS)
    assert sorted(n.name for n in g.of_kind("loss")) == ["train_c0", "train_c1", "train_c2"]
    assert not g.of_kind("reward") and not g.of_kind("advantage")
    assert not [n for n in g.of_kind("suffix_score") if n.model == "actor"]  # inside train_c
    assert "decode_c2" not in g.g.predecessors("train_c0")  # chunk 0's groups train before decode ends
    assert "suffix_ref_logprobs_c1" in g.g.predecessors("train_c1")  # with that chunk's KL reference
    assert g.values["rewards_p3"].producer == "join_rewards"
    assert g.nodes["optimizer_step"].args["deferred_normaliser"] == "tokens"
    assert g.g.has_edge("train_c0", "train_c1")  # gradients accumulate in chunk order
    schedule(g, "rollplex").lint()


def _actor_and_critic():
    """Two trained models and no node of its own: per group, but not the policy alone."""
    from rollplex import Algorithm

    alg = Algorithm("two_models")
    alg.policy("actor")
    alg.critic("critic", copy_of="actor")
    alg.score("critic", as_="values", grad=True)
    alg.score("actor", as_="logprobs", grad=True)

    @alg.advantage(scope="group")
    def advantages(rewards):
        return rewards - rewards.mean()

    @alg.loss(agg="token-mean")
    def policy_loss(logprobs, advantages):
        return -logprobs * advantages.unsqueeze(-1), {}

    @alg.loss(model="critic", agg="token-mean")
    def value_loss(values, rewards):
        return (values - rewards.unsqueeze(-1)) ** 2, {}

    return alg


@pytest.mark.parametrize("alg, kw, why", [(ppo, {}, "trains ['actor', 'critic']"),
                                          (_actor_and_critic(), {}, "trains ['actor', 'critic']"),
                                          (grpo, dict(train_fusion=False), None),
                                          (grpo, dict(stage_fusion=False), "needs stage fusion")])
def test_algorithms_or_shapes_that_are_not_per_group_train_after_decode_and_say_why(alg, kw, why):
    shape = _shape(**kw)
    assert not train_fusable(alg, shape)
    g = compile_iteration(alg, shape, ENGINES, DIMS)
    assert "train_c0" not in g.nodes and g.of_kind("reward")
    assert (why is None and "train_fusion_off" not in g.meta) or why in g.meta["train_fusion_off"]
    assert not g.meta["shape"].train_fusion  # the graph's shape is the one it was compiled to


def test_the_policys_prefix_runs_in_the_training_node_and_frozen_prefixes_stay_batched():
    """No prefix graph is made before its group is done: each chunk's training node runs the policy's
    prefixes itself (from the prompts and vision embeddings), and only the frozen reference has prefix
    nodes, batched as asked."""
    g = compile_iteration(grpo, _shape(micro_batch_groups=2, prompts_per_node=2), ENGINES, DIMS)
    prefixes = {n.model: [] for n in g.of_kind("prefix")}
    for n in g.of_kind("prefix"):
        prefixes[n.model].append(n.args["prompts"])
    assert prefixes == {"ref": [[0, 1], [2, 3]]}
    train = g.nodes["train_c0"]
    assert {f"vis_p{p}" for p in range(4)} <= set(train.inputs)
    assert not any(i.startswith("prefix_") for i in train.inputs)



def test_under_train_fusion_the_reference_scores_the_groups_each_chunk_finished():
    """Its scores are read only when a group trains: it scores handed groups, not single samples, so
    chunks that finish samples but no group cost no forward."""
    fused = compile_iteration(grpo, _shape(), ENGINES, DIMS)
    assert not any(v.startswith("finished_c") for v in fused.values)
    assert fused.nodes["suffix_ref_logprobs_c1"].inputs[-1] == "handoff_c1"
    unfused = compile_iteration(grpo, _shape(train_fusion=False), ENGINES, DIMS)
    assert unfused.nodes["suffix_ref_logprobs_c1"].inputs[-1] == "finished_c1"


def test_a_chunks_groups_train_in_micro_batches(tmp_path, monkeypatch):
    """Four groups over two chunks: some chunk finishes two or more. With micro-batches of one group
    each trains in a backward of its own; with four, a chunk's groups share one."""
    from rollplex.engines.torch_train import TorchTrainEngine
    from rollplex.pipeline.bench.bench import BenchConfig, run
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.session import resolve_model_path

    config = resolve_model_path(load_config(None, [])) + "/config.json"
    backwards: list[int] = []
    timed, backward = LocalExecutor.run, TorchTrainEngine.backward

    def run_and_count(self, graph, iteration, inputs):
        backwards.append(0)
        return timed(self, graph, iteration, inputs)

    def counted(self, loss):
        backwards[-1] += 1
        return backward(self, loss)

    monkeypatch.setattr(LocalExecutor, "run", run_and_count)
    monkeypatch.setattr(TorchTrainEngine, "backward", counted)
    per_policy = {}
    for policy in ("rollplex:ppn=4:mb=1:tf=1", "rollplex:ppn=4:mb=4:tf=1", "rollplex:ppn=4:mb=4:tf=1:ft=1"):
        backwards.clear()
        run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=4, samples=2, vision_tokens=16,
                        text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=4, iterations=2,
                        policies=(policy,), out=str(tmp_path / policy.replace(":", "_"))), log=lambda *a: None)
        per_policy[policy] = list(backwards)
    assert set(per_policy["rollplex:ppn=4:mb=1:tf=1"]) == {4}
    assert max(per_policy["rollplex:ppn=4:mb=4:tf=1"]) <= 3
    # A token budget below any group's tokens: each group trains in a backward of its own again.
    assert set(per_policy["rollplex:ppn=4:mb=4:tf=1:ft=1"]) == {4}
    # Long responses do not split a micro-batch: the LM head runs in pieces, so no logits budget
    # applies (one of a single element here, which every group's logits pass).
    from rollplex.engines import vlm

    monkeypatch.setitem(vlm.batches_within.__kwdefaults__, "budget", 1)
    backwards.clear()
    run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=4, samples=2, vision_tokens=16,
                    text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=4, iterations=2,
                    policies=("rollplex:ppn=4:mb=4:tf=1",), out=str(tmp_path / "budget")), log=lambda *a: None)
    assert backwards == per_policy["rollplex:ppn=4:mb=4:tf=1"]


def test_a_token_budget_cuts_a_chunks_groups_into_backwards_in_order():
    """handoff_batches: every group once, in order; at most ``most`` groups and ``budget`` tokens a
    backward, a group over the budget alone; no budget is the count alone."""
    import random

    from rollplex.tasks.fused_train import handoff_batches

    rng = random.Random(0)
    for _ in range(200):
        groups = sorted(rng.sample(range(64), rng.randint(0, 12)))
        tokens = {g: rng.randint(1, 3000) for g in groups}
        most, budget = rng.randint(1, 4), rng.choice([0, 1, 1500, 4000, 10**6])
        batches = handoff_batches(groups, tokens, most, budget)
        assert [g for b in batches for g in b] == groups
        assert all(1 <= len(b) <= most for b in batches)
        if budget:
            assert all(len(b) == 1 or sum(tokens[g] for g in b) <= budget for b in batches)
            # greedy: a batch was closed only because the next group did not fit
            for a, b in zip(batches, batches[1:]):
                assert len(a) == most or sum(tokens[g] for g in a) + tokens[b[0]] > budget
        else:
            assert batches == [groups[i: i + most] for i in range(0, len(groups), most)]


def test_the_token_budget_reaches_the_training_nodes_only_when_set():
    g = compile_iteration(grpo, _shape(fusion_batch_tokens=4096), ENGINES, DIMS)
    assert {n.args["batch_tokens"] for n in g.of_kind("loss")} == {4096}
    assert not any("batch_tokens" in n.args for n in compile_iteration(grpo, _shape(), ENGINES, DIMS).of_kind("loss"))


OVERRIDES = ["iterations=2", "seed=4", "warmup.steps=0", "stop_at_reward=null", "checkpoint.every=1",
             "engines.train=torch", "engines.decode=hf", "rollout.max_new_tokens=8", "rollout.chunk_tokens=2",
             "train.micro_batch_groups=1"]


@pytest.mark.slow
def test_the_fused_update_equals_the_serial_one_on_the_same_rollout(tmp_path):
    """The bench's parity reward has real variance, so the gradient is not rounding noise (the
    embedded task's reward is 0 before the format is learned, and Adam's first step turns a noise
    gradient into ±lr everywhere)."""
    from rollplex.pipeline.bench.bench import BenchConfig, run
    from rollplex.pipeline.run.session import resolve_model_path

    config = resolve_model_path(load_config(None, [])) + "/config.json"
    out = run(BenchConfig(model=config, device="cpu", dtype="float32", prompts=4, samples=2, vision_tokens=16,
                          text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=2, iterations=2,
                          train_fusion=True, policies=("serial", "rollplex", "rollplex:mb=4:ft=1"), out=str(tmp_path)),
              log=lambda *a: None)
    updates = {u["policy"]: u for u in out["updates"]}
    for policy in ("rollplex", "rollplex:mb=4:ft=1"):  # the latter: one backward per group, by its token budget
        rollplex = updates[policy]
        assert rollplex["identical_responses"] == rollplex["responses"]
        # Summed in chunk order, scaled once, reference scored per sample: rounding, not zero (Adam's
        # first step amplifies it; a real fault is O(1), see test_bench_cpu).
        assert 0 < rollplex["replayed"] <= 1e-2, policy
    kinds = {r["policy"]: r["seconds_by_kind"] for r in out["results"]}
    assert "reward" not in kinds["rollplex"] and "reward" in kinds["serial"]  # rewards inside train_c


@pytest.mark.slow
def test_two_data_parallel_ranks_each_training_in_its_window_update_as_serial_does(tmp_path):
    """``rollplex-dp2:tf=1``: each rank trains the groups its own decode chain finished (``train_c*_r*``),
    its loss scaled by the ranks, and the averaged update equals serial's on the same rollout."""
    from transformers import AutoConfig

    from rollplex.pipeline.bench.bench import BenchConfig, compile_for, run
    from rollplex.pipeline.run.session import resolve_model_path

    config = resolve_model_path(load_config(None, [])) + "/config.json"
    cfg = BenchConfig(model=config, device="cpu", dtype="float32", prompts=4, samples=2, vision_tokens=16,
                      text_tokens=8, max_new_tokens=8, mean_new_tokens=4, chunk_tokens=2, iterations=2,
                      policies=("serial", "rollplex-dp2:tf=1"), out=str(tmp_path))
    graph = compile_for(cfg, "rollplex-dp2:tf=1", AutoConfig.from_pretrained(config))
    assert {"train_c0_r0", "train_c0_r1", "train_c3_r1"} <= set(graph.nodes) and "train_c0" not in graph.nodes
    out = run(cfg, log=lambda *a: None)
    dp2 = {u["policy"]: u for u in out["updates"]}["rollplex-dp2:tf=1"]
    assert dp2["identical_responses"] == dp2["responses"]
    # Rounding (see above); a group lost or trained twice is O(1). Adam hides a loss scale: the
    # ranks' scaling is checked by the gradient norm in test_distributed.py.
    assert 0 < dp2["replayed"] <= 1e-2


@pytest.mark.slow
def test_a_fused_run_trains_and_logs_like_any_run(tmp_path):
    cfg = load_config(None, [*OVERRIDES, "schedule=rollplex", "train.train_fusion=true"])
    lines = []
    train(cfg, tmp_path, progress=False, log=lines.append)
    assert not [line for line in lines if "train fusion off" in line]
    trace = json.loads((tmp_path / "traces" / "iter_000001.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"train_c0", "train_c3", "join_rewards"} <= names and "reward_p0" not in names
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["kl"], r["grad_norm"]])).all() for r in rows)
    assert (tmp_path / "checkpoints" / "iter_000001" / "model.safetensors").exists()


def test_a_session_says_why_an_algorithm_cannot_train_in_the_window(tmp_path):
    cfg = load_config(None, [*OVERRIDES, "algorithm=ppo", "schedule=rollplex", "train.train_fusion=true"])
    assert "trains ['actor', 'critic']" in Session(cfg, tmp_path / "run").train_fusion_off
    assert Session(load_config(None, [*OVERRIDES, "schedule=rollplex", "train.train_fusion=true"]),
                   tmp_path / "run2").train_fusion_off is None
    # schedule: auto times no unfused copy of a graph that cannot fuse: it would be rollplex's own.
    auto = load_config(None, [*OVERRIDES, "algorithm=ppo", "schedule=auto", "train.train_fusion=true"])
    assert Session(auto, tmp_path / "run3").schedules == ("rollplex", "serial")
    fusing = load_config(None, [*OVERRIDES, "schedule=auto", "train.train_fusion=true"])
    assert Session(fusing, tmp_path / "run4").schedules == ("rollplex", "rollplex-unfused", "serial")


@pytest.mark.parametrize("overrides, unused", [
    (["schedule=rollplex", "train.train_fusion=true"], False),
    (["schedule=auto", "train.train_fusion=true"], False),
    (["schedule=rollplex"], True),  # train fusion not asked for
    (["schedule=serial", "train.train_fusion=true"], True),  # serial trains after decode
    (["algorithm=ppo", "schedule=rollplex", "train.train_fusion=true"], True),  # ppo cannot fuse
])
def test_a_session_says_when_the_fusion_token_cap_does_nothing(tmp_path, overrides, unused):
    cfg = load_config(None, [*OVERRIDES, *overrides, "train.fusion_batch_tokens=64"])
    assert Session(cfg, tmp_path / "run").fusion_cap_unused is unused
    assert Session(load_config(None, [*OVERRIDES, *overrides]), tmp_path / "run0").fusion_cap_unused is False


def test_the_bench_refuses_a_train_fusion_policy_that_would_train_after_decode():
    from transformers import AutoConfig

    from rollplex.errors import RollplexError
    from rollplex.pipeline.bench.bench import BenchConfig, compile_for
    from rollplex.pipeline.run.session import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(load_config(None, [])))
    one_chunk = BenchConfig(device="cpu", prompts=2, samples=2, max_new_tokens=4, chunk_tokens=4)
    with pytest.raises(RollplexError, match="'rollplex:tf=1': train fusion is off: it needs stage fusion"):
        compile_for(one_chunk, "rollplex:tf=1", config)
    two_chunks = BenchConfig(device="cpu", prompts=2, samples=2, max_new_tokens=8, chunk_tokens=4)
    assert "train_c0" in compile_for(two_chunks, "rollplex:ppn=2:mb=2:tf=1", config).nodes


def test_train_fusion_names_the_engine_that_cannot_do_it(tmp_path):
    cfg = load_config(None, [*OVERRIDES, "engines.train=deepspeed", "train.train_fusion=true"])
    with pytest.raises(ConfigError, match="train.train_fusion: the deepspeed train engine"):
        Session(cfg, tmp_path / "run")


def test_torch_engine_scales_accumulated_gradients():
    from rollplex.engines.base import EngineContext, get_engine

    module = torch.nn.Linear(2, 1)
    engine = get_engine("torch", "train").factory(EngineContext("", torch.device("cpu"), torch.float32, 0,
                                                                {"module": module}))
    engine.backward(engine.module(torch.ones(1, 2)).sum() * 4)
    engine.scale_gradients(0.25)
    assert engine.module.weight.grad.tolist() == [[1.0, 1.0]]


@pytest.mark.slow
def test_schedule_auto_with_train_fusion_also_times_rollplex_training_after_decode(tmp_path):
    """Train fusion pays only while the window's work fits beside decode, so auto times three graphs:
    rollplex (fused), rollplex with the policy's training after decode, and serial."""
    cfg = load_config(None, [*OVERRIDES, "schedule=auto", "schedule_trials=1", "train.train_fusion=true",
                             "iterations=6", "checkpoint.every=0"])
    train(cfg, tmp_path, progress=False, log=lambda *a: None)
    rl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["phase"] == "rl"]
    assert [r["schedule"] for r in rl] == ["rollplex", "rollplex-unfused", "serial"] * 2

    def kinds(iteration: int) -> set[str]:
        trace = json.loads((tmp_path / "traces" / f"iter_{iteration:06d}.json").read_text())
        return {e["name"].split("_")[0] for e in trace["traceEvents"] if e.get("ph") == "X"}

    fused, unfused, serial = kinds(3), kinds(4), kinds(5)
    assert "train" in fused and "train" not in unfused and "loss" in unfused and "loss" in serial
