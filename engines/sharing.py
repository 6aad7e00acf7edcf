"""Rollout weights on the trainer's storage: materialisation, refresh, fused allocation, and an
emulated tensor-parallel gang (several TP ranks in one process) for tests and the GPU check.

The planner (pipeline/plan/weightshare) says per tensor and GPU whether the rollout shard is a view of
the trainer's storage, a buffer the trainer's shard lives inside (peers' rows gathered into it), or
a copy. This module carries that out on real tensors:

- ``fuse_parameters(module)``: allocate each fused group (q/k/v weights, q/k/v biases, gate/up) of an
  HF model as one buffer with the parameters as views into it, so vLLM's fused tensor is an alias.
  ``fusion_order(module)`` lists the trainable parameters group by group, the order in which
  DeepSpeed ZeRO-1/2 lays them out in its flat buffer (the same adjacency, its own storage).
- ``SharedWeights``: rollout tensors for one GPU at TP 1 from a live module: a view where the
  storage is adjacent (checked on the real data pointers, never assumed), otherwise a copy that
  ``refresh`` updates after each optimizer step.
- ``Gang``: trainer shards per emulated GPU for (t_train, t_roll), the rollout tensors materialised by
  the plan, ``refresh`` (rebuilt tensors only; byte counts checked against the plan), and
  ``tp_forward``: a Qwen2 decoder forward over TP ranks (column shards concatenated, row shards summed).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollplex.errors import EngineError
from rollplex.engines.tensorlayouts import TensorLayout, hf_name, unfuse

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --------------------------------------------------------------------------------------------------
# storage helpers
def view_of(base: torch.Tensor, offset: int, shape: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """A view ``offset`` elements past ``base``'s first element, on the same storage (no copy)."""
    return base.as_strided(tuple(shape), tuple(stride), base.storage_offset() + offset)


def storage_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte address the tensor's elements may touch."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def inside(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Every element of ``t`` lies in ``base``'s storage."""
    a, b = storage_span(t)
    s = base.untyped_storage()
    return s.data_ptr() <= a and b <= s.data_ptr() + s.nbytes() and t.untyped_storage().data_ptr() == s.data_ptr()


def adjacent_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One [sum rows, ...] view over tensors laid out back to back on one storage, or None."""
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts):
        return None
    if any(p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for p in parts):
        return None
    for a, b in zip(parts, parts[1:]):
        if a.storage_offset() + a.numel() != b.storage_offset():
            return None
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def fusion_groups(module: torch.nn.Module, layouts: Sequence[TensorLayout], lm_prefix: str,
                  vision_prefix: str = "model.") -> list[tuple[TensorLayout, list[str]]]:
    """(layout, its parts' module parameter names) for every layout whose parameters the module has."""
    names = dict(module.named_parameters())
    out = []
    for lay in layouts:
        parts = list(dict.fromkeys(hf_name(p.hf, lm_prefix, vision_prefix) for p in lay.parts))
        if all(n in names for n in parts):
            out.append((lay, parts))
    return out


def lm_prefix_of(module: torch.nn.Module) -> str:
    names = {n for n, _ in module.named_parameters()}
    for prefix in ("model.language_model.", "model."):
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise EngineError(f"weight sharing: {type(module).__name__} has no embed_tokens under model. or "
                      "model.language_model.; not a Qwen2-family model")


def fuse_parameters(module: torch.nn.Module, layouts: Sequence[TensorLayout], frozen_only: bool = False) -> int:
    """Re-allocate each fused group's parameters as views into one buffer (values unchanged). Call
    before an optimizer holds the parameters, or with ``frozen_only`` (the vision tower) when one
    already does (DeepSpeed's flat buffer must keep the trainable ones). Returns the groups fused."""
    params = dict(module.named_parameters())
    fused = 0
    with torch.no_grad():
        for lay, names in fusion_groups(module, layouts, lm_prefix_of(module)):
            if len(names) < 2 or (frozen_only and any(params[n].requires_grad for n in names)):
                continue
            ps = [params[n] for n in names]
            if adjacent_view(ps) is not None:
                continue
            buf = torch.cat([p.detach().reshape(p.shape[0], -1) for p in ps]).reshape(-1)
            at = 0
            for p in ps:
                p.data = buf[at:at + p.numel()].view(p.shape)
                at += p.numel()
            fused += 1
    return fused


