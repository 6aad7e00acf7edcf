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
    from rollplex.tasks import lm
    from rollplex.tasks.data import PromptBuilder, SyntheticVisualTask, build_item

    builder = PromptBuilder(AutoProcessor.from_pretrained(tiny_model_dir))
    prompts = [build_item(SyntheticVisualTask(image_size=112), builder, i) for i in range(3)]
    visions = lm.vision_embeds_batch(model, prompts)
    return [DecodeRequest(f"r{i}", p.input_ids.tolist(), v.image, p.image_grid_thw, max_tokens=9 + 5 * i,
                          seed=7 + i, temperature=temperature, n=4, stop_token_ids=(1,))
            for i, (p, v) in enumerate(zip(prompts, visions))]


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


def test_green_contexts_give_partition_streams_or_none(cuda):
    from rollplex.pipeline.bench import BenchConfig, sm_partitions

    parts = sm_partitions(BenchConfig())  # decode_sms 0: one split per row of the live-batch table
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
