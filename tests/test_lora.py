"""LoRA (train.lora): adapters alone train, the reference is the base on the policy's own weights,
the merged export loads in plain transformers, and a checkpoint resumes exactly.

Engine tests train the tiny Qwen2.5-VL on test_train_engines' batch (two prompt groups, M = 2
micro-batches) through the same tasks.lm forwards the runtime uses.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from test_train_engines import assert_params_close, batch, make, micro_losses, model_dir  # noqa: E402,F401

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}


def lora_engine(kind: str, model_dir, **options):
    return make(kind, model_dir, lora=LORA, **options)


def steps(engine, batch, n: int) -> None:
    for _ in range(n):
        for loss in micro_losses(engine.module, batch):
            engine.backward(loss)
        assert not engine.step().skipped


def merged(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.state_dict_for_sync()}


def logits(module, batch) -> torch.Tensor:
    from rollplex.engines.vlm import prefix_forward, vision_embeds

    prompt = batch[0][0][0]
    with torch.no_grad():
        return prefix_forward(module, prompt, vision_embeds(module, prompt), grad=False).last_logits


def test_only_the_adapters_train_and_the_sync_speaks_the_base_models_names(model_dir, batch):
    from transformers import Qwen2_5_VLForConditionalGeneration

    engine = lora_engine("torch", model_dir)
    optimized = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert optimized == {id(p) for n, p in engine.module.named_parameters() if n in trained}
    before = merged(engine)
    steps(engine, batch, 2)
    after = merged(engine)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # the targets' merged weights moved, nothing else did
    assert changed and {k.rsplit(".", 2)[-2] for k in changed} == set(LORA["target_modules"])
    fresh = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    fresh.load_state_dict(after, strict=True)  # the base model's names, every tensor
    # a step changes the targets alone, but vLLM reloads fused layers whole: the language model travels
    assert {k for k, _ in engine.state_dict_for_sync(trainable_only=True)} == {k for k in after if "visual" not in k}
    # the merged weights give the adapted forward
    assert torch.allclose(logits(fresh, batch), logits(engine.module, batch), atol=1e-5)


def test_the_reference_is_the_base_with_the_adapters_off_on_the_policys_storage(model_dir, batch):
    from rollplex.engines.lora import without_adapters

    engine = lora_engine("torch", model_dir)
    steps(engine, batch, 2)
    reference = without_adapters(engine.module)
    with engine.peft.disable_adapter():
        base = logits(engine.module, batch)
    assert torch.equal(logits(reference, batch), base)
    assert not torch.allclose(logits(engine.module, batch), base, atol=1e-4)  # the policy did move
    policy_storage = {p.data_ptr() for p in engine.module.parameters()}
    assert all(p.data_ptr() in policy_storage for p in reference.parameters())  # no second copy
    assert not any(".lora_" in n for n, _ in reference.named_parameters())


def test_dropout_acts_in_training_forwards_only(model_dir, batch):
    from rollplex.engines.vlm import prefix_forward, vision_embeds

    engine = make("torch", model_dir, lora={**LORA, "dropout": 0.5})
    steps(engine, batch, 1)  # B is no longer zero, so the adapters' input dropout shows
    prompt = batch[0][0][0]
    vis = vision_embeds(engine.module, prompt)
    scored = [prefix_forward(engine.module, prompt, vis, grad=False).last_logits for _ in range(2)]
    trained = [prefix_forward(engine.module, prompt, vis, grad=True).last_logits.detach() for _ in range(2)]
    assert torch.equal(scored[0], scored[1])
    assert not torch.equal(trained[0], trained[1])


@pytest.mark.parametrize("kind", ["torch", "deepspeed"])
def test_a_lora_checkpoint_resumes_exactly_and_its_export_loads_in_plain_transformers(model_dir, batch, tmp_path,
                                                                                       kind):
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
    from transformers import AutoModelForImageTextToText

    first, resumed = lora_engine(kind, model_dir), lora_engine(kind, model_dir)
    try:
        steps(first, batch, 1)
        first.save(str(tmp_path))
        saved = merged(first)
        steps(first, batch, 1)
        resumed.load(str(tmp_path))
        assert_params_close(merged(resumed), saved, 0.0)
        steps(resumed, batch, 1)
        assert_params_close(merged(resumed), merged(first), 0.0)
        policy = logits(first.module, batch)
    finally:
        first.close()
        resumed.close()
    assert not (tmp_path / "adapter_config.json").exists()  # transformers would load the folder as an adapter
    from safetensors.torch import load_file

    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_" in k for k in adapter)  # not lm_head's base weight beside its adapter
    export = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    assert_params_close(dict(export.state_dict()), saved, 0.0)
    assert not torch.allclose(logits(export, batch), policy, atol=1e-4)  # the step after the save moved it
    # the adapter alone holds the optimizer's state: no copy of the frozen base in the checkpoint
    base_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    optimizer_bytes = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()
                          and "model.safetensors" not in p.name and p.parent.name != "adapter")
    assert optimizer_bytes < base_bytes / 4


@pytest.mark.parametrize("kind", ["torch", "deepspeed"])
def test_folding_makes_the_base_the_policy_and_restarts_the_adapters(model_dir, batch, kind):
    """The warm-up's end: the adapters merge into the base and B restarts at zero. Under DeepSpeed the
    fp32 copy of B must restart too; else its next step starts from the old B and applies it twice."""
    if kind == "deepspeed":
        pytest.importorskip("deepspeed")
    from rollplex.engines.lora import lora_layers, without_adapters

    results = {}
    for engine_kind in ("torch", kind):
        engine = lora_engine(engine_kind, model_dir)
        try:
            steps(engine, batch, 1)
            policy = logits(engine.module, batch)
            engine.reset_optimizer_state()
            assert engine.fold_adapter()
            assert torch.allclose(logits(without_adapters(engine.module), batch), policy, atol=1e-5)
            assert all(not layer.lora_B["default"].weight.any() for layer in lora_layers(engine.module).values())
            steps(engine, batch, 1)
            results[engine_kind] = merged(engine)
        finally:
            engine.close()
    assert_params_close(results[kind], results["torch"], 1e-5)


def test_lora_refuses_zero3_and_names_unknown_targets(model_dir):
    from rollplex.errors import ConfigError

    pytest.importorskip("deepspeed")
    with pytest.raises(ConfigError, match="train.lora: ZeRO-3"):
        make("deepspeed", model_dir, zero_stage=3, lora=LORA)
    with pytest.raises(ConfigError, match=r"train.lora.target_modules: \['qkv_proj'\] name no linear layer.*q_proj"):
        make("torch", model_dir, lora={**LORA, "target_modules": ["qkv_proj"]})
