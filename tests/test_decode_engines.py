"""Decode engines: the torch fallback against HF generate, vLLM against the torch engine.

Both engines treat temperature 0 as greedy. The tiny model is random, so its distributions are
nearly flat: agreement to 1e-4 in fp32 is a real check, and a wrong temperature shows at 1e-2.
"""
from __future__ import annotations

import dataclasses

import os
from pathlib import Path

import pytest
import torch

from rollplex import runtime

runtime.configure(threads=2)

from rollplex.engines.base import DecodeRequest, EngineContext, get_engine  # noqa: E402
from rollplex.errors import EngineError  # noqa: E402

CORPUS = ("What colour is the shape? Answer with one word. red green blue",)
STOP = tuple(range(100, 130))  # ~10% of the vocabulary: some samples stop early, some run to length


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rollplex.engines.models import TinyVLMSpec, ensure_tiny_vlm

    cache = Path(os.environ.get("ROLLPLEX_CACHE", Path(__file__).resolve().parents[1] / ".cache" / "test"))
    return ensure_tiny_vlm(TinyVLMSpec(corpus=CORPUS), cache)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(model_dir, hf_model):
    """Two prompts of different lengths (different image sizes), with their vision embeddings."""
    from PIL import Image
    from transformers import AutoProcessor

    from rollplex.engines.vlm import PromptInputs, vision_embeds

    proc = AutoProcessor.from_pretrained(model_dir)
    out = []
    for i, (question, colour, size) in enumerate([("What colour is the shape?", (255, 0, 0), (64, 64)),
                                                  ("Answer with one word.", (0, 200, 0), (110, 56))]):
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = proc.apply_chat_template(msgs, add_generation_prompt=True)
        enc = proc(text=[text], images=[Image.new("RGB", size, colour)], return_tensors="pt")
        p = PromptInputs(f"p{i}", enc["input_ids"][0], pixel_values=enc["pixel_values"],
                         image_grid_thw=enc["image_grid_thw"])
        out.append((p, vision_embeds(hf_model, p), enc))
    assert out[0][0].num_tokens != out[1][0].num_tokens
    return out


def ctx(model_dir, **options) -> EngineContext:
    return EngineContext(str(model_dir), torch.device("cpu"), torch.float32, seed=0, options=options)


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    pytest.importorskip("vllm")
    engine = get_engine("vllm", "decode").factory(ctx(model_dir, max_model_len=256, kv_cache_bytes=64 << 20))
    yield engine
    engine.close()


@pytest.fixture
def torch_engine(model_dir):
    engine = get_engine("hf", "decode").factory(ctx(model_dir))
    yield engine
    engine.close()


@pytest.fixture
def graph_engine(model_dir):
    """The static-KV engine on its eager path (CUDA graphs are captured on a GPU only)."""
    engine = get_engine("torch-graph", "decode").factory(ctx(model_dir, max_num_seqs=32, max_model_len=256))
    yield engine
    engine.close()


@pytest.fixture(params=["hf", "torch-graph", pytest.param("vllm", marks=pytest.mark.slow)])
def engine(request):
    return request.getfixturevalue({"hf": "torch_engine", "torch-graph": "graph_engine",
                                    "vllm": "vllm_engine"}[request.param])


def requests(prompts, *, group=1, temperature=0.0, max_tokens=12, seed=0, top_p=1.0, stop=()):
    out = []
    for p, vis, _ in prompts:
        for g in range(group):
            temp = temperature[g % len(temperature)] if isinstance(temperature, tuple) else temperature
            out.append(DecodeRequest(f"{p.prompt_id}-{g}", p.input_ids.tolist(), vis.image, p.image_grid_thw,
                                     max_tokens=max_tokens, seed=seed + 1000 * int(p.prompt_id[1:]) + g,
                                     temperature=temp, top_p=top_p, stop_token_ids=stop))
    return out


def run(engine, reqs, chunk=1000) -> dict:
    engine.add_requests(reqs)
    done = []
    while engine.has_unfinished():
        done += engine.step(chunk)
    assert {r.request_id for r in reqs} <= {d.request_id for d in done}  # plus any added earlier
    return {d.request_id: d for d in done}


