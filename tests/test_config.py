"""Typed run configuration: defaults, --set overrides, errors that name the field, the dump/load round
trip, and fuzzing that nothing but ConfigError ever escapes. CPU only."""
from __future__ import annotations

import dataclasses
import re
import os
import math
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollplex.config import RunConfig, describe_fields, dump_config, load_config, validate
from rollplex.errors import ConfigError


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def assert_one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert message and len(message.splitlines()) == 1, message
    return message


# -- defaults ------------------------------------------------------------------------------------------
def test_defaults_load():
    cfg = load_config()
    assert cfg == RunConfig()
    assert (cfg.schedule, cfg.algorithm, cfg.seed) == ("rollplex", "grpo", 0)
    assert (cfg.rollout.prompts_per_iteration, cfg.rollout.chunk_tokens, cfg.rollout.temperature) == (8, 4, 1.0)
    assert cfg.model.path is None and cfg.engines.overrides == {}
    validate(cfg)


def test_default_lists_and_dicts_are_not_shared():
    a, b = RunConfig(), RunConfig()
    a.task.kinds.append("shape")
    a.engines.overrides["decode_chunk"] = "hf"
    assert b.task.kinds == ["colour"] and b.engines.overrides == {}


@pytest.mark.parametrize("text", ["", "# only a comment\n", "rollout:\n", "rollout: null\ntrain: {}\n"])
def test_empty_files_and_sections_mean_defaults(tmp_path, text):
    assert load_config(write(tmp_path, text)) == RunConfig()


def test_every_field_is_described():
    rows = describe_fields()
    paths = [path for path, _, _, _ in rows]
    assert len(paths) == len(set(paths))
    assert {"seed", "rollout.temperature", "engines.decode", "train.betas"} <= set(paths)
    assert all(path.count(".") <= 1 for path in paths)


# -- overrides -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, path, expected", [
    ("rollout.temperature=0.7", "rollout.temperature", 0.7),
    ("rollout.temperature=1", "rollout.temperature", 1.0),  # an int is a fine float
    ("train.lr=1e-4", "train.lr", 1e-4),  # YAML 1.1 would read this as a string
    ("train.lr=2.5E-3", "train.lr", 2.5e-3),
    ("seed=7", "seed", 7),
    ("iterations=1_000", "iterations", 1000),
    ("train.prefix_sharing=false", "train.prefix_sharing", False),
    ("task.kinds=[colour, shape]", "task.kinds", ["colour", "shape"]),
    ("train.betas=[0.8, 0.95]", "train.betas", [0.8, 0.95]),
    ("stop_at_reward=null", "stop_at_reward", None),
    ("stop_at_reward=0.9", "stop_at_reward", 0.9),
    ("model.path=~", "model.path", None),
    ("model.path=/models/qwen", "model.path", "/models/qwen"),
    ("cluster.scheduler=tcp://10.0.0.1:8786", "cluster.scheduler", "tcp://10.0.0.1:8786"),
    ("engines.overrides.decode_chunk=hf", "engines.overrides", {"decode_chunk": "hf"}),
    ("engines.decode_options={max_num_seqs: 4, enforce_eager: true}", "engines.decode_options",
     {"max_num_seqs": 4, "enforce_eager": True}),
    ("params.kl_coef=0.0", "params", {"kl_coef": 0.0}),
    ("params.kl_coef=3e-2", "params", {"kl_coef": 0.03}),
    ("algorithm=dags/my_ppo.py", "algorithm", "dags/my_ppo.py"),
    ("task.reward=a=b", "task.reward", "a=b"),  # only the first '=' splits
    (" seed = 3", "seed", 3),
])
def test_override_sets_one_typed_field(override, path, expected):
    cfg = load_config(None, [override])
    section, _, name = path.rpartition(".")
    got = getattr(getattr(cfg, section) if section else cfg, name)
    assert got == expected and type(got) is type(expected)
    # ... and nothing else.
    fresh = dataclasses.asdict(RunConfig())
    changed = dataclasses.asdict(cfg)
    (fresh[section] if section else fresh)[name] = expected
    assert changed == fresh


