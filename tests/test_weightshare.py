"""Weight sharing: the planner's invariants, and the rollout layout materialised on the trainer's
storage for emulated TP gangs (every (t_train, t_roll) in {1,2,4,8}²), checked against HF forwards.

One gang of max(t_train, t_roll) GPUs, emulated in one process::

    HF model ──shard (t_train)──▶ trainer storage per GPU ──plan──▶ rollout tensors per GPU
        │                              │  alias: a view of it (data_ptr inside)      │
        │                              │  inplace: it lies inside the rollout buffer │
        │                              │  rebuild: a copy (local or from peers)      │
        └── forward ══ trainer TP forward ══ rollout TP forward ◀─────────────────────┘
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollplex.engines.sharing import Gang, SharedWeights, TextDims, fuse_parameters, inside, tp_forward
from rollplex.errors import ConfigError
from rollplex.engines.modelspec import PRESETS, VLMSpec
from rollplex.engines.tensorlayouts import actor_layouts
from rollplex.pipeline.plan.weightshare import RolloutSide, TrainerSide, format_plan, plan_gang

TPS = (1, 2, 4, 8)


@pytest.fixture(autouse=True)
def one_thread(torch_threads):
    """Thousands of tiny matmuls: one thread, or OMP's team start-up dominates on a busy box."""
    torch_threads(1)


# --------------------------------------------------------------------------------------------------
# the planner, on its own
@st.composite
def specs(draw):
    heads = draw(st.sampled_from([8, 16, 24, 40]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0]))
    return VLMSpec("h", heads * 8, draw(st.integers(1, 3)), heads, kv, 8, 8 * draw(st.integers(1, 6)),
                   draw(st.integers(10, 700)), draw(st.booleans()),
                   vit_depth=draw(st.sampled_from([0, 1])), vit_hidden=32, vit_intermediate=48, vit_heads=8, vit_out=64)


@settings(max_examples=60, deadline=None)
@given(spec=specs(), tt=st.sampled_from(TPS), tr=st.sampled_from(TPS), fused=st.booleans(),
       allocation=st.sampled_from(["fused", "separate"]), zero=st.sampled_from([0, 1, 2, 3]),
       mapping=st.sampled_from(["aligned", "contiguous"]))
def test_plan_invariants(spec, tt, tr, fused, allocation, zero, mapping):
    if spec.heads % 8 and max(tt, tr) == 8 and spec.heads % max(tt, tr):
        with pytest.raises(ConfigError, match="qkv_proj"):
            plan_gang(actor_layouts(spec), TrainerSide(tt, zero=zero), RolloutSide(tr))
        return
    plan = plan_gang(actor_layouts(spec), TrainerSide(tt, zero=zero, allocation=allocation),
                     RolloutSide(tr, fused=fused), mapping)
    assert len(plan.gpus) == max(tt, tr)
    for g in plan.gpus:
        for d in g.decisions:
            assert d.aliased + d.local + d.gathered == d.nbytes, d  # every byte has one source
            assert (d.kind == "alias") == (d.aliased == d.nbytes and d.view is not None)
            if d.view is not None:  # the view stays inside the trainer's shard of that tensor
                v = d.view
                extent = v.offset + 1 + sum((s - 1) * st_ for s, st_ in zip(v.shape, v.stride))
                lay = next(x for x in (plan_gang.__globals__["unfuse"](actor_layouts(spec)) if not fused
                                       else actor_layouts(spec)) if x.name == d.tensor)
                assert extent <= lay.shard_numel(tt, g.train_rank)
    if zero == 3:
        assert not plan.shared and any("ZeRO-3" in n for n in plan.notes)
        assert any("ZeRO-3" in line for line in format_plan(plan))
    if tt == tr and zero < 3 and mapping == "aligned" and (allocation == "fused" or not fused):
        assert all(d.kind == "alias" for g in plan.gpus for d in g.decisions)  # equal layouts: all views
    if zero < 3 and mapping == "contiguous":  # the aligned mapping never shares less
        aligned = plan_gang(actor_layouts(spec), TrainerSide(tt, zero=zero, allocation=allocation),
                            RolloutSide(tr, fused=fused), "aligned")
        assert aligned.saved_per_gpu() >= plan.saved_per_gpu()


