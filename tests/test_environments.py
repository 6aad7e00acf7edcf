"""Environments: the registry, their options, what a failing or slow one does to its episode (and
only to it), and the embedded zoom task's promise that its answer cannot be seen without the tool."""
from __future__ import annotations

import time

import numpy as np
import pytest

from rollplex.errors import ConfigError
from rollplex.tasks.environments import (EnvPrompt, EnvSpec, Environment, Job, Observation, StepPool, StepResult,
                                         check_env_options, environment_names, get_environment,
                                         register_environment, step_all)
from rollplex.tasks.zoom import PAIRS, SCALE, ZoomEnv, ZoomTask, block_mean, zoom_call


class Scripted(Environment):
    """Does what its prompt's meta says: answer, raise, hang, or return something else."""

    def step(self, response):
        how = self.prompt.meta["how"]
        if how == "raise":
            raise RuntimeError("the tool broke")
        if how == "hang":
            time.sleep(5)
        if how == "junk":
            return {"reward": 1}
        if how == "nan":
            return StepResult(None, float("nan"), done=True)
        if how == "silent":
            return StepResult(None, 0.0, done=False)
        return StepResult(Observation("again"), 0.5, done=False, tool_calls=1)


SCRIPTED = EnvSpec("scripted-test", lambda options: Scripted())


def prompt(how: str, sample: int = 0) -> EnvPrompt:
    return EnvPrompt("p", "q", "a", (), {"how": how}, sample, 0)


def test_registry_refuses_a_second_name_and_lists_the_known_ones():
    assert "zoom" in environment_names()
    with pytest.raises(ConfigError, match="registered already"):
        register_environment(EnvSpec("zoom", lambda o: ZoomEnv(o)))
    with pytest.raises(ConfigError, match=r"env.name: unknown environment 'zom'; registered environments: .*zoom"):
        get_environment("zom")


def test_options_are_checked_by_name():
    spec = get_environment("zoom")
    assert check_env_options(spec, {"view": 56}) == {"view": 56}
    with pytest.raises(ConfigError, match=r"env.options.size: environment 'zoom' takes no option 'size'; its options: "
                                          r"reward, view"):
        check_env_options(spec, {"size": 3})
    with pytest.raises(ConfigError, match="env.options.view: expected int"):
        check_env_options(spec, {"view": "big"})
    with pytest.raises(ConfigError, match="env.options.view: 30 is not a multiple of 28"):
        check_env_options(spec, {"view": 30})
    with pytest.raises(ConfigError, match="env.options.reward: unknown reward 'nope'"):
        check_env_options(spec, {"reward": "nope"})


def test_a_failing_or_slow_environment_ends_its_episode_and_no_other():
    """Seven samples in one step: each way of going wrong ends its own episode with its reason, in
    about the timeout (the hanging step's thread is left behind, not waited for), and the samples
    whose environment works get their answer."""
    hows = ["ok", "raise", "hang", "junk", "nan", "silent", "ok"]
    jobs = [Job(None, prompt(how, i), "zoom(1)") for i, how in enumerate(hows)]
    start = time.time()
    pool = StepPool()
    first = pool._pool
    results = step_all(SCRIPTED, {}, jobs, timeout=0.5, pool=pool)
    assert time.time() - start < 2.0
    reasons = [outcome.end_reason.split(":")[0] for _, outcome in results]
    assert reasons == ["", "env_error", "env_timeout", "env_error", "env_error", "env_error", ""]
    assert "the tool broke" in results[1][1].end_reason
    assert [outcome.done for _, outcome in results] == [False, True, True, True, True, True, False]
    ok = results[0][1]
    assert ok.reward == 0.5 and ok.tool_calls == 1 and ok.observation.text == "again"
    assert isinstance(results[0][0], Scripted)  # the episode's environment, kept for its next turn
    assert pool._pool is not first  # the hanging step keeps its thread in the pool left behind
    (env, again), = step_all(SCRIPTED, {}, [Job(results[0][0], prompt("ok"), "x")], timeout=0.5, pool=pool)
    assert env is results[0][0] and again.observation.text == "again"


def test_reset_that_returns_an_observation_is_contained():
    class Talky(Scripted):
        def reset(self, prompt):
            super().reset(prompt)
            return Observation("instructions")

    (_, outcome), = step_all(EnvSpec("talky-test", lambda o: Talky()), {}, [Job(None, prompt("ok"), "x")], 1.0,
                             StepPool())
    assert outcome.done and outcome.end_reason.startswith("env_error") and "reset returned an observation" in \
        outcome.end_reason


def test_zoom_view_hides_the_answer_and_the_zoom_shows_it():
    """Scenes that differ only in their answer look the same at the view's resolution (the square's
    4x4 blocks are (125, 125, 125) whatever the pair), and the zoomed quadrant shows each pair's two
    colours, one pixel per cell."""
    task = ZoomTask(size=64)
    views, seen = {}, set()
    for i in range(64):
        scene, answer, quadrant = task.scene(i)
        view = np.asarray(task.view(scene))
        assert view.shape == (112, 112, 3)
        square = view[(view == 125).all(-1)]
        assert len(square) >= 24 * 24  # the grey square is there, plain
        assert set(map(tuple, view.reshape(-1, 3))) <= {(125, 125, 125), tuple(view[0, 0])}
        seen.add(answer)
        env = ZoomEnv({})
        env.reset(EnvPrompt(task.prompt_id(i), "", answer, (), {"images": [{"task": "zoom", "seed": 0, "index": i,
                                                                            "image_size": 112, "size": 64}]}, 0, 0))
        step = env.step(f"zoom({quadrant})")
        assert step.tool_calls == 1 and not step.done
        crop = np.asarray(step.observation.images[0])
        assert crop.shape == (112, 112, 3)
        colours = set(map(tuple, crop.reshape(-1, 3)))
        assert set(PAIRS[answer]) <= colours  # the zoom shows the pair
        other = env.step(f"zoom({quadrant % 4 + 1})")
        assert not set(PAIRS[answer]) & set(map(tuple, np.asarray(other.observation.images[0]).reshape(-1, 3)))
        views[i] = view
        final = env.step(f"Answer: {answer}")
        assert final.done and final.reward == 1.0
    assert seen == set(PAIRS)
    # The same layout with another answer gives the very same view.
    scene, answer, _ = task.scene(3)
    other = next(a for a in PAIRS if a != answer)
    swapped = scene.copy()
    for c_old, c_new in zip(PAIRS[answer], PAIRS[other]):
        swapped[(scene == c_old).all(-1)] = c_new
    assert np.array_equal(block_mean(swapped, SCALE), views[3])


def test_a_zoom_call_is_the_whole_response():
    assert zoom_call("zoom(3)") == 3 and zoom_call(" zoom( 4 )\n") == 4
    for answer in ("red", "zoom(5)", "zoom2", "zoom(2)blue", "I zoom(1)", "Zoom(1)"):
        assert zoom_call(answer) is None, answer