def test_overrides_apply_over_the_file_in_order(tmp_path):
    path = write(tmp_path, "seed: 3\nrollout:\n  temperature: 0.5\n  top_p: 0.9\n")
    cfg = load_config(path, ["rollout.temperature=0.25", "seed=4", "seed=5"])
    assert (cfg.seed, cfg.rollout.temperature, cfg.rollout.top_p) == (5, 0.25, 0.9)


def test_override_into_a_value_is_refused_by_name(tmp_path):
    path = write(tmp_path, "seed: 3\n")
    with pytest.raises(ConfigError, match=r"--set 'seed.x=1': 'seed' is a value, not a section"):
        load_config(path, ["seed.x=1"])


@pytest.mark.parametrize("override, message", [
    ("seed", r"--set 'seed': expected KEY=VALUE"),
    ("=3", r"--set '=3': empty key"),
    ("rollout=3", r"^rollout: expected a mapping of fields, got int$"),
])
def test_malformed_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


# -- field errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("rollout.temprature=0.5", r"unknown field rollout.temprature; did you mean 'temperature'\?"),
    ("sed=1", r"unknown field sed; did you mean 'seed'\?"),
    ("rolout.temperature=0.5", r"unknown field rolout; did you mean 'rollout'\?"),
    ("engines.decod=hf", r"unknown field engines.decod; did you mean 'decode'\?"),
    ("xyzzy=1", r"unknown field xyzzy; known fields: seed, iterations, .*checkpoint"),
])
def test_unknown_field_suggests_the_nearest(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [override])
    assert_one_line(err)