def samples(engine, done, reqs=()) -> dict:
    """{(request, sample): sequence} of everything ``engine`` decodes, ``done`` (what it handed on
    already) included, after adding ``reqs``."""
    engine.add_requests(list(reqs))
    done = list(done)
    while engine.has_unfinished():
        done += engine.step(2)
    return {(d.request_id, d.index): d for d in done}


def hf_greedy(model, enc, max_tokens) -> list[int]:
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:].tolist()


# --------------------------------------------------------------------------------------------------
def test_registered():
    assert get_engine("hf", "decode").requires == ("transformers",)
    assert get_engine("vllm", "decode").requires == ("vllm",)


def test_collapse_pads():
    from rollplex.engines.vllm_decode import collapse_pads

    ids, runs = collapse_pads([1, 9, 7, 7, 7, 8, 2, 7, 7, 3], (7, 6))
    assert ids == [1, 9, 7, 8, 2, 7, 3] and runs == {7: 2, 6: 0}


def test_torch_greedy_matches_hf_generate(torch_engine, hf_model, prompts):
    out = run(torch_engine, requests(prompts, group=2), chunk=5)
    for p, _, enc in prompts:
        want = hf_greedy(hf_model, enc, 12)
        assert out[f"{p.prompt_id}-0"].token_ids == want
        assert out[f"{p.prompt_id}-1"].token_ids == want


def test_torch_waiting_and_late_requests_decode_alike(model_dir, prompts):
    """max_num_seqs=2 queues the second prompt; a request added mid-decode joins the live batch."""
    def make():
        return requests(prompts, group=2, temperature=(0.0, 1.0))

    reference = run(get_engine("hf").factory(ctx(model_dir)), make())
    queued = run(get_engine("hf").factory(ctx(model_dir, max_num_seqs=2)), make())
    for rid, ref in reference.items():
        assert queued[rid].token_ids == ref.token_ids
    # Prompt lengths are 29 and 33. p0 first: after 3 tokens its rows fill 32 columns and the 33-token
    # p1 shifts them right; p1 first: p0 joins left-padded.
    for first, second in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
        late = get_engine("hf").factory(ctx(model_dir))
        reqs = make()
        late.add_requests(reqs[first])
        got = {d.request_id: d for d in late.step(3)}
        got.update(run(late, reqs[second]))
        for rid, ref in reference.items():
            assert got[rid].token_ids == ref.token_ids
            torch.testing.assert_close(got[rid].logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_chunked_steps_match_one_big_step(engine, prompts):
    def make():
        return requests(prompts, group=3, temperature=(1.0, 0.7, 0.0), top_p=0.9, max_tokens=10, stop=STOP)

    whole = run(engine, make(), chunk=1000)
    chunked = run(engine, make(), chunk=3)
    assert {k: v.token_ids for k, v in whole.items()} == {k: v.token_ids for k, v in chunked.items()}
    assert {k: v.finish_reason for k, v in whole.items()} == {k: v.finish_reason for k, v in chunked.items()}
    assert {v.finish_reason for v in whole.values()} == {"stop", "length"}  # both endings exercised
    for k, v in whole.items():
        assert len(v.logprobs) == len(v.token_ids)
        if v.finish_reason == "stop":
            assert v.token_ids[-1] in STOP and not set(v.token_ids[:-1]) & set(STOP)


def test_seeded_sampling_is_reproducible(engine, prompts):
    first = run(engine, requests(prompts, group=3, temperature=1.0, seed=5))
    again = run(engine, requests(prompts, group=3, temperature=1.0, seed=5))
    other = run(engine, requests(prompts, group=3, temperature=1.0, seed=6))
    assert {k: v.token_ids for k, v in first.items()} == {k: v.token_ids for k, v in again.items()}
    assert {k: v.token_ids for k, v in first.items()} != {k: v.token_ids for k, v in other.items()}
    rows = [v.token_ids for v in first.values()]
    assert len({tuple(r) for r in rows}) == len(rows)  # the G samples of a prompt differ


def test_load_weights_matches_perturbed_hf(engine, hf_model, prompts):
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    before = [hf_greedy(hf_model, enc, 12) for _, _, enc in prompts]
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()
                 if "language_model" in k or "lm_head" in k}  # the vision tower stays, so embeddings do too
    try:
        hf_model.load_state_dict(perturbed, strict=False)
        engine.load_weights(perturbed.items())
        out = run(engine, requests(prompts))
        after = [hf_greedy(hf_model, enc, 12) for _, _, enc in prompts]
        assert after != before  # the perturbation changes what greedy decoding says
        for (p, _, _), want in zip(prompts, after):
            assert out[f"{p.prompt_id}-0"].token_ids == want
    finally:
        hf_model.load_state_dict(original)
        engine.load_weights((k, original[k]) for k in perturbed)


