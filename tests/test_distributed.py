"""Data-parallel training on a real Dask cluster: stock `dask scheduler` + two `dask worker` processes on
loopback, two DeepSpeed ranks (gloo), against a one-worker run with the same global batch.

    1 worker:   [p0 p1 p2 p3] → loss m0..m3 → step                       (the reference)
    2 ranks:    rank0 [p0 p1] → m0 m1 ─┐ all-reduce → step on each rank
                rank1 [p2 p3] → m2 m3 ─┘

The DAG (tests/reliability_dag.py) rewards the sampled text's length, so every iteration moves the
weights. Adam's update is nearly scale-free, so the weights alone would not catch a loss normalised per
rank instead of over the global batch; the logged gradient norm (the global one, after the all-reduce
and before clipping) does. The kill test SIGKILLs one rank's worker process inside iteration 1's
optimizer step: the run restarts both ranks, forms the process group again, rolls back to iteration 0's
checkpoint and replays, ending where the uninterrupted 2-rank run ends.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import fork_server
import pytest
import torch
from reliability_harness import checkpoint_tensors, run_concurrently

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
DAG = Path(__file__).with_name("reliability_dag.py")
LR = 1e-3
# 4 prompts × 2 samples × 3 tokens, one prompt per micro-batch (two per rank), a checkpoint every iteration.
ARGS = [str(DAG), "--seed", "5", "--iterations", "2", "--no-progress",
        "--set", "rollout.prompts_per_iteration=4", "--set", "rollout.samples_per_prompt=2",
        "--set", "rollout.max_new_tokens=3", "--set", "rollout.chunk_tokens=2",
        "--set", "warmup.steps=1", "--set", "warmup.batch_size=2", "--set", "checkpoint.every=1",
        "--set", "stop_at_reward=null", "--set", "train.micro_batch_groups=1", "--set", f"train.lr={LR}",
        "--set", "engines.decode=hf", "--set", "engines.train=deepspeed", "--set", "train.zero_stage=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StockCluster:
    """`dask scheduler` and N `dask worker` processes (each with its nanny, as in production)."""

    def __init__(self, root: Path, workers: int, env: dict[str, str] | None = None) -> None:
        port = _free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        (root / "dask").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "DASK_TEMPORARY_DIRECTORY": str(root / "dask"), **(env or {})}
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
        self.procs = [subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                        "--no-dashboard"], **quiet)]
        for i in range(workers):
            self.procs.append(subprocess.Popen(
                [str(BIN / "dask"), "worker", self.address, "--name", f"rank-{i}", "--nthreads", "1",
                 "--resources", "rank=1", "--no-dashboard", "--host", "127.0.0.1"],
                **quiet))

    def close(self) -> None:
        """The workers first, then the scheduler: a worker whose scheduler has gone spends 8 s trying
        to reach it before it exits; while it is there, it leaves in half a second."""
        for group in (self.procs[1:], self.procs[:1]):
            for proc in group:
                proc.terminate()
            for proc in group:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def rollplex(*argv: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """The `rollplex` console script, forked from a process that imported the stack once
    (tests/fork_server.py); its Dask worker processes start as they always do."""
    return fork_server.run(list(argv), env={**os.environ, **(env or {})}, timeout=timeout, script=str(BIN / "rollplex"))


def train(out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = rollplex("train", *ARGS, "--out", str(out), *extra, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def rl_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl"]


def final_weights(run: Path, iteration: int = 1) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in checkpoint_tensors(run / "checkpoints" / f"iter_{iteration:06d}").items()
            if k.startswith("model/")}


def assert_same_update(reference: Path, other: Path) -> None:
    """The runs end equal up to fp32 summation order, measured against the last step's update u (the
    reference's weights after iteration 1 minus after iteration 0): ‖Δ‖ ≤ 1% of ‖u‖ over the model
    and ≤ 10% of ‖u‖ in each tensor. A lost or doubled step, or a rank training on the wrong prompts,
    differs by about ‖u‖ everywhere. An element-wise bound would not hold across hosts: Adam's step
    g / (√v + eps) turns a rounding difference in a tiny gradient into a share of lr, and the
    DeepSpeed pair's worst embedding element moved 2.2% of lr on an AMD EPYC host and 19% on an
    Intel Xeon (82 of 43k elements above 5%), where ‖Δ‖ was 0.26% of ‖u‖ (2.2% in that tensor)."""
    a, b, start = final_weights(reference), final_weights(other), final_weights(reference, 0)
    assert a.keys() == b.keys()
    diff = {k: float((a[k] - b[k]).norm()) for k in a}
    step = {k: float((a[k] - start[k]).norm()) for k in a}
    total = sum(d * d for d in diff.values()) ** 0.5 / max(sum(u * u for u in step.values()) ** 0.5, 1e-30)
    assert total <= 1e-2, f"the runs' weights differ by {total:.3g} of the last update's norm"
    worst = max((diff[k] / max(step[k], 1e-30), k) for k in a if step[k] > 0)
    assert worst[0] <= 1e-1, f"{worst[1]} differs by {worst[0]:.3g} of its last update's norm"


def train_side_by_side(root: Path, jobs: dict[str, tuple[str, ...]],
                       env: dict[str, dict[str, str]] | None = None) -> dict[str, subprocess.CompletedProcess]:
    """``rollplex train`` once per job, into ``root / name``, all at once (most of a launch is
    single-threaded imports); the first failure is raised in the caller's thread."""
    names = list(jobs)
    done = run_concurrently(*(partial(train, root / name, *jobs[name], env=(env or {}).get(name)) for name in names))
    return dict(zip(names, done))


