"""Activation checkpointing (train.gradient_checkpointing): the same log-probs and gradients, with
a layer's input the only thing a training forward keeps."""
from __future__ import annotations

import pytest
import torch

from rollplex.engines import recompute, vlm
from test_packed_attention import GROUPS, _prompts


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """The tiny model twice, the second with its decoder layers recomputing."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    pair = []
    for checkpointed in (False, True):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir)
        for name, p in model.named_parameters():
            p.requires_grad_("visual" not in name)
        if checkpointed:
            assert recompute.checkpoint_layers(model) == len(model.model.language_model.layers)
            assert recompute.checkpoint_layers(model) == 0  # once only
        pair.append(model)
    return pair, _prompts(tiny_model_dir)


def _train_step(model, prompts, attention: str):
    """Prefix and packed suffix with grad, backward: (log-probs, gradients, bytes the suffix forward's
    graph keeps for the backward)."""
    model.zero_grad()
    visions = vlm.vision_embeds_batch(model, prompts)
    states = vlm.prefix_forward_batch(model, prompts, visions, grad=True)
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        scored = vlm.suffix_logprobs_batch(model, states, GROUPS, pad_id=0, grad=True)
    sum((lp * mask).sum() * (i + 1) for i, (lp, mask) in enumerate(scored)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return [lp.detach() * mask for lp, mask in scored], grads, sum(kept)


@pytest.mark.parametrize("attention", ["dense", "varlen"])
def test_recomputed_layers_give_the_same_logprobs_and_gradients_and_keep_less(models, attention, monkeypatch):
    monkeypatch.setattr(vlm, "SUFFIX_ATTENTION", attention)
    (plain, checkpointed), prompts = models
    checkpointed.load_state_dict(plain.state_dict())
    lp_a, g_a, kept_a = _train_step(plain, prompts, attention)
    lp_b, g_b, kept_b = _train_step(checkpointed, prompts, attention)
    for a, b in zip(lp_a, lp_b):
        assert torch.equal(a, b)
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=1e-7, rtol=1e-5), name
    assert kept_b < kept_a / 2, (kept_a, kept_b)


def test_full_sequence_forwards_recompute_too(models):
    (plain, checkpointed), prompts = models
    checkpointed.load_state_dict(plain.state_dict())
    out = []
    for model in (plain, checkpointed):
        model.zero_grad()
        lp, mask = vlm.full_sequence_logprobs(model, prompts[0], GROUPS[0], pad_id=0, grad=True)
        (lp * mask).sum().backward()
        out.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    assert torch.equal(out[0][0], out[1][0])
    for name, g in out[0][1].items():
        assert torch.allclose(g, out[1][1][name], atol=1e-7, rtol=1e-5), name


def test_the_prefix_forward_recomputes_and_returns_the_same_kv(models):
    """The prefix forward's KV is its output: recorded, not appended, so recomputing a layer leaves it
    as the first run made it; the forward keeps under half the bytes."""
    (plain, checkpointed), prompts = models
    checkpointed.load_state_dict(plain.state_dict())
    with torch.no_grad():
        visions = vlm.vision_embeds_batch(plain, prompts)
    out = []
    for model in (plain, checkpointed):
        kept = []

        def pack(t):
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            states = vlm.prefix_forward_batch(model, prompts, visions, grad=True)
        out.append((states, sum(kept)))
    (a, kept_a), (b, kept_b) = out
    for sa, sb in zip(a, b):
        assert sa.length == sb.length and torch.equal(sa.last_logits, sb.last_logits)
        for (ka, va), (kb, vb) in zip(sa.kv, sb.kv):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert kept_b < kept_a / 2, (kept_a, kept_b)


def test_the_trainer_checkpoints_when_the_config_asks(tiny_model_dir):
    from rollplex.engines.base import EngineContext
    from rollplex.engines.torch_train import load_policy

    for asked in (False, True):
        ctx = EngineContext(str(tiny_model_dir), torch.device("cpu"), torch.float32, seed=0,
                            options={"gradient_checkpointing": asked})
        model, _ = load_policy(ctx)
        assert all(getattr(layer, "_rollplex_recompute", False) == asked for layer in model.model.language_model.layers)


def test_a_run_asked_to_recompute_plans_and_trains_with_it(tmp_path):
    """train.gradient_checkpointing reaches the trainer's options and the byte model the planners
    read: a training forward's activations at 2·h bytes a token and layer instead of 34·h."""
    from rollplex.config import load_config
    from rollplex.pipeline.run.session import Session

    on = Session(load_config(None, ["train.gradient_checkpointing=true"]), tmp_path / "on")
    off = Session(load_config(None, []), tmp_path / "off")
    assert on.host_spec().train_options["gradient_checkpointing"] is True
    assert off.host_spec().train_options["gradient_checkpointing"] is False
    assert on.dims.checkpointing and not off.dims.checkpointing
    assert on.dims.activation_bytes(1000) * 17 == off.dims.activation_bytes(1000)
    assert on.dims.vision_bytes(100, grad=True) == off.dims.vision_bytes(100, grad=True)  # the tower keeps its own
