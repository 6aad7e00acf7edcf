"""What ``rollplex bench`` measures and prints: policy names and variants, each policy's result,
the update comparison against serial, the lower bound, the report and its chart, and the profile of
one iteration. ``pipeline/bench/bench.py`` runs the iterations."""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rollplex.errors import RollplexError
from rollplex.pipeline.bench.multi import SPLIT_ROLES, TWO_GPU_POLICIES

if TYPE_CHECKING:
    from rollplex.pipeline.bench.bench import BenchConfig

# One GPU, the default. plain: the same GRPO iteration in plain transformers/torch (pipeline/bench/plain.py),
# the reference every ratio is also printed against.
POLICIES = ("plain", "serial-noshare", "serial", "rollplex")
# rollplex-nofusion: the decode window without stage fusion, so each gain shows on its own.
ALL_POLICIES = POLICIES + ("rollplex-nofusion",) + TWO_GPU_POLICIES  # two-GPU ones: pipeline/bench/multi.py
# Options of the rollplex policies only: how the decode window is shared.
VARIANT_KEYS = {"gate": "prefix work waits until decode has at most this many live rows",
                "sms": "decode's SMs while both streams are busy (0: re-chosen per chunk)",
                "cs": "with sp=1: compute's SMs while both streams are busy (0: the GPU's less decode's); "
                      "without sms, decode keeps the whole GPU and only compute is fenced in",
                "target": "1 (default): matmuls on a partition target its SMs through cuBLASLt; 0: plain cuBLAS",
                "sp": "1: decode and compute on SM partitions while both run; 0 (default): plain streams, "
                      "each on the whole GPU",
                "gp": "1: forwards kept for a backward (the policy's prefix) may run on a partition; "
                      "0 (default): whole GPU",
                "pf": "1 (default): compute work waits out decode's prefill; 0: starts beside it",
                "wc": "with stage fusion and tf=0, chunks from this one on are scored by one node after decode "
                      "(0: per chunk)",
                "gl": "the policy's prefix of micro-batch m waits for the loss of m - N (0, default: no bound)",
                "tf": "train fusion: 1 trains finished groups inside the window, 0 after it "
                      "(default: --train-fusion)",
                "ft": "train fusion: the most tokens one backward over a chunk's finished groups holds "
                      "(train.fusion_batch_tokens; 0, default: mb alone bounds it)",
                "spare": "plain streams: while decode runs, compute's matmuls leave this many SMs free "
                         "(cuBLASLt's SM target; 0, default: none)",
                "prio": "1: decode's stream at high priority, so the GPU issues its blocks ahead of compute's "
                        "as SMs free up (plain streams; a green context's stream keeps the default)"}
# Options of every policy: how the work is batched, so each policy can run at its best settings.
SHAPE_KEYS = {"ppn": "prompts per vit/prefix/suffix node (batched forwards; default: --prompts-per-node)",
              "seq": "plain: sequences per forward and backward (default G, one group)",
              "mb": "prompts per micro-batch: one loss and backward each (default 1)",
              "mt": "training after decode: a micro-batch's groups in backwards of at most this many tokens, "
                    "cut once the responses are known (train.micro_batch_tokens; 0, default: one backward)",
              "spg": "decode steps per CUDA graph launch (default 1)",
              "gil": "Python's GIL switch interval in µs during the policy's timed iterations (default: "
                     "the process's, 5000; a run's cluster.switch_interval_us): how long a compute thread may "
                     "hold the GIL that the decode thread wants back after each graph launch",
              "cudnn": "1: cuDNN's attention on for the policy's eager forwards during its timed iterations; "
                       "default 0, as in the runtime: it builds a plan per new shape (engines/attention_kernels.py). "
                       "Decode's graphs are captured with it either way"}


def file_stem(policy: str) -> str:
    """rollplex:gate=32 -> rollplex_gate32: a file name without the separators some copiers refuse."""
    return policy.replace(":", "_").replace("=", "")


