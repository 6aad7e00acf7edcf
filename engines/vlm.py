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
import torch.utils.checkpoint

from rollplex.engines import packed_attention
from rollplex.engines.recompute import KVRecorder, PrefixCache


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


def vision_embeds(model: torch.nn.Module, prompt: PromptInputs, *, grad: bool = False) -> VisionEmbeds:
    """The vision tower's merged output; with ``grad`` (a vision tower that trains) it keeps its
    autograd graph, so a loss over the prefixes that read it back-propagates into the tower."""
    return vision_embeds_batch(model, [prompt], grad=grad)[0]


def vision_embeds_batch(model: torch.nn.Module, prompts: list[PromptInputs], *,
                        grad: bool = False) -> list[VisionEmbeds]:
    """One vision-tower call for the images (and one for the videos) of several prompts."""
    device = _device_of(model)
    core = model.model
    out: list[dict] = [{"image": None, "video": None} for _ in prompts]
    with torch.set_grad_enabled(grad):
        for kind, pixels_of, grid_of, features in (
            ("image", "pixel_values", "image_grid_thw", core.get_image_features),
            ("video", "pixel_values_videos", "video_grid_thw", core.get_video_features),
        ):
            owners = [i for i, p in enumerate(prompts) if getattr(p, pixels_of) is not None]
            if not owners:
                continue
            # Each prompt's pixels go to the device on their own, then join there: a join on the host
            # is a fresh pageable copy of them all (8 images of 1,024 tokens: 77 MB), on one thread.
            pixels = torch.cat([getattr(prompts[i], pixels_of).to(device, non_blocking=True) for i in owners])
            grids = [getattr(prompts[i], grid_of).reshape(-1, 3) for i in owners]
            per_item = features(pixels, torch.cat(grids).to(device)).pooler_output  # one tensor per image
            items = iter(per_item)
            for i, grid in zip(owners, grids):
                out[i][kind] = torch.cat([next(items) for _ in range(grid.shape[0])], dim=0)
    return [VisionEmbeds(o["image"], o["video"]) for o in out]


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
    return prefix_forward_batch(model, [prompt], [vis], grad=grad)[0]


def prefix_forward_batch(model: torch.nn.Module, prompts: list[PromptInputs], visions: list[VisionEmbeds], *,
                         grad: bool) -> list[PrefixState]:
    """One LM forward over several prompts, right-padded to the longest.

    Attention is causal, so a prompt's tokens never see the padding after them: no mask is needed,
    and each prompt's KV and last logits are read back at its own length.
    """
    device = _device_of(model)
    lengths = [p.num_tokens for p in prompts]
    width = max(lengths)
    with torch.set_grad_enabled(grad):
        rows, positions, deltas = [], [], []
        for prompt, vis in zip(prompts, visions):
            embeds = embed_prompt(model, prompt, vis)
            pos, delta = rope_positions(model, prompt)
            pad = width - prompt.num_tokens
            if pad:
                embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
                pos = torch.cat([pos, pos[:, :, -1:] + torch.arange(1, pad + 1).view(1, 1, -1)], dim=2)
            rows.append(embeds)
            positions.append(pos)
            deltas.append(delta)
        made = KVRecorder()
        out = model.model.language_model(
            inputs_embeds=torch.cat(rows),
            position_ids=torch.cat(positions, dim=1).to(device),
            past_key_values=made,
            use_cache=True,
        )
        index = torch.tensor([n - 1 for n in lengths], device=device)
        last = model.lm_head(out.last_hidden_state[torch.arange(len(prompts), device=device), index]).float()
        layers = [made.made[i] for i in range(len(made.made))]
    return [PrefixState(kv=[(k[i : i + 1, :, :n], v[i : i + 1, :, :n]) for k, v in layers],
                        last_logits=last[i], rope_delta=deltas[i], length=n)
            for i, n in enumerate(lengths)]