def test_dtype_mismatch_and_bad_degrees():
    lays = actor_layouts(PRESETS["qwen2.5-vl-7b"], vision=False)
    plan = plan_gang(lays, TrainerSide(2, dtype="float32"), RolloutSide(2, dtype="bfloat16"))
    assert not plan.shared and all(d.how == "cast" for g in plan.gpus for d in g.decisions)
    with pytest.raises(ConfigError, match="divide"):
        plan_gang(lays, TrainerSide(2), RolloutSide(3))
    with pytest.raises(ConfigError, match="q_proj.weight has 28 units"):  # 28 heads cannot split 8 ways
        plan_gang(lays, TrainerSide(8), RolloutSide(2))


def test_preset_reports_hbm_saved():
    """7B at train TP 2 → rollout TP 4 (the paper's kind of pair): the row-parallel and vocab tensors
    are views, qkv and gate_up are concatenated locally; nothing crosses the link."""
    plan = plan_gang(actor_layouts(PRESETS["qwen2.5-vl-7b"]), TrainerSide(2), RolloutSide(4))
    rows = plan.by_class()
    assert rows["attn.o"]["aliased"] == rows["attn.o"]["nbytes"] and rows["mlp.gate_up"]["aliased"] == 0
    assert all(r["gathered"] == 0 for r in rows.values())
    text = "\n".join(format_plan(plan, "qwen2.5-vl-7b"))
    assert "GiB saved" in text and "mlp.gate_up" in text
    # the torch engines run gate/up and q/k/v apart: every tensor is a view
    unfused = plan_gang(actor_layouts(PRESETS["qwen2.5-vl-32b"]), TrainerSide(4), RolloutSide(8, fused=False))
    assert all(d.kind == "alias" for g in unfused.gpus for d in g.decisions)


# --------------------------------------------------------------------------------------------------
# emulated gangs on a random small model
def _model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    rng = random.Random(seed)
    heads, d = 8, rng.choice([4, 8])
    kv = rng.choice([1, 2, 4, 8])
    cfg = Qwen2Config(vocab_size=rng.randint(40, 200), hidden_size=heads * d, intermediate_size=8 * rng.randint(2, 6),
                      num_hidden_layers=rng.choice([1, 2]), num_attention_heads=heads, num_key_value_heads=kv,
                      tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float().eval()
    spec = VLMSpec("rand", heads * d, cfg.num_hidden_layers, heads, kv, d, cfg.intermediate_size, cfg.vocab_size,
                   False)
    ids = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(seed))
    return model, spec, ids


def _canonical(model) -> dict[str, torch.Tensor]:
    return {(k[6:] if k.startswith("model.") else k): v.detach().clone() for k, v in model.state_dict().items()}


def _forwards(model, spec, ids, gang: Gang, fused: bool):
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
        cos, sin = model.model.rotary_emb(torch.zeros(1, len(ids), spec.hidden), torch.arange(len(ids))[None])
    dims = TextDims(spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.vocab, model.config.rms_norm_eps)
    lays = gang.layouts

    def split(name, rank):
        return [n for _, _, n in lays[name].shard_rows(gang.tr, rank)]

    roll = tp_forward(dims, ids, cos, sin, gang.tr, lambda r, n: gang.rollout[gang.rank_gpu("roll", r)][n], fused,
                      split)
    train = tp_forward(dims, ids, cos, sin, gang.tt, lambda r, n: gang.trainer_tensor(gang.rank_gpu("train", r), n),
                       False, split)
    return ref, train, roll


def _plan_bytes(plan, trainable_only=False) -> dict[str, int]:
    decisions = [d for g in plan.gpus for d in g.decisions if d.trainable or not trainable_only]
    return {"local": sum(d.local for d in decisions), "gathered": sum(d.gathered for d in decisions)}


