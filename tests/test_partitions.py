"""SM partitions follow the live decode batch, re-chosen as each decode chunk starts (pipeline/run/partitions.py)."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from rollplex.pipeline.bench.bench import BenchConfig, _host, bench_reward
from rollplex.pipeline.run.partitions import AUTO_SPLITS, Partitions, decode_sms_for


def test_fewer_live_rows_leave_decode_fewer_sms():
    assert [decode_sms_for(r) for r in (None, 0, 64, 33, 32, 9, 8, 1)] == [96, 96, 96, 96, 64, 64, 32, 32]
    shares = [decode_sms_for(r) for r in range(1, 129)]
    assert shares == sorted(shares)  # monotone: a lighter decode never keeps more SMs


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def synchronize(self) -> None:
        pass


class FakeDecode:
    rows = 64

    def live_rows(self) -> int:
        return self.rows


def _fake_partitions(sms_list) -> Partitions:
    return Partitions({sms: {"decode": FakeStream(f"decode{sms}"), "compute": FakeStream(f"compute{sms}"),
                             "decode_sms": sms, "compute_sms": 132 - sms} for sms in sms_list})


def test_a_fixed_split_ignores_the_batch():
    parts = _fake_partitions([96])
    assert parts.choose(3) == 96 and parts.stream("compute").name == "compute96"


def test_the_host_rechooses_the_split_per_decode_chunk_and_compute_takes_the_complement(monkeypatch):
    from rollplex.tasks import rewards

    monkeypatch.setitem(rewards._REWARDS, "bench_parity", bench_reward)
    used = []
    monkeypatch.setattr(torch.cuda, "stream", lambda s: used.append(s.name) or contextlib.nullcontext())
    decode = FakeDecode()
    host = _host(BenchConfig(device="cpu"), None, None, decode, "rollplex",
                 {"decode": FakeStream("decode-whole"), "compute": FakeStream("compute-whole")})
    host.partitions = _fake_partitions([sms for _, sms in AUTO_SPLITS])

    got = []

    def run(stream: str, other_busy: bool) -> str:
        other = "compute" if stream == "decode" else "decode"
        host._busy[other] = int(other_busy)
        with host.on_stream(stream) as sms:
            got.append(sms)
        host._busy[other] = 0
        return used[-1]

    assert run("decode", other_busy=False) == "decode-whole"  # alone: the whole GPU
    assert run("decode", other_busy=True) == "decode96"  # 64 rows: heavy, decode keeps most SMs
    decode.rows = 20
    assert run("decode", other_busy=True) == "decode64"
    assert run("compute", other_busy=True) == "compute64"  # beside that chunk: the complement
    decode.rows = 5
    assert run("decode", other_busy=False) == "decode-whole"
    assert run("compute", other_busy=True) == "compute32"  # the tail chunk chose 32 for decode
    assert got == [None, 96, 64, 68, None, 100]  # what a trace event records: the SMs of a shared stream

    # A forward kept for a backward stays on the whole GPU: its backward would run on its stream.
    host._busy["decode"] = 1
    with host.on_stream("compute", keeps_graph=True) as sms:
        assert sms is None and used[-1] == "compute-whole"
    host.window = dataclasses.replace(host.window, grad_on_partition=True)
    with host.on_stream("compute", keeps_graph=True) as sms:
        assert sms == 100 and used[-1] == "compute32"


def test_the_runtime_asks_for_partitions_under_the_rollplex_schedule_only(tmp_path):
    from rollplex.config import load_config
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.run.worker import WorkerHost

    asked = ["cluster.sm_partitions=true"]
    specs = {s: Session(load_config(None, [f"schedule={s}", *asked]), tmp_path / s).host_spec()
             for s in ("serial", "rollplex")}
    assert specs["rollplex"].window.partitions is True and specs["serial"].window.partitions is False
    fenced = Session(load_config(None, ["schedule=rollplex", *asked, "cluster.compute_sms=100"]), tmp_path / "f")
    assert fenced.host_spec().window.compute_sms == 100
    default = Session(load_config(None, ["schedule=rollplex"]), tmp_path / "default")
    assert default.host_spec().window.partitions is False  # plain streams unless asked for
    # Engines given, so that none is built (a DeepSpeed engine would start a process group here).
    spec = dataclasses.replace(specs["rollplex"], ref_cache_bytes=0)
    host = WorkerHost(spec, name="cpu", engines={"actor": None, "ref": None}, decode=FakeDecode())
    assert host.streams == {} and host.partitions is None  # a CPU: plain threads, no partitions


def test_a_partitioned_compute_node_targets_its_sms_and_the_setting_is_restored(monkeypatch):
    """cuBLAS would size its matmuls for all 132 SMs; on a partition they target its share, and
    the process-wide setting is back to none once no partitioned node runs."""
    from rollplex.tasks import rewards

    monkeypatch.setitem(rewards._REWARDS, "bench_parity", bench_reward)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    host = _host(BenchConfig(device="cpu"), None, None, FakeDecode(), "rollplex",
                 {"decode": FakeStream("decode-whole"), "compute": FakeStream("compute-whole")})
    host.partitions = dataclasses.replace(_fake_partitions([96]), total_sms=132)
    host._busy["decode"] = 1
    with host.on_stream("compute") as sms:
        inside = torch._C._get_sm_carveout_experimental()
    assert sms == 36 and inside == 132 - 36
    assert torch._C._get_sm_carveout_experimental() is None
    with host.on_stream("decode"):  # decode replays graphs captured with their own target
        assert torch._C._get_sm_carveout_experimental() is None
    host.window = dataclasses.replace(host.window, sm_target=False)
    with host.on_stream("compute"):
        assert torch._C._get_sm_carveout_experimental() is None


def test_attaching_partitions_captures_decode_graphs_on_every_split_with_its_target(monkeypatch):
    from rollplex.tasks import rewards

    monkeypatch.setitem(rewards._REWARDS, "bench_parity", bench_reward)
    captured = []

    class CapturingDecode(FakeDecode):
        def capture_graphs(self, stream, top_p: bool = False) -> None:
            captured.append((stream.name, torch._C._get_sm_carveout_experimental(), top_p))

    host = _host(BenchConfig(device="cpu"), None, None, CapturingDecode(), "rollplex", {})
    host.use_partitions(dataclasses.replace(_fake_partitions([32, 96]), total_sms=132))
    assert captured == [("decode32", 100, False), ("decode96", 36, False)]
    assert torch._C._get_sm_carveout_experimental() is None
    # A run that samples with top-p steps through other graphs: those are the ones captured up front.
    captured.clear()
    host.spec = dataclasses.replace(host.spec, settings=dataclasses.replace(host.spec.settings, top_p=0.9))
    host.use_partitions(dataclasses.replace(_fake_partitions([32]), total_sms=132))
    assert captured == [("decode32", 100, True)]


def test_measured_step_times_pick_the_fewest_sms_that_keep_decode_within_tolerance():
    """Heavy decode needs its SMs; light decode steps as fast on a third of the GPU, so compute
    work gets the rest. The graph that holds the live rows is the one timed."""
    from rollplex.pipeline.run.partitions import fewest_sms_within

    measured = {32: {8: 6.0, 64: 20.0}, 64: {8: 5.9, 64: 11.0}, 96: {8: 5.8, 64: 9.0}}
    assert fewest_sms_within(measured, 64, 0.10) == 96  # 11.0 > 1.1 × 9.0
    assert fewest_sms_within(measured, 64, 0.25) == 64
    assert fewest_sms_within(measured, 5, 0.10) == 32  # the 8-row graph: 6.0 ≤ 1.1 × 5.8
    assert fewest_sms_within(measured, 100, 0.10) == 96  # past the largest graph: the largest one
    parts = _fake_partitions([32, 64, 96])
    assert parts.choose(20) == 64  # no timings yet: the table
    parts.measured = measured
    assert parts.choose(20) == 96 and parts.choose(3) == 32


def test_attaching_partitions_records_the_engines_step_times_per_split(monkeypatch):
    from rollplex.tasks import rewards

    monkeypatch.setitem(rewards._REWARDS, "bench_parity", bench_reward)

    class TimedDecode(FakeDecode):
        def capture_graphs(self, stream, top_p: bool = False) -> None:
            pass

        def step_seconds_on(self, stream) -> dict[int, float]:
            return {8: 0.005, 64: 0.010 if stream.name == "decode96" else 0.020}

    host = _host(BenchConfig(device="cpu"), None, None, TimedDecode(), "rollplex", {})
    parts = dataclasses.replace(_fake_partitions([32, 96]), total_sms=132)
    host.use_partitions(parts)
    assert parts.measured == {32: {8: 0.005, 64: 0.020}, 96: {8: 0.005, 64: 0.010}}
    assert parts.choose(64) == 96 and parts.choose(8) == 32


def test_compute_work_waits_out_decodes_prefill_and_only_while_decode_runs(monkeypatch):
    import threading
    import time

    from rollplex.tasks import rewards

    monkeypatch.setitem(rewards._REWARDS, "bench_parity", bench_reward)

    class Prefilling(FakeDecode):
        rows, prefill_left = 0, 3  # polls until the device finishes the prefill

        def prefilling(self) -> bool:
            if not self.rows:
                return False
            self.prefill_left -= 1
            return self.prefill_left >= 0

    decode = Prefilling()
    host = _host(BenchConfig(device="cpu"), None, None, decode, "rollplex", {})
    t0 = time.time()
    host.wait_for_prefill(3, poll=0.001)  # no decode has run on this host: nothing to wait for
    assert time.time() - t0 < 0.05
    host._decode_iteration = 0
    t0 = time.time()
    host.wait_for_prefill(0, poll=0.001)  # this iteration's decode ran and is idle now: no wait
    assert time.time() - t0 < 0.05 and decode.prefill_left == 3
    t0 = time.time()  # ready before decode began: waits for it up to start_limit, then goes
    host.wait_for_prefill(1, poll=0.001, start_limit=0.05)
    assert 0.05 <= time.time() - t0 < 0.5
    # Decode begins (busy) but has not added its requests yet: wait, then through every prefill poll.
    host._decode_iteration, host._busy["decode"] = 1, 1
    threading.Timer(0.05, lambda: setattr(decode, "rows", 64)).start()
    t0 = time.time()
    host.wait_for_prefill(1, poll=0.001)
    assert time.time() - t0 >= 0.05 and decode.prefill_left == -1
    decode.rows, decode.prefill_left = 0, 10**9
    t0 = time.time()
    host.wait_for_prefill(1, poll=0.001, limit=0.05)  # a misread engine costs the limit, not a hang
    assert 0.05 <= time.time() - t0 < 1.0


def test_compute_spares_sms_for_decode_only_while_decode_runs():
    from rollplex.pipeline.run.partitions import WindowSharing, compute_sms

    spare = WindowSharing(compute_spare=32)
    assert compute_sms(spare, decode_busy=True, total=132) == 100
    assert compute_sms(spare, decode_busy=False, total=132) is None  # alone, compute takes the whole GPU
    assert compute_sms(WindowSharing(), decode_busy=True, total=132) is None  # the default spares none
    assert compute_sms(spare, decode_busy=True, total=0) is None  # no GPU
    assert compute_sms(WindowSharing(compute_spare=500), decode_busy=True, total=132) == 1


def test_a_runs_switch_interval_holds_while_its_worker_runs_and_the_process_gets_its_own_back(tmp_path, monkeypatch):
    """cluster.switch_interval_us: the worker's process switches threads at that interval while the run's
    nodes execute (the decode thread then waits at most that long for the GIL), and Python's own after."""
    import sys

    from rollplex.config import load_config
    from rollplex.pipeline.run.runner import train
    from rollplex.pipeline.run.worker import WorkerHost

    seen: list[float] = []
    record = WorkerHost.record

    def noting(self, event):
        seen.append(sys.getswitchinterval())
        return record(self, event)

    monkeypatch.setattr(WorkerHost, "record", noting)
    before = sys.getswitchinterval()
    overrides = ["iterations=1", "warmup.steps=0", "stop_at_reward=null", "engines.train=torch", "engines.decode=hf",
                 "rollout.max_new_tokens=4", "rollout.chunk_tokens=2", "rollout.prompts_per_iteration=2",
                 "rollout.samples_per_prompt=2", "cluster.switch_interval_us=300"]
    train(load_config(None, overrides), tmp_path / "run", progress=False, log=lambda *a: None)
    assert seen and set(seen) == {300e-6}
    assert sys.getswitchinterval() == before != 300e-6


