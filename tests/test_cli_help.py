"""What the CLI tells a user about itself: help for every train flag, every config field listed with its
type, default and meaning, messages that name the argument as it is typed, and no citation of files
the repository does not hold. CPU only; nothing is trained."""
from __future__ import annotations

import dataclasses
import re


from rollplex.cli import build_parser, main
from rollplex.config import RunConfig, describe_fields


def _subparser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def test_every_train_flag_has_help():
    missing = [a.option_strings for a in _subparser("train")._actions if not a.help]
    assert missing == []


def test_help_config_lists_every_field_with_type_default_and_meaning(capsys):
    assert main(["train", "--help-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = describe_fields()
    assert len(lines) == 1 + len(rows) and lines[0].split() == ["field", "type", "default", "meaning"]
    shown = {line.split()[0]: line for line in lines[1:]}

    def leaves(tree: dict, prefix: str = ""):
        for key, value in tree.items():
            is_section = dataclasses.is_dataclass(getattr(RunConfig(), key, None)) if not prefix else False
            if is_section:
                yield from leaves(value, f"{key}.")
            else:
                yield prefix + key

    assert set(shown) == set(leaves(RunConfig().to_dict()))
    for path, kind, default, doc in rows:
        assert doc, f"{path} has no one-line meaning"
        assert f"  {kind}  " in shown[path] and f"  {default}  " in shown[path] and shown[path].endswith(doc)
    assert shown["rollout.temperature"].split()[1:3] == ["float", "1.0"]
    assert "auto" in shown["stop_at_reward"] and "null" in shown["warmup.steps"]


def test_init_model_names_its_arguments_as_typed(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    assert main(["init-model", str(tmp_path / "taken"), "--preset", "qwen2.5-vl-3b", "--layers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'taken'}: exists already" in err and "--out" not in err
    assert main(["init-model", str(tmp_path / "new"), "--preset", "qwen9"]) == 2
    err = capsys.readouterr().err
    assert "--preset 'qwen9': not a preset" in err and "--model" not in err


def test_simulate_cites_only_what_the_repository_holds(capsys):
    assert main(["simulate", "--model", "qwen2.5-vl-7b", "--gpus", "8", "--hardware", "h800"]) == 0
    out = capsys.readouterr().out
    assert "assumptions" in out
    assert "ROLLPLEX.md" not in out and not re.search(r"\bissue \d", out)


def test_bench_refuses_a_model_the_memory_cannot_hold_before_building_it(tmp_path, capsys, monkeypatch):
    from rollplex.pipeline.run import preflight

    monkeypatch.setattr(preflight, "available_memory", lambda device: 8 * 2**30)
    out = tmp_path / "bench"
    assert main(["bench", "--device", "cpu", "--model", "qwen2.5-vl-3b", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rollplex bench --model qwen2.5-vl-3b on cpu: needs at least" in err and "8 GiB are available" in err
    assert "--layers" in err and not out.exists()


def test_resume_takes_the_run_directory_itself_or_through_out(tmp_path):
    from rollplex.cli import _resume_dir

    run = str(tmp_path / "run")
    for argv, expected in ((["--resume", run], run), (["--resume", "--out", run], run),
                           (["--resume", run, "--out", str(tmp_path / "." / "run")], run),
                           (["--out", run], run), ([], None)):
        args = _subparser("train").parse_args(argv)
        assert _resume_dir(args.resume, args.out) == expected, argv
        assert bool(args.resume) == ("--resume" in argv), argv
