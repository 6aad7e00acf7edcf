"""A node kind of the user's own, added without touching pipeline/ (dags/examples/reward_model.py).

    prompt ─▶ vit ─▶ decode ─▶ responses ─┬─▶ reward ──────────┐
                 │                        ├─▶ rm_scores (rm_score[rm] @example-rm) ─▶ advantage ─▶ loss
                 └────────────────────────┘   (prompt, vision, responses)

The example registers the kind, its task and its engine on import; the compiler places it, the
schedules order it, the renderer draws it and the executor runs it on the engine it names.
"""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "dags" / "examples" / "reward_model.py"


def test_pipeline_sources_know_nothing_of_the_example_kind():
    """The proof that pipeline/ needed no change: none of its files names the kind, its task or its
    engine (they live only in the example). The test is only meaningful with the one below."""
    for path in (ROOT / "pipeline").rglob("*.py"):
        text = path.read_text()
        for name in ("rm_score", "example-rm", "RewardModel"):
            assert name not in text, f"{path} mentions {name}"


def test_the_example_kind_compiles_schedules_and_renders(tmp_path, capsys):
    from rollplex.cli import main

    out = tmp_path / "rm.svg"
    args = ["graph", str(EXAMPLE), "--set", "rollout.prompts_per_iteration=2", "--set", "rollout.samples_per_prompt=2"]
    assert main([*args, "--format", "svg", "--out", str(out)]) == 0
    svg = out.read_text()
    assert "rm_scores_p0" in svg and "rm_score[rm]" in svg and "@example-rm" in svg
    capsys.readouterr()
    assert main([*args, "--schedule", "serial"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("%rm_scores_p1 "))
    assert "= rm_score[model=rm] @example-rm(%prompt_p1, %vis_p1, %responses_p1)" in line


@pytest.mark.slow
def test_the_example_kind_runs_on_its_own_engine(tmp_path):
    """Two iterations in process. With no warm-up every verifiable reward is 0, so GRPO alone would
    have all-zero advantages; the reward model's scores make them nonzero, so its node really ran and
    fed the advantage, on the engine the example registered."""
    from rollplex.config import load_config
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.run.worker import WorkerHost

    cfg = load_config(None, ["seed=2", "warmup.steps=0", "stop_at_reward=null", "engines.decode=hf",
                             "engines.train=torch", "rollout.prompts_per_iteration=2", "rollout.samples_per_prompt=4",
                             "rollout.max_new_tokens=4", f"algorithm={EXAMPLE}", "params.rm_coef=1.0"])
    session = Session(cfg, tmp_path / "run")
    host = WorkerHost(session.host_spec(), name="local")
    try:
        assert type(host.engines["rm"]).__name__ == "RewardModel"
        for iteration in range(2):
            batch = session.loader.next_batch()
            result = LocalExecutor(host).run(session.graph, iteration, {f"prompt_p{p}": x for p, x in enumerate(batch)})
            rows = result.output["report"]["rows"]
            assert all(r["reward"] == 0.0 for r in rows)
            assert any(abs(r["advantage"]) > 1e-3 for r in rows)
            ran = {e["name"]: e for e in result.events}
            assert ran["rm_scores_p0"]["cat"] == "rm_score" and ran["rm_scores_p0"]["args"]["engine"] == "example-rm"
            assert ran["rm_scores_p0"]["tid"] == "compute"
    finally:
        host.close()


REWARD_DAG = '''
import copy

from rollplex.dags.grpo import grpo

algorithm = copy.deepcopy(grpo)  # GRPO with a reward of its own


@algorithm.reward
def length_bonus(text, answer, bonus: float = 0.25):
    return bonus
'''


@pytest.mark.slow
def test_an_algorithms_reward_gets_its_hyperparameters_from_the_config(tmp_path):
    """A reward of the algorithm's own takes hyperparameters like its other functions: their defaults,
    or ``params`` from the config."""
    from rollplex.config import load_config
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.run.worker import WorkerHost

    dag = tmp_path / "bonus.py"
    dag.write_text(REWARD_DAG)
    for params, expected in (([], 0.25), (["params.bonus=0.75"], 0.75)):
        cfg = load_config(None, ["warmup.steps=0", "engines.decode=hf", "engines.train=torch",
                                 "rollout.prompts_per_iteration=2", "rollout.samples_per_prompt=2",
                                 "rollout.max_new_tokens=2", "rollout.chunk_tokens=2", f"algorithm={dag}", *params])
        session = Session(cfg, tmp_path / "run")
        host = WorkerHost(session.host_spec(), name="local")
        try:
            batch = session.loader.next_batch()
            rows = LocalExecutor(host).run(session.graph, 0, session.graph.feed(batch)).output["report"]["rows"]
            assert {r["reward"] for r in rows} == {expected}
        finally:
            host.close()
