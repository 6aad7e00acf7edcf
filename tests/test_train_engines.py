"""Train engines: gradient accumulation, ZeRO equivalence, checkpoint round trips, bad steps.

Every test trains the tiny Qwen2.5-VL on one batch of two prompt groups (M = 2 micro-batches, one
group each). Each micro-batch loss is normalised to the whole batch, as the runtime does:

    loss_m = -sum_{g,t in group m} A_g * logp(g, t) / (response tokens in the batch)

so M backward calls followed by one step must equal one backward of sum_m loss_m. The losses run on
``engine.module`` through tasks.lm, exactly as the runtime's loss nodes do. DeepSpeed tests share one
process-wide gloo group (the first engine creates it).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

import rollplex.engines.deepspeed_train  # noqa: E402,F401  (registers; deepspeed loads lazily)
import rollplex.engines.hf_score  # noqa: E402,F401
import rollplex.engines.torch_train  # noqa: E402,F401
from rollplex.engines.base import EngineContext, get_engine  # noqa: E402

CORPUS = ("What colour is the shape? Answer with one word. red green blue",)
OPTIONS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, grad_clip=1.0, accumulation_steps=2)
STEPS = 2


@pytest.fixture(scope="module")
def model_dir():
    from rollplex.engines.models import TinyVLMSpec, default_cache_dir, ensure_tiny_vlm

    return ensure_tiny_vlm(TinyVLMSpec(corpus=CORPUS), default_cache_dir())


@pytest.fixture(scope="module")
def batch(model_dir):
    """Two prompts (a red and a blue square), each with a group of responses and advantages."""
    from PIL import Image
    from transformers import AutoProcessor

    from rollplex.engines.vlm import PromptInputs

    proc = AutoProcessor.from_pretrained(model_dir)
    tok = proc.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    text = proc.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    groups = []
    for i, (rgb, answers, adv) in enumerate([
        ((200, 30, 30), ["red", "green blue", "blue"], [1.0, -0.5, -0.5]),
        ((30, 30, 200), ["blue", "red"], [0.7, -0.7]),
    ]):
        enc = proc(text=[text], images=[Image.new("RGB", (64, 64), rgb)], return_tensors="pt")
        prompt = PromptInputs(f"p{i}", enc["input_ids"][0], enc["pixel_values"], enc["image_grid_thw"])
        responses = [tok.encode(a) + [eos] for a in answers]
        groups.append((prompt, responses, torch.tensor(adv)))
    return groups, tok.pad_token_id


def micro_losses(module, batch) -> list[torch.Tensor]:
    from rollplex.engines.vlm import prefix_forward, suffix_logprobs, vision_embeds

    groups, pad_id = batch
    total = sum(sum(len(r) for r in responses) for _, responses, _ in groups)
    losses = []
    for prompt, responses, adv in groups:
        prefix = prefix_forward(module, prompt, vision_embeds(module, prompt), grad=True)
        logp, mask = suffix_logprobs(module, prefix, responses, pad_id=pad_id, grad=True)
        losses.append(-(adv.view(-1, 1) * logp * mask).sum() / total)
    return losses


def make(kind: str, model_dir, dtype=torch.float32, **options):
    spec = get_engine(kind, role="train")
    return spec.factory(EngineContext(str(model_dir), torch.device("cpu"), dtype, 0, {**OPTIONS, **options}))


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.state_dict_for_sync()}


def train(engine, batch, steps: int = STEPS, *, fused: bool = False) -> list[float]:
    """``steps`` optimizer steps on the batch; ``fused`` backpropagates the summed loss once."""
    norms = []
    for _ in range(steps):
        losses = micro_losses(engine.module, batch)
        if fused:
            engine.backward(torch.stack(losses).sum())
        else:
            for loss in losses:
                engine.backward(loss)
        stats = engine.step()
        assert not stats.skipped and stats.lr == OPTIONS["lr"]
        norms.append(stats.grad_norm)
    return norms


def assert_params_close(got: dict, want: dict, rel: float) -> None:
    """||got - want|| <= rel * ||want|| over all tensors together.

    Not per tensor: the k_proj biases have an exactly zero true gradient (softmax ignores a shift
    shared by all keys), so their AdamW update is normalised rounding noise and differs by ~1e-5
    relative between two correct summation orders.
    """
    assert got.keys() == want.keys()
    diff = math.sqrt(sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want))
    scale = math.sqrt(sum(float(want[k].double().pow(2).sum()) for k in want))
    assert diff <= rel * scale, f"relative parameter difference {diff / scale:.3g} > {rel}"


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


@pytest.fixture(scope="module")
def reference(model_dir, batch):
    """The torch engine's trajectory: initial weights, weights after STEPS steps, grad norms."""
    engine = make("torch", model_dir)
    start = snapshot(engine)
    norms = train(engine, batch)
    return start, snapshot(engine), norms