# Full-vocabulary fp32 logits are the largest tensors of a suffix forward: [tokens, V], 4.7 GB for
# 64 responses of 120 tokens on a 152k vocabulary. A forward that batches groups keeps them under
# this many elements (8 GiB in fp32); one with grad keeps half, as its backward holds several such
# tensors at once (bf16 and fp32 logits, their gradient).
LOGITS_BUDGET = 2**31


def batches_within(tokens: list[int], vocab: int, *, grad: bool, budget: int = LOGITS_BUDGET,
                   most: int | None = None) -> list[list[int]]:
    """Runs of consecutive groups, given by their response tokens, whose packed forward's logits
    (tokens summed × vocab) stay within the logits budget, and of at most ``most`` groups each (a
    micro-batch) when given. Every group gets a batch, even one over the budget on its own."""
    limit = budget // 2 if grad else budget
    return consecutive_runs(tokens, limit // vocab, most)  # (Σ n) · vocab ≤ limit ⇔ Σ n ≤ ⌊limit / vocab⌋


def consecutive_runs(sizes: list[int], limit: int | None = None, most: int | None = None) -> list[list[int]]:
    """Indices of ``sizes`` cut greedily, in order, into runs whose sizes sum to at most ``limit`` and
    that hold at most ``most`` items (None: no such bound). An item over the limit makes a run alone."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if out and (limit is None or total + n <= limit) and (most is None or len(out[-1]) < most):
            out[-1].append(i)
            total += n
        else:
            out.append([i])
            total = n
    return out


def pad_responses(responses: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to [G, R] and return (tokens, mask)."""
    width = _width(responses)
    tokens = torch.full((len(responses), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(responses), width), dtype=torch.float32)
    for i, r in enumerate(responses):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1.0
    return tokens, mask


@dataclass
class PackedSuffix:
    """The last hidden state at every response token that predicts another, without padding.

    Row n is response token ``cols[n] - 1`` of stacked row ``rows[n]`` (the groups' responses one
    after another); it predicts ``targets[n]``, the token at ``cols[n]``.
    """

    hidden: torch.Tensor  # [N, hidden]
    targets: torch.Tensor  # [N] long
    rows: torch.Tensor  # [N] long
    cols: torch.Tensor  # [N] long


# How a packed suffix attends: "varlen" cuts each row into its responses (flash attention on CUDA in
# bf16/fp16, a loop of SDPA calls elsewhere), "dense" masks the whole row, "auto" is varlen where flash
# runs and dense elsewhere (on CPU the masked call is one kernel per layer, the loop one per response).
SUFFIX_ATTENTION = "auto"


def _varlen(attention: str | None, dtype: torch.dtype, device: torch.device) -> bool:
    mode = attention or SUFFIX_ATTENTION
    if mode not in ("auto", "varlen", "dense"):
        raise ValueError(f"suffix attention {mode!r} is not auto, varlen or dense")
    return mode == "varlen" or (mode == "auto" and packed_attention.flash_ok(dtype, device))


def packed_attention_inputs(model: torch.nn.Module, segments: list[tuple[int, int, int, int]], seg_t: torch.Tensor,
                            lengths_t: torch.Tensor, longest: int, dtype: torch.dtype,
                            attention: str | None = None) -> tuple[dict, dict]:
    """The ``attention_mask`` and extra keyword arguments of a packed forward's language model: rows
    [B, width] of responses (``seg_t``: each slot's response in its row, -1 for padding) on prefixes
    of ``lengths_t`` tokens padded to ``longest``. ``segments`` as ``packed_attention.layout`` takes them."""
    kinds = set(model.config.get_text_config().layer_types)
    rows, width = seg_t.shape
    device = seg_t.device
    if segments and _varlen(attention, dtype, device) and packed_attention.enable(model):
        return dict.fromkeys(kinds), {"packed": packed_attention.layout(segments, rows, width, longest, device)}
    # Padding queries (segment -1) see only the prefix, so no row of the mask is empty.
    same = (seg_t[:, :, None] == seg_t[:, None, :]) & (seg_t[:, :, None] >= 0)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    in_prefix = (torch.arange(longest, device=device) < lengths_t[:, None])[:, None, :].expand(-1, width, -1)
    allowed = torch.cat([in_prefix, same & causal], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return {t: mask.unsqueeze(1) for t in kinds}, {}


def suffix_forward_packed(model: torch.nn.Module, prefixes: list[PrefixState], responses: list[list[list[int]]], *,
                          grad: bool, pad_id: int = 0, attention: str | None = None) -> PackedSuffix | None:
    """One LM forward over every response of several prompt groups, each group's responses packed
    into one row on top of its prefix KV.

    A token attends to its group's prefix and causally to its own response only (a block-diagonal
    mask, or on CUDA each response as a sequence of its own: ``packed_attention``), so the result
    equals one forward per response. Packing instead of padding each response
    to the longest costs no compute for padding (responses have a long tail) and reads each prefix
    KV once per group rather than once per response; gradients reach the one prefix directly.
    ``None`` when no response has a second token.
    """
    device = _device_of(model)
    feed, seg, pos, targets, rows, cols, segments = [], [], [], [], [], [], []
    row = 0
    for b, (p, group) in enumerate(zip(prefixes, responses)):
        f, s_, q = [], [], []
        for j, r in enumerate(group):
            n = len(r) - 1
            if n > 0:
                segments.append((b, len(f), n, p.length))
                f += r[:-1]
                s_ += [j] * n
                q += range(n)
                targets += r[1:]
                rows += [row + j] * n
                cols += range(1, n + 1)
        row += len(group)
        feed.append(f)
        seg.append(s_)
        pos.append([p.length + int(p.rope_delta) + k for k in q])
    width = max(len(f) for f in feed)
    if width == 0:
        return None
    # Every index the forward needs is built on the host and moved in one copy (each small tensor
    # made on the device is a copy the host waits for), and the real tokens are picked by index, not
    # by a boolean mask, whose count the host would wait for too.
    grid = torch.tensor([[x + [fill] * (width - len(x)) for x in xs] for xs, fill in ((feed, pad_id), (seg, -1), (pos, 0))])
    real = [b * width + t for b, f in enumerate(feed) for t in range(len(f))]
    lengths = [p.length for p in prefixes]
    n = len(targets)
    flat = torch.cat([grid.view(-1), torch.tensor(targets + rows + cols + real + lengths, dtype=torch.long)])
    flat = flat.to(device)
    feed_t, seg_t, pos_t = flat[: grid.numel()].view(grid.shape)
    targets_t, rows_t, cols_t, real_t = flat[grid.numel():].narrow(0, 0, 4 * n).view(4, n)
    lengths_t = flat[-len(lengths):]
    longest = max(lengths)
    with torch.set_grad_enabled(grad):
        layers = []
        for layer in range(len(prefixes[0].kv)):
            ks, vs = [], []
            for p in prefixes:
                k, v = p.kv[layer]
                if p.length != longest:
                    k = torch.nn.functional.pad(k, (0, 0, 0, longest - p.length))
                    v = torch.nn.functional.pad(v, (0, 0, 0, longest - p.length))
                ks.append(k)
                vs.append(v)
            layers.append((torch.cat(ks), torch.cat(vs)) if len(ks) > 1 else (ks[0], vs[0]))
        mask, extra = packed_attention_inputs(model, segments, seg_t, lengths_t, longest, layers[0][0].dtype,
                                              attention)
        out = model.model.language_model(
            inputs_embeds=model.get_input_embeddings()(feed_t),
            position_ids=pos_t.unsqueeze(0).expand(3, -1, -1),
            past_key_values=PrefixCache(ddp_cache_data=layers),
            attention_mask=mask,
            use_cache=True,
            **extra,
        )
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1]).index_select(0, real_t)
    return PackedSuffix(hidden, targets_t, rows_t, cols_t)


