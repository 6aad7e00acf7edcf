"""The multi-turn recipe as the README, docs/authoring.md (section 8) and dags/examples/zoom_agent.py
show it: the environment written there works, the commands' settings are accepted, and
``rollplex graph`` draws the turns."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rollplex.config import load_config
from rollplex.tasks.environments import EnvPrompt, check_env_options, get_environment
from rollplex.tasks.zoom import ZoomTask

ROOT = Path(__file__).resolve().parents[1]
SECTION = ROOT.joinpath("docs", "authoring.md").read_text().split("## 8. Several turns")[1]


def zoom_prompt(index: int = 5) -> tuple[EnvPrompt, int, str]:
    task = ZoomTask(size=16)
    _, answer, quadrant = task.scene(index)
    meta = {"images": [{"task": "zoom", "seed": 0, "index": index, "image_size": 112, "size": 16}],
            "quadrant": quadrant}
    return EnvPrompt(task.prompt_id(index), "", answer, (), meta, 0, 0), quadrant, answer


def commands(text: str, fence: str) -> list[list[str]]:
    blocks = re.findall(rf"^```{fence}\n(.*?)^```", text, re.M | re.S)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if line.startswith("rollplex ")]


def settings(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]


def test_the_environment_written_in_the_tutorial_works():
    namespace: dict = {}
    exec(re.search(r"^```python\n(.*?)^```", SECTION, re.M | re.S).group(1), namespace)  # noqa: S102
    spec = get_environment("quarters")
    env = spec.factory(check_env_options(spec, {"budget": 1}))
    prompt, quadrant, answer = zoom_prompt()
    env.reset(prompt)
    first = env.step(f"zoom({quadrant})")
    assert first.tool_calls == 1 and not first.done and first.observation.images
    second = env.step("zoom(1)")
    assert not second.done and second.observation.text.startswith("No zooms left")
    final = env.step(answer)
    assert final.done and final.reward == 1.0


def test_the_example_page_charges_each_zoom():
    from rollplex.pipeline.run.algorithms import load_algorithm

    algorithm = load_algorithm(str(ROOT / "dags" / "examples" / "zoom_agent.py"))
    assert algorithm.name == "zoom_agent"
    spec = get_environment("zoom-budget")
    env = spec.factory(check_env_options(spec, {"cost": 0.1}))
    prompt, quadrant, answer = zoom_prompt()
    env.reset(prompt)
    assert env.step(f"zoom({quadrant})").reward == pytest.approx(-0.1)
    assert env.step(answer).reward == 1.0


def test_the_documented_commands_are_accepted():
    from rollplex.pipeline.run.session import environment

    readme = ROOT.joinpath("README.md").read_text().split("## Multi-turn")[1]
    found = commands(readme, "bash") + commands(SECTION, "console")
    assert len(found) == 5
    test_the_example_page_charges_each_zoom()  # registers zoom-budget, as the DAG file does when a run loads it
    for argv in found:
        cfg = load_config(None, settings(argv))
        assert cfg.task.name == "zoom"
        if cfg.rollout.max_turns > 1:
            name, spec, options = environment(cfg)
            assert name in ("zoom", "zoom-budget")


@pytest.mark.slow
def test_rollplex_graph_draws_the_turns(capsys):
    from rollplex.cli import main

    argv = next(a for a in commands(SECTION, "console") if a[1] == "graph")
    assert main(argv[1:]) == 0
    table = capsys.readouterr().out
    for node in ("%decode_t0_c0 ", "%decode_t0_c1 ", "%env_t0_c0 ", "%env_t0_c1 ", "%vit_obs_t0_c0 ",
                 "%decode_t1_c0 ", "%env_t1_c1 ", "%episodes "):
        assert node in table, node
    assert "= decode_chunk[model=actor] @vllm(%decode_state_t0_c1, %obs_t0_c0, %obs_t0_c1, %obsvis_t0_c0, " \
           "%obsvis_t0_c1)" in table
