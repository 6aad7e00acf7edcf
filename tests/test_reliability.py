"""NaN/Inf refusals, security defaults, and the checkpoint store's small guarantees.

- A NaN loss, or a finite loss whose gradient is NaN, stops `rollplex train` at that iteration with
  one line naming it (exit code 3), before the optimizer applies anything; the last good checkpoint
  stays intact and ``--resume`` continues from it.
- The LocalCluster listens on loopback only; cluster.tls_* reach a TLS-only scheduler, which refuses
  a client without them; a checkpoint's pickle that is more than tensors is refused, not unpickled.
- Checkpoint directories appear and disappear atomically; stale temporaries are cleaned; a corrupt
  newest checkpoint is refused by name with the earlier one to fall back to.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from reliability_harness import HF_TORCH, Launch, assert_intact, metric_rows, run_to_end, worker_start_environment

from rollplex.errors import CheckpointError, ConfigError, RollplexError
from rollplex.pipeline.run import checkpoints

NAN_AT = 2  # one loss micro-batch per iteration below, so the loss's third call is iteration 2
ONE_MICRO_BATCH = ["--set", "train.micro_batch_groups=2"]


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory) -> dict[str, tuple[Path, Launch]]:
    """One run per kind of NaN. One after the other: two concurrent runs' schedulers would both want
    Dask's HTTP port 8787 and warn on stderr, which this test reads."""
    root = tmp_path_factory.mktemp("nan")
    out: dict[str, tuple[Path, Launch]] = {}
    for where in ("loss", "grad"):
        launch = Launch(root / where, [*HF_TORCH, *ONE_MICRO_BATCH],
                        env={"ROLLPLEX_TEST_NAN_AT": str(NAN_AT), "ROLLPLEX_TEST_NAN_IN": where})
        launch.finish()
        out[where] = (root / where, launch)
    return out


@pytest.mark.parametrize("where,says", [("loss", "non-finite loss nan"),
                                        ("grad", "gradient norm is nan (non-finite) in parameter")])
def test_nan_stops_the_iteration_before_its_update_and_keeps_the_last_checkpoint(nan_runs, where, says):
    run_dir, launch = nan_runs[where]
    assert launch.proc.returncode == 3, launch.log()
    lines = launch.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in launch.stderr, launch.stderr
    line = lines[0]
    assert line.startswith(f"rollplex: error: iteration {NAN_AT} stopped before its update: "), line
    assert says in line and "iter_000001, is intact" in line, line
    assert_intact(run_dir)
    assert checkpoints.latest(run_dir).iteration == NAN_AT - 1
    assert [r["iteration"] for r in metric_rows(run_dir) if r["phase"] == "rl"] == list(range(NAN_AT))
    assert not (run_dir / "rollouts" / f"iter_{NAN_AT:06d}.jsonl").exists()


def test_resume_after_a_nan_continues_from_the_last_good_checkpoint(nan_runs):
    run_dir, _ = nan_runs["loss"]
    launch = Launch(run_dir, [*HF_TORCH, *ONE_MICRO_BATCH])
    assert launch.finish() == 0, launch.log()
    assert any(line.startswith(f"it    {NAN_AT} ") for line in launch.lines), launch.log()
    rl = [r["iteration"] for r in metric_rows(run_dir) if r["phase"] == "rl"]
    assert rl == list(range(6))


def test_a_resume_may_run_longer_and_the_change_is_recorded_where_it_took_effect(tmp_path):
    """iterations may change on --resume (it defines how long, not what, the run computes); the row of
    the first iteration run under the new value says so, and config.yaml holds it, checksummed."""
    from rollplex.config import load_config

    run_dir = tmp_path / "run"
    run_to_end(run_dir, HF_TORCH)
    launch = run_to_end(run_dir, [*HF_TORCH, "--iterations", "8"])
    rl = [r for r in metric_rows(run_dir) if r["phase"] == "rl"]
    assert [r["iteration"] for r in rl] == list(range(8))
    assert [(r["iteration"], r["config_changed"]) for r in rl if "config_changed" in r] == [(6, {"iterations": [6, 8]})]
    assert "--resume: iterations 6 → 8 from iteration 6 (recorded in metrics.jsonl)" in launch.lines, launch.log()
    assert load_config(run_dir / "config.yaml", checksummed=True).iterations == 8


def _resume_from(config: dict):
    from rollplex.pipeline.run.checkpoints import CheckpointState

    return CheckpointState(4, Path("run/checkpoints/iter_000004"), {}, {}, None, config)