def _width(group: list[list[int]]) -> int:
    """A group's [G, R] width: its longest response, at least 1 (as ``pad_responses`` pads)."""
    return max(1, max((len(r) for r in group), default=0))


def _response_rows(responses: list[list[list[int]]]) -> tuple[list[int], int]:
    """Each group's row count, and the widest group's width."""
    return [len(g) for g in responses], max(_width(g) for g in responses)


def suffix_logits(model: torch.nn.Module, prefix: PrefixState, tokens: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """Logits [G, R, V] predicting each response token of ``tokens`` [G, R] (every column a token)."""
    return suffix_logits_batch(model, [prefix], [tokens.tolist()], grad=grad)[0]


def suffix_logits_batch(model: torch.nn.Module, prefixes: list[PrefixState], responses: list[list[list[int]]], *,
                        grad: bool) -> list[torch.Tensor]:
    """Logits [G_i, R_i, V] for several prompt groups' responses in one packed forward. Position 0
    of every row is the prefix's last logits, which the group shares; after it, zeros past each
    response's end."""
    counts, width = _response_rows(responses)
    packed = suffix_forward_packed(model, prefixes, responses, grad=grad)
    with torch.set_grad_enabled(grad):
        first = torch.cat([p.last_logits.view(1, -1).expand(n, -1) for p, n in zip(prefixes, counts)]).float()
        rest = first.new_zeros(sum(counts), width - 1, first.shape[-1])
        if packed is not None:
            rest = rest.index_put((packed.rows, packed.cols - 1), model.lm_head(packed.hidden).float())
        full = torch.cat([first.unsqueeze(1), rest], dim=1)
    out, row = [], 0
    for group, n in zip(responses, counts):
        out.append(full[row : row + n, : _width(group)])
        row += n
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), gathered per position: [G, R]."""
    tokens = tokens.to(logits.device)
    flat = _gathered_logprobs(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), temperature)
    return flat.view(tokens.shape)


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
    return suffix_logprobs_batch(model, [prefix], [responses], pad_id=pad_id, temperature=temperature, grad=grad)[0]


def suffix_logprobs_batch(
    model: torch.nn.Module,
    prefixes: list[PrefixState],
    responses: list[list[list[int]]],
    *,
    pad_id: int,
    temperature: float = 1.0,
    grad: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``suffix_logprobs`` for several prompt groups, in one packed forward.

    Full-vocabulary logits are made only at real response tokens, and log p(token) is the gathered
    logit less the log-sum-exp, so no log-softmax of the logits' size is kept either.
    """
    counts, width = _response_rows(responses)
    packed = suffix_forward_packed(model, prefixes, responses, grad=grad, pad_id=pad_id)
    device = prefixes[0].last_logits.device
    first_rows, first_tokens, first_logits = [], [], []
    lengths = []
    row = 0
    for p, group in zip(prefixes, responses):
        for j, r in enumerate(group):
            lengths.append(len(r))
            if r:
                first_rows.append(row + j)
                first_tokens.append(r[0])
                first_logits.append(p.last_logits)
        row += len(group)
    # The masks and the first tokens' indices go to the device in one copy.
    mask = (torch.arange(width).view(1, -1) < torch.tensor(lengths).view(-1, 1)).long()
    moved = torch.cat([mask.view(-1), torch.tensor(first_rows + first_tokens, dtype=torch.long)]).to(device)
    mask, firsts = moved[: mask.numel()].view(mask.shape).float(), moved[mask.numel():].view(2, -1)
    with torch.set_grad_enabled(grad):
        rows, targets = firsts
        cols = torch.zeros_like(rows)
        logits = torch.stack(first_logits).float() if first_logits else torch.zeros(0, 1, device=device)
        values = _gathered_logprobs(logits, targets, temperature) if first_logits else logits.new_zeros(0)
        if packed is not None:
            rest = head_logprobs(model.lm_head, packed.hidden, packed.targets, temperature)
            rows, cols, values = torch.cat([rows, packed.rows]), torch.cat([cols, packed.cols]), torch.cat([values, rest])
        full = torch.zeros(sum(counts), width, device=device).index_put((rows, cols), values)
    out, row = [], 0
    for group, n in zip(responses, counts):
        own = _width(group)
        out.append((full[row : row + n, :own], mask[row : row + n, :own]))
        row += n
    return out