def fuse_for_rollout(module: torch.nn.Module, trainer: str = "") -> int:
    """q|k|v and gate|up of a module the rollout engine shares made one buffer each: vLLM runs them
    fused, and torch-graph projects each group in one matmul where its parts are adjacent. Before the
    ``torch`` trainer's first step (AdamW's state is still empty); under another trainer (DeepSpeed's
    flat buffer holds its trainable ones, in fusion order) or none, only the frozen ones move."""
    return fuse_parameters(module, layouts_for_module(module), frozen_only=trainer != "torch")


def fusion_order(module: torch.nn.Module, layouts: Sequence[TensorLayout]) -> list[torch.nn.Parameter]:
    """Trainable parameters, each fused group's parts consecutive (then any others, in module order)."""
    params = dict(module.named_parameters())
    seen, out = set(), []
    for _, names in fusion_groups(module, layouts, lm_prefix_of(module)):
        for n in names:
            if n not in seen and params[n].requires_grad:
                seen.add(n)
                out.append(params[n])
    out += [p for n, p in params.items() if n not in seen and p.requires_grad]
    return out


# --------------------------------------------------------------------------------------------------
# one GPU at TP 1: a live module's storage
@dataclass
class SharedTensor:
    name: str  # canonical rollout name
    cls: str
    tensor: torch.Tensor  # what the rollout engine reads
    sources: tuple[torch.Tensor, ...]  # the trainer's parameters it is made of
    aliased: bool
    trainable: bool


