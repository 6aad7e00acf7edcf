"""Seconds per node from the model's shape, the workload and the hardware: a roofline per node kind,
scaled by efficiencies that come from measurements, and calibratable from a run's trace.

- ``vit_encode``: vision-tower FLOPs of the prompts' patches.
- ``prefix``: LM prefill FLOPs over the prompt (attention included); TP all-reduces.
- ``decode_chunk``: per step max(weights + live KV bytes / bandwidth, FLOPs / peak) + a fixed step
  overhead + TP all-reduces, summed over the chunk's steps with the live batch at each step
  (sequences finish, so the batch shrinks: the long tail). Chunk 0 also prefills the prompts.
- ``suffix_score``: the G responses against the prefix KV (or, without prefix sharing, the whole
  sequence G times).
- ``loss``: the backward (2× forward) of its micro-batch, plus the recomputed forward under
  activation checkpointing and, in ``recompute`` mode, the suffix forward with grad.
- ``optimizer_step``: AdamW streams ~28 bytes per local parameter; plus the DP gradient
  reduce-scatter and parameter all-gather. ``weight_sync``: the rollout layout rebuilt from the
  training one, over NVLink (colocated) or the network (disaggregated).

Default efficiencies are derived from the one-H200 iteration in ROLLPLEX.md (``MEASURED_H200``) by
dividing the roofline of each measured phase by its measured time; they are printed with results.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from rollplex.errors import ConfigError
from rollplex.pipeline.plan.hardware import Cluster, Layout
from rollplex.pipeline.compile.compiler import ModelDims
from rollplex.pipeline.compile.ir import Node
from rollplex.engines.modelspec import PRESETS, VLMSpec, vision_patches

HOST_SECONDS = {"reward": 1e-3, "advantage": 1e-4, "custom": 1e-3, "report": 1e-2}  # assumed, per node
MAX_LOGIT_TOKENS = 2048  # the LM head's piece (engines/vlm.py HEAD_CHUNK_TOKENS): the most logits rows held


@dataclass(frozen=True)
class Workload:
    """One iteration's shape. Token counts are LM tokens; ``vision_tokens`` is per image (or per
    two video frames, Qwen2.5-VL's temporal patch)."""

    prompts: int = 64
    samples: int = 8
    text_tokens: int = 64
    vision_tokens: int = 1024
    frames: int = 0  # video frames per prompt; 0: one image
    max_new_tokens: int = 1024
    response: str = "lognormal:256:0.6"  # fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA (clipped to max)
    chunk_tokens: int = 32
    tp_rollout: int = 1
    tp_train: int = 1
    zero: int = 1  # 0: nothing sharded over DP, 1: optimizer + master, 2: + grads, 3: + weights
    micro_batch_groups: int = 0  # prompts per loss node; 0: one per data-parallel rank
    prompts_per_node: int = 1
    checkpointing: bool = True  # activation checkpointing in training
    actor_forward: str = "recompute"  # the loss re-runs the actor suffix with grad (verl-style) | keep
    kv_pool_fraction: float = 0.5  # rollout engine's HBM share for weights + KV (vLLM gpu_memory_utilization)
    ref_cache_hit: float = 0.0  # share of reference prefixes served by the cross-iteration cache
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompts", "samples", "max_new_tokens", "chunk_tokens", "tp_rollout", "tp_train",
                     "prompts_per_node", "text_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"workload: {name} must be ≥ 1, got {getattr(self, name)}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"workload: zero must be 0..3, got {self.zero}")
        if self.actor_forward not in ("keep", "recompute"):
            raise ConfigError(f"workload: actor_forward must be keep or recompute, got {self.actor_forward!r}")
        if not 0 <= self.ref_cache_hit <= 1 or not 0 < self.kv_pool_fraction <= 1:
            raise ConfigError("workload: ref_cache_hit must be in [0, 1] and kv_pool_fraction in (0, 1]")
        parse_lengths(self.response, self.max_new_tokens)

    @property
    def image_groups(self) -> int:
        return 1 if self.frames <= 0 else math.ceil(self.frames / 2)

    @property
    def vision_total(self) -> int:
        return self.vision_tokens * self.image_groups

    @property
    def prefix_tokens(self) -> int:
        return self.text_tokens + self.vision_total


