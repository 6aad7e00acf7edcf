"""A Hugging Face ``datasets`` folder (``save_to_disk``) as data.path, the way verl, EasyR1 and TRL users
keep their data: the Image feature, a DatasetDict's splits, the recipe a worker re-reads, and a run.
The folders are written by the real `datasets` package; Rollplex reads them with pyarrow alone."""
from __future__ import annotations

import json
import pickle

import datasets  # a test dependency (pyproject: test); the runtime reads the folders with pyarrow
import pytest
import torch

from rollplex.errors import ConfigError, DataError
from rollplex.tasks.data import PromptBuilder, SyntheticVisualTask, build_item
from rollplex.tasks.dataset import FileDataset, export_synthetic


@pytest.fixture(scope="module")
def builder(tiny_model_dir):
    from transformers import AutoProcessor

    return PromptBuilder(AutoProcessor.from_pretrained(tiny_model_dir))


def _rows(tmp_path, size: int) -> list[dict]:
    """The embedded task's first ``size`` items as rows whose images are PNG files."""
    path = export_synthetic(tmp_path / "export", size=size)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row["images"] = [str(path.parent / p) for p in row["images"]]
    return rows


def _dataset(rows: list[dict], column: str = "images", many: bool = True):
    """A Dataset whose images are the `datasets` Image feature (bytes inside the Arrow file)."""
    Image = datasets.Image
    data = {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows],
            column: [r["images"] if many else r["images"][0] for r in rows]}
    features = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string"),
                                  column: datasets.Sequence(Image()) if many else Image()})
    ds = datasets.Dataset.from_dict(data, features=features)
    return ds.map(lambda r: r)  # decoded and re-encoded: the images' bytes now live in the Arrow file


@pytest.mark.parametrize("many", [True, False], ids=["images-list", "one-image-column"])
def test_a_saved_dataset_builds_the_same_prompts_as_the_embedded_task(tmp_path, builder, many):
    rows = _rows(tmp_path, 6)
    folder = tmp_path / "ds"
    _dataset(rows, "images" if many else "image", many).save_to_disk(str(folder))
    for p in (tmp_path / "export" / "images").iterdir():  # bytes, not paths: nothing outside the folder
        p.unlink()
    data = FileDataset(folder, image_key="images" if many else "image")
    assert data.format == "datasets" and len(data) == 6
    task = SyntheticVisualTask(image_size=112, size=6)
    for i in range(6):
        a, b = data.build(builder, i), build_item(task, builder, i)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values, b.pixel_values)
        assert a.answer == b.answer and list(a.meta["images"][0]) == ["sha256"]


def test_a_dataset_dict_reads_the_split_asked_for(tmp_path, builder):
    rows = _rows(tmp_path, 6)
    datasets.DatasetDict({"train": _dataset(rows[:4]), "test": _dataset(rows[4:])}).save_to_disk(str(tmp_path / "dd"))
    assert len(FileDataset(tmp_path / "dd")) == 4
    test = FileDataset(tmp_path / "dd", split="test")
    assert len(test) == 2 and test.build(builder, 0).answer == rows[4]["answer"]
    with pytest.raises(ConfigError, match=r"data.split: 'validation' is not a split of .*dd \(it has train, test\)"):
        FileDataset(tmp_path / "dd", split="validation")


def test_it_pickles_as_its_recipe_and_reads_back_in_the_same_order(tmp_path):
    rows = _rows(tmp_path, 8)
    shuffled = _dataset(rows).shuffle(seed=3)
    shuffled.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    data = FileDataset(tmp_path / "ds")
    raw = datasets.load_from_disk(str(tmp_path / "ds"))
    raw = raw.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))["images"]
    assert [r.images for r in data.rows] == [tuple(i["bytes"] for i in r) for r in raw]  # its order, over 3 shards
    blob = pickle.dumps(data)
    assert len(blob) < 2000  # the recipe, not the rows' image bytes
    again = pickle.loads(blob)
    assert [r.images for r in again.rows] == [r.images for r in data.rows]
    assert again.identity() == data.identity()


def test_what_is_not_a_datasets_folder_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty is a directory but not a Hugging Face datasets folder"):
        FileDataset(tmp_path / "empty")
    path = export_synthetic(tmp_path / "export", size=2)
    with pytest.raises(ConfigError, match="data.format: datasets reads a save_to_disk folder"):
        FileDataset(path, fmt="datasets")


@pytest.mark.slow
def test_a_datasets_folder_trains(tmp_path, tiny_model_dir):
    from rollplex.config import load_config
    from rollplex.pipeline.run.runner import train

    _dataset(_rows(tmp_path, 8)).save_to_disk(str(tmp_path / "ds"))
    cfg = load_config(None, [f"data.path={tmp_path / 'ds'}", f"model.path={tiny_model_dir}", "iterations=2",
                             "engines.decode=hf", "engines.train=torch", "rollout.prompts_per_iteration=2",
                             "rollout.samples_per_prompt=2", "rollout.max_new_tokens=2", "rollout.chunk_tokens=2"])
    train(cfg, tmp_path / "run", progress=False, log=lambda *a: None)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [0, 1] and all(m["phase"] == "rl" for m in metrics)
    row = json.loads((tmp_path / "run" / "rollouts" / "iter_000001.jsonl").read_text().splitlines()[0])
    assert row["prompt_id"].startswith("ds-") and len(row["images"][0]["sha256"]) == 64
