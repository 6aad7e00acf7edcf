"""The live rows of the torch-graph decode engine (``engines/graph_decode.py``): what each row and
each resident prompt is, and the static device buffers a captured step reads and writes.

Every buffer is allocated once at its largest size, since a CUDA graph holds its addresses.
"""
from __future__ import annotations

import dataclasses

import torch

from rollplex.engines.base import DecodeRequest
from rollplex.engines.decode_attention import PREFIX_MEMBERS
from rollplex.engines.decode_step import _Weights

# Stop tokens per row, EOS ids included: a fixed width, since the captured step compares against it.
MAX_STOP_TOKENS = 64


@dataclasses.dataclass
class _Row:
    parent: str
    sample: int
    n: int
    request: DecodeRequest
    slot: int = -1  # its prompt's prefix slot (shared_prefix)


@dataclasses.dataclass
class _Slot:
    """A prompt resident in the prefix cache, and what a row admitted to it starts from."""

    key: tuple
    rows: int  # live rows reading it; the slot is freed at 0
    last_logits: torch.Tensor
    length: int
    rope_delta: int
    request: DecodeRequest  # keeps the key's embedding tensors alive: ids in keys stay unique


class _Batch:
    """Static device buffers of the live rows: everything a step reads and writes. ``max_len``: the
    slots of a row's own cache; ``prefix``: (slots, max_prompt_len) of the shared prefix cache."""

    def __init__(self, w: _Weights, rows: int, max_len: int, layers: int, vocab: int, dtype, device,
                 prefix: tuple[int, int] | None = None) -> None:
        shape = (rows, w.kv_heads, max_len, w.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.prefix_len = 0
        if prefix is not None:
            slots, self.prefix_len = prefix
            pshape = (slots, w.kv_heads, self.prefix_len, w.head_dim)
            self.pk = [torch.zeros(pshape, dtype=dtype, device=device) for _ in range(layers)]
            self.pv = [torch.zeros(pshape, dtype=dtype, device=device) for _ in range(layers)]
            i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=device)  # noqa: E731
            # Entries: (slot, its prompt length, up to PREFIX_MEMBERS of its rows); at most one per row.
            self.entry_slot, self.entry_len = i32(rows), i32(rows)
            self.members = torch.full((rows, PREFIX_MEMBERS), -1, dtype=torch.int32, device=device)
            self.slot_of_row = torch.zeros(rows, dtype=torch.long, device=device)
            self.prompt_len = torch.zeros(rows, dtype=torch.long, device=device)
        z = lambda dt: torch.zeros(rows, dtype=dt, device=device)  # noqa: E731
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.length = z(torch.long)  # filled slots of the row's own cache = where the next token's KV goes
        self.rope_pos = z(torch.long)  # M-RoPE text position of the next token
        self.seed, self.n_gen, self.max_new = z(torch.long), z(torch.long), z(torch.long)
        self.temp, self.top_p, self.done = z(torch.float32), z(torch.float32), z(torch.bool)
        self.stop = torch.full((rows, MAX_STOP_TOKENS), -1, dtype=torch.long, device=device)
        # Sized for the longest response at once: graphs hold these buffers' addresses.
        self.tokens = torch.zeros(rows, max_len, dtype=torch.long, device=device)
        self.logps = torch.zeros(rows, max_len, dtype=torch.float32, device=device)
        self.max_len = max_len


def _prompt_key(req: DecodeRequest) -> tuple:
    """Requests with equal keys have the same prompt: the same tokens and the same embedding tensors."""
    return tuple(req.prompt_token_ids), id(req.image_embeds), id(req.video_embeds)