def parse_lengths(spec: str, cap: int):
    """A sampler ``rng, n -> lengths`` from a response-length spec, clipped to [1, cap]."""
    kind, *nums = spec.split(":")
    try:
        vals = [float(x) for x in nums]
    except ValueError:
        raise ConfigError(f"--response-len {spec!r}: numbers expected after the kind") from None
    shapes = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if kind not in shapes or len(vals) != shapes[kind]:
        raise ConfigError(f"--response-len {spec!r}: use fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA")
    clip = lambda x: np.clip(np.rint(x), 1, cap).astype(int)  # noqa: E731
    if kind == "fixed":
        return lambda rng, n: clip(np.full(n, vals[0]))
    if kind == "uniform":
        return lambda rng, n: clip(rng.uniform(vals[0], vals[1], n))
    return lambda rng, n: clip(rng.lognormal(math.log(vals[0]), vals[1], n))


@dataclass(frozen=True)
class Efficiency:
    """Achieved share of the roofline per kind of work (hardware rates are already achieved ones)."""

    vit: float
    forward: float
    train: float
    decode_bw: float
    decode_step_overhead: float  # seconds per decode step not explained by bytes or FLOPs
    source: str = ""


# One serial GRPO iteration on one H200, plain transformers bf16, random Qwen2.5-VL-3B-shaped model,
# P=8, G=8, prefix 1088 tokens (1024 vision + 64 text), R=256 (ROLLPLEX.md).
MEASURED_H200 = {
    "vit_seconds": 0.26,  # batched attention variant
    "prefill_8_seconds": 0.11,
    "ref_full_seconds": 1.1,
    "train_full_seconds": 3.5,
    "ref_shared_seconds": 0.41,  # validation only
    "train_shared_seconds": 1.25,  # validation only
    # torch.compile + CUDA graph decode, static KV of 1344 slots: (batch, seconds per step)
    "decode_steps": ((8, 3.8e-3), (64, 4.8e-3), (128, 6.1e-3)),
}


def measured_efficiency(peak: float = 788e12, copy_bw: float = 4.3e12) -> Efficiency:
    """Efficiencies that make the roofline reproduce MEASURED_H200 (no other fitting)."""
    m, M = PRESETS["qwen2.5-vl-3b"], MEASURED_H200
    P, G, L, R = 8, 8, 1088, 256
    full = P * G * m.lm_flops(L + R, (L + R) / 2, R)
    vit = m.vit_flops(P * 4096, 4096) / peak / M["vit_seconds"]
    forward = full / peak / M["ref_full_seconds"]
    adam = 28 * m.params / copy_bw
    train = 3 * full / peak / (M["train_full_seconds"] - adam)
    # Decode: step = overhead + bytes / (copy_bw · e); least squares over the three measured points.
    xs = np.array([(m.lm_params * 2 + b * 1344 * m.kv_bytes_per_token()) / copy_bw for b, _ in M["decode_steps"]])
    ys = np.array([t for _, t in M["decode_steps"]])
    slope, overhead = np.polyfit(xs, ys, 1)
    return Efficiency(vit=round(vit, 3), forward=round(forward, 3), train=round(train, 3),
                      decode_bw=round(float(1 / slope), 3), decode_step_overhead=round(float(overhead), 5),
                      source="derived from one measured H200 iteration (MEASURED_H200, pipeline/plan/costs.py)")


@dataclass(frozen=True)
class NodeCost:
    seconds: float
    batch: float = 0.0  # per-GPU decode batch while this node runs (decode_chunk only)