FAULT = {"ROLLPLEX_TEST_FAULT": "task:optimizer_step:before#2", "ROLLPLEX_TEST_FAULT_KILL": "self"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Three runs side by side (most of a launch is single-threaded imports): the one-worker reference
    (LocalCluster), the 2-rank run on a stock cluster, and the 2-rank run whose worker is killed, on a
    second stock cluster whose workers carry the fault (inert until that run's driver installs the
    task hooks)."""
    root = tmp_path_factory.mktemp("dp")
    fault = {**FAULT, "ROLLPLEX_TEST_FAULT_ONCE": str(root / "fired")}
    clusters = [StockCluster(root / "a", workers=2), StockCluster(root / "b", workers=2, env=fault)]
    jobs = {"one": (), "two": ("--scheduler", clusters[0].address, "--workers", "2"),
            "killed": ("--scheduler", clusters[1].address, "--workers", "2")}
    try:
        logs = train_side_by_side(root, jobs, env={"killed": fault})
    finally:
        for c in clusters:
            c.close()
    return {"fired": root / "fired", **{name: root / name for name in jobs},
            **{f"{name}-log": log for name, log in logs.items()}}


def test_two_data_parallel_ranks_equal_one_worker_with_the_same_global_batch(runs):
    one, two = rl_rows(runs["one"]), rl_rows(runs["two"])
    assert [r["iteration"] for r in two] == [0, 1]
    for a, b in zip(one, two):
        # The same rollouts (sampling seeds follow the prompt, not the rank) and the same global loss.
        assert a["reward_mean"] == b["reward_mean"] and a["response_len_mean"] == b["response_len_mean"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
    assert one[1]["grad_norm"] > 0.1  # the update is real
    assert_same_update(runs["one"], runs["two"])
    # Each rank saved its own ZeRO optimizer partition; both ranks' events are on one trace timeline.
    state = runs["two"] / "checkpoints" / "iter_000001" / "deepspeed" / "state"
    assert {p.name for p in state.glob("zero_pp_rank_*_optim_states.pt")} == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    trace = json.loads((runs["two"] / "traces" / "iter_000001.json").read_text())
    assert trace["otherData"]["workers"] == ["rank0", "rank1"]
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "optimizer_step"]
    assert sorted(e["name"] for e in steps) == ["optimizer_step_r0", "optimizer_step_r1"]
    assert len({e["pid"] for e in steps}) == 2


def test_a_killed_rank_worker_is_replaced_and_no_update_is_lost_or_applied_twice(runs):
    """One rank's worker process dies in iteration 1's optimizer step (its peer waits in the all-reduce)."""
    assert runs["fired"].exists(), "the fault never fired"
    log = runs["killed-log"].stdout + runs["killed-log"].stderr
    assert "iteration 1: lost a Dask worker" in log and "rolling back to iter_000000" in log, log[-3000:]
    assert "ranks formed again" in log
    assert [r["iteration"] for r in rl_rows(runs["killed"])] == [0, 1]  # no gap, no duplicate
    assert_same_update(runs["two"], runs["killed"])


def test_a_tensor_parallel_rollout_trains_as_the_data_parallel_one(tmp_path):
    """cluster.tp_rollout=2: both ranks' torch-graph engines decode all 4 prompts together, each with
    half the heads, and each rank trains on its own 2. Against the same 2 ranks each decoding its own
    prompts: the same samples (decode's log-probs differ by fp32 summation order, two partial
    products summed by the all-reduce), so the same rewards and lengths, and the same weights."""
    graph = ("--workers", "2", "--set", "engines.decode=torch-graph")
    # The serial schedule orders nodes across ranks by token tasks (its phase barriers): same update.
    jobs = {"dp": graph, "tp": (*graph, "--set", "cluster.tp_rollout=2"),
            "tp-serial": (*graph, "--set", "cluster.tp_rollout=2", "--schedule", "serial")}
    logs = {name: r.stdout + r.stderr for name, r in train_side_by_side(tmp_path, jobs).items()}
    dp = rl_rows(tmp_path / "dp")
    assert dp[1]["grad_norm"] > 0.1  # the update is real
    for name in ("tp", "tp-serial"):
        rows = rl_rows(tmp_path / name)
        assert [r["iteration"] for r in rows] == [0, 1]
        for a, b in zip(dp, rows):
            assert a["reward_mean"] == b["reward_mean"] and a["response_len_mean"] == b["response_len_mean"]
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), name
        assert_same_update(tmp_path / "dp", tmp_path / name)
    assert "decode tensor parallel: rank0 1/2, rank1 2/2" in logs["tp"], logs["tp"][-2000:]
    assert "decode tensor parallel" not in logs["dp"]
    first_chunks = [line for line in (tmp_path / "tp" / "graph.txt").read_text().splitlines()
                    if line.startswith("%decode_r") and "_c0 :" in line]
    assert len(first_chunks) == 2  # each rank's chain starts from all four prompts
    assert all("(%prompt_p0, %prompt_p1, %prompt_p2, %prompt_p3," in line for line in first_chunks)


def test_two_torch_engine_ranks_training_in_their_windows_equal_one_worker(tmp_path):
    """Train fusion over data-parallel ranks: each rank trains the groups its own decode chain
    finished (``train_c*_r*``) and the torch engine averages the ranks' gradients at the step, so the
    global gradient norm, the loss and the weights are the one-worker fused run's (LocalCluster)."""
    fused = ("--set", "engines.train=torch", "--set", "schedule=rollplex", "--set", "train.train_fusion=true")
    logs = train_side_by_side(tmp_path, {"one": fused, "two": (*fused, "--workers", "2")})
    assert "train fusion off" not in logs["two"].stdout + logs["two"].stderr
    trace = json.loads((tmp_path / "two" / "traces" / "iter_000001.json").read_text())
    assert {"train_c0_r0", "train_c0_r1"} <= {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    one, two = rl_rows(tmp_path / "one"), rl_rows(tmp_path / "two")
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4, abs=1e-7)
    assert_same_update(tmp_path / "two", tmp_path / "one")


def test_two_ranks_taking_several_steps_per_iteration_equal_one_worker(tmp_path):
    """train.mini_batches 2 × train.epochs 2: each rank trains its share of a mini-batch (one prompt of
    its two) at each of the 4 steps and all-reduces there, and each step's loss divides by its
    mini-batch's tokens over both ranks, so grad norms, losses and weights are the one-worker run's."""
    steps = ("--set", "train.mini_batches=2", "--set", "train.epochs=2")
    train_side_by_side(tmp_path, {"one": steps, "two": (*steps, "--workers", "2")})
    one, two = rl_rows(tmp_path / "one"), rl_rows(tmp_path / "two")
    assert one[1]["grad_norm"] > 0.1  # the update is real
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4, abs=1e-7)
    assert_same_update(tmp_path / "one", tmp_path / "two")
    trace = json.loads((tmp_path / "two" / "traces" / "iter_000001.json").read_text())
    steps_run = sorted(e["name"] for e in trace["traceEvents"] if e.get("cat") == "optimizer_step")
    assert steps_run == sorted(f"optimizer_step_s{k}_r{r}" for k in range(4) for r in range(2))