def test_compute_alone_can_be_fenced_while_decode_keeps_the_whole_gpu():
    import pytest

    from rollplex.errors import RollplexError
    from rollplex.pipeline.bench.bench import window_sharing
    from rollplex.pipeline.bench.results import parse_policy
    from rollplex.pipeline.run.partitions import split_sizes

    assert split_sizes(132) == [(sms, 132 - sms) for _, sms in AUTO_SPLITS]  # disjoint, the GPU filled
    assert split_sizes(132, 32) == [(32, 100)]
    assert split_sizes(132, 0, 100) == [(132, 100)]  # overlapping: decode on every SM
    assert split_sizes(132, 64, 100) == [(64, 100)]
    assert split_sizes(132, 0, 500) == [(132, 132)]
    cfg = BenchConfig(device="cpu")
    assert window_sharing(cfg, "rollplex:sp=1:cs=100").compute_sms == 100
    assert window_sharing(cfg, "rollplex:sp=1").compute_sms == 0
    with pytest.raises(RollplexError, match="'cs' fences compute .* it needs sp=1"):
        parse_policy("rollplex:cs=100")


def test_fencing_compute_without_partitions_is_refused_naming_the_field():
    import pytest

    from rollplex.config import load_config
    from rollplex.errors import ConfigError

    with pytest.raises(ConfigError, match="cluster.compute_sms: 100 .* needs cluster.sm_partitions: true"):
        load_config(None, ["cluster.compute_sms=100"])