def test_a_resume_refuses_a_change_to_any_field_but_those_that_may_change_naming_each():
    """Nested keys of the dict fields are fields too: a new hyperparameter or engine option is named."""
    from rollplex.config import MAY_CHANGE_ON_RESUME, RunConfig, load_config
    from rollplex.pipeline.run.runner import resume_changes

    before = RunConfig().to_dict()
    said: list[str] = []
    changed = resume_changes(load_config(None, ["iterations=9", "checkpoint.every=2", "cluster.memory_plan=true"]),
                             _resume_from(before), said.append)
    assert changed == {"checkpoint.every": (25, 2), "cluster.memory_plan": (False, True), "iterations": (300, 9)}
    assert said[-1] == "--resume: iterations 300 → 9 from iteration 5 (recorded in metrics.jsonl)"
    for overrides, named in [(["train.lr=0.1"], "train.lr (0.001 → 0.1)"),
                             (["params={kl_coef: 0.5}"], "params.kl_coef (None → 0.5)"),
                             (["engines.decode_options={max_num_seqs: 4}", "iterations=9"],
                              "engines.decode_options.max_num_seqs (None → 4) would change"),
                             (["cluster.threads=2", "seed=1"],
                              "cluster.threads (1 → 2), seed (0 → 1) would change")]:
        with pytest.raises(ConfigError, match=r"^--resume: " + re.escape(named)):
            resume_changes(load_config(None, overrides), _resume_from(before), said.append)
    leaves = set(_leaf_fields(before))
    assert MAY_CHANGE_ON_RESUME <= leaves, MAY_CHANGE_ON_RESUME - leaves  # each names a field
    assert len(leaves) > 3 * len(MAY_CHANGE_ON_RESUME)


