"""GPU-only checks, run on a CUDA machine with ``pytest -m gpu`` (CI deselects them by marker)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu suite needs a CUDA device; run it on the GPU machine")
    return torch.device("cuda")


def _requests(model, tiny_model_dir, temperature):
    from transformers import AutoProcessor

    from rollplex.engines.base import DecodeRequest
    from rollplex.engines import vlm
    from rollplex.tasks.data import PromptBuilder, SyntheticVisualTask, build_item

    builder = PromptBuilder(AutoProcessor.from_pretrained(tiny_model_dir))
    prompts = [build_item(SyntheticVisualTask(image_size=112), builder, i) for i in range(3)]
    visions = vlm.vision_embeds_batch(model, prompts)
    return [DecodeRequest(f"r{i}", p.input_ids.tolist(), v.image, p.image_grid_thw, max_tokens=9 + 5 * i,
                          seed=7 + i, temperature=temperature, n=4, stop_token_ids=(1,))
            for i, (p, v) in enumerate(zip(prompts, visions))]


def _decode_all(model, tiny_model_dir, cuda, options: dict, tokens_per_call: int):
    """A torch-graph engine with ``options`` on the tiny model; every request of ``_requests`` decoded
    to its end, ``tokens_per_call`` at a time. Returns the engine and {(request, sample): sequence}."""
    from rollplex.engines.base import EngineContext, get_engine

    import rollplex.engines  # noqa: F401

    engine = get_engine("torch-graph").factory(EngineContext(
        str(tiny_model_dir), cuda, torch.float32, 0, {"share_model": model, "max_num_seqs": 16, "max_model_len": 128,
                                                      **options}))
    engine.add_requests(_requests(model, tiny_model_dir, temperature=1.0))
    done = []
    while engine.has_unfinished():
        done += engine.step(tokens_per_call)
    return engine, {(d.request_id, d.index): d for d in done}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_steps_equal_eager_steps(cuda, tiny_model_dir, dtype):
    """Replaying captured graphs (several batch sizes, rows packed as they finish) gives the eager
    step's tokens exactly."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.base import EngineContext, get_engine

    import rollplex.engines  # noqa: F401

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=dtype).to(cuda).eval()
    outs = {}
    for graphs in (False, True):
        engine = get_engine("torch-graph").factory(EngineContext(
            str(tiny_model_dir), cuda, dtype, 0, {"share_model": model, "max_num_seqs": 16, "max_model_len": 128,
                                                  "cuda_graphs": graphs}))
        engine.add_requests(_requests(model, tiny_model_dir, temperature=1.0))
        done = []
        while engine.has_unfinished():
            done += engine.step(3)
        outs[graphs] = {(d.request_id, d.index): d for d in done}
        if graphs:
            assert engine._graphs, "no CUDA graph was captured"
    assert outs[True].keys() == outs[False].keys()
    for key, seq in outs[False].items():
        assert outs[True][key].token_ids == seq.token_ids
        assert outs[True][key].logprobs == pytest.approx(seq.logprobs, abs=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype, heads, kv_heads", [(torch.float32, 16, 2), (torch.bfloat16, 16, 2),
                                                     (torch.float32, 4, 4)])