class SharedWeights:
    """Rollout tensors (canonical names, TP 1) over a trainer module's storage."""

    def __init__(self, module: torch.nn.Module, layouts: Sequence[TensorLayout], fused: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        lays = list(layouts) if fused else unfuse(layouts)
        params = dict(module.named_parameters())
        self.tensors: dict[str, SharedTensor] = {}
        self.copied_bytes = 0  # bytes refresh has copied so far
        # The trainer's parameter names these tensors stand for. A layer the module has renamed (a
        # LoRA layer's weight is its base layer's) has no tensor here: the engine keeps its own.
        self.covered: set[str] = set()
        with torch.no_grad():
            for lay, names in fusion_groups(module, lays, lm_prefix_of(module)):
                self.covered.update(names)
                src = tuple(params[n].detach() for n in names)
                view = src[0] if len(src) == 1 else adjacent_view(src)
                if view is not None and (dtype is None or view.dtype == dtype):
                    t, aliased = view, True
                else:
                    t, aliased = torch.cat([s.to(dtype or s.dtype) for s in src]), False
                trainable = any(params[n].requires_grad for n in names)
                self.tensors[lay.name] = SharedTensor(lay.name, lay.cls, t, src, aliased, trainable)

    def refresh(self) -> int:
        """After an optimizer step: copy what is not aliased (frozen tensors never change)."""
        moved = 0
        with torch.no_grad():
            for st in self.tensors.values():
                if st.aliased or not st.trainable:
                    continue
                at = 0
                for s in st.sources:
                    st.tensor[at:at + s.shape[0]].copy_(s)
                    at += s.shape[0]
                moved += st.tensor.numel() * st.tensor.element_size()
        self.copied_bytes += moved
        return moved

    def report(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for st in self.tensors.values():
            row = out.setdefault(st.cls, {"aliased": 0, "rebuilt": 0})
            row["aliased" if st.aliased else "rebuilt"] += st.tensor.numel() * st.tensor.element_size()
        return out

    def summary(self) -> str:
        rep = self.report()
        a = sum(r["aliased"] for r in rep.values())
        b = sum(r["rebuilt"] for r in rep.values())
        rebuilt = sorted(c for c, r in rep.items() if r["rebuilt"])
        return (f"weight sharing: {a / 2**20:.1f} MiB aliased to the trainer's storage, {b / 2**20:.1f} MiB "
                f"rebuilt{' (' + ', '.join(rebuilt) + ')' if rebuilt else ''}")


# --------------------------------------------------------------------------------------------------
# an emulated gang: several TP ranks in one process
@dataclass
class _Piece:
    part: int
    row0: int  # first row in the part
    rows: int
    col0: int
    cols: int


class Gang:
    """Trainer shards and rollout tensors of every GPU of one gang, per ``plan``, from full HF
    tensors ``full`` (canonical HF names). Trainer storage per GPU is one flat buffer per layout
    (``fused`` allocation), or the rollout-shaped buffer for ``inplace`` decisions; the trainer's HF
    parameters are views into it (``train_params[gpu][hf name]``)."""

    def __init__(self, layouts: Sequence[TensorLayout], plan, full: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu", local: Sequence[int] | None = None,
                 exchange: Callable[[list], list] | None = None) -> None:
        """``local``: the GPUs this process holds (default: all, emulated); the peers' trainer buffers
        then come from ``exchange(buffers) -> buffers of every GPU`` (an all-gather across processes)."""
        self.plan = plan  # a GangPlan (pipeline/plan/weightshare.py): planned there, carried out here
        self.layouts = {lay.name: lay for lay in (layouts if plan.rollout.fused else unfuse(layouts))}
        self.tt, self.tr = plan.trainer.tp, plan.rollout.tp
        self.device = torch.device(device)
        self.local = set(range(len(plan.gpus)) if local is None else local)
        self.exchange = exchange
        n = len(plan.gpus)
        self.buffers: list[dict[str, torch.Tensor] | None] = [None] * n
        self.train_params: list[dict] = [{} for _ in range(n)]
        self.rollout: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        self.moved = {"local": 0, "gathered": 0}
        with torch.no_grad():
            for g in plan.gpus:
                if g.gpu in self.local:
                    self._allocate_trainer(g, full)
            self._exchange()
            for g in plan.gpus:
                if g.gpu in self.local:
                    self.rollout[g.gpu] = self._materialise(g)

    def _exchange(self) -> None:
        """Bring the peers' trainer buffers (current values) into reach, as views of the same geometry."""
        if self.exchange is None:
            return
        everyone = self.exchange(self.buffers)
        for g in self.plan.gpus:
            if g.gpu not in self.local:
                self.buffers[g.gpu] = everyone[g.gpu]
                self.train_params[g.gpu] = self._views(g, everyone[g.gpu])

    # -- geometry --------------------------------------------------------------------------------
    def _pieces(self, lay: TensorLayout, t: int, rank: int) -> list[_Piece]:
        c0, c1 = lay.shard_cols(t, rank)
        return [_Piece(i, a, n, c0, c1 - c0) for i, a, n in lay.shard_rows(t, rank)]

    def _outer(self, lay: TensorLayout, d, g) -> list[_Piece]:
        """The pieces of the trainer's buffer for one tensor: its own shard, or for an ``inplace``
        decision the rollout shard its pieces sit inside."""
        if d.kind == "inplace":
            return self._pieces(lay, self.tr, g.roll_rank)
        return self._pieces(lay, self.tt, g.train_rank)

    def buffer_numel(self, lay: TensorLayout, d, g) -> int:
        outer = self._outer(lay, d, g)
        return sum(p.rows for p in outer) * max(outer[0].cols if lay.cols else 0, 1)

    def _views(self, g, bufs: dict[str, torch.Tensor]) -> dict:
        """The trainer's HF parameters on GPU ``g`` as views into its buffers."""
        params = {}
        for d in g.decisions:
            lay = self.layouts[d.tensor]
            outer, tp = self._outer(lay, d, g), self._pieces(lay, self.tt, g.train_rank)
            width = outer[0].cols if lay.cols else 0
            base = 0
            for i, (o, p) in enumerate(zip(outer, tp)):
                shape = (p.rows, p.cols) if lay.cols else (p.rows,)
                stride = (width, 1) if lay.cols else (1,)
                params[(lay.name, i)] = view_of(bufs[lay.name], (base + p.row0 - o.row0) * max(width, 1)
                                                + (p.col0 - o.col0), shape, stride)
                base += o.rows
        return params

    # -- trainer storage -------------------------------------------------------------------------
    def _allocate_trainer(self, g, full: dict[str, torch.Tensor]) -> None:
        dtype = getattr(torch, self.plan.trainer.dtype)
        bufs = {d.tensor: torch.zeros(self.buffer_numel(self.layouts[d.tensor], d, g), dtype=dtype, device=self.device)
                for d in g.decisions}
        params = self._views(g, bufs)
        for (name, i), view in params.items():
            lay = self.layouts[name]
            p = self._pieces(lay, self.tt, g.train_rank)[i]
            part = lay.parts[p.part]
            real = max(0, min(p.rows, part.rows - p.row0))  # vocab padding rows hold zeros
            src = full[part.hf]
            src = src.reshape(src.shape[0], -1) if lay.cols else src
            rows = src[part.hf_row0 + p.row0: part.hf_row0 + p.row0 + real]
            view[:real].copy_(rows[:, p.col0:p.col0 + p.cols] if lay.cols else rows)
        self.buffers[g.gpu] = bufs
        self.train_params[g.gpu] = params

    # -- rollout tensors -----------------------------------------------------------------------
    def _materialise(self, g) -> dict[str, torch.Tensor]:
        out = {}
        for d in g.decisions:
            lay = self.layouts[d.tensor]
            buf = self.buffers[g.gpu][lay.name]
            if d.kind == "alias":
                v = d.view
                out[lay.name] = view_of(buf, v.offset, v.shape, v.stride)
                continue
            pieces = self._pieces(lay, self.tr, g.roll_rank)
            rows, width = sum(p.rows for p in pieces), pieces[0].cols
            shape = (rows, width) if lay.cols else (rows,)
            if d.kind == "inplace":
                out[lay.name] = buf.view(shape)
            else:
                out[lay.name] = torch.empty(shape, dtype=getattr(torch, self.plan.rollout.dtype), device=self.device)
        self._fill(g, out, first=True)
        return out

    def _fill(self, g, out: dict[str, torch.Tensor], first: bool) -> dict[str, int]:
        """Copy every non-aliased element of this GPU's rollout tensors from the trainer shard that
        holds it (this GPU's first, then peers'); ``inplace`` tensors take only the peers' rows."""
        moved = {"local": 0, "gathered": 0}
        for d in g.decisions:
            if d.kind == "alias" or (not first and not d.trainable):
                continue
            lay = self.layouts[d.tensor]
            dst = out[lay.name]
            dst2 = dst.view(dst.shape[0], -1) if lay.cols else dst
            at = 0
            for piece in self._pieces(lay, self.tr, g.roll_rank):
                covered: set[tuple[int, int, int, int]] = set()
                got = 0
                ranks = {}  # train rank -> the GPU to read it from: this one first
                for h in [g, *self.plan.gpus]:
                    ranks.setdefault(h.train_rank, h)
                for h in ranks.values():
                    tp = self._pieces(lay, self.tt, h.train_rank)[piece.part]
                    r0, r1 = max(piece.row0, tp.row0), min(piece.row0 + piece.rows, tp.row0 + tp.rows)
                    c0, c1 = max(piece.col0, tp.col0), min(piece.col0 + piece.cols, tp.col0 + tp.cols)
                    if r0 >= r1 or (lay.cols and c0 >= c1) or (r0, r1, c0, c1) in covered:
                        continue  # not held there, or replicated rows (KV heads) taken already
                    covered.add((r0, r1, c0, c1))
                    got += (r1 - r0) * max(c1 - c0, 1)
                    local = h.gpu == g.gpu
                    if d.kind == "inplace" and local:
                        continue  # the trainer's own rows are the buffer already
                    src = self.train_params[h.gpu][(lay.name, piece.part)]
                    if lay.cols:
                        block = src[r0 - tp.row0:r1 - tp.row0, c0 - tp.col0:c1 - tp.col0]
                        target = dst2[at + r0 - piece.row0:at + r1 - piece.row0, c0 - piece.col0:c1 - piece.col0]
                    else:
                        block = src[r0 - tp.row0:r1 - tp.row0]
                        target = dst[at + r0 - piece.row0:at + r1 - piece.row0]
                    target.copy_(block)
                    moved["local" if local else "gathered"] += block.numel() * dst.element_size()
                if got != piece.rows * max(piece.cols, 1):
                    raise EngineError(f"weight sharing: the trainer ranks hold {got} of the "
                                      f"{piece.rows * max(piece.cols, 1)} elements {lay.name} needs on GPU {g.gpu}")
                at += piece.rows
        for k in moved:
            self.moved[k] += moved[k]
        return moved

    def refresh(self) -> dict[str, int]:
        """After an optimizer step: rebuild what is not aliased; returns the bytes moved."""
        total = {"local": 0, "gathered": 0}
        with torch.no_grad():
            if any(d.gathered and d.trainable for g in self.plan.gpus if g.gpu in self.local for d in g.decisions):
                self._exchange()  # the peers' updated rows
            for g in self.plan.gpus:
                if g.gpu not in self.local:
                    continue
                moved = self._fill(g, self.rollout[g.gpu], first=False)
                for k in total:
                    total[k] += moved[k]
        return total

    def trainer_tensor(self, gpu: int, hf: str) -> torch.Tensor:
        """The trainer's shard of HF tensor ``hf`` on ``gpu`` (a view into its storage)."""
        for (name, i), t in self.train_params[gpu].items():
            if self.layouts[name].parts[i].hf == hf and self.layouts[name].parts[i].hf_row0 == 0:
                return t
        raise KeyError(hf)

    def rank_gpu(self, side: str, rank: int) -> int:
        return next(g.gpu for g in self.plan.gpus if (g.train_rank if side == "train" else g.roll_rank) == rank)


# --------------------------------------------------------------------------------------------------
# a Qwen2 decoder forward over emulated TP ranks
@dataclass(frozen=True)
class TextDims:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float


def tp_forward(dims: TextDims, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, t: int,
               weight: Callable[[int, str], torch.Tensor], fused: bool, split: Callable[[str, int], list[int]]
               ) -> torch.Tensor:
    """Logits [S, vocab] for one sequence ``ids`` [S], computed rank by rank: embeddings and logits
    vocab-parallel (column shards concatenated), q/k/v and gate/up column-parallel, o and down
    row-parallel (partial outputs summed: the all-reduce). ``weight(rank, name)`` returns a rank's
    tensor under a canonical name: fused (``qkv_proj``, ``gate_up_proj``) or HF (``q_proj`` ...);
    ``split(name, rank)`` gives a fused tensor's per-part rows on that rank."""
    S = ids.shape[0]

    def rms(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + dims.eps)).to(x.dtype) * w

    def rope(x):  # [heads, S, d]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def vocab_rows(rank):
        w = weight(rank, "embed_tokens.weight")
        return rank * w.shape[0], w

    x = 0
    for r in range(t):
        a, w = vocab_rows(r)
        local = ids - a
        hit = (local >= 0) & (local < w.shape[0])
        x = x + F.embedding(local.clamp(0, w.shape[0] - 1), w) * hit.unsqueeze(-1)
    causal = torch.full((S, S), float("-inf"), dtype=x.dtype).triu(1)
    for layer in range(dims.layers):
        p = f"layers.{layer}"
        attn_out = 0
        for r in range(t):
            h = rms(x, weight(r, f"{p}.input_layernorm.weight"))
            if fused:
                qkv = F.linear(h, weight(r, f"{p}.self_attn.qkv_proj.weight"),
                               weight(r, f"{p}.self_attn.qkv_proj.bias"))
                q, k, v = qkv.split(split(f"{p}.self_attn.qkv_proj.weight", r), -1)
            else:
                q, k, v = (F.linear(h, weight(r, f"{p}.self_attn.{n}_proj.weight"),
                                    weight(r, f"{p}.self_attn.{n}_proj.bias")) for n in "qkv")
            d = dims.head_dim
            q = rope(q.view(S, -1, d).transpose(0, 1))
            k = rope(k.view(S, -1, d).transpose(0, 1))
            v = v.view(S, -1, d).transpose(0, 1)
            group = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            att = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5 + causal, -1) @ v
            o_proj = weight(r, f"{p}.self_attn.o_proj.weight")
            attn_out = attn_out + F.linear(att.transpose(0, 1).reshape(S, -1), o_proj)
        x = x + attn_out
        mlp_out = 0
        for r in range(t):
            h = rms(x, weight(r, f"{p}.post_attention_layernorm.weight"))
            if fused:
                gate, up = F.linear(h, weight(r, f"{p}.mlp.gate_up_proj.weight")).split(
                    split(f"{p}.mlp.gate_up_proj.weight", r), -1)
            else:
                gate = F.linear(h, weight(r, f"{p}.mlp.gate_proj.weight"))
                up = F.linear(h, weight(r, f"{p}.mlp.up_proj.weight"))
            mlp_out = mlp_out + F.linear(F.silu(gate) * up, weight(r, f"{p}.mlp.down_proj.weight"))
        x = x + mlp_out
    logits = []
    for r in range(t):
        h = rms(x, weight(r, "norm.weight"))
        logits.append(F.linear(h, weight(r, "lm_head.weight")))
    return torch.cat(logits, -1)[:, :dims.vocab]


def layouts_for_module(module: torch.nn.Module) -> list[TensorLayout]:
    """The actor layouts of a live HF Qwen2 / Qwen2.5-VL model, from its config."""
    from rollplex.engines.modelspec import from_dict
    from rollplex.engines.tensorlayouts import actor_layouts

    return actor_layouts(from_dict(module.config.to_dict(), type(module).__name__))
