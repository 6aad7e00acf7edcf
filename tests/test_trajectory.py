"""Multi-turn forwards and decode: trajectories with images between turns.

- Scoring a trajectory on its prompt's shared prefix (engines/trajectory.py) equals one plain
  transformers forward over the whole sequence, every image included.
- The torch decode engine continues a finished sample on its parked KV: the same tokens and
  log-probs as decoding the whole context afresh, and only the tokens past the last turn computed.
- vLLM continues a sample as a resumable request: it computes the new tokens alone.
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


@pytest.mark.parametrize("attention", ["dense", "varlen"])
def test_trajectory_logprobs_equal_a_full_sequence_forward(model_parts, prompt, attention, monkeypatch):
    """Three samples of one prompt, with 0, 1 and 2 observation images of two sizes between their
    turns, scored together on one prefix: each row equals a plain HF forward over prompt + trajectory
    with all its images (the M-RoPE positions of the images past the prompt included), whether the
    packed row attends under a mask or cut into its samples (varlen). So does scoring them turn by
    turn, each turn on its sample's history (``extend_histories``: a turn's response and the answer
    after it per forward, the samples that end dropping out)."""
    monkeypatch.setattr(vlm, "SUFFIX_ATTENTION", attention)
    processor, model = model_parts
    p, vis = prompt
    observations = [observation(model_parts, (112, 112), (0, 200, 0)), observation(model_parts, (56, 112), (0, 0, 200))]
    g = torch.Generator().manual_seed(0)
    samples, segments = [], []  # segments[k][t]: sample k's turn t, with the answer after it
    for k in range(3):
        ids, embeds, grids, pixels, turns = [], [], [], [], []
        for t in range(k):
            o, o_vis = observations[t]
            response = torch.randint(0, 300, (3 + t,), generator=g).tolist()
            ids += response + o.input_ids.tolist()
            turns.append(trajectory.Continuation(response + o.input_ids.tolist(), o_vis.image, o.image_grid_thw,
                                                 [1] * len(response) + [0] * o.num_tokens))
            embeds.append(o_vis.image)
            grids.append(o.image_grid_thw)
            pixels.append(o.pixel_values)
        response = torch.randint(0, 300, (4,), generator=g).tolist()
        ids += response
        turns.append(trajectory.Continuation(response, policy_mask=[1] * 4))
        samples.append((trajectory.Continuation(ids, torch.cat(embeds) if embeds else None,
                                                torch.cat(grids) if grids else None), pixels, grids))
        segments.append(turns)
    with torch.no_grad():
        state = vlm.prefix_forward(model, p, vis, grad=False)
        scored = trajectory.logprobs_batch(model, [state], [[c for c, _, _ in samples]], pad_id=0, grad=False)[0]
        histories, by_turns = {k: trajectory.History.of_prefix(state) for k in range(3)}, {}
        for t in range(3):
            live = [k for k in range(3) if k >= t]
            after = trajectory.extend_histories(model, [histories[k] for k in live], [segments[k][t] for k in live],
                                                keep=[k > t for k in live])
            histories.update(zip(live, after))
            by_turns.update({k: h.logprobs for k, h in zip(live, after) if k == t})
        for row, (c, pixels, grids) in enumerate(samples):
            ids = torch.tensor([p.input_ids.tolist() + c.token_ids])
            logits = model(input_ids=ids, pixel_values=torch.cat([p.pixel_values, *pixels]),
                           image_grid_thw=torch.cat([p.image_grid_thw, *grids]),
                           mm_token_type_ids=vlm.mm_token_types(ids, model.config)).logits[0].float()
            want = torch.log_softmax(logits[p.num_tokens - 1:-1], -1).gather(-1, torch.tensor(c.token_ids).view(-1, 1))
            assert float((want.view(-1) - scored[row, : len(c.token_ids)]).abs().max()) <= 1e-5
            assert not scored[row, len(c.token_ids):].any()
            assert float((want.view(-1) - by_turns[row]).abs().max()) <= 1e-5


def ctx(model_dir, **options) -> EngineContext:
    return EngineContext(str(model_dir), torch.device("cpu"), torch.float32, seed=0, options=options)


def first_turn(engine, prompt, temperature: float) -> dict:
    """Three samples of a turn, their KV kept: {sample: its finished sequence}."""
    p, vis = prompt
    engine.add_requests([DecodeRequest("r0", p.input_ids.tolist(), vis.image, p.image_grid_thw, max_tokens=6, seed=1,
                                       temperature=temperature, n=3, keep_kv=True)])
    first = []
    while engine.has_unfinished():
        first += engine.step(2)
    return {f.index: f for f in first}


def next_turn(engine, prompt, obs, first: dict, temperature: float):
    """Each sample of ``first`` continued with an observation: ({request id: continuation}, requests)."""
    p, vis = prompt
    o, o_vis = obs
    requests = [DecodeRequest(f"c{g}", p.input_ids.tolist() + f.token_ids + o.input_ids.tolist(),
                              torch.cat([vis.image, o_vis.image]), torch.cat([p.image_grid_thw, o.image_grid_thw]),
                              max_tokens=5, seed=7 + g, temperature=temperature, continues=("r0", g))
                for g, f in sorted(first.items())]
    engine.add_requests(requests)
    out = []
    while engine.has_unfinished():
        out += engine.step(3)
    return {f.request_id: f for f in out}, requests


def continued(engine, prompt, obs, temperature: float):
    first = first_turn(engine, prompt, temperature)
    return (*next_turn(engine, prompt, obs, first, temperature), first)


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
def test_vllm_computes_only_the_new_tokens_of_a_continued_turn(tiny_model_dir, model_parts, prompt):
    """Turn 2 of three samples on vLLM. The tokens its scheduler computes for them, counted at the
    scheduler, are the new ones alone (each sample's last sampled token and the observation) and one
    per token sampled after the first: nothing of the prompt or turn 1, where a whole-context request
    through the prefix cache computes the earlier turns' last partial block again. Their tokens and
    log-probs equal a fresh decode of the whole context, and the sessions free their KV when done."""
    pytest.importorskip("vllm")
    engine = get_engine("vllm").factory(ctx(tiny_model_dir, max_model_len=256, kv_cache_bytes=64 << 20, limit_images=2,
                                            vllm_kwargs={"block_size": 32}))
    scheduler = engine._engine.engine_core.engine_core.scheduler
    scheduled, schedule = [0], scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        scheduled[0] += sum(out.num_scheduled_tokens.values())
        return out

    scheduler.schedule = counted
    obs = observation(model_parts, (56, 112), (0, 200, 0))
    first = first_turn(engine, prompt, 1.0)
    scheduled[0] = 0
    got, requests = next_turn(engine, prompt, obs, first, 1.0)
    held = [prompt[0].num_tokens + len(first[g].token_ids) - 1 for g in range(3)]  # prompt, turn 1 but its last token
    new = [len(r.prompt_token_ids) - h for r, h in zip(requests, held)]
    assert new == [1 + obs[0].num_tokens] * 3
    assert scheduled[0] == sum(new) + sum(len(got[r.request_id].token_ids) - 1 for r in requests)
    assert [got[r.request_id].cached_tokens for r in requests] == held  # and the engine's own count says so
    assert not scheduler.requests and scheduler.get_kv_cache_usage() == 0  # every session ended with its turn
    engine.add_requests([dataclasses.replace(r, request_id=f"fresh-{r.request_id}", continues=None) for r in requests])
    fresh = []
    while engine.has_unfinished():
        fresh += engine.step(3)
    for f in fresh:
        want = got[f.request_id.removeprefix("fresh-")]
        assert f.token_ids == want.token_ids
        torch.testing.assert_close(f.logprobs, want.logprobs, atol=1e-5, rtol=0)
    first_turn(engine, prompt, 1.0)  # parked sessions end when released, the rest with new weights
    assert len(scheduler.requests) == 3
    engine.release([("r0", 0)])
    assert len(scheduler.requests) == 2
    engine.load_weights([])
    assert not scheduler.requests and scheduler.get_kv_cache_usage() == 0
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


def test_a_vision_tower_that_trains_encodes_the_observations_again_with_grad(tiny_model_dir, model_parts):
    """The rollout encodes an observation's image without grad; a trained model's scoring encodes it
    again with its own tower (the same values at the same weights), so the loss reaches the tower
    through the observations too."""
    import types

    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.torch_train import trains_vision
    from rollplex.tasks.turns import Trajectory, continuations

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert trains_vision(model)
    o, o_vis = observation(model_parts, (112, 112), (0, 200, 0))
    ids = [11, 12] + o.input_ids.tolist()
    seq = Trajectory("r", ids, [0.0] * len(ids), "stop", policy_mask=[1, 1] + [0] * o.num_tokens,
                     image_embeds=o_vis.image, image_grid_thw=o.image_grid_thw, pixel_values=o.pixel_values)
    bare = dataclasses.replace(seq, pixel_values=None)
    [[again], [kept]] = continuations(model, [types.SimpleNamespace(sequences=[seq]),
                                              types.SimpleNamespace(sequences=[bare])], grad=True)
    assert again.image_embeds.requires_grad and torch.allclose(again.image_embeds, o_vis.image, atol=1e-6)
    assert kept.image_embeds is o_vis.image  # nothing to encode again: the rollout's embeddings stay
    again.image_embeds.square().sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "visual" in n)
    for n, p in model.named_parameters():
        p.requires_grad_("visual" not in n)
    assert not trains_vision(model)