# 128-slot blocks pass in bf16; in fp32 they need 272 KiB of shared memory, past the H200's 227.
@pytest.mark.parametrize("tile", [(64, 4), (32, 4)])
def test_split_kv_attention_equals_sdpa_over_each_rows_filled_slots(cuda, dtype, heads, kv_heads, tile, monkeypatch):
    """Slots past a row's length hold NaN here: a kernel that read one would return NaN. ``tile``:
    slots per inner iteration and warps (decode_profile.py --split-kv-tiles times them)."""
    import torch.nn.functional as F

    from rollplex.engines import decode_attention
    from rollplex.engines.decode_attention import split_kv_attention

    monkeypatch.setattr(decode_attention, "BLOCK", tile[0])
    monkeypatch.setattr(decode_attention, "NUM_WARPS", tile[1])
    torch.manual_seed(0)
    n, dim, max_len = 6, 128, 700
    lengths = torch.tensor([1, 2, 63, 64, 333, max_len], dtype=torch.int32, device=cuda)
    q = torch.randn(n, heads, dim, device=cuda, dtype=dtype)
    k, v = (torch.randn(n, kv_heads, max_len, dim, device=cuda, dtype=dtype) for _ in range(2))
    filled = torch.arange(max_len, device=cuda).view(1, -1) < lengths.view(-1, 1)  # [n, L]
    mask = torch.zeros(n, 1, 1, max_len, device=cuda, dtype=dtype).masked_fill(~filled.view(n, 1, 1, -1), float("-inf"))
    want = F.scaled_dot_product_attention(q.view(n, heads, 1, dim), k, v, attn_mask=mask, scale=dim ** -0.5,
                                          enable_gqa=True).view(n, heads, dim)
    past = ~filled.view(n, 1, max_len, 1)
    got = split_kv_attention(q, k.masked_fill(past, float("nan")), v.masked_fill(past, float("nan")), lengths,
                             dim ** -0.5)
    assert got.dtype == dtype and got.shape == want.shape
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    # Under a CUDA graph, replayed on new contents, as the decode step runs it.
    k2, v2 = k.clone(), v.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = split_kv_attention(q, k2, v2, lengths, dim ** -0.5)
    k2.mul_(0.5)
    graph.replay()
    want = F.scaled_dot_product_attention(q.view(n, heads, 1, dim), k2, v2, attn_mask=mask, scale=dim ** -0.5,
                                          enable_gqa=True).view(n, heads, dim)
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.parametrize("dtype, heads, kv_heads", [(torch.float32, 16, 2), (torch.bfloat16, 16, 2),
                                                     (torch.bfloat16, 28, 4)])
def test_shared_prefix_attention_equals_sdpa_over_prompt_then_own_slots(cuda, dtype, heads, kv_heads):
    """Three prompts in slots 0, 2 and 3 (slot 1 free); ten rows of slot 0 in two entries, rows of
    different prompts interleaved, a last padding row no entry lists. Slots past a prompt's or a
    row's length hold NaN: a kernel that read one would return NaN."""
    from rollplex.engines.decode_attention import (
        PREFIX_MEMBERS,
        shared_prefix_attention,
        shared_prefix_attention_sdpa,
    )

    torch.manual_seed(0)
    dim, slots, prefix_len, max_len = 128, 4, 600, 300
    slot_of_row = [0, 2, 0, 3, 0, 0, 2, 0, 0, 0, 0, 0, 0]
    prompt_of_slot = {0: 590, 2: 64, 3: 1}
    n = len(slot_of_row) + 1  # the padding row
    lengths = torch.randint(1, max_len + 1, (n,), dtype=torch.int32, device=cuda)
    entries = [(slot, rows[i: i + PREFIX_MEMBERS]) for slot in prompt_of_slot
               for rows in [[r for r, s in enumerate(slot_of_row) if s == slot]] for i in range(0, len(rows), PREFIX_MEMBERS)]
    assert len(entries) == 4
    entry_slot = torch.zeros(n, dtype=torch.int32)
    entry_len = torch.zeros(n, dtype=torch.int32)
    members = torch.full((n, PREFIX_MEMBERS), -1, dtype=torch.int32)
    for e, (slot, rows) in enumerate(entries):
        entry_slot[e], entry_len[e] = slot, prompt_of_slot[slot]
        members[e, : len(rows)] = torch.tensor(rows)
    q = torch.randn(n, heads, dim, device=cuda, dtype=dtype)
    pk, pv = (torch.randn(slots, kv_heads, prefix_len, dim, device=cuda, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(n, kv_heads, max_len, dim, device=cuda, dtype=dtype) for _ in range(2))
    rows_slot = torch.tensor(slot_of_row + [0], device=cuda)
    plen = torch.tensor([prompt_of_slot[s] for s in slot_of_row] + [0], device=cuda)
    in_prompt = torch.arange(prefix_len, device=cuda).view(1, -1) < plen.view(-1, 1)
    own = torch.arange(max_len, device=cuda).view(1, -1) < lengths.view(-1, 1)
    valid = torch.cat([in_prompt, own], 1)
    mask = torch.zeros(n, 1, 1, prefix_len + max_len, device=cuda, dtype=dtype).masked_fill(
        ~valid.view(n, 1, 1, -1), float("-inf"))
    want = shared_prefix_attention_sdpa(q, pk, pv, rows_slot, k, v, mask, dim ** -0.5)
    for t, filled in ((pk, None), (pv, None), (k, own), (v, own)):
        if filled is None:
            for slot in range(slots):
                t[slot, :, prompt_of_slot.get(slot, 0):] = float("nan")
        else:
            t.masked_fill_(~filled.view(n, 1, max_len, 1), float("nan"))
    got = shared_prefix_attention(q, pk, pv, entry_slot.to(cuda), entry_len.to(cuda), members.to(cuda), k, v, lengths,
                                  dim ** -0.5)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[: n - 1], want[: n - 1], **tol)


