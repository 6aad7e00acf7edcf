"""Prompts from jsonl or parquet files or a Hugging Face ``datasets`` folder (``save_to_disk``), in
the column conventions of verl/EasyR1 datasets.

A row holds
- a prompt: ``prompt`` or ``problem`` (``data.prompt_key``), a string or verl's list of chat
  messages (the last user message is the prompt);
- zero or more images: ``images``, each a path (relative to the data file's directory), raw bytes,
  a ``{"bytes": ..., "path": ...}`` struct as HF datasets store images in parquet, or (in jsonl) a
  ``data:image/png;base64,...`` URI;
- optional videos: ``videos``, each a list of frames (as images) or a directory of frame images;
- an answer: ``answer``; a dotted key such as ``reward_model.ground_truth`` reads verl's nesting.
``<image>``/``<video>`` in the prompt text place the media, as EasyR1 does; without them the media
come first.

Every row is checked when the file is opened: text present, answer present, each image file
present and its header decodable. A row that fails is reported with the file and its line (jsonl)
or row (parquet): ``on_bad_row: reject`` raises one DataError naming it (exit 2); ``skip`` leaves it
out, logs it and counts it (``data_skipped_rows`` in metrics). A row that fails only later, in the
processor or over the prompt-length cap, follows the same switch (``PromptLoader``).
"""
from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from rollplex.errors import ConfigError, DataError
from rollplex.tasks.rewards import get_reward

if TYPE_CHECKING:
    from rollplex.tasks.data import PromptBuilder
    from rollplex.engines.vlm import PromptInputs

FORMATS = ("jsonl", "parquet", "datasets")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
_VIDEO_FILE_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")
_PLACEHOLDER = re.compile(r"(<image>|<video>)")
_MISSING = object()
PROBE_ROWS = 32  # rows built up front to size prompts (tokens, vision tokens) for the compiler and engines


@dataclass(frozen=True)
class BadRow:
    where: str  # "data/train.jsonl line 17" / "data/train.parquet row 16"
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass(frozen=True)
class FileRow:
    where: str
    text: str
    answer: str
    images: tuple  # per image, a resolved file path (str) or encoded bytes
    videos: tuple  # per video, a tuple of frames as above


def _get(row: dict, key: str) -> Any:
    """``row[key]``, where a dotted key walks nested dicts; _MISSING when any step is absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _prompt_text(value: Any) -> str:
    """A prompt string, or the last user message of a verl chat-message list."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
        raise ValueError("a chat-message list needs a user message whose content is a string")
    raise ValueError(f"expected a string or a list of chat messages, got {type(value).__name__}")