def test_torch_load_weights_rejects_unknown_names(torch_engine):
    with pytest.raises(EngineError, match="model.language_model.nope"):
        torch_engine.load_weights([("model.language_model.nope", torch.zeros(1))])
    with pytest.raises(EngineError, match="shape"):
        torch_engine.load_weights([("lm_head.weight", torch.zeros(1))])


def _hf_logprobs(hf_model, prompts, out, temperature):
    from rollplex.engines.vlm import full_sequence_logprobs

    for p, vis, _ in prompts:
        seqs = [v for k, v in sorted(out.items()) if k.startswith(p.prompt_id + "-")]
        lp, mask = full_sequence_logprobs(hf_model, p, [s.token_ids for s in seqs], pad_id=0,
                                          temperature=temperature, vis=vis)
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            yield torch.tensor(s.logprobs), lp[i, :n].float()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_match_hf_forward(engine, hf_model, prompts, temperature):
    out = run(engine, requests(prompts, group=2, temperature=temperature, max_tokens=10, seed=3))
    for got, want in _hf_logprobs(hf_model, prompts, out, temperature):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    if temperature != 1.0:  # the raw (temperature 1) log-probs are far off: the check has teeth
        raw = list(_hf_logprobs(hf_model, prompts, out, 1.0))
        assert max(float((g - w).abs().max()) for g, w in raw) > 1e-2


def test_top_p_logprobs_are_under_the_truncated_distribution(engine, hf_model, prompts):
    """With top-p both engines report log-probs of the renormalised nucleus, the distribution drawn
    from; the reference applies the nucleus to HF's logits the way vLLM's sampler does."""
    from rollplex.engines.torch_decode import _apply_top_p
    from rollplex.engines.vlm import prefix_forward, suffix_logits

    temperature, top_p = 0.6, 0.8
    out = run(engine, requests(prompts, group=2, temperature=temperature, top_p=top_p, max_tokens=8, seed=9))
    for p, vis, _ in prompts:
        prefix = prefix_forward(hf_model, p, vis, grad=False)
        for g in range(2):
            seq = out[f"{p.prompt_id}-{g}"]
            tokens = torch.tensor([seq.token_ids])
            logits = suffix_logits(hf_model, prefix, tokens, grad=False)[0] / temperature
            logp = torch.log_softmax(_apply_top_p(logits, torch.full((len(seq.token_ids),), top_p)), -1)
            want = logp.gather(1, tokens.view(-1, 1)).view(-1)
            torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_vllm_greedy_matches_torch_engine(vllm_engine, torch_engine, prompts):
    reqs = requests(prompts, group=2, max_tokens=16, stop=STOP)
    want = run(torch_engine, reqs)
    got = run(vllm_engine, reqs)
    for rid, w in want.items():
        assert got[rid].token_ids == w.token_ids
        assert got[rid].finish_reason == w.finish_reason
        torch.testing.assert_close(got[rid].logprobs, w.logprobs, atol=1e-4, rtol=0)


