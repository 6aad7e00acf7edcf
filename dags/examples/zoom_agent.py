"""A multi-turn visual agent: GRPO on trajectories, with a zoom tool that costs a little per call.

A trajectory is the sample's turns after its prompt: the policy's responses and, between them, its
environment's answers, whose new images go through the vision tower. The algorithm does not change
for it: GRPO's page scores every token of the trajectory on the prompt's shared prefix, and the mask
it is given has gaps where the environment wrote (``mask`` is 1 at the policy's tokens only), so the
surrogate and the KL count the policy's tokens alone. What makes the run multi-turn is the config
(``rollout.max_turns``, ``env.name``) and an environment, registered here with the public API:

- ``Environment.step(response) -> StepResult(observation, reward, done, tool_calls)``, one instance per
  sample, ``reset(prompt)`` at its first turn;
- ``register_environment(EnvSpec(name, factory, options=...))``, its options checked by name
  (``env.options.cost``), its errors and timeouts contained per sample.

``zoom-budget`` is the embedded zoom task's environment (``zoom(q)`` shows quarter q up close) with a
price of ``cost`` per call taken from the reward: a policy learns to zoom once, where the answer is.
Run it with

    rollplex train dags/examples/zoom_agent.py --set task.name=zoom --set rollout.max_turns=3 \\
        --set env.name=zoom-budget --set env.options.cost=0.05
"""
from rollplex import Algorithm, EnvSpec, register_environment
from rollplex.dags.grpo import advantages, policy_loss
from rollplex.engines.base import Option
from rollplex.tasks.environments import get_environment
from rollplex.tasks.zoom import ZoomEnv


class BudgetZoom(ZoomEnv):
    def __init__(self, options):
        super().__init__(options)
        self.cost = float(options.get("cost", 0.05))

    def step(self, response):
        result = super().step(response)
        result.reward -= self.cost * result.tool_calls
        return result


zoom = get_environment("zoom")
register_environment(EnvSpec("zoom-budget", BudgetZoom, options={**zoom.options, "cost": Option(float, 0.0, 1.0)},
                             description="zoom, each call costing env.options.cost of the reward",
                             observation_tokens=zoom.observation_tokens, warmup=zoom.warmup))

agent = Algorithm("zoom_agent", doc=__doc__)
agent.policy("actor")
agent.frozen("ref", copy_of="actor")
agent.score("ref", as_="ref_logprobs")  # over the whole trajectory, the prompt's prefix once per group
agent.score("actor", as_="logprobs", grad=True)
agent.advantage(scope="group", min_samples=2)(advantages)  # one reward per trajectory: its environment's
agent.loss(agg="token-mean")(policy_loss)  # token-mean over the policy's tokens: the mask has gaps

algorithm = agent
