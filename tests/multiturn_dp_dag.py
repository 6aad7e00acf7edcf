"""GRPO on two-turn zoom trajectories whose reward varies with the text, so that every iteration
moves the weights: the first turn always zooms (an image between the turns), the second turn's
reward is its response's length modulo 3, halved."""
from rollplex import EnvSpec, StepResult, register_environment
from rollplex.dags.grpo import algorithm  # noqa: F401 - the algorithm this file runs
from rollplex.tasks.zoom import ZoomEnv, warmup_examples


class ZoomThenLength(ZoomEnv):
    def step(self, response):
        if not getattr(self, "zoomed", False):
            self.zoomed = True
            return super().step(f"zoom({self.prompt.meta['quadrant']})")
        return StepResult(None, float(len(response) % 3) / 2, done=True)


def _forty(observation) -> int:
    return 40


register_environment(EnvSpec("zoom-then-length", ZoomThenLength, observation_tokens=_forty, warmup=warmup_examples))
