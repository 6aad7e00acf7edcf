"""docs/authoring.md, executed: its file blocks are written and its bash blocks run, in order, in a
fresh directory, so the tutorial and the code cannot drift apart."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "authoring.md"
# ```bash ... ``` runs; ```python file=my_grpo.py ... ``` is written to my_grpo.py; others are prose.
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```\s*$", re.M | re.S)


def steps(text: str) -> list[tuple[str, str, str]]:
    """(action, target, body) per fenced block: ("run", "", script) or ("write", filename, content)."""
    out = []
    for lang, info, body in FENCE.findall(text):
        name = re.search(r"\bfile=(\S+)", info)
        if name:
            out.append(("write", name.group(1), body))
        elif lang == "bash":
            out.append(("run", "", body))
    return out


def test_the_parser_finds_every_block():
    found = steps(DOC.read_text())
    assert [s[1] for s in found if s[0] == "write"] == ["my_grpo.py", "my_run.yaml"]
    scripts = [s[2] for s in found if s[0] == "run"]
    assert len(scripts) == 5
    for needed in ("rollplex export-task", "rollplex graph", "rollplex train", "rollplex plot"):
        assert any(needed in s for s in scripts), needed
    # The engine swap is one line of config, on the train command itself.
    assert "--set engines.overrides.decode_chunk=hf" in next(s for s in scripts if "rollplex train" in s)


@pytest.mark.slow
def test_every_command_of_the_tutorial_runs(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    outputs = []
    for action, target, body in steps(DOC.read_text()):
        if action == "write":
            (tmp_path / target).write_text(body)
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=480)
        assert done.returncode == 0, f"tutorial block failed (exit {done.returncode}):\n{body}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout + done.stderr)
    log = "\n".join(outputs)
    assert '"answer"' in log and "<image>" in log  # `head` showed the rows
    assert (tmp_path / "my_grpo.svg").read_text().lstrip().startswith("<svg")
    steps_shown = [line for line in log.splitlines() if "= optimizer_step[model=actor]" in line]
    assert [line.split()[0] for line in steps_shown] == [f"%optimizer_step_s{k}" for k in range(4)]
    assert any("= weight_sync[" in line and "(%step_s3)" in line for line in log.splitlines())
    run = tmp_path / "runs" / "my_grpo"
    assert "my_grpo on cpu" in log and "engines decode=hf" in log
    decode_lines = [line for line in (run / "graph.txt").read_text().splitlines() if "= decode_chunk" in line]
    assert decode_lines and all("@hf(" in line for line in decode_lines)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["iteration"] for r in rl] == [0, 1, 2, 3] and all(r["data_skipped_rows"] == 0 for r in rl)
    assert all(r["rollout_logprob_diff"] > 0 and r["rollout_kl_k3"] > 0 and "clip_frac" in r for r in rl)
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["iteration"] for r in evals] == [2, 4] and all("val/pass@2" in r for r in evals)
    assert "iter_000002.jsonl" in log and "iter_000004.jsonl" in log  # `ls` showed eval/
    assert len((run / "eval" / "iter_000004.jsonl").read_text().splitlines()) == 8 * 2
    assert any((run / "tensorboard").glob("events.out.tfevents.*"))
    assert {p.name for p in (run / "plots").iterdir()} == {"curves.png", "time_by_kind.png", "gantt_iter_000003.png"}
    # the LoRA run: its reference holds nothing of its own, its checkpoint the merged model and the adapter
    assert re.search(r"^lora: rank 4, alpha 16 on \d+ layers .* ref is the base with the adapters off, on the "
                     r"policy's weights: 0 bytes of its own", log, re.M)
    assert "model.safetensors" in log and "adapter_model.safetensors" in log