@pytest.mark.parametrize("dtype, heads, kv_heads, with_prefix", [
    (torch.float32, 16, 2, True), (torch.bfloat16, 16, 2, True), (torch.bfloat16, 28, 4, True),
    (torch.bfloat16, 16, 2, False)])
def test_layer_attention_rotates_writes_and_attends_as_the_split_kernels(cuda, dtype, heads, kv_heads, with_prefix):
    """``decode_layer_attention`` (one launch: RoPE of q and k, the step's k and v into the cache,
    prompt and own stretches) against the rotary, cache write and ``shared_prefix_attention`` /
    ``split_kv_attention`` it replaces, at the 3B and 7B head shapes and a 1088-token prompt; then
    under a CUDA graph replayed on new inputs, as the decode step runs it."""
    from rollplex.engines.decode_attention import (
        PREFIX_MEMBERS,
        decode_layer_attention,
        shared_prefix_attention,
        split_kv_attention,
    )

    torch.manual_seed(0)
    dim, slots, prefix_len, max_len, n = 128, 3, 1088, 1024, 19  # 16 rows of one prompt, 2 of another, a pad
    slot_of_row = [0] * 8 + [2, 2] + [0] * 8
    lengths = torch.randint(1, max_len + 1, (n,), dtype=torch.int32, device=cuda)
    last = (lengths - 1).long()
    rows = torch.arange(n, device=cuda)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def reference(qkv, cos, sin, k_cache, v_cache, prefix):
        q, k, v = qkv.float().split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        c, s = cos.view(n, 1, dim), sin.view(n, 1, dim)
        q, k = rope(q.view(n, heads, dim), c, s).to(dtype), rope(k.view(n, kv_heads, dim), c, s).to(dtype)
        k_cache[rows, :, last], v_cache[rows, :, last] = k, v.view(n, kv_heads, dim).to(dtype)
        if prefix[0] is None:
            return split_kv_attention(q, k_cache, v_cache, lengths, dim ** -0.5)
        return shared_prefix_attention(q, *prefix[:5], k_cache, v_cache, lengths, dim ** -0.5)

    prefix = (None,) * 6
    if with_prefix:
        entry_slot, entry_len = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
        members = torch.full((n, PREFIX_MEMBERS), -1, dtype=torch.int32)
        groups = [(0, list(range(8))), (2, [8, 9]), (0, list(range(10, 18)))]
        for e, (slot, members_of) in enumerate(groups):
            entry_slot[e], entry_len[e] = slot, prefix_len - 3 * slot
            members[e, : len(members_of)] = torch.tensor(members_of)
        prompt_len = torch.tensor([prefix_len - 3 * s for s in slot_of_row] + [0], device=cuda)
        pk, pv = (torch.randn(slots, kv_heads, prefix_len, dim, device=cuda, dtype=dtype) for _ in range(2))
        prefix = (pk, pv, entry_slot.to(cuda), entry_len.to(cuda), members.to(cuda), prompt_len)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, device=cuda, dtype=dtype)
    angle = torch.randint(0, 3000, (n, 1), device=cuda).float() * torch.rand(1, dim // 2, device=cuda)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    k_cache, v_cache = (torch.randn(n, kv_heads, max_len, dim, device=cuda, dtype=dtype) for _ in range(2))
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want = reference(qkv, cos, sin, k_want, v_want, prefix)
    got = decode_layer_attention(qkv, cos, sin, lengths, k_cache, v_cache, *prefix, heads, dim ** -0.5)
    torch.testing.assert_close(got[: n - 1], want[: n - 1], **tol)
    torch.testing.assert_close(k_cache, k_want, **tol)
    torch.testing.assert_close(v_cache, v_want, **tol)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = decode_layer_attention(qkv, cos, sin, lengths, k_cache, v_cache, *prefix, heads, dim ** -0.5)
    qkv.copy_(torch.randn_like(qkv))
    lengths.copy_(torch.randint(1, max_len + 1, (n,), dtype=torch.int32, device=cuda))
    last = (lengths - 1).long()
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want = reference(qkv, cos, sin, k_want, v_want, prefix)
    graph.replay()
    torch.testing.assert_close(out[: n - 1], want[: n - 1], **tol)
    torch.testing.assert_close(k_cache, k_want, **tol)


@pytest.mark.parametrize("options", [{}, {"shared_prefix": False}, {"compile": True}],
                         ids=["shared", "per-row", "compiled"])
def test_fused_layer_attention_samples_what_split_kv_does(cuda, tiny_model_dir, options):
    """``attention: fused`` (rotary and cache write inside the attention kernel) against ``split-kv``
    on the tiny model with q|k|v fused as a run shares them, under CUDA graphs."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.sharing import fuse_for_rollout

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).to(cuda).eval()
    fuse_for_rollout(model.requires_grad_(False))
    runs = {}
    for attention in ("split-kv", "fused"):
        engine, runs[attention] = _decode_all(model, tiny_model_dir, cuda, {"attention": attention, **options}, 3)
        assert engine.layer_kernel == (attention == "fused") and engine._graphs
    assert runs["fused"].keys() == runs["split-kv"].keys()
    for key, seq in runs["split-kv"].items():
        assert runs["fused"][key].token_ids == seq.token_ids
        assert runs["fused"][key].logprobs == pytest.approx(seq.logprobs, abs=1e-4)


@pytest.mark.parametrize("options", [{"shared_prefix": False}, {"cuda_graphs": True, "compile": True}],
                         ids=["per-row", "compiled-graphs"])
def test_shared_prefix_decode_samples_what_per_row_prompt_copies_do(cuda, tiny_model_dir, options):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).to(cuda).eval()
    _, shared = _decode_all(model, tiny_model_dir, cuda, {"prefix_slots": 2}, tokens_per_call=3)
    engine, other = _decode_all(model, tiny_model_dir, cuda, options, tokens_per_call=3)
    assert engine.split_kv and engine.shared_prefix == options.get("shared_prefix", True)
    assert other.keys() == shared.keys()
    for key, seq in shared.items():
        assert other[key].token_ids == seq.token_ids
        assert other[key].logprobs == pytest.approx(seq.logprobs, abs=1e-4)


def test_split_kv_and_sdpa_decode_engines_sample_the_same_tokens(cuda, tiny_model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).to(cuda).eval()
    runs = {}
    for attention in ("sdpa", "split-kv"):
        engine, runs[attention] = _decode_all(model, tiny_model_dir, cuda, {"attention": attention}, tokens_per_call=3)
        assert engine.split_kv == (attention == "split-kv")
    assert runs["sdpa"].keys() == runs["split-kv"].keys()
    for key, seq in runs["sdpa"].items():
        assert runs["split-kv"][key].token_ids == seq.token_ids
        assert runs["split-kv"][key].logprobs == pytest.approx(seq.logprobs, abs=1e-4)


def test_the_skinny_projection_kernel_decodes_the_tokens_cublas_does(cuda, tiny_model_dir):
    """The torch-graph engine with ``linear: skinny`` and ``skinny-norm`` (engines/projections.py),
    compiled under CUDA graphs, in fp32: the same tokens and log-probs as with cuBLAS."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).to(cuda).eval()
    runs = {}
    for linear in ("cublas", "skinny", "skinny-norm"):
        engine, runs[linear] = _decode_all(model, tiny_model_dir, cuda, {"linear": linear, "compile": True},
                                           tokens_per_call=3)
        assert (engine._linear is None) == (linear == "cublas")
    for linear in ("skinny", "skinny-norm"):
        assert runs["cublas"].keys() == runs[linear].keys()
        for key, seq in runs["cublas"].items():
            assert runs[linear][key].token_ids == seq.token_ids
            assert runs[linear][key].logprobs == pytest.approx(seq.logprobs, abs=1e-4)


def test_decode_graphs_are_captured_with_cudnn_attention_while_eager_forwards_go_without(cuda, tiny_model_dir,
                                                                                          monkeypatch):
    """Eager work meets new shapes (cuDNN would build a plan for each); a graph is captured once."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.attention_kernels import eager_attention_without_cudnn
    from rollplex.engines.graph_decode import GraphDecodeEngine

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).to(cuda).eval()
    before = torch.backends.cuda.cudnn_sdp_enabled()
    seen = []
    step = GraphDecodeEngine._step
    monkeypatch.setattr(GraphDecodeEngine, "_step", lambda self, n, top_p: (
        seen.append(torch.backends.cuda.cudnn_sdp_enabled()), step(self, n, top_p))[1])
    try:
        eager_attention_without_cudnn(cuda)
        engine, _ = _decode_all(model, tiny_model_dir, cuda, {}, tokens_per_call=3)
        assert engine._graphs and seen and all(seen), "a decode step ran outside a capture, or without cuDNN"
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_green_contexts_give_partition_streams_or_none(cuda):
    from rollplex.pipeline.bench.bench import sm_partitions

    parts = sm_partitions(0)  # decode_sms 0: one split per row of the live-batch table
    if parts is not None:
        total = torch.cuda.get_device_properties(0).multi_processor_count
        assert sorted(parts.streams) == [32, 64, 96]
        for split in parts.streams.values():
            assert split["decode_sms"] + split["compute_sms"] == total
            for name in ("decode", "compute"):
                with torch.cuda.stream(split[name]):
                    x = torch.ones(1024, device="cuda") * 2
                split[name].synchronize()
                assert float(x.sum()) == 2048.0


def test_compute_can_be_fenced_while_decode_keeps_every_sm(cuda):
    """cs=N: the partitions overlap, decode's on every SM and compute's on N; both streams work."""
    from rollplex.pipeline.bench.bench import sm_partitions

    total = torch.cuda.get_device_properties(0).multi_processor_count
    parts = sm_partitions(0, 0, total - 16)
    if parts is not None:
        (split,) = parts.streams.values()
        assert (split["decode_sms"], split["compute_sms"]) == (total, total - 16)
        for name in ("decode", "compute"):
            with torch.cuda.stream(split[name]):
                x = torch.ones(1024, device="cuda") * 2
            split[name].synchronize()
            assert float(x.sum()) == 2048.0


def test_compiled_layer_under_cuda_graphs_samples_what_the_eager_layer_does(cuda, tiny_model_dir):
    """``compile``: torch.compile of the decoder layer, then captured into the graphs as usual."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).to(cuda).eval()
    outs = {compiled: _decode_all(model, tiny_model_dir, cuda, {"compile": compiled}, 3)[1]
            for compiled in (False, True)}
    for key, seq in outs[False].items():
        assert outs[True][key].token_ids == seq.token_ids


def test_several_steps_per_graph_sample_what_one_step_graphs_do(cuda, tiny_model_dir):
    """``steps_per_graph``: k decode steps captured as one graph, one launch per k tokens. Rows
    leave only between calls, so the k steps are the k single steps, token for token; a call of 7
    with k = 4 runs one 4-step graph and three one-step ones."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).to(cuda).eval()
    outs, launches = {}, {}
    for k in (1, 4):
        engine, outs[k] = _decode_all(model, tiny_model_dir, cuda, {"steps_per_graph": k}, 7)
        launches[k] = {key[3] for key in engine._graphs}
    assert launches == {1: {1}, 4: {1, 4}}
    assert outs[4].keys() == outs[1].keys()
    for key, seq in outs[1].items():
        assert outs[4][key].token_ids == seq.token_ids
        assert torch.allclose(torch.tensor(outs[4][key].logprobs), torch.tensor(seq.logprobs), atol=1e-5)


def _tiny_bench(tiny_model_dir, tmp_path, policies, **kw):
    """The bench in-process on the tiny model, with the eager decode layer unless ``kw`` says
    otherwise: the compiled default's path is the CLI run of the allocator test below."""
    from rollplex.pipeline.bench.bench import BenchConfig, run

    kw.setdefault("compile_decode", False)
    return run(BenchConfig(model=str(tiny_model_dir / "config.json"), device="cuda", dtype="float32", prompts=4,
                           samples=2, vision_tokens=16, text_tokens=8, max_new_tokens=8, mean_new_tokens=4,
                           chunk_tokens=2, iterations=2, policies=policies, out=str(tmp_path), **kw),
               log=print)


def test_bench_on_cuda_replays_serial_rollout_under_every_policy(cuda, tiny_model_dir, tmp_path):
    """On 2026-11-30 the H200 bench left every ``replayed`` entry empty while the CPU run filled them;
    this runs the same path on CUDA with the tiny model (fp32), with auto partitions and train fusion."""
    late = "rollplex:wc=1:tf=0:spg=2:ppn=2:mb=2"  # late chunks scored together, 2-step graphs, batched nodes
    fused = "rollplex:ppn=2:mb=2:tf=1:sp=0"  # batched prompts trained in the window, on plain streams
    out = _tiny_bench(tiny_model_dir, tmp_path, ("plain", "serial", "rollplex-nofusion", "rollplex", late, fused),
                      train_fusion=True)
    updates = {u["policy"]: u for u in out["updates"]}
    assert updates["serial"]["replayed"] is not None, "serial's rollout was not recorded on CUDA"
    assert updates["plain"]["replayed"] <= 1e-3 and updates["serial#aa"]["replayed"] <= 1e-4
    assert updates["rollplex-nofusion"]["replayed"] <= 1e-4 and updates["rollplex"]["replayed"] <= 1e-2
    assert updates[late]["replayed"] <= 1e-2 and updates[fused]["replayed"] <= 1e-2
    kinds = {r["policy"]: r["seconds_by_kind"] for r in out["results"]}
    assert "reward" not in kinds[fused]  # rewards inside train_c: the fused graph ran


def test_bench_two_gpu_policies_on_cuda(cuda, tiny_model_dir, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 CUDA devices, found {torch.cuda.device_count()}; run it on the 2-GPU machine")
    out = _tiny_bench(tiny_model_dir, tmp_path, ("serial", "disaggregated", "disaggregated-noshare", "rollplex-dp2"))
    rows = {r["policy"]: r for r in out["results"]}
    assert rows["rollplex-dp2"]["ranks_max_weight_difference"] <= 1e-6
    assert rows["disaggregated"]["seconds_by_kind"]["weight_sync"] > 0
    assert rows["disaggregated-noshare"]["seconds_by_kind"]["weight_sync"] > 0


def test_partition_streams_get_every_graph_before_the_window(cuda, tiny_model_dir):
    """``WorkerHost.use_partitions`` captures the decode step for every batch size on every split's
    stream up front: a capture in the decode window would synchronize the device under the compute
    stream."""
    from rollplex.engines.base import EngineContext
    from rollplex.engines.graph_decode import GraphDecodeEngine
    from rollplex.pipeline.bench.bench import sm_partitions

    parts = sm_partitions(0)
    if parts is None:
        pytest.skip("no green contexts in this torch build or driver: nothing is partitioned")
    engine = GraphDecodeEngine(EngineContext(str(tiny_model_dir), cuda, torch.float32, 0, {"max_num_seqs": 16}))
    for stream, _ in parts.decode_streams():
        engine.capture_graphs(stream)
    assert len(engine._graphs) == len(engine.sizes) * len(parts.streams)
    for stream, _ in parts.decode_streams():
        engine.capture_graphs(stream)  # already there: nothing captured again
        timed = engine.step_seconds_on(stream)  # each graph timed on its split as it was captured
        assert sorted(timed) == engine.sizes and all(t > 0 for t in timed.values())
    assert len(engine._graphs) == len(engine.sizes) * len(parts.streams)


def test_bench_runs_on_the_stream_ordered_allocator(cuda, tiny_model_dir, tmp_path):
    """``--cuda-allocator async`` reaches torch before it loads (a fresh process), green-context
    partitions and CUDA graphs run on cudaMallocAsync, and bench.json records the backend. Compiled
    decode is off by default there: its Triton kernels refuse the pool's pointers under capture."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "rollplex.cli", "bench", "--cuda-allocator", "async", "--device", "cuda",
           "--model", str(tiny_model_dir / "config.json"), "--dtype", "float32", "--prompts", "2", "--samples", "2",
           "--vision-tokens", "16", "--max-new-tokens", "8", "--mean-new-tokens", "4", "--chunk-tokens", "2",
           "--iterations", "2", "--policies", "serial,rollplex", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if "frame #" not in line)
    saved = json.loads((out / "bench.json").read_text())
    assert saved["cuda_allocator"] == "cudaMallocAsync"
    assert {u["policy"]: u["replayed"] for u in saved["updates"]}["rollplex"] <= 1e-2
    assert saved["config"]["compile_decode"] is False


def test_a_training_run_on_cuda_decodes_with_the_graph_engine_by_default(cuda, tmp_path):
    """`rollplex train` on CUDA with every engine left on auto: torch-graph decodes (shared with the
    trainer's weights, graphs captured on the worker's decode stream), and the run ends normally."""
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rollplex.cli", "train", "--out", str(out), "--iterations", "3", "--no-progress",
           "--set", "model.device=cuda", "--set", "warmup.steps=2", "--set", "stop_at_reward=null"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "@torch-graph" in (out / "graph.txt").read_text()
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 3


def test_skinny_linear_matches_cublas_in_bf16_at_the_3b_layers_shapes(cuda):
    """engines/skinny_linear.py in bf16 (the interpreter test is fp32 only), every tiling, against
    F.linear at the 3B layer's projections for 8 and 64 rows."""
    import torch.nn.functional as F

    from rollplex.engines.skinny_linear import CONFIGS, skinny_linear

    torch.manual_seed(0)
    for n, k, bias in ((2560, 2048, True), (2048, 2048, False), (22016, 2048, False), (2048, 11008, False)):
        w = torch.randn(n, k, device=cuda, dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device=cuda, dtype=torch.bfloat16) if bias else None
        for m in (8, 64):
            x = torch.randn(m, k, device=cuda, dtype=torch.bfloat16)
            want = F.linear(x, w, b).float()
            for config in CONFIGS:
                err = ((skinny_linear(x, w, b, config).float() - want).abs().max() / want.abs().max()).item()
                assert err < 1e-2, (n, k, m, config, err)


def test_skinny_norm_linear_matches_the_separate_ops_in_bf16_at_the_3b_layers_shapes(cuda):
    """The residual add, RMS norm and projection in one launch (and gate|up's SiLU product), bf16, at
    the 3B layer's q|k|v and gate|up for 8 and 64 rows, against the separate ops the layer runs."""
    from rollplex.engines.decode_step import _norm_linear_of
    from rollplex.engines.skinny_linear import CONFIGS, skinny_norm_linear

    separate = _norm_linear_of(torch.nn.functional.linear)
    torch.manual_seed(0)
    for n, k, silu in ((2560, 2048, False), (22016, 2048, True)):
        w = torch.randn(n, k, device=cuda, dtype=torch.bfloat16) * 0.02
        b = None if silu else torch.randn(n, device=cuda, dtype=torch.bfloat16)
        g = torch.rand(k, device=cuda, dtype=torch.bfloat16) + 0.5
        for m in (8, 64):
            x, r = (torch.randn(m, k, device=cuda, dtype=torch.bfloat16) for _ in range(2))
            want, want_sum = separate(x, r, g, 1e-6, w, b, silu)
            for config in CONFIGS[:8]:
                got, got_sum = skinny_norm_linear(x, r, g, 1e-6, w, b, silu, config)
                assert torch.equal(got_sum, want_sum)
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                assert err < 1e-2, (n, k, m, config, err)