def _as_list(value: Any) -> list:
    if value is None or value is _MISSING:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class FileDataset:
    """The valid rows of one jsonl/parquet file. Item ``i`` is the i-th valid row, in file order."""

    def __init__(self, path: str | Path, fmt: str = "auto", prompt_key: str | None = None,
                 image_key: str = "images", video_key: str = "videos", answer_key: str = "answer",
                 on_bad_row: str = "reject", reward: str = "exact_match", max_prompt_tokens: int = 0,
                 split: str = "train") -> None:
        self.path = Path(path)
        self.split = split
        if self.path.is_dir():
            self.path, fmt = _datasets_folder(self.path, split, fmt), "datasets"
        elif not self.path.is_file():
            raise DataError(f"data.path: {self.path} does not exist (or is not a file)")
        elif fmt == "datasets":
            raise ConfigError(f"data.format: datasets reads a save_to_disk folder, but data.path {self.path} is a file")
        if fmt == "auto":
            fmt = _SUFFIXES.get(self.path.suffix.lower(), "")
            if not fmt:
                raise ConfigError(f"data.format: cannot tell the format of {self.path} from its suffix; "
                                  f"set data.format to one of {', '.join(FORMATS)}")
        if fmt not in FORMATS:
            raise ConfigError(f"data.format: {fmt!r} is not one of auto, {', '.join(FORMATS)}")
        if on_bad_row not in ("skip", "reject"):
            raise ConfigError(f"data.on_bad_row: {on_bad_row!r} is not one of skip, reject")
        self.format = fmt
        self.prompt_keys = (prompt_key,) if prompt_key else ("prompt", "problem")
        self.image_key, self.video_key, self.answer_key = image_key, video_key, answer_key
        self.on_bad_row = on_bad_row
        self.reward = reward
        self.max_prompt_tokens = max_prompt_tokens
        get_reward(reward)  # fail at config time, with the list of known rewards
        # Relative image paths: beside a file, inside a datasets folder.
        self.root = self.path.resolve() if fmt == "datasets" else self.path.resolve().parent
        self.rows: list[FileRow] = []
        self.bad_rows: list[BadRow] = []
        self.total_rows = 0
        for where, raw in self._read():
            self.total_rows += 1
            try:
                self.rows.append(self._check(where, raw))
            except ValueError as exc:
                self._bad(BadRow(where, str(exc)))
        if not self.rows:
            raise DataError(f"data.path: {self.path} holds no usable rows ({self.total_rows} rows read, "
                            f"{len(self.bad_rows)} bad)" + (f"; first: {self.bad_rows[0]}" if self.bad_rows else ""))
        self._answers = tuple(sorted({r.answer for r in self.rows}))

    # ----------------------------------------------------------------------------------------------
    def _bad(self, bad: BadRow) -> None:
        if self.on_bad_row == "reject":
            raise DataError(f"{bad} (set data.on_bad_row: skip to leave such rows out)")
        self.bad_rows.append(bad)

    def _read(self):
        if self.format == "jsonl":
            try:
                lines = self.path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise DataError(f"data.path: {self.path} cannot be read: {exc}") from None
            # A malformed line is yielded as its error, so that it becomes a bad row like any other.
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{self.path} line {number}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield where, ValueError(f"not valid JSON: {exc.msg} at column {exc.colno}")
                    continue
                yield where, row
            return
        if self.format == "datasets":
            for i, row in enumerate(_datasets_rows(self.path)):
                yield f"{self.path} row {i}", row
            return
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(self.path).to_pylist()
        except ImportError:
            raise DataError("data.format: parquet needs pyarrow (pip install pyarrow)") from None
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
            raise DataError(f"data.path: {self.path} cannot be read as parquet: {exc}") from None
        for i, row in enumerate(rows):
            yield f"{self.path} row {i}", row

    def _check(self, where: str, row: Any) -> FileRow:
        """The row's fields, resolved and checked; ValueError names what is wrong with it."""
        if isinstance(row, ValueError):
            raise row
        if not isinstance(row, dict):
            raise ValueError(f"expected an object of columns, got {type(row).__name__}")
        # Parquet gives every row every column, so an absent prompt reads as None there.
        key = next((k for k in self.prompt_keys if _get(row, k) not in (_MISSING, None)), None)
        if key is None:
            raise ValueError(f"no prompt (column {' or '.join(map(repr, self.prompt_keys))})")
        text = _prompt_text(_get(row, key))
        if not text.strip():
            raise ValueError(f"empty prompt (column {key!r})")
        answer = _get(row, self.answer_key)
        if answer is _MISSING or answer is None or not str(answer).strip():
            raise ValueError(f"no answer (column {self.answer_key!r})")
        images = tuple(self._image(v, f"image {i}") for i, v in enumerate(_as_list(_get(row, self.image_key))))
        videos = tuple(self._video(v, f"video {i}") for i, v in enumerate(_as_list(_get(row, self.video_key))))
        for tag, media in (("<image>", images), ("<video>", videos)):
            n = text.count(tag)
            if n and n != len(media):
                raise ValueError(f"the prompt has {n} {tag} placeholder(s) but the row has {len(media)} "
                                 f"{tag[1:-1]}(s)")
        return FileRow(where, text, str(answer).strip(), images, videos)

    def _image(self, value: Any, what: str):
        if isinstance(value, dict):  # HF datasets' Image feature: {"bytes": ..., "path": ...}
            value = value.get("bytes") or value.get("path")
        if isinstance(value, str) and value.startswith("data:image/") and ";base64," in value:
            import base64
            import binascii

            try:  # a data URI: how jsonl carries image bytes
                value = base64.b64decode(value.split(";base64,", 1)[1], validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"{what}: a data URI whose base64 does not decode") from None
        if isinstance(value, (bytes, bytearray)):
            if not value:
                raise ValueError(f"{what}: empty bytes")
            ref: Any = bytes(value)
            source: Any = io.BytesIO(ref)
            shown = f"{what} ({len(ref)} bytes)"
        elif isinstance(value, str) and value:
            path = Path(value) if Path(value).is_absolute() else self.root / value
            if not path.is_file():
                raise ValueError(f"{what}: {path} does not exist")
            ref = source = str(path)
            shown = f"{what} ({path})"
        else:
            raise ValueError(f"{what}: expected a path, bytes or {{bytes, path}}, got {type(value).__name__}")
        try:
            with Image.open(source) as im:
                im.verify()  # the header and structure; cheap, no full decode
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for a damaged file
            raise ValueError(f"{shown} is not a readable image: {exc}") from None
        return ref

    def _video(self, value: Any, what: str) -> tuple:
        if isinstance(value, str):
            path = Path(value) if Path(value).is_absolute() else self.root / value
            if path.suffix.lower() in _VIDEO_FILE_SUFFIXES:
                raise ValueError(f"{what}: {path} is a video file; give its frames instead (a list of "
                                 "image paths, or a directory of frame images): video decoding is not built in")
            if not path.is_dir():
                raise ValueError(f"{what}: {path} is not a directory of frames")
            value = sorted(str(p) for p in path.iterdir() if p.suffix.lower() in _FRAME_SUFFIXES)
            if not value:
                raise ValueError(f"{what}: {path} holds no frame images ({', '.join(_FRAME_SUFFIXES)})")
        frames = _as_list(value)
        if not frames:
            raise ValueError(f"{what}: no frames")
        return tuple(self._image(v, f"{what} frame {i}") for i, v in enumerate(frames))

    # ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    @property
    def has_video(self) -> bool:
        return any(r.videos for r in self.rows)

    @property
    def chance(self) -> float:
        """Expected reward of an answer drawn uniformly from the dataset's distinct answers."""
        return 1.0 / len(self._answers)

    def answers(self, kind: str = "file") -> tuple[str, ...]:
        """The distinct answers of the valid rows: the warm-up's target vocabulary."""
        return self._answers

    def prompt_id(self, index: int) -> str:
        return f"{self.path.stem}-{index:06d}"

    def __reduce__(self):
        """Pickled as its recipe, not its rows: a worker that builds prompts re-reads the file, so the
        rows' image bytes never travel (``tasks.data.PromptStore``). The same file gives the same
        valid rows in the same order, hence the same item indices."""
        key = self.prompt_keys[0] if len(self.prompt_keys) == 1 else None
        return (FileDataset, (str(self.path.resolve()), self.format, key, self.image_key, self.video_key,
                              self.answer_key, self.on_bad_row, self.reward, self.max_prompt_tokens, self.split))

    def identity(self) -> dict:
        """What a resumed run must match: the same file (by name, size and rows) and the same keys."""
        size = (sum(p.stat().st_size for p in _datasets_files(self.path)) if self.format == "datasets"
                else self.path.stat().st_size)
        return {"path": str(self.path.resolve()), "bytes": size, "rows": self.total_rows,
                "valid": len(self.rows), "keys": [list(self.prompt_keys), self.image_key, self.video_key,
                                                  self.answer_key]}

    def build(self, builder: PromptBuilder, index: int) -> PromptInputs:
        """The processed prompt of valid row ``index``; DataError names the row if it fails here."""
        row = self.rows[index]
        try:
            images = [_load(ref) for ref in row.images]
            videos = [[_load(ref) for ref in frames] for frames in row.videos]
        except Exception as exc:  # noqa: BLE001 - a file changed or broke after the check
            raise DataError(f"{row.where}: an image cannot be decoded: {exc}") from None
        parts: list[dict] = []
        if _PLACEHOLDER.search(row.text):
            for piece in _PLACEHOLDER.split(row.text):
                if piece in ("<image>", "<video>"):
                    parts.append({"type": piece[1:-1]})
                elif piece:
                    parts.append({"type": "text", "text": piece})
        else:
            parts = [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
            parts.append({"type": "text", "text": row.text})
        meta = {"index": index, "kind": "file", "row": row.where, "images": [_media_ref(r) for r in row.images]}
        if row.videos:
            meta["videos"] = [[_media_ref(r) for r in frames] for frames in row.videos]
        try:
            prompt = builder.encode(self.prompt_id(index), parts, images, videos, row.answer, row.text, meta)
        except DataError as exc:
            raise DataError(f"{row.where}: {exc}") from None
        if self.max_prompt_tokens and prompt.num_tokens > self.max_prompt_tokens:
            raise DataError(f"{row.where}: the prompt has {prompt.num_tokens} tokens, more than "
                            f"data.max_prompt_tokens={self.max_prompt_tokens}")
        return prompt


def _datasets_folder(path: Path, split: str, fmt: str) -> Path:
    """The ``save_to_disk`` folder of one split: ``path`` itself (a Dataset) or ``path/split`` (a DatasetDict)."""
    if fmt not in ("auto", "datasets"):
        raise ConfigError(f"data.format: {fmt} reads a file, but data.path {path} is a directory")
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"data.path: {path}/dataset_dict.json cannot be read: {exc}") from None
        if split not in splits:
            raise ConfigError(f"data.split: {split!r} is not a split of {path} (it has {', '.join(map(str, splits))})")
        path = path / split
    if not (path / "state.json").is_file():
        raise DataError(f"data.path: {path} is a directory but not a Hugging Face datasets folder "
                        "(save_to_disk writes state.json and data-*.arrow)")
    return path