def _leaf_fields(data: dict, prefix: str = "") -> list[str]:
    return [name for key, value in data.items() for name in
            (_leaf_fields(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"])]


def test_a_resume_of_a_checkpoint_that_records_no_config_is_refused():
    from rollplex.config import RunConfig
    from rollplex.pipeline.run.runner import resume_changes

    with pytest.raises(CheckpointError, match="iter_000004 records no config"):
        resume_changes(RunConfig(), _resume_from(None), print)


# -- security defaults ---------------------------------------------------------------------------
def test_the_local_cluster_listens_on_loopback_only():
    from rollplex.pipeline.run.cluster import connect

    with connect(None, workers=1, threads=1) as client:
        info = client.scheduler_info()
        addresses = [client.scheduler.address, *info["workers"]]
    assert addresses and all(a.startswith("tcp://127.0.0.1:") for a in addresses), addresses


def test_a_local_worker_process_keeps_glibcs_malloc_tuning_and_the_threads_asked_for():
    """Dask's nanny would start it with MALLOC_TRIM_THRESHOLD_ set (every large tensor a fresh mmap)."""
    import torch

    from rollplex.pipeline.run.cluster import connect

    threads = int(os.environ["OMP_NUM_THREADS"])
    with connect(None, workers=1, threads=threads, processes=True) as client:
        env = worker_start_environment(client)
        [torch_threads] = client.run(torch.get_num_threads).values()
    assert "MALLOC_TRIM_THRESHOLD_" not in env, env.get("MALLOC_TRIM_THRESHOLD_")
    assert env["OMP_NUM_THREADS"] == str(threads) and torch_threads == threads


def test_a_host_computes_with_the_threads_asked_for_after_vllm_replaced_torchs_setter(tmp_path, monkeypatch):
    """Once loaded, vLLM's CPU worker makes torch.set_num_threads a no-op. A run in that process (a
    notebook, a test session) still computes with cluster.threads, not with whatever count ran before
    it: another count sums in another order, and the run's bits would depend on its neighbours."""
    import torch

    from rollplex.config import load_config
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.run.worker import WorkerHost

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    torch._C.set_num_threads(2)
    try:
        cfg = load_config(None, ["cluster.threads=1", "engines.decode=hf", "engines.train=torch"])
        host = WorkerHost(Session(cfg, tmp_path / "run").host_spec())
        try:
            assert torch.get_num_threads() == 1
        finally:
            host.close()
    finally:
        torch._C.set_num_threads(before)


def _tls_files(tmp_path: Path):
    from distributed.security import Security

    temp = Security.temporary()  # a throwaway CA and certificate (needs `cryptography`)
    files = {}
    for name, pem in (("ca.pem", temp.tls_ca_file), ("cert.pem", temp.tls_client_cert),
                      ("key.pem", temp.tls_client_key)):
        (tmp_path / name).write_text(pem)
        files[name] = str(tmp_path / name)
    return temp, files


def test_tls_options_reach_a_tls_only_scheduler_which_refuses_plain_clients(tmp_path):
    from distributed import LocalCluster

    from rollplex.config import load_config
    from rollplex.pipeline.run.cluster import connect
    from rollplex.pipeline.run.runner import cluster_security

    temp, files = _tls_files(tmp_path)
    with LocalCluster(n_workers=0, protocol="tls", host="127.0.0.1", security=temp, dashboard_address=None) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tls://127.0.0.1:")
        cfg = load_config(None, [f"cluster.scheduler={address}", f"cluster.tls_ca_file={files['ca.pem']}",
                                 f"cluster.tls_cert={files['cert.pem']}", f"cluster.tls_key={files['key.pem']}"])
        security = cluster_security(cfg)
        assert security.require_encryption
        # Connected over TLS: the scheduler answers, and has no workers to offer.
        with pytest.raises(RollplexError, match="has no workers"):
            with connect(address, 1, 1, security=security):
                pass
        plain = address.replace("tls://", "tcp://")  # the same port without TLS: the handshake fails
        with pytest.raises(RollplexError, match="cannot reach the Dask scheduler"):
            with connect(plain, 1, 1):
                pass
        with pytest.raises(ConfigError, match="is a TLS address; give cluster.tls_ca_file"):
            load_config(None, [f"cluster.scheduler={address}"])


@pytest.mark.parametrize("overrides,message", [
    (["cluster.tls_ca_file=CA"], "cluster.tls_cert, cluster.tls_key: TLS needs all of"),
    (["cluster.tls_ca_file=CA", "cluster.tls_cert=CERT", "cluster.tls_key=missing.pem"],
     "cluster.tls_key: missing.pem does not exist"),
    (["cluster.tls_ca_file=CA", "cluster.tls_cert=CERT", "cluster.tls_key=KEY"], "need a tls://HOST:PORT"),
    (["cluster.scheduler=tcp://h:1", "cluster.tls_ca_file=CA", "cluster.tls_cert=CERT", "cluster.tls_key=KEY"],
     "need a tls://HOST:PORT scheduler address, got 'tcp://h:1'"),
])
def test_tls_options_are_checked_by_name(tmp_path, overrides, message):
    from rollplex.config import load_config

    for name in ("CA", "CERT", "KEY"):
        (tmp_path / name).write_text("x")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, overrides)
    finally:
        os.chdir(cwd)


# -- the checkpoint store ------------------------------------------------------------------------
def _save(run_dir: Path, iteration: int, reward: float | None, keep_last: int = 2) -> Path:
    def model(directory: str) -> None:
        Path(directory, "model.bin").write_bytes(os.urandom(64))

    return checkpoints.save(run_dir, iteration, model, loader={"epoch": 0, "position": iteration},
                            keep_last=keep_last, reward=reward)


def test_retention_keeps_the_last_n_and_the_best(tmp_path):
    for i, reward in enumerate([0.1, 0.9, 0.2, 0.3, 0.4]):
        _save(tmp_path, i, reward)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["iter_000001", "iter_000003", "iter_000004"]


def test_latest_orders_by_iteration_past_a_million(tmp_path):
    _save(tmp_path, 999_999, None, keep_last=5)
    _save(tmp_path, 1_000_000, None, keep_last=5)
    assert checkpoints.latest(tmp_path).iteration == 1_000_000


def test_a_corrupt_newest_checkpoint_is_refused_naming_the_fallback(tmp_path):
    _save(tmp_path, 0, None)
    newest = _save(tmp_path, 1, None)
    (newest / "model.bin").write_bytes(b"x" * 64)
    with pytest.raises(CheckpointError, match=r"model.bin fails its checksum.*resume from iter_000000 instead"):
        checkpoints.latest(tmp_path)


@pytest.mark.parametrize("name", ["after_warmup", "iter_000001"])
def test_a_checkpoint_of_any_name_without_its_manifest_is_reported(tmp_path, name):
    """The warm-up's checkpoint as much as an iteration's: one that lost its manifest is named, not
    skipped (which would resume from an older state, or from the start, in silence)."""
    for iteration in (checkpoints.WARMUP, 0, 1):
        _save(tmp_path, iteration, None, keep_last=5)
    (tmp_path / "checkpoints" / name / "manifest.json").unlink()
    fallback = "iter_000001" if name == "after_warmup" else "iter_000000"
    with pytest.raises(CheckpointError, match=rf"{name} has no manifest.json.*resume from {fallback}$"):
        checkpoints.latest(tmp_path)


@pytest.mark.parametrize("added", ["extra.bin", "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_a_file_the_manifest_does_not_list_is_refused(tmp_path, added):
    """DeepSpeed loads its partitions by a glob, so a file added beside the verified ones would be read."""
    newest = _save(tmp_path, 0, None)
    (newest / added).parent.mkdir(parents=True, exist_ok=True)
    (newest / added).write_bytes(b"cos\nsystem\n(S'touch pwned'\ntR.")
    with pytest.raises(CheckpointError, match=rf"iter_000000: {re.escape(added)} is not in manifest.json"):
        checkpoints.latest(tmp_path)


@pytest.mark.parametrize("damage", ["flip", "remove"])
def test_the_wandb_run_id_a_resume_reads_is_checked_against_the_checkpoint(tmp_path, damage):
    """Written once, when the run starts: a flipped byte would send the resumed run's metrics to
    another W&B run, a missing file to a new one."""
    (tmp_path / "wandb_id").write_text("0123456789ab\n")
    _save(tmp_path, 0, None)
    state = checkpoints.latest(tmp_path)
    checkpoints.verify_side_files(tmp_path, state, {"wandb_id"})
    if damage == "flip":
        (tmp_path / "wandb_id").write_text("0123456789aa\n")
    else:
        (tmp_path / "wandb_id").unlink()
    checkpoints.verify_side_files(tmp_path, state, set())  # not read when W&B is off
    says = "fails its checksum against iter_000000" if damage == "flip" else "is missing; iter_000000 recorded it"
    with pytest.raises(CheckpointError, match=rf"wandb_id {says}"):
        checkpoints.verify_side_files(tmp_path, state, {"wandb_id"})


def test_stale_temporaries_of_killed_writers_are_cleaned(tmp_path):
    good = _save(tmp_path, 0, None)
    for stale in ("checkpoints/.tmp-iter_000001-99", "checkpoints/.trash-iter_000000-98", ".reference-tmp"):
        (tmp_path / stale).mkdir(parents=True)
        (tmp_path / stale / "model.bin").write_bytes(b"partial")
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / ".iter_000001.jsonl.abc.tmp").write_text("{")
    removed = checkpoints.clean_stale(tmp_path)
    assert len(removed) == 4
    assert sorted(p.name for p in tmp_path.rglob("*") if p.name.startswith(".")) == []
    assert checkpoints.latest(tmp_path).directory == good


def test_truncated_metrics_drop_later_rows_and_a_torn_line_and_keep_warmup(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"iteration": -1, "phase": "warmup"}, *({"iteration": i, "phase": "rl", "reward_mean": i / 10}
                                                   for i in range(4))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 4, "pha')
    checkpoints.truncate_metrics(path, 1)
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [-1, 0, 1]
    assert checkpoints.rl_rewards(path) == [0.0, 0.1]


def test_the_kept_metrics_are_the_rows_the_checkpoint_saw_and_its_own_validation_after_it(tmp_path):
    """Checkpoint 1 records the digest of metrics.jsonl as it stood: the rows up to RL iteration 1 and
    validation 1. Validation 2 (of checkpoint 1's policy) is written after it, so it is kept but cannot
    be in that digest; any row the digest covers, edited, is refused."""
    import hashlib

    path = tmp_path / "metrics.jsonl"
    row = {"rl": lambda i: {"iteration": i, "phase": "rl", "reward_mean": i / 10},
           "eval": lambda i: {"iteration": i, "phase": "eval", "val/reward_mean": i / 10}}
    seen = [row["eval"](0), row["rl"](0), row["rl"](1)]
    digest = hashlib.sha256("".join(json.dumps(r) + "\n" for r in seen).encode()).hexdigest()
    later = [row["eval"](2), row["rl"](2), row["eval"](3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in seen + later))
    kept = checkpoints.kept_metrics(path, 1, digest, "iter_000001")
    assert [(r["phase"], r["iteration"]) for r in map(json.loads, kept.splitlines())] == [
        ("eval", 0), ("rl", 0), ("rl", 1), ("eval", 2)]
    path.write_text(path.read_text().replace('"val/reward_mean": 0.0', '"val/reward_mean": 0.5'))
    with pytest.raises(CheckpointError, match="its rows up to iter_000001 are not the ones that checkpoint recorded"):
        checkpoints.kept_metrics(path, 1, digest, "iter_000001")