# --------------------------------------------------------------------------------------------------
# torch engine
def test_torch_micro_batches_equal_one_backward(model_dir, batch, reference):
    start, after, norms = reference
    fused = make("torch", model_dir)
    fused_norms = train(fused, batch, fused=True)
    assert_params_close(snapshot(fused), after, 1e-6)
    assert fused_norms == pytest.approx(norms, rel=1e-6)
    assert norms[0] > OPTIONS["grad_clip"]  # clipping was exercised


def test_vision_tower_is_frozen_and_never_changes(model_dir, reference):
    start, after, _ = reference
    vision = {k for k in start if "visual" in k}
    assert vision and not vision & changed(start, after)
    assert changed(start, after) == set(start) - vision  # everything else trained
    engine = make("torch", model_dir)
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    for name, p in engine.module.named_parameters():
        assert p.requires_grad == ("visual" not in name)
        assert (id(p) in optimized) == p.requires_grad, name


def test_sync_names_are_module_names(model_dir):
    """state_dict_for_sync uses module names; save_pretrained's file uses the release names."""
    from safetensors import safe_open
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.torch_train import checkpoint_to_module_names

    engine = make("torch", model_dir)
    weights = dict(engine.state_dict_for_sync())
    fresh = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    fresh.load_state_dict(weights, strict=True)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        file_names = set(f.keys())
    assert set(checkpoint_to_module_names(fresh)) == file_names
    assert {k for k, _ in engine.state_dict_for_sync(trainable_only=True)} == {k for k in weights if "visual" not in k}


def test_torch_save_load_resumes_exactly(model_dir, batch, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    first = make("torch", model_dir)
    train(first, batch, 1)
    first.save(str(tmp_path))
    train(first, batch, 1)
    resumed = make("torch", model_dir)
    resumed.load(str(tmp_path))
    train(resumed, batch, 1)
    assert_params_close(snapshot(resumed), snapshot(first), 0.0)
    # the checkpoint is an ordinary HF checkpoint
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "optimizer.pt").exists()
    assert reloaded.state_dict().keys() == first.module.state_dict().keys()


def test_torch_nan_loss_raises_and_applies_nothing(model_dir, batch, reference):
    engine = make("torch", model_dir)
    before = snapshot(engine)
    losses = micro_losses(engine.module, batch)
    engine.backward(losses[0])
    engine.backward(losses[1] * float("nan"))
    with pytest.raises(FloatingPointError, match=r"non-finite.*in parameter 'model\.language_model\..*not applied"):
        engine.step()
    assert not changed(before, snapshot(engine))
    assert all(p.grad is None for p in engine.module.parameters())
    assert not engine.optimizer.state  # AdamW never stepped
    # the bad batch left nothing behind: the next steps follow the reference exactly
    train(engine, batch)
    assert_params_close(snapshot(engine), reference[1], 0.0)


# --------------------------------------------------------------------------------------------------
# DeepSpeed engine
deepspeed_stages = pytest.mark.parametrize("stage", [0, 1, 2, 3])