def parse_policy(name: str) -> tuple[str, dict[str, int]]:
    """``rollplex:gate=32:sms=64`` -> ("rollplex", {"gate": 32, "sms": 64}): a policy with its own
    knobs, so variants run side by side in one bench against the same serial run. ``serial#aa``: the
    same policy once more under its own name (the A/A run that measures the noise)."""
    base, *options = name.split("#", 1)[0].split(":")
    if base not in ALL_POLICIES:
        raise RollplexError(f"--policies: {base!r} unknown; choose from {', '.join(ALL_POLICIES)}")
    parsed: dict[str, int] = {}
    known = VARIANT_KEYS | SHAPE_KEYS
    for option in options:
        key, _, value = option.partition("=")
        if key not in known or not value.isdigit():
            raise RollplexError(f"--policies: {name!r}: option {option!r} is not KEY=N with KEY one of "
                                + ", ".join(f"{k} ({v})" for k, v in known.items()))
        if key in VARIANT_KEYS and not base.startswith("rollplex"):
            raise RollplexError(f"--policies: {name!r}: option {key!r} applies to the rollplex policies only")
        if key == "seq" and base != "plain":
            raise RollplexError(f"--policies: {name!r}: option 'seq' applies to the plain policy only")
        parsed[key] = int(value)
    if parsed.get("cs") and not parsed.get("sp"):
        raise RollplexError(f"--policies: {name!r}: option 'cs' fences compute on an SM partition; it needs sp=1")
    return base, parsed


def read_lengths(path: str, prompts: int, samples: int, most: int) -> tuple[tuple[int, ...], ...]:
    """``--lengths FILE``: a JSON list of ``prompts`` lists of ``samples`` response caps in [1, ``most``],
    one per prompt of every iteration (``rollout.length_caps``' draws, so the bench runs train's work)."""
    try:
        caps = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise RollplexError(f"--lengths {path}: {err}") from err
    if not (isinstance(caps, list) and len(caps) == prompts
            and all(isinstance(row, list) and len(row) == samples for row in caps)):
        raise RollplexError(f"--lengths {path}: expected {prompts} lists (--prompts) of {samples} caps (--samples)")
    for p, row in enumerate(caps):
        for cap in row:
            if not (isinstance(cap, int) and not isinstance(cap, bool) and 1 <= cap <= most):
                raise RollplexError(f"--lengths {path}: prompt {p}: {cap!r} is not a whole number in [1, {most}] "
                                    "(--max-new-tokens)")
    return tuple(tuple(row) for row in caps)


def policy_shape(policy: str, *, prompts_per_node: int, stage_fusion: bool, train_fusion: bool) -> dict[str, Any]:
    """The batch-shape fields a bench policy's name sets, its options over the bench's defaults:
    prompts per node and per micro-batch, stage fusion (the rollplex policies that score in the
    window), train fusion (rollplex, over one rank or two) and late-chunk scoring. The bench
    compiles with them and ``benchmarks/predict_bench.py`` simulates with them."""
    base, options = parse_policy(policy)
    fused = stage_fusion and base in ("rollplex", "rollplex-dp2")
    return {"prompts_per_node": options.get("ppn", prompts_per_node), "micro_batch_groups": options.get("mb", 1),
            "stage_fusion": fused,
            "train_fusion": fused and bool(options.get("tf", train_fusion)),
            "window_chunks": options.get("wc", 0), "grad_prefix_lookahead": options.get("gl", 0),
            "fusion_batch_tokens": options.get("ft", 0), "micro_batch_tokens": options.get("mt", 0)}


