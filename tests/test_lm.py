"""Prefix once + G suffixes on its KV must equal G full-sequence forwards: values and gradients."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from rollplex.engines import vlm


@pytest.fixture(scope="module")
def model_and_prompt(tiny_model_dir):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir)
    for name, p in model.named_parameters():
        p.requires_grad_("visual" not in name)
    image = Image.new("RGB", (112, 84), (200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    enc = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)], images=[image],
                    return_tensors="pt")
    prompt = vlm.PromptInputs("p0", enc["input_ids"][0], enc["pixel_values"], enc["image_grid_thw"])
    return model, prompt


RESPONSES = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]


def _plain_hf_logprobs(model, prompt, responses):
    """One transformers forward per response over prompt + response, the way a serial runtime scores."""
    rows = []
    for r in responses:
        ids = torch.cat([prompt.input_ids, torch.tensor(r)]).view(1, -1)
        out = model(input_ids=ids, pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                    mm_token_type_ids=vlm.mm_token_types(ids, model.config))
        logp = torch.log_softmax(out.logits[0, prompt.num_tokens - 1:-1].float(), -1)
        rows.append(logp.gather(-1, torch.tensor(r).view(-1, 1)).view(-1))
    return rows


def test_prefix_plus_suffix_logprobs_equal_full_sequences(model_and_prompt):
    model, prompt = model_and_prompt
    with torch.no_grad():
        vis = vlm.vision_embeds(model, prompt)
        state = vlm.prefix_forward(model, prompt, vis, grad=False)
        shared, mask = vlm.suffix_logprobs(model, state, RESPONSES, pad_id=0, grad=False)
        plain = _plain_hf_logprobs(model, prompt, RESPONSES)
        full, _ = vlm.full_sequence_logprobs(model, prompt, RESPONSES, pad_id=0, vis=vis)
    for i, r in enumerate(RESPONSES):
        assert torch.allclose(shared[i, : len(r)], plain[i], atol=1e-5, rtol=0)
        assert torch.allclose(full[i, : len(r)], plain[i], atol=1e-5, rtol=0)
        assert mask[i].sum() == len(r)


def test_first_token_is_scored_from_the_prefix_last_logits(model_and_prompt):
    model, prompt = model_and_prompt
    with torch.no_grad():
        state = vlm.prefix_forward(model, prompt, vlm.vision_embeds(model, prompt), grad=False)
        logp, _ = vlm.suffix_logprobs(model, state, [[7], [9, 3]], pad_id=0, grad=False)
    expected = torch.log_softmax(state.last_logits, -1)
    # Gathered logit less log-sum-exp against log_softmax: equal up to the CPU's summation order
    # (bit-equal on some machines, one ulp apart on others); another position's score is O(1) off.
    assert logp[0, 0].item() == pytest.approx(expected[7].item(), abs=1e-6)
    assert logp[1, 0].item() == pytest.approx(expected[9].item(), abs=1e-6)


def test_packed_scoring_ignores_empty_responses_and_zeroes_past_each_end(model_and_prompt):
    """Responses are packed into one row per group: an empty one adds no token, and every value past
    a response's end is zero (logits too), whatever the other responses' lengths."""
    model, prompt = model_and_prompt
    with torch.no_grad():
        state = vlm.prefix_forward(model, prompt, vlm.vision_embeds(model, prompt), grad=False)
        alone, _ = vlm.suffix_logprobs(model, state, [[5, 6, 7]], pad_id=0, grad=False)
        mixed, mask = vlm.suffix_logprobs(model, state, [[], [5, 6, 7], [8]], pad_id=0, grad=False)
        logits = vlm.suffix_logits_batch(model, [state], [[[], [5, 6, 7], [8]]], grad=False)[0]
    assert mask.tolist() == [[0, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert torch.allclose(mixed[1], alone[0], atol=1e-6, rtol=0)
    assert not mixed[mask == 0].any() and not logits[1:, 1:][mask[1:, 1:] == 0].any()
    assert torch.allclose(torch.log_softmax(logits[1], -1).gather(1, torch.tensor([[5], [6], [7]])).view(-1),
                          alone[0], atol=1e-5, rtol=0)


def test_prefix_plus_suffix_gradient_equals_full_sequence_gradient(model_and_prompt):
    """One backward through the shared prefix (its KV used by G suffixes) = the sum over G full
    sequences, for every trainable parameter."""
    model, prompt = model_and_prompt
    weights = torch.linspace(0.5, 1.5, steps=sum(len(r) for r in RESPONSES))

    def weighted(rows):
        flat = torch.cat(rows)
        return (flat * weights).sum()

    model.zero_grad()
    vis = vlm.vision_embeds(model, prompt)
    state = vlm.prefix_forward(model, prompt, vis, grad=True)
    shared, _ = vlm.suffix_logprobs(model, state, RESPONSES, pad_id=0, grad=True)
    weighted([shared[i, : len(r)] for i, r in enumerate(RESPONSES)]).backward()
    grads_shared = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model.zero_grad()
    weighted(_plain_hf_logprobs(model, prompt, RESPONSES)).backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        scale = p.grad.abs().max().clamp(min=1e-8)
        assert float((grads_shared[name] - p.grad).abs().max() / scale) < 1e-4, name
    model.zero_grad()


def test_the_head_in_pieces_gives_the_same_logprobs_and_gradients_and_keeps_no_full_logits(monkeypatch):
    """Above HEAD_CHUNK_TOKENS rows the LM head runs in checkpointed pieces: the log-probs and both
    gradients (hidden state's and head's) are the one-piece ones, and no [N, V] tensor is kept for
    the backward."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    tokens = torch.randint(0, 300, (37,))
    weights = torch.linspace(0.5, 1.5, 37)

    def run(chunk):
        monkeypatch.setattr(vlm, "HEAD_CHUNK_TOKENS", chunk)
        head.zero_grad()
        hidden.grad = None
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
            values = vlm.head_logprobs(head, hidden, tokens, temperature=0.7)
        (values * weights).sum().backward()
        return values.detach(), hidden.grad.clone(), head.weight.grad.clone(), max(kept, default=0)

    whole, pieces = run(10_000), run(8)
    for a, b in zip(whole[:3], pieces[:3]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert whole[3] >= 37 * 300 and pieces[3] < 37 * 300


def test_scoring_in_head_pieces_equals_full_sequence_gradient(model_and_prompt, monkeypatch):
    """The prefix + packed suffix gradient still equals the full-sequence one with the head in pieces."""
    monkeypatch.setattr(vlm, "HEAD_CHUNK_TOKENS", 2)
    test_prefix_plus_suffix_gradient_equals_full_sequence_gradient(model_and_prompt)


def _prompt(processor, size, text):
    image = Image.new("RGB", size, (30, 200, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    enc = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)], images=[image],
                    return_tensors="pt")
    return vlm.PromptInputs(text, enc["input_ids"][0], enc["pixel_values"], enc["image_grid_thw"])