def test_n_samples_equal_n_single_requests_seeded_seed_plus_i(engine, prompts):
    """A request with n samples is n requests with seeds seed..seed+n-1 (vLLM hands them on together,
    torch-graph each as it finishes)."""
    p, vis, _ = prompts[0]
    base = dict(prompt_token_ids=p.input_ids.tolist(), image_embeds=vis.image, image_grid_thw=p.image_grid_thw,
                max_tokens=6, temperature=1.0)
    engine.add_requests([DecodeRequest("group", seed=77, n=4, **base)])
    grouped = []
    while engine.has_unfinished():
        grouped += engine.step(2)
    assert sorted(s.index for s in grouped) == [0, 1, 2, 3] and {s.request_id for s in grouped} == {"group"}
    singles = run(engine, [DecodeRequest(f"single{i}", seed=77 + i, **base) for i in range(4)])
    for s in grouped:
        assert s.token_ids == singles[f"single{s.index}"].token_ids
        assert s.logprobs == pytest.approx(singles[f"single{s.index}"].logprobs, abs=1e-5)


def test_graph_engine_greedy_matches_torch_engine(graph_engine, torch_engine, prompts):
    reqs = requests(prompts, group=2, temperature=0.0)
    want = run(torch_engine, reqs)
    got = run(graph_engine, reqs, chunk=3)
    for rid, seq in want.items():
        assert got[rid].token_ids == seq.token_ids and got[rid].finish_reason == seq.finish_reason
        assert got[rid].logprobs == pytest.approx(seq.logprobs, abs=1e-4)


def test_graph_engine_long_tail_packs_rows_without_changing_tokens(model_dir, prompts):
    """Rows that finish early leave the batch; the rest move to the front and decode on. Their tokens
    are those of each request decoded alone (per-request noise, not per-batch)."""
    reqs = [dataclasses.replace(r, max_tokens=3 + 4 * i) for i, r in enumerate(requests(prompts, group=2,
                                                                                         temperature=1.0))]
    together = run(get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=8)), reqs, chunk=2)
    for r in reqs:
        alone = run(get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=8)), [r])
        assert together[r.request_id].token_ids == alone[r.request_id].token_ids


def test_graph_engine_shared_prefix_samples_what_per_row_prompt_copies_do(model_dir, prompts, monkeypatch):
    """shared_prefix (the default): each prompt's KV once in a prefix slot that its rows read, the
    rows' own caches their responses only. Same tokens and log-probs as copying the prompt into every
    row. With one slot for two prompts the second waits for the first's rows; a prompt whose slot is
    resident is not prefilled again; a request of more samples than a prefix entry holds spans two."""
    from rollplex.engines import vlm
    from rollplex.engines.decode_attention import PREFIX_MEMBERS

    reqs = [dataclasses.replace(r, max_tokens=3 + 2 * i) for i, r in enumerate(requests(prompts, group=3,
                                                                                         temperature=1.0))]
    wide = dataclasses.replace(reqs[0], request_id="wide", n=PREFIX_MEMBERS + 2, max_tokens=5)
    factory = get_engine("torch-graph").factory
    per_row = run(factory(ctx(model_dir, max_num_seqs=16, shared_prefix=False)), reqs, chunk=2)

    prefilled = []
    real = vlm.prefix_forward_batch
    monkeypatch.setattr(vlm, "prefix_forward_batch", lambda model, ps, *a, **k: prefilled.extend(ps) or real(
        model, ps, *a, **k))
    engine = factory(ctx(model_dir, max_num_seqs=16, prefix_slots=1, max_prompt_len=64, max_response_len=16))
    assert engine.batch.pk[0].shape[:3] == (1, engine.w.kv_heads, 64) and engine.batch.k[0].shape[2] == 16
    engine.add_requests(reqs)
    engine.step(1)
    live = [i for i, r in enumerate(engine._live) if r is not None]
    assert len(live) == 3 and {engine._live[i].parent for i in live} == {r.request_id for r in reqs[:3]}
    members = engine.batch.members[engine.batch.entry_len > 0]
    assert sorted(members[members >= 0].tolist()) == live  # every live row in one entry
    shared = run(engine, [])
    assert [p.prompt_id for p in prefilled] == ["p0-0", "p1-0"]  # one prefill per prompt, the second after the first
    assert engine._slots == [None] and not engine._slot_of_key
    for r in reqs:
        got, want = shared[r.request_id], per_row[r.request_id]
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    engine.add_requests([wide])
    first = engine.step(1)
    assert int((engine.batch.entry_len > 0).sum()) == 2
    got, want = samples(engine, first), samples(factory(ctx(model_dir, max_num_seqs=16, shared_prefix=False)), (), [wide])
    assert got.keys() == want.keys() and len(got) == PREFIX_MEMBERS + 2
    for key, seq in want.items():
        assert got[key].token_ids == seq.token_ids
        assert got[key].logprobs == pytest.approx(seq.logprobs, abs=1e-5)
    with pytest.raises(EngineError, match="exceeds max_response_len 16"):
        engine.add_requests([dataclasses.replace(reqs[0], request_id="long", max_tokens=17)])


