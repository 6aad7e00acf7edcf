"""A trainable vision tower (train.freeze_vision: false).

The policy's vision forwards: one without grad for the rollout, and per micro-batch one with grad,
kept until that micro-batch's backward; the frozen reference keeps its own. Drawn for 4 prompts in
micro-batches of 2 (rollplex):

    prompt_p0..3 ─▶ vit (actor, no grad) ─▶ decode_c0 ─▶ ... ─▶ responses
                 ─▶ vit_ref ─▶ prefix_ref ─▶ suffix_ref ─────────────────┐
                 ─▶ vit_actor_p0-1 (grad) ─▶ prefix_actor_p0-1 ─▶ suffix ─▶ loss_m0 ─▶ loss_m1
                 ─▶ vit_actor_p2-3 (grad) ─▶ prefix_actor_p2-3 ─▶ suffix ────────────────┘

End to end, serial and rollplex give the same checkpoints (vision tower included) and the logged
log-probs equal an independent transformers forward of the checkpoint that scored them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollplex.config import load_config
from rollplex.dags.grpo import grpo
from rollplex.dags.ppo import ppo
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
from rollplex.pipeline.plan.schedule import schedule

ENGINES = EngineChoice({"decode": "hf", "train": "torch", "score": "transformers"})
DIMS = ModelDims(64, 2, 2, 16, 1000, 10**6, 2)


def _shape(**kw) -> BatchShape:
    base = dict(prompts=4, samples=2, max_new_tokens=4, chunk_tokens=2, micro_batch_groups=2, prompts_per_node=2,
                trains_vision=True)
    return BatchShape(**{**base, **kw})


def _vision(g) -> dict[str, object]:
    return {n.name: n for n in g.of_kind("vit_encode")}


def test_the_rollout_the_reference_and_each_micro_batch_get_their_own_vision_forward():
    g = compile_iteration(grpo, _shape(), ENGINES, DIMS)
    vit = _vision(g)
    assert sorted(vit) == ["vit_actor_p0-1", "vit_actor_p2-3", "vit_p0-1", "vit_p2-3", "vit_ref_p0-1", "vit_ref_p2-3"]
    assert {vit[n].model for n in ("vit_p0-1", "vit_actor_p0-1")} == {"actor"} and vit["vit_ref_p0-1"].model == "ref"
    assert [n for n in vit if vit[n].args.get("grad")] == ["vit_actor_p0-1", "vit_actor_p2-3"]
    users = {n: {u for o in vit[n].outputs for u in g.consumers(o)} for n in vit}
    assert users["vit_p0-1"] == {"decode_c0"}  # the rollout: the policy's tower, before any update
    assert users["vit_ref_p0-1"] == {"prefix_ref_p0-1"}
    assert users["vit_actor_p2-3"] == {"prefix_actor_p2-3"}  # kept for micro-batch 1's backward only
    # gradients reach the tower in one order under every schedule: micro-batch 1's vision forward
    # follows micro-batch 0's prefix, the way prefixes are chained
    assert g.g.edges["prefix_actor_p0-1", "vit_actor_p2-3"]["reason"] == "accumulation order"
    # serial runs the forwards that keep a graph with training, after the advantages; rollplex may
    # run them in the decode window
    serial = schedule(g, "serial")
    assert any(serial.g.edges[u, "vit_actor_p0-1"]["reason"] == "barrier" and serial.nodes[u].kind == "advantage"
               for u in serial.g.predecessors("vit_actor_p0-1"))
    rollplex = schedule(g, "rollplex")
    assert not any(rollplex.g.edges[u, "vit_actor_p0-1"].get("reason") == "barrier"
                   for u in rollplex.g.predecessors("vit_actor_p0-1"))


def test_a_frozen_tower_is_one_forward_every_model_shares():
    g = compile_iteration(grpo, _shape(trains_vision=False), ENGINES, DIMS)
    vit = _vision(g)
    assert sorted(vit) == ["vit_p0-1", "vit_p2-3"] and {n.model for n in vit.values()} == {"ref"}
    readers = {u for n in vit.values() for o in n.outputs for u in g.consumers(o)}
    assert readers == {"decode_c0", "prefix_ref_p0-1", "prefix_ref_p2-3", "prefix_actor_p0-1", "prefix_actor_p2-3"}


def test_a_critic_trains_its_own_tower_as_scoring_and_train_fusion_encodes_in_its_node():
    g = compile_iteration(ppo, _shape(), ENGINES, DIMS)
    vit = _vision(g)
    assert vit["vit_critic_p0-1"].args == {"prompts": [0, 1], "grad": True, "feeds_advantage": True}
    schedule(g, "serial").lint()  # GAE reads the critic: its vision forward is scoring, no cycle
    fused = compile_iteration(grpo, _shape(micro_batch_groups=1, stage_fusion=True, train_fusion=True),
                              ENGINES, DIMS)
    train = fused.nodes["train_c0"]
    assert train.args["vision_grad"] and not [v for v in train.inputs if fused.values[v].role == "vision"]
    assert not [n for n in fused.of_kind("vit_encode") if n.args.get("grad")]


def test_the_engines_train_the_tower_only_when_asked(tiny_model_dir):
    from rollplex.engines.base import EngineContext, get_engine
    from rollplex.engines.vlm import PromptInputs, prefix_forward, vision_embeds
    from transformers import AutoProcessor
    from PIL import Image

    proc = AutoProcessor.from_pretrained(tiny_model_dir)
    enc = proc(text=["<|vision_start|><|image_pad|><|vision_end|>red"], images=[Image.new("RGB", (56, 56), (200, 0, 0))],
               return_tensors="pt")
    prompt = PromptInputs("p", enc["input_ids"][0], enc["pixel_values"], enc["image_grid_thw"])
    for freeze in (True, False):
        engine = get_engine("torch", "train").factory(EngineContext(str(tiny_model_dir), torch.device("cpu"),
                                                                    torch.float32, 0, {"freeze_vision": freeze}))
        vision = {n: p.detach().clone() for n, p in engine.module.named_parameters() if "visual" in n}
        optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
        assert all((id(p) in optimized) != freeze for n, p in engine.module.named_parameters() if "visual" in n)
        state = prefix_forward(engine.module, prompt, vision_embeds(engine.module, prompt, grad=True), grad=True)
        engine.backward(state.last_logits.logsumexp(-1))
        engine.step()
        moved = [n for n, p in engine.module.named_parameters() if "visual" in n and not torch.equal(p, vision[n])]
        assert (moved == []) == freeze, moved[:3]


def test_the_memory_plan_refuses_a_tower_that_trains():
    from rollplex.errors import ConfigError

    assert load_config(None).train.freeze_vision
    with pytest.raises(ConfigError, match="cluster.memory_plan: the plan sizes a frozen vision tower"):
        load_config(None, ["train.freeze_vision=false", "cluster.memory_plan=true", "cluster.memory_budget_gib=8"])


# --------------------------------------------------------------------------------------------------
ITERATIONS = 3
SEED = 3


def _run(tmp: Path, schedule_name: str, extra: tuple[str, ...] = ()) -> Path:
    from rollplex.pipeline.run.runner import train

    cfg = load_config(None, [f"schedule={schedule_name}", f"iterations={ITERATIONS}", f"seed={SEED}", "warmup.steps=3",
                             "stop_at_reward=null", "checkpoint.every=1", "checkpoint.keep_last=5",
                             "train.freeze_vision=false", *extra])
    run_dir = tmp / schedule_name
    train(cfg, run_dir, progress=False, log=lambda *a: None)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("vision")
    return {name: _run(tmp, name) for name in ("serial", "rollplex")}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def _rows(run_dir: Path, iteration: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts" / f"iter_{iteration:06d}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_serial_and_rollplex_agree_and_the_vision_tower_trains(runs):
    reference = _weights(runs["rollplex"] / "reference")
    for iteration in range(ITERATIONS):
        name = f"checkpoints/iter_{iteration:06d}"
        a, b = _weights(runs["serial"] / name), _weights(runs["rollplex"] / name)
        assert a.keys() == b.keys()
        for key in a:
            scale = a[key].abs().max().clamp(min=1e-12)
            assert float((a[key] - b[key]).abs().max() / scale) <= 1e-5, (iteration, key)
        for x, y in zip(_rows(runs["serial"], iteration), _rows(runs["rollplex"], iteration)):
            assert x["response_token_ids"] == y["response_token_ids"]
    last = _weights(runs["rollplex"] / f"checkpoints/iter_{ITERATIONS - 1:06d}")
    vision = [k for k in last if "visual" in k]
    assert vision and all(not torch.equal(last[k], reference[k]) for k in vision)


@pytest.mark.slow
def test_logged_logprobs_equal_a_plain_transformers_forward(runs):
    """old_logprobs of iteration N against checkpoint N-1 (the policy, its own vision tower), and
    ref_logprobs against reference/ (the frozen tower): one HF forward over prompt and response."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.vlm import mm_token_types
    from rollplex.tasks.data import PromptBuilder, SyntheticVisualTask, build_item

    run_dir = runs["rollplex"]
    cfg = load_config(run_dir / "config.yaml")
    processor = AutoProcessor.from_pretrained(run_dir / "reference")
    task = SyntheticVisualTask(kinds=tuple(cfg.task.kinds), image_size=cfg.task.image_size, size=cfg.task.size,
                               seed=cfg.seed)
    builder = PromptBuilder(processor)
    models = {"ref_logprobs": run_dir / "reference", "old_logprobs": run_dir / f"checkpoints/iter_{ITERATIONS - 2:06d}"}
    for field, folder in models.items():
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
        worst = 0.0
        for row in _rows(run_dir, ITERATIONS - 1)[::9]:
            prompt = build_item(task, builder, int(row["prompt_id"].split("-")[1]))
            ids = torch.tensor([row["prompt_token_ids"] + row["response_token_ids"]])
            with torch.no_grad():
                out = model(input_ids=ids, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                            mm_token_type_ids=mm_token_types(ids, model.config)).logits[0].float()
            start = len(row["prompt_token_ids"])
            logp = torch.log_softmax(out[start - 1:-1], dim=-1)
            expected = logp.gather(-1, torch.tensor(row["response_token_ids"]).view(-1, 1)).view(-1)
            worst = max(worst, float((expected - torch.tensor(row[field])).abs().max()))
        assert worst <= 1e-5, field
