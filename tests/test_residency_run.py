"""The memory plan executed by a real run (cluster.memory_plan): offload/prefetch nodes enter the
iteration graph, run on the engines, and change nothing that is computed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollplex.config import load_config
from rollplex.engines.base import EngineError, move_tensors
from rollplex.errors import ConfigError, MemoryPlanError
from rollplex.pipeline.plan.residency import GiB, plan_residency
from rollplex.pipeline.run.runner import train
from rollplex.pipeline.run.session import Session
from rollplex.tasks.residency import to_device

BASE = ["iterations=2", "seed=5", "warmup.steps=0", "stop_at_reward=null", "checkpoint.every=1"]


def _plan(session, budget):
    return plan_residency(session.compiled, session.cfg.schedule, model_path=session.model_path,
                          shape=session.shape, budget_bytes=budget, train_engine=session.train_engine,
                          score_engine=session.score_engine, zero_stage=session.cfg.train.zero_stage)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    return Session(load_config(None, BASE), tmp_path_factory.mktemp("plan"))


def test_a_tight_budget_moves_only_what_the_engines_can_move(session):
    naive = max(_plan(session, 1e12).memory.naive_peak.values())
    plan = _plan(session, naive * 0.8)
    moved = {n.args["tensor"] for n in plan.graph if n.kind == "offload"}
    assert moved and moved <= {"actor.adam", "actor.master", "ref.weights"}  # DeepSpeed: masters, moments
    assert max(plan.memory.peak.values()) <= naive * 0.8
    for name in plan.moves:  # every move is ordered against the uses it serves
        assert plan.graph.g.in_degree(name) + plan.graph.g.out_degree(name) > 0, name
    with pytest.raises(MemoryPlanError, match=r"gpu0 needs .* largest live tensors: .*rollout\.kv_pool"):
        _plan(session, naive * 0.3)  # the KV pool and the actor's weights cannot leave


def test_engines_refuse_parts_they_cannot_move_and_moves_are_in_place():
    from rollplex.engines.hf_score import HFScoreEngine
    from rollplex.engines.torch_train import TorchTrainEngine

    with pytest.raises(EngineError, match="cannot move 'weights'.*moves grads, master, adam"):
        TorchTrainEngine.offload(object.__new__(TorchTrainEngine), "weights")
    with pytest.raises(EngineError, match="cannot move 'adam'"):
        HFScoreEngine.offload(object.__new__(HFScoreEngine), "adam")
    t = torch.ones(3)
    holder = {"state": t}
    assert move_tensors([t], torch.device("cpu")) == 0  # already there: nothing copied
    assert holder["state"] is t
    nested = {"kv": (torch.zeros(2), [torch.ones(1)]), "n": 3}
    moved = to_device(nested, torch.device("cpu"))
    assert moved["n"] == 3 and torch.equal(moved["kv"][1][0], torch.ones(1))


def test_a_value_goes_to_host_memory_and_back_to_the_workers_device():
    from types import SimpleNamespace

    from rollplex.pipeline.compile.ir import Node
    from rollplex.tasks.residency import offload, prefetch

    ctx = SimpleNamespace(host=SimpleNamespace(device=torch.device("cpu"), engines={}))
    kv = {"k": torch.arange(4.0), "rows": [torch.ones(2)]}
    off = offload(ctx, Node("offload_kv_0", "offload", ("kv",), ("kv@host0",)), {"kv": kv})
    back = prefetch(ctx, Node("prefetch_kv_0", "prefetch", ("kv@host0",), ("kv@dev0",)), off)
    assert torch.equal(back["kv@dev0"]["k"], kv["k"]) and torch.equal(back["kv@dev0"]["rows"][0], kv["rows"][0])
    with pytest.raises(Exception, match="no engine for model 'ref'"):
        offload(ctx, Node("offload_ref_0", "offload", (), (),
                          args={"resident": True, "tensor": "ref.weights", "model": "ref", "part": "weights"}), {})


def test_a_missing_budget_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cluster.memory_plan needs cluster.memory_budget_gib"):
        Session(load_config(None, BASE + ["cluster.memory_plan=true"]), tmp_path / "x")


@pytest.mark.slow
def test_a_run_with_a_memory_plan_offloads_and_matches_a_run_without(session, tmp_path):
    from safetensors.torch import load_file

    naive = max(_plan(session, 1e12).memory.naive_peak.values())
    budget = f"cluster.memory_budget_gib={naive * 0.8 / GiB:.9f}"
    logs: list[str] = []
    planned = tmp_path / "planned"
    train(load_config(None, BASE + ["cluster.memory_plan=true", budget]), planned, progress=False,
          log=lambda *a: logs.append(" ".join(map(str, a))))
    plain = tmp_path / "plain"
    train(load_config(None, BASE), plain, progress=False, log=lambda *a: None)
    assert any("memory plan: peak" in line and "actor.adam" in line for line in logs), logs
    trace = json.loads((planned / "traces" / "iter_000001.json").read_text())
    kinds = [e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert "offload" in kinds and "prefetch" in kinds
    last = "checkpoints/iter_000001/model.safetensors"
    a, b = load_file(str(planned / last)), load_file(str(plain / last))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = lambda d: (Path(d) / "rollouts" / "iter_000001.jsonl").read_text()  # noqa: E731
    assert rows(planned) == rows(plain)
