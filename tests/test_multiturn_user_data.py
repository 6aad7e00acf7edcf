"""A multi-turn run as a user writes one: their jsonl, an environment of their own in their DAG file
(a tool that answers with text and a crop of the prompt's image, read from the dataset's file), the
`rollplex train` command line. No warm-up, every iteration runs, every trajectory has its two turns,
and the log says where each image came from: the dataset file for the prompt's, the pixels' sha256
for the tool's."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from rollplex.tasks.dataset import export_synthetic

AGENT = '''
from PIL import Image

from rollplex import EnvSpec, Environment, Observation, StepResult, register_environment
from rollplex.dags.grpo import algorithm  # noqa: F401 - the algorithm this file runs


class Corner(Environment):
    """The first response gets the image's top-left corner, enlarged; the second is judged by length."""

    def __init__(self, options):
        self.turn = 0

    def reset(self, prompt):
        super().reset(prompt)
        self.prompt = prompt

    def step(self, response):
        self.turn += 1
        if self.turn == 1:
            image = Image.open(self.prompt.meta["images"][0]["path"]).convert("RGB")
            crop = image.crop((0, 0, 56, 56)).resize((112, 112))
            return StepResult(Observation("The corner, enlarged. One word:", images=[crop]), 0.0, tool_calls=1)
        return StepResult(None, float(len(response) % 3) / 2, done=True)


register_environment(EnvSpec("corner", Corner, observation_tokens=lambda observation: 64))
'''


@pytest.mark.slow
def test_a_users_data_and_tool_train_for_the_iterations_asked(tmp_path, tiny_model_dir):
    data = export_synthetic(tmp_path / "data", size=8)
    (tmp_path / "agent.py").write_text(AGENT)
    done = subprocess.run(
        [sys.executable, "-m", "rollplex.cli", "train", str(tmp_path / "agent.py"), "--no-progress",
         "--out", str(tmp_path / "run"), "--iterations", "2", "--set", f"data.path={data}",
         "--set", f"model.path={tiny_model_dir}", "--set", "rollout.max_turns=2", "--set", "env.name=corner",
         "--set", "engines.train=torch", "--set", "rollout.prompts_per_iteration=2",
         "--set", "rollout.samples_per_prompt=2", "--set", "rollout.max_new_tokens=4"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warm-up" not in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r["phase"] == "rl"] == [0, 1]
    assert rows[-1]["tool_use_rate"] == 1.0 and rows[-1]["turns_mean"] == 2.0
    for line in (tmp_path / "run" / "rollouts" / "iter_000001.jsonl").read_text().splitlines():
        row = json.loads(line)
        first, _ = row["turns"]
        (source,) = first["sources"]
        (image,) = row["images"]
        crop = Image.open(image["path"]).convert("RGB").crop((0, 0, 56, 56)).resize((112, 112))
        assert source == {"sha256": hashlib.sha256(crop.tobytes()).hexdigest(), "size": [112, 112]}
        start, end = first["observation"]
        assert row["response_mask"][start:end] == [0] * (end - start)
