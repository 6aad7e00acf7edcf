"""Forward passes of a Hugging Face Qwen2.5-VL model, split into vision, prefix and suffix.

The prompt prefix (vision tokens + text) does not depend on the responses, so it is run once per
prompt; the G responses are then scored on top of its KV cache. The first response token is scored
from the prefix's last-position logits, which all G responses share. With ``grad=True`` the prefix
keeps its autograd graph, so a loss over the G suffixes back-propagates through the prefix once.

These functions call the model's submodules directly (``model.model.language_model``,
``model.lm_head``) and compute M-RoPE positions with ``get_rope_index`` themselves. That keeps them
free of the HF wrapper's per-call state (``rope_deltas``), so two threads can use one model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache


@dataclass
class PromptInputs:
    """One prompt as the processor produced it: expanded token ids plus vision tensors (host)."""

    prompt_id: str
    input_ids: torch.Tensor  # [L] long, one image/video pad token per merged vision token
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None  # [n_images, 3]
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    answer: str = ""
    text: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class VisionEmbeds:
    """Merged vision-tower output for one prompt, in the LM's hidden size."""

    image: torch.Tensor | None  # [n_image_tokens, hidden]
    video: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.image, self.video) if t is not None)


@dataclass
class PrefixState:
    """What the suffixes of one prompt need from its prefix forward."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [1, kv_heads, L, head_dim]
    last_logits: torch.Tensor  # [vocab]: predicts the first response token
    rope_delta: int  # M-RoPE offset: text position i sits at i + rope_delta
    length: int

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv) + self.last_logits.numel() * 4


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def mm_token_types(input_ids: torch.Tensor, config) -> torch.Tensor:
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def vision_embeds(model: torch.nn.Module, prompt: PromptInputs) -> VisionEmbeds:
    """The vision tower's merged output. The tower is frozen, so no graph is kept."""
    device = _device_of(model)
    core = model.model
    image = video = None
    with torch.no_grad():
        if prompt.pixel_values is not None:
            out = core.get_image_features(prompt.pixel_values.to(device), prompt.image_grid_thw.to(device))
            image = torch.cat(out.pooler_output, dim=0)
        if prompt.pixel_values_videos is not None:
            out = core.get_video_features(prompt.pixel_values_videos.to(device), prompt.video_grid_thw.to(device))
            video = torch.cat(out.pooler_output, dim=0)
    return VisionEmbeds(image, video)


def rope_positions(model: torch.nn.Module, prompt: PromptInputs) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, 1, L] of the prompt and the delta for the text tokens after it."""
    ids = prompt.input_ids.view(1, -1)
    if prompt.image_grid_thw is None and prompt.video_grid_thw is None:
        pos = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        return pos, 0
    pos, delta = model.model.get_rope_index(
        ids,
        mm_token_type_ids=mm_token_types(ids, model.config),
        image_grid_thw=prompt.image_grid_thw,
        video_grid_thw=prompt.video_grid_thw,
        second_per_grid_ts=prompt.second_per_grid_ts,
    )
    return pos, int(delta.view(-1)[0])


def embed_prompt(model: torch.nn.Module, prompt: PromptInputs, vis: VisionEmbeds) -> torch.Tensor:
    device = _device_of(model)
    ids = prompt.input_ids.view(1, -1).to(device)
    embeds = model.get_input_embeddings()(ids)
    for token_id, feats in ((model.config.image_token_id, vis.image), (model.config.video_token_id, vis.video)):
        if feats is None:
            continue
        mask = (ids == token_id).unsqueeze(-1)
        if int(mask.sum()) != feats.shape[0]:
            raise ValueError(
                f"prompt {prompt.prompt_id}: {int(mask.sum())} vision placeholder tokens but "
                f"{feats.shape[0]} vision embeddings"
            )
        embeds = embeds.masked_scatter(mask, feats.to(device, embeds.dtype))
    return embeds


def prefix_forward(model: torch.nn.Module, prompt: PromptInputs, vis: VisionEmbeds, *, grad: bool) -> PrefixState:
    """LM forward over the prompt once; keeps the autograd graph when ``grad``."""
    device = _device_of(model)
    with torch.set_grad_enabled(grad):
        embeds = embed_prompt(model, prompt, vis)
        pos, delta = rope_positions(model, prompt)
        out = model.model.language_model(
            inputs_embeds=embeds,
            position_ids=pos.to(device),
            past_key_values=DynamicCache(),
            use_cache=True,
        )
        last_logits = model.lm_head(out.last_hidden_state[:, -1]).float()[0]
        kv = [(k, v) for k, v, *_ in out.past_key_values]
    return PrefixState(kv=kv, last_logits=last_logits, rope_delta=delta, length=prompt.num_tokens)


def pad_responses(responses: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to [G, R] and return (tokens, mask)."""
    width = max(1, max(len(r) for r in responses))
    tokens = torch.full((len(responses), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(responses), width), dtype=torch.float32)
    for i, r in enumerate(responses):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1.0
    return tokens, mask