def _check_storage(gang: Gang) -> None:
    """Aliases point into the trainer's buffer on the same GPU; copies do not; in place buffers
    hold the trainer's parameters."""
    for g in gang.plan.gpus:
        for d in g.decisions:
            t, buf = gang.rollout[g.gpu][d.tensor], gang.buffers[g.gpu][d.tensor]
            if d.kind == "alias":
                assert inside(t, buf), d.tensor
            elif d.kind == "inplace":
                assert t.data_ptr() == buf.data_ptr()
                assert all(inside(v, t) for (name, _), v in gang.train_params[g.gpu].items() if name == d.tensor)
            else:
                assert not any(inside(t, b) for b in gang.buffers[g.gpu].values()), d.tensor


@pytest.mark.parametrize("seed", [0, 1])
def test_rollout_forward_equals_training_forward_all_tp_pairs(seed):
    model, spec, ids = _model(seed)
    full = _canonical(model)
    lays = actor_layouts(spec)
    for (tt, tr), fused in itertools.product(itertools.product(TPS, TPS), (True, False)):
        plan = plan_gang(lays, TrainerSide(tt, "float32"), RolloutSide(tr, "float32", fused=fused))
        gang = Gang(lays, plan, full)
        ref, train, roll = _forwards(model, spec, ids, gang, fused)
        where = f"t_train={tt} t_roll={tr} fused={fused} kv_heads={spec.kv_heads}"
        torch.testing.assert_close(train, ref, rtol=1e-5, atol=2e-5, msg=where)
        torch.testing.assert_close(roll, train, rtol=1e-5, atol=2e-5, msg=where)
        assert gang.moved == _plan_bytes(plan), where  # the copies made are the ones the plan counted
        _check_storage(gang)