# A long packed suffix (8 responses of 1,024 tokens) would hold [8192, 152k] fp32 logits, their
# log-sum-exp's saved input and their gradient at once: about 15 GB at 3B, enough to miss an 80 GB
# card. Above this many tokens the head runs in pieces, each recomputed in the backward
# (checkpointed), so one piece's logits (1.2 GB) is the most held.
HEAD_CHUNK_TOKENS = 2048


def head_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """log p(token) per row of ``hidden`` [N, H] under the LM head, in pieces of at most
    ``HEAD_CHUNK_TOKENS`` rows; under grad each piece's logits are made again in the backward."""
    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _gathered_logprobs(lm_head(h).float(), t, temperature)

    n = hidden.shape[0]
    if n <= HEAD_CHUNK_TOKENS:
        return piece(hidden, tokens)
    recompute = torch.is_grad_enabled()  # the hidden state's or the head's own (LoRA) gradient
    parts = []
    for start in range(0, n, HEAD_CHUNK_TOKENS):
        h, t = hidden[start: start + HEAD_CHUNK_TOKENS], tokens[start: start + HEAD_CHUNK_TOKENS]
        parts.append(torch.utils.checkpoint.checkpoint(piece, h, t, use_reentrant=False) if recompute else piece(h, t))
    return torch.cat(parts)


