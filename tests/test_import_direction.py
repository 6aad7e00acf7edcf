"""The rooms import one way (docs/architecture.md):

    dags ──▶ compile ◀── plan ◀── run ◀── bench          (cli: any)
                            │        │
                            ▼        ▼
                         engines ◀── tasks

engines/ and tasks/ import neither the planners nor the runtime, plan/ never the runtime, and
compile/ only itself. Every import counts, those inside functions too: a lazy import is still a
dependency. A few leaf modules of the root package (errors, fsio, runtime) serve every room.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEAVES = {"errors", "fsio", "runtime", "_compat"}
ALLOWED = {
    "compile": {"compile"},
    "plan": {"compile", "plan", "engines"},
    "run": {"compile", "plan", "run", "engines", "tasks", "dags", "config"},
    "bench": {"compile", "plan", "run", "bench", "engines", "tasks", "dags", "config"},
    "engines": {"engines"},
    "tasks": {"tasks", "engines"},
    "dags": {"compile", "dags"},
    "dags/examples": {"compile", "dags", "tasks", "engines"},  # a node kind of a user's own computes with them
}


def room_of_module(dotted: str) -> str | None:
    """The room of an imported ``rollplex...`` module; None for a leaf or the CLI."""
    parts = dotted.split(".")
    if parts[0] != "rollplex":
        return None
    if len(parts) == 1:
        return "compile"  # rollplex/__init__ exports the authoring API
    if parts[1] == "pipeline":
        return parts[2] if len(parts) > 2 else "pipeline"
    if parts[1] in LEAVES:
        return None
    if parts[1] in ("engines", "tasks", "dags", "config"):
        return parts[1]
    return "cli"


def room_of_file(path: Path) -> str | None:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "pipeline" and len(rel) > 2:
        return rel[1]
    if rel[0] == "dags":
        return "dags/examples" if len(rel) > 2 and rel[1] == "examples" else "dags"
    if rel[0] in ("engines", "tasks"):
        return rel[0]
    return None


def _folder(parts: list[str]) -> list[str]:
    """The source folder of a ``rollplex...`` package: rollplex.pipeline.run is pipeline/run."""
    return parts if parts[:1] != ["rollplex"] or len(parts) == 1 else parts[1:]


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from rollplex.pipeline.run import session` imports a module; `from rollplex import
            # Algorithm` a name
            folder = ROOT.joinpath(*_folder(node.module.split(".")))
            subs = [a.name for a in node.names if (folder / f"{a.name}.py").exists() or (folder / a.name).is_dir()]
            out += [(node.lineno, f"{node.module}.{s}") for s in subs] or [(node.lineno, node.module)]
    return out


def wrong_directions() -> list[str]:
    wrong = []
    for path in sorted(ROOT.glob("**/*.py")):
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        room = room_of_file(path)
        if room is None:
            continue
        for line, module in imports(path):
            target = room_of_module(module)
            if target is not None and target not in ALLOWED[room]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {room} imports {module} ({target})")
    return wrong


def test_every_import_flows_the_one_way():
    assert wrong_directions() == []


def test_the_check_sees_a_wrong_direction(tmp_path, monkeypatch):
    """The checker itself: an engine that imports the scheduler is reported, naming file and line."""
    fake = ROOT / "engines" / "_direction_probe.py"
    fake.write_text("def f():\n    from rollplex.pipeline.plan.schedule import schedule\n")
    try:
        assert wrong_directions() == [
            "engines/_direction_probe.py:2: engines imports rollplex.pipeline.plan.schedule (plan)"]
    finally:
        fake.unlink()


def test_compile_imports_without_torch():
    """The compile room (IR, authoring, compiler, ranks, render) loads where torch is absent."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import rollplex.pipeline.compile.compiler, rollplex.pipeline.compile.ranks, "
            "rollplex.pipeline.compile.render, rollplex.pipeline.compile.authoring\n"
            "assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