def test_unknown_field_in_a_file(tmp_path):
    path = write(tmp_path, "rollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"unknown field rollout.temprature; did you mean 'temperature'\?"):
        load_config(path)


def test_an_unknown_key_with_a_line_break_stays_on_one_line(tmp_path):
    path = write(tmp_path, '"bad\\nkey": 1\n')
    with pytest.raises(ConfigError, match=r"unknown field 'bad\\nkey'") as err:
        load_config(path)
    assert_one_line(err)


@pytest.mark.parametrize("override, message", [
    ("seed=abc", r"^seed: expected int, got str 'abc'$"),
    ("seed=1.5", r"^seed: expected int, got float 1.5$"),
    ("seed=true", r"^seed: expected int, got bool True$"),  # a bool is not an int here
    ("rollout.temperature=[1]", r"^rollout.temperature: expected float, got list \[1\]$"),
    ("rollout.temperature=hot", r"^rollout.temperature: expected float, got str 'hot'$"),
    ("train.prefix_sharing=1", r"^train.prefix_sharing: expected bool, got int 1$"),
    ("task.kinds=colour", r"^task.kinds: expected list, got str 'colour'$"),
    ("model.path=3", r"^model.path: expected str, got int 3$"),
    ("params=[1]", r"^params: expected dict, got list \[1\]$"),
    ("seed=2001-13-01", r"^seed: expected int, got str '2001-13-01'$"),  # not a date: YAML would crash
    ("cluster.processes=3", r"^cluster.processes: expected bool or str, got int 3$"),
])
def test_wrong_type_names_field_and_value(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("override, expected", [
    ("cluster.processes=auto", "auto"), ("cluster.processes=true", True), ("cluster.processes=false", False)])
def test_a_field_of_two_types_takes_either(override, expected):
    assert load_config(None, [override]).cluster.processes == expected


def test_one_cpu_worker_shares_the_drivers_process_unless_asked_otherwise():
    from rollplex.pipeline.run.session import resolve_worker_processes

    assert resolve_worker_processes("auto", 1, "cpu") is False
    assert resolve_worker_processes("auto", 1, "cuda") is True  # a CUDA fault costs the worker, not the run
    assert resolve_worker_processes("auto", 2, "cpu") is True  # a process group rank per process
    assert resolve_worker_processes(True, 1, "cpu") is True and resolve_worker_processes(False, 1, "cuda") is False
    assert resolve_worker_processes(False, 1, "cpu", "tcp://127.0.0.1:8786") is True  # stock `dask worker`s


@pytest.mark.parametrize("override, message", [
    ("rollout.top_p=1.5", r"^rollout.top_p: 1.5 is above the maximum 1.0$"),
    ("rollout.temperature=-0.1", r"^rollout.temperature: -0.1 is below the minimum 0.0$"),
    ("rollout.prompts_per_iteration=0", r"^rollout.prompts_per_iteration: 0 is below the minimum 1$"),
    ("train.zero_stage=4", r"^train.zero_stage: 4 is above the maximum 3$"),
    ("seed=-1", r"^seed: -1 is below the minimum 0$"),
    ("stop_at_reward=2", r"^stop_at_reward: 2.0 is above the maximum 1.0$"),
    ("rollout.temperature=.inf", r"^rollout.temperature: inf is above the maximum 10.0$"),
    ("rollout.temperature=.nan", r"^rollout.temperature: expected a number, got nan$"),
    ("train.lr=" + "9" * 400, r"^train.lr: an integer this large does not fit a float$"),
])
def test_out_of_range_names_field_and_bound(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("override, message", [
    ("schedule=overlap", r"^schedule: 'overlap' is not one of serial, rollplex, auto$"),
    ("model.dtype=float16", r"^model.dtype: 'float16' is not one of float32, bfloat16$"),
    ("model.device=tpu", r"^model.device: 'tpu' is not one of auto, cpu, cuda$"),
    ("cluster.processes=maybe", r"^cluster.processes: 'maybe' is not one of auto, true, false$"),
])
def test_bad_choice_lists_the_choices(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, message", [
    (["task.image_size=50"], r"task.image_size: 50 is not a multiple of 28"),
    (["task.kinds=[]"], r"task.kinds: needs at least one kind"),
    (["task.kinds=[colour, smell]"], r"task.kinds: 'smell' is not one of colour, shape, count"),
    (["train.betas=[0.9]"], r"train.betas: expected two numbers in \[0, 1\)"),
    (["train.betas=[0.9, 1.0]"], r"train.betas: expected two numbers in \[0, 1\)"),
    (["rollout.chunk_tokens=16"], r"rollout.chunk_tokens: 16 exceeds rollout.max_new_tokens \(8\)"),
    (["cluster.lowering=iteration", "cluster.workers=2"], r"cluster.lowering: 'iteration' runs a whole iteration "
                                                          r"on one worker; with cluster.workers 2"),
])
def test_cross_field_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_validate_checks_a_config_built_in_code():
    cfg = RunConfig()
    cfg.rollout.max_new_tokens = 2
    with pytest.raises(ConfigError, match="rollout.chunk_tokens"):
        validate(cfg)


# -- files ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, where", [
    ("rollout:\n  temperature: [1\nseed: 3\n", "line 3, column 5"),
    ("seed: 1\nrollout: a: b\n", "line 2, column 11"),
    ("seed: 1\n\trollout: {}\n", "line 2, column 1"),
    ('seed: "unterminated\n', "line 2, column 1"),
])
def test_malformed_yaml_gives_file_line_and_column(tmp_path, text, where):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=f"malformed YAML at {where}") as err:
        load_config(path)
    assert assert_one_line(err).startswith(f"{path}: malformed YAML")


def test_a_yaml_value_that_cannot_be_built_is_a_config_error(tmp_path):
    path = write(tmp_path, "seed: 2001-13-01\n")  # matches YAML's date pattern, but month 13
    with pytest.raises(ConfigError, match=r"malformed YAML: month must be in 1..12"):
        load_config(path)


@pytest.mark.parametrize("text, kind", [("- 1\n- 2\n", "list"), ("42\n", "int"), ("just words\n", "str")])
def test_top_level_must_be_a_mapping(tmp_path, text, kind):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=f"{path}: the top level must be a mapping of fields, got {kind}"):
        load_config(path)


