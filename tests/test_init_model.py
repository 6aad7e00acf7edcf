"""`rollplex init-model`: a random-weight model of a preset's architecture, written in HF format and
loaded by the runtime's own loading code. The 3B preset cut to one decoder layer and one ViT block
(the widths, heads, vocabulary and ViT shape stay the preset's), to keep it under a gigabyte."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollplex.cli import main
from rollplex.engines.modelspec import PRESETS, from_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("init") / "qwen3b-1layer"
    assert main(["init-model", str(out), "--preset", "qwen2.5-vl-3b", "--layers", "1", "--vision-layers", "1"]) == 0
    return out


def test_the_written_model_has_the_presets_shape_but_its_depths(model_dir):
    written, preset = from_config(model_dir), PRESETS["qwen2.5-vl-3b"]
    same = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tied", "vit_hidden",
            "vit_intermediate", "vit_heads", "vit_out")
    assert {k: getattr(written, k) for k in same} == {k: getattr(preset, k) for k in same}
    assert (written.layers, written.vit_depth) == (1, 1)
    assert not any(p.name.startswith(".") for p in model_dir.parent.iterdir())  # no staging left behind


def test_the_processor_encodes_the_task_inside_the_models_vocabulary(model_dir):
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    config, processor = AutoConfig.from_pretrained(model_dir), AutoProcessor.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    enc = processor(text=[processor.apply_chat_template(msgs, add_generation_prompt=True)],
                    images=[Image.new("RGB", (112, 112))], return_tensors="pt")
    ids = enc["input_ids"][0]
    assert int(ids.max()) < config.text_config.vocab_size
    assert processor.tokenizer.convert_ids_to_tokens(config.image_token_id) == "<|image_pad|>"
    assert int((ids == config.image_token_id).sum()) == 16  # 112 px: 8 × 8 patches, merged 2 × 2


def test_the_runtime_compiles_a_run_on_it(model_dir, capsys):
    assert main(["graph", "--set", f"model.path={model_dir}", "--set", "model.dtype=bfloat16"]) == 0
    assert "vit_encode" in capsys.readouterr().out


def test_an_existing_directory_is_refused_and_left_as_it_was(model_dir, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert main(["init-model", str(model_dir), "--preset", "qwen2.5-vl-3b", "--layers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"error: {model_dir}: exists already" in err and "--out" not in err
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_an_unknown_preset_is_named(tmp_path, capsys):
    assert main(["init-model", str(tmp_path / "m"), "--preset", "qwen9"]) == 2
    err = capsys.readouterr().err
    assert "--preset 'qwen9': not a preset" in err and "--model" not in err and not (tmp_path / "m").exists()


def test_a_vocabulary_below_the_tokenizers_is_refused(tmp_path):
    from rollplex.engines.models import TinyVLMSpec, write_vlm
    from rollplex.errors import ConfigError

    with pytest.raises(ConfigError, match="vocab_size 8 is smaller than the tokenizer's"):
        write_vlm(dataclasses.replace(TinyVLMSpec(corpus=("red",)), vocab_size=8), tmp_path / "m")
    assert not (tmp_path / "m").exists() and list(tmp_path.iterdir()) == []


def test_cuda_weights_without_a_gpu_are_refused_before_writing(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["init-model", str(tmp_path / "m"), "--preset", "qwen2.5-vl-3b", "--layers", "1",
                 "--device", "cuda"]) == 2
    assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