@dataclass
class PolicyResult:
    """One policy's timed iterations. Everything per iteration is reported as its median over them,
    as the iteration time is: a slow first iteration (allocator growth, a first capture) would pull
    a mean's breakdown off the median's total."""

    policy: str
    seconds: list[float] = field(default_factory=list)
    kinds: list[dict[str, float]] = field(default_factory=list)  # per iteration: seconds per node kind
    hidden: list[float] = field(default_factory=list)  # per iteration: share of prefix work under decode
    read_bytes: list[float] = field(default_factory=list)  # per iteration: weights + KV bytes decode read
    generated: list[float] = field(default_factory=list)  # per iteration: response tokens
    bounds: list[float] = field(default_factory=list)  # per iteration: the true lower bound (lower_bound)
    peak_bytes: int = 0
    alloc_retries: list[int] = field(default_factory=list)  # per iteration: the allocator's emptied-cache retries
    # Serial only: its weights after the first step, on the host, sampled and on its own replayed
    # rollout. Every other policy is compared with these on the device as it ends (update_difference).
    weights: dict[str, torch.Tensor] | None = None
    replayed_weights: dict[str, torch.Tensor] | None = None
    sampled_difference: float | None = None
    replayed_difference: float | None = None
    trace: dict | None = None
    responses: list | None = None
    ranks_disagree: float = 0.0  # two data-parallel ranks: largest weight difference after a step
    comparison: dict | None = None  # its update against serial's (compare_update)
    same_graph_as: str | None = None  # an earlier policy of the same graph (same_graph_as)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def tokens(self) -> float:
        return statistics.median(self.generated) if self.generated else 0.0

    @property
    def by_kind(self) -> dict[str, float]:
        names = sorted({k for it in self.kinds for k in it})
        return {k: statistics.median(it.get(k, 0.0) for it in self.kinds) for k in names}

    @property
    def decode_seconds(self) -> float:
        return self.by_kind.get("decode_chunk", 0.0)

    @property
    def hidden_share(self) -> float:
        return statistics.median(self.hidden) if self.hidden else 0.0

    def decode_bandwidth(self) -> float:
        """Median over iterations of the bytes decode read over its time."""
        rates = [b / it["decode_chunk"] for b, it in zip(self.read_bytes, self.kinds) if it.get("decode_chunk")]
        return statistics.median(rates) if rates else 0.0



def profile_iteration(executor, graph, inputs: dict[str, Any], path: Path) -> None:
    """One more iteration under torch.profiler; the top operators and kernels by device time, per
    node kind (record_function ranges named after the node kinds) and overall."""
    from torch.profiler import ProfilerActivity, profile

    from rollplex.fsio import atomic_write_text

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:  # nodes run on the stream threads, not this one
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: device kernels are still captured, host operators only here
        config = None
    with profile(activities=activities, experimental_config=config) as prof:
        executor.run(graph, 1, inputs)
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    atomic_write_text(path, prof.key_averages().table(sort_by=key, row_limit=40) + "\n" + long_host_calls(prof))


def long_host_calls(prof, min_ms: float = 20.0, limit: int = 200) -> str:
    """Host calls of at least ``min_ms``, in time order, per thread: where a stream thread blocks
    (a synchronize, an allocation, a lock) rather than launches. Leaves and runtime calls only, so
    each stall is listed once, not again under every enclosing operator."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    if not events:
        return ""
    t0 = min(e.time_range.start for e in events)
    rows = [e for e in events if e.time_range.elapsed_us() >= min_ms * 1e3
            and (e.name.startswith(("cuda", "cu", "node:")) or not e.cpu_children)]
    rows.sort(key=lambda e: e.time_range.start)
    lines = [f"host calls of at least {min_ms:.0f} ms (start and duration in ms, thread):"]
    lines += [f"{(e.time_range.start - t0) / 1e3:9.1f} {e.time_range.elapsed_us() / 1e3:9.1f}  {e.thread:>8}  {e.name}"
              for e in rows[:limit]]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class DeviceRates:
    """The best the device does, measured on it once per bench: the true lower bound's two rates."""

    copy_bytes_per_s: float  # a device-to-device copy, bytes read plus bytes written
    matmul_flops_per_s: float  # a large square matmul in the bench's dtype


