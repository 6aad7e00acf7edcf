"""Forwards over multi-turn trajectories: each sample's turns scored on its prompt's shared prefix.

A trajectory continues its prompt with every turn: the policy's response, then the environment's
answer (its text and new images, in the chat template), then the next response. Scoring it is a
suffix forward like a single response's (``vlm.suffix_forward_packed``), with two differences:

- the continuation holds image placeholders, whose embeddings come from the vision tower's output
  for the observation images (``Continuation.image_embeds``), not from the token table;
- its positions are M-RoPE's: an image's tokens take (t, h, w) grid positions. They are computed on
  the continuation alone and shifted by the prefix's next text position, which equals
  ``get_rope_index`` over the whole sequence (every segment's positions start where the last ended).

The prompt is forwarded once per group (its prefix), and each sample's turns once on top of it: the
prefix tree of a group's trajectories, never a turn recomputed. Where an environment's tokens stand
the outputs are computed and then masked by the caller (``policy_mask``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from rollplex.engines import vlm
from rollplex.engines.recompute import PrefixCache


@dataclass
class Continuation:
    """What a forward needs of one sample's turns after its prompt. ``policy_mask`` (1: sampled by the
    policy) says which image placeholders are the environment's: a placeholder token the policy
    sampled is text, as the decode engine fed it, and takes no image."""

    token_ids: list[int]
    image_embeds: torch.Tensor | None = None  # [the environment's image pads in token_ids, hidden], in order
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    policy_mask: list[int] | None = None


def continuation_of(seq) -> Continuation:
    """A decoded sample (a single response or a multi-turn trajectory) as a ``Continuation``."""
    return Continuation(list(seq.token_ids), getattr(seq, "image_embeds", None), getattr(seq, "image_grid_thw", None),
                        getattr(seq, "policy_mask", None))


def image_slots(model: torch.nn.Module, token_ids: list[int], policy_mask: list[int] | None) -> torch.Tensor:
    """[n] bool: the image placeholders an image fills (the environment's, not the policy's)."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    slots = ids == model.config.image_token_id
    if policy_mask is not None:
        slots &= torch.tensor(policy_mask[: len(token_ids)], dtype=torch.long) == 0
    return slots


def segment_positions(model: torch.nn.Module, token_ids: list[int], image_grid_thw: torch.Tensor | None,
                      start: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """M-RoPE positions [3, n] of a segment that follows text whose next position is ``start``;
    ``slots`` marks the placeholders its images fill (default: every image placeholder)."""
    n = len(token_ids)
    if image_grid_thw is None or n == 0:
        return torch.arange(start, start + n).view(1, -1).expand(3, -1).clone()
    ids = torch.tensor(token_ids, dtype=torch.long).view(1, -1)
    types = (slots.view(1, -1) if slots is not None else ids == model.config.image_token_id).to(torch.int32)
    pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw.reshape(-1, 3))
    return pos[:, 0] + start


def next_position(positions: torch.Tensor, start: int) -> int:
    """The text position after a segment of ``positions`` [3, n] that began at ``start``."""
    return int(positions.max()) + 1 if positions.numel() else start


def embed_segment(model: torch.nn.Module, token_ids: torch.Tensor, image_embeds: torch.Tensor | None,
                  slots: torch.Tensor | None = None) -> torch.Tensor:
    """Token embeddings [.., n, hidden] with the image placeholders ``slots`` (default: all) replaced by
    their vision embeddings."""
    embeds = model.get_input_embeddings()(token_ids)
    if image_embeds is None:
        return embeds
    mask = (slots if slots is not None else token_ids == model.config.image_token_id).unsqueeze(-1)
    if int(mask.sum()) != image_embeds.shape[0]:
        raise ValueError(f"{int(mask.sum())} image placeholders but {image_embeds.shape[0]} image embeddings")
    return embeds.masked_scatter(mask, image_embeds.to(embeds.device, embeds.dtype))


