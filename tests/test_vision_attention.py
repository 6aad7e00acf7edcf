"""Batched vision attention: the patched Qwen2.5-VL vision tower gives HF's output with fewer SDPA calls."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from rollplex.engines.vision_attention import (  # noqa: E402
    BatchedVisionAttention,
    batch_vision_attention,
    window_runs,
)

DEPTH = 3
# 4x4-patch windows (window_size / patch_size = 4): an 8x8 grid is four equal windows; a 6x10 grid
# ends in 4x2, 2x4 and 2x2 windows, so its lengths are ragged.
EQUAL = [[1, 8, 8]]
RAGGED = [[1, 8, 12], [1, 6, 10]]


def tiny_model(attn: str):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=DEPTH, hidden_size=48, intermediate_size=96, num_heads=3, out_hidden_size=32,
                           fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def run_tower(model, grids):
    """The vision tower on random pixels for ``grids``, called as HF's get_image_features calls it."""
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.model.visual(pixels, grid_thw=grid)
    return out.last_hidden_state, out.pooler_output


def count_sdpa(monkeypatch) -> list[int]:
    calls = [0]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


# SDPA calls for the 1 full + 2 window layers. EQUAL: HF 1 + 2 * 4 windows, patched 1 + 2 * 1 run.
# RAGGED: the full layer has one run per image; windows 8x12 -> 6 of 16, 6x10 -> 16,16,8 | 8,8,4,
# so HF makes 2 + 2 * 12 calls, patched 2 + 2 * 3 (runs 16x8, 8x3, 4x1).
@pytest.mark.parametrize("grids, hf_calls, patched_calls", [(EQUAL, 9, 3), (RAGGED, 26, 8)])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_same_output_fewer_calls(monkeypatch, attn, grids, hf_calls, patched_calls):
    reference = tiny_model(attn)
    model = copy.deepcopy(reference)
    assert batch_vision_attention(model) == DEPTH
    assert batch_vision_attention(model) == 0  # idempotent
    assert all(type(b.attn) is BatchedVisionAttention for b in model.model.visual.blocks)

    calls = count_sdpa(monkeypatch)
    expected = run_tower(reference, grids)
    assert calls[0] == (hf_calls if attn == "sdpa" else 0)  # HF's eager path does not use SDPA
    calls[0] = 0
    got = run_tower(model, grids)
    assert calls[0] == patched_calls
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_patches_tower_alone_and_keeps_state_dict():
    model = tiny_model("sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert batch_vision_attention(model.model.visual) == DEPTH
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_flash_attention_left_alone():
    model = tiny_model("sdpa")
    for block in model.model.visual.blocks:
        block.attn.config._attn_implementation_internal = "flash_attention_2"
    assert batch_vision_attention(model) == 0


def test_window_runs_read_once_per_tensor():
    cu = torch.tensor([0, 16, 32, 48, 56, 64, 68, 68, 132], dtype=torch.int32)
    runs = window_runs(cu)
    assert runs == [(16, 3), (8, 2), (4, 1), (64, 1)]
    assert window_runs(cu) is runs  # cached for the other layers of the forward
    assert window_runs(cu.clone()) == runs  # same values, another tensor: recomputed
    cu[1:] += 4  # changed in place: the version moves, so no stale hit
    assert window_runs(cu) == [(20, 1), (16, 2), (8, 2), (4, 1), (64, 1)]