@dataclass
class Calibration:
    """Per kind: measured = overhead per node + factor × predicted seconds, from real runs.

    A factor alone says "this kind runs at X% of the roofline". Runtimes also pay a per-node cost
    the roofline has no term for (kernel launches, Python, padding); it dominates small nodes, so one
    factor fitted on small suffixes over-predicts big ones. ``fit`` separates the two when the
    measurements include the same kind at two sizes (e.g. prefix sharing on and off).
    """

    factors: dict[str, float] = field(default_factory=dict)
    source: str = "none"
    overheads: dict[str, float] = field(default_factory=dict)  # seconds per node

    def apply(self, kind: str, seconds: float) -> float:
        return self.overheads.get(kind, 0.0) + self.factors.get(kind, 1.0) * seconds

    @classmethod
    def fit(cls, samples: "list[tuple[str, int, float, float]]", source: str = "measurements") -> "Calibration":
        """``samples``: (kind, nodes, predicted seconds, measured seconds), each summed over one run's
        nodes of that kind. Per kind: least squares for (overhead, factor) when the runs differ in
        predicted seconds per node, else the ratio alone. Overheads are kept ≥ 0."""
        by_kind: dict[str, list[tuple[int, float, float]]] = {}
        for kind, nodes, predicted, measured in samples:
            if nodes > 0 and predicted > 0:
                by_kind.setdefault(kind, []).append((nodes, predicted, measured))
        factors, overheads = {}, {}
        for kind, rows in by_kind.items():
            per_node = {round(p / n, 12) for n, p, _ in rows}
            ratio = sum(m for _, _, m in rows) / sum(p for _, p, _ in rows)
            if len(per_node) < 2:
                factors[kind] = ratio
                continue
            a = np.array([[n, p] for n, p, _ in rows], dtype=float)
            (overhead, factor), *_ = np.linalg.lstsq(a, np.array([m for _, _, m in rows]), rcond=None)
            if overhead < 0 or factor <= 0:  # no per-node cost visible: one factor fits best
                factors[kind] = ratio
                continue
            factors[kind], overheads[kind] = float(factor), float(overhead)
        if not factors:
            raise ConfigError(f"calibration: {source} has no node kinds with both predicted and measured time")
        return cls(factors, source, overheads)

    @classmethod
    def from_trace(cls, trace: Mapping, predicted: Mapping[str, float], source: str = "trace") -> "Calibration":
        """factor[kind] = measured seconds / predicted seconds, summed over the nodes of that kind
        found in both (Chrome events: cat = kind, dur in µs, name = node)."""
        measured: dict[str, float] = {}
        expected: dict[str, float] = {}
        seen = set()
        for e in trace.get("traceEvents", []):
            if e.get("ph") != "X" or e.get("name") not in predicted or e["name"] in seen:
                continue
            seen.add(e["name"])  # a node spanning several GPUs appears once per GPU
            measured[e["cat"]] = measured.get(e["cat"], 0.0) + e["dur"] / 1e6
            expected[e["cat"]] = expected.get(e["cat"], 0.0) + predicted[e["name"]]
        if not measured:
            raise ConfigError(f"calibration: {source} has no events for the graph's nodes")
        return cls({k: measured[k] / expected[k] for k in measured if expected[k] > 0}, source)


@dataclass
class DecodeProfile:
    """The rollout as decode steps: live batch per step (per replica), chunked by K tokens."""

    lengths: list[list[int]]  # [prompt][sample]
    replicas: int
    cap: int  # sequences one replica's KV pool holds at once
    chunk_seconds: list[float]
    chunk_batch: list[float]
    finish_chunk: dict[int, int]  # prompt → chunk whose end hands its group on
    sample_chunks: dict[int, list[int]] = field(default_factory=dict)  # prompt → each sample's finish chunk


