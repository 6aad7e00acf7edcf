"""Multi-turn settings on bad input: exit code 2, one line naming the field, nothing written (the
real CLI in a process of its own, as tests/test_cli_errors.py runs it)."""
from __future__ import annotations

import pytest
from test_cli_errors import assert_user_error, rollplex

ZOOM = ("--set", "task.name=zoom")


@pytest.mark.parametrize("args, names, says", [
    (("--set", "rollout.max_turns=2"), ("rollout.max_turns",), "need an environment"),
    (("--set", "rollout.max_turns=0"), ("rollout.max_turns",), "below the minimum 1"),
    ((*ZOOM, "--set", "env.name=zoom"), ("env.name",), "rollout.max_turns is 1"),
    ((*ZOOM, "--set", "rollout.max_turns=2", "--set", "env.timeout_s=0"), ("env.timeout_s",), "below the minimum"),
    ((*ZOOM, "--set", "rollout.max_turns=2", "--set", "cluster.tp_rollout=2", "--set", "cluster.workers=2",
      "--set", "engines.decode=torch-graph"), ("engines.decode",), "multi-turn"),
    ((*ZOOM, "--set", "rollout.max_turns=2", "--set", "cluster.memory_plan=true"), ("cluster.memory_plan",),
     "multi-turn"),
    ((*ZOOM, "--set", "data.path=rows.jsonl"), ("task.name",), "data.path"),
])
def test_config_errors_name_the_field(tmp_path, args, names, says):
    line = assert_user_error(rollplex(tmp_path, "train", *args, "--out", "run"), *names)
    assert says in line


@pytest.mark.parametrize("args, names, says", [
    ((*ZOOM, "--set", "rollout.max_turns=2", "--set", "env.name=zom"), ("env.name", "'zom'"), "zoom"),
    ((*ZOOM, "--set", "rollout.max_turns=2", "--set", "env.options.size=3"), ("env.options.size",),
     "its options: reward, view"),
    ((*ZOOM, "--set", "rollout.max_turns=2", "--set", "env.options.view=30"), ("env.options.view",),
     "not a multiple of 28"),
    ((*ZOOM, "--set", "rollout.max_turns=2", "--set", "engines.decode=torch-graph"), ("engines.decode",),
     "does not continue a sequence"),
    ((*ZOOM, "--set", "rollout.max_turns=40", "--set", "rollout.max_new_tokens=64"), ("rollout.max_new_tokens",),
     "max_position_embeddings"),
])
def test_environment_errors_name_the_field_before_anything_starts(tmp_path, args, names, says):
    line = assert_user_error(rollplex(tmp_path, "graph", *args, "--out", "graph.html"), *names)
    assert says in line


def test_a_run_recorded_before_the_multi_turn_fields_resumes_as_one_turn():
    """A checkpoint's config without rollout.max_turns or env (written before they existed) is a
    single-turn run: a resume with the defaults changes nothing, one asking for turns is refused."""
    from rollplex.config import MAY_CHANGE_ON_RESUME, config_changes, load_config

    recorded = load_config(None, []).to_dict()
    del recorded["env"], recorded["rollout"]["max_turns"]
    assert config_changes(recorded, load_config(None, []).to_dict()) == {}
    turns = config_changes(recorded, load_config(None, ["task.name=zoom", "rollout.max_turns=2"]).to_dict())
    assert {k for k in turns if k not in MAY_CHANGE_ON_RESUME} == {"task.name", "rollout.max_turns"}