@dataclass
class PackedTurns:
    """``vlm.PackedSuffix`` for trajectories: the last hidden state at every continuation token that
    predicts another (row ``rows[n]``, column ``cols[n]`` of the group's [G, R] grid)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


def forward_packed(model: torch.nn.Module, prefixes: list[vlm.PrefixState], groups: list[list[Continuation]], *,
                   grad: bool, pad_id: int = 0) -> PackedTurns | None:
    """One LM forward over every continuation of several groups, each group's packed into one row on
    its prefix's KV, each continuation attending to the prefix and causally to itself (as
    ``vlm.suffix_forward_packed``, varlen on CUDA), image
    placeholders embedded from the vision tower's output and placed at their M-RoPE positions."""
    device = next(model.parameters()).device
    feed, seg, pos, feats, slot, targets, rows, cols, segments = [], [], [], [], [], [], [], [], []
    row = 0
    for b, (prefix, group) in enumerate(zip(prefixes, groups)):
        f, s_, q, k = [], [], [], []
        start = prefix.length + int(prefix.rope_delta)
        for j, c in enumerate(group):
            n = len(c.token_ids) - 1
            if n <= 0:
                continue
            slots = image_slots(model, c.token_ids, c.policy_mask)
            segments.append((b, len(f), n, prefix.length))
            f += c.token_ids[:-1]
            s_ += [j] * n
            k.append(slots[:-1])
            q.append(segment_positions(model, c.token_ids, c.image_grid_thw, start, slots)[:, :-1])
            if c.image_embeds is not None:
                feats.append(c.image_embeds)  # a trajectory's last token is the policy's: no image is cut off
            targets += c.token_ids[1:]
            rows += [row + j] * n
            cols += range(1, n + 1)
        row += len(group)
        feed.append(f)
        seg.append(s_)
        pos.append(torch.cat(q, dim=1) if q else torch.zeros(3, 0, dtype=torch.long))
        slot.append(torch.cat(k) if k else torch.zeros(0, dtype=torch.bool))
    width = max(len(f) for f in feed)
    if width == 0:
        return None
    feed_t = torch.tensor([f + [pad_id] * (width - len(f)) for f in feed], device=device)
    seg_t = torch.tensor([s + [-1] * (width - len(s)) for s in seg], device=device)
    pos_t = torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in pos], dim=1).to(device)
    real = torch.tensor([b * width + t for b, f in enumerate(feed) for t in range(len(f))], device=device)
    lengths = torch.tensor([p.length for p in prefixes], device=device)
    longest = max(p.length for p in prefixes)
    with torch.set_grad_enabled(grad):
        layers = []
        for layer in range(len(prefixes[0].kv)):
            ks, vs = [], []
            for p in prefixes:
                k, v = p.kv[layer]
                pad = longest - p.length
                ks.append(torch.nn.functional.pad(k, (0, 0, 0, pad)) if pad else k)
                vs.append(torch.nn.functional.pad(v, (0, 0, 0, pad)) if pad else v)
            layers.append((torch.cat(ks), torch.cat(vs)) if len(ks) > 1 else (ks[0], vs[0]))
        mask, extra = vlm.packed_attention_inputs(model, segments, seg_t, lengths, longest, layers[0][0].dtype)
        slots = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in slot]).to(device)
        embeds = embed_segment(model, feed_t, torch.cat(feats) if feats else None, slots)
        out = model.model.language_model(inputs_embeds=embeds, position_ids=pos_t,
                                          past_key_values=PrefixCache(ddp_cache_data=layers),
                                          attention_mask=mask, use_cache=True, **extra)
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1]).index_select(0, real)
    return PackedTurns(hidden, torch.tensor(targets, device=device), torch.tensor(rows, device=device),
                       torch.tensor(cols, device=device))


def logprobs_batch(model: torch.nn.Module, prefixes: list[vlm.PrefixState], groups: list[list[Continuation]], *,
                   pad_id: int, temperature: float = 1.0, grad: bool) -> list[torch.Tensor]:
    """Per-token log-probs [G_i, R_i] of every token of each group's continuations (0 past a row's
    end); the first token is scored from the prefix's last logits, which the group shares."""
    counts, width = vlm._response_rows([[c.token_ids for c in g] for g in groups])
    packed = forward_packed(model, prefixes, groups, grad=grad, pad_id=pad_id)
    device = prefixes[0].last_logits.device
    first_rows, first_tokens, first_logits, row = [], [], [], 0
    for p, group in zip(prefixes, groups):
        for j, c in enumerate(group):
            if c.token_ids:
                first_rows.append(row + j)
                first_tokens.append(c.token_ids[0])
                first_logits.append(p.last_logits)
        row += len(group)
    with torch.set_grad_enabled(grad):
        rows = torch.tensor(first_rows, dtype=torch.long, device=device)
        cols = torch.zeros_like(rows)
        values = (vlm._gathered_logprobs(torch.stack(first_logits).float(),
                                         torch.tensor(first_tokens, device=device), temperature)
                  if first_logits else torch.zeros(0, device=device))
        if packed is not None:
            rest = vlm.head_logprobs(model.lm_head, packed.hidden, packed.targets, temperature)
            rows, cols = torch.cat([rows, packed.rows]), torch.cat([cols, packed.cols])
            values = torch.cat([values, rest])
        full = torch.zeros(sum(counts), width, device=device).index_put((rows, cols), values)
    return _split(full, groups, counts)


def head_outputs_batch(model: torch.nn.Module, prefixes: list[vlm.PrefixState], groups: list[list[Continuation]], *,
                       grad: bool) -> list[torch.Tensor]:
    """A scalar head's output [G_i, R_i] at the state before each continuation token (a critic's
    values): position 0 from the prefix's last output, the rest from the packed forward."""
    counts, width = vlm._response_rows([[c.token_ids for c in g] for g in groups])
    packed = forward_packed(model, prefixes, groups, grad=grad)
    with torch.set_grad_enabled(grad):
        first = torch.cat([p.last_logits.view(1, -1).expand(n, -1) for p, n in zip(prefixes, counts)]).float()
        full = first.new_zeros(sum(counts), width)
        full[:, 0] = first[:, 0]
        if packed is not None:
            full = full.index_put((packed.rows, packed.cols), model.lm_head(packed.hidden).float()[:, 0])
    return _split(full, groups, counts)


