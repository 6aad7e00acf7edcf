"""Chrome trace events (they open in Perfetto) from the node events workers record."""
from __future__ import annotations

from collections import defaultdict


def chrome_trace(events: list[dict], iteration: int, policy: str) -> dict:
    """One process per worker, one thread per stream; times in µs from the iteration's first event."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"iteration": iteration}}
    origin = min(e["ts"] for e in events)
    workers = sorted({str(e["pid"]) for e in events})
    streams = sorted({str(e["tid"]) for e in events})
    pid = {w: i for i, w in enumerate(workers)}
    tid = {s: i for i, s in enumerate(streams)}
    out = []
    for w in workers:
        out.append({"name": "process_name", "ph": "M", "pid": pid[w], "tid": 0, "args": {"name": w}})
        for s in streams:
            out.append({"name": "thread_name", "ph": "M", "pid": pid[w], "tid": tid[s], "args": {"name": s}})
    for e in sorted(events, key=lambda e: e["ts"]):
        out.append({**e, "ts": round(e["ts"] - origin, 1), "dur": round(e["dur"], 1),
                    "pid": pid[str(e["pid"])], "tid": tid[str(e["tid"])]})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"iteration": iteration, "policy": policy, "streams": streams, "workers": workers}}


def combine_traces(traces: dict[str, dict]) -> dict:
    """Several ``chrome_trace`` results in one trace, each under processes named after its key (a
    bench policy), so Perfetto shows them one above the other on a shared time axis from 0."""
    out, offset = [], 0
    for name, trace in traces.items():
        pids = sorted({e["pid"] for e in trace["traceEvents"]})
        for e in trace["traceEvents"]:
            e = {**e, "pid": offset + pids.index(e["pid"])}
            if e.get("name") == "process_name":
                e["args"] = {"name": f"{name}: {e['args']['name']}"}
            out.append(e)
        offset += len(pids)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"parts": list(traces)}}


def seconds_by_kind(events: list[dict]) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for e in events:
        total[e["cat"]] += e["dur"] / 1e6
    return {k: round(v, 5) for k, v in sorted(total.items())}


def intervals(trace: dict, kinds: set[str], worker=None) -> list[tuple[float, float, str]]:
    """(start, end, name) in µs of the trace's events of the given kinds (on one worker's ``pid``)."""
    return [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") in kinds and worker in (None, e.get("pid"))]


def overlap_seconds(trace: dict, a: set[str], b: set[str]) -> float:
    """Total time during which an event of kinds ``a`` and one of kinds ``b`` ran at once on the same
    worker (another worker's decode hides nothing of this one's work)."""
    total = 0.0
    for worker in {e.get("pid") for e in trace["traceEvents"] if e.get("ph") == "X"}:
        ys = _union(intervals(trace, b, worker))  # two ranks' decode at once hide a node once, not twice
        for s1, e1, _ in intervals(trace, a, worker):
            for s2, e2, _ in ys:
                total += max(0.0, min(e1, e2) - max(s1, s2))
    return total / 1e6


def _union(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    merged: list[tuple[float, float, str]] = []
    for start, end, name in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end), merged[-1][2])
        else:
            merged.append((start, end, name))
    return merged


def dispatch_gaps(events: list[dict], predecessors: dict[str, list[str]]) -> dict[str, float]:
    """The executor's own time per node, in seconds: from the moment the node could start (its last
    predecessor finished and the previous node on its worker's stream finished) to its start. On the
    Dask path that is the scheduler round trip and the worker's hand-off to the stream thread; nodes
    without predecessors (their start has no reference) are left out. ``events``: one iteration's."""
    end = {e["name"]: e["ts"] + e["dur"] for e in events}
    lanes: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        lanes[(str(e["pid"]), str(e["tid"]))].append(e)
    free: dict[str, float] = {}
    for lane in lanes.values():
        lane.sort(key=lambda e: e["ts"])
        for before, after in zip(lane, lane[1:]):
            free[after["name"]] = before["ts"] + before["dur"]
    gaps = {}
    for e in events:
        preds = [end[p] for p in predecessors.get(e["name"], ()) if p in end]
        if not preds:
            continue
        ready = max(max(preds), free.get(e["name"], 0.0))
        gaps[e["name"]] = max(0.0, e["ts"] - ready) / 1e6
    return gaps