def test_missing_unreadable_and_non_utf8_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        load_config(tmp_path)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("task:\n  reward: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(bad)


# -- round trip ----------------------------------------------------------------------------------------
def test_dump_load_round_trip(tmp_path):
    cfg = load_config(None, ["seed=11", "train.lr=1e-5", "task.kinds=[shape, count]", "stop_at_reward=0.75",
                             "engines.overrides.decode_chunk=hf", "params.kl_coef=0", "task.reward='1e5'",
                             "model.path='null'", "algorithm='yes'"])
    text = dump_config(cfg)
    back = load_config(write(tmp_path, text))
    assert back == cfg
    assert (back.task.reward, back.model.path, back.algorithm) == ("1e5", "null", "yes")  # strings stay strings
    assert dump_config(back) == text


FIELD_NAMES = sorted({part for path, *_ in describe_fields() for part in path.split(".")})
SAFE_FLOATS = st.floats(allow_nan=False)
NAMES = st.text().filter(str.strip)  # a string field takes any text but a blank one
PARAM_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | SAFE_FLOATS | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.floats(0.0, 10.0), top_p=st.floats(0.0, 1.0, exclude_min=True),
       lr=st.floats(0.0, 1.0), kinds=st.lists(st.sampled_from(["colour", "shape", "count"]), min_size=1),
       reward=NAMES, path=st.none() | NAMES, params=st.dictionaries(st.text(max_size=8), PARAM_VALUES, max_size=4),
       stop=st.none() | st.floats(0.0, 1.0), schedule=st.sampled_from(["serial", "rollplex"]))
def test_any_valid_config_round_trips(seed, temperature, top_p, lr, kinds, reward, path, params, stop, schedule):
    cfg = RunConfig(seed=seed, schedule=schedule, params=params, stop_at_reward=stop)
    cfg.rollout.temperature, cfg.rollout.top_p, cfg.train.lr = temperature, top_p, lr
    cfg.task.kinds, cfg.task.reward, cfg.model.path = kinds, reward, path
    validate(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        back = load_config(write(Path(tmp), dump_config(cfg)))
    assert back == cfg


# -- fuzzing: only ConfigError escapes, always on one line ---------------------------------------------
KEYS = st.sampled_from(FIELD_NAMES) | st.text(max_size=8)
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
           | st.sampled_from(["1e-4", ".nan", "2001-13-01", "serial", "colour"]))
DOCS = st.dictionaries(KEYS, st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5), max_leaves=16),
    max_size=6)
RAW_VALUES = (st.sampled_from(["1", "-1", "0", "1e-4", "1.5", ".nan", "-.inf", "null", "~", "true", "yes", "[]",
                               "[1, 2]", "[colour]", "{a: 1}", "{", "[", "]", "'x", ": :", "!!binary x", "!!set {a}",
                               "0x1F", "0o17", "1_000", "2001-13-01", "2001-12-01", "*alias", "&a b", "|", ">-",
                               "%YAML 1.2", "---", "...", "- a", "a: b", "\t", "@x", "`x", "9" * 40])
              | st.text(max_size=16) | st.integers().map(str) | st.floats().map(repr))
PATHS = st.lists(st.sampled_from(FIELD_NAMES) | st.text(max_size=5), min_size=1, max_size=3).map(".".join)
OVERRIDES = st.lists(st.builds(lambda k, v: f"{k}={v}", PATHS, RAW_VALUES) | st.text(max_size=20), max_size=4)


def only_config_errors(fn, *args) -> None:
    try:
        fn(*args)
    except ConfigError as exc:
        message = str(exc)
        assert message and len(message.splitlines()) == 1, repr(message)


@settings(max_examples=150, deadline=None)
@given(overrides=OVERRIDES)
@example(overrides=["seed=2001-13-01"])
@example(overrides=["rollout.temperature=" + "9" * 400])
@example(overrides=["rollout.top_p=.nan"])
def test_random_overrides_raise_only_config_error(overrides):
    only_config_errors(load_config, None, overrides)


