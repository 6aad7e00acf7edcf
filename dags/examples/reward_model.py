"""A node kind of your own: a reward model scored on the prompt prefix plus each response.

GRPO whose reward adds a reward model's score to the verifier's. Three registrations extend the
runtime; pipeline/ is not touched:

1. ``register_kind(NodeKind("rm_score", ...))``: what the node is and where it runs by default (its
   engine role, stream and phase). The compiler, the scheduler and the visualiser read only these.
2. ``register_engine(EngineSpec("example-rm", role="score", ...))``: the engine that hosts the reward
   model, named by ``frozen("rm", ..., engine="example-rm")``. Each worker builds it once.
3. ``@register_task("rm_score")``: what a node of the kind computes on that engine.

The reward model here is the policy's trunk with a scalar head (seeded, untrained: a stand-in for a
real checkpoint given with ``path=``). It reads the prompt's prefix once and scores the G responses
on top of its KV cache, like the reference model does. Run it with
``rollplex train --set algorithm=dags/examples/reward_model.py``.
"""
import torch

from rollplex import (Algorithm, EngineSpec, NodeKind, ScoreEngine, register_engine, register_kind,
                      register_task)
from rollplex.dags.grpo import policy_loss
from rollplex.engines import vlm


class RewardModel(ScoreEngine):
    """A frozen Qwen2.5-VL trunk with a scalar head: the mean head output over a response's tokens."""

    def __init__(self, ctx):
        from transformers import Qwen2_5_VLForConditionalGeneration

        self.device, self.dtype = torch.device(ctx.device), ctx.dtype
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ctx.model_path, dtype=ctx.dtype)
        torch.manual_seed(ctx.seed)
        model.lm_head = torch.nn.Linear(model.config.get_text_config().hidden_size, 1, bias=False, dtype=ctx.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)

    def score(self, prompt, vision, responses: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            state = vlm.prefix_forward(self.model, prompt, vision, grad=False)
            tokens, mask = vlm.pad_responses(responses, pad_id=0)
            values = vlm.suffix_logits(self.model, state, tokens, grad=False).squeeze(-1).cpu()
        return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


register_kind(NodeKind("rm_score", role="score", stream="compute", phase="score",
                       description="reward-model score of one prompt's responses (prefix + suffix)"))
register_engine(EngineSpec("example-rm", role="score", factory=RewardModel, requires=("transformers",),
                           description="dags/examples/reward_model.py: a scalar-head reward model"))


@register_task("rm_score")
def rm_score(ctx, node, inputs):
    """Call the node's function with its bound values and the engine hosting its model as ``rm``."""
    return {node.outputs[0]: ctx.call(node, inputs, rm=ctx.engine_for(node))}


grpo_rm = Algorithm("grpo_rm", doc=__doc__)
grpo_rm.policy("actor")
grpo_rm.frozen("ref", copy_of="actor")
grpo_rm.frozen("rm", copy_of="actor", engine="example-rm")
grpo_rm.score("ref", as_="ref_logprobs")
grpo_rm.score("actor", as_="logprobs", grad=True)


@grpo_rm.node(writes="rm_scores", kind="rm_score", model="rm")
def rm_scores(prompt, vision, responses, rm=None):
    """One score per response; the rm_score task passes the reward model's engine as ``rm``."""
    return rm.score(prompt, vision, responses.token_ids)


@grpo_rm.advantage(scope="group")
def advantages(rewards, rm_scores, rm_coef: float = 0.1, eps: float = 1e-6):
    r = rewards + rm_coef * torch.tanh(rm_scores)
    return (r - r.mean()) / (r.std() + eps)


grpo_rm.loss(agg="token-mean")(policy_loss)  # GRPO's loss, reused as it is

algorithm = grpo_rm