class CostModel:
    """``cost(node, gang_size) -> NodeCost`` for one model, workload, cluster and layout."""

    def __init__(self, model: VLMSpec, cluster: Cluster, workload: Workload, layout: Layout, *,
                 efficiency: Efficiency | None = None, calibration: Calibration | None = None,
                 weight_sharing: bool = False, prefix_sharing: bool = True, recompute_prefix: bool = False) -> None:
        self.m, self.c, self.w, self.layout = model, cluster, workload, layout
        self.prefix_sharing = prefix_sharing
        self.recompute_prefix = recompute_prefix and workload.actor_forward == "recompute"
        self.eff = efficiency or measured_efficiency()
        self.calibration = calibration or Calibration()
        self.weight_sharing = weight_sharing
        self.flop_rate = cluster.peak_flops
        self.profile = self._decode_profile()

    # -- helpers --------------------------------------------------------------------------------
    def _tp_comm(self, tokens: float, tp: int, passes: float = 1.0) -> float:
        """Two all-reduces of the hidden state per layer and pass, ring algorithm over NVLink."""
        if tp <= 1:
            return 0.0
        nbytes = tokens * self.m.hidden * 2 * 2 * (tp - 1) / tp
        return passes * 2 * self.m.layers * (self.c.collective_latency + nbytes / self.c.intra_bw)

    def _compute(self, flops: float, gpus: int, eff: float) -> float:
        return flops / (gpus * self.flop_rate * eff)

    def response_lengths(self, p: int, samples: list[int] | None = None) -> list[int]:
        """Prompt p's response lengths (of ``samples`` only: the ones a decode chunk handed on)."""
        rs = self.profile.lengths[p]
        return rs if samples is None else [rs[g] for g in samples]

    def suffix_flops(self, p: int, full: bool, samples: list[int] | None = None) -> float:
        """FLOPs of scoring prompt p's responses (``samples`` of them: the ones a decode chunk handed on)."""
        L = self.w.prefix_tokens
        rs = self.response_lengths(p, samples)
        if full:
            return sum(self.m.lm_flops(L + r, (L + r) / 2, r) for r in rs)
        return sum(self.m.lm_flops(r, L + r / 2, r) for r in rs)

    def tokens(self, p: int, full: bool, samples: list[int] | None = None) -> int:
        rs = self.response_lengths(p, samples)
        return sum(rs) + (self.w.prefix_tokens * len(rs) if full else 0)

    # -- decode ---------------------------------------------------------------------------------
    def rollout_weight_bytes(self) -> float:
        """Bytes of rollout weights each rollout GPU streams per step (its TP shard of the LM)."""
        return self.m.lm_params * 2 / self.layout.tp_rollout

    def kv_shard(self) -> int:
        return min(self.layout.tp_rollout, self.m.kv_heads)

    def decode_step(self, batch: float, context: float) -> float:
        """Seconds of one decode step for ``batch`` sequences of ``context`` tokens on average."""
        tp = self.layout.tp_rollout
        kv = batch * context * self.m.kv_bytes_per_token() / self.kv_shard()
        t_mem = (self.rollout_weight_bytes() + kv) / (self.c.hbm_bw * self.eff.decode_bw)
        t_flop = self.m.lm_flops(batch, context, batch) / tp / (self.flop_rate * self.eff.forward)
        return self.eff.decode_step_overhead + max(t_mem, t_flop) + self._tp_comm(batch, tp)

    def kv_pool_bytes(self) -> float:
        """Per rollout GPU: what the engine reserves (its HBM share minus weights), never more than
        all sequences of its replica need at full length."""
        w = self.w
        per_seq = (w.prefix_tokens + w.max_new_tokens) * self.m.kv_bytes_per_token() / self.kv_shard()
        seqs = math.ceil(w.prompts / self.layout.rollout_replicas) * w.samples
        reserve = w.kv_pool_fraction * self.c.hbm_budget - self.rollout_weight_bytes()
        return max(per_seq, min(reserve, seqs * per_seq))

    def _decode_profile(self) -> DecodeProfile:
        w, lay = self.w, self.layout
        rng = np.random.default_rng(w.seed)
        sample = parse_lengths(w.response, w.max_new_tokens)
        lengths = [list(map(int, sample(rng, w.samples))) for _ in range(w.prompts)]
        replicas = lay.rollout_replicas
        per_seq = (w.prefix_tokens + w.max_new_tokens) * self.m.kv_bytes_per_token() / self.kv_shard()
        cap = max(1, int(self.kv_pool_bytes() // per_seq))
        K = w.chunk_tokens
        chunks = math.ceil(w.max_new_tokens / K)
        seconds = np.zeros(chunks)
        batch = np.zeros(chunks)
        sample_end: dict[int, list[int]] = {p: [] for p in range(w.prompts)}
        L = w.prefix_tokens
        for r in range(replicas):
            prompts = list(range(r, w.prompts, replicas))
            if not prompts:
                continue
            seqs = [(p, n) for p in prompts for n in lengths[p]]
            # Continuous batching: a sequence starts when one of ``cap`` slots frees (FIFO).
            slots = [0] * min(cap, len(seqs))
            starts, ends = [], []
            for p, n in seqs:
                s = heapq.heappop(slots)
                starts.append(s)
                ends.append(s + n)
                heapq.heappush(slots, s + n)
                sample_end[p].append(s + n)
            steps = max(ends)
            live = np.zeros(steps + 1)
            ctx = np.zeros(steps + 1)  # Σ (L − start) over live sequences; + t·live gives Σ context
            np.add.at(live, starts, 1)
            np.add.at(live, ends, -1)
            np.add.at(ctx, starts, [L - s for s in starts])
            np.add.at(ctx, ends, [-(L - s) for s in starts])
            live, ctx = np.cumsum(live)[:steps], np.cumsum(ctx)[:steps]
            t = np.arange(steps)
            mean_ctx = (ctx + t * live) / np.maximum(live, 1)
            step_s = np.array([self.decode_step(b, c) for b, c in zip(live, mean_ctx)])
            chunk_of = np.minimum(t // K, chunks - 1)
            sec = np.bincount(chunk_of, weights=step_s, minlength=chunks)
            bat = np.bincount(chunk_of, weights=live, minlength=chunks) / np.maximum(
                np.bincount(chunk_of, minlength=chunks), 1)
            prefill = sum(self.m.prefill_flops(L) for _ in prompts)
            sec[0] += self._compute(prefill, lay.tp_rollout, self.eff.forward) + self._tp_comm(
                L * len(prompts), lay.tp_rollout)
            slower = sec > seconds
            seconds = np.where(slower, sec, seconds)
            batch = np.where(slower, bat, batch)
        by_sample = {p: [min(chunks - 1, max(0, (s - 1) // K)) for s in ends] for p, ends in sample_end.items() if ends}
        finish = {p: max(cs) for p, cs in by_sample.items()}  # a group goes on with its last sample
        return DecodeProfile(lengths, replicas, cap, seconds.tolist(), batch.tolist(), finish, by_sample)

    # -- per node -------------------------------------------------------------------------------
    @property
    def dims(self) -> ModelDims:
        """The byte model of this model in bf16, activations kept as the workload trains."""
        return ModelDims.of(self.m, 2, self.w.checkpointing)

    def __call__(self, node: Node, gang: int) -> NodeCost:
        if "handoff_chunk" in node.args:
            return self._handed_on(node, gang)
        if "micro_batch_tokens" in node.args:  # a loss node that makes the policy's forwards with grad too
            groups = list(node.args["prompts"])
            return NodeCost(self._trained(groups, len(groups), gang))
        cost = self._raw(node, gang)
        return NodeCost(self.calibration.apply(node.kind, cost.seconds), cost.batch)

    def _handed_on(self, node: Node, gang: int) -> NodeCost:
        """A node of a stage-fused graph that works on what decode chunks handed on (its args say which
        chunks, ``handed_chunks``, and whether ``handed`` groups or samples): a frozen model's scoring
        of those, or, under train fusion, ``train_c``: the groups its chunk finished, in micro-batches,
        each its policy prefix and suffix with grad, loss and backward, each part calibrated as
        serial's node of that kind. A node with nothing handed on costs nothing (the runtime's returns
        at once)."""
        chunks = set(node.args["handed_chunks"])
        groups = [p for p in node.args.get("prompts", []) if self.profile.finish_chunk.get(p) in chunks]
        cal = self.calibration
        if node.kind == "loss":
            return NodeCost(self._trained(groups, max(1, node.args.get("micro_batch_groups") or len(groups)), gang))
        if node.args["handed"] == "samples":
            some = {p: [g for g, c in enumerate(self.profile.sample_chunks[p]) if c in chunks]
                    for p in node.args.get("prompts", []) if p in self.profile.sample_chunks}
            some = {p: gs for p, gs in some.items() if gs}
        else:
            some = {p: None for p in groups}
        return NodeCost(cal.apply(node.kind, self._forward(some, gang)) if some else 0.0)

    def _trained(self, groups: list[int], most: int, gang: int) -> float:
        """Training ``groups`` in backwards of ``most`` groups, each the policy's prefix and suffix with
        grad, the loss and backward, each part calibrated as serial's node of that kind."""
        seconds, cal, L = 0.0, self.calibration, self.w.prefix_tokens
        for mb in (groups[i : i + most] for i in range(0, len(groups), most)):
            prefix = self._compute(len(mb) * self.m.prefill_flops(L), gang, self.eff.forward) + self._tp_comm(
                L * len(mb), gang)
            suffix = self._forward({p: None for p in mb}, gang)
            seconds += (cal.apply("prefix", prefix) + cal.apply("suffix_score", suffix)
                        + cal.apply("loss", self._loss(mb, gang, forward_kept=True)))
        return seconds

    def _forward(self, samples: Mapping[int, list[int] | None], gang: int) -> float:
        """A suffix forward over the given samples of each prompt (None: all of its samples)."""
        flops = sum(self.suffix_flops(p, False, gs) for p, gs in samples.items())
        tokens = sum(self.tokens(p, False, gs) for p, gs in samples.items())
        return self._compute(flops, gang, self.eff.forward) + self._tp_comm(tokens, gang)

    def _raw(self, node: Node, gang: int) -> NodeCost:
        w, m, eff, k = self.w, self.m, self.eff, node.kind
        prompts = list(node.args.get("prompts", [node.args["prompt"]] if "prompt" in node.args else []))
        L = w.prefix_tokens
        if k in HOST_SECONDS:
            return NodeCost(HOST_SECONDS[k] * max(1, len(prompts) if k != "report" else 1))
        if k == "vit_encode":
            patches = vision_patches(w.vision_total, m)
            per_image = vision_patches(w.vision_tokens, m)
            return NodeCost(self._compute(len(prompts) * m.vit_flops(patches, per_image), gang, eff.vit))
        if k == "prefix":
            if node.args.get("cached"):
                return NodeCost(node.args.get("bytes_per_gpu", 0) / self.c.pcie_bw)
            flops = len(prompts) * m.prefill_flops(L)
            return NodeCost(self._compute(flops, gang, eff.forward) + self._tp_comm(L * len(prompts), gang))
        if k == "decode_chunk":
            c = node.args["chunk"]
            return NodeCost(self.profile.chunk_seconds[c], self.profile.chunk_batch[c])
        if k == "suffix_score":
            full = bool(node.args.get("full_sequence"))
            some = node.args.get("samples", {})  # per-sample stage fusion: the samples one chunk handed on
            flops = sum(self.suffix_flops(p, full, some.get(p)) for p in prompts)
            tokens = sum(self.tokens(p, full, some.get(p)) for p in prompts)
            return NodeCost(self._compute(flops, gang, eff.forward) + self._tp_comm(tokens, gang))
        if k == "loss":
            return NodeCost(self._loss(prompts, gang))
        if k == "optimizer_step":
            return NodeCost(self._optimizer())
        if k == "weight_sync":
            return NodeCost(self._weight_sync())
        if k in ("offload", "prefetch"):
            return NodeCost(node.args.get("bytes_per_gpu", 0) / self.c.pcie_bw)
        return NodeCost(1e-3)  # plugin kinds: assumed small

    def _loss(self, prompts: list[int], gpus: int, forward_kept: bool = False) -> float:
        """The backward of ``prompts``' groups; with ``actor_forward="recompute"`` also the forward it
        re-runs with grad, unless ``forward_kept`` (the node ran that forward itself)."""
        w, m = self.w, self.m
        shared = self.prefix_sharing
        fwd = 0.0
        tokens = 0
        for p in prompts:
            fwd += self.suffix_flops(p, not shared)
            tokens += self.tokens(p, not shared)
            if shared:
                fwd += m.prefill_flops(w.prefix_tokens)
                tokens += w.prefix_tokens
        passes = 2.0 + (1.0 if w.checkpointing else 0.0)  # backward, recomputed forward
        flops = passes * fwd
        if w.actor_forward == "recompute" and not forward_kept:  # the scoring forward again, with grad
            flops += sum(self.suffix_flops(p, not shared) for p in prompts)
            if shared and self.recompute_prefix:
                flops += len(prompts) * m.prefill_flops(w.prefix_tokens)
            passes += 1
        tp = self.layout.tp_train
        return self._compute(flops, gpus, self.eff.train) + self._tp_comm(tokens / max(1, gpus // tp), tp, passes)

    def shard(self, what: str) -> int:
        """How many ways a per-model tensor is split per GPU in training (TP × DP under ZeRO)."""
        lay, z = self.layout, self.w.zero
        dp = lay.train_dp
        level = {"weights": 3, "grads": 2, "optimizer": 1}[what]
        return lay.tp_train * (dp if z >= level else 1)

    def _optimizer(self) -> float:
        lay = self.layout
        local = self.m.lm_params / self.shard("optimizer")  # the vision tower is frozen
        t = 28 * local / self.c.hbm_bw
        dp = lay.train_dp
        if dp > 1:  # reduce-scatter grads + all-gather bf16 params across DP ranks
            moved = 2 * 2 * self.m.lm_params / lay.tp_train * (dp - 1) / dp
            t += moved / self.c.link_bw(lay.train) + 2 * self.c.collective_latency * math.log2(dp)
        return t

    def share_plan(self):
        """The weight-sharing plan (pipeline/plan/weightshare) of a colocated layout, or None: what the
        rollout engine's LM shard aliases of the trainer's storage and what a sync still moves."""
        lay = self.layout
        if not (self.weight_sharing and lay.colocated):
            return None
        if not hasattr(self, "_share_plan"):
            from rollplex.engines.tensorlayouts import actor_layouts
            from rollplex.pipeline.plan.weightshare import RolloutSide, TrainerSide, plan_gang

            try:
                self._share_plan = plan_gang(actor_layouts(self.m, vision=False),
                                             TrainerSide(lay.tp_train, zero=self.w.zero, dp=lay.train_dp),
                                             RolloutSide(lay.tp_rollout))
            except ConfigError:  # shapes that do not split over these degrees: no sharing assumed
                self._share_plan = None
        return self._share_plan

    def rollout_copy_bytes(self) -> float:
        """Per rollout GPU: rollout weights not physically shared with the training layout."""
        plan = self.share_plan()
        return plan.per_gpu("extra") if plan is not None else self.m.lm_params * 2 / self.layout.tp_rollout

    def _weight_sync(self) -> float:
        lay = self.layout
        plan = self.share_plan()
        if plan is not None:  # aliased bytes are current already; copies read+write HBM, gathers cross NVLink
            return plan.sync_seconds(self.c.hbm_bw, self.c.intra_bw, self.c.collective_latency, self.m.layers)
        nbytes = self.rollout_copy_bytes()
        if lay.colocated:
            return nbytes / self.c.intra_bw + self.c.collective_latency * self.m.layers
        return nbytes / self.c.link_bw(lay.gpus) + self.c.collective_latency * self.m.layers
