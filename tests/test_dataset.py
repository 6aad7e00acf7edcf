"""File datasets (jsonl/parquet, verl/EasyR1 columns), bad rows, video prompts and the exporter (CPU)."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from rollplex.errors import CheckpointError, ConfigError, DataError
from rollplex.tasks.data import PromptBuilder, PromptLoader, SyntheticVisualTask, build_item
from rollplex.tasks.dataset import FileDataset, export_synthetic, probe_shape


@pytest.fixture(scope="module")
def builder(tiny_model_dir):
    from transformers import AutoProcessor

    return PromptBuilder(AutoProcessor.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def pad_ids(tiny_model_dir):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_model_dir)
    return c.image_token_id, c.video_token_id


def _png(colour=(200, 20, 20), size=56) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_exported_task_builds_the_same_prompts_as_the_embedded_one(tmp_path, builder, fmt):
    path = export_synthetic(tmp_path, size=6, fmt=fmt)
    data = FileDataset(path)
    task = SyntheticVisualTask(image_size=112, size=6)
    assert len(data) == 6 and data.answers() == tuple(sorted({task.item(i).answer for i in range(6)}))
    for i in (0, 5):
        a, b = data.build(builder, i), build_item(task, builder, i)
        assert torch.equal(a.input_ids, b.input_ids)  # "<image>question" == image part, then text
        assert torch.equal(a.pixel_values, b.pixel_values)  # PNG is lossless
        assert a.answer == b.answer


def test_verl_and_easyr1_conventions(tmp_path, builder):
    """problem/prompt keys, verl chat-message prompts, nested answers, bytes and {bytes, path} images."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png())
    rows = [
        {"problem": "<image>What colour?", "images": ["img/a.png"], "answer": "red"},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Colour? <image>"}],
         "images": ["data:image/png;base64," + base64.b64encode(_png((20, 20, 200))).decode()],
         "reward_model": {"ground_truth": "blue"}},
        {"prompt": "Two views: <image> and <image>", "images": [_png(), str(tmp_path / "img" / "a.png")],
         "answer": 3},
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Parquet needs one type per column: keep rows 0 and 2 (string answers) there; row 1 as jsonl.
    data = FileDataset(_write_jsonl(tmp_path / "d.jsonl", [rows[1]]), answer_key="reward_model.ground_truth")
    p = data.build(builder, 0)
    assert p.answer == "blue" and p.image_grid_thw.shape == (1, 3) and p.text == "Colour? <image>"
    # from_pylist takes its columns from the first row: parquet rows all have every column.
    table = [dict(rows[0], prompt=None, images=[{"bytes": None, "path": "img/a.png"}]), {"prompt": rows[2]["prompt"], "images": [
        {"bytes": _png(), "path": None}, {"bytes": None, "path": "img/a.png"}], "answer": "3"}]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "d.parquet")
    data = FileDataset(tmp_path / "d.parquet")
    assert [data.build(builder, i).image_grid_thw.shape[0] for i in range(2)] == [1, 2]
    assert data.build(builder, 1).answer == "3"
    # Placeholders order the parts: text, image, text, image.
    ids = data.build(builder, 1).input_ids.tolist()
    vision_start = builder.processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert ids.count(vision_start) == 2


BAD_ROWS = [
    ({"prompt": "<image>Q", "images": ["missing.png"], "answer": "red"}, "missing.png does not exist"),
    ({"prompt": "<image>Q", "images": ["broken.png"], "answer": "red"}, "is not a readable image"),
    ({"prompt": "   ", "images": ["ok.png"], "answer": "red"}, "empty prompt (column 'prompt')"),
    ({"prompt": "<image>Q", "images": ["ok.png"]}, "no answer (column 'answer')"),
    ({"prompt": "<image>Q", "images": ["ok.png"], "answer": ""}, "no answer"),
    ('{"prompt": "Q", "answer": ', "not valid JSON"),
    ({"prompt": "<image><image>Q", "images": ["ok.png"], "answer": "red"}, "2 <image> placeholder(s)"),
    ({"prompt": "<video>Q", "videos": ["clip.mp4"], "answer": "red"}, "is a video file; give its frames"),
    ({"images": ["ok.png"], "answer": "red"}, "no prompt (column 'prompt' or 'problem')"),
]


