"""Plain transformers/torch decode engine: the fallback where vLLM is not installed (e.g. the GPU box).

How it decodes:
- Requests with identical prompt ids and vision embeddings (the G samples of one prompt) share one
  prefill (``tasks.lm.prefix_forward``); its KV is copied into G rows of the batch.
- All live rows decode together, one token per forward. The KV cache is one preallocated buffer per
  layer, [rows, kv_heads, columns, head_dim]. Rows are left-padded so that every row writes its next
  token at the same column; an additive mask hides the padding (no mask when there is none).
- Sampling runs on the device: temperature, top-p, then an exponential race (argmax p / q with
  q ~ Exp(1)) whose noise comes from a per-request ``torch.Generator`` seeded with the request's
  seed, so a request's tokens do not depend on what else is in the batch or how steps are chunked.
- One host sync per token (``fin.any()``), for the whole batch; tokens stay on the device until
  their row finishes. Finished rows are dropped at once, with any columns only they needed.
- Queued prompts are prefilled at the start of ``step`` while fewer than ``max_num_seqs`` rows are
  live; a later ``add_requests`` joins the running batch at the next ``step``.
- Multi-turn: a finished sample of a ``keep_kv`` request is parked (its KV, the ids it holds and
  the position its next token takes); a request that ``continues`` it prefills only the tokens past
  those, images through their M-RoPE positions (``engines/trajectory.py``), on the parked KV, so no
  earlier turn is computed again. Parked sequences are dropped with a weight load (their KV came
  from the old weights).
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollplex.engines.base import (
    DecodeEngine,
    DecodeRequest,
    EngineContext,
    EngineSpec,
    FinishedSequence,
    Option,
    register_engine,
)
from rollplex.errors import EngineError

# rollplex.engines.vlm imports transformers: it is imported inside the methods that need it, so that
# `import rollplex.engines` stays fast.

# Checkpoint-style names (as in model.safetensors) -> the module names transformers 5 uses.
_LEGACY_PREFIXES = (("model.layers.", "model.language_model.layers."),
                    ("model.embed_tokens.", "model.language_model.embed_tokens."),
                    ("model.norm.", "model.language_model.norm."),
                    ("visual.", "model.visual."))


@dataclass
class _Group:
    """Requests that share one prefill."""

    prompt: object  # tasks.lm.PromptInputs
    vis: object  # tasks.lm.VisionEmbeds
    requests: list[DecodeRequest]


@dataclass
class _Parked:
    """A finished sample kept for its continuation: the KV of every token it was fed."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [1, kv_heads, len(ids), head_dim]
    ids: list[int]  # the tokens in the KV: its prompt and all its sampled tokens but the last
    next_pos: int  # the M-RoPE text position of the next token fed (the last sampled one)


