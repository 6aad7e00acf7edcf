"""Prompts for RL: a synthetic visual question task, the processor step, and a resumable sampler.

``SyntheticVisualTask`` draws small images whose pixels carry a one-word answer (a colour, a shape,
or a count), so a run needs no downloaded data and its reward is checkable by eye. Item ``i`` is a
pure function of ``(seed, i)``. ``PromptBuilder`` turns an image and a question into the
``PromptInputs`` the engines consume, through the model's own processor and chat template.
``PromptLoader`` yields batches in a seeded per-epoch order and resumes exactly from its state.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from PIL import Image, ImageDraw

from rollplex.errors import CheckpointError, ConfigError, DataError
from rollplex.tasks.rewards import get_reward

if TYPE_CHECKING:
    from rollplex.engines.models import TinyVLMSpec
    from rollplex.engines.vlm import PromptInputs

# Six colours far apart in RGB and from the light-grey background, so one pixel names its colour.
# Four far-apart hues. With orange and purple as well, a frozen random ViT left red/orange/yellow
# confusable and GRPO on the tiny model plateaued near 0.6 reward; with these four it passes 0.9.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "green": (20, 160, 20),
    "blue": (20, 40, 220),
    "yellow": (240, 210, 0),
}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = ("one", "two", "three", "four")
KINDS = ("colour", "shape", "count")
QUESTIONS = {
    "colour": "What colour is the shape? Answer with one word.",
    "shape": "What shape is in the image? Answer with one word.",
    "count": "How many shapes are in the image? Answer with one word.",
}
_ANSWERS = {"colour": tuple(COLOURS), "shape": SHAPES, "count": COUNT_WORDS}
_BACKGROUND = (225, 256)  # grey level range [lo, hi) of the background
_MARGIN = 2  # pixels between a shape and its cell's edge, so count shapes never touch


@dataclass(frozen=True)
class VisualItem:
    index: int
    kind: str
    image: Image.Image
    question: str
    answer: str


@dataclass(frozen=True)
class SyntheticVisualTask:
    """``size`` distinct items; item ``i`` asks about ``kinds[i % len(kinds)]``."""

    kinds: tuple[str, ...] = ("colour",)
    image_size: int = 56
    size: int = 512
    seed: int = 0
    reward: str = "exact_match"

    def __post_init__(self) -> None:
        kinds = tuple(self.kinds)
        object.__setattr__(self, "kinds", kinds)  # a list from YAML would make the config unhashable
        unknown = [k for k in kinds if k not in KINDS]
        if not kinds or unknown or len(set(kinds)) != len(kinds):
            raise ConfigError(f"task.kinds={list(kinds)}: give one or more distinct kinds out of {list(KINDS)}")
        if self.image_size < 28 or self.image_size % 28:
            raise ConfigError(
                f"task.image_size={self.image_size}: must be a positive multiple of 28 (patch 14 x merge 2)"
            )
        if self.size < 1:
            raise ConfigError(f"task.size={self.size}: need at least one item")
        if self.seed < 0:
            raise ConfigError(f"task.seed={self.seed}: must be >= 0")
        get_reward(self.reward)  # fail at config time, with the list of known rewards

    def __len__(self) -> int:
        return self.size

    @staticmethod
    def answers(kind: str) -> tuple[str, ...]:
        """The answer vocabulary of one kind."""
        if kind not in _ANSWERS:
            raise ConfigError(f"unknown task kind {kind!r}; known: {list(KINDS)}")
        return _ANSWERS[kind]

    @property
    def chance(self) -> float:
        """Expected reward of a uniformly random valid answer, averaged over this dataset's items."""
        per_kind = [len(range(j, self.size, len(self.kinds))) for j in range(len(self.kinds))]
        return sum(n / len(self.answers(k)) for n, k in zip(per_kind, self.kinds)) / self.size

    def kind_of(self, index: int) -> str:
        return self.kinds[index % len(self.kinds)]

    def prompt_id(self, index: int) -> str:
        return f"syn-{index:06d}"

    def item(self, index: int) -> VisualItem:
        if not 0 <= index < self.size:
            raise DataError(f"synthetic task: item {index} out of range [0, {self.size})")
        kind = self.kind_of(index)
        rng = np.random.default_rng([self.seed, index])
        image, answer = _render(kind, rng, self.image_size)
        return VisualItem(index, kind, image, QUESTIONS[kind], answer)


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, x: int, y: int, s: int, fill) -> None:
    """Axis-aligned and without anti-aliasing, so every shape pixel has exactly ``fill``."""
    x1, y1 = x + s - 1, y + s - 1
    if shape == "circle":
        draw.ellipse([x, y, x1, y1], fill=fill)
    elif shape == "square":
        draw.rectangle([x, y, x1, y1], fill=fill)
    else:
        draw.polygon([(x, y1), (x1, y1), (x + (s - 1) / 2, y)], fill=fill)


