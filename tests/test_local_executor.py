"""The in-process executor gives the same iteration as the Dask one lowered node by node: same
rollouts, same update. (A one-worker run's default lowering is the whole iteration as one Dask task
running this executor on the worker, so this is also that lowering against the per-node one.)"""
from __future__ import annotations

import json

import pytest
import torch

from rollplex.config import load_config
from rollplex.pipeline.run.runner import train
from rollplex.pipeline.run.session import Session

OVERRIDES = ["iterations=2", "seed=5", "warmup.steps=0", "stop_at_reward=null", "engines.decode=hf",
             "engines.train=torch", "checkpoint.every=1"]


@pytest.mark.parametrize("schedule", ["serial", "rollplex"])
def test_local_executor_matches_the_dask_executor(tmp_path, schedule):
    from safetensors.torch import load_file

    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.worker import WorkerHost

    cfg = load_config(None, [*OVERRIDES, f"schedule={schedule}", "cluster.lowering=nodes"])
    train(cfg, tmp_path / "dask", progress=False, log=lambda *a: None)

    session = Session(cfg, tmp_path / "local")
    host = WorkerHost(session.host_spec(), name="local")
    executor = LocalExecutor(host)
    try:
        for iteration in range(cfg.iterations):
            batch = session.loader.next_batch()
            result = executor.run(session.graph, iteration, {f"prompt_p{p}": x for p, x in enumerate(batch)})
            rows = result.output["report"]["rows"]
            logged = [json.loads(line) for line in
                      (tmp_path / "dask" / "rollouts" / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]
            assert [r["response_token_ids"] for r in rows] == [r["response_token_ids"] for r in logged]
            assert [r["ref_logprobs"] for r in rows] == [r["ref_logprobs"] for r in logged]
            assert {e["tid"] for e in result.events} == {"decode", "compute", "host"}
        expected = load_file(str(tmp_path / "dask" / "checkpoints" / "iter_000001" / "model.safetensors"))
        state = host.train_engine("actor").module.state_dict()
        from rollplex.engines.torch_train import checkpoint_to_module_names

        names = checkpoint_to_module_names(host.train_engine("actor").module)
        for key, tensor in expected.items():
            assert torch.equal(state[names.get(key, key)], tensor), key
    finally:
        host.close()


def test_a_failing_node_is_raised_only_after_the_nodes_running_beside_it_end(monkeypatch):
    """A node left running on another stream after a failure would go on writing (gradients, decode
    rows) into whatever runs next; the executor waits for it, then raises the failure."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from rollplex.errors import NodeFailure
    from rollplex.pipeline.run import local
    from rollplex.pipeline.compile.ir import IterationGraph, Node

    ended = threading.Event()

    def execute(host, node, iteration, inputs, values):
        if node.name == "slow":
            time.sleep(0.3)
            ended.set()
            return {"a": 1}
        raise NodeFailure(node.name, node.kind, "OutOfMemoryError: CUDA out of memory")

    class Host:
        name = "fake"
        pools = {s: ThreadPoolExecutor(1) for s in ("decode", "compute")}

        def submit(self, stream, fn, *args):
            return self.pools[stream].submit(fn, *args)

    g = IterationGraph("two")
    g.add(Node("slow", "decode_chunk", (), ("a",), meta={"stream": "decode"}))
    g.add(Node("fails", "prefix", (), ("b",), meta={"stream": "compute"}))
    g.connect()
    monkeypatch.setattr(local, "execute_node", execute)
    with pytest.raises(NodeFailure, match="out of memory"):
        local.LocalExecutor(Host()).run(g, 0, {})
    assert ended.is_set()


def test_in_process_workers_run_whole_iterations(tmp_path):
    """``cluster.processes: false``: the LocalCluster's worker lives in this process (no env of its
    own to take), and its iterations run as one Dask task each."""
    cfg = load_config(None, [*OVERRIDES, "iterations=1", "cluster.processes=false"])
    lines = []
    train(cfg, tmp_path, progress=False, log=lines.append)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0] and rows[0]["seconds_by_kind"]["decode_chunk"] > 0


@pytest.mark.parametrize("overrides", [[], ["train.train_fusion=true"]])
def test_tasks_find_their_inputs_by_what_they_are_not_by_name(tmp_path, overrides):
    """One iteration of the compiled graph and of the same graph with every value and node renamed
    give the same report: tasks read the value records (role, prompts, chunk), never a name."""
    from test_values import renamed

    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.worker import WorkerHost

    cfg = load_config(None, [*OVERRIDES, "schedule=rollplex", *overrides])
    session = Session(cfg, tmp_path)
    batch = session.loader.next_batch()
    reports = []
    for graph in (session.graph, renamed(session.graph)):
        host = WorkerHost(session.host_spec(), name="local")
        try:
            (report,) = LocalExecutor(host).run(graph, 0, graph.feed(batch)).output.values()
        finally:
            host.close()
        reports.append(report)
    assert reports[0]["rows"] and reports[0]["rows"] == reports[1]["rows"]
    assert reports[0]["metrics"] == reports[1]["metrics"]


def test_alloc_retries_count_what_happened_since_any_host_on_the_device_last_drained(monkeypatch):
    """Hosts that take turns on one device (the bench's policies) each report their own iterations'
    retries: the count is the device's, cumulative, and a drain by either host moves the mark."""
    import torch

    from rollplex.pipeline.run import worker

    count = {"num_alloc_retries": 5}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(count))
    monkeypatch.setattr(worker, "_ALLOC_RETRIES", {})
    device = torch.device("cuda", 0)
    assert worker.alloc_retries_since_drain(device) == 0  # a host starts: the mark
    count["num_alloc_retries"] = 7  # host A's iteration retried twice
    assert worker.alloc_retries_since_drain(device) == 2
    count["num_alloc_retries"] = 8  # host B's iteration once
    assert worker.alloc_retries_since_drain(device) == 1
    assert worker.alloc_retries_since_drain(device) == 0  # A again: nothing since B drained
    assert worker.alloc_retries_since_drain(torch.device("cuda", 1)) == 0  # another device: its own mark