class _SlotCache:
    """Just enough of HF's ``Cache`` for decoding: write the new column, return the filled view."""

    def __init__(self, rows: _Rows) -> None:
        self.rows = rows

    def update(self, key, value, layer_idx, *args, **kwargs):
        r = self.rows
        r.k[layer_idx][:, :, r.t : r.t + 1] = key
        r.v[layer_idx][:, :, r.t : r.t + 1] = value
        return r.k[layer_idx][:, :, : r.t + 1], r.v[layer_idx][:, :, : r.t + 1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.rows.t


class _Rows:
    """The live sequences: per-row device tensors plus the shared KV buffer."""

    def __init__(self, k, v, valid, t, logits, pos, temp, top_p, stop, max_new, reqs, gens, out_width):
        self.k, self.v, self.valid, self.t = k, v, valid, t  # KV [B,H,C,D] per layer; valid [B,C]
        self.logits, self.pos = logits, pos  # next-token logits [B,V] f32; next text position [B]
        self.temp, self.top_p, self.stop, self.max_new = temp, top_p, stop, max_new
        self.reqs, self.gens = reqs, gens  # host lists, one per row
        self.last: torch.Tensor | None = None  # tokens sampled but not yet fed [B]
        device = logits.device
        self.n_gen = torch.zeros(len(reqs), dtype=torch.long, device=device)
        self.tokens = torch.zeros(len(reqs), out_width, dtype=torch.long, device=device)
        self.logps = torch.zeros(len(reqs), out_width, dtype=torch.float32, device=device)
        self.padded = not bool(valid[:, :t].all())
        self.any_top_p = any(r.top_p < 1.0 and r.temperature > 0 for r in reqs)

    def __len__(self) -> int:
        return len(self.reqs)

    def select(self, keep: torch.Tensor, keep_list: list[int]) -> None:
        """Keep rows ``keep`` (device index) and drop columns that are padding in every kept row."""
        first = int(self.valid[keep, : self.t].float().argmax(1).min()) if self.padded and keep_list else 0
        for layer in range(len(self.k)):
            self.k[layer] = self.k[layer][keep, :, first:]
            self.v[layer] = self.v[layer][keep, :, first:]
        self.valid = self.valid[keep, first:]
        self.t -= first
        for name in ("logits", "pos", "temp", "top_p", "stop", "max_new", "n_gen", "tokens", "logps"):
            setattr(self, name, getattr(self, name)[keep])
        self.reqs = [self.reqs[i] for i in keep_list]
        self.gens = [self.gens[i] for i in keep_list]
        self.padded = self.padded and not bool(self.valid[:, : self.t].all())
        self.any_top_p = any(r.top_p < 1.0 and r.temperature > 0 for r in self.reqs)


class TorchDecodeEngine(DecodeEngine):
    """Options: max_num_seqs (rows decoded at once; groups wait beyond it), attn_implementation
    ("sdpa" or "eager"), share_model (a colocated trainer's module, used as is: no second copy)."""

    def __init__(self, ctx: EngineContext) -> None:
        from transformers import Qwen2_5_VLForConditionalGeneration

        opts = dict(ctx.options)
        attn = opts.get("attn_implementation", "sdpa")
        if attn not in ("sdpa", "eager"):  # both take the additive 4-D mask we build
            raise EngineError(f"engine 'hf': attn_implementation {attn!r} is not 'sdpa' or 'eager'")
        self.device = torch.device(ctx.device)
        shared = opts.get("share_model")  # a colocated trainer's module: decode runs on its storage
        self.shares_module = shared is not None
        if shared is not None:
            self.model = shared
        else:
            self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                str(ctx.model_path), dtype=ctx.dtype, attn_implementation=attn).to(self.device).eval()
            self.model.requires_grad_(False)
        text = self.model.config.text_config
        kinds = set(text.layer_types)
        if kinds != {"full_attention"}:
            raise EngineError(f"engine 'hf': layer types {sorted(kinds)} are not supported (full attention only)")
        self._layer_types = kinds
        self.eos_token_ids = eos_token_ids(ctx.model_path, self.model.config)
        self.max_num_seqs = int(opts.get("max_num_seqs") or 1 << 30)
        self._params = dict(self.model.named_parameters())
        self._params.update(dict(self.model.named_buffers()))
        self._lock = threading.Lock()
        self._pending: list[_Group] = []
        self._rows: _Rows | None = None
        self._ids: set[str] = set()  # live parent requests
        self._parent_of: dict[str, tuple[str, int, int]] = {}  # row id -> (request id, sample, n)
        self._children: dict[str, list[FinishedSequence]] = {}  # finished samples per live request
        self._parked: dict[tuple[str, int], _Parked] = {}  # (request id, sample) -> its KV, to continue
        self._cached: dict[str, int] = {}  # row id -> prompt tokens it took from a parked KV

    # ----------------------------------------------------------------------------------------------
    def add_requests(self, requests: Sequence[DecodeRequest]) -> None:
        with self._lock:
            for parent in requests:
                if parent.request_id in self._ids:
                    raise EngineError(f"request {parent.request_id}: a live request has this id already")
                if parent.max_tokens < 1 or parent.n < 1:
                    raise EngineError(f"request {parent.request_id}: max_tokens and n must be >= 1")
                self._ids.add(parent.request_id)
                self._children[parent.request_id] = []
                for i in range(parent.n):  # sample i is a row of its own, seeded seed + i (as in vLLM)
                    self._parent_of[f"{i}_{parent.request_id}"] = (parent.request_id, i, parent.n)
                    self._add_row(dataclasses.replace(parent, request_id=f"{i}_{parent.request_id}",
                                                      seed=parent.seed + i, n=1))

    def _add_row(self, req: DecodeRequest) -> None:
        """Queue one sample; samples of the same prompt (ids and embeddings) share one prefill group."""
        from rollplex.engines.vlm import PromptInputs, VisionEmbeds

        group = None if req.continues else next((g for g in self._pending if not g.requests[0].continues
                                                  and _same_prompt(g.requests[0], req)), None)
        if group is None:
            prompt = PromptInputs(req.request_id, torch.tensor(req.prompt_token_ids, dtype=torch.long),
                                  image_grid_thw=None if req.image_grid_thw is None
                                  else req.image_grid_thw.reshape(-1, 3).cpu(),
                                  video_grid_thw=None if req.video_grid_thw is None
                                  else req.video_grid_thw.reshape(-1, 3).cpu(),
                                  second_per_grid_ts=req.second_per_grid_ts)
            group = _Group(prompt, VisionEmbeds(image=req.image_embeds, video=req.video_embeds), [])
            self._pending.append(group)
        group.requests.append(req)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._pending) or (self._rows is not None and len(self._rows) > 0)

    def step(self, max_tokens: int) -> list[FinishedSequence]:
        done: list[FinishedSequence] = []
        with self._lock, torch.no_grad():
            self._admit()
            for _ in range(max_tokens):
                rows = self._rows
                if rows is None or not len(rows):
                    break
                done += self._sample_once(rows)
                if len(rows):
                    self._forward(rows)
        return done

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._lock, torch.no_grad():
            if self._pending or (self._rows is not None and len(self._rows)):
                raise EngineError(f"engine 'hf': load_weights while {len(self._ids)} request(s) are live; "
                                  "finish or drop them first")
            self._parked.clear()  # their KV came from the old weights
            if self.shares_module:
                # It runs the trainer's module itself: the update is there already, and LoRA adapters
                # are served as they are, unmerged (``named_tensors``, merged, is not read).
                return
            for name, tensor in named_tensors:
                target = self._params.get(name)
                if target is None:
                    alias = next((new + name[len(old):] for old, new in _LEGACY_PREFIXES if name.startswith(old)), None)
                    target = self._params.get(alias) if alias else None
                if target is None:
                    raise EngineError(f"engine 'hf': load_weights got tensor {name!r}, which the model does not "
                                      f"have (names look like {next(iter(self._params))!r})")
                if target.shape != tensor.shape:
                    raise EngineError(f"engine 'hf': load_weights tensor {name!r} has shape "
                                      f"{tuple(tensor.shape)}, the model's is {tuple(target.shape)}")
                if target.data_ptr() != tensor.data_ptr():  # a shared tensor is current already
                    target.copy_(tensor)

    def close(self) -> None:
        with self._lock:
            self._rows = None
            self._pending.clear()
            self.model = None

    # ----------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Prefill pending groups (up to max_num_seqs live rows) and merge them into the batch."""
        live = len(self._rows) if self._rows is not None else 0
        take: list[_Group] = []
        while self._pending and (live == 0 or live + len(self._pending[0].requests) <= self.max_num_seqs):
            group = self._pending.pop(0)
            take.append(group)
            live += len(group.requests)
        if not take:
            return
        from rollplex.engines.vlm import prefix_forward

        parts = [self._rows] if self._rows is not None and len(self._rows) else []
        for group in take:
            state = self._continued(group) if group.requests[0].continues else None
            if state is None:
                state = prefix_forward(self.model, group.prompt, group.vis, grad=False)
            parts.append(self._rows_from_prefix(group, state))
        self._rows = _merge(parts)

    def _continued(self, group: _Group):
        """The prefix state of a continuation: its parked sequence's KV extended by the tokens past it
        (the last sampled token, the environment's answer and its images), or None where nothing
        fitting is parked (then the whole context is prefilled, and counted as computed)."""
        from transformers import DynamicCache

        from rollplex.engines.trajectory import embed_segment, next_position, segment_positions
        from rollplex.engines.vlm import PrefixState

        req = group.requests[0]
        parked = self._parked.pop(req.continues, None)
        ids = req.prompt_token_ids
        if parked is None or ids[: len(parked.ids)] != parked.ids or len(ids) == len(parked.ids):
            self._cached[req.request_id] = 0
            return None
        new = ids[len(parked.ids):]
        pad = self.model.config.image_token_id
        pads, images = _pad_runs(new, pad)
        embeds = req.image_embeds[req.image_embeds.shape[0] - pads:] if pads else None
        grids = req.image_grid_thw.reshape(-1, 3)[-images:] if images else None
        positions = segment_positions(self.model, new, grids, parked.next_pos)
        cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in parked.kv])
        out = self.model.model.language_model(
            inputs_embeds=embed_segment(self.model, torch.tensor([new], device=self.device), embeds),
            position_ids=positions.view(3, 1, -1).to(self.device), past_key_values=cache, use_cache=True)
        length = len(ids)
        self._cached[req.request_id] = len(parked.ids)
        return PrefixState(kv=[(k, v) for k, v, *_ in out.past_key_values],
                           last_logits=self.model.lm_head(out.last_hidden_state[0, -1]).float(),
                           rope_delta=next_position(positions, parked.next_pos) - length, length=length)

    def _rows_from_prefix(self, group: _Group, state) -> _Rows:
        reqs, n, device = group.requests, len(group.requests), self.device
        budget = max(r.max_tokens for r in reqs)
        stop = _stop_matrix([sorted(set(r.stop_token_ids) | set(self.eos_token_ids)) for r in reqs], device)
        gens = []
        for r in reqs:  # greedy rows draw no noise
            gens.append(torch.Generator(device=device).manual_seed(r.seed) if r.temperature > 0 else None)
        return _Rows(  # the KV stays an expanded view of the prefix until _merge copies it
            [kk.expand(n, -1, -1, -1) for kk, _ in state.kv], [vv.expand(n, -1, -1, -1) for _, vv in state.kv],
            torch.ones(n, state.length, dtype=torch.bool, device=device), state.length,
            logits=state.last_logits.float().view(1, -1).expand(n, -1).contiguous(),
            pos=torch.full((n,), state.length + state.rope_delta, dtype=torch.long, device=device),
            temp=torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=device),
            top_p=torch.tensor([r.top_p for r in reqs], dtype=torch.float32, device=device),
            stop=stop,
            max_new=torch.tensor([r.max_tokens for r in reqs], dtype=torch.long, device=device),
            reqs=list(reqs), gens=gens, out_width=budget,
        )

    def _sample_once(self, rows: _Rows) -> list[FinishedSequence]:
        tok, logp = _sample(rows.logits, rows.temp, rows.top_p, rows.gens, rows.any_top_p)
        col = rows.n_gen.view(-1, 1)
        rows.tokens.scatter_(1, col, tok.view(-1, 1))
        rows.logps.scatter_(1, col, logp.view(-1, 1))
        rows.n_gen += 1
        stopped = (tok.view(-1, 1) == rows.stop).any(1)
        fin = stopped | (rows.n_gen >= rows.max_new)
        rows.last = tok
        if not bool(fin.any()):  # the one host sync per token
            return []
        fin_h, stopped_h, n_h = fin.cpu().tolist(), stopped.cpu().tolist(), rows.n_gen.cpu().tolist()
        idx = [i for i, f in enumerate(fin_h) if f]
        toks, lps = rows.tokens[idx].cpu().tolist(), rows.logps[idx].cpu().tolist()
        out = []
        for j, i in enumerate(idx):
            req = rows.reqs[i]
            parent, sample, n = self._parent_of.pop(req.request_id)
            if req.keep_kv:
                self._park(rows, i, (parent, sample), req.prompt_token_ids + toks[j][: n_h[i] - 1])
            seqs = self._children[parent]
            seqs.append(FinishedSequence(parent, toks[j][: n_h[i]], lps[j][: n_h[i]],
                                         "stop" if stopped_h[i] else "length", index=sample,
                                         cached_tokens=self._cached.pop(req.request_id, None)))
            if len(seqs) == n:  # a request is handed on when all its samples are done, as vLLM does
                self._ids.discard(parent)
                out.extend(sorted(self._children.pop(parent), key=lambda f: f.index))
        keep_list = [i for i, f in enumerate(fin_h) if not f]
        keep = torch.tensor(keep_list, dtype=torch.long, device=self.device)
        rows.last = tok[keep]
        rows.select(keep, keep_list)
        return out

    def _park(self, rows: _Rows, i: int, key: tuple[str, int], ids: list[int]) -> None:
        """Keep row ``i``'s KV (its valid columns: rows are left-padded) for a continuation."""
        first = rows.t - len(ids)
        self._parked[key] = _Parked([(k[i: i + 1, :, first: rows.t].clone(), v[i: i + 1, :, first: rows.t].clone())
                                     for k, v in zip(rows.k, rows.v)], ids, int(rows.pos[i]))

    def _forward(self, rows: _Rows) -> None:
        """Feed each row's last sampled token; leave the next logits in ``rows.logits``."""
        n, t = len(rows), rows.t
        if t >= rows.k[0].shape[2]:
            raise EngineError("engine 'hf': KV buffer overflow (a row decoded past its max_tokens)")
        rows.valid[:, t] = True
        mask = None
        if rows.padded:
            dtype = rows.k[0].dtype
            mask = torch.zeros(n, 1, 1, t + 1, dtype=dtype, device=self.device)
            mask.masked_fill_(~rows.valid[:, : t + 1].view(n, 1, 1, -1), torch.finfo(dtype).min)
        lm = self.model.model.language_model
        out = lm(
            inputs_embeds=self.model.get_input_embeddings()(rows.last.view(n, 1)),
            position_ids=rows.pos.view(1, n, 1).expand(3, n, 1),
            past_key_values=_SlotCache(rows),
            attention_mask={kind: mask for kind in self._layer_types},  # a dict skips HF's mask builder
            use_cache=True,
        )
        rows.t += 1
        rows.pos += 1
        rows.logits = self.model.lm_head(out.last_hidden_state[:, -1]).float()