def test_batched_forwards_equal_one_prompt_at_a_time(model_and_prompt, tiny_model_dir):
    """Several prompts of different lengths in one vision, prefix and suffix call: same values and
    the same gradients as one call per prompt (padding is masked, never attended to)."""
    from transformers import AutoProcessor

    model, first = model_and_prompt
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    prompts = [first, _prompt(processor, (56, 56), "Which colour?"), _prompt(processor, (112, 112), "Colour.")]
    assert len({p.num_tokens for p in prompts}) == 3
    groups = [RESPONSES, [[3, 4], [5]], [[6, 7, 8, 9, 10, 11]]]

    def run(batched: bool):
        model.zero_grad()
        if batched:
            visions = vlm.vision_embeds_batch(model, prompts)
            states = vlm.prefix_forward_batch(model, prompts, visions, grad=True)
            scored = vlm.suffix_logprobs_batch(model, states, groups, pad_id=0, grad=True)
        else:
            visions = [vlm.vision_embeds(model, p) for p in prompts]
            states = [vlm.prefix_forward(model, p, v, grad=True) for p, v in zip(prompts, visions)]
            scored = [vlm.suffix_logprobs(model, s, g, pad_id=0, grad=True) for s, g in zip(states, groups)]
        total = sum((lp * mask).sum() * (i + 1) for i, (lp, mask) in enumerate(scored))
        total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return visions, [lp.detach() * mask for lp, mask in scored], grads

    vis_a, lp_a, g_a = run(batched=True)
    vis_b, lp_b, g_b = run(batched=False)
    for a, b in zip(vis_a, vis_b):
        assert torch.allclose(a.image, b.image, atol=1e-6)
    for a, b in zip(lp_a, lp_b):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    for name in g_b:
        scale = g_b[name].abs().max().clamp(min=1e-8)
        assert float((g_a[name] - g_b[name]).abs().max() / scale) < 1e-4, name
    model.zero_grad()


def test_scoring_batches_stay_within_the_logits_budget_and_cover_every_group_in_order():
    import random

    from rollplex.engines.vlm import batches_within

    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randint(1, 8) * rng.randint(1, 256) for _ in range(rng.randint(1, 12))]
        vocab, budget, grad = rng.choice([1000, 151936]), rng.choice([2**20, 2**31]), rng.random() < 0.5
        runs = batches_within(tokens, vocab, grad=grad, budget=budget)
        assert [i for run in runs for i in run] == list(range(len(tokens)))
        limit = budget // 2 if grad else budget
        for run in runs:  # within the budget, unless one group alone is over it
            assert len(run) == 1 or sum(tokens[i] for i in run) * vocab <= limit
        for a, b in zip(runs, runs[1:]):  # greedy: the next group did not fit
            assert (sum(tokens[i] for i in a) + tokens[b[0]]) * vocab > limit
    # Eight groups of 8 responses of 128 tokens on Qwen's vocabulary: six groups in the first
    # forward with grad (6·1024·151936 ≈ 0.93·2^30 elements), all eight without.
    assert batches_within([8 * 128] * 8, 151936, grad=True) == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert batches_within([8 * 128] * 8, 151936, grad=False) == [list(range(8))]
    # A micro-batch bound packs as tightly under both bounds, not by cutting the budget's runs after.
    assert batches_within([8 * 128] * 8, 151936, grad=True, most=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batches_within([8 * 128] * 3, 151936, grad=True, most=2) == [[0, 1], [2]]
