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
    # the memory preflight counts them alike, on the meta device
    from rollplex.pipeline.run.preflight import parameter_counts

    assert parameter_counts(str(model_dir), lora=LORA) == (sum(p.numel() for p in engine.module.parameters()),
                                                           sum(p.numel() for n, p in engine.module.named_parameters()
                                                               if n in trained))
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


@pytest.mark.parametrize("given, message", [
    ("train.lora={rnak: 4}", "unknown field train.lora.rnak; did you mean 'rank'?"),
    ("train.lora={rank: 0}", "train.lora.rank: 0 is below the minimum 1"),
    ("train.lora={alpha: 0}", "train.lora.alpha: 0.0 must be above 0"),
    ("train.lora={rank: 100000}", "train.lora.rank: 100000 is above the maximum 65536"),
    ("train.lora={alpha: .inf}", "train.lora.alpha: inf is above the maximum"),
    ("train.lora={alpha: .nan}", "train.lora.alpha: expected a number, got nan"),
    ("train.lora={dropout: 1}", r"train.lora.dropout: 1.0 is not in \[0, 1\)"),
    ("train.lora={target_modules: q_proj}", "train.lora.target_modules: expected list"),
    ("train.freeze_vision=false", "train.freeze_vision: false trains the whole vision tower"),
])
def test_bad_lora_settings_are_refused_by_name(given, message):
    from rollplex.config import load_config
    from rollplex.errors import ConfigError

    extra = ["train.lora={rank: 4}"] if given.startswith("train.freeze") else []
    with pytest.raises(ConfigError, match=message):
        load_config(None, [given, *extra])


def test_missing_lora_keys_take_their_defaults_and_the_config_round_trips(tmp_path):
    from rollplex.config import LORA_DEFAULTS, dump_config, load_config

    cfg = load_config(None, ["train.lora={rank: 16}"])
    assert cfg.train.lora == {**LORA_DEFAULTS, "rank": 16}
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "c.yaml") == cfg
    assert load_config(None).train.lora is None


def test_the_sharing_plan_gives_vllm_its_own_copy_of_each_layer_a_target_is_part_of(tiny_model_dir):
    from rollplex.pipeline.plan.weightshare import annotate_run

    def decisions(targets):
        plan = annotate_run([], str(tiny_model_dir), "vllm", "deepspeed", "float32", 2, "auto", lora_targets=targets)
        return plan, {d.tensor: d for d in plan.gpus[0].decisions}

    full, before = decisions(())
    plan, after = decisions(["q_proj", "lm_head"])
    assert all(d.kind == "alias" for d in before.values())
    rebuilt = {n for n, d in after.items() if d.kind == "rebuild"}
    assert rebuilt == {n for n in after if "qkv_proj" in n} | {"lm_head.weight"}
    assert after["layers.0.self_attn.qkv_proj.weight"].how == "merge"
    assert after["layers.0.self_attn.qkv_proj.bias"].how == "copy"  # q's bias sits in the fused q|k|v
    # only what is reloaded counts as synced; the base the rollout aliases never changes
    assert {n for n, d in after.items() if d.trainable} == rebuilt
    assert plan.per_gpu("extra") == sum(after[n].nbytes for n in rebuilt) > full.per_gpu("extra") == 0
    assert any("LoRA on q_proj, lm_head" in note for note in plan.notes)
    # hf runs the trainer's module, adapters and all: its plan is the one without LoRA
    hf = annotate_run([], str(tiny_model_dir), "hf", "torch", "float32", 0, "auto", lora_targets=["q_proj"])
    assert all(d.kind == "alias" for d in hf.gpus[0].decisions)


@pytest.mark.slow
def test_vllm_and_hf_decode_the_adapted_policy_on_the_trainers_base(tiny_model_dir, torch_threads):
    """Weight sharing under LoRA: the hf engine runs the trainer's module, adapters and all; vLLM runs
    on the trainer's storage for every layer the adapters leave alone and keeps its own copy of the
    targets, merged at each sync. Both follow the adapters' steps and agree token for token."""
    pytest.importorskip("vllm")
    from rollplex.engines.base import DecodeRequest, EngineContext, get_engine
    from rollplex.engines.sharing import fuse_for_rollout
    from rollplex.pipeline.plan.weightshare import annotate_run

    torch_threads(2)
    dtype, device = torch.float32, torch.device("cpu")
    train = get_engine("torch", "train").factory(EngineContext(str(tiny_model_dir), device, dtype, 0,
                                                               {"lr": 0.05, "lora": LORA}))
    fuse_for_rollout(train.module, "torch")
    vllm = get_engine("vllm", "decode").factory(EngineContext(str(tiny_model_dir), device, dtype, 0, {
        "share_model": train.module, "max_model_len": 256, "max_num_seqs": 4, "kv_cache_bytes": 32 << 20}))
    hf = get_engine("hf", "decode").factory(EngineContext(str(tiny_model_dir), device, dtype, 0,
                                                           {"share_model": train.module}))
    shared = vllm.shared.tensors
    assert shared and all(st.aliased for st in shared.values()), vllm.shared.summary()
    # the run's sharing plan (what `rollplex graph` prints) says exactly this
    plan = annotate_run([], str(tiny_model_dir), "vllm", "torch", "float32", 0, "auto",
                        lora_targets=LORA["target_modules"])
    assert {d.tensor for d in plan.gpus[0].decisions if d.kind == "alias"} == set(shared)
    assert not [n for n in shared if n.startswith(("lm_head", "layers.0.self_attn.qkv", "layers.0.mlp.down"))]
    assert "layers.0.mlp.gate_up_proj.weight" in shared and "layers.0.self_attn.o_proj.weight" in shared

    def greedy(engine, tag):
        engine.add_requests([DecodeRequest(f"{tag}{i}", [5 + i, 17, 33, 9], None, None, 8, seed=i, temperature=0.0)
                             for i in range(2)])
        out = []
        while engine.has_unfinished():
            out += engine.step(8)
        return sorted((f.request_id[len(tag):], f.token_ids) for f in out)

    before = greedy(vllm, "a")
    assert before == greedy(hf, "b")
    ids = torch.tensor([[5, 17, 33, 9] + before[0][1]])
    for _ in range(3):  # move the adapters far enough to change greedy tokens
        loss = -train.module(ids).logits.log_softmax(-1)[0, :-1].gather(1, ids[0, 1:, None]).mean()
        train.backward(-loss)
        train.step()
    vllm.load_weights(train.state_dict_for_sync(trainable_only=True))
    hf.load_weights(train.state_dict_for_sync(trainable_only=True))
    after = greedy(vllm, "c")
    assert after == greedy(hf, "d") and after != before
    storages = {p.untyped_storage().data_ptr() for p in train.module.parameters()}
    model = dict(vllm.llm.collective_rpc(lambda w: w.model_runner.model)[0].named_parameters())
    assert model["language_model.model.layers.0.mlp.gate_up_proj.weight"].untyped_storage().data_ptr() in storages
    assert model["language_model.lm_head.weight"].untyped_storage().data_ptr() not in storages  # merged, its own
    # Not closed, as in test_weightshare: in-process vLLM's teardown takes the process group with it.