def test_ppo_trains_on_two_ranks(tmp_path):
    """PPO's advantage is batch-level (it whitens over the whole batch), so its node reads every
    rank's old values, which the critic's scoring node makes beside device tensors: each rank relays
    a host copy (ranks.host_relay), each rank's report reads the batch's advantages, and the actor's
    and critic's backwards and steps run in one order on every rank (gloo refused the collectives
    otherwise). Both models train on both ranks; that the update equals one worker's is not shown."""
    ppo = [str(Path(__file__).parents[1] / "dags" / "ppo.py"), *ARGS[1:]]
    jobs = {"two": ("--workers", "2")}
    done = run_concurrently(*(partial(rollplex, "train", *ppo, "--out", str(tmp_path / name), *extra, timeout=900)
                              for name, extra in jobs.items()))
    for result in done:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = rl_rows(tmp_path / "two")
    assert len(rows) == 2 and rows[1]["grad_norm"] > 0 and rows[1]["grad_norm_critic"] > 0
    assert "%relay_old_values_p2 : rank1/host" in (tmp_path / "two" / "graph.txt").read_text()


def test_two_ranks_play_multi_turn_episodes_as_one_worker(tmp_path):
    """Multi-turn GRPO (tests/multiturn_dp_dag.py: a zoom, its crop, then a reward by the answer's
    length) on two ranks: each rank plays its own prompts' episodes on its own decode engine
    (``decode_t*_r*``, ``env_t*_r*``, ``episodes_r*``), the rollout stats and the reports are gathered,
    and rewards, grad norms, losses, the turn metrics and the weights are the one-worker run's."""
    dag = Path(__file__).with_name("multiturn_dp_dag.py")
    args = (str(dag), *ARGS[1:], "--set", "task.name=zoom", "--set", "rollout.max_turns=2",
            "--set", "env.name=zoom-then-length", "--set", "engines.train=torch", "--set", "eval.every=2",
            "--set", "eval.prompts=3", "--set", "eval.samples=2", "--set", "eval.temperature=1.0")
    done = run_concurrently(*(partial(rollplex, "train", *args, "--out", str(tmp_path / name), *extra, timeout=900)
                              for name, extra in (("one", ()), ("two", ("--workers", "2")))))
    for result in done:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    graph = (tmp_path / "two" / "graph.txt").read_text()
    for node in ("%decode_t1_c0_r1 : rank1/decode", "%env_t0_c1_r0 : rank0/host", "%episodes_r1 : rank1/host",
                 "%gather_rollout_stats : rank0/host"):
        assert node in graph, node
    one, two = rl_rows(tmp_path / "one"), rl_rows(tmp_path / "two")
    assert one[1]["grad_norm"] > 0.01 and one[1]["turns_mean"] == 2.0 and one[1]["tool_use_rate"] == 1.0
    for a, b in zip(one, two):
        for key in ("reward_mean", "reward_std", "response_len_mean", "turns_mean", "tool_use_rate",
                    "forward_tokens", "forward_tokens_per_turn", "decode_prefill_tokens", "episodes_done"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), key
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
    assert_same_update(tmp_path / "one", tmp_path / "two")
    # Validation: the ranks split the prompts (2 and 1) and play the same episodes as one worker.
    a, b = ([json.loads(line) for line in (tmp_path / run / "eval" / "iter_000002.jsonl").read_text().splitlines()]
            for run in ("one", "two"))
    assert [(r["prompt_id"], r["response_token_ids"], r["reward"]) for r in b] == \
        [(r["prompt_id"], r["response_token_ids"], r["reward"]) for r in a]
    assert len(a) == 3 * 2 and all(len(r["turns"]) == 2 for r in a)
