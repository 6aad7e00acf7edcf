"""Multi-turn forwards and decode: trajectories with images between turns.

- Scoring a trajectory on its prompt's shared prefix (engines/trajectory.py) equals one plain
  transformers forward over the whole sequence, every image included.
- The torch decode engine continues a finished sample on its parked KV: the same tokens and
  log-probs as decoding the whole context afresh, and only the tokens past the last turn computed.
- vLLM continues through its prefix cache: of the earlier turns only the last partial block of 32
  tokens is computed again.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rollplex.engines import trajectory, vlm
from rollplex.engines.base import DecodeRequest, EngineContext, get_engine

OBS = "\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>zoomed<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_parts(tiny_model_dir):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return processor, model


@pytest.fixture(scope="module")
def prompt(model_parts):
    from PIL import Image

    processor, model = model_parts
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": "What colour?"}]}],
                                         add_generation_prompt=True)
    enc = processor(text=[text], images=[Image.new("RGB", (112, 112), (200, 30, 30))], return_tensors="pt")
    p = vlm.PromptInputs("p0", enc["input_ids"][0], pixel_values=enc["pixel_values"],
                         image_grid_thw=enc["image_grid_thw"])
    return p, vlm.vision_embeds(model, p)


def observation(model_parts, size, colour):
    from PIL import Image

    processor, model = model_parts
    enc = processor(text=[OBS], images=[Image.new("RGB", size, colour)], return_tensors="pt")
    o = vlm.PromptInputs("o", enc["input_ids"][0], pixel_values=enc["pixel_values"],
                         image_grid_thw=enc["image_grid_thw"])
    return o, vlm.vision_embeds(model, o)


def test_trajectory_logprobs_equal_a_full_sequence_forward(model_parts, prompt):
    """Three samples of one prompt, with 0, 1 and 2 observation images of two sizes between their
    turns, scored together on one prefix: each row equals a plain HF forward over prompt + trajectory
    with all its images (the M-RoPE positions of the images past the prompt included)."""
    processor, model = model_parts
    p, vis = prompt
    observations = [observation(model_parts, (112, 112), (0, 200, 0)), observation(model_parts, (56, 112), (0, 0, 200))]
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(3):
        ids, embeds, grids, pixels = [], [], [], []
        for t in range(k):
            o, o_vis = observations[t]
            ids += torch.randint(0, 300, (3 + t,), generator=g).tolist() + o.input_ids.tolist()
            embeds.append(o_vis.image)
            grids.append(o.image_grid_thw)
            pixels.append(o.pixel_values)
        ids += torch.randint(0, 300, (4,), generator=g).tolist()
        samples.append((trajectory.Continuation(ids, torch.cat(embeds) if embeds else None,
                                                torch.cat(grids) if grids else None), pixels, grids))
    with torch.no_grad():
        state = vlm.prefix_forward(model, p, vis, grad=False)
        scored = trajectory.logprobs_batch(model, [state], [[c for c, _, _ in samples]], pad_id=0, grad=False)[0]
        for row, (c, pixels, grids) in enumerate(samples):
            ids = torch.tensor([p.input_ids.tolist() + c.token_ids])
            logits = model(input_ids=ids, pixel_values=torch.cat([p.pixel_values, *pixels]),
                           image_grid_thw=torch.cat([p.image_grid_thw, *grids]),
                           mm_token_type_ids=vlm.mm_token_types(ids, model.config)).logits[0].float()
            want = torch.log_softmax(logits[p.num_tokens - 1:-1], -1).gather(-1, torch.tensor(c.token_ids).view(-1, 1))
            assert float((want.view(-1) - scored[row, : len(c.token_ids)]).abs().max()) <= 1e-5
            assert not scored[row, len(c.token_ids):].any()


def ctx(model_dir, **options) -> EngineContext:
    return EngineContext(str(model_dir), torch.device("cpu"), torch.float32, seed=0, options=options)


def continued(engine, prompt, obs, temperature: float):
    """Three samples of a turn, then each continued with an observation; the continuations."""
    p, vis = prompt
    o, o_vis = obs
    engine.add_requests([DecodeRequest("r0", p.input_ids.tolist(), vis.image, p.image_grid_thw, max_tokens=6, seed=1,
                                       temperature=temperature, n=3, keep_kv=True)])
    first = []
    while engine.has_unfinished():
        first += engine.step(2)
    requests = [DecodeRequest(f"c{f.index}", p.input_ids.tolist() + f.token_ids + o.input_ids.tolist(),
                              torch.cat([vis.image, o_vis.image]), torch.cat([p.image_grid_thw, o.image_grid_thw]),
                              max_tokens=5, seed=7 + f.index, temperature=temperature, continues=("r0", f.index))
                for f in first]
    engine.add_requests(requests)
    out = []
    while engine.has_unfinished():
        out += engine.step(3)
    return {f.request_id: f for f in out}, requests, {f.index: f for f in first}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_torch_engine_continues_on_the_parked_kv(tiny_model_dir, model_parts, prompt, temperature):
    obs = observation(model_parts, (56, 112), (0, 200, 0))
    got, requests, first = continued(get_engine("hf").factory(ctx(tiny_model_dir)), prompt, obs, temperature)
    fresh = get_engine("hf").factory(ctx(tiny_model_dir))
    fresh.add_requests([dataclasses.replace(r, continues=None) for r in requests])
    want = []
    while fresh.has_unfinished():
        want += fresh.step(3)
    want = {f.request_id: f for f in want}
    p = prompt[0]
    for r in requests:
        rid, g = r.request_id, int(r.request_id[1:])
        assert got[rid].token_ids == want[rid].token_ids
        torch.testing.assert_close(got[rid].logprobs, want[rid].logprobs, atol=1e-5, rtol=0)
        # Held: the prompt and the first turn but its last sampled token; computed: only the rest.
        assert got[rid].cached_tokens == p.num_tokens + len(first[g].token_ids) - 1
        assert want[rid].cached_tokens is None


def test_torch_engine_drops_parked_sequences_with_new_weights(tiny_model_dir, prompt):
    engine = get_engine("hf").factory(ctx(tiny_model_dir))
    p, vis = prompt
    engine.add_requests([DecodeRequest("r0", p.input_ids.tolist(), vis.image, p.image_grid_thw, max_tokens=3, seed=1,
                                       temperature=1.0, n=2, keep_kv=True)])
    while engine.has_unfinished():
        engine.step(4)
    assert len(engine._parked) == 2
    engine.load_weights([])
    assert not engine._parked


@pytest.mark.slow
def test_vllm_continues_through_its_prefix_cache(tiny_model_dir, model_parts, prompt):
    pytest.importorskip("vllm")
    engine = get_engine("vllm").factory(ctx(tiny_model_dir, max_model_len=256, kv_cache_bytes=64 << 20, limit_images=2,
                                            vllm_kwargs={"block_size": 32}))
    obs = observation(model_parts, (56, 112), (0, 200, 0))
    got, requests, first = continued(engine, prompt, obs, 1.0)
    for r in requests:
        f = got[r.request_id]
        held = len(r.prompt_token_ids) - len(obs[0].input_ids) - 1  # the first turn's context
        # All of it but its last partial block comes from the cache (more where another sample's
        # context was the same), and at least the last token is computed.
        assert f.cached_tokens is not None and held - 32 < f.cached_tokens < len(r.prompt_token_ids)
    engine.close()


def test_a_placeholder_the_policy_sampled_is_text(model_parts, prompt):
    """An image placeholder token the policy sampled takes no image: the trajectory forward scores it
    as the decode engine fed it, a text token, as the single-turn suffix forward does."""
    processor, model = model_parts
    p, vis = prompt
    pad = model.config.image_token_id
    ids = [5, pad, 7, 9, pad, 11]
    with torch.no_grad():
        state = vlm.prefix_forward(model, p, vis, grad=False)
        got = trajectory.logprobs_batch(model, [state], [[trajectory.Continuation(ids, policy_mask=[1] * 6)]],
                                        pad_id=0, grad=False)[0]
        want = vlm.suffix_logprobs_batch(model, [state], [[ids]], pad_id=0, grad=False)[0][0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
