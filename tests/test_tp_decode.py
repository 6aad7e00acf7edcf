"""The torch-graph decode engine under tensor parallelism: two gloo ranks in two processes, each
with the full tiny model and half its heads and MLP columns, sample what one rank samples.

Greedy and sampled rows, stop tokens and a chunked schedule; both ranks hand on every sample, with
the same tokens as the one-rank engine and log-probs equal to fp32 rounding (the row-parallel
projections sum two partial products instead of one)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rollplex import runtime

runtime.configure(threads=1)

from rollplex.engines.base import DecodeRequest, EngineContext, get_engine  # noqa: E402
from rollplex.errors import EngineError  # noqa: E402

CORPUS = ("What colour is the shape? Answer with one word. red green blue",)
STOP = tuple(range(60, 120))  # a large share of the tiny vocabulary: some rows stop early


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rollplex.engines.models import TinyVLMSpec, ensure_tiny_vlm

    cache = Path(os.environ.get("ROLLPLEX_CACHE", Path(__file__).resolve().parents[1] / ".cache" / "test"))
    return ensure_tiny_vlm(TinyVLMSpec(corpus=CORPUS), cache)


def _requests(model_dir: Path) -> list[DecodeRequest]:
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.vlm import PromptInputs, vision_embeds

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(model_dir)
    out = []
    for i, (question, size) in enumerate([("What colour is the shape?", (64, 64)), ("One word.", (110, 56))]):
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        enc = proc(text=[proc.apply_chat_template(msgs, add_generation_prompt=True)],
                   images=[Image.new("RGB", size, (200, 40 * i, 0))], return_tensors="pt")
        p = PromptInputs(f"p{i}", enc["input_ids"][0], pixel_values=enc["pixel_values"],
                         image_grid_thw=enc["image_grid_thw"])
        image = vision_embeds(model, p).image
        for g, temperature in enumerate((0.0, 1.0, 1.0)):
            out.append(DecodeRequest(f"p{i}-{g}", p.input_ids.tolist(), image, p.image_grid_thw, max_tokens=16,
                                     seed=1000 * i + g, temperature=temperature, stop_token_ids=STOP))
    return out


def _decode(engine, requests) -> dict:
    engine.add_requests(requests)
    done = []
    while engine.has_unfinished():
        done += engine.step(3)  # chunks of 3 tokens: rows leave between calls
    return {d.request_id: (list(d.token_ids), list(d.logprobs)) for d in done}


def _rank(rank: int, world: int, init: str, model_dir: str, requests, out: str, device: str = "cpu") -> None:
    import torch.distributed as dist

    runtime.configure(threads=1)
    device = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=world, **({"device_id": device} if device.type == "cuda" else {}))
    ctx = EngineContext(model_dir, device, torch.float32, seed=0,
                        options={"max_num_seqs": 8, "max_model_len": 256, "tp_group": dist.group.WORLD})
    engine = get_engine("torch-graph", "decode").factory(ctx)
    torch.save(_decode(engine, requests), f"{out}.{rank}")
    dist.barrier()
    # No destroy_process_group and no interpreter teardown: on two H200s NCCL's teardown after
    # graph-captured all-reduces hung (benchmarks/tp_decode.py, 2026-11-30), and in a full pytest
    # session both gloo ranks once aborted at teardown after writing their results.
    os._exit(0)


def _spawn_ranks(args: tuple, timeout_s: float = 300) -> None:
    """Two ranks; a rank that hangs fails the test by name instead of stalling the suite."""
    context = mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"tensor-parallel ranks still running after {timeout_s:.0f} s")


@pytest.mark.slow
def test_two_tensor_parallel_ranks_sample_what_one_rank_samples(model_dir, tmp_path):
    requests = _requests(model_dir)
    one = get_engine("torch-graph", "decode").factory(EngineContext(
        str(model_dir), torch.device("cpu"), torch.float32, seed=0, options={"max_num_seqs": 8, "max_model_len": 256}))
    expected = _decode(one, requests)
    assert {len(tokens) for tokens, _ in expected.values()} != {16}  # some rows stop early
    out = str(tmp_path / "tp")
    _spawn_ranks((2, f"file://{tmp_path / 'rendezvous'}", str(model_dir), requests, out))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got.keys() == expected.keys()
        for key, (tokens, logprobs) in expected.items():
            assert got[key][0] == tokens, (rank, key)
            assert torch.allclose(torch.tensor(got[key][1]), torch.tensor(logprobs), atol=1e-5), (rank, key)


def test_a_tensor_parallel_degree_must_divide_the_heads(model_dir):
    """The tiny model has 4 attention heads and 2 key/value heads: three ranks cannot split them."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.decode_step import _Weights

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(EngineError, match="tensor parallel 3 does not divide the model's 4 attention heads"):
        _Weights(model, 0, 3)
    half = _Weights(model, 1, 2)
    q_w = model.model.language_model.layers[0].self_attn.q_proj.weight
    assert half.layer_args[0][0][1].data_ptr() == q_w[q_w.shape[0] // 2:].data_ptr()  # a view: no copy


@pytest.mark.gpu
def test_two_tensor_parallel_gpus_under_cuda_graphs_sample_what_one_gpu_samples(model_dir, tmp_path):
    """The same check on two GPUs: NCCL all-reduces captured inside each rank's step graphs."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 CUDA devices, found {torch.cuda.device_count()}; run it on the 2-GPU machine")
    requests = _requests(model_dir)
    one = get_engine("torch-graph", "decode").factory(EngineContext(
        str(model_dir), torch.device("cuda:0"), torch.float32, seed=0, options={"max_num_seqs": 8, "max_model_len": 256}))
    expected = _decode(one, requests)
    out = str(tmp_path / "tp")
    _spawn_ranks((2, f"file://{tmp_path / 'rendezvous'}", str(model_dir), requests, out, "cuda"))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        for key, (tokens, logprobs) in expected.items():
            assert got[key][0] == tokens, (rank, key)
            assert torch.allclose(torch.tensor(got[key][1]), torch.tensor(logprobs), atol=1e-4), (rank, key)
