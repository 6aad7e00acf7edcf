"""The embedded multi-turn visual task: a colour too fine to see, and a ``zoom(region)`` tool.

Each item is a 4x-resolution scene (448 px for the 112 px view): a light-grey background and, in one
quadrant, a square of a checkerboard of 2-pixel cells in two colours whose mean is the grey 125 in
every channel. The answer names the pair (``red`` is red and cyan, ``green`` green and magenta,
``blue`` blue and yellow, ``black`` black and white). The model is shown the scene at 112 px, the
mean of each 4x4 block: every block holds two cells of each colour, so the square is the same plain
grey whatever the answer, and no single-turn policy can beat chance (0.25). The question says
which quarter the square is in ("It is in quarter 2 (top right)").

``zoom(q)`` (q = 1..4: top left, top right, bottom left, bottom right) answers with quadrant q of the
scene at 2x2 block means, shown at 112 px: there each cell is one pixel of its colour. Any other
response is the final answer, rewarded by exact match; the episode then ends. A trajectory that
zooms into the square's quadrant and names its colours is the only way to the reward.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from rollplex.engines.base import Option
from rollplex.errors import ConfigError, DataError
from rollplex.tasks.environments import EnvSpec, Environment, Observation, StepResult, register_environment
from rollplex.tasks.rewards import get_reward

# Each answer: a pair of colours that average to (125, 125, 125), so a 4x4 block of the checkerboard
# is that grey whatever the answer. No two pairs share a colour, so a cell names its answer.
PAIRS: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "red": ((220, 20, 20), (30, 230, 230)),
    "green": ((20, 160, 20), (230, 90, 230)),
    "blue": ((20, 40, 220), (230, 210, 30)),
    "black": ((10, 10, 10), (240, 240, 240)),
}
QUARTERS = ("top left", "top right", "bottom left", "bottom right")  # zoom(1) .. zoom(4)
QUESTION = "What colour is in the grey square? It is in quarter {} ({}); zoom(1) to zoom(4) show a quarter up close."
SCALE = 4  # the scene's resolution over the view's
_ZOOM = re.compile(r"zoom\(\s*([1-4])\s*\)")


def zoom_call(text: str) -> int | None:
    """The quadrant (1..4) a response asks to see when it is a zoom call and nothing else, as a tool
    parser takes a call or leaves it; else None (the response is an answer)."""
    m = _ZOOM.fullmatch(text.strip())
    return int(m.group(1)) if m else None


def block_mean(image: np.ndarray, k: int) -> np.ndarray:
    """The mean of each k x k block of an H x W x 3 uint8 array (H, W multiples of k), rounded."""
    h, w, _ = image.shape
    blocks = image.reshape(h // k, k, w // k, k, 3).astype(np.float64).mean(axis=(1, 3))
    return np.rint(blocks).astype(np.uint8)


@dataclass(frozen=True)
class ZoomTask:
    """``size`` items; item ``i`` is a pure function of ``(seed, i)``. ``image_size``: the view."""

    image_size: int = 112
    size: int = 512
    seed: int = 0
    reward: str = "exact_match"
    kinds: tuple[str, ...] = ("zoom",)

    def __post_init__(self) -> None:
        if self.image_size < 56 or self.image_size % 56:
            raise ConfigError(f"task.image_size={self.image_size}: the zoom task needs a multiple of 56 (a quadrant "
                              "of the view is a whole number of 28-pixel patches)")
        if self.size < 1:
            raise ConfigError(f"task.size={self.size}: need at least one item")
        get_reward(self.reward)

    def __len__(self) -> int:
        return self.size

    @staticmethod
    def answers(kind: str = "zoom") -> tuple[str, ...]:
        return tuple(PAIRS)

    @property
    def chance(self) -> float:
        return 1 / len(PAIRS)

    def prompt_id(self, index: int) -> str:
        return f"zoom-{index:06d}"

    def identity(self) -> dict:
        return {"zoom": {"image_size": self.image_size, "size": self.size, "seed": self.seed, "reward": self.reward}}

    def scene(self, index: int) -> tuple[np.ndarray, str, int]:
        """(the scene as an H x W x 3 uint8 array, the answer, the target's quadrant 1..4)."""
        if not 0 <= index < self.size:
            raise DataError(f"zoom task: item {index} out of range [0, {self.size})")
        rng = np.random.default_rng([self.seed, index, 1])
        view = self.image_size
        side = view * SCALE
        grey = int(rng.integers(190, 250))
        scene = np.full((side, side, 3), grey, dtype=np.uint8)
        answer = list(PAIRS)[int(rng.integers(len(PAIRS)))]
        quadrant = int(rng.integers(4))
        half = view // 2
        s = int(rng.integers(half * 3 // 7, half * 5 // 7 + 1))  # the square's side in view pixels
        margin = max(2, half // 14)
        x = int(rng.integers(margin, half - s - margin + 1)) + (quadrant % 2) * half
        y = int(rng.integers(margin, half - s - margin + 1)) + (quadrant // 2) * half
        a, b = (np.array(c, dtype=np.uint8) for c in PAIRS[answer])
        rows, cols = np.indices((s * SCALE, s * SCALE)) // 2  # 2-pixel cells; the square starts on a 4-pixel edge
        cells = ((rows + cols) % 2 == 0)[..., None]
        scene[y * SCALE: (y + s) * SCALE, x * SCALE: (x + s) * SCALE] = np.where(cells, a, b)
        return scene, answer, quadrant + 1

    def view(self, scene: np.ndarray) -> Image.Image:
        """What the model is shown: the scene at the view's resolution (4x4 block means)."""
        return Image.fromarray(block_mean(scene, SCALE))

    def build(self, builder, index: int):
        scene, answer, quadrant = self.scene(index)
        source = {"task": "zoom", "seed": self.seed, "index": index, "image_size": self.image_size,
                  "size": self.size}
        meta = {"index": index, "kind": "zoom", "images": [source], "quadrant": quadrant}
        question = QUESTION.format(quadrant, QUARTERS[quadrant - 1])
        return builder.build(self.prompt_id(index), self.view(scene), question, answer, meta)

    @staticmethod
    def tool_calls() -> tuple[str, ...]:
        """The calls the embedded model's tokenizer keeps whole: one token each."""
        return tuple(f"zoom({q})" for q in range(1, 5))

    def corpus(self) -> tuple[str, ...]:
        texts = ["user", "assistant", "system", *(QUESTION.format(i + 1, q) for i, q in enumerate(QUARTERS))]
        for word in PAIRS:
            texts += [word, word.capitalize(), f"Answer: {word}"]
        texts += [f"zoom({q})" for q in range(1, 5)]
        return tuple(texts)


def source_scene(meta: dict) -> np.ndarray | None:
    """The full-resolution scene of a zoom-task prompt, rebuilt from its recorded source (the G
    samples of a prompt share one; read-only)."""
    sources = meta.get("images") or []
    if not sources or sources[0].get("task") != "zoom":
        return None
    s = sources[0]
    return _scene(s["image_size"], s["size"], s["seed"], s["index"])


@functools.lru_cache(maxsize=64)
def _scene(image_size: int, size: int, seed: int, index: int) -> np.ndarray:
    scene = ZoomTask(image_size=image_size, size=size, seed=seed).scene(index)[0]
    scene.flags.writeable = False
    return scene


class ZoomEnv(Environment):
    """``zoom(q)`` shows quadrant q of the prompt's image at ``view`` pixels; any other response is the
    final answer. The image is the embedded task's scene, or a file dataset's first image as stored."""

    def __init__(self, options: dict) -> None:
        self.view = int(options.get("view", 112))
        self.reward_fn = get_reward(options.get("reward", "exact_match"))
        self.image: Image.Image | None = None

    def reset(self, prompt) -> None:
        super().reset(prompt)
        scene = source_scene(dict(prompt.meta))
        if scene is not None:
            self.image = Image.fromarray(scene)
        elif prompt.images:
            self.image = prompt.images[0]
        else:
            raise ValueError(f"prompt {prompt.prompt_id} has no image to zoom into")
        return None

    def step(self, response: str) -> StepResult:
        q = zoom_call(response)
        if q is None:
            return StepResult(None, float(self.reward_fn(response, self.prompt.answer)), done=True)
        w, h = self.image.size
        left, top = (q - 1) % 2 * (w // 2), (q - 1) // 2 * (h // 2)
        crop = self.image.crop((left, top, left + w // 2, top + h // 2)).resize((self.view, self.view), Image.BOX)
        return StepResult(Observation("", [crop], [{"zoom": q, "of": self.prompt.prompt_id}]), 0.0, done=False,
                          tool_calls=1)


def _observation_tokens(options: dict) -> int:
    side = int(options.get("view", 112))
    return (side // 28) ** 2 + 24  # the image's merged patches, and the turn's template text


def _check_reward(name: str) -> str | None:
    try:
        get_reward(name)
    except ConfigError as exc:
        return str(exc)
    return None


def warmup_examples(task: ZoomTask, builder, render, rng: np.random.Generator, n: int,
                    tool_rate: float = 0.75) -> list[tuple[Any, list[tuple[str, Any]]]]:
    """``n`` supervised trajectories that teach the turn format and where to look, not the answer:
    with probability ``tool_rate`` a ``zoom(q)`` of the grey square's quadrant, the environment's real
    answer to it, then a random valid answer; otherwise a random valid answer at once (a cold start on
    tool-call demonstrations, as agent RL recipes begin). Each is (prompt, [(target text, the rendered
    observation after it, or None)]). The answers are drawn apart from the truth, so the reward stays
    at chance after it: what RL learns is to read the zoomed colours, and to zoom every time."""
    out = []
    for index in rng.choice(len(task), size=n, replace=n > len(task)):
        prompt = task.build(builder, int(index))
        answer = str(rng.choice(task.answers()))
        if rng.random() >= tool_rate:
            out.append((prompt, [(answer, None)]))
            continue
        env = ZoomEnv({})
        from rollplex.tasks.environments import EnvPrompt

        env.reset(EnvPrompt(prompt.prompt_id, prompt.text, prompt.answer, (), prompt.meta, 0, 0))
        call = f"zoom({prompt.meta['quadrant']})"
        out.append((prompt, [(call, render(env.step(call).observation, stopped=True)), (answer, None)]))
    return out


register_environment(EnvSpec(
    name="zoom",
    factory=ZoomEnv,
    options={"view": Option(int, 28, 1024, check=lambda v: None if v % 28 == 0 else f"{v} is not a multiple of 28"),
             "reward": Option(str, check=_check_reward)},
    description="zoom(q) shows quadrant q of the prompt's image up close; any other response is the answer",
    observation_tokens=_observation_tokens,
    warmup=warmup_examples,
))
