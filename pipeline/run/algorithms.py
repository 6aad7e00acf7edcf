"""Find an algorithm: a module in ``rollplex.dags`` by name, or a user's DAG file by path.

A DAG file is Python code and runs with the user's rights (see the README's trust model). It must
define one ``Algorithm``, conventionally bound to the name ``algorithm``.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

from rollplex.errors import GraphError
from rollplex.pipeline.compile.authoring import Algorithm


def builtin_algorithms() -> list[str]:
    import rollplex.dags

    return sorted(m.name for m in pkgutil.iter_modules(rollplex.dags.__path__) if not m.name.startswith("_"))


def _pick(module, where: str) -> Algorithm:
    found = getattr(module, "algorithm", None)
    candidates = [found] if isinstance(found, Algorithm) else [v for v in vars(module).values()
                                                                if isinstance(v, Algorithm)]
    if len(candidates) == 1:
        try:
            return candidates[0].validate()
        except GraphError as exc:
            raise GraphError(f"{where}: {exc}") from None
    if not candidates:
        raise GraphError(f"{where} defines no Algorithm; create one with rollplex.Algorithm(...)")
    raise GraphError(f"{where} defines {len(candidates)} Algorithms; bind the one to run to `algorithm`")


def load_algorithm(ref: str) -> Algorithm:
    if ref.endswith(".py") or "/" in ref:
        path = Path(ref)
        if not path.exists():
            raise GraphError(f"DAG file {path} does not exist")
        if not path.is_file():
            raise GraphError(f"DAG file {path} is a directory, not a Python file")
        name = "rollplex_user_dag_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
        if name in sys.modules:
            return _pick(sys.modules[name], str(path))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except GraphError as exc:
            sys.modules.pop(name, None)
            raise GraphError(f"{path}: {exc}") from None
        except SyntaxError as exc:
            sys.modules.pop(name, None)
            raise GraphError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
        except Exception as exc:  # noqa: BLE001 - user code: report it as one line naming the file
            sys.modules.pop(name, None)
            raise GraphError(f"{path}: importing the DAG file failed: {type(exc).__name__}: {exc}") from None
        return _pick(module, str(path))
    known = builtin_algorithms()
    if ref not in known:
        raise GraphError(f"unknown algorithm {ref!r}; built in: {', '.join(known)}; or give a path to a .py DAG file")
    return _pick(importlib.import_module(f"rollplex.dags.{ref}"), f"rollplex.dags.{ref}")