@pytest.mark.parametrize("row, reason", BAD_ROWS)
def test_a_bad_row_is_rejected_naming_file_and_line(tmp_path, row, reason):
    (tmp_path / "ok.png").write_bytes(_png())
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (tmp_path / "clip.mp4").write_bytes(b"\x00")
    good = {"prompt": "<image>Q", "images": ["ok.png"], "answer": "red"}
    path = _write_jsonl(tmp_path / "train.jsonl", [good, "", row, good])  # the blank line still counts
    with pytest.raises(DataError) as err:
        FileDataset(path)
    msg = str(err.value)
    assert msg.startswith(f"{path} line 3: ") and reason in msg and "on_bad_row: skip" in msg, msg
    data = FileDataset(path, on_bad_row="skip")
    assert len(data) == 2 and [str(b) for b in data.bad_rows] == [msg.split(" (set data.on_bad_row")[0]]


def test_parquet_bad_rows_name_the_row_and_config_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "Q", "answer": "a"}, {"prompt": "", "answer": "b"}]),
                   tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet row 1: empty prompt"):
        FileDataset(tmp_path / "d.parquet")
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ConfigError, match="data.format: cannot tell the format"):
        FileDataset(tmp_path / "d.csv")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet cannot be read as parquet"):
        FileDataset(tmp_path / "junk.parquet")
    with pytest.raises(DataError, match="does not exist"):
        FileDataset(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"holds no usable rows \(1 rows read, 1 bad\)"):
        FileDataset(_write_jsonl(tmp_path / "e.jsonl", [{"prompt": "", "answer": "x"}]), on_bad_row="skip")
    with pytest.raises(ConfigError, match="unknown reward"):
        FileDataset(tmp_path / "d.parquet", on_bad_row="skip", reward="nope")
    small = FileDataset(tmp_path / "d.parquet", on_bad_row="skip")
    with pytest.raises(ConfigError, match=r"prompts_per_iteration\): must be between 1 and the 1 usable rows of"):
        PromptLoader(small, None, 2)


def test_loader_skips_late_bad_rows_reproducibly_and_resumes(tmp_path, builder):
    """A row that fails only when built (here: over max_prompt_tokens) is skipped, counted, kept in
    the loader state, and a restored loader yields exactly the batches the original would have."""
    (tmp_path / "ok.png").write_bytes(_png())
    rows = [{"prompt": f"<image>Q{i}", "images": ["ok.png"], "answer": "red"} for i in range(7)]
    rows[3] = {"prompt": "<image><image>Q3", "images": ["ok.png", "ok.png"], "answer": "red"}  # 2 images: longer
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    one = FileDataset(path).build(builder, 0).num_tokens
    logged = []

    def loader(mode):
        return PromptLoader(FileDataset(path, on_bad_row=mode, max_prompt_tokens=one), builder, 2, seed=1,
                            log=logged.append)

    with pytest.raises(DataError, match=r"t\.jsonl line 4: the prompt has \d+ tokens, more than"):
        reject = loader("reject")
        for _ in range(8):
            reject.next_batch()
    run = loader("skip")
    batches = [[p.prompt_id for p in run.next_batch()] for _ in range(2)]
    state = json.loads(json.dumps(run.state_dict()))
    later = [[p.prompt_id for p in run.next_batch()] for _ in range(6)]
    assert run.skipped == [3] and run.metrics() == {"data_skipped_rows": 1}
    assert len(logged) == 1 and "t.jsonl line 4" in logged[0]
    assert all(len(b) == 2 and len(set(b)) == 2 for b in batches + later)
    assert "t-000003" not in sum(batches + later, [])
    resumed = loader("skip")
    resumed.load_state_dict(state)
    assert [[p.prompt_id for p in resumed.next_batch()] for _ in range(6)] == later
    other = PromptLoader(FileDataset(export_synthetic(tmp_path / "x", size=4)), builder, 2)
    with pytest.raises(CheckpointError, match="resume with the same task"):
        other.load_state_dict(state)


