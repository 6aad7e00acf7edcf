"""The packed suffix forward cut into its responses (varlen) equals the dense-masked one."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from rollplex.engines import packed_attention, vlm


def _prompts(tiny_model_dir) -> list[vlm.PromptInputs]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    prompts = []
    for size, text in (((112, 84), "What colour is it?"), ((56, 56), "Which colour?"), ((112, 112), "Colour.")):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        enc = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                        images=[Image.new("RGB", size, (200, 30, 30))], return_tensors="pt")
        prompts.append(vlm.PromptInputs(text, enc["input_ids"][0], enc["pixel_values"], enc["image_grid_thw"]))
    assert len({p.num_tokens for p in prompts}) == 3  # prefixes padded to the longest
    return prompts


@pytest.fixture(scope="module")
def model_and_prompts(tiny_model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir)
    for name, p in model.named_parameters():
        p.requires_grad_("visual" not in name)
    return model, _prompts(tiny_model_dir)


# Empty and one-token responses (no packed token), and groups of unequal widths.
GROUPS = [[[5, 6, 7, 8, 9], [10, 11], [], [15]], [[3, 4], [5]], [[6, 7, 8, 9, 10, 11], [1, 2, 3]]]


def _scored(model, prompts, attention):
    model.zero_grad()
    visions = vlm.vision_embeds_batch(model, prompts)
    states = vlm.prefix_forward_batch(model, prompts, visions, grad=True)
    old = vlm.SUFFIX_ATTENTION
    vlm.SUFFIX_ATTENTION = attention
    try:
        scored = vlm.suffix_logprobs_batch(model, states, GROUPS, pad_id=0, grad=True)
    finally:
        vlm.SUFFIX_ATTENTION = old
    total = sum((lp * mask).sum() * (i + 1) for i, (lp, mask) in enumerate(scored))
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return [lp.detach() * mask for lp, mask in scored], grads


def test_varlen_equals_the_dense_mask_in_values_and_gradients(model_and_prompts):
    model, prompts = model_and_prompts
    lp_v, g_v = _scored(model, prompts, "varlen")
    assert model.config.get_text_config()._attn_implementation == packed_attention.NAME
    lp_d, g_d = _scored(model, prompts, "dense")
    for a, b in zip(lp_v, lp_d):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    for name in g_d:
        scale = g_d[name].abs().max().clamp(min=1e-8)
        assert float((g_v[name] - g_d[name]).abs().max() / scale) < 1e-4, name
    assert any(float(g.abs().max()) > 0 for g in g_v.values())
    model.zero_grad()


def test_the_routed_model_still_runs_sdpa_for_every_other_forward(model_and_prompts, tiny_model_dir, tmp_path):
    """Once routed, a plain transformers forward of the same model gives what it gave before, and
    the folder it saves loads anywhere (the routing is not written to its config)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model, prompts = model_and_prompts
    packed_attention.enable(model)
    fresh = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir)
    assert fresh.config.get_text_config()._attn_implementation == "sdpa"
    p = prompts[0]
    ids = torch.cat([p.input_ids, torch.tensor([5, 6, 7])]).view(1, -1)
    kw = dict(input_ids=ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw,
              mm_token_type_ids=vlm.mm_token_types(ids, model.config))
    with torch.no_grad():
        assert torch.allclose(model(**kw).logits, fresh(**kw).logits, atol=1e-5)
    model.save_pretrained(tmp_path)
    assert packed_attention.NAME not in (tmp_path / "config.json").read_text()
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path)
    assert reloaded.config.get_text_config()._attn_implementation == "sdpa"


def test_the_layout_puts_each_response_on_its_own_prefix():
    # Two rows of width 6 on prefixes of 3 and 2 slots (padded to 3): row 0 holds responses of 2 and
    # 3 tokens, row 1 one of 4.
    lay = packed_attention.layout([(0, 0, 2, 3), (0, 2, 3, 3), (1, 0, 4, 2)], rows=2, width=6, prefix=3,
                                  device=torch.device("cpu"))
    assert lay.q_index.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert lay.k_index.tolist() == [0, 1, 2, 3, 4,  0, 1, 2, 5, 6, 7,  9, 10, 12, 13, 14, 15]
    assert lay.cu_q.tolist() == [0, 2, 5, 9] and lay.cu_k.tolist() == [0, 5, 11, 17]
    assert (lay.max_q, lay.max_k) == (4, 6)


def test_an_unknown_suffix_attention_is_refused():
    with pytest.raises(ValueError, match="suffix attention 'flash'"):
        vlm._varlen("flash", torch.float32, torch.device("cpu"))


def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu suite needs a CUDA device; run it on the GPU machine")
    return torch.device("cuda")


@pytest.mark.gpu
def test_flash_varlen_equals_the_reference_loop_at_3b_heads():
    """PyTorch's flash kernel (16 query heads on 2 KV heads of 128) against the SDPA loop in fp32 on
    the same bf16 inputs: outputs and the gradients of queries, keys and values."""
    device = _cuda()
    torch.manual_seed(0)
    segments = [(0, 0, 700, 1088), (0, 700, 1, 1088), (0, 701, 300, 1088), (1, 0, 1024, 900), (1, 1024, 64, 900)]
    lay = packed_attention.layout(segments, rows=2, width=1100, prefix=1088, device=device)
    tq, tk = len(lay.q_index), len(lay.k_index)
    q = torch.randn(tq, 16, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(tk, 2, 128, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(tq, 16, 128, device=device, dtype=torch.bfloat16)
    out = packed_attention.varlen(q, k, v, lay, 128 ** -0.5)
    out.backward(g)
    got = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = packed_attention.varlen(q32, k32, v32, lay, 128 ** -0.5)
    ref.backward(g.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref, q32.grad, k32.grad, v32.grad]):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 2e-2, (name, err)


@pytest.mark.gpu
def test_varlen_scores_on_cuda_in_bf16_as_closely_as_the_dense_mask(tiny_model_dir):
    """Both bf16 paths against the dense path in fp32: the flash path's error is no larger than the
    masked kernel's own (log-probs and gradients)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    device = _cuda()
    results = {}
    for dtype, attention in ((torch.float32, "dense"), (torch.bfloat16, "dense"), (torch.bfloat16, "varlen")):
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=dtype).to(device)
        for name, p in model.named_parameters():
            p.requires_grad_("visual" not in name)
        prompts = _prompts(tiny_model_dir)
        lp, grads = _scored(model, prompts, attention)
        results[dtype, attention] = ([x.float().cpu() for x in lp], {n: t.float().cpu() for n, t in grads.items()})
    ref_lp, ref_g = results[torch.float32, "dense"]
    err = {}
    for key in ((torch.bfloat16, "dense"), (torch.bfloat16, "varlen")):
        lp, g = results[key]
        err[key] = (max(float((a - b).abs().max()) for a, b in zip(lp, ref_lp)),
                    max(float((g[n] - ref_g[n]).abs().max() / ref_g[n].abs().max().clamp(min=1e-8)) for n in ref_g))
    dense, flash = err[torch.bfloat16, "dense"], err[torch.bfloat16, "varlen"]
    assert flash[0] <= 1.5 * dense[0] + 1e-3 and flash[1] <= 1.5 * dense[1] + 1e-3, (flash, dense)
