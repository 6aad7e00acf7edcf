"""One policy's nodes from a ``rollplex bench`` trace (its last timed iteration), or two policies'
node by node: the decode window read as a table instead of in Perfetto.

    python benchmarks/trace_nodes.py benchmarks/results/2026-11-30-h200-trace-run28-1024.json rollplex:ppn=8:mb=2:tf=1:sp=0
    python benchmarks/trace_nodes.py TRACE POLICY OTHER_POLICY     # durations side by side, sums per kind
"""
from __future__ import annotations

import argparse
import json

LANES = {0: "compute", 1: "decode", 2: "host"}


def nodes(trace: dict | list, policy: str) -> list[dict]:
    """The policy's node events, by start time: {name, lane, start_s, ms}."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    pids = [pid for pid, name in names.items() if name.split(": ")[0] == policy]
    if not pids:
        raise SystemExit(f"trace_nodes: no policy {policy!r} in the trace; it has: {', '.join(sorted(n.split(': ')[0] for n in names.values()))}")
    out = [{"name": e["name"], "lane": LANES.get(e["tid"], str(e["tid"])), "start_s": e["ts"] / 1e6,
            "ms": e["dur"] / 1e3} for e in events if e.get("ph") == "X" and e["pid"] == pids[0]]
    return sorted(out, key=lambda n: n["start_s"])


def kind(name: str) -> str:
    """train_c7 -> train, suffix_ref_logprobs_c2 -> suffix_ref_logprobs, prefix_actor_p0-1 -> prefix_actor."""
    for cut in ("_c", "_p", "_m"):
        head, sep, tail = name.rpartition(cut)
        if sep and tail[:1].isdigit():
            return head
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("policy")
    ap.add_argument("other", nargs="?")
    ap.add_argument("--min-ms", type=float, default=1.0, help="leave out nodes shorter than this")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    mine = nodes(trace, args.policy)
    if args.other is None:
        for n in mine:
            if n["ms"] >= args.min_ms:
                print(f"{n['lane']:8s} {n['start_s']:8.3f} s {n['ms']:9.1f} ms  {n['name']}")
        return
    theirs = {n["name"]: n["ms"] for n in nodes(trace, args.other)}
    sums: dict[str, list[float]] = {}
    print(f"{'node':32s} {'ms':>9s} {'other ms':>9s}")
    for n in mine:
        if n["name"] in theirs and max(n["ms"], theirs[n["name"]]) >= args.min_ms:
            print(f"{n['name']:32s} {n['ms']:9.1f} {theirs[n['name']]:9.1f}")
            total = sums.setdefault(kind(n["name"]), [0.0, 0.0])
            total[0] += n["ms"]
            total[1] += theirs[n["name"]]
    print("\nsummed per kind (s):")
    for k, (a, b) in sorted(sums.items()):
        print(f"  {k:30s} {a / 1e3:7.2f} {b / 1e3:7.2f}")


if __name__ == "__main__":
    main()
