"""Cluster descriptions: what one GPU can do, how GPUs are linked, and how decode and prefix work
share one GPU.

Every number carries its source. *measured* means ../shared/reference/ROLLPLEX.md (one H200,
2026-11-29); *vendor* means a datasheet figure; *assumed* means a stated assumption that
``rollplex simulate`` prints with its result. Bandwidths and FLOP/s are what work actually reaches
(measured copy bandwidth, measured matmul throughput), not datasheet peaks, so a cost model built on
them needs no second "efficiency" for the hardware itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rollplex.errors import ConfigError

GiB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class Interference:
    """What happens when compute-stream work (prefix, vision, suffix) runs beside decode on one GPU.

    Measured on an H200 with SM partitioning (green contexts + CUDA graphs on the partition):
    the share of a prefill that runs hidden under decode falls with the decode batch: about 65–70%
    at light, small-batch decode, about 30% for a realistic 7B step at B=32, about 0% at B=128.
    While both run, decode is about 1.2× slower. ``hidden`` interpolates those points in log2(B).

    A hidden fraction H and a decode slowdown s fix the rate r at which the compute work progresses
    beside decode: a job of T seconds alone takes T/r beside decode, while decode runs at 1/s and
    loses (1−1/s)·T/r, so H = 1 − (1−1/s)/r, i.e. r = (1−1/s)/(1−H). H=0.675 gives r=0.51
    (consistent with the measured 1.3–1.5× prefill slowdown on the ~70% of SMs light decode leaves);
    H=0 gives r=0.17, no gain at all. Without partitioning (plain CUDA streams) only 0–9% was hidden
    and decode slowed 1.6×.
    """

    partitioned: bool = True
    # (per-GPU decode batch, hidden fraction). B=8 is the light small-batch point; at B=32 we take
    # the realistic 7B-like step (3.6 TB/s), not the light loop, because that is what large models do.
    hidden_table: tuple[tuple[float, float], ...] = ((8, 0.675), (32, 0.30), (128, 0.0))
    decode_slowdown: float = 1.2
    plain_hidden: float = 0.05  # measured 0–9% with plain streams
    plain_decode_slowdown: float = 1.6
    min_hidden: float = 0.05  # below this, rollplex keeps prefix work out of the decode window

    def hidden(self, batch: float) -> float:
        if not self.partitioned:
            return self.plain_hidden
        table = self.hidden_table
        if batch <= table[0][0]:
            return table[0][1]
        for (b0, h0), (b1, h1) in zip(table, table[1:]):
            if batch <= b1:
                x = (math.log2(batch) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return h0 + x * (h1 - h0)
        return table[-1][1]

    @property
    def slowdown(self) -> float:
        return self.decode_slowdown if self.partitioned else self.plain_decode_slowdown

    def compute_rate(self, batch: float) -> float:
        """Progress rate (vs alone) of compute-stream work beside decode at this batch."""
        return min(1.0, (1.0 - 1.0 / self.slowdown) / max(1e-9, 1.0 - self.hidden(batch)))


@dataclass(frozen=True)
class Cluster:
    """GPUs × nodes with the achieved rates of one GPU and of the links between them."""

    name: str
    nodes: int
    gpus_per_node: int
    hbm_bytes: int
    hbm_bw: float  # achieved device-copy bandwidth, B/s
    peak_flops: float  # achieved dense bf16 matmul FLOP/s
    intra_bw: float  # NVLink, per GPU, one direction, B/s reachable by NCCL
    inter_bw: float  # network, per GPU, one direction, B/s
    pcie_bw: float  # host ↔ device copies, per GPU, one direction, B/s
    host_bytes_per_node: int
    streams: tuple[str, ...] = ("decode", "compute")  # GPU streams; "host" and "copy" lanes always exist
    reserve_bytes: int = 3 * GiB  # CUDA context, NCCL buffers, allocator slack: never plannable
    collective_latency: float = 10e-6  # per small all-reduce (assumed; NCCL/NVLink order of magnitude)
    interference: Interference = field(default_factory=Interference)
    sources: tuple[tuple[str, str], ...] = ()  # (field, where its number comes from)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"cluster {self.name}: {name} must be ≥ 1, got {getattr(self, name)}")
        if not self.streams or any(s not in ("decode", "compute") for s in self.streams):
            raise ConfigError(f"cluster {self.name}: streams must be decode and/or compute, got {self.streams}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def hbm_budget(self) -> int:
        """Bytes per GPU a plan may use."""
        return self.hbm_bytes - self.reserve_bytes

    @property
    def host_budget_per_gpu(self) -> int:
        return self.host_bytes_per_node // self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link_bw(self, gpus: tuple[int, ...] | list[int]) -> float:
        """Per-GPU bandwidth of a collective over ``gpus``: NVLink inside a node, else the network."""
        return self.intra_bw if len({self.node_of(g) for g in gpus}) <= 1 else self.inter_bw

    def lane(self, stream: str) -> str:
        """The lane a stream runs on: with a single GPU stream, decode and compute share it."""
        if stream in ("decode", "compute") and len(self.streams) == 1:
            return self.streams[0]
        return stream

    def with_gpus(self, gpus: int) -> "Cluster":
        """The same GPU type with ``gpus`` GPUs: whole nodes when more than one node is needed."""
        if gpus < 1:
            raise ConfigError(f"--gpus must be ≥ 1, got {gpus}")
        per = self.gpus_per_node
        if gpus <= per:
            return replace(self, nodes=1, gpus_per_node=gpus)
        if gpus % per:
            raise ConfigError(f"--gpus {gpus}: a {self.name} node has {per} GPUs; use a multiple of {per} "
                              f"beyond one node")
        return replace(self, nodes=gpus // per)

    def describe(self) -> list[tuple[str, str, str]]:
        """(quantity, value, source) rows for the assumptions table."""
        src = dict(self.sources)
        rows = [
            ("GPUs", f"{self.gpus} = {self.nodes} node(s) × {self.gpus_per_node}", "--gpus"),
            ("HBM per GPU", f"{self.hbm_bytes / GiB:.1f} GiB (plan budget {self.hbm_budget / GiB:.1f} GiB)",
             src.get("hbm_bytes", "vendor")),
            ("HBM bandwidth (achieved)", f"{self.hbm_bw / 1e12:.2f} TB/s", src.get("hbm_bw", "")),
            ("bf16 matmul (achieved)", f"{self.peak_flops / 1e12:.0f} TFLOP/s", src.get("peak_flops", "")),
            ("NVLink per GPU", f"{self.intra_bw / GB:.0f} GB/s", src.get("intra_bw", "")),
            ("network per GPU", f"{self.inter_bw / GB:.0f} GB/s", src.get("inter_bw", "")),
            ("PCIe host↔GPU", f"{self.pcie_bw / GB:.0f} GB/s", src.get("pcie_bw", "")),
            ("host memory per node", f"{self.host_bytes_per_node / GiB:.0f} GiB", src.get("host_bytes", "")),
            ("GPU streams", ", ".join(self.streams), "decode beside compute needs 2"),
        ]
        i = self.interference
        table = ", ".join(f"B={b:g}: {h:.0%}" for b, h in i.hidden_table)
        rows.append(("prefix hidden under decode", table if i.partitioned else f"{i.plain_hidden:.0%} (plain streams)",
                     "measured, H200 (SM partitioning)" if i.partitioned else "measured, H200 (plain streams)"))
        rows.append(("decode slowdown beside prefix", f"{i.slowdown:.2f}×", "measured, H200"))
        return rows


_COMMON_SOURCES = (
    ("peak_flops", "measured on H200 (788 TFLOP/s); H800 has the same Hopper SM count and clocks → same"),
    ("pcie_bw", "assumed: PCIe Gen5 x16, 64 GB/s nominal, ~50 GB/s pinned copies"),
    ("host_bytes", "assumed: 2 TiB host RAM per 8-GPU node"),
    ("inter_bw", "assumed: one 400 Gb/s NIC per GPU at ~80% → 40 GB/s"),
)

H200 = Cluster(
    name="h200", nodes=1, gpus_per_node=8,
    hbm_bytes=141 * 10**9, hbm_bw=4.3e12, peak_flops=788e12,
    intra_bw=360e9,  # NVLink4 450 GB/s per direction at ~80%
    inter_bw=40e9, pcie_bw=50e9, host_bytes_per_node=2048 * GiB,
    sources=(("hbm_bytes", "vendor: 141 GB HBM3e"),
             ("hbm_bw", "measured device copy 4.3 TB/s (vendor 4.8)"),
             ("intra_bw", "vendor NVLink4 900 GB/s bidirectional → 450 one way, assumed 80% → 360"),
             *_COMMON_SOURCES),
)

H800 = Cluster(
    name="h800", nodes=1, gpus_per_node=8,
    hbm_bytes=80 * GiB, hbm_bw=3.35e12 * 4.3 / 4.8, peak_flops=788e12,
    intra_bw=160e9,  # NVLink 400 GB/s bidirectional on H800 → 200 one way at ~80%
    inter_bw=40e9, pcie_bw=50e9, host_bytes_per_node=2048 * GiB,
    sources=(("hbm_bytes", "vendor H800 SXM: 80 GiB"),
             ("hbm_bw", "vendor 3.35 TB/s × the measured H200 copy/vendor ratio 4.3/4.8 → 3.0 TB/s (assumed)"),
             ("intra_bw", "vendor H800 NVLink 400 GB/s bidirectional → 200 one way, assumed 80% → 160"),
             *_COMMON_SOURCES),
)

PRESETS = {"h200": H200, "h800": H800}


@dataclass(frozen=True)
class Layout:
    """Which GPUs roll out and which train, and the tensor-parallel degree of each.

    Colocated policies use every GPU for both; a disaggregated one splits them. Gangs are runs of
    ``tp`` consecutive GPUs inside one node (TP never crosses a node).
    """

    rollout: tuple[int, ...]
    train: tuple[int, ...]
    tp_rollout: int = 1
    tp_train: int = 1

    @property
    def colocated(self) -> bool:
        return set(self.rollout) == set(self.train)

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.rollout) | set(self.train)))

    def gangs(self, pool: tuple[int, ...], tp: int) -> tuple[tuple[int, ...], ...]:
        return tuple(pool[i:i + tp] for i in range(0, len(pool), tp))

    @property
    def rollout_replicas(self) -> int:
        return len(self.rollout) // self.tp_rollout

    @property
    def train_dp(self) -> int:
        return len(self.train) // self.tp_train

    def check(self, cluster: Cluster) -> "Layout":
        for pool, tp, what in ((self.rollout, self.tp_rollout, "rollout"), (self.train, self.tp_train, "train")):
            if not pool:
                raise ConfigError(f"layout: the {what} pool has no GPUs")
            if tp < 1 or len(pool) % tp:
                raise ConfigError(f"layout: {what} TP {tp} does not divide its {len(pool)} GPUs")
            if tp > cluster.gpus_per_node:
                raise ConfigError(f"layout: {what} TP {tp} spans more than one node of {cluster.gpus_per_node} GPUs")
            for gang in self.gangs(pool, tp):
                if len({cluster.node_of(g) for g in gang}) > 1:
                    raise ConfigError(f"layout: {what} TP group {gang} crosses a node boundary")
        return self

    @classmethod
    def colocate(cls, cluster: Cluster, tp_rollout: int = 1, tp_train: int = 1) -> "Layout":
        every = tuple(range(cluster.gpus))
        return cls(every, every, tp_rollout, tp_train).check(cluster)

    @classmethod
    def split(cls, cluster: Cluster, rollout_gpus: int, tp_rollout: int = 1, tp_train: int = 1) -> "Layout":
        if not 0 < rollout_gpus < cluster.gpus:
            raise ConfigError(f"disaggregated layout: rollout GPUs must be between 1 and {cluster.gpus - 1}, "
                              f"got {rollout_gpus}")
        return cls(tuple(range(rollout_gpus)), tuple(range(rollout_gpus, cluster.gpus)),
                   tp_rollout, tp_train).check(cluster)


def hardware(name: str, gpus: int | None = None, partitioned: bool = False) -> Cluster:
    """A preset's cluster. ``partitioned``: decode and compute on SM partitions while both run
    (``cluster.sm_partitions``); the runtime's default is plain streams, and so is this one."""
    try:
        base = PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown hardware {name!r}; choose one of {', '.join(PRESETS)}") from None
    if not partitioned:
        base = replace(base, interference=replace(base.interference, partitioned=False))
    return base.with_gpus(gpus) if gpus is not None else base
