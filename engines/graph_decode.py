"""A static-KV decode engine in plain torch whose decode step is one CUDA graph per batch size.

Where vLLM's CUDA build is absent (the lent GPU machine), this is the decode engine; its interface is
vLLM's (``DecodeEngine``). HF's eager decode is bound by kernel launches (tens of ms per step for a
3B model), so the step here is written for capture instead:

- The KV cache is preallocated per layer. With ``shared_prefix`` (the default) a prompt's KV (from
  ``engines.vlm.prefix_forward_batch``, once per prompt) fills one slot of a prefix cache,
  [prefix_slots, kv_heads, max_prompt_len, head_dim], that its n rows read; each row's own cache,
  [rows, kv_heads, max_response_len, head_dim], holds its response. So a step reads a group's prompt
  KV once, not once per row (at 8 samples of a 1088-token prompt, 7/8 of the prompt bytes), and the
  cache holds it once. Without it, the prompt KV is copied into each of its rows, [rows, kv_heads,
  max_model_len, head_dim]. Each step writes one slot per row at its own position (``index_put_``).
- Attention reads each row's filled slots only, on CUDA (option ``attention``: ``fused``, the
  default there where q|k|v are one tensor: one launch rotates q and k, writes the step's k and v
  and attends, ``engines/decode_attention.py``; ``split-kv``: the same without the rotary and the
  cache write); elsewhere it is SDPA's
  grouped-query mode over all slots under a length mask. Either way: no repeat of K/V per query
  head, fixed shapes.
- Sampling runs inside the step: a counter-based hash of (request seed, token index, vocab id) gives
  each row its uniform noise, so a row's tokens do not depend on the batch, the graph or the chunking.
  Gumbel-max over logits / temperature draws the token; its log-prob is taken from the same
  distribution.
- Graphs are captured for a few batch sizes. When rows finish, the live ones are packed to the front
  and the next step replays the smallest graph that holds them, so the long tail runs small graphs.
- A request's samples are handed on one by one as each finishes (vLLM hands on a request whole),
  so stage fusion scores each sample in the decode window.
- Tensor parallel (option ``tp_group``, a torch.distributed group): each rank's step reads its share
  of the attention heads and MLP columns as views of its own full copy (a data-parallel trainer's
  replica), its KV cache holds its heads only, and the attention output and MLP partial sums are
  all-reduced. Every rank gets the same requests and samples the same tokens (replicated logits,
  counter-based noise), so each hands on every sample. The prefill runs on the full copy.
On CPU (and wherever CUDA graphs are off) the same step runs eagerly: CI tests this path. The
step's tensor functions (noise, sampler, decoder layer) are in ``engines/decode_step.py``.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from rollplex.engines import decode_attention
from rollplex.engines.attention_kernels import graph_attention_kernels
from rollplex.engines.base import (
    DecodeEngine,
    DecodeRequest,
    EngineContext,
    EngineSpec,
    FinishedSequence,
    Option,
    register_engine,
)
from rollplex.engines.decode_attention import PREFIX_MEMBERS
from rollplex.engines.decode_batch import MAX_STOP_TOKENS, _Batch, _Row, _Slot, _prompt_key
from rollplex.engines.decode_step import _Weights, _advance, _decoder_layer, _head
from rollplex.engines.torch_decode import eos_token_ids
from rollplex.errors import EngineError

class GraphDecodeEngine(DecodeEngine):
    """Options: max_num_seqs (rows), max_model_len (KV slots per row), graph_batch_sizes (captured;
    default powers of two up to max_num_seqs), cuda_graphs (default True on CUDA), steps_per_graph
    (decode steps per graph launch; default 1), compile (the
    decoder layer and the sampler through torch.compile, true or a compile mode; default off), share_model (an HF model whose weights the
    engine uses in place: no second copy), tp_group (a torch.distributed group: tensor parallel over
    its ranks, each with a full copy of the model), attention (``fused``: up to each row's length,
    with the rotary and the cache write in the kernel, the default on CUDA where Triton is present
    and q|k|v lie in one tensor; ``split-kv``: the same in separate kernels, the default otherwise;
    ``sdpa``: SDPA over every slot under a length mask),
    shared_prefix (default true: a prompt's KV held once for its rows), prefix_slots (prompts resident
    at once; default max_num_seqs), max_prompt_len and max_response_len (the two caches' slots;
    default max_model_len each)."""

    def __init__(self, ctx: EngineContext) -> None:
        opts = dict(ctx.options)
        self.device = torch.device(ctx.device)
        model = opts.get("share_model")
        if model is None:
            from transformers import Qwen2_5_VLForConditionalGeneration

            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(ctx.model_path), dtype=ctx.dtype)
            model = model.to(self.device).eval().requires_grad_(False)
        self.model = model
        text = model.config.get_text_config()
        if set(getattr(text, "layer_types", ["full_attention"])) != {"full_attention"}:
            raise EngineError("engine 'torch-graph': only full-attention models are supported")
        self.tp_group = opts.get("tp_group")
        tp_rank, tp_size = 0, 1
        if self.tp_group is not None:
            import torch.distributed as dist

            tp_rank, tp_size = dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
        self.tensor_parallel = (tp_rank, tp_size)  # this rank's share of the heads, of how many
        self.w = _Weights(model, tp_rank, tp_size)
        self._reduce = self._all_reduce if tp_size > 1 else None
        self.vocab = text.vocab_size
        self.dtype = self.w.embed.dtype
        self.eos_token_ids = eos_token_ids(ctx.model_path, model.config)
        self.rows = int(opts.get("max_num_seqs") or 64)
        self.max_len = int(opts.get("max_model_len") or 2048)
        self.use_graphs = bool(opts.get("cuda_graphs", self.device.type == "cuda"))
        self.shared_prefix = bool(opts.get("shared_prefix", True))
        self.split_kv, self.layer_kernel = self._attention(opts.get("attention"))
        self._linear = self._projections(opts.get("linear"))
        self.max_prompt_len = int(opts.get("max_prompt_len") or self.max_len)
        self.max_response_len = int(opts.get("max_response_len") or self.max_len)
        self._slots: list[_Slot | None] = [None] * int(opts.get("prefix_slots") or self.rows)
        self._slot_of_key: dict[tuple, int] = {}
        # compile: the decoder layer through torch.compile (fused norm/rope/residual kernels), compiled
        # once per batch size on first use (warm-up), then captured into the CUDA graphs as usual.
        self._layer, self._advance, self._head = _decoder_layer, _advance, _head
        if opts.get("compile"):
            from torch._dynamo import config as dynamo_config

            # One compiled layer per (batch size, device): 8 sizes on each of a process's engines
            # passes dynamo's default limit of 8, past which it would fall back to eager silently.
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
            # compile: true, or a torch.compile mode ("max-autotune-no-cudagraphs": Triton GEMMs
            # tuned for the step's skinny shapes; the engine captures CUDA graphs itself).
            mode = None if opts["compile"] is True or opts["compile"] in ("true", "default") else str(opts["compile"])
            if mode not in (None, "max-autotune-no-cudagraphs"):  # the others capture CUDA graphs of their own
                raise EngineError(f"engine 'torch-graph': compile {opts['compile']!r} is not one of true, default, "
                                  f"max-autotune-no-cudagraphs")
            if self.use_graphs and torch.cuda.get_allocator_backend() == "cudaMallocAsync":
                # Measured on an H200: Triton kernels captured in a step graph get pointers the
                # stream-ordered pool maps only at replay, and refuse them ("Pointer argument
                # cannot be accessed from Triton"); the process then aborts.
                raise EngineError("engine 'torch-graph': compile needs the native CUDA allocator; under "
                                  "cudaMallocAsync (cluster.cuda_allocator / --cuda-allocator async) set "
                                  "compile: false")
            self._layer = torch.compile(_decoder_layer, dynamic=False, mode=mode)
            self._advance = torch.compile(_advance, dynamic=False, mode=mode)
            self._head = torch.compile(_head, dynamic=False, mode=mode)
        sizes = opts.get("graph_batch_sizes") or [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < self.rows]
        self.sizes = sorted({int(b) for b in sizes if b <= self.rows} | {self.rows})
        if self.shared_prefix:
            self.batch = _Batch(self.w, self.rows, self.max_response_len, len(self.w.layers), self.vocab, self.dtype,
                                self.device, prefix=(len(self._slots), self.max_prompt_len))
        else:
            self.batch = _Batch(self.w, self.rows, self.max_len, len(self.w.layers), self.vocab, self.dtype,
                                self.device)
        self._graphs: dict[tuple[int, bool, int, int], torch.cuda.CUDAGraph] = {}
        self._graph_pool = None  # the graphs' shared memory pool (_capture)
        # Steps per graph launch; a call's remainder below it runs one-step graphs.
        self.steps_per_graph = max(1, int(opts.get("steps_per_graph") or 1))
        self._lock = threading.Lock()
        self._pending: list[DecodeRequest] = []
        self._live: list[_Row | None] = [None] * self.rows  # row slot -> what it decodes
        self._children: dict[str, int] = {}  # live request id -> samples handed on so far
        self._admitting = 0  # rows whose prefill runs now (live_rows counts them)
        self._prefilled = None  # CUDA event after the last prefill's kernels
        self._pinned: dict[str, torch.Tensor] | None = None  # host buffers for finished rows (CUDA)
        self._step_seconds: dict[int, dict[int, float]] = {}  # stream -> {graph batch: step seconds}
        self.steps_run = 0

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(partial, group=self.tp_group)  # NCCL's is captured into the step's CUDA graph
        return partial

    # -- the interface -----------------------------------------------------------------------------
    def add_requests(self, requests: Sequence[DecodeRequest]) -> None:
        with self._lock:
            for req in requests:
                if req.request_id in self._children:
                    raise EngineError(f"request {req.request_id}: a live request has this id already")
                stops = set(req.stop_token_ids) | set(self.eos_token_ids)
                if len(stops) > MAX_STOP_TOKENS:
                    raise EngineError(f"request {req.request_id}: {len(stops)} stop tokens (EOS ids included); "
                                      f"engine 'torch-graph' checks at most {MAX_STOP_TOKENS} per row")
                if self.shared_prefix and len(req.prompt_token_ids) > self.max_prompt_len:
                    raise EngineError(f"request {req.request_id}: prompt {len(req.prompt_token_ids)} tokens exceeds "
                                      f"max_prompt_len {self.max_prompt_len}")
                if self.shared_prefix and req.max_tokens > self.max_response_len:
                    raise EngineError(f"request {req.request_id}: max_tokens {req.max_tokens} exceeds "
                                      f"max_response_len {self.max_response_len}")
                if len(req.prompt_token_ids) + req.max_tokens > self.max_len:
                    raise EngineError(f"request {req.request_id}: prompt {len(req.prompt_token_ids)} + max_tokens "
                                      f"{req.max_tokens} exceeds max_model_len {self.max_len}")
                self._children[req.request_id] = 0
                self._pending.append(req)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._pending) or any(r is not None for r in self._live)

    def step(self, max_tokens: int) -> list[FinishedSequence]:
        with self._lock, torch.no_grad():
            self._admit()
            done: list[FinishedSequence] = []
            # Rows leave only at _collect, so the batch (its graph size, whether any row samples
            # with top-p) holds for the whole call, and k steps can be one graph: the decode thread
            # then launches once per k tokens, which a busy compute thread (the GIL, the driver)
            # delays k times less often.
            live = self._live_count()
            if live:
                n = self._graph_size(live)
                top_p = any(r is not None and r.request.top_p < 1.0 and r.request.temperature > 0 for r in self._live)
                left = max_tokens
                while left > 0:
                    k = self.steps_per_graph if self.use_graphs and left >= self.steps_per_graph else 1
                    self._run_steps(n, top_p, k)
                    left -= k
            done += self._collect()
            return done

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._lock, torch.no_grad():
            if self._pending or any(r is not None for r in self._live):
                raise EngineError("engine 'torch-graph': load_weights while requests are live")
            # Tied weights (lm_head = embed_tokens) appear under both names in a state dict.
            params = dict(self.model.named_parameters(remove_duplicate=False))
            for name, tensor in named_tensors:
                target = params.get(name)
                if target is None:
                    raise EngineError(f"engine 'torch-graph': unknown tensor {name!r}")
                if target.data_ptr() != tensor.data_ptr():  # a shared tensor is current already
                    target.copy_(tensor)

    def close(self) -> None:
        with self._lock:
            self._graphs.clear()
            self.batch = None

    def capture_graphs(self, stream, top_p: bool = False) -> None:
        """Capture the step for every batch size on ``stream`` now (an SM partition's stream, before
        its decode window), not on first use: each capture synchronizes the whole device."""
        if not self.use_graphs:
            return
        with self._lock, torch.no_grad():
            for n in self.sizes:
                for steps in sorted({1, self.steps_per_graph}):
                    self._graph(n, top_p, stream, steps)

    def step_seconds_on(self, stream) -> dict[int, float]:
        """{batch size: seconds per step} of the graphs captured on ``stream`` (timed at capture)."""
        return dict(self._step_seconds.get(stream.cuda_stream, {}))

    def live_rows(self) -> int:
        """Rows decoding now (read without the lock: a scheduling hint, not bookkeeping)."""
        return sum(r is not None for r in self._live) + sum(r.n for r in self._pending) + self._admitting

    def prefilling(self) -> bool:
        """Whether a prefill is queued, being launched, or still running on the device. A prefill is
        compute-bound, so work beside it slows it as much as it gains (WorkerHost's prefill gate)."""
        if self._admitting or (self._pending and not self._live_count()):
            return True
        return self._prefilled is not None and not self._prefilled.query()

    # -- admission: prefill queued prompts into free rows ----------------------------------------
    def _live_count(self) -> int:
        return sum(r is not None for r in self._live)

    def _admit(self) -> None:
        from rollplex.engines.vlm import PromptInputs, VisionEmbeds, prefix_forward_batch

        free = [i for i, r in enumerate(self._live) if r is None]
        free_slots = sum(slot is None for slot in self._slots)
        take, new_keys = [], set()
        while self._pending and self._pending[0].n <= len(free) - sum(r.n for r in take):
            key = _prompt_key(self._pending[0])
            if self.shared_prefix and key not in self._slot_of_key and key not in new_keys:
                if len(new_keys) == free_slots:
                    break  # every prefix slot is taken: wait for rows to finish
                new_keys.add(key)
            take.append(self._pending.pop(0))
        if not take:
            if self._pending and not self._live_count():
                raise EngineError(f"engine 'torch-graph': a request needs {self._pending[0].n} rows; "
                                  f"max_num_seqs is {self.rows}")
            return
        self._admitting = sum(r.n for r in take)  # neither pending nor live while the prefill runs
        try:
            # Requests for the same prompt (per-sample caps split a group into n=1 requests) share
            # one prefill, as vLLM's prefix cache would: the prompt is the same tokens and embeddings.
            # A prompt resident in the prefix cache is not prefilled again.
            keys = [_prompt_key(r) for r in take]
            first: dict[tuple, int] = {}  # prompt key -> its index among the prompts to prefill
            unique: list[DecodeRequest] = []
            for key, r in zip(keys, take):
                if key not in first and key not in self._slot_of_key:
                    first[key] = len(unique)
                    unique.append(r)
            grid = lambda t: None if t is None else t.reshape(-1, 3)  # noqa: E731
            prompts = [PromptInputs(r.request_id, torch.tensor(r.prompt_token_ids, dtype=torch.long),
                                    image_grid_thw=grid(r.image_grid_thw), video_grid_thw=grid(r.video_grid_thw),
                                    second_per_grid_ts=r.second_per_grid_ts)
                       for r in unique]
            visions = [VisionEmbeds(image=r.image_embeds, video=r.video_embeds) for r in unique]
            states = prefix_forward_batch(self.model, prompts, visions, grad=False) if unique else []
            b, heads = self.batch, self.w.kv_slice  # heads: this tensor-parallel rank's of the full prefill
            if self.shared_prefix:
                for key, u in first.items():  # one KV copy per prompt and layer, into its slot
                    state = states[u]
                    slot = self._slots.index(None)
                    self._slots[slot] = _Slot(key, 0, state.last_logits, state.length, state.rope_delta, unique[u])
                    self._slot_of_key[key] = slot
                    for layer, (k, v) in enumerate(state.kv):
                        b.pk[layer][slot, :, : state.length] = k[0, heads]
                        b.pv[layer][slot, :, : state.length] = v[0, heads]
                for req, key in zip(take, keys):
                    slot = self._slot_of_key[key]
                    self._slots[slot].rows += req.n
                    self._fill_rows(req, [free.pop(0) for _ in range(req.n)], self._slots[slot], slot)
            else:
                rows_of: dict[int, list[int]] = {}
                for req, key in zip(take, keys):
                    rows = [free.pop(0) for _ in range(req.n)]
                    rows_of.setdefault(first[key], []).extend(rows)
                    self._fill_rows(req, rows, states[first[key]])
                for u, rows in rows_of.items():  # one KV copy per prompt and layer, broadcast over its rows
                    state, index = states[u], torch.tensor(rows, device=self.device)
                    for layer, (k, v) in enumerate(state.kv):
                        b.k[layer][index, :, : state.length] = k[:, heads]
                        b.v[layer][index, :, : state.length] = v[:, heads]
            if self.device.type == "cuda":  # prefilling() asks the device, not the host, when it is done
                self._prefilled = torch.cuda.Event()
                self._prefilled.record()
        finally:
            self._admitting = 0
        self._pack()

    def _fill_rows(self, req: DecodeRequest, rows: list[int], state, slot: int = -1) -> None:
        """Per-row state of a request's n samples (the KV is copied per prompt, in ``_admit``).
        ``state``: a PrefixState or a _Slot, either with last_logits, length and rope_delta."""
        b = self.batch
        stops = sorted(set(req.stop_token_ids) | set(self.eos_token_ids))  # at most the width (add_requests)
        index = torch.tensor(rows, device=self.device)
        for sample, row in enumerate(rows):
            self._live[row] = _Row(req.request_id, sample, req.n, req, slot)
        b.logits[index] = state.last_logits
        b.length[index] = 0 if self.shared_prefix else state.length  # the row's own cache: its response
        b.rope_pos[index] = state.length + state.rope_delta
        b.seed[index] = torch.arange(req.seed, req.seed + req.n, device=self.device, dtype=b.seed.dtype)
        b.n_gen[index] = 0
        b.max_new[index] = req.max_tokens
        b.temp[index] = req.temperature
        b.top_p[index] = req.top_p
        b.done[index] = False
        stop = torch.full((b.stop.shape[1],), -1, dtype=torch.long)
        stop[: len(stops)] = torch.tensor(stops, dtype=torch.long)
        b.stop[index] = stop.to(self.device)

    def _pack(self) -> None:
        """Move the live rows to the front, so a small graph covers them all."""
        live = [i for i, r in enumerate(self._live) if r is not None]
        if live != list(range(len(live))):
            self._move_rows(live + [i for i, r in enumerate(self._live) if r is None])
        if self.shared_prefix:
            self._prefix_tables()

    def _move_rows(self, order: list[int]) -> None:
        index = torch.tensor(order, device=self.device)
        b = self.batch
        for layer in range(len(b.k)):  # index_select then copy_: the graphs keep the same storage
            b.k[layer].copy_(b.k[layer].index_select(0, index))
            b.v[layer].copy_(b.v[layer].index_select(0, index))
        for name in ("logits", "length", "rope_pos", "seed", "n_gen", "max_new", "temp", "top_p", "done", "stop",
                     "tokens", "logps"):
            t = getattr(b, name)
            t.copy_(t.index_select(0, index))
        self._live = [self._live[i] for i in order]

    def _prefix_tables(self) -> None:
        """Which rows read which prefix slot, for the step: entries for the split-KV kernel, and per
        row for SDPA. Rebuilt on the host whenever rows come or go (the step's graphs read these
        buffers in place)."""
        b = self.batch
        rows_of: dict[int, list[int]] = {}
        for i, r in enumerate(self._live):
            if r is not None:
                rows_of.setdefault(r.slot, []).append(i)
        entry_slot, entry_len = [0] * self.rows, [0] * self.rows
        members = [[-1] * PREFIX_MEMBERS for _ in range(self.rows)]
        slot_of_row, prompt_len = [0] * self.rows, [0] * self.rows
        e = 0
        for slot, rows in rows_of.items():
            length = self._slots[slot].length
            for at in range(0, len(rows), PREFIX_MEMBERS):
                chunk = rows[at: at + PREFIX_MEMBERS]
                entry_slot[e], entry_len[e], members[e][: len(chunk)] = slot, length, chunk
                e += 1
            for i in rows:
                slot_of_row[i], prompt_len[i] = slot, length
        for name, values in (("entry_slot", entry_slot), ("entry_len", entry_len), ("members", members),
                             ("slot_of_row", slot_of_row), ("prompt_len", prompt_len)):
            t = getattr(b, name)
            t.copy_(torch.tensor(values, dtype=t.dtype))

    def _release_slot(self, slot: int) -> None:
        held = self._slots[slot]
        held.rows -= 1
        if held.rows == 0:
            self._slots[slot] = None
            del self._slot_of_key[held.key]

    def _projections(self, linear: str | None):
        """The layer's projections: cuBLAS (``cublas``, the default) or ``skinny``, the Triton kernel of
        engines/skinny_linear.py at each weight shape's measured tiling, cuBLAS where that is faster
        (``benchmarks/decode_linear.py`` compares them); ``skinny-norm`` also takes the residual add
        and RMS norm into the q|k|v and gate|up launches, and gate|up's SiLU product (fused
        attention's layer only)."""
        if linear in (None, "cublas"):
            return None
        if linear not in ("skinny", "skinny-norm"):
            raise EngineError(f"engine 'torch-graph': linear {linear!r} is not one of cublas, skinny, skinny-norm")
        if self.device.type != "cuda" or not decode_attention.available():
            raise EngineError(f"engine 'torch-graph': linear {linear!r} needs CUDA and Triton; set linear: cublas")
        from rollplex.engines.projections import linear_for
        from rollplex.engines.skinny_linear import tiling_for

        return linear_for(tiling_for, norm=linear == "skinny-norm")

    def _attention(self, attention: str | None) -> tuple[bool, bool]:
        """(split_kv, layer_kernel): whether attention reads each row's filled slots only
        (``split-kv``), and whether it is ``fused``: the split-KV kernel that also rotates q and k and
        writes the step's k and v (``decode_layer_attention``), which needs q|k|v in one tensor and
        one tensor-parallel rank."""
        group = self.w.heads // self.w.kv_heads
        usable = self.device.type == "cuda" and decode_attention.usable(self.w.head_dim, group, self.shared_prefix)
        # As for compile (above): under cudaMallocAsync, a Triton kernel captured in a step graph gets
        # pointers the pool maps only at replay, and refuses them.
        pooled = self.use_graphs and usable and torch.cuda.get_allocator_backend() == "cudaMallocAsync"
        layer_ok = self.w.fused and self.tensor_parallel[1] == 1
        if attention in (None, "auto"):  # fused where it can: a 3B step 5-7% faster at 8 and 64 rows (H100)
            split = usable and not pooled
            return split, split and layer_ok
        if attention not in ("fused", "split-kv", "sdpa"):
            raise EngineError(f"engine 'torch-graph': attention {attention!r} is not one of fused, split-kv, sdpa, "
                              f"auto")
        if attention != "sdpa" and not usable:
            raise EngineError(f"engine 'torch-graph': attention {attention!r} needs CUDA and Triton and a power-of-two "
                              f"head width of at least 16 (device {self.device}, head width {self.w.head_dim})")
        if attention != "sdpa" and pooled:
            raise EngineError(f"engine 'torch-graph': attention {attention!r} under CUDA graphs needs the native CUDA "
                              "allocator; under cudaMallocAsync (cluster.cuda_allocator / --cuda-allocator async) "
                              "set attention: sdpa or auto")
        if attention == "fused" and not layer_ok:
            raise EngineError("engine 'torch-graph': attention 'fused' needs the model's q, k and v projections "
                              "adjacent in memory (engines.sharing.fuse_for_rollout) and no tensor parallelism")
        return attention != "sdpa", attention == "fused"

    def _graph_size(self, live: int) -> int:
        return next(s for s in self.sizes if s >= live)

    # -- the step ------------------------------------------------------------------------------------
    def _step(self, n: int, top_p: bool) -> None:
        """Sample a token for rows [0, n) from their logits, then feed it to get the next logits."""
        b, w = self.batch, self.w
        x, cos, sin, slot, filled = self._advance(b.logits[:n], b.temp[:n], b.top_p[:n], b.seed[:n], b.n_gen[:n], b.done[:n],
                                          b.max_new[:n], b.stop[:n], b.tokens[:n], b.logps[:n], b.rope_pos[:n],
                                          b.length[:n], w.embed, w.inv_freq, top_p, self.layer_kernel)
        if self.split_kv:
            visible = filled
        else:
            valid = (torch.arange(b.max_len, device=x.device).view(1, -1) <= slot.view(-1, 1))  # [n, L]
            if self.shared_prefix:  # the row's prompt slots come first (shared_prefix_attention_sdpa)
                prompt = torch.arange(b.prefix_len, device=x.device).view(1, -1) < b.prompt_len[:n].view(-1, 1)
                valid = torch.cat([prompt, valid], dim=1)
            visible = torch.zeros(valid.shape, dtype=x.dtype, device=x.device).masked_fill(~valid, float("-inf"))
            visible = visible.view(n, 1, 1, -1)
        where = None  # the layer kernel writes the step's k and v itself
        if not self.layer_kernel:
            where = (torch.arange(n, device=x.device).view(-1, 1), torch.arange(w.kv_heads, device=x.device).view(1, -1),
                     slot.view(-1, 1))
        residual = torch.zeros_like(x)
        for i, (weights, eps) in enumerate(w.layer_args):
            prefix = None
            if self.layer_kernel:
                prefix = ("layer", *((b.pk[i], b.pv[i], b.entry_slot[:n], b.entry_len[:n], b.members[:n],
                                      b.prompt_len[:n]) if self.shared_prefix else (None,) * 6))
            elif self.shared_prefix and not self.split_kv:
                prefix = ("sdpa", b.pk[i], b.pv[i], b.slot_of_row[:n])
            elif self.shared_prefix:
                prefix = ("groups", b.pk[i], b.pv[i], b.entry_slot[:n], b.entry_len[:n], b.members[:n])
            x, residual = self._layer(x, residual, cos, sin, visible, where, b.k[i], b.v[i], weights, eps,
                                      w.heads, w.kv_heads, w.head_dim, w.attn_scale, self._reduce, prefix,
                                      self._linear)
        self._head(x, residual, w.norm_w, w.eps, w.lm_head, b.logits[:n], b.length[:n], b.rope_pos[:n])

    def _run_steps(self, n: int, top_p: bool, k: int) -> None:
        self.steps_run += k
        if not self.use_graphs:
            for _ in range(k):
                self._step(n, top_p)
            return
        self._graph(n, top_p, torch.cuda.current_stream(self.device), k).replay()

    def _graph(self, n: int, top_p: bool, stream: torch.cuda.Stream, steps: int = 1) -> torch.cuda.CUDAGraph:
        """The graph of ``steps`` steps for n rows on ``stream``, captured there on first use. Graphs
        belong to the stream they were captured on: one captured on an ordinary stream uses every SM
        even when replayed on a green context's stream, so each stream gets its own."""
        key = (n, top_p, stream.cuda_stream, steps)
        if key not in self._graphs:
            self._graphs[key] = self._capture(n, top_p, stream, steps)
        return self._graphs[key]

    def _capture(self, n: int, top_p: bool, stream: torch.cuda.Stream, steps: int = 1) -> torch.cuda.CUDAGraph:
        """Capture ``steps`` steps for n rows on ``stream`` (a side stream if that is the default one),
        after warm-up steps. Warm-up and capture advance live rows; their bookkeeping is restored
        after, and the KV slots they wrote lie past each row's length, where the next real step
        overwrites them."""
        b = self.batch
        saved = {name: getattr(b, name).clone() for name in ("logits", "length", "rope_pos", "n_gen", "done",
                                                              "tokens", "logps")}
        if stream == torch.cuda.default_stream(self.device):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), graph_attention_kernels():
            for _ in range(2):
                self._step(n, top_p)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for all of the engine's graphs: they replay one at a time (under the lock),
        # and each writes its results to the batch's static buffers, so a graph may reuse another's
        # intermediates. Private pools grow with every batch size, stream and steps per launch: run 27
        # (six policies on one engine, one with 8-step graphs) stopped at its first chunk with cuBLAS
        # unable to allocate a handle.
        self._graph_pool = self._graph_pool or torch.cuda.graph_pool_handle()
        # thread_local: other threads (the compute stream's prefix work) keep running CUDA calls
        # while this thread captures; the default global mode would fail them.
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=stream, capture_error_mode="thread_local"), \
                graph_attention_kernels():
            for _ in range(steps):
                self._step(n, top_p)
        with torch.cuda.stream(stream):
            # Its step time on this stream (an SM partition's, or the whole GPU's): the partitions
            # choose how many SMs decode keeps from these (partitions.fewest_sms_within).
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            start.record(stream)
            for _ in range(3):
                graph.replay()
            end.record(stream)
            end.synchronize()
            if steps == 1:  # the split choice compares one step's time across partitions
                self._step_seconds.setdefault(stream.cuda_stream, {})[n] = start.elapsed_time(end) / 3e3
            for name, value in saved.items():
                getattr(b, name).copy_(value)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph

    # -- finished rows ---------------------------------------------------------------------------------
    def _rows_on_host(self) -> dict[str, torch.Tensor]:
        """done, n_gen, tokens and log-probs of every row, on the host. On CUDA they go to pinned
        buffers by async copies and one wait on this stream: a pageable copy blocks inside the
        driver, and the profile showed the compute thread's allocations waiting behind it."""
        b = self.batch
        names = ("done", "n_gen", "tokens", "logps")
        if self.device.type != "cuda":
            return {n: getattr(b, n) for n in names}
        if self._pinned is None:
            self._pinned = {n: torch.empty_like(getattr(b, n), device="cpu").pin_memory() for n in names}
        for n in names:
            self._pinned[n].copy_(getattr(b, n), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return self._pinned

    def _collect(self) -> list[FinishedSequence]:
        host = self._rows_on_host()
        done = host["done"].tolist()
        finished = [i for i, r in enumerate(self._live) if r is not None and done[i]]
        if not finished:
            return []
        n_gen, tokens, logps = (host[n].tolist() for n in ("n_gen", "tokens", "logps"))
        out = []
        for i in finished:
            row = self._live[i]
            self._live[i] = None
            count = n_gen[i]
            ids = tokens[i][:count]
            stop = set(row.request.stop_token_ids) | set(self.eos_token_ids)
            reason = "stop" if ids and ids[-1] in stop else "length"
            # Each sample goes on as it finishes (a frozen model can score it in the decode window);
            # the request's id stays taken until its last sample is out.
            out.append(FinishedSequence(row.parent, ids, logps[i][:count], reason, index=row.sample))
            if self.shared_prefix:
                self._release_slot(row.slot)
            self._children[row.parent] += 1
            if self._children[row.parent] == row.n:
                del self._children[row.parent]
        self._pack()
        return out


def _batch_sizes(sizes: list) -> str | None:
    if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 2**20 for b in sizes):
        return f"expected a list of batch sizes (whole numbers 1..{2**20}), got {sizes!r}"
    return None


def _compile_mode(mode) -> str | None:
    if mode in (True, False, "true", "default", "max-autotune-no-cudagraphs"):
        return None
    return f"{mode!r} is not one of true, false, default, max-autotune-no-cudagraphs"


SPEC = register_engine(EngineSpec(
    name="torch-graph",
    role="decode",
    factory=GraphDecodeEngine,
    requires=("transformers",),
    description="static-KV torch engine: grouped-query attention, in-step sampling, CUDA graphs per batch size",
    options={"max_num_seqs": Option(int, 1, 2**20), "max_model_len": Option(int, 1, 2**20),
             "graph_batch_sizes": Option(list, check=_batch_sizes), "cuda_graphs": Option(bool),
             "steps_per_graph": Option(int, 1, 1024), "compile": Option((bool, str), check=_compile_mode),
             "attention": Option(str, choices=("auto", "fused", "split-kv", "sdpa")),
             "linear": Option(str, choices=("cublas", "skinny", "skinny-norm")),
             "shared_prefix": Option(bool),
             "prefix_slots": Option(int, 1, 2**20), "max_prompt_len": Option(int, 1, 2**20),
             "max_response_len": Option(int, 1, 2**20)},
))