# --------------------------------------------------------------------------------------------------
def _sample(logits, temp, top_p, gens, any_top_p: bool):
    """Sampled tokens [B] and their log-probs under the distribution drawn from.

    Temperature 0 is greedy; its log-prob is log_softmax of the raw logits (as vLLM reports it).
    """
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp).view(-1, 1)
    if any_top_p:
        scaled = _apply_top_p(scaled, torch.where(greedy, torch.ones_like(top_p), top_p))
    logp = F.log_softmax(scaled, dim=-1)
    if all(g is None for g in gens):
        tok = logits.argmax(-1)
    else:
        q = torch.ones_like(logp)
        for i, g in enumerate(gens):  # one small kernel per sampled row: per-request reproducible noise
            if g is not None:
                q[i].exponential_(generator=g)
        tok = torch.where(greedy, logits.argmax(-1), (logp.exp() / q).argmax(-1))
    return tok, logp.gather(1, tok.view(-1, 1)).view(-1)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens outside the nucleus, the way vLLM's sampler does (always keeps the top one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum <= (1 - top_p).view(-1, 1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _stop_matrix(stop_lists: list[list[int]], device) -> torch.Tensor:
    width = max(1, max(len(s) for s in stop_lists))
    m = torch.full((len(stop_lists), width), -1, dtype=torch.long)
    for i, s in enumerate(stop_lists):
        m[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return m.to(device)


def _merge(parts: list[_Rows]) -> _Rows:
    """One batch in fresh buffers, rows right-aligned at a common column so all write at the same t,
    with room for the longest remaining budget."""
    t = max(p.t for p in parts)
    budget = max(int((p.max_new - p.n_gen).max()) for p in parts)
    width = max(p.tokens.shape[1] for p in parts)
    n, c = sum(len(p) for p in parts), t + budget
    ref = parts[0]
    k = [torch.zeros(n, x.shape[1], c, x.shape[3], dtype=x.dtype, device=x.device) for x in ref.k]
    v = [torch.zeros_like(x) for x in k]
    valid = torch.zeros(n, c, dtype=torch.bool, device=ref.valid.device)
    stop_w = max(p.stop.shape[1] for p in parts)
    row = 0
    for p in parts:
        m, off = len(p), t - p.t
        for layer in range(len(k)):
            k[layer][row : row + m, :, off:t] = p.k[layer][:, :, : p.t]
            v[layer][row : row + m, :, off:t] = p.v[layer][:, :, : p.t]
        valid[row : row + m, off:t] = p.valid[:, : p.t]
        row += m
    merged = _Rows(
        k, v, valid, t,
        logits=torch.cat([p.logits for p in parts]),
        pos=torch.cat([p.pos for p in parts]),
        temp=torch.cat([p.temp for p in parts]),
        top_p=torch.cat([p.top_p for p in parts]),
        stop=torch.cat([F.pad(p.stop, (0, stop_w - p.stop.shape[1]), value=-1) for p in parts]),
        max_new=torch.cat([p.max_new for p in parts]),
        reqs=[r for p in parts for r in p.reqs], gens=[g for p in parts for g in p.gens], out_width=width,
    )
    merged.n_gen = torch.cat([p.n_gen for p in parts])
    merged.tokens = torch.cat([F.pad(p.tokens, (0, width - p.tokens.shape[1])) for p in parts])
    merged.logps = torch.cat([F.pad(p.logps, (0, width - p.logps.shape[1])) for p in parts])
    return merged


def eos_token_ids(model_path, config) -> tuple[int, ...]:
    """EOS ids from the config (top level and text_config) and generation_config.json, if any."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    sources = [getattr(config, "text_config", None), config]
    try:
        sources.append(GenerationConfig.from_pretrained(str(model_path)))
    except OSError:  # no generation_config.json
        pass
    for src in sources:
        eos = getattr(src, "eos_token_id", None)
        ids.update(int(e) for e in ([eos] if isinstance(eos, int) else (eos or [])))
    return tuple(sorted(ids))


def _pad_runs(ids: list[int], pad: int) -> tuple[int, int]:
    """(image pad tokens, runs of them: images) in ``ids``."""
    count = runs = 0
    for i, t in enumerate(ids):
        if t == pad:
            count += 1
            runs += i == 0 or ids[i - 1] != pad
    return count, runs


def _same_prompt(a: DecodeRequest, b: DecodeRequest) -> bool:
    """Same prompt ids and the same vision embeddings (identity first; equality as a fallback)."""
    if a.prompt_token_ids != b.prompt_token_ids:
        return False
    for x, y in ((a.image_embeds, b.image_embeds), (a.image_grid_thw, b.image_grid_thw),
                 (a.video_embeds, b.video_embeds), (a.video_grid_thw, b.video_grid_thw)):
        if x is y:
            continue
        if x is None or y is None or x.shape != y.shape or not torch.equal(x, y):
            return False
    return True


SPEC = register_engine(EngineSpec(
    name="hf",
    role="decode",
    factory=TorchDecodeEngine,
    requires=("transformers",),
    description="transformers/torch decode with shared prefills and batched left-padded KV",
    options={"max_num_seqs": Option(int, 1, 2**20), "attn_implementation": Option(str, choices=("sdpa", "eager"))},
))