@pytest.mark.slow
def test_graph_engine_compiled_layer_samples_what_the_eager_one_does(model_dir, prompts):
    """``compile``: the decoder layer through torch.compile (one compile per batch size, reused by
    every layer). Sampled with temperature, so the per-row noise and the long tail's repacking run."""
    reqs = [dataclasses.replace(r, max_tokens=3 + 3 * i) for i, r in enumerate(requests(prompts, group=2,
                                                                                         temperature=1.0))]
    eager = run(get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=8)), reqs, chunk=4)
    compiled = get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=8, compile=True))
    got = run(compiled, reqs, chunk=4)
    for rid, seq in eager.items():
        assert got[rid].token_ids == seq.token_ids
        assert got[rid].logprobs == pytest.approx(seq.logprobs, abs=1e-4)
    assert compiled._layer is not eager_layer_of(compiled)
    # the step's work before and after the layers (sampling, bookkeeping, the head) is compiled too
    assert compiled._advance is not eager_step_parts()[0] and compiled._head is not eager_step_parts()[1]
    with pytest.raises(EngineError, match="compile 'reduce-overhead' is not one of"):
        get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=8, compile="reduce-overhead"))


def eager_layer_of(engine):
    from rollplex.engines.decode_step import _decoder_layer

    return _decoder_layer


def eager_step_parts():
    from rollplex.engines.decode_step import _advance, _head

    return _advance, _head


def test_graph_engine_prefills_a_shared_prompt_once_and_counts_its_rows_meanwhile(graph_engine, prompts,
                                                                                  monkeypatch):
    """Per-sample requests of one prompt (as a per-sample length cap makes them) share one prefill,
    like vLLM's prefix cache; while it runs, ``live_rows`` counts their rows (the scheduler's gate
    reads it), and the samples are those of the one n-sample request."""
    from rollplex.engines import vlm

    p, vis, _ = prompts[0]
    base = dict(prompt_token_ids=p.input_ids.tolist(), image_embeds=vis.image, image_grid_thw=p.image_grid_thw,
                temperature=1.0)
    seen = []
    real = vlm.prefix_forward_batch

    def spy(model, batch, visions, *, grad):
        seen.append((len(batch), graph_engine.live_rows(), graph_engine.prefilling()))
        return real(model, batch, visions, grad=grad)

    monkeypatch.setattr(vlm, "prefix_forward_batch", spy)
    graph_engine.add_requests([DecodeRequest(f"s{i}", seed=5 + i, max_tokens=3 + i, **base) for i in range(4)])
    assert graph_engine.prefilling()  # queued, nothing decoding: a prefill is next
    singles = run(graph_engine, [])
    assert seen == [(1, 4, True)] and not graph_engine.prefilling()
    monkeypatch.setattr(vlm, "prefix_forward_batch", real)
    graph_engine.add_requests([DecodeRequest("g", seed=5, n=4, max_tokens=6, **base)])
    grouped = []
    while graph_engine.has_unfinished():
        grouped += graph_engine.step(2)
    assert graph_engine.live_rows() == 0
    for s in grouped:  # the same noise per (seed, token index): each single is its sample's start
        assert singles[f"s{s.index}"].token_ids == s.token_ids[: 3 + s.index]


