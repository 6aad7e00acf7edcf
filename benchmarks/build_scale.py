"""How building, printing and running the bookkeeping of an iteration graph grow with the batch.

For each P (GRPO, G samples, the 7B preset's dimensions, the default config otherwise, prompts of the
7B workload's length, batched per node as on a GPU), both schedules as ``rollplex train`` builds them
(``plan.build.build_iteration`` of ``session.iteration_spec``: compile, distribute, schedule; stage
fusion under rollplex):

- build: compile + distribute + schedule;
- print: ``str(graph)``, the one-line-per-node table;
- executor: ``LocalExecutor.run`` of one iteration on hosts whose tasks do nothing (the first run
  builds the graph's tables, ``pipeline/run/tables.py``; the steady runs reuse them), and the Dask
  lowering of one iteration (``executor.lower``, the per-node path), so what is timed is the
  executor's own bookkeeping, not node work.

Each is the median of ``--repeat`` runs, in seconds and in milliseconds per prompt: linear growth
keeps the per-prompt column flat. Wall time; the machine may be shared.

    python benchmarks/build_scale.py                       # P = 64, 256, 512
    python benchmarks/build_scale.py --set train.prompts_per_node=1 --json /tmp/build_scale.json  # larger graphs
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import Future


class NullHost:
    """A host whose every node finishes at once with empty outputs: only the executor runs."""

    name = "null"

    def submit(self, stream, fn, host, node, iteration, inputs, values) -> Future:
        done: Future = Future()
        done.set_result(dict.fromkeys(node.outputs))
        return done

    def drain(self) -> dict:
        return {"events": [], "peak_memory_bytes": 0}


def timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--policies", nargs="+", default=["rollplex", "serial"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    ap.add_argument("--json")
    args = ap.parse_args()

    from rollplex.config import load_config
    from rollplex.dags.grpo import grpo
    from rollplex.engines.modelspec import load_model
    from rollplex.pipeline.compile.compiler import EngineChoice, ModelDims
    from rollplex.pipeline.plan.costs import Workload
    from rollplex.pipeline.run.executor import lower
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.plan.build import build_iteration
    from rollplex.pipeline.run.session import iteration_spec

    m = load_model("qwen2.5-vl-7b")
    dims = ModelDims.of(m, 2)
    w = Workload()
    choice = EngineChoice({"decode": "torch-graph", "train": "deepspeed", "score": "transformers"})
    rows = []
    print(f"{'P':>5} {'policy':<9} {'nodes':>6} {'values':>6} | {'build s':>8} {'print s':>8} {'local 1st':>9} "
          f"{'local s':>8} {'lower s':>8} | ms/prompt: {'build':>6} {'print':>6} {'local':>6} {'lower':>6}")
    for P in args.prompts:
        cfg = load_config(None, [f"rollout.prompts_per_iteration={P}", f"rollout.samples_per_prompt={args.samples}",
                                 *args.set])
        spec = iteration_spec(cfg, dims, w.prefix_tokens, w.vision_total, "cuda", choice)
        for policy in args.policies:
            build, built = timed(lambda: build_iteration(grpo, spec.under(policy), dims), args.repeat)
            graph = built.graph
            printing, _ = timed(lambda: str(graph), args.repeat)
            inputs = graph.feed([None] * P)
            executor = LocalExecutor(NullHost())
            first, _ = timed(lambda: executor.run(graph, 0, inputs), 1)
            local, _ = timed(lambda: executor.run(graph, 1, inputs), args.repeat)
            lowering, _ = timed(lambda: lower(graph, 2, inputs), args.repeat)
            row = {"prompts": P, "policy": policy, "nodes": len(graph), "values": len(graph.values),
                   "build_s": build, "print_s": printing, "local_first_s": first, "local_s": local,
                   "lower_s": lowering}
            rows.append(row)
            per = {k: 1e3 * row[f"{k}_s"] / P for k in ("build", "print", "local", "lower")}
            print(f"{P:5d} {policy:<9} {len(graph):6d} {len(graph.values):6d} | {build:8.3f} {printing:8.3f} "
                  f"{first:9.3f} {local:8.3f} {lowering:8.3f} | {'':11}{per['build']:6.2f} {per['print']:6.2f} "
                  f"{per['local']:6.2f} {per['lower']:6.2f}")
    for policy in args.policies:  # growth from the smallest P to the largest against the prompts' growth
        mine = [r for r in rows if r["policy"] == policy]
        lo, hi = mine[0], mine[-1]
        if hi["prompts"] > lo["prompts"]:
            growth = {k: hi[f"{k}_s"] / lo[f"{k}_s"] for k in ("build", "print", "local", "lower")}
            print(f"{policy}: P x{hi['prompts'] / lo['prompts']:.0f} -> " + ", ".join(
                f"{k} x{g:.1f}" for k, g in growth.items()))
    if args.json:
        from rollplex.fsio import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