def test_video_prefix_grows_with_frames_and_the_graph_shape_sees_it(tmp_path, builder, pad_ids):
    """Qwen2.5-VL patches 2 frames in time: 16 merged tokens per 2 frames of a 112 px clip."""
    tokens, vision = [], []
    for frames in (2, 4, 6):
        data = FileDataset(export_synthetic(tmp_path / f"v{frames}", size=2, video_frames=frames))
        prompt = data.build(builder, 0)
        assert prompt.video_grid_thw.tolist() == [[frames // 2, 8, 8]] and prompt.pixel_values is None
        tokens.append(prompt.num_tokens)
        vision.append(probe_shape(data, builder, pad_ids)[1])
    assert vision == [16, 32, 48]
    assert [b - a for a, b in zip(tokens, tokens[1:])] == [16, 16]
    image = FileDataset(export_synthetic(tmp_path / "img", size=2))
    assert probe_shape(image, builder, pad_ids)[1] == 16


def test_video_prompt_prefix_matches_a_plain_forward(tmp_path, builder, tiny_model_dir):
    """The split prefix forward with video embeddings equals the HF model's own forward (M-RoPE with
    temporal positions included)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.engines import vlm

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    prompt = FileDataset(export_synthetic(tmp_path, size=1, video_frames=4)).build(builder, 0)
    vis = vlm.vision_embeds(model, prompt)
    assert vis.video.shape[0] == 32 and vis.image is None
    state = vlm.prefix_forward(model, prompt, vis, grad=False)
    with torch.no_grad():
        ref = model(input_ids=prompt.input_ids.view(1, -1), pixel_values_videos=prompt.pixel_values_videos,
                    video_grid_thw=prompt.video_grid_thw, second_per_grid_ts=prompt.second_per_grid_ts,
                    mm_token_type_ids=vlm.mm_token_types(prompt.input_ids.view(1, -1), model.config)).logits[0, -1]
    torch.testing.assert_close(state.last_logits, ref.float(), rtol=1e-4, atol=1e-4)


def test_the_compiled_graph_sees_video_tokens_and_vllm_refuses_video(tmp_path):
    """BatchShape counts a prompt's image and video pad tokens: 4 frames give 32, one image 16."""
    from rollplex.config import load_config
    from rollplex.errors import EngineError
    from rollplex.pipeline.run.session import Session

    base = ["engines.decode=hf", "engines.train=torch", "rollout.prompts_per_iteration=2"]
    shapes = {}
    for name, frames in (("image", 0), ("video", 4)):
        path = export_synthetic(tmp_path / name, size=4, video_frames=frames)
        session = Session(load_config(None, base + [f"data.path={path}"]), tmp_path)
        shapes[name] = (session.shape.vision_tokens, session.shape.prompt_tokens)
        vit = session.graph.of_kind("vit_encode")[0]
        assert session.graph.values[vit.outputs[0]].nbytes == shapes[name][0] * session.dims.hidden * 4  # per prompt
    assert shapes["image"][0] == 16 and shapes["video"][0] == 32
    assert shapes["video"][1] - shapes["image"][1] == 16
    with pytest.raises(EngineError, match="video prompts, which the vllm decode engine does not take"):
        Session(load_config(None, base + [f"data.path={tmp_path / 'video' / 'train.jsonl'}",
                                          "engines.overrides={decode_chunk: vllm}"]), tmp_path)


def test_cli_exits_2_naming_the_file_and_line(tmp_path, capsys):
    from rollplex.cli import main

    (tmp_path / "ok.png").write_bytes(_png())
    good = {"prompt": "<image>Q", "images": ["ok.png"], "answer": "red"}
    path = _write_jsonl(tmp_path / "train.jsonl", [good, good, {"prompt": "<image>Q", "images": ["gone.png"],
                                                                 "answer": "red"}])
    assert main(["graph", "--set", f"data.path={path}", "--set", "rollout.prompts_per_iteration=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rollplex: error: {path} line 3: image 0: {tmp_path / 'gone.png'} does not exist "
                   "(set data.on_bad_row: skip to leave such rows out)")
