"""Hugging Face model loading, and the embedded tiny Qwen2.5-VL built locally from a config.

No weights can be downloaded here, so the default model is built from a config: a byte-level BPE
tokenizer trained on the task's own text, the Qwen2.5-VL image/video processors, and a randomly
initialised ``Qwen2_5_VLForConditionalGeneration``, all saved with ``save_pretrained``. Everything
downstream loads it with the ordinary ``from_pretrained`` path, exactly as it would a real checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollplex.errors import ConfigError

# Qwen2.5-VL's special tokens, in its own order. The ids follow the BPE vocabulary.
QWEN_VL_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)

# Qwen2.5-VL's chat template, reduced to what a single-turn image+text prompt needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyVLMSpec:
    """Shape of the embedded model. head_dim 32 is one vLLM's CPU attention supports."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_heads: int = 2
    bpe_vocab_size: int = 512
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    seed: int = 0
    corpus: tuple[str, ...] = field(default=())
    # Preset-shaped models (``preset_spec``): a full-size vocabulary and ViT, their RoPE base and dtype.
    vocab_size: int = 0  # rows of the embedding and LM head; 0: the tokenizer's size
    vision_intermediate_size: int = 0  # 0: twice vision_hidden_size
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    dtype: str = "float32"
    # Strings the tokenizer keeps whole, one token each (a tool call such as "zoom(2)"), after the
    # special tokens.
    added_tokens: tuple[str, ...] = ()

    def fingerprint(self) -> str:
        fields = asdict(self)
        if not self.added_tokens:  # models built before the field existed keep their directory
            del fields["added_tokens"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_dir() -> Path:
    return Path(os.environ.get("ROLLPLEX_CACHE", Path.home() / ".cache" / "rollplex"))


def ensure_tiny_vlm(spec: TinyVLMSpec, cache_dir: Path | None = None) -> Path:
    """Build the tiny model once per spec and return its directory (atomic: temp dir + rename)."""
    target = Path(cache_dir or default_cache_dir()) / f"tiny-qwen2.5-vl-{spec.fingerprint()}"
    if not (target / "config.json").exists():
        _build_then_rename(spec, target)  # False: another process finished first; its copy is as good
    return target


def _build_then_rename(spec: TinyVLMSpec, target: Path, device: str = "cpu") -> bool:
    """Build ``spec`` in a temp directory beside ``target`` and rename it into place, so an interrupted
    build leaves nothing that looks like a model. False where ``target`` appeared meanwhile."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_tiny_vlm(spec, staging, device)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 is for the staging only
        try:
            os.rename(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            return False
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def preset_spec(name: str, corpus: tuple[str, ...], layers: int | None = None,
                vision_layers: int | None = None, dtype: str = "bfloat16", seed: int = 0) -> TinyVLMSpec:
    """A model of a preset's architecture (``pipeline.modelspec.PRESETS``: widths, heads, vocabulary,
    ViT) with random weights and the task's own tokenizer; ``layers``/``vision_layers`` cut the depth."""
    from rollplex.engines.modelspec import load_model

    m = load_model(name, "--preset")
    return TinyVLMSpec(hidden_size=m.hidden, intermediate_size=m.intermediate, num_hidden_layers=layers or m.layers,
                       num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                       vision_depth=vision_layers or m.vit_depth, vision_hidden_size=m.vit_hidden,
                       vision_heads=m.vit_heads, vision_intermediate_size=m.vit_intermediate,
                       min_pixels=56 * 56, max_pixels=28 * 28 * 1280, seed=seed, corpus=tuple(corpus),
                       vocab_size=m.vocab, tie_word_embeddings=m.tied, rope_theta=1e6, dtype=dtype)


def write_vlm(spec: TinyVLMSpec, out_dir: Path, device: str = "cpu") -> Path:
    """Build ``spec`` into ``out_dir``, which must not exist yet (atomic: temp dir + rename).
    ``device``: where the random weights are drawn; a GPU draws a 7B model's in seconds where the CPU
    takes minutes, but its values differ from the CPU's for the same seed."""
    out_dir = Path(out_dir)
    if out_dir.exists() or not _build_then_rename(spec, out_dir, device):
        raise ConfigError(f"{out_dir}: exists already; name a new directory")
    return out_dir


def _train_tokenizer(spec: TinyVLMSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.bpe_vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    corpus = list(spec.corpus) or ["the quick brown fox"]
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_VL_SPECIAL_TOKENS),
    )
    if spec.added_tokens:
        fast.add_tokens(list(spec.added_tokens))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_vlm(spec: TinyVLMSpec, out_dir: Path, device: str = "cpu") -> None:
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _train_tokenizer(spec)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    if spec.vocab_size and spec.vocab_size < len(tokenizer):
        raise ConfigError(f"vocab_size {spec.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    vocab_size = spec.vocab_size or len(tokenizer)
    head_dim = spec.hidden_size // spec.num_attention_heads
    # M-RoPE splits head_dim/2 rotary frequencies over (temporal, height, width).
    half = head_dim // 2
    mrope = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            max_position_embeddings=max(2048, 32768 if spec.vocab_size else 0),
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta, "mrope_section": mrope},
            tie_word_embeddings=spec.tie_word_embeddings,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_hidden_size,
            intermediate_size=spec.vision_intermediate_size or spec.vision_hidden_size * 2,
            num_heads=spec.vision_heads,
            out_hidden_size=spec.hidden_size,
            # Qwen2.5-VL's 32-block ViT attends fully in blocks 7, 15, 23, 31; shallower ones in the last.
            fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < spec.vision_depth] or [spec.vision_depth - 1],
            window_size=112,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    torch.manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a 7B model in fp32 would need 30 GiB of host memory
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
    finally:
        torch.set_default_dtype(default)
    model.to("cpu")
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out_dir)

    image_processor = Qwen2VLImageProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    (out_dir / "rollplex_spec.json").write_text(json.dumps(asdict(spec), indent=1))