@settings(max_examples=150, deadline=None)
@given(doc=DOCS, overrides=OVERRIDES)
@example(doc={"rollout": {"temperature": math.nan}}, overrides=[])
@example(doc={"a\nb": 1}, overrides=[])
@example(doc={"rollout": {"temprature": 1}}, overrides=["rollout=3"])
def test_random_yaml_documents_raise_only_config_error(doc, overrides):
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), yaml.safe_dump(doc))
        only_config_errors(load_config, path, overrides)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60) | st.lists(RAW_VALUES, max_size=6).map("\n".join))
@example(text="seed: 2001-13-01")
@example(text="[" * 5000)
def test_random_yaml_text_raises_only_config_error(text):
    with tempfile.TemporaryDirectory() as tmp:
        only_config_errors(load_config, write(Path(tmp), text))


def test_the_async_cuda_allocator_is_asked_for_before_torch_loads():
    """torch reads the allocator backend once, as it loads: the CLI sets it first, in a process
    that has not imported torch (here: a child), and keeps the user's other allocator settings."""
    import subprocess
    import sys

    code = ("import os, sys; from rollplex.runtime import request_cuda_allocator; "
            "request_cuda_allocator('async'); assert 'torch' not in sys.modules; "
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])")
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:native,expandable_segments:True"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "backend:cudaMallocAsync,expandable_segments:True"


def test_an_unknown_cuda_allocator_is_named():
    from rollplex.runtime import request_cuda_allocator

    with pytest.raises(ConfigError, match="cluster.cuda_allocator: 'fast' is not one of native, async"):
        request_cuda_allocator("fast")
    with pytest.raises(ConfigError, match="cluster.cuda_allocator"):
        load_config(None, ["cluster.cuda_allocator=fast"])


# -- classes of bad input: every number bounded, unknown keys refused in option dicts too, YAML that
# -- reads two ways refused -------------------------------------------------------------------------
def _numeric_fields(cls=RunConfig, prefix=""):
    import typing

    for fl in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[fl.name]
        if dataclasses.is_dataclass(hint):
            yield from _numeric_fields(hint, f"{prefix}{fl.name}.")
        elif {int, float} & set(typing.get_args(hint) or (hint,)) and hint is not bool:
            yield f"{prefix}{fl.name}", fl.metadata, int in (typing.get_args(hint) or (hint,))


NUMERIC = list(_numeric_fields())


def test_every_number_in_the_config_has_both_bounds():
    assert len(NUMERIC) > 30
    unbounded = [path for path, meta, _ in NUMERIC if meta.get("lo") is None or meta.get("hi") is None]
    assert unbounded == []


@pytest.mark.parametrize("path,meta,integer", NUMERIC, ids=[p for p, _, _ in NUMERIC])
def test_every_number_refuses_what_lies_outside_its_bounds_by_name(path, meta, integer):
    step = 1 if integer else 1e-3 * max(1.0, abs(meta["hi"]))
    bad = [meta["hi"] + step, meta["lo"] - step, ".nan", ".inf", "-.inf"] + ([meta["lo"]] if meta.get("above") else [])
    for value in bad:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{path}={value}"])
        assert assert_one_line(err).startswith(f"{path}: "), (value, str(err.value))
    if not meta.get("above"):  # the bounds themselves are taken (a cross-field check aside)
        for value in (meta["lo"], meta["hi"]):
            try:
                load_config(None, [f"{path}={value}"])
            except ConfigError as exc:
                assert "the minimum" not in str(exc) and "the maximum" not in str(exc), str(exc)


def _string_fields(cls=RunConfig, prefix=""):
    import typing

    for fl in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[fl.name]
        if dataclasses.is_dataclass(hint):
            yield from _string_fields(hint, f"{prefix}{fl.name}.")
        elif str in (typing.get_args(hint) or (hint,)):
            yield f"{prefix}{fl.name}"


STRINGS = list(_string_fields())