def _split(full: torch.Tensor, groups: list[list[Continuation]], counts: list[int]) -> list[torch.Tensor]:
    out, row = [], 0
    for group, n in zip(groups, counts):
        out.append(full[row: row + n, : vlm._width([c.token_ids for c in group])])
        row += n
    return out


@dataclass
class History:
    """One sample's trajectory so far on a frozen model, for scoring its turns as they end (stage
    fusion across turns): the KV of every token (prompt, responses, the environment's answers), the
    next M-RoPE text position, the logits that predict its next token, and the log-probs of its tokens
    after the prompt."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [1, kv_heads, length, head_dim]
    length: int
    next_pos: int
    last_logits: torch.Tensor  # [vocab]
    logprobs: torch.Tensor  # [tokens after the prompt so far]

    @classmethod
    def of_prefix(cls, prefix: vlm.PrefixState) -> "History":
        """A sample before its first turn: its prompt's prefix, which the group shares."""
        return cls(prefix.kv, prefix.length, prefix.length + int(prefix.rope_delta), prefix.last_logits,
                   prefix.last_logits.new_zeros(0))


def extend_histories(model: torch.nn.Module, histories: list[History], segments: list[Continuation], *,
                     keep: list[bool], pad_id: int = 0, temperature: float = 1.0) -> list[History]:
    """Each history extended by its segment (a turn's response, with the environment's answer and its
    images where the trajectory goes on) in one forward, rows padded: the segment's log-probs appended,
    and where ``keep`` its KV, next position and last logits for the next segment. Every token of a
    segment is fed, as in a forward over the whole trajectory, so the log-probs equal that forward's."""
    device = next(model.parameters()).device
    lengths = [len(s.token_ids) for s in segments]
    width, longest = max(lengths), max(h.length for h in histories)
    slots = [image_slots(model, s.token_ids, s.policy_mask) for s in segments]
    positions = [segment_positions(model, s.token_ids, s.image_grid_thw, h.next_pos, k)
                 for s, h, k in zip(segments, histories, slots)]
    feed = torch.tensor([s.token_ids + [pad_id] * (width - n) for s, n in zip(segments, lengths)], device=device)
    pos = torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in positions], dim=1).to(device)
    slot = torch.stack([torch.nn.functional.pad(k, (0, width - len(k))) for k in slots]).to(device)
    feats = [s.image_embeds for s in segments if s.image_embeds is not None]
    layers = []
    for layer in range(len(histories[0].kv)):
        ks = [torch.nn.functional.pad(h.kv[layer][0], (0, 0, 0, longest - h.length)) for h in histories]
        vs = [torch.nn.functional.pad(h.kv[layer][1], (0, 0, 0, longest - h.length)) for h in histories]
        layers.append((torch.cat(ks), torch.cat(vs)))
    # Row b holds one segment on its own history: the packed forward's attention with one response a row.
    seg_t = torch.where(torch.arange(width) < torch.tensor(lengths)[:, None], 0, -1).to(device)
    history = torch.tensor([h.length for h in histories], device=device)
    mask, extra = vlm.packed_attention_inputs(model, [(b, 0, n, h.length) for b, (n, h) in enumerate(zip(lengths, histories))
                                                      if n], seg_t, history, longest, layers[0][0].dtype)
    with torch.no_grad():
        out = model.model.language_model(
            inputs_embeds=embed_segment(model, feed, torch.cat(feats) if feats else None, slot), position_ids=pos,
            past_key_values=DynamicCache(ddp_cache_data=layers), use_cache=True, attention_mask=mask, **extra)
        logits = model.lm_head(out.last_hidden_state).float()
        cache = [(k, v) for k, v, *_ in out.past_key_values]
    extended = []
    for row, (h, s, n) in enumerate(zip(histories, segments, lengths)):
        ids = torch.tensor(s.token_ids, device=device)
        predicting = torch.cat([h.last_logits.float().view(1, -1), logits[row, : n - 1]])
        lp = torch.cat([h.logprobs, vlm._gathered_logprobs(predicting, ids, temperature)])
        if not keep[row]:
            extended.append(History([], 0, 0, h.last_logits, lp))
            continue
        kv = [(torch.cat([k[row: row + 1, :, : h.length], k[row: row + 1, :, longest: longest + n]], dim=2),
               torch.cat([v[row: row + 1, :, : h.length], v[row: row + 1, :, longest: longest + n]], dim=2))
              for k, v in cache]
        extended.append(History(kv, h.length + n, next_position(positions[row], h.next_pos), logits[row, n - 1], lp))
    return extended