def _place(rng: np.random.Generator, origin: tuple[int, int], cell: int, lo: float, hi: float):
    """A random size in [lo, hi] x cell and a position keeping the shape inside the cell's margin."""
    s = int(rng.integers(max(4, int(lo * cell)), int(hi * cell) + 1))
    room = cell - 2 * _MARGIN - s
    x = origin[0] + _MARGIN + int(rng.integers(room + 1))
    y = origin[1] + _MARGIN + int(rng.integers(room + 1))
    return x, y, s


def _render(kind: str, rng: np.random.Generator, size: int) -> tuple[Image.Image, str]:
    grey = int(rng.integers(*_BACKGROUND))
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    draw = ImageDraw.Draw(image)
    if kind == "count":
        # One shape per distinct quadrant: shapes never overlap, so the count stays visible.
        n = int(rng.integers(1, len(COUNT_WORDS) + 1))
        half = size // 2
        for cell in rng.permutation(4)[:n]:
            origin = (int(cell % 2) * half, int(cell // 2) * half)
            x, y, s = _place(rng, origin, half, 0.35, 0.7)
            _draw_shape(draw, _pick(rng, SHAPES), x, y, s, COLOURS[_pick(rng, tuple(COLOURS))])
        return image, COUNT_WORDS[n - 1]
    colour, shape = _pick(rng, tuple(COLOURS)), _pick(rng, SHAPES)
    x, y, s = _place(rng, (0, 0), size, 0.35, 0.8)
    _draw_shape(draw, shape, x, y, s, COLOURS[colour])
    return image, colour if kind == "colour" else shape


def task_corpus(task: SyntheticVisualTask) -> tuple[str, ...]:
    """Every text the tokenizer must encode compactly: the questions, the answer words alone and
    in an "Answer: X" line, and the chat roles. Ordered, so the default model's fingerprint is stable."""
    texts = ["user", "assistant", "system"]
    for kind in task.kinds:
        texts.append(QUESTIONS[kind])
        for word in task.answers(kind):
            texts += [word, word.capitalize(), f"Answer: {word}"]
    return tuple(texts)


def default_model_spec(task: str = "synthetic") -> TinyVLMSpec:
    """The embedded tiny model, its tokenizer trained on the texts of the embedded task ``task``."""
    from rollplex.engines.models import TinyVLMSpec

    if task == "zoom":
        from rollplex.tasks.zoom import ZoomTask

        return TinyVLMSpec(corpus=ZoomTask().corpus(), added_tokens=ZoomTask.tool_calls())
    return TinyVLMSpec(corpus=task_corpus(SyntheticVisualTask()))


def to_rgb_image(image: Any, where: str) -> Image.Image:
    """A PIL image (any mode) or a uint8 HxWx3 numpy array / torch tensor, as an RGB PIL image."""
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise DataError(f"{where}: image has zero size {image.size}")
        return image if image.mode == "RGB" else image.convert("RGB")
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and torch.is_tensor(image):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise DataError(f"{where}: expected a PIL.Image or a uint8 HxWx3 array, got {type(image).__name__}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise DataError(f"{where}: expected a uint8 HxWx3 array, got {image.dtype} of shape {tuple(image.shape)}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise DataError(f"{where}: image has zero size {tuple(image.shape)}")
    return Image.fromarray(np.ascontiguousarray(image))


class PromptBuilder:
    """Chat template + processor: one user turn of images then the question, ready to answer."""

    def __init__(self, processor) -> None:
        self.processor = processor

    def build(self, prompt_id: str, images, question: str, answer: str = "", meta: dict | None = None) -> PromptInputs:
        """``images``: one image, a list of them, or None for a text-only prompt."""
        if images is None:
            images = []
        elif not isinstance(images, (list, tuple)):
            images = [images]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        return self.encode(prompt_id, content, list(images), [], answer, question, meta)

    def encode(self, prompt_id: str, content: list[dict], images: list, videos: list[list], answer: str = "",
               question: str = "", meta: dict | None = None) -> PromptInputs:
        """One user turn of ``content`` parts ({"type": "image" | "video" | "text"}, in order), with
        ``images`` and ``videos`` (each a list of frames) filling the media parts in turn. A video's
        frames go through the processor's temporal patching, so its tokens grow with the frame count."""
        from rollplex.engines.vlm import PromptInputs

        pil = [to_rgb_image(im, f"prompt {prompt_id} image {i}") for i, im in enumerate(images)]
        clips = [[to_rgb_image(fr, f"prompt {prompt_id} video {v} frame {i}") for i, fr in enumerate(frames)]
                 for v, frames in enumerate(videos)]
        messages = [{"role": "user", "content": content}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        try:
            enc = self.processor(text=[text], images=pil or None, videos=clips or None, return_tensors="pt")
        except (ValueError, TypeError) as err:  # e.g. an aspect ratio the processor cannot resize
            raise DataError(f"prompt {prompt_id}: the processor rejected its input: {err}") from err
        return PromptInputs(
            prompt_id=prompt_id,
            input_ids=enc["input_ids"][0],
            pixel_values=enc.get("pixel_values"),
            image_grid_thw=enc.get("image_grid_thw"),
            pixel_values_videos=enc.get("pixel_values_videos"),
            video_grid_thw=enc.get("video_grid_thw"),
            second_per_grid_ts=enc.get("second_per_grid_ts"),
            answer=answer,
            text=question,
            meta=dict(meta or {}),
        )


@dataclass(frozen=True)
class HeldOut:
    """``count`` items of the synthetic task that its training loader never visits: item ``i`` here
    is item ``start + i`` of the same task drawn larger (``start`` = the training ``task.size``, and
    an item is a pure function of its seed and index, so the training items stay as they are)."""

    base: SyntheticVisualTask  # the training task's settings with size start + count
    start: int

    def __len__(self) -> int:
        return self.base.size - self.start

    def prompt_id(self, index: int) -> str:
        return self.base.prompt_id(self.start + index)

    def build(self, builder: PromptBuilder, index: int) -> PromptInputs:
        return build_item(self.base, builder, self.start + index)

    def identity(self) -> dict:
        return {"held_out": asdict(self.base), "start": self.start}


def build_item(task, builder: PromptBuilder, index: int) -> PromptInputs:
    """Item ``index`` of the synthetic task or of a file dataset (``tasks.dataset.FileDataset``)."""
    if not isinstance(task, SyntheticVisualTask):
        return task.build(builder, index)
    item = task.item(index)
    # The image is a pure function of these: SyntheticVisualTask(seed=, image_size=, ...).item(index).image
    source = {"task": "synthetic", "seed": task.seed, "index": index, "kind": item.kind,
              "image_size": task.image_size, "kinds": list(task.kinds), "size": task.size}
    meta = {"index": index, "kind": item.kind, "images": [source]}
    return builder.build(task.prompt_id(index), item.image, item.question, item.answer, meta)


@dataclass(frozen=True)
class PromptRef:
    """A prompt as the driver sends it: the item's index, not its pixels. The worker that reads it
    builds its tensors (``PromptStore``), so an iteration's Dask graph stays small whatever the
    images weigh (8 prompts of 1,024 vision tokens were 147 MiB of fp32 pixels per iteration).
    ``seen_before``/``seen_again``: whether this run visited the item in an earlier epoch and will
    visit it again, which is when a cache of its frozen prefixes can hit (pipeline/run/refcache.py)."""

    index: int
    prompt_id: str
    seen_before: bool = False
    seen_again: bool = False


class BadPrompt(DataError):
    """An item whose prompt could not be built where it was used; the driver's loader skips it
    (``data.on_bad_row: skip``) and the iteration runs again with the next item in its place."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self):  # crosses from a Dask worker to the driver
        return (BadPrompt, (self.index, str(self)))


class PromptStore:
    """Builds a task's items into ``PromptInputs`` where they are used, keeping the last
    ``cache_size`` built ones (an epoch of a small task is built once), and builds the next batch's
    in the background while the current iteration runs. ``dtype`` casts pixel values once here,
    not in every vision forward; ``pin`` puts them in page-locked memory for an async copy to a GPU."""

    def __init__(self, task, builder: PromptBuilder, cache_size: int = 1024, dtype=None, pin: bool = False) -> None:
        import threading

        self.task, self.builder = task, builder
        self.cache_size, self.dtype, self.pin = cache_size, dtype, pin
        self._built: OrderedDict[int, PromptInputs] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}  # index -> Future of a background build
        self._pool = None
        # What item i holds is a pure function of the task and i: caches key on this, not on a hash
        # of the pixels (blake2b of one 1,024-token image's fp32 pixels: 19 MB per prompt per use).
        import hashlib
        import json

        identity = json.dumps(_jsonish(_identity(task)), sort_keys=True, default=str).encode()
        self.identity = hashlib.blake2b(identity, digest_size=12).hexdigest()

    def __len__(self) -> int:
        return len(self.task)

    def get(self, index: int) -> PromptInputs:
        """Item ``index``'s prompt; a DataError names the row when it cannot be built."""
        with self._lock:
            prompt = self._built.get(index)
            if prompt is not None:
                self._built.move_to_end(index)
            pending = self._pending.pop(index, None)
        if prompt is None and pending is not None:
            pending.result()  # a background build's DataError is raised here, by its user
            with self._lock:
                prompt = self._built.get(index)
        if prompt is None:
            prompt = self._build(index)
        return replace(prompt, meta=dict(prompt.meta))  # callers annotate meta; the kept copy stays clean

    def resolve(self, value: Any) -> Any:
        """A ``PromptRef``'s prompt, with the ref's epoch facts in its meta; anything else as it is."""
        if not isinstance(value, PromptRef):
            return value
        try:
            prompt = self.get(value.index)
        except DataError as exc:
            raise BadPrompt(value.index, str(exc)) from None
        prompt.meta.update(seen_before=value.seen_before, seen_again=value.seen_again)
        return prompt

    def prefetch(self, indices: Sequence[int]) -> None:
        """Build these items on a background thread (the next batch, while this one runs)."""
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollplex-prompts")
        with self._lock:
            todo = [i for i in indices if i not in self._built and i not in self._pending]
            for i in todo:
                self._pending[i] = self._pool.submit(self._build, i)

    def _build(self, index: int) -> PromptInputs:
        prompt = build_item(self.task, self.builder, index)
        prompt.meta["content"] = f"{self.identity}:{index}"
        if prompt.pixel_values is not None and (self.dtype is not None or self.pin):
            pixels = prompt.pixel_values.to(self.dtype or prompt.pixel_values.dtype)
            prompt = replace(prompt, pixel_values=pixels.pin_memory() if self.pin else pixels)
        with self._lock:
            self._built[index] = prompt
            self._built.move_to_end(index)
            while len(self._built) > max(self.cache_size, 0):
                self._built.popitem(last=False)
        return prompt

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class PromptLoader:
    """Seeded, resumable sampler over a task's items.

    Epoch ``e`` visits the items in the order ``permutation(seed, e)``, ``prompts_per_batch`` at a
    time. A tail shorter than a batch is skipped, so no batch repeats a prompt. The state is just
    (epoch, position): a loader restored from ``state_dict()`` yields exactly the batches the
    original would have yielded next.
    """

    task: Any  # SyntheticVisualTask or tasks.dataset.FileDataset
    builder: PromptBuilder
    prompts_per_batch: int
    seed: int = 0
    cache_size: int = 1024  # processed prompts kept; 0 turns the cache off
    epoch: int = 0
    position: int = 0
    log: Any = None  # where a skipped row is reported (print when None)
    skipped: list = field(default_factory=list)  # items that failed to build (on_bad_row: skip)
    _store: PromptStore | None = field(default=None, init=False, repr=False)
    _tokens: dict = field(default_factory=dict, init=False, repr=False)
    _order: tuple[int, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.prompts_per_batch <= len(self.task):
            where = (f"the {len(self.task)} usable rows of {self.task.path}" if hasattr(self.task, "path")
                     else f"the task size {len(self.task)}")
            raise ConfigError(f"prompts_per_batch={self.prompts_per_batch} (rollout.prompts_per_iteration): "
                              f"must be between 1 and {where}")
        if self.seed < 0:
            raise ConfigError(f"loader seed={self.seed}: must be >= 0")
        self._store = PromptStore(self.task, self.builder, self.cache_size)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.task) // self.prompts_per_batch

    def order(self, epoch: int) -> np.ndarray:
        """The item indices of one epoch, in visiting order."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.task)))
        return self._order[1]

    def next_indices(self) -> list[int]:
        if self.position + self.prompts_per_batch > len(self.task):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position
        self.position += self.prompts_per_batch
        return [int(i) for i in self.order(self.epoch)[start : self.position]]

    def next_batch(self) -> list[PromptInputs]:
        """The next batch, built here. An item that fails to build is a bad row: re-raised under
        ``on_bad_row: reject``; under ``skip`` reported once, remembered in the state, and replaced by
        the next item of the order (so a batch stays full and a resumed run skips exactly the same items)."""
        while True:
            before = self.state_dict()
            refs = self.next_refs()
            try:
                return [self._store.resolve(ref) for ref in refs]
            except BadPrompt as exc:
                self.load_state_dict(before)
                self.skip(exc)

    def next_refs(self, batches_left: int | None = None) -> list[PromptRef]:
        """The next batch as ``PromptRef``s, leaving out the items known to be bad. ``batches_left``:
        how many batches the run will take after this one (None: unknown, taken as many), which says
        whether it comes back to this batch's items in a later epoch."""
        out: list[PromptRef] = []
        while len(out) < self.prompts_per_batch:
            need = self.prompts_per_batch - len(out)
            if self.position + need > len(self.task):
                self.epoch, self.position = self.epoch + 1, 0
            index = int(self.order(self.epoch)[self.position])
            self.position += 1
            if index in self.skipped:
                continue
            out.append(PromptRef(index, self.task.prompt_id(index), seen_before=self.epoch > 0))
        # A later epoch starts once this one's full batches are taken.
        later = (len(self.task) - self.position) // self.prompts_per_batch
        again = batches_left is None or batches_left > later
        return [replace(r, seen_again=again) for r in out]

    def tokens(self, index: int) -> int:
        """Item ``index``'s prompt length in tokens, built here once (data-parallel runs balance
        their ranks by it before the workers build the prompts)."""
        if index not in self._tokens:
            self._tokens[index] = self._store.get(index).num_tokens
        return self._tokens[index]

    def skip(self, exc: DataError) -> None:
        """Leave item ``exc.index`` out of this run (``on_bad_row: skip``), or re-raise (``reject``)."""
        if getattr(self.task, "on_bad_row", "reject") != "skip":
            raise DataError(str(exc)) from None
        self.skipped.append(exc.index)
        if len(self.skipped) >= len(self.task) - self.prompts_per_batch + 1:
            raise DataError(f"{len(self.skipped)} of {len(self.task)} rows failed; too few left "
                            f"for a batch of {self.prompts_per_batch}. Last: {exc}") from None
        (self.log or print)(f"data: skipped a bad row: {exc}")

    def metrics(self) -> dict:
        """Rows left out so far: at load time (``bad_rows``) and while building prompts."""
        if not hasattr(self.task, "bad_rows"):
            return {}
        return {"data_skipped_rows": len(self.task.bad_rows) + len(self.skipped)}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "task": _identity(self.task),
                "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        saved = {"seed": state.get("seed"), "task": state.get("task")}
        ours = {"seed": self.seed, "task": _jsonish(_identity(self.task))}
        saved["task"] = _jsonish(saved["task"])
        diff = [k for k in ours if saved[k] != ours[k]]
        if diff:
            raise CheckpointError(
                f"prompt loader state: {diff} differ from this run (saved {[saved[k] for k in diff]}, "
                f"now {[ours[k] for k in diff]}); resume with the same task and loader seed"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.skipped = [int(i) for i in state.get("skipped", [])]


def _identity(task) -> dict:
    return asdict(task) if isinstance(task, SyntheticVisualTask) else task.identity()


def _jsonish(value):
    """Tuples and lists compare equal after a JSON/YAML round trip of a state dict."""
    if isinstance(value, dict):
        return {k: _jsonish(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonish(v) for v in value]
    return value


def format_warmup_batch(
    task: SyntheticVisualTask, builder: PromptBuilder, rng: np.random.Generator, n: int
) -> list[tuple[PromptInputs, str]]:
    """``n`` supervised (prompt, target) pairs that teach the answer *format*, not the answer.

    The target is a uniformly random word from the item's answer vocabulary, drawn independently of
    the true answer. Fine-tuning on it teaches the model to reply with exactly one valid answer word
    and then end its turn (append the end-of-turn token, see ``warmup_target_ids``), while its
    expected reward stays at ``task.chance``: any gain RL shows afterwards comes from the images.
    """
    indices = rng.choice(len(task), size=n, replace=n > len(task))
    pairs = []
    for index in indices:
        try:
            prompt = build_item(task, builder, int(index))
        except DataError:
            if getattr(task, "on_bad_row", "reject") != "skip":
                raise
            continue  # the loader reports and counts it when RL reaches it
        pairs.append((prompt, _pick(rng, task.answers(prompt.meta["kind"]))))
    return pairs


def warmup_target_ids(tokenizer, target: str) -> list[int]:
    """Token ids of a warm-up target: the answer word, then the end-of-turn token (``<|im_end|>``)."""
    return list(tokenizer.encode(target, add_special_tokens=False)) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