@pytest.mark.parametrize("path", STRINGS)
def test_every_string_refuses_an_empty_one_by_name(path):
    """An empty path is not null: `model.path: ""` used to run the embedded model instead."""
    assert len(STRINGS) > 20
    for value in ("", "'  '"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{path}={value}"])
        assert assert_one_line(err) == f"{path}: is empty; give a value (or null where the field takes one)"


def test_a_value_of_the_right_type_that_a_union_refuses_is_named_for_what_it_is():
    with pytest.raises(ConfigError, match=r"^stop_at_reward: expected a number, got nan$"):
        load_config(None, ["stop_at_reward=.nan"])


@pytest.mark.parametrize("text, says", [
    ("seed: 1\nseed: 2\n", "key 'seed' appears twice in one mapping (lines 1 and 2)"),
    ("engines:\n  overrides: {decode_chunk: hf, decode_chunk: vllm}\n", "key 'decode_chunk' appears twice"),
    ("cluster:\n  processes: yes\n", "yes is true in YAML 1.1 and the string 'yes' in YAML 1.2"),
    ("train:\n  prefix_sharing: Off\n", "Off is false in YAML 1.1"),
    ("seed: 010\n", "010 is 8 in YAML 1.1 and 10 in YAML 1.2"),
    ("seed: 0o10\n", "0o10 is the string '0o10' in YAML 1.1 and 8 in YAML 1.2"),
    ("seed: 0b11\n", "0b11 is 3 in YAML 1.1 and the string '0b11' in YAML 1.2"),
    ("iterations: 1:30\n", "1:30 is 90 in YAML 1.1 and the string '1:30' in YAML 1.2"),
])
def test_yaml_that_reads_two_ways_is_refused_by_line(tmp_path, text, says):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        load_config(path)
    assert assert_one_line(err).startswith(f"{path}: ambiguous YAML at line ")


def test_quoted_and_unambiguous_forms_still_load(tmp_path):
    cfg = load_config(write(tmp_path, 'cluster:\n  processes: true\ndata:\n  prompt_key: "no"\nseed: 00\n'))
    assert (cfg.cluster.processes, cfg.data.prompt_key, cfg.seed) == (True, "no", 0)


def _registered_engines():
    import rollplex.engines  # noqa: F401 - registers the builtin engines
    from rollplex.engines.base import engines_for

    return [spec for spec in engines_for() if spec.role in ("decode", "train")]


WRONG = {bool: "maybe", int: "many", float: "x", str: 3, dict: 1, list: 2}


@pytest.mark.parametrize("spec", _registered_engines(), ids=lambda s: s.name)
def test_every_engine_refuses_options_it_does_not_take_and_values_of_a_wrong_type(spec):
    from rollplex.engines.base import check_options

    with pytest.raises(ConfigError, match=rf"^x\.nope: engine {spec.name!r} takes no option 'nope'"):
        check_options(spec, {"nope": 1}, "x")
    for key, option in spec.options.items():
        kind = option.kind[0] if isinstance(option.kind, tuple) else option.kind
        with pytest.raises(ConfigError, match=rf"^x\.{key}: ") as err:
            check_options(spec, {key: WRONG[kind] if kind is not str or not option.choices else "neither"}, "x")
        assert_one_line(err)
        if option.lo is not None:
            with pytest.raises(ConfigError, match=rf"^x\.{key}: .* below the minimum"):
                check_options(spec, {key: option.lo - 1}, "x")


def test_every_hyperparameter_of_the_builtin_algorithms_takes_its_defaults_type_only():
    from rollplex.pipeline.run.algorithms import builtin_algorithms, load_algorithm
    from rollplex.pipeline.run.session import check_hyperparameters

    for name in builtin_algorithms():
        algorithm = load_algorithm(name)
        for key, default in algorithm.hyperparameters().items():
            check_hyperparameters(algorithm, {key: default})
            for wrong in ("abc", float("nan"), float("inf"), True, [1]):
                if type(wrong) is type(default) and wrong == wrong and abs(wrong) != float("inf"):
                    continue
                with pytest.raises(ConfigError, match=rf"^params\.{key}: "):
                    check_hyperparameters(algorithm, {key: wrong})