def measure_rates(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> DeviceRates:
    """A 1 GiB copy (64 MiB on the CPU) and an 8192² matmul (1024² on the CPU), each the best of
    ``repeats`` after one warm-up. The H200 gives about 4.3 TB/s and 790 TFLOP/s in bf16; an H100 has
    the same cores and about 70% of that bandwidth, so constants would misstate its bound."""
    cuda = device.type == "cuda"
    nbytes, n = (2**30, 8192) if cuda else (2**26, 1024)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t)
        return min(times)

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = best(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    matmul = best(lambda: a @ b)
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return DeviceRates(2 * nbytes / copy, 2 * n**3 / matmul)


H200_RATES = DeviceRates(4.3e12, 788e12)  # one H200's: every bound the bench printed before 2026-12-07


def note_iteration(out_dir: Path, policy: str, iteration: int, result, log) -> None:
    """Each iteration as it ends, a console line and a line of ``iterations.jsonl``: a bench stopped by a
    time limit keeps what it measured (bench.json is written as policies end, all at once when they
    take turns)."""
    from rollplex.fsio import append_line
    from rollplex.pipeline.plan.trace import seconds_by_kind

    append_line(out_dir / "iterations.jsonl", json.dumps(
        {"policy": policy, "iteration": iteration, "warm_up": iteration == 0, "seconds": round(result.seconds, 4),
         "peak_hbm_bytes": result.peak_memory_bytes, "alloc_retries": result.alloc_retries,
         "seconds_by_kind": seconds_by_kind(result.events)}))
    log(f"  iteration {iteration} {policy}: {result.seconds:.3f} s{' (warm-up)' if iteration == 0 else ''}, "
        f"peak {result.peak_memory_bytes / 2**30:.1f} GiB" + (f", {result.alloc_retries} allocator retries"
                                                              if result.alloc_retries else ""))


def record_iteration(cfg: BenchConfig, spec, weight_bytes: int, res: PolicyResult, result, decode_steps: int,
                     policy: str, rates: DeviceRates = H200_RATES) -> None:
    """Add one timed iteration to the policy's result. ``weight_bytes``: the LM weights a decode step
    reads (the vision tower is not read)."""
    from rollplex.pipeline.plan.trace import chrome_trace, overlap_seconds, seconds_by_kind

    res.seconds.append(result.seconds)
    res.peak_bytes = max(res.peak_bytes, result.peak_memory_bytes)
    res.alloc_retries.append(result.alloc_retries)
    res.kinds.append(seconds_by_kind(result.events))
    trace = chrome_trace(result.events, 0, policy)
    prefix_time = sum(e["dur"] for e in trace["traceEvents"] if e.get("cat") in ("prefix", "vit_encode")) / 1e6
    hidden = overlap_seconds(trace, {"prefix", "vit_encode"}, {"decode_chunk"})
    res.hidden.append(hidden / prefix_time if prefix_time else 0.0)
    rows = result.output["report"]["rows"]
    res.generated.append(result.output["report"]["metrics"]["response_len_mean"] * cfg.prompts * cfg.samples)
    res.trace = trace
    prompt_len = cfg.vision_tokens + cfg.text_tokens + 2
    kv_reads = sum(prompt_len * len(r["response_token_ids"]) + len(r["response_token_ids"]) ** 2 / 2 for r in rows)
    res.read_bytes.append(decode_steps * weight_bytes + kv_reads * spec.kv_bytes_per_token(2))
    res.bounds.append(lower_bound(cfg, spec, rows, rates, gpus=2 if parse_policy(policy)[0] in TWO_GPU_POLICIES else 1))


def allocator_backend() -> str:
    """"native" (the caching allocator: blocks cached per stream) or "cudaMallocAsync" (one
    stream-ordered pool for every stream). Chosen by PYTORCH_CUDA_ALLOC_CONF=backend:... before
    torch loads, so the bench records it rather than sets it."""
    return torch.cuda.get_allocator_backend()


def lower_bound(cfg: BenchConfig, spec, rows: list[dict], rates: DeviceRates = H200_RATES, gpus: int = 1) -> float:
    """The iteration's true lower bound from its own responses (``rows``): the longest one's decode
    steps at HBM bandwidth, each reading the weights and the KV the best algorithm must read (each
    live group's prompt KV once, shared-prefix attention, and each live row's own tokens), against
    all its FLOPs at ``peak``: the vision tower once per prompt, five prefill-equivalents per prompt
    (decode's prefill, the reference, the policy's forward and its backward at twice the forward)
    and as many per response token (decode, the reference's suffix, the policy's forward and
    backward). Over ``gpus`` GPUs each reads the weights every step and a share of the KV, and does
    a share of the FLOPs."""
    prompt = cfg.vision_tokens + cfg.text_tokens + 2
    kv = spec.kv_bytes_per_token(2)
    groups: dict[str, list[int]] = {}
    for r in rows:
        groups.setdefault(r["prompt_id"], []).append(len(r["response_token_ids"]))
    lengths = [n for g in groups.values() for n in g]
    steps = max(lengths, default=0)
    kv_reads = prompt * sum(max(g) for g in groups.values()) + sum(n * (n + 1) / 2 for n in lengths)
    decode_bytes = steps * spec.lm_params * 2 + kv_reads * kv / gpus
    tokens = sum(lengths)
    context = prompt + (tokens / max(len(lengths), 1)) / 2
    patches = cfg.vision_tokens * spec.spatial_merge ** 2
    flops = (len(groups) * (spec.vit_flops(patches, patches) + 5 * spec.prefill_flops(prompt))
             + 5 * spec.lm_flops(tokens, context, tokens))
    return max(decode_bytes / rates.copy_bytes_per_s, flops / gpus / rates.matmul_flops_per_s)


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """(median, low, high): the median with a distribution-free interval from order statistics,
    [x(k), x(n+1-k)] for the largest k whose coverage is at least ``level``; None when n is too
    small for one (n ≥ 6 for 95%)."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        return None
    below, k = 0.0, 0  # P(Binomial(n, 1/2) < k), the chance the median lies below x(k)
    while True:
        nxt = below + math.comb(n, k) / 2 ** n
        if 2 * nxt > 1 - level or k + 1 > n // 2:
            break
        below, k = nxt, k + 1
    if k == 0:
        return None
    return statistics.median(xs), xs[k - 1], xs[n - k]


def paired(a: PolicyResult, b: PolicyResult) -> list[float]:
    """``a``'s speed-up over ``b`` iteration by iteration (b's seconds over a's): the policies took
    turns, so iteration i of both met the same workload and the same state of the machine."""
    return [tb / ta for ta, tb in zip(a.seconds, b.seconds) if ta > 0]


def report(cfg, spec, results: dict[str, PolicyResult], out_dir: Path, log, failed: dict[str, str] | None = None,
           rates: DeviceRates | None = None) -> dict:
    from rollplex.fsio import atomic_write_text
    from rollplex.pipeline.plan.trace import combine_traces

    order = [*cfg.policies, *(p for p in results if p not in cfg.policies)]  # an A/A copy after the policies
    results = {p: results[p] for p in order if p in results}
    base = results.get("serial-noshare")
    rows = []
    log("")
    width = max([16, *(len(n) for n in results)])
    log(f"{'policy':{width}s} {'s/it':>7s} {'×noshare':>9s} {'peak GiB':>9s} {'hidden':>7s} {'tok/s':>8s} {'÷bound':>7s} "
        f"{'decode TB/s':>11s}")
    for name, res in results.items():
        gpus = 2 if parse_policy(name)[0] in TWO_GPU_POLICIES else 1
        over_bound = [t / b for t, b in zip(res.seconds, res.bounds) if b > 0]
        bound = statistics.median(res.bounds) if res.bounds else float("nan")
        speedup = base.median / res.median if base else None  # JSON null, not NaN, without the baseline
        row = {"policy": name, "median_s": res.median, "all_s": res.seconds, "speedup_vs_serial_noshare": speedup,
               "peak_hbm_bytes": res.peak_bytes, "alloc_retries_per_iteration": res.alloc_retries,
               "prefix_hidden_share": res.hidden_share,
               "tokens_per_s": res.tokens / res.median, "lower_bound_s": bound,
               "ratio_to_bound": statistics.median(over_bound) if over_bound else None,
               "ratio_to_bound_per_iteration": over_bound,
               "seconds_by_kind": res.by_kind, "seconds_by_kind_per_iteration": res.kinds,
               "decode_seconds": res.decode_seconds,
               "decode_bytes_per_s": res.decode_bandwidth(), "gpus": gpus,
               "ranks_max_weight_difference": res.ranks_disagree, "same_graph_as": res.same_graph_as}
        rows.append(row)
        shown = f"{speedup:9.2f}" if speedup is not None else f"{'-':>9s}"
        ratio = f"{row['ratio_to_bound']:7.2f}" if over_bound else f"{'-':>7s}"
        log(f"{name:{width}s} {res.median:7.3f} {shown} {res.peak_bytes / 2**30:9.1f} {res.hidden_share:7.0%} "
            f"{row['tokens_per_s']:8.0f} {ratio} {res.decode_bandwidth() / 1e12:11.2f}")
    for name, res in results.items():
        if any(res.alloc_retries):
            log(f"{name}: the allocator emptied its cache and retried {res.alloc_retries} times in its timed "
                "iterations (each retry waits for the whole device)")
    # One Perfetto trace of every policy's last timed iteration, one above the other.
    traces = {name: res.trace for name, res in results.items() if res.trace is not None}
    if traces:
        atomic_write_text(out_dir / "trace.json", json.dumps(combine_traces(traces)))
    ratios = speedups(results)
    for line in ratios:
        log(line)
    updates = [res.comparison for res in results.values() if res.comparison is not None]
    checks = update_lines(updates)
    for line in checks:
        log(line)
    for name, why in (failed or {}).items():
        log(f"{name}: not measured: {why}")
    for name, res in results.items():
        if res.same_graph_as:
            log(f"{name}: the graph of {res.same_graph_as}, which met each iteration's shapes first: "
                f"compare the two with their order swapped too")
    for name, res in results.items():
        if parse_policy(name)[0] == "rollplex-dp2":
            log(f"{name}: ranks' weights after the step differ by at most {res.ranks_disagree:.1e}")
    summary = {"config": cfg.__dict__ | {"policies": list(cfg.policies)}, "results": rows, "updates": updates,
               "speedups": ratios,
               "update_checks": checks, "failed": dict(failed or {}),
               "device": torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu",
               "cuda_allocator": allocator_backend() if cfg.device == "cuda" else None,
               "bound_rates": dataclasses.asdict(rates) if rates else None,
               "date": time.strftime("%Y-%m-%d")}
    atomic_write_text(out_dir / "bench.json", json.dumps(summary, indent=1, default=str))
    _plot(results, out_dir)
    return summary


def same_graph_as(graphs: dict) -> dict[str, str]:
    """{policy: the first policy before it, in run order, whose graph is the same}: variants that
    differ only in a runtime knob (sp, gil, cudnn, ...). On each iteration's inputs such a policy meets
    the shapes the earlier one met first, so whatever torch builds per new shape is ready for it:
    in runs 23-30 (cuDNN's attention plans) that was worth 0.9-1.3 s of a 5-6 s iteration, and
    0.14 s in run 34, with cuDNN's attention off for eager forwards."""
    first: dict[tuple, str] = {}
    out = {}
    for policy, graph in graphs.items():
        if graph is None:  # plain: no graph
            continue
        key = tuple(sorted((n.name, n.kind, n.model or "", repr(sorted(n.args.items(), key=str))) for n in graph))
        out.update({policy: first[key]} if key in first else {})
        first.setdefault(key, policy)
    return out


def speedups(results: dict[str, PolicyResult]) -> list[str]:
    """The ratios the issue asks for, each a gain on its own: prefix sharing (serial vs noshare), the
    decode window (rollplex-nofusion vs serial), stage fusion (rollplex vs rollplex-nofusion), two
    GPUs as ranks vs split roles, and every policy against ``plain``. Each is the median of the
    per-iteration ratios with its 95% interval; an A/A pair (``serial#aa`` against ``serial``) says
    how far the same policy moves by itself, and a run whose A/A interval misses 1 does not count."""
    base_pairs = [("serial", "serial-noshare"), ("rollplex", "serial-noshare"), ("rollplex", "serial"),
                  ("rollplex-nofusion", "serial"), ("rollplex", "rollplex-nofusion"), ("rollplex-dp2", "rollplex"),
                  ("disaggregated", "serial"), ("disaggregated", "disaggregated-noshare")]
    base_pairs += [(b, "plain") for b in ALL_POLICIES if b != "plain"]
    base_pairs += [("rollplex-dp2", b) for b in SPLIT_ROLES]  # two GPUs: ranks against split roles

    def named(base: str) -> list[str]:  # every row of a policy, whatever options each was run with
        return [n for n in results if "#" not in n and parse_policy(n)[0] == base]

    pairs = [(a, b) for base_a, base_b in base_pairs for a in named(base_a) for b in named(base_b)]
    if "serial" in results:  # serial's variants against serial
        pairs += [(v, "serial") for v in named("serial") if v != "serial"]
    lines = []
    for a, b in dict.fromkeys(pairs):
        if results[a].seconds and results[b].seconds:
            lines.append(f"{a} is {_ratio(paired(results[a], results[b]), b)}")
    for name in results:
        if "#" in name and name.split("#", 1)[0] in results:
            base = name.split("#", 1)[0]
            ratios = paired(results[name], results[base])
            stats = median_interval(ratios)
            verdict = ("too few iterations for an interval: the run does not count" if stats is None else
                       "the interval contains 1: the run counts" if stats[1] <= 1 <= stats[2] else
                       "the interval does not contain 1: drift or order moves the numbers more than that; the run "
                       "does not count")
            lines.append(f"A/A: {name} is {_ratio(ratios, base)}; {verdict}")
    return lines


def _ratio(ratios: list[float], baseline: str) -> str:
    stats = median_interval(ratios)
    if stats is None:
        return f"{statistics.median(ratios):.2f}x {baseline} (n={len(ratios)}: too few iterations for a 95% interval)"
    return f"{stats[0]:.2f}x {baseline} (95% {stats[1]:.2f}-{stats[2]:.2f}, n={len(ratios)})"


def update_difference(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                      start: dict[str, torch.Tensor]) -> float:
    """‖u − r‖ / ‖r‖, u and r the updates (weights − start) in fp32, summed in fp64 on ``start``'s
    device one tensor at a time: no fp32 copy of a whole model is ever made, on the host or the GPU."""
    num = den = None
    for k, ref in reference.items():
        base = start[k].float()
        r = ref.to(base.device).float() - base
        u = weights[k].to(base.device).float() - base
        d, n = (u - r).double().pow(2).sum(), r.double().pow(2).sum()
        num, den = (d, n) if num is None else (num + d, den + n)
    return 0.0 if num is None else math.sqrt(float(num) / max(float(den), 1e-30))


def compare_update(res: PolicyResult, ref: PolicyResult | None) -> dict | None:
    """The first iteration's update (new − start weights) from the same start, against serial's
    (``ref``). ``sampled``: each policy's own rollout (bf16 kernels on another SM partition may round
    differently and flip a sample, and then everything downstream differs). ``replayed``: serial's
    recorded rollout under every policy, so only the scoring, the loss and the update are compared;
    serial's own row compares its replayed update with its sampled one: the run-to-run floor."""
    if ref is None or ref.weights is None:
        return None
    return {"policy": res.policy, "reference": ref.policy,
            "sampled": 0.0 if res is ref else res.sampled_difference,
            "identical_responses": sum(a == b for a, b in zip(res.responses or [], ref.responses or [])),
            "responses": len(ref.responses or []),
            "replayed": res.replayed_difference}


def update_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        ref = r.get("reference", "serial")
        if r["policy"] == ref:
            if r["replayed"] is not None:
                lines.append(f"update {ref} on its replayed rollout vs sampled: {r['replayed']:.2e} (the replay itself)")
            continue
        lines.append(f"update {r['policy']} vs {ref}: sampled {r['sampled']:.2e} ({r['identical_responses']}/"
                     f"{r['responses']} responses identical)" + (f", on {ref}'s replayed rollout {r['replayed']:.2e}"
                                                                if r["replayed"] is not None else ""))
    return lines


def _plot(results: dict[str, PolicyResult], out_dir: Path) -> None:
    if not results:  # every policy failed so far: bench.json says why, there is nothing to draw
        return
    try:
        import matplotlib
    except ImportError:  # a bare GPU machine: the traces are written, the PNG is drawn elsewhere
        print("bench: matplotlib is not installed; bench.png not drawn (trace.json is)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.2 * len(results)), squeeze=False)
    colours = {"decode_chunk": "#4c72b0", "prefix": "#dd8452", "vit_encode": "#c44e52", "suffix_score": "#55a868",
               "loss": "#8172b3", "optimizer_step": "#937860", "weight_sync": "#da8bc3"}
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        if res.trace is None:
            continue
        tracks = {}
        for e in res.trace["traceEvents"]:
            if e.get("ph") != "X":
                continue
            y = tracks.setdefault((e["pid"], e["tid"]), len(tracks))
            ax.barh(y, e["dur"] / 1e6, left=e["ts"] / 1e6, color=colours.get(e["cat"], "#999999"), height=0.8)
        ax.set_yticks(list(tracks.values()))
        ax.set_yticklabels([f"{p}/{t}" if len({k[0] for k in tracks}) > 1 else str(t) for p, t in tracks])
        ax.set_title(f"{name}: {res.median:.2f} s/iteration", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=110)
    plt.close(fig)