def test_graph_engine_hands_each_sample_on_as_it_finishes(graph_engine, prompts):
    """An 8-sample request whose samples stop at different lengths comes back a sample at a time,
    each on the step that produced its last token, so the reference can score the first ones while
    the rest decode."""
    p, vis, _ = prompts[0]
    graph_engine.add_requests([DecodeRequest("g", p.input_ids.tolist(), vis.image, p.image_grid_thw, max_tokens=12,
                                             seed=3, temperature=1.0, n=8, stop_token_ids=(203, 79, 104, 183))])
    handed_at, step = {}, 0
    while graph_engine.has_unfinished():
        step += 1
        for seq in graph_engine.step(1):
            handed_at[seq.index] = (step, len(seq.token_ids))
    assert sorted(handed_at) == list(range(8))
    assert all(at == length for at, length in handed_at.values())
    assert len({at for at, _ in handed_at.values()}) > 1  # some samples left before the others


def test_graph_engine_refuses_more_stop_tokens_than_its_step_checks(graph_engine, prompts):
    """The captured step compares each token against a fixed-width row of stop ids; a request with
    more is refused by name rather than silently losing some (it kept 4 until 2026-11-30)."""
    from rollplex.engines.graph_decode import MAX_STOP_TOKENS

    reqs = requests(prompts, stop=tuple(range(100, 101 + MAX_STOP_TOKENS)))
    with pytest.raises(EngineError, match=rf"request p0-0: \d+ stop tokens \(EOS ids included\); engine "
                                          rf"'torch-graph' checks at most {MAX_STOP_TOKENS} per row"):
        graph_engine.add_requests(reqs[:1])
    assert not graph_engine.has_unfinished()
    stop = set(range(100, 100 + MAX_STOP_TOKENS - 2))  # every one of them ends a row, not the first 4
    done = run(graph_engine, requests(prompts, stop=tuple(stop), max_tokens=16))
    for d in done.values():
        assert not set(d.token_ids[:-1]) & stop
        assert (d.token_ids[-1] in stop) == (d.finish_reason == "stop")


def test_graph_engine_attends_over_every_slot_on_cpu_and_names_a_kernel_it_cannot_run(model_dir):
    """The split-KV kernel (``engines/decode_attention.py``) is CUDA and Triton only: on CPU the engine
    picks SDPA by itself, and asking for the kernel, or for an unknown one, is an error by name."""
    assert not get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=2)).split_kv
    for kernel in ("split-kv", "fused"):
        with pytest.raises(EngineError, match=f"attention '{kernel}' needs CUDA and Triton"):
            get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=2, attention=kernel))
    with pytest.raises(EngineError, match="attention 'flash' is not one of fused, split-kv, sdpa, auto"):
        get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=2, attention="flash"))
    # The projections' Triton kernel likewise (engines/skinny_linear.py; cublas, the default, runs anywhere).
    assert get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=2, linear="cublas"))._linear is None
    with pytest.raises(EngineError, match="linear 'skinny' needs CUDA and Triton"):
        get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=2, linear="skinny"))


