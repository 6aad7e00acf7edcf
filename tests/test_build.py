"""One builder of an iteration (pipeline/plan/build.py) that the runner, the bench and the simulator
all use, its passes in order, each checking what it requires and ensures.

    IterationSpec ──expand──▶ ──distribute──▶ [──plan memory──▶] ──schedule──▶ graph
"""
from __future__ import annotations

import pytest

from rollplex.dags.grpo import grpo
from rollplex.errors import GraphError
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims
from rollplex.pipeline.compile.spec import IterationSpec
from rollplex.pipeline.plan import build

ENGINES = EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"})
DIMS = ModelDims(hidden=128, layers=2, kv_heads=2, head_dim=32, vocab=512, params=1_000_000)
SHAPE = BatchShape(prompts=4, samples=2, max_new_tokens=8, chunk_tokens=4, micro_batch_groups=2, stage_fusion=True)


def test_the_passes_run_in_order_and_stop_where_asked():
    spec = IterationSpec(SHAPE, ENGINES, "rollplex", world=2)
    built = build.build_iteration(grpo, spec, DIMS)
    assert all("stream" in n.meta and "priority" in n.meta for n in built.graph)
    assert {n.meta["rank"] for n in built.compiled} == {0, 1}
    early = build.build_iteration(grpo, spec, DIMS, until="distribute")
    assert early.graph is early.compiled and not any("priority" in n.meta for n in early.graph)
    with pytest.raises(GraphError, match="no pass 'lower'"):
        build.build_iteration(grpo, spec, DIMS, until="lower")


def test_a_pass_that_breaks_its_promise_is_named(monkeypatch):
    monkeypatch.setattr(build, "schedule", lambda graph, policy: graph)  # returns it unscheduled
    with pytest.raises(GraphError, match=r"build pass 'schedule' did not ensure \['scheduled'\]"):
        build.build_iteration(grpo, IterationSpec(SHAPE, ENGINES, "serial"), DIMS)


def test_only_the_rollplex_policy_fuses_stages():
    fused = build.build_iteration(grpo, IterationSpec(SHAPE, ENGINES, "rollplex"), DIMS).graph
    serial = build.build_iteration(grpo, IterationSpec(SHAPE, ENGINES, "serial"), DIMS).graph
    assert "join_ref_logprobs" in fused.nodes and "join_ref_logprobs" not in serial.nodes
    assert any(d["reason"] == "barrier" for *_, d in serial.g.edges(data=True))
    assert IterationSpec(SHAPE, ENGINES, "rollplex").under("serial").compiled_shape.stage_fusion is False


@pytest.mark.parametrize("kwargs, message", [(dict(policy="fast"), "policy 'fast'"),
                                             (dict(world=3, tp_rollout=2), "3 ranks cannot form")])
def test_a_spec_names_what_cannot_be_built(kwargs, message):
    with pytest.raises(GraphError, match=message):
        IterationSpec(SHAPE, ENGINES, **kwargs)


def test_the_bench_and_the_simulator_build_what_a_run_builds():
    """A bench policy and a simulated variant of the same batch build the same graph table as a run's
    spec: one builder, three ways in."""
    from rollplex.config import load_config
    from rollplex.engines.modelspec import load_model
    from rollplex.pipeline.bench.bench import BenchConfig, bench_spec
    from rollplex.pipeline.plan import simulator as S
    from rollplex.pipeline.plan.costs import Workload
    from rollplex.pipeline.plan.hardware import Layout, hardware
    from rollplex.pipeline.run.session import iteration_spec

    bench = bench_spec(BenchConfig(prompts=4, samples=2, max_new_tokens=8, chunk_tokens=4, vision_tokens=16,
                                   text_tokens=8, device="cpu"), "rollplex:ppn=2:mb=2")
    cfg = load_config(None, ["rollout.prompts_per_iteration=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
                             "rollout.chunk_tokens=4", "train.prompts_per_node=2", "train.micro_batch_groups=2"])
    run = iteration_spec(cfg, DIMS, 26, 16, "cpu", bench.engines)
    assert run.shape == bench.shape
    model = load_model("qwen2.5-vl-3b")
    w = Workload(prompts=4, samples=2, vision_tokens=16, text_tokens=10, max_new_tokens=8, chunk_tokens=4,
                 micro_batch_groups=2, prompts_per_node=2)
    scn = S.Scenario(model, hardware("h200", 1), w, grpo)
    sim = S.spec_for(scn, Layout.colocate(scn.cluster), True, rollplex=True)
    assert sim.shape == bench.shape and sim.policy == bench.policy == run.policy == "rollplex"
    tables = {str(build.build_iteration(grpo, spec, DIMS).graph) for spec in (bench, run)}
    assert len(tables) == 1