@pytest.mark.parametrize("tt,tr", [(1, 1), (2, 4), (4, 2), (1, 8), (8, 1), (4, 4)])
def test_optimizer_step_reaches_rollout_without_copying_aliases(tt, tr):
    model, spec, ids = _model(3)
    lays = actor_layouts(spec)
    plan = plan_gang(lays, TrainerSide(tt, "float32"), RolloutSide(tr, "float32"))
    gang = Gang(lays, plan, _canonical(model))
    # One AdamW step: on the HF model, and on every GPU's trainer shards with the same gradients
    # (a gang of the gradients has the same geometry, so its shards are the matching slices).
    model.train()
    loss = model(ids[None], labels=ids[None]).loss
    loss.backward()
    model.eval()
    grads = Gang(lays, plan, {(k[6:] if k.startswith("model.") else k): p.grad.detach()
                              for k, p in model.named_parameters()})
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    before = {(g.gpu, d.tensor): gang.rollout[g.gpu][d.tensor].data_ptr() for g in plan.gpus for d in g.decisions}
    for gpu, params in enumerate(gang.train_params):
        views = list(params.values())
        for key, v in params.items():
            v.grad = grads.train_params[gpu][key].clone()
        torch.optim.AdamW(views, lr=1e-2, foreach=False).step()
    aliased = [(g.gpu, d.tensor) for g in plan.gpus for d in g.decisions if d.kind == "alias"]
    updated = _canonical(model)
    fresh = Gang(lays, plan, updated)  # what the rollout tensors must now hold
    for gpu, name in aliased:  # current before any refresh
        torch.testing.assert_close(gang.rollout[gpu][name], fresh.rollout[gpu][name], rtol=1e-6, atol=1e-6)
    moved = gang.refresh()
    assert moved == _plan_bytes(plan, trainable_only=True)  # aliased tensors moved no byte
    assert all(gang.rollout[g][n].data_ptr() == p for (g, n), p in before.items())
    _, train, roll = _forwards(model, spec, ids, gang, True)
    ref, _, _ = _forwards(model, spec, ids, fresh, True)
    torch.testing.assert_close(train, ref, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(roll, ref, rtol=1e-5, atol=2e-5)


# --------------------------------------------------------------------------------------------------
# one GPU, a live module (what the runtime's colocated decode engines use)
def test_shared_weights_on_a_live_module():
    model, spec, ids = _model(5)
    lays = actor_layouts(spec)
    plain = SharedWeights(_model(5)[0], lays, fused=True)  # a twin whose storage stays HF's own
    assert {c for c, r in plain.report().items() if r["rebuilt"]} == {"attn.qkv", "mlp.gate_up"}
    assert all(plain.tensors[n].aliased for n in ("embed_tokens.weight", "layers.0.self_attn.o_proj.weight"))
    assert fuse_parameters(model, lays) == 3 * spec.layers  # qkv weight, qkv bias, gate_up per layer
    shared = SharedWeights(model, lays, fused=True)
    assert all(st_.aliased for st_ in shared.tensors.values())
    params = dict(model.named_parameters())
    qkv = shared.tensors["layers.0.self_attn.qkv_proj.weight"].tensor
    assert inside(params["model.layers.0.self_attn.k_proj.weight"], qkv)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(ids[None], labels=ids[None]).loss.backward()
    opt.step()
    assert shared.refresh() == 0  # every rollout tensor is the trainer's storage: nothing to copy
    q, k, v = (params[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    torch.testing.assert_close(qkv, torch.cat([q, k, v]).detach(), rtol=0, atol=0)
    twin = plain.tensors["layers.0.self_attn.qkv_proj.weight"]
    with torch.no_grad():
        for s in twin.sources:
            s.add_(1.0)
    assert plain.refresh() == sum(st_.tensor.numel() * 4 for st_ in plain.tensors.values() if not st_.aliased)
    torch.testing.assert_close(twin.tensor, torch.cat(twin.sources), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# the runtime's colocated engines on the trainer's storage
@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero2_shares_its_flat_buffer_and_zero3_is_refused(tiny_model_dir, stage):
    """ZeRO-2 with parameters in fusion order: every rollout tensor (vLLM's layout) is a view of
    DeepSpeed's flat buffer (the frozen vision tower fused beside it), and its step reaches them in
    place. ZeRO-3 partitions the parameters: the run-level check refuses to share and says why."""
    pytest.importorskip("deepspeed")
    from rollplex.engines.base import EngineContext, get_engine
    from rollplex.engines.sharing import layouts_for_module
    from rollplex.pipeline.plan.weightshare import sharing_refusal

    if stage == 3:
        assert "ZeRO-3" in sharing_refusal("vllm", "deepspeed", 3)
        assert sharing_refusal("vllm", "deepspeed", 2) is None
        return
    train = get_engine("deepspeed", "train").factory(EngineContext(str(tiny_model_dir), torch.device("cpu"),
                                                                   torch.float32, 0,
                                                                   {"zero_stage": 2, "fusion_order": True, "lr": 0.05}))
    lays = layouts_for_module(train.module)
    fuse_parameters(train.module, lays, frozen_only=True)
    shared = SharedWeights(train.module, lays)
    assert all(st_.aliased for st_ in shared.tensors.values()), shared.summary()
    qkv = shared.tensors["layers.0.self_attn.qkv_proj.weight"].tensor
    before = qkv.clone()
    ids = torch.tensor([[5, 17, 33, 9, 12, 40]])
    train.backward(train.module(ids, labels=ids).loss)
    train.step()
    assert not torch.equal(qkv, before) and shared.refresh() == 0
    params = dict(train.module.named_parameters())
    torch.testing.assert_close(qkv, torch.cat([params[f"model.language_model.layers.0.self_attn.{n}_proj.weight"]
                                               for n in "qkv"]).detach(), rtol=0, atol=0)


@pytest.mark.slow
def test_vllm_and_hf_decode_run_on_the_trainers_storage(tiny_model_dir, torch_threads):
    """vLLM (CPU, in-process) and the torch engine decode on the torch trainer's parameters: every
    vLLM weight lies inside a trainer parameter's storage, both engines give the same greedy tokens,
    and after an optimizer step they follow the new weights with nothing copied."""
    pytest.importorskip("vllm")
    from rollplex.engines.base import DecodeRequest, EngineContext, get_engine
    from rollplex.engines.sharing import layouts_for_module

    torch_threads(2)
    dtype, device = torch.float32, torch.device("cpu")
    train = get_engine("torch", "train").factory(EngineContext(str(tiny_model_dir), device, dtype, 0, {"lr": 0.05}))
    fuse_parameters(train.module, layouts_for_module(train.module))
    vllm = get_engine("vllm", "decode").factory(EngineContext(str(tiny_model_dir), device, dtype, 0, {
        "share_model": train.module, "max_model_len": 256, "max_num_seqs": 4, "kv_cache_bytes": 32 << 20}))
    hf = get_engine("hf", "decode").factory(EngineContext(str(tiny_model_dir), device, dtype, 0,
                                                           {"share_model": train.module}))
    assert all(st_.aliased for st_ in vllm.shared.tensors.values()), vllm.shared.summary()
    storages = {p.untyped_storage().data_ptr() for p in train.module.parameters()}
    model = vllm.llm.collective_rpc(lambda w: w.model_runner.model)[0]
    assert all(p.untyped_storage().data_ptr() in storages for p in model.parameters() if p.numel())

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
    for _ in range(3):  # move the weights far enough to change greedy tokens
        loss = -train.module(ids).logits.log_softmax(-1)[0, :-1].gather(1, ids[0, 1:, None]).mean()
        train.backward(-loss)
        train.step()
    vllm.load_weights(train.state_dict_for_sync(trainable_only=True))
    hf.load_weights(train.state_dict_for_sync(trainable_only=True))
    assert vllm.shared.copied_bytes == 0
    after = greedy(vllm, "c")
    assert after == greedy(hf, "d") and after != before
    # Not closed: dropping in-process vLLM tears down the torch.distributed group DeepSpeed adopts,
    # and a later DeepSpeed engine in this process would find it gone (the DeepSpeed test runs first).


# --------------------------------------------------------------------------------------------------
# what users see: `rollplex weights`, and the weight_sync node of `rollplex graph`
def test_weights_cli_prints_hbm_saved_and_refuses_bad_degrees(capsys, tmp_path):
    import json

    from rollplex.cli import main

    out = tmp_path / "w.json"
    assert main(["weights", "--model", "qwen2.5-vl-32b", "--tp-train", "8", "--tp-roll", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "GiB saved" in text and "mlp.gate_up" in text and "gather into" in text
    row = json.loads(out.read_text())[0]
    assert row["aliased_bytes_per_gpu"] > 0 and row["tp_train"] == 8
    assert main(["weights", "--model", "qwen2.5-vl-7b", "--tp-train", "2", "--tp-roll", "3"]) == 2
    assert "must divide one another" in capsys.readouterr().err
    assert main(["weights", "--model", "qwen2.5-vl-7b", "--zero", "3", "--tp-train", "2", "--tp-roll", "2"]) == 0
    assert "ZeRO-3" in capsys.readouterr().out


def test_weight_sync_node_carries_the_plan(tiny_model_dir):
    from rollplex.dags.grpo import grpo
    from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
    from rollplex.pipeline.plan.weightshare import annotate_run

    dims = ModelDims(hidden=128, layers=2, kv_heads=2, head_dim=32, vocab=600, params=600_000)
    graph = compile_iteration(grpo, BatchShape(prompts=2, samples=2, max_new_tokens=8, chunk_tokens=4,
                                               micro_batch_groups=1),
                              EngineChoice({"decode": "vllm", "train": "deepspeed", "score": "transformers"}), dims)
    plan = annotate_run([graph], str(tiny_model_dir), "vllm", "deepspeed", "float32", 2, "auto")
    assert plan is not None and plan.saved_per_gpu() == plan.per_gpu("nbytes")  # TP 1: everything a view
    line = next(ln for ln in str(graph).splitlines() if ln.startswith("%weight_sync"))
    assert "aliased 2." in line and "rebuilt 0.0MiB" in line
    annotate_run([graph], str(tiny_model_dir), "vllm", "deepspeed", "float32", 3, "auto")
    assert "ZeRO-3" in next(ln for ln in str(graph).splitlines() if ln.startswith("%weight_sync"))