def _gathered_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature)[token] per row of [N, V], without a [N, V] log-softmax."""
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, tokens.view(-1, 1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def full_sequence_logprobs(
    model: torch.nn.Module,
    prompt: PromptInputs,
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
    grad: bool = False,
    vis: VisionEmbeds | None = None,
    head: str = "lm",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same log-probs from forwards over prompt+response: no prefix sharing.

    This is what serial runtimes do, and what ``prefix_sharing: false`` compiles to: a batched
    implementation's, with the responses right-padded into as few forwards as the logits budget
    allows (causal attention: padding after a row's last token changes none of its outputs). With
    ``head="value"`` (a critic's scalar head) the per-position outputs are returned as they are.
    """
    vis = vis if vis is not None else vision_embeds(model, prompt, grad=grad)
    device = _device_of(model)
    tokens, mask = pad_responses(responses, pad_id)
    rows = []
    with torch.set_grad_enabled(grad):
        prompt_embeds = embed_prompt(model, prompt, vis)
        pos, delta = rope_positions(model, prompt)
        length, width = prompt.num_tokens, tokens.shape[1]
        vocab = 1 if head == "value" else model.config.get_text_config().vocab_size
        text_pos = torch.arange(length, length + width).view(1, 1, -1) + delta
        for run in batches_within([width] * tokens.shape[0], vocab, grad=grad):  # logits: response positions
            resp = tokens[run[0]: run[-1] + 1].to(device)
            n = resp.shape[0]
            embeds = torch.cat([prompt_embeds.expand(n, -1, -1), model.get_input_embeddings()(resp)], dim=1)
            position_ids = torch.cat([pos.expand(3, n, -1), text_pos.expand(3, n, -1)], dim=2).to(device)
            out = model.model.language_model(inputs_embeds=embeds, position_ids=position_ids, use_cache=False)
            logits = model.lm_head(out.last_hidden_state[:, length - 1: -1]).float()
            rows.append(logits[..., 0] if head == "value" else token_logprobs(logits, resp, temperature))
    return torch.cat(rows), mask.to(device)