def _datasets_files(folder: Path) -> list[Path]:
    """The folder's Arrow files, in the order its state.json lists them (the dataset's row order)."""
    try:
        files = [folder / f["filename"] for f in json.loads((folder / "state.json").read_text(encoding="utf-8"))
                 ["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"data.path: {folder}/state.json cannot be read: {exc}") from None
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise DataError(f"data.path: {folder}/state.json lists {missing[0]}, which does not exist")
    return files


def _datasets_rows(folder: Path):
    """A datasets folder's rows, read with pyarrow: its Arrow files are IPC streams, and the Image
    feature is a {bytes, path} struct, as in parquet (the `datasets` package itself is not needed)."""
    import pyarrow as pa

    for p in _datasets_files(folder):
        try:
            with pa.memory_map(str(p)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(f"data.path: {p} cannot be read as an Arrow stream: {exc}") from None
        yield from table.to_pylist()


def _media_ref(ref) -> dict:
    """What a rollout records of one image, so it can be found again: its file, or its bytes' sha256."""
    if isinstance(ref, bytes):
        import hashlib

        return {"sha256": hashlib.sha256(ref).hexdigest()}
    return {"path": ref}


def _load(ref) -> Image.Image:
    with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
        return im.convert("RGB")


# --------------------------------------------------------------------------------------------------
def make_task(cfg):
    """The run's prompt source: the file in ``data.path``, else the embedded synthetic task."""
    from rollplex.tasks.data import SyntheticVisualTask

    d = cfg.data
    if d.path:
        return FileDataset(d.path, d.format, d.prompt_key, d.image_key, d.video_key, d.answer_key,
                           d.on_bad_row, cfg.task.reward, d.max_prompt_tokens, d.split)
    if cfg.task.name == "zoom":
        from rollplex.tasks.zoom import ZoomTask

        return ZoomTask(image_size=cfg.task.image_size, size=cfg.task.size, seed=cfg.seed, reward=cfg.task.reward)
    return SyntheticVisualTask(kinds=tuple(cfg.task.kinds), image_size=cfg.task.image_size, size=cfg.task.size,
                               seed=cfg.seed, reward=cfg.task.reward)


def make_eval_task(cfg, task, max_prompt_tokens: int):
    """The validation prompts (``eval.*``): ``data.val_path`` read like ``data.path``, its prompts held
    to the training prompts' ``max_prompt_tokens`` (they size the decode engine), else the embedded
    task's held-out items."""
    from dataclasses import replace

    from rollplex.tasks.data import HeldOut

    d = cfg.data
    if not d.val_path:
        return HeldOut(replace(task, size=task.size + cfg.eval.prompts), task.size)
    try:
        return FileDataset(d.val_path, d.format, d.prompt_key, d.image_key, d.video_key, d.answer_key,
                           d.on_bad_row, cfg.task.reward, max_prompt_tokens, d.split)
    except (ConfigError, DataError) as exc:  # its messages name the field they read from
        raise type(exc)(str(exc).replace("data.path", "data.val_path")) from None


def probe_shape(task, builder: PromptBuilder, vision_token_ids: tuple[int, ...]) -> tuple[int, int]:
    """(prompt tokens, vision tokens) to size the iteration graph and the decode engine: item 0 of the
    synthetic task (all its items have one shape), the longest of the first PROBE_ROWS rows of a file.
    A file's later row longer than that is a bad row, so the engines never see a longer prompt."""
    from rollplex.tasks.data import build_item

    if not isinstance(task, FileDataset):
        prompts = [build_item(task, builder, 0)]
    else:
        prompts = []
        for i in range(min(len(task), PROBE_ROWS)):
            try:
                prompts.append(task.build(builder, i))
            except DataError:
                if task.on_bad_row == "reject":
                    raise
        if not prompts:
            raise DataError(f"data.path: none of the first {PROBE_ROWS} rows of {task.path} could be processed")
        if not task.max_prompt_tokens:
            task.max_prompt_tokens = max(p.num_tokens for p in prompts)
    tokens = max(p.num_tokens for p in prompts)
    if isinstance(task, FileDataset):
        tokens = task.max_prompt_tokens  # the cap every later row is held to
    vision = max(sum(int((p.input_ids == t).sum()) for t in vision_token_ids) for p in prompts)
    return tokens, vision


# --------------------------------------------------------------------------------------------------
def export_synthetic(out_dir: str | Path, size: int = 64, kinds: tuple[str, ...] = ("colour",), image_size: int = 112,
                     seed: int = 0, fmt: str = "jsonl", video_frames: int = 0) -> Path:
    """Write the embedded synthetic task as a dataset in the conventions above, and return its file.

    jsonl: ``train.jsonl`` with PNG files under ``images/`` (paths relative to the file). parquet:
    ``train.parquet`` with each image stored as ``{"bytes", "path"}``, as HF datasets store them.
    ``video_frames > 0``: each row holds one video of that many frames (the item's image in every
    frame) instead of an image, so its prompt carries the frames' temporal patches.
    """
    from rollplex.fsio import atomic_write_bytes, atomic_write_text
    from rollplex.tasks.data import SyntheticVisualTask

    if fmt not in ("jsonl", "parquet"):
        raise ConfigError(f"--format: {fmt!r} is not one of jsonl, parquet")
    if video_frames < 0:
        raise ConfigError(f"--video-frames: {video_frames} must be >= 0")
    task = SyntheticVisualTask(kinds=tuple(kinds), image_size=image_size, size=size, seed=seed)
    out = Path(out_dir)
    rows = []
    for i in range(size):
        item = task.item(i)
        buf = io.BytesIO()
        item.image.save(buf, format="PNG")
        png = buf.getvalue()
        name = f"images/{i:06d}.png"
        tag = "<video>" if video_frames else "<image>"
        row: dict[str, Any] = {"prompt": tag + item.question, "answer": item.answer, "kind": item.kind}
        if fmt == "jsonl":
            atomic_write_bytes(out / name, png)
            media: Any = name
        else:
            media = {"bytes": png, "path": name}
        if video_frames:
            row["videos"] = [[media] * video_frames]
        else:
            row["images"] = [media]
        rows.append(row)
    if fmt == "jsonl":
        target = out / "train.jsonl"
        atomic_write_text(target, "".join(json.dumps(r) + "\n" for r in rows))
        return target
    import pyarrow as pa
    import pyarrow.parquet as pq

    target = out / "train.parquet"
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    atomic_write_bytes(target, sink.getvalue().to_pybytes())
    return target
