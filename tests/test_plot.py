"""`rollplex plot` on a small hand-made run directory (no engines): files, numbers behind them, errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollplex.cli import main
from rollplex.errors import DataError
from rollplex.pipeline.run.plot import plot_run, read_metrics, seconds_per_kind
from rollplex.pipeline.plan.trace import chrome_trace

PNG = b"\x89PNG\r\n\x1a\n"


def _events(iteration: int) -> list[dict]:
    """Two streams of one worker: decode_chunk overlapping a prefix, then a loss (times in µs)."""
    t0 = 1e9 + iteration * 1e6
    ev = lambda name, cat, tid, ts, dur: {"name": name, "cat": cat, "ph": "X", "ts": t0 + ts, "dur": dur,  # noqa: E731
                                          "pid": "worker0", "tid": tid, "args": {}}
    return [ev("decode_c0", "decode_chunk", "decode", 0, 30_000), ev("prefix_ref_p0", "prefix", "compute", 5_000, 10_000),
            ev("prefix_actor_p0", "prefix", "compute", 16_000, 10_000), ev("loss_m0", "loss", "compute", 40_000, 2_000)]


def _run_dir(tmp: Path, iterations: int = 3) -> Path:
    run = tmp / "run"
    rows = [{"iteration": -1, "phase": "warmup", "warmup_loss": 2.0}]
    rows += [{"iteration": i, "phase": "rl", "reward_mean": 0.25 + 0.1 * i, "reward_std": 0.1, "kl": 0.01 * i,
              "loss": -0.1 * i, "reward_chance": 0.25, "value_loss": 1.0 / (i + 1)} for i in range(iterations)]
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 9, "rew')
    for i in range(iterations):
        (run / "traces").mkdir(exist_ok=True)
        (run / "traces" / f"iter_{i:06d}.json").write_text(json.dumps(chrome_trace(_events(i), i, "rollplex")))
    return run


def test_plot_writes_the_pngs_atomically(tmp_path):
    run = _run_dir(tmp_path)
    written = plot_run(run)
    names = sorted(p.name for p in written)
    assert names == ["curves.png", "gantt_iter_000002.png", "time_by_kind.png"]
    for p in written:
        assert p.parent == run / "plots" and p.read_bytes()[:8] == PNG and p.stat().st_size > 5000
    assert not [p for p in (run / "plots").iterdir() if p.name.startswith(".")]  # no temp files left
    out = tmp_path / "elsewhere"
    assert [p.name for p in plot_run(run, out, iteration=0)][-1] == "gantt_iter_000000.png"


def test_the_numbers_behind_the_plots(tmp_path):
    run = _run_dir(tmp_path)
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # warm-up row and torn last line left out
    trace = json.loads((run / "traces" / "iter_000001.json").read_text())
    assert seconds_per_kind(trace) == pytest.approx({"decode_chunk": 0.03, "prefix": 0.02, "loss": 0.002})


def test_plot_errors_name_the_directory_or_iteration(tmp_path, capsys):
    run = _run_dir(tmp_path)
    with pytest.raises(DataError, match=r"--iteration 7: .*has no iter_000007.json \(traced: 0, 1, 2\)"):
        plot_run(run, iteration=7)
    assert main(["plot", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no metrics.jsonl"):
        plot_run(tmp_path / "empty")
    assert main(["plot", str(run), "--out", str(tmp_path / "o")]) == 0
    assert "wrote" in capsys.readouterr().out


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plots_keep_their_size_from_10_to_1000_iterations(tmp_path):
    """A figure that grew with the run was 4,365 px wide after 173 iterations; each stays as it is."""
    sizes = {}
    for n in (10, 1000):
        (tmp_path / str(n)).mkdir()
        sizes[n] = {p.name.split("_iter_")[0]: _png_size(p) for p in plot_run(_run_dir(tmp_path / str(n), n))}
    assert sizes[10] == sizes[1000]
    for name, (w, h) in sizes[10].items():
        assert 600 <= w <= 1300 and 300 <= h <= 900, (name, w, h)
