"""``rollplex``: train, render the iteration graph, list engines, plot a run, export the task.

Bad input (config, DAG, engine names, checkpoints) prints one line and exits with code 2.
Heavy libraries are imported inside the commands, so ``rollplex --help`` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollplex.errors import ConfigError, Interrupted, RollplexError


def _config_from(args, base: Path | None = None) -> "object":
    from rollplex.config import load_config

    overrides = list(args.set or [])
    config_path = getattr(args, "config", None)
    dag_file = None
    if config_path and config_path.endswith(".py"):  # a DAG file instead of a config
        dag_file, config_path = config_path, None
    config_path = config_path or base
    for flag in ("schedule", "iterations", "seed"):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{flag}={value}")
    if getattr(args, "scheduler", None):
        overrides.append(f"cluster.scheduler={args.scheduler}")
    if getattr(args, "workers", None) is not None:
        overrides.append(f"cluster.workers={args.workers}")
    if getattr(args, "dashboard", False):
        overrides.append("cluster.dashboard=true")
    cfg = load_config(config_path, overrides, checksummed=base is not None and config_path == base)
    if dag_file is not None:
        cfg.algorithm = dag_file  # a path, taken as is (not through YAML)
    return cfg


def cmd_train(args) -> int:
    from rollplex.runtime import request_cuda_allocator

    if args.help_config:
        from rollplex.config import format_fields

        print(format_fields(), end="")
        return 0
    args.out = _resume_dir(args.resume, args.out)
    args.resume = bool(args.resume)
    cfg = _config_from(args)
    out = Path(args.out or f"runs/{cfg.algorithm.replace('/', '_').removesuffix('.py')}-seed{cfg.seed}")
    saved = out / "config.yaml"
    if args.resume and not (args.config or "").endswith((".yaml", ".yml")):
        if saved.is_file():
            cfg = _config_from(args, base=saved)  # continue the run as configured; flags and --set still apply
        elif (out / "checkpoints").is_dir():
            raise ConfigError(f"--resume: {saved} is missing; give the run's config file as the first argument")
    request_cuda_allocator(cfg.cluster.cuda_allocator)  # before torch loads, here and in the workers

    from rollplex.pipeline.run.runner import train

    summary = train(cfg, out, resume=args.resume, progress=not args.no_progress)
    print(f"done: {summary.iterations} iterations, mean reward of the last 10 {summary.final_reward:.3f}, "
          f"{summary.seconds_per_iteration:.3f} s/iteration → {summary.run_dir}")
    return 0


def _output_file(path: str, flag: str) -> None:
    """Refuse an output path that names the wrong kind of thing, before any work."""
    import os

    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    if not p.parent.is_dir():
        raise ConfigError(f"{flag} {path}: {p.parent} is not a directory")
    if not os.access(p.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {p.parent} is not writable (a read-only file system, or no permission)")


def _resume_dir(resume: bool | str | None, out: str | None) -> str | None:
    """The run directory of ``--resume RUN_DIR`` or ``--resume --out RUN_DIR`` (both: the same one)."""
    if not isinstance(resume, str):
        return out
    if Path(resume).is_file():  # `--resume my.yaml`: argparse took the config for the run directory
        raise ConfigError(f"--resume {resume}: a file, not a run directory; give the config first "
                          f"(rollplex train {resume} --resume RUN_DIR)")
    if out is not None and Path(out).resolve() != Path(resume).resolve():
        raise ConfigError(f"--resume {resume} and --out {out} name two run directories; give one of them")
    return resume


def cmd_graph(args) -> int:
    from rollplex.pipeline.compile.render import render
    from rollplex.pipeline.run.session import Session

    if args.out is not None:
        _output_file(args.out, "--out")
    cfg = _config_from(args)
    session = Session(cfg, Path("."))
    if args.out is None:
        print(session.graph)
        return 0
    render(session.graph, args.format, args.out)
    print(f"wrote {args.out} ({len(session.graph)} nodes, {args.format})")
    return 0


def cmd_bench(args) -> int:
    from rollplex.runtime import request_cuda_allocator

    request_cuda_allocator(args.cuda_allocator, "--cuda-allocator")  # before the bench loads torch
    from rollplex.pipeline.bench.bench import POLICIES, BenchConfig, parse_policy, run
    from rollplex.pipeline.bench.results import read_lengths

    policies = tuple(args.policies.split(",")) if args.policies else POLICIES
    for policy in policies:  # before the model is built: a typo costs nothing
        parse_policy(policy)
    lengths = (read_lengths(args.lengths, args.prompts, args.samples, args.max_new_tokens)
               if args.lengths else None)
    cfg = BenchConfig(model=args.model, prompts=args.prompts, samples=args.samples,
                      vision_tokens=args.vision_tokens, max_new_tokens=args.max_new_tokens,
                      mean_new_tokens=args.mean_new_tokens, lengths=lengths, chunk_tokens=args.chunk_tokens,
                      iterations=args.iterations, policies=policies, train_engine=args.train_engine,
                      gradient_checkpointing=args.gradient_checkpointing,
                      decode_sms=args.decode_sms, gate_rows=args.gate_rows, out=args.out, device=args.device,
                      dtype=args.dtype, layers=args.layers, prompts_per_node=args.prompts_per_node,
                      stage_fusion=not args.no_stage_fusion,
                      profile=tuple(args.profile.split(",")) if args.profile else (),
                      compile_decode=args.compile_decode, train_fusion=args.train_fusion,
                      decode_attention=args.decode_attention, decode_linear=args.decode_linear,
                      interleave=not args.sequential,
                      shared_prefix_decode=args.decode_prefix == "shared")
    run(cfg)
    return 0


def cmd_engines(args) -> int:
    import rollplex.engines  # noqa: F401 - registers the builtin engines
    from rollplex.engines.base import ROLES, engines_for

    print(f"{'role':<8} {'engine':<14} {'installed':<10} description")
    for role in ROLES:
        for spec in engines_for(role):
            state = "yes" if spec.installed() else "no (" + ", ".join(spec.missing()) + ")"
            print(f"{role:<8} {spec.name:<14} {state:<10} {spec.description}")
    return 0


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line and exit 2, like every other bad input; --help prints the usage.
    Subcommands' parsers are of this class too (argparse makes them with the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"rollplex: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rollplex", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override any config field, e.g. --set rollout.temperature=0.7 (repeatable)")

    t = sub.add_parser("train", help="train with an RL algorithm (default: GRPO on the embedded task)")
    t.add_argument("config", nargs="?", help="a YAML config (default: the embedded defaults)")
    t.add_argument("--schedule", choices=("serial", "rollplex", "auto"),
                   help="serial: phase barriers; rollplex: vision, prefix and scoring inside the decode window; "
                        "auto: time both first, keep the faster (the config's `schedule`)")
    t.add_argument("--iterations", type=int, metavar="N", help="RL iterations to run (the config's `iterations`)")
    t.add_argument("--seed", type=int, help="run seed: data order, sampling, init (the config's `seed`)")
    t.add_argument("--help-config", action="store_true",
                   help="print every config field with its type, default and meaning, and exit")
    t.add_argument("--out", help="run directory (default: runs/<algorithm>-seed<seed>)")
    t.add_argument("--scheduler", metavar="tcp://HOST:PORT", help="use an existing Dask cluster")
    t.add_argument("--workers", type=int, metavar="N",
                   help="data-parallel ranks, one Dask worker each (LocalCluster starts N; with --scheduler, "
                        "the cluster must have N workers); docs/distributed.md")
    t.add_argument("--dashboard", action="store_true", help="serve the Dask dashboard and print its address")
    t.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (or --out) from its last checkpoint")
    t.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    common(t)
    t.set_defaults(fn=cmd_train)

    g = sub.add_parser("graph", help="render the compiled iteration DAG")
    g.add_argument("config", nargs="?", help="a YAML config or a DAG .py file")
    g.add_argument("--format", choices=("dot", "svg", "html", "json"), default="html")
    g.add_argument("--out", help="output file (default: print the node table)")
    g.add_argument("--schedule", choices=("serial", "rollplex"))
    common(g)
    g.set_defaults(fn=cmd_graph)

    b = sub.add_parser("bench", help="GRPO iterations of a VLM-shaped model under each policy, side by side")
    b.add_argument("--model", default="qwen2.5-vl-3b", help="preset (qwen2.5-vl-3b/7b/32b) or a config.json")
    b.add_argument("--prompts", type=int, default=8)
    b.add_argument("--samples", type=int, default=8)
    b.add_argument("--vision-tokens", type=int, default=1024, help="merged vision tokens per prompt")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--mean-new-tokens", type=int, default=96, help="centre of the long-tailed length spread")
    b.add_argument("--lengths", metavar="FILE",
                   help="JSON: per prompt, its samples' response caps, the same every iteration (a train run's "
                        "rollout.length_caps; benchmarks/train_vs_bench.py writes them) instead of fresh draws")
    b.add_argument("--chunk-tokens", type=int, default=32)
    b.add_argument("--iterations", type=int, default=7,
                   help="per policy; the first is a warm-up, and a 95%% interval needs 6 timed ones")
    b.add_argument("--policies", help="comma-separated, from plain,serial-noshare,serial,rollplex (one GPU; the "
                                      "default, with serial#aa, serial once more: the A/A noise floor), "
                                      "rollplex-nofusion (one GPU) and disaggregated,disaggregated-noshare,"
                                      "rollplex-dp2 (two GPUs); a rollplex policy takes options, e.g. rollplex:gate=32:sms=64 "
                                      "(gate: prefix work waits for at most that many decode rows; sms: decode's "
                                      "SMs beside compute work, 0 per chunk)")
    b.add_argument("--train-engine", default="torch", choices=("torch", "deepspeed"))
    b.add_argument("--gradient-checkpointing", action="store_true",
                   help="every policy's training forwards recompute the decoder layers' activations in the "
                        "backward (train.gradient_checkpointing)")
    b.add_argument("--decode-sms", type=int, default=0, help="SMs for decode while prefix work runs (0: re-chosen per decode chunk "
                                                                 "from the live batch: ≤8 rows 32, ≤32 rows 64, else 96)")
    b.add_argument("--gate-rows", type=int, default=0,
                   help="rollplex: prefix work joins decode once at most this many rows decode (0: at once)")
    b.add_argument("--prompts-per-node", type=int, default=1,
                   help="prompts per vision, prefix and suffix node (batched forwards; ViT batching)")
    b.add_argument("--no-stage-fusion", action="store_true",
                   help="rollplex: score the reference after the last decode chunk, not per chunk")
    b.add_argument("--train-fusion", action="store_true",
                   help="rollplex: the policy also trains on each chunk's finished groups inside the decode window")
    b.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="the decode engine's layer through torch.compile, compiled at start (default: on for "
                        "CUDA, where it made a step 1.5x faster; off for CPU)")
    b.add_argument("--decode-linear", default="cublas", choices=("cublas", "skinny", "skinny-norm"),
                   help="the decode step's projections: cuBLAS, or the Triton kernel of engines/skinny_linear.py "
                        "(skinny-norm: with the residual add, RMS norm and SiLU product in its launches; CUDA)")
    b.add_argument("--decode-attention", default="auto", choices=("auto", "fused", "split-kv", "sdpa"),
                   help="the decode step's attention: split-kv reads each row's filled KV slots only (CUDA "
                        "with Triton), fused does so with the rotary and the cache write in the kernel, sdpa "
                        "reads every slot under a length mask; auto: fused where it can run, else split-kv")
    b.add_argument("--decode-prefix", default="shared", choices=("shared", "per-row"),
                   help="the decode cache holds each prompt's KV once for its samples (shared; a step reads it "
                        "once per group), or a copy in each sample's row")
    b.add_argument("--sequential", action="store_true",
                   help="run each one-GPU policy's iterations in a row (default: they take turns per iteration)")
    b.add_argument("--profile", metavar="POLICIES", help="run these policies once more under torch.profiler "
                                                          "(untimed) and write profile_<policy>.txt")
    b.add_argument("--cuda-allocator", default="native", choices=("native", "async"),
                   help="native: torch's caching allocator (blocks cached per stream); async: cudaMallocAsync, "
                        "one stream-ordered pool that every stream and SM partition shares")
    b.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    b.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    b.add_argument("--layers", type=int, help="override the preset's depth (smoke runs)")
    b.add_argument("--out", default="bench",
                   help="directory for bench.json, trace.json (Perfetto, every policy) and bench.png")
    b.set_defaults(fn=cmd_bench)

    e = sub.add_parser("engines", help="list the registered engines per role and whether each is installed")
    e.set_defaults(fn=cmd_engines)

    from rollplex.commands_simulate import add_parser as add_simulate  # light: heavy imports are inside

    add_simulate(sub)
    from rollplex.commands_data import add_parsers as add_data_commands  # plot, export-task

    add_data_commands(sub)
    from rollplex.commands_weights import add_parser as add_weights  # weight sharing report

    add_weights(sub)
    return parser


def _run_is_over() -> None:
    """Dask's teardown can leave an asyncio future holding an exception (a close that timed out);
    collected later, asyncio logs it as a traceback after the command's last line. The command has
    said what happened: nothing of its engines' teardown is printed after it."""
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Interrupted as exc:  # not an error: a requested stop, resumable
        print(f"rollplex: {exc}", file=sys.stderr)
        return exc.exit_code
    except RollplexError as exc:
        print(f"rollplex: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("rollplex: interrupted", file=sys.stderr)
        return 130
    finally:  # after the command's last line
        _run_is_over()


if __name__ == "__main__":
    sys.exit(main())