@deepspeed_stages
def test_deepspeed_matches_torch(model_dir, batch, reference, stage):
    pytest.importorskip("deepspeed")
    start, after, norms = reference
    engine = make("deepspeed", model_dir, zero_stage=stage)
    try:
        assert_params_close(snapshot(engine), start, 0.0)
        ds_norms = train(engine, batch)
        got = snapshot(engine)
    finally:
        engine.close()
    assert_params_close(got, after, 1e-5)
    # the norm catches a loss scaled by 1/M, which AdamW's scale invariance would hide in the weights
    assert ds_norms == pytest.approx(norms, rel=1e-5)
    assert not {k for k in changed(start, got) if "visual" in k}


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_save_load_resumes_exactly(model_dir, batch, tmp_path, stage):
    pytest.importorskip("deepspeed")
    from transformers import Qwen2_5_VLForConditionalGeneration

    first = make("deepspeed", model_dir, zero_stage=stage)
    resumed = make("deepspeed", model_dir, zero_stage=stage)
    try:
        train(first, batch, 1)
        first.save(str(tmp_path))
        saved = snapshot(first)
        train(first, batch, 1)
        resumed.load(str(tmp_path))
        assert_params_close(snapshot(resumed), saved, 0.0)
        train(resumed, batch, 1)
        assert_params_close(snapshot(resumed), snapshot(first), 0.0)
    finally:
        first.close()
        resumed.close()
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    assert_params_close(dict(reloaded.state_dict()), saved, 0.0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_nan_loss_raises_and_applies_nothing(model_dir, batch, reference, stage):
    pytest.importorskip("deepspeed")
    engine = make("deepspeed", model_dir, zero_stage=stage)
    try:
        before = snapshot(engine)
        losses = micro_losses(engine.module, batch)
        engine.backward(losses[0])
        engine.backward(losses[1] * float("nan"))
        named = r"in parameter 'model\.language_model\." if stage == 1 else r"ZeRO's gradient partitions"
        with pytest.raises(FloatingPointError, match=rf"non-finite\).*{named}.*not applied"):
            engine.step()
        assert not changed(before, snapshot(engine))
        train(engine, batch)
        got = snapshot(engine)
    finally:
        engine.close()
    assert_params_close(got, reference[1], 1e-5)


def test_deepspeed_bf16_without_zero_matches_zero(model_dir, batch):
    """bf16 at stage 0 takes DeepSpeed's FP16_UnfusedOptimizer path, whose state set-up runs one AdamW
    step on zero gradients (the first real update came out 0.75x); the engine undoes that."""
    pytest.importorskip("deepspeed")
    updates = {}
    for stage in (0, 2):
        engine = make("deepspeed", model_dir, dtype=torch.bfloat16, zero_stage=stage)
        try:
            start = snapshot(engine)
            train(engine, batch, 1)
            updates[stage] = {k: v.float() - start[k].float() for k, v in snapshot(engine).items()}
        finally:
            engine.close()
    assert_params_close(updates[0], updates[2], 1e-2)


def test_engines_are_registered():
    assert get_engine("torch", role="train").factory.__name__ == "TorchTrainEngine"
    assert get_engine("deepspeed", role="train").requires == ("deepspeed",)
    assert get_engine("transformers", role="score").factory.__name__ == "HFScoreEngine"


def test_hf_score_engine_is_frozen(model_dir):
    engine = get_engine("transformers", role="score").factory(
        EngineContext(str(model_dir), torch.device("cpu"), torch.float32, 0))
    assert not engine.model.training and engine.dtype == torch.float32
    assert not any(p.requires_grad for p in engine.model.parameters())
    assert math.isfinite(float(next(engine.model.parameters()).sum()))


def test_deepspeed_builds_after_an_unclosed_engines_world_is_gone(model_dir):
    """An engine never closed leaves DeepSpeed's clone of the world group cached; a run's end
    destroys the world (vLLM does), and the next engine in the process must not reuse the dead clone."""
    pytest.importorskip("deepspeed")
    import torch.distributed as dist
    from deepspeed.utils import groups

    make("deepspeed", model_dir, zero_stage=0)
    dist.destroy_process_group()
    assert groups._WORLD_GROUP is not None  # the stale cache the next engine meets
    engine = make("deepspeed", model_dir, zero_stage=0)
    assert engine.ds.module is engine.module
