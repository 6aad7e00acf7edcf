"""The synthetic visual task, prompt building, the resumable loader and format warm-up (CPU, no vLLM)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex.errors import CheckpointError, ConfigError, DataError
from rollplex.tasks.data import (
    COLOURS,
    KINDS,
    PromptBuilder,
    PromptLoader,
    SyntheticVisualTask,
    default_model_spec,
    format_warmup_batch,
    task_corpus,
    warmup_target_ids,
)
from rollplex.tasks.rewards import exact_match, get_reward

ALL = SyntheticVisualTask(kinds=KINDS)


@pytest.fixture(scope="module")
def builder(tiny_model_dir):
    from transformers import AutoProcessor

    return PromptBuilder(AutoProcessor.from_pretrained(tiny_model_dir))


def foreground(image: Image.Image) -> np.ndarray:
    """[H, W] mask of pixels that differ from the background (shapes keep off the corner)."""
    px = np.asarray(image)
    return np.any(px != px[0, 0], axis=-1)


def components(mask: np.ndarray) -> int:
    """Number of 4-connected regions in a boolean mask."""
    seen = np.zeros_like(mask)
    count = 0
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        count += 1
        stack = [start]
        seen[start] = True
        while stack:
            y, x = stack.pop()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


# --- the task -------------------------------------------------------------------------------------


def test_items_are_a_pure_function_of_seed_and_index():
    a, b = SyntheticVisualTask(kinds=KINDS), SyntheticVisualTask(kinds=KINDS)
    for i in (0, 1, 2, 77, 511):
        x, y = a.item(i), b.item(i)
        assert (x.answer, x.question, x.kind) == (y.answer, y.question, y.kind)
        assert x.image.tobytes() == y.image.tobytes()
        assert x.image.size == (56, 56) and x.image.mode == "RGB"
    other = SyntheticVisualTask(kinds=KINDS, seed=1)
    assert any(other.item(i).image.tobytes() != a.item(i).image.tobytes() for i in range(5))


@pytest.mark.parametrize("kwargs, field", [
    ({"kinds": ("color",)}, "task.kinds"), ({"kinds": ()}, "task.kinds"), ({"kinds": ("shape", "shape")}, "task.kinds"),
    ({"image_size": 50}, "task.image_size"), ({"size": 0}, "task.size"), ({"reward": "nope"}, "unknown reward"),
])
def test_bad_task_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SyntheticVisualTask(**kwargs)


def test_kinds_alternate_and_answers_cover_the_vocabulary():
    items = [ALL.item(i) for i in range(300)]
    assert [it.kind for it in items[:6]] == list(KINDS) * 2
    for kind in KINDS:
        seen = Counter(it.answer for it in items if it.kind == kind)
        assert set(seen) == set(ALL.answers(kind)), kind


def test_chance_is_the_mean_over_items_of_one_over_vocabulary():
    colours = len(SyntheticVisualTask.answers("colour"))
    assert SyntheticVisualTask().chance == pytest.approx(1 / colours)
    per_kind = [len(range(j, ALL.size, 3)) for j in range(3)]  # items cycle colour, shape, count
    assert ALL.chance == pytest.approx(sum(n / a for n, a in zip(per_kind, (colours, 3, 4))) / ALL.size)
    odd = SyntheticVisualTask(kinds=("colour", "shape"), size=3)  # two colour items, one shape item
    assert odd.chance == pytest.approx((2 / colours + 1 / 3) / 3)


def test_colour_answer_is_the_colour_of_every_shape_pixel():
    task = SyntheticVisualTask(kinds=("colour",), image_size=84)
    for i in range(60):
        item = task.item(i)
        px = np.asarray(item.image)[foreground(item.image)]
        assert len(px) >= 50, i
        assert (px == COLOURS[item.answer]).all(), (i, item.answer)


def test_shape_answer_follows_from_how_full_its_bounding_box_is():
    """square fills its box, a circle about pi/4 of it, a triangle about half."""
    task = SyntheticVisualTask(kinds=("shape",))
    for i in range(60):
        item = task.item(i)
        ys, xs = np.nonzero(foreground(item.image))
        fill = len(ys) / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
        guess = "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"
        assert guess == item.answer, (i, fill)


def test_count_answer_is_the_number_of_separate_shapes():
    task = SyntheticVisualTask(kinds=("count",))
    words = task.answers("count")
    for i in range(60):
        item = task.item(i)
        assert words[components(foreground(item.image)) - 1] == item.answer, i


def test_corpus_covers_every_question_and_answer_and_default_spec_is_stable():
    corpus = task_corpus(ALL)
    for kind in KINDS:
        assert ALL.item(KINDS.index(kind)).question in corpus
        assert set(ALL.answers(kind)) <= set(corpus)
    assert default_model_spec() == default_model_spec()
    assert default_model_spec().fingerprint() == default_model_spec().fingerprint()
    assert default_model_spec().corpus == task_corpus(SyntheticVisualTask())


def test_default_reward_is_exact_match():
    assert get_reward(SyntheticVisualTask().reward) is exact_match


# --- prompt building ------------------------------------------------------------------------------


def test_prompt_has_one_pad_token_per_merged_vision_token(builder):
    tok = builder.processor.tokenizer
    item = ALL.item(0)
    p = builder.build("syn-000000", item.image, item.question, item.answer, {"kind": item.kind})
    assert p.input_ids.ndim == 1 and p.input_ids.dtype == torch.long
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    merged = int(p.image_grid_thw.prod()) // 4  # spatial merge 2x2
    assert int((p.input_ids == pad).sum()) == merged == 4
    assert p.pixel_values.shape[0] == int(p.image_grid_thw.prod())
    text = tok.decode(p.input_ids)
    assert text.endswith("<|im_start|>assistant\n") and item.question in text
    assert (p.answer, p.text, p.meta) == (item.answer, item.question, {"kind": item.kind})


def test_arrays_tensors_and_other_modes_give_the_same_prompt(builder):
    image = ALL.item(3).image
    ref = builder.build("p", image, "q?")
    arr = np.asarray(image)
    for variant in (arr, torch.from_numpy(arr.copy()), [image], image.convert("RGBA")):
        got = builder.build("p", variant, "q?")
        assert torch.equal(got.input_ids, ref.input_ids)
        assert torch.equal(got.pixel_values, ref.pixel_values)
    grey = builder.build("p", image.convert("L"), "q?")
    assert grey.pixel_values.shape == ref.pixel_values.shape


@pytest.mark.parametrize("bad, why", [
    ("not an image", "got str"),
    (np.zeros((56, 56, 3), np.float32), "uint8 HxWx3"),
    (np.zeros((56, 56, 4), np.uint8), "uint8 HxWx3"),
    (np.zeros((56, 56), np.uint8), "uint8 HxWx3"),
    (np.zeros((0, 56, 3), np.uint8), "zero size"),
    (Image.new("RGB", (0, 0)), "zero size"),
    (np.zeros((1, 400, 3), np.uint8), "processor rejected"),  # aspect ratio over 200
])
def test_bad_images_raise_data_errors_naming_the_prompt(builder, bad, why):
    with pytest.raises(DataError, match=f"prompt syn-bad.*{why}"):
        builder.build("syn-bad", bad, "q?")


def test_second_bad_image_is_named_by_position(builder):
    with pytest.raises(DataError, match="prompt x image 1"):
        builder.build("x", [ALL.item(0).image, None], "q?")


# --- the loader -----------------------------------------------------------------------------------


def ids(batch):
    return [p.prompt_id for p in batch]


def test_resumed_loader_yields_the_batch_an_uninterrupted_one_would(builder):
    task = SyntheticVisualTask(size=10)
    run = PromptLoader(task, builder, prompts_per_batch=4, seed=3)
    for _ in range(3):
        run.next_batch()
    state = run.state_dict()
    resumed = PromptLoader(task, builder, prompts_per_batch=4, seed=3)
    resumed.load_state_dict(state)
    a, b = run.next_batch(), resumed.next_batch()
    assert ids(a) == ids(b)
    assert all(torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(a, b))
    assert (run.epoch, run.position) == (resumed.epoch, resumed.position) == (1, 8)


def test_each_epoch_is_a_fresh_shuffle_without_repeats(builder):
    task = SyntheticVisualTask(size=10)
    loader = PromptLoader(task, builder, prompts_per_batch=3, seed=0, cache_size=4)
    epochs = [sum((loader.next_indices() for _ in range(loader.batches_per_epoch)), []) for _ in range(3)]
    assert all(len(set(e)) == 9 for e in epochs)  # one short tail of 1 skipped per epoch
    assert epochs[0] != epochs[1]
    again = PromptLoader(task, builder, prompts_per_batch=3, seed=0)
    assert again.next_indices() == epochs[0][:3]
    batch = again.next_batch()
    assert ids(batch) == [f"syn-{i:06d}" for i in epochs[0][3:6]]
    batch[0].meta["note"] = 1  # callers' annotations must not leak into the cache
    assert "note" not in again._store.get(epochs[0][3]).meta


def test_loader_refuses_foreign_state_and_bad_batch_size(builder):
    loader = PromptLoader(SyntheticVisualTask(size=10), builder, prompts_per_batch=2, seed=0)
    other = PromptLoader(SyntheticVisualTask(size=12), builder, prompts_per_batch=2, seed=0)
    with pytest.raises(CheckpointError, match="task"):
        loader.load_state_dict(other.state_dict())
    with pytest.raises(ConfigError, match="prompts_per_batch=11"):
        PromptLoader(SyntheticVisualTask(size=10), builder, prompts_per_batch=11)


# --- format warm-up -------------------------------------------------------------------------------


def test_warmup_targets_are_valid_answers_independent_of_the_truth(builder):
    n = 240
    pairs = format_warmup_batch(ALL, builder, np.random.default_rng(0), n)
    assert len(pairs) == n and len({p.prompt_id for p, _ in pairs}) == n
    for prompt, target in pairs:
        assert target in ALL.answers(prompt.meta["kind"])
    # Reward of the warm-up targets is at chance: the targets carry no information about the image.
    match = np.mean([exact_match(target, prompt.answer) for prompt, target in pairs])
    assert abs(match - ALL.chance) < 4 * np.sqrt(ALL.chance * (1 - ALL.chance) / n)
    # And every answer word is used as a target, not just the true ones.
    colour_targets = Counter(t for p, t in pairs if p.meta["kind"] == "colour")
    assert set(colour_targets) == set(COLOURS)


def test_warmup_target_ids_end_the_turn(builder):
    tok = builder.processor.tokenizer
    ids_ = warmup_target_ids(tok, "red")
    assert ids_[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids_[:-1]) == "red"
