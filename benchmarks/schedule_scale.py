"""How long compiling and scheduling a large iteration DAG takes on this CPU (issue 3: a 10k-node
iteration DAG compiles and schedules in under 1 s).

For each size: ``compile_iteration`` of GRPO, the runner's ``schedule(graph, policy)`` (streams and
critical-path priorities), and the full ``plan(graph, cluster, costs, policy)`` (placement and
predicted times on the lanes of every GPU). Wall and process CPU time are both printed: the
machine may be shared. All three pause Python's cyclic GC while they run (``ir.gc_paused``). The
cost model is built once per size outside the timings (its decode profile samples every response length), so the
times are the graph work alone.

    python benchmarks/schedule_scale.py                 # ~10k nodes, rollplex and serial, 8 H200s
    python benchmarks/schedule_scale.py --prompts 200 1420 --gpus 32 --json /tmp/scale.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1420], help="P per size (1420 → ~10k nodes)")
    ap.add_argument("--policies", nargs="+", default=["rollplex", "serial"])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    from rollplex.dags.grpo import grpo
    from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
    from rollplex.pipeline.plan.costs import CostModel, Workload
    from rollplex.pipeline.plan.hardware import Layout, hardware
    from rollplex.engines.modelspec import PRESETS
    from rollplex.pipeline.plan.schedule import plan, schedule

    model = PRESETS["qwen2.5-vl-7b"]
    cluster = hardware("h200", args.gpus)
    layout = Layout.colocate(cluster)
    dims = ModelDims.of(model, 2)
    engines = EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"})
    rows = []
    for P in args.prompts:
        w = Workload(prompts=P, samples=8, max_new_tokens=512, chunk_tokens=32)
        costs = CostModel(model, cluster, w, layout)
        shape = BatchShape(prompts=P, samples=w.samples, max_new_tokens=w.max_new_tokens, chunk_tokens=w.chunk_tokens,
                           micro_batch_groups=layout.train_dp, prompt_tokens=w.prefix_tokens,
                           vision_tokens=w.vision_total, stage_fusion=True)
        for policy in args.policies:
            times: dict[str, list[float]] = {k: [] for k in ("compile", "schedule", "plan", "compile_cpu",
                                                              "schedule_cpu", "plan_cpu")}
            for _ in range(args.repeat):
                marks = [(time.perf_counter(), time.process_time())]
                # stage fusion as the rollplex schedule compiles it; serial's shape leaves it out
                graph = compile_iteration(grpo, shape if policy == "rollplex" else replace(shape, stage_fusion=False),
                                          engines, dims)
                marks.append((time.perf_counter(), time.process_time()))
                schedule(graph, policy)
                marks.append((time.perf_counter(), time.process_time()))
                planned = plan(graph, cluster, costs, policy, layout)
                marks.append((time.perf_counter(), time.process_time()))
                for k, (a, b) in zip(("compile", "schedule", "plan"), zip(marks, marks[1:])):
                    times[k].append(b[0] - a[0])
                    times[k + "_cpu"].append(b[1] - a[1])
            row = {"prompts": P, "nodes": len(graph), "policy": policy, "gpus": args.gpus,
                   "predicted_makespan_s": planned.makespan,
                   **{f"{k}_s": statistics.median(v) for k, v in times.items()}}
            rows.append(row)
            print(f"{row['nodes']:6d} nodes  {policy:<9} wall: compile {row['compile_s']:.3f}s + schedule "
                  f"{row['schedule_s']:.3f}s + plan on {args.gpus} GPUs {row['plan_s']:.3f}s | cpu: compile "
                  f"{row['compile_cpu_s']:.3f}s + schedule {row['schedule_cpu_s']:.3f}s + plan "
                  f"{row['plan_cpu_s']:.3f}s → compile+plan {row['compile_cpu_s'] + row['plan_cpu_s']:.3f}s cpu "
                  f"(median of {args.repeat})")
    if args.json:
        from rollplex.fsio import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