def suffix_logits(model: torch.nn.Module, prefix: PrefixState, tokens: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """Logits [G, R, V] predicting each response token, from the shared prefix KV."""
    device = _device_of(model)
    tokens = tokens.to(device)
    group, width = tokens.shape
    first = prefix.last_logits.view(1, 1, -1).expand(group, 1, -1)
    if width == 1:
        return first
    with torch.set_grad_enabled(grad):
        cache = DynamicCache(ddp_cache_data=[(k.expand(group, -1, -1, -1), v.expand(group, -1, -1, -1))
                                             for k, v in prefix.kv])
        feed = tokens[:, :-1]  # token t predicts token t+1; the last token predicts nothing we score
        start = prefix.length + prefix.rope_delta
        pos = torch.arange(start, start + feed.shape[1], device=device).view(1, 1, -1).expand(3, group, -1)
        embeds = model.get_input_embeddings()(feed)
        out = model.model.language_model(
            inputs_embeds=embeds,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
        )
        rest = model.lm_head(out.last_hidden_state).float()
    return torch.cat([first, rest], dim=1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), gathered per position: [G, R]."""
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    return logp.gather(-1, tokens.to(logits.device).unsqueeze(-1)).squeeze(-1)


def suffix_logprobs(
    model: torch.nn.Module,
    prefix: PrefixState,
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
    grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs [G, R] of the G responses on the prefix, and their mask [G, R]."""
    tokens, mask = pad_responses(responses, pad_id)
    logits = suffix_logits(model, prefix, tokens, grad=grad)
    with torch.set_grad_enabled(grad):
        logprobs = token_logprobs(logits, tokens, temperature)
    return logprobs, mask.to(logprobs.device)


def full_sequence_logprobs(
    model: torch.nn.Module,
    prompt: PromptInputs,
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
    grad: bool = False,
    vis: VisionEmbeds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same log-probs from one forward per response over prompt+response: no prefix sharing.

    This is what serial runtimes do, and what ``prefix_sharing: false`` compiles to.
    """
    vis = vis if vis is not None else vision_embeds(model, prompt)
    device = _device_of(model)
    tokens, mask = pad_responses(responses, pad_id)
    rows = []
    with torch.set_grad_enabled(grad):
        prompt_embeds = embed_prompt(model, prompt, vis)
        pos, delta = rope_positions(model, prompt)
        length = prompt.num_tokens
        for i in range(tokens.shape[0]):
            resp = tokens[i : i + 1].to(device)
            embeds = torch.cat([prompt_embeds, model.get_input_embeddings()(resp)], dim=1)
            text_pos = torch.arange(length, length + resp.shape[1]).view(1, 1, -1).expand(3, 1, -1) + delta
            position_ids = torch.cat([pos, text_pos], dim=2).to(device)
            out = model.model.language_model(inputs_embeds=embeds, position_ids=position_ids, use_cache=False)
            logits = model.lm_head(out.last_hidden_state[:, length - 1 : -1]).float()
            rows.append(token_logprobs(logits, resp, temperature)[0])
    return torch.stack(rows), mask.to(device)