def test_graph_engine_projects_fused_groups_in_one_matmul_and_samples_what_separate_ones_do(model_dir, prompts):
    """A shared model whose q|k|v and gate|up lie back to back (``fuse_for_rollout``) is projected
    one matmul per group; the tokens and log-probs are those of separate projections."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.sharing import fuse_for_rollout

    reqs = [dataclasses.replace(r, max_tokens=3 + 3 * i) for i, r in enumerate(requests(prompts, group=2,
                                                                                         temperature=1.0))]

    def shared(fuse: bool):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        if fuse:
            assert fuse_for_rollout(model.requires_grad_(False)) > 0
        return get_engine("torch-graph").factory(ctx(model_dir, max_num_seqs=8, share_model=model))

    separate, fused = shared(False), shared(True)
    assert not separate.w.fused and fused.w.fused
    assert all(len(weights) == 7 for weights, _ in fused.w.layer_args)
    want, got = run(separate, reqs, chunk=4), run(fused, reqs, chunk=4)
    for rid, seq in want.items():
        assert got[rid].token_ids == seq.token_ids
        assert got[rid].logprobs == pytest.approx(seq.logprobs, abs=1e-4)


@pytest.mark.slow
def test_vllm_on_cpu_ranks_sampled_tokens_without_compiling(vllm_engine, prompts):
    """vLLM's count of logits above the sampled token's is ``torch.compile``d; on CPU its compile
    took 1.8 s of every run's first decode step (engines/vllm_decode.py). The engine runs it eagerly
    there, and the count is the same."""
    from vllm.v1.sample import sampler

    count = sampler.batched_count_greater_than
    assert not hasattr(count, "_torchdynamo_orig_callable")
    x = torch.tensor([[0.1, 0.5, 0.3], [0.2, 0.2, 0.9]])
    assert count(x, torch.tensor([[0.3], [0.2]])).tolist() == [2, 3]
    out = run(vllm_engine, requests(prompts, group=2, temperature=1.0, seed=3, max_tokens=4))
    assert all(len(v.logprobs) == len(v.token_ids) for v in out.values())


@pytest.mark.slow
def test_vllm_on_cpu_samples_batches_larger_than_one_prefill_step(model_dir, prompts):
    """More prompt tokens than one step's budget (here 256): vLLM's chunked prefill would cut a
    prompt over two steps and rewind its seeded generator with ``set_offset``, which a CPU generator
    lacks ("CPU Generator does not use offset", the failure of every run above 8 prompts). Whole
    prefills sample what the same requests sample one at a time."""
    pytest.importorskip("vllm")
    engine = get_engine("vllm", "decode").factory(ctx(model_dir, max_model_len=256, kv_cache_bytes=64 << 20,
                                                      vllm_kwargs={"max_num_batched_tokens": 256}))
    try:
        reqs = requests(prompts * 6, group=2, temperature=1.0, seed=5, max_tokens=6)
        reqs = [dataclasses.replace(r, request_id=f"{r.request_id}-{i}") for i, r in enumerate(reqs)]
        assert sum(len(r.prompt_token_ids) for r in reqs) > 256
        together = run(engine, reqs)
        alone = {}
        for r in reqs:
            alone.update(run(engine, [dataclasses.replace(r, request_id=r.request_id + "-alone")]))
        for r in reqs:
            assert together[r.request_id].token_ids == alone[r.request_id + "-alone"].token_ids
    finally:
        engine.close()


@pytest.mark.parametrize("kwargs, says", [
    ({"block_size": "abc"}, "block_size: vLLM's EngineArgs refuses 'abc': Input should be a valid integer"),
    ({"gpu_memory_utilization": 5}, "gpu_memory_utilization: vLLM's CacheConfig refuses 5: Input should be less than"),
    ({"kv_cache_dtype": "fp9"}, "kv_cache_dtype: vLLM's EngineArgs refuses 'fp9': Input should be 'auto'"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size: vLLM's ParallelConfig refuses 0"),
    ({"logprobs_mode": "raw_logprobs"}, "logprobs_mode: Rollplex sets it"),
    ({"max_num_seqs": 4}, "max_num_seqs: set engines.decode_options.max_num_seqs instead"),
    ({"block_size": 32, "gpu_memory_utilization": 0.5, "kv_cache_dtype": "auto", "max_num_batched_tokens": 256}, None),
])
def test_vllm_kwargs_are_checked_as_vllm_would_before_the_engine_starts(kwargs, says):
    """vLLM refused these from inside its constructor, a traceback after the cluster had started."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    from rollplex.engines.vllm_decode import _RESERVED, _SET_ELSEWHERE, _engine_args

    problem = _engine_args(kwargs)
    assert (problem is None) if says is None else problem.startswith(says), problem
    arguments = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(_SET_ELSEWHERE) | set(_RESERVED) <= arguments  # each still names an argument of this vLLM
