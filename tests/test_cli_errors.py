"""`rollplex` on bad input: exit code 2, exactly one `rollplex: error: ...` line on stderr naming the
field, engine or file, no traceback, and nothing written. Runs the real CLI in a process of its own
(forked from one that imported the stack once, tests/fork_server.py); CPU only, no engine is started
(`rollplex graph` only loads the tiny model's config to compile the DAG)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import fork_server
import pytest
from dag_fixtures import CYCLIC_DAG

BROKEN_DAG = '''\
"""A loss that reads `values`, which no node of the iteration produces."""
from rollplex import Algorithm

algorithm = Algorithm("broken")
algorithm.policy("actor")
algorithm.score("actor", as_="logprobs", grad=True)


@algorithm.advantage(scope="group")
def advantages(rewards):
    return rewards


@algorithm.loss(agg="token-mean")
def policy_loss(logprobs, values, advantages):
    return -(logprobs * advantages.unsqueeze(-1))
'''


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    created: set[str]  # paths that appeared in the working directory

    @property
    def error_line(self) -> str:
        assert "Traceback" not in self.stderr, self.stderr
        lines = self.stderr.splitlines()
        assert len(lines) == 1, f"expected one line on stderr, got:\n{self.stderr}"
        assert lines[0].startswith("rollplex: error: "), lines[0]
        return lines[0]


def rollplex(cwd: Path, *args: str, timeout: float = 120) -> Result:
    before = {p.relative_to(cwd).as_posix() for p in cwd.rglob("*")}
    env = dict(os.environ)  # conftest has set ROLLPLEX_CACHE: the tiny model is cached
    proc = fork_server.run(list(args), env=env, timeout=timeout, cwd=cwd)
    after = {p.relative_to(cwd).as_posix() for p in cwd.rglob("*")}
    return Result(proc.returncode, proc.stdout, proc.stderr, after - before)


def assert_user_error(result: Result, *names: str) -> str:
    assert result.rc == 2, (result.rc, result.stderr)
    line = result.error_line
    for name in names:
        assert name in line, f"{name!r} not named in: {line}"
    assert result.stdout == ""
    assert result.created == set(), f"bad input wrote {result.created}"
    return line


# -- config errors: these fail before any model or engine is touched -----------------------------------
def test_malformed_yaml_names_the_file_line_and_column(tmp_path):
    (tmp_path / "bad.yaml").write_text("rollout:\n  temperature: [1\nseed: 3\n")
    line = assert_user_error(rollplex(tmp_path, "graph", "bad.yaml", "--out", "graph.html"), "bad.yaml")
    assert "malformed YAML at line 3, column 5" in line


def test_unknown_field_in_a_file_suggests_the_right_one(tmp_path):
    (tmp_path / "run.yaml").write_text("rollout:\n  temprature: 0.5\n")
    line = assert_user_error(rollplex(tmp_path, "train", "run.yaml", "--out", "run"), "rollout.temprature")
    assert line.endswith("did you mean 'temperature'?")


def test_out_of_range_override_names_field_and_bound(tmp_path):
    line = assert_user_error(rollplex(tmp_path, "train", "--set", "rollout.top_p=2", "--out", "run"), "rollout.top_p")
    assert line == "rollplex: error: rollout.top_p: 2.0 is above the maximum 1.0"


def test_override_without_a_value(tmp_path):
    assert_user_error(rollplex(tmp_path, "graph", "--set", "seed", "--out", "graph.html"), "--set 'seed'", "KEY=VALUE")


# -- errors found while compiling the graph ------------------------------------------------------------
def test_unknown_engine_is_named(tmp_path):
    result = rollplex(tmp_path, "graph", "--set", "engines.decode=nope", "--out", "graph.html")
    line = assert_user_error(result, "'nope'")
    assert "unknown engine" in line and "vllm" in line  # lists the engines it knows


def test_missing_dag_file_is_named(tmp_path):
    result = rollplex(tmp_path, "graph", "nowhere.py", "--format", "json", "--out", "graph.json")
    assert assert_user_error(result, "nowhere.py") == "rollplex: error: DAG file nowhere.py does not exist"


@pytest.fixture(scope="module")
def broken_dag_run(tmp_path_factory) -> Result:
    cwd = tmp_path_factory.mktemp("broken_dag")
    (cwd / "broken.py").write_text(BROKEN_DAG)
    return rollplex(cwd, "graph", "broken.py", "--format", "json", "--out", "graph.json")


def test_invalid_algorithm_names_the_value_nothing_produces(broken_dag_run):
    line = assert_user_error(broken_dag_run, "policy_loss()", "'values'", "broken")
    assert "nothing produces" in line and "logprobs" in line  # and what it could read instead


def test_invalid_algorithm_names_the_dag_file(broken_dag_run):
    assert_user_error(broken_dag_run, "broken.py")




def test_cyclic_user_dag_names_the_cycle_node_by_node(tmp_path):
    (tmp_path / "cyclic.py").write_text(CYCLIC_DAG)
    line = assert_user_error(rollplex(tmp_path, "graph", "cyclic.py", "--out", "graph.html"), "cycle")
    assert "%bonus_p0" in line and "%penalty_p0" in line


def test_dag_file_that_fails_to_import_is_one_line(tmp_path):
    (tmp_path / "bad_import.py").write_text("import no_such_module_anywhere\n")
    line = assert_user_error(rollplex(tmp_path, "graph", "bad_import.py", "--out", "g.html"), "bad_import.py")
    assert "no_such_module_anywhere" in line


# -- the same commands succeed on good input (so the checks above are not vacuous) ---------------------
def test_good_input_exits_zero_and_writes_the_graph(tmp_path):
    result = rollplex(tmp_path, "graph", "--format", "json", "--out", "graph.json", "--schedule", "serial")
    assert result.rc == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.created == {"graph.json"} and result.stdout.startswith("wrote graph.json (")


def test_help_and_engines_exit_zero(tmp_path):
    help_ = rollplex(tmp_path, "--help", timeout=30)
    assert help_.rc == 0 and "graph" in help_.stdout and "engines" in help_.stdout
    engines = rollplex(tmp_path, "engines", timeout=60)
    assert engines.rc == 0 and engines.stdout.startswith("role") and "vllm" in engines.stdout
    assert help_.created == engines.created == set()


TEARDOWN = '''
import argparse, asyncio, gc, sys
from rollplex import cli
from rollplex.errors import Interrupted

left = []


def stopped(args):
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(TimeoutError("Timeout"))  # what a Dask close that timed out leaves behind
    left.append(future)
    raise Interrupted("SIGINT: stopped after iteration 0, checkpoint iter_000000 written", 2)


cli.build_parser = lambda: argparse.Namespace(parse_args=lambda argv: argparse.Namespace(fn=stopped))
code = cli.main([])
left.clear()
gc.collect()  # the future is collected after the command's line, as at the end of a stopped run
sys.exit(code)
'''


def test_a_stopped_run_prints_its_line_last_whatever_the_teardown_left():
    """A Ctrl-C's one line is the last thing on stderr: a future that Dask's teardown left holding an
    exception does not print a traceback after it when collected (CI saw one in test_kill)."""
    done = subprocess.run([sys.executable, "-c", TEARDOWN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130
    assert done.stderr.strip().splitlines()[-1].startswith("rollplex: SIGINT: stopped"), done.stderr
    assert "never retrieved" not in done.stderr
