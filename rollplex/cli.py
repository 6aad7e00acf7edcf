"""``rollplex``: train, render the iteration graph, list engines.

Bad input (config, DAG, engine names, checkpoints) prints one line and exits with code 2.
Heavy libraries are imported inside the commands, so ``rollplex --help`` stays fast.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollplex.errors import RollplexError


def _config_from(args) -> "object":
    from rollplex.config import load_config

    overrides = list(args.set or [])
    config_path = getattr(args, "config", None)
    dag_file = None
    if config_path and config_path.endswith(".py"):  # a DAG file instead of a config
        dag_file, config_path = config_path, None
    for flag in ("schedule", "iterations", "seed"):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{flag}={value}")
    if getattr(args, "scheduler", None):
        overrides.append(f"cluster.scheduler={args.scheduler}")
    cfg = load_config(config_path, overrides)
    if dag_file is not None:
        cfg.algorithm = dag_file  # a path, taken as is (not through YAML)
    return cfg


def cmd_train(args) -> int:
    from rollplex.pipeline.runner import train

    cfg = _config_from(args)
    out = Path(args.out or f"runs/{cfg.algorithm.replace('/', '_').removesuffix('.py')}-seed{cfg.seed}")
    summary = train(cfg, out, resume=args.resume, progress=not args.no_progress)
    print(f"done: {summary.iterations} iterations, mean reward of the last 10 {summary.final_reward:.3f}, "
          f"{summary.seconds_per_iteration:.3f} s/iteration → {summary.run_dir}")
    return 0


def cmd_graph(args) -> int:
    from rollplex.pipeline.render import render
    from rollplex.pipeline.runner import Session

    cfg = _config_from(args)
    session = Session(cfg, Path("."))
    if args.out is None:
        print(session.graph)
        return 0
    render(session.graph, args.format, args.out)
    print(f"wrote {args.out} ({len(session.graph)} nodes, {args.format})")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollplex", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--set", action="append", metavar="KEY=VALUE",
                       help="override any config field, e.g. --set rollout.temperature=0.7 (repeatable)")

    t = sub.add_parser("train", help="train with an RL algorithm (default: GRPO on the embedded task)")
    t.add_argument("config", nargs="?", help="a YAML config (default: the embedded defaults)")
    t.add_argument("--schedule", choices=("serial", "rollplex"))
    t.add_argument("--iterations", type=int)
    t.add_argument("--seed", type=int)
    t.add_argument("--out", help="run directory (default: runs/<algorithm>-seed<seed>)")
    t.add_argument("--scheduler", metavar="tcp://HOST:PORT", help="use an existing Dask cluster")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
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

    e = sub.add_parser("engines", help="list the registered engines per role and whether each is installed")
    e.set_defaults(fn=cmd_engines)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except RollplexError as exc:
        print(f"rollplex: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("rollplex: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
