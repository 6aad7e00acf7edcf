"""`rollplex plot RUN_DIR`: PNGs of a run directory, from its metrics.jsonl and traces/.

- ``curves.png``: reward (mean ± std, with chance), KL and loss per RL iteration, plus any other
  per-iteration loss the algorithm logs (``value_loss`` for PPO);
- ``time_by_kind.png``: seconds per node kind per iteration, summed from each iteration's trace;
- ``gantt_iter_N.png``: one iteration's trace as a Gantt chart, a row per worker and stream.
Every PNG has a fixed size, whatever the run's length or the number of its workers (``SIZES``), and is
rendered in memory and written atomically (temp file + rename).
"""
from __future__ import annotations

import io
import json
import re
from collections import defaultdict
from pathlib import Path

from rollplex.errors import DataError
from rollplex.fsio import atomic_write_bytes

EXTRA_CURVES = ("value_loss", "entropy", "clip_frac")  # plotted when an algorithm logs them
_TRACE = re.compile(r"^iter_(-?\d+)\.json$")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


DPI = 110
# Inches per plot. Fixed: a size that grew with the iterations (0.25 in each) was 4,365 px wide after 173
# of them; a fixed one with a line or an area per kind reads the same at 10 iterations as at 10,000.
SIZES = {"curves": (8.0, 7.0), "time_by_kind": (9.0, 4.2), "gantt": (11.0, 5.0)}
BARS_UP_TO = 60  # iterations drawn as stacked bars; more as a stacked area


def _figure(kind: str, rows: int = 1, **kw):
    plt = _pyplot()
    # constrained layout fits labels and outside legends into the figure, so the PNG keeps its size.
    return plt.subplots(rows, 1, figsize=SIZES[kind], layout="constrained", squeeze=False, **kw)


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    _pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    """The RL rows of metrics.jsonl (warm-up rows and a torn last line left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{run_dir}: no metrics.jsonl; give a run directory written by `rollplex train`")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a crash mid-append leaves a torn last line
        if isinstance(row, dict) and row.get("phase", "rl") == "rl" and "iteration" in row:
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no RL iterations logged yet")
    return rows


def trace_files(run_dir: Path) -> dict[int, Path]:
    folder = run_dir / "traces"
    found = {}
    for p in folder.glob("iter_*.json") if folder.is_dir() else []:
        m = _TRACE.match(p.name)
        if m:
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def read_trace(path: Path) -> dict:
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable Chrome trace: {exc}") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise DataError(f"{path}: not a Chrome trace (no traceEvents list)")
    return trace


def seconds_per_kind(trace: dict) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            total[str(e.get("cat", e.get("name")))] += float(e["dur"]) / 1e6
    return dict(total)


# --------------------------------------------------------------------------------------------------
def plot_curves(rows: list[dict], out: Path) -> Path:
    plt = _pyplot()
    it = [r["iteration"] for r in rows]
    panels = [("reward", "reward_mean"), ("KL to the reference", "kl"), ("loss", "loss")]
    panels += [(k.replace("_", " "), k) for k in EXTRA_CURVES if any(k in r for r in rows)]
    fig, axes = _figure("curves", len(panels), sharex=True)
    for ax, (title, key) in zip(axes[:, 0], panels):
        pts = [(r["iteration"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None, lw=1.2)
        if key == "reward_mean":
            std = [(r["iteration"], r["reward_mean"], r.get("reward_std", 0.0)) for r in rows if "reward_mean" in r]
            if std:
                xs, ms, ss = zip(*std)
                ax.fill_between(xs, [m - s for m, s in zip(ms, ss)], [m + s for m, s in zip(ms, ss)], alpha=0.2)
            chance = next((r["reward_chance"] for r in rows if "reward_chance" in r), None)
            if chance is not None:
                ax.axhline(chance, color="grey", ls="--", lw=1, label=f"chance {chance:.2f}")
                ax.legend(loc="lower right", fontsize=8)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("iteration")
    axes[0, 0].set_title(f"{len(it)} RL iterations")
    return _save(fig, out)


def plot_time_by_kind(per_iteration: dict[int, dict[str, float]], out: Path) -> Path:
    plt = _pyplot()
    kinds = sorted({k for v in per_iteration.values() for k in v},
                   key=lambda k: -sum(v.get(k, 0.0) for v in per_iteration.values()))
    its = list(per_iteration)
    fig, axes = _figure("time_by_kind")
    ax = axes[0, 0]
    cmap = plt.get_cmap("tab20")
    series = [[per_iteration[t].get(kind, 0.0) for t in its] for kind in kinds]
    colours = [cmap(i % 20) for i in range(len(kinds))]
    if len(its) <= BARS_UP_TO:
        bottom = [0.0] * len(its)
        for kind, vals, colour in zip(kinds, series, colours):
            ax.bar(its, vals, bottom=bottom, label=kind, color=colour, width=0.8)
            bottom = [b + v for b, v in zip(bottom, vals)]
    else:
        ax.stackplot(its, *series, labels=kinds, colors=colours, linewidth=0)
        ax.set_xlim(its[0], its[-1])
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("node seconds (summed over streams)")
    ax.set_title("time per node kind")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out)


def plot_gantt(trace: dict, out: Path, title: str) -> Path:
    plt = _pyplot()
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    workers = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not events:
        raise DataError(f"{title}: the trace holds no node events")
    lanes = sorted({(e["pid"], e["tid"]) for e in events})
    row = {lane: i for i, lane in enumerate(lanes)}
    kinds = sorted({str(e.get("cat")) for e in events})
    cmap = plt.get_cmap("tab20")
    colour = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    fig, axes = _figure("gantt")
    ax = axes[0, 0]
    for e in events:
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))], (row[(e["pid"], e["tid"])] - 0.4, 0.8),
                       facecolors=colour[str(e.get("cat"))], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"{workers.get(p, p)}/{names.get((p, t), t)}" for p, t in lanes],
                       fontsize=max(5, min(10, 200 // max(len(lanes), 1))))  # many workers: smaller, same figure
    ax.invert_yaxis()
    ax.set_xlabel("ms from the iteration's first node")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[k]) for k in kinds]
    ax.legend(handles, kinds, fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, out)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, iteration: int | None = None) -> list[Path]:
    """All plots of a run; ``iteration``: the Gantt chart's iteration (default: the last traced one)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise DataError(f"{run_dir}: not a directory; give a run directory written by `rollplex train`")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    rows = read_metrics(run_dir)
    written = [plot_curves(rows, out / "curves.png")]
    traces = trace_files(run_dir)
    if not traces:
        raise DataError(f"{run_dir}: no traces/iter_N.json; the run logged no iteration traces")
    per_iteration = {i: seconds_per_kind(read_trace(p)) for i, p in traces.items()}
    written.append(plot_time_by_kind(per_iteration, out / "time_by_kind.png"))
    if iteration is None:
        iteration = max(traces)
    if iteration not in traces:
        shown = ", ".join(map(str, list(traces)[:10])) + (" ..." if len(traces) > 10 else "")
        raise DataError(f"--iteration {iteration}: {run_dir}/traces has no iter_{iteration:06d}.json "
                        f"(traced: {shown})")
    trace = read_trace(traces[iteration])
    policy = trace.get("otherData", {}).get("policy", "")
    written.append(plot_gantt(trace, out / f"gantt_iter_{iteration:06d}.png",
                              f"iteration {iteration}" + (f", schedule={policy}" if policy else "")))
    return written
