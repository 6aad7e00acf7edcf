"""Where the vLLM decode engine's time goes in the default job's iteration: ``add_requests`` (the
renderer turns each prompt's image embeddings into vLLM inputs), and each engine step (the first
one prefills every sample's prompt). The default config's iterations run in this process on one
``WorkerHost`` (the local executor), with the decode engine's calls timed; the first two are left out.

    python benchmarks/vllm_steps.py --iterations 6
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="config overrides, as for rollplex train")
    args = ap.parse_args()

    from rollplex import runtime

    runtime.configure(threads=1, device="cpu")
    from rollplex.config import load_config
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.pipeline.run.session import Session
    from rollplex.pipeline.run.worker import WorkerHost

    cfg = load_config(None, ["warmup.steps=0", "engines.decode=vllm", *args.set])
    session = Session(cfg, Path(tempfile.mkdtemp(prefix="rollplex-vllm-steps-")))
    host = WorkerHost(session.host_spec(), name="probe")
    engine = host.decode
    times: dict[str, list[list[float]]] = {"add_requests": [], "engine steps": []}

    def timed(fn, into: str):
        def call(*a):
            start = time.perf_counter()
            out = fn(*a)
            times[into][-1].append(time.perf_counter() - start)
            return out
        return call

    engine.add_requests = timed(engine.add_requests, "add_requests")
    engine._engine.step = timed(engine._engine.step, "engine steps")
    block_size = engine._engine.vllm_config.cache_config.block_size
    executor = LocalExecutor(host)
    try:
        for it in range(args.iterations):
            for v in times.values():
                v.append([])
            batch = session.loader.next_batch()
            executor.run(session.graph, it, {f"prompt_p{p}": x for p, x in enumerate(batch)})
    finally:
        host.close()
    steps = times["engine steps"][args.skip:]
    print(f"{cfg.rollout.prompts_per_iteration} prompts x {cfg.rollout.samples_per_prompt} samples, "
          f"{cfg.rollout.max_new_tokens} new tokens; block size "
          f"{block_size}; medians over {len(steps)} iterations (ms)")
    print(f"add_requests per iteration {1e3 * statistics.median(sum(v) for v in times['add_requests'][args.skip:]):.1f}")
    print(f"first engine step (prefill) {1e3 * statistics.median(v[0] for v in steps):.1f}")
    print(f"later engine steps, each {1e3 * statistics.median(x for v in steps for x in v[1:]):.1f} "
          f"({statistics.median(len(v) - 1 for v in steps):.0f} per iteration)")
    print(f"engine steps per iteration {1e3 * statistics.median(sum(v) for v in steps):.1f}")


if __name__ == "__main__":
    main()
