"""Worker-side state: the engines a Dask worker hosts, its streams, and the values its nodes hand on
(what runs a node on them is ``pipeline/run/execution.py``).

Engines are long-lived per worker. They live in this importable module (``current_host()``), set up
by a ``WorkerPlugin``, because functions submitted from ``__main__`` are pickled by value and would
see fresh globals. Tensors stay in the worker: a node's task returns a dict of its output values,
Dask passes that dict by reference to consumers on the same worker, and each value is dropped as
soon as its last consumer has run (a per-value use count), not when the whole dict is released.
"""
from __future__ import annotations

import functools
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from rollplex.errors import RollplexError
from rollplex.pipeline.run.partitions import WindowSharing
from rollplex.pipeline.run.usercode import user_files

STREAMS = ("decode", "compute", "host")  # a worker's streams; Dask resources of the same names


@dataclass
class IterationResult:
    """What running one iteration returns to the driver, whichever executor ran it."""

    output: Any
    events: list[dict]
    peak_memory_bytes: int
    seconds: float
    started: float = 0.0  # when its first node could start (epoch seconds, the worker's clock)
    prepare_seconds: float = 0.0  # on the worker before that: its prompts built from their refs
    # CUDA allocations that found no free block, emptied the allocator's cache and tried again: each
    # such cudaFree waits for the whole device, so a window that meets them loses its overlap.
    alloc_retries: int = 0


@dataclass
class IterationSettings:
    """Per-run constants every node may read; shipped once with the host spec."""

    seed: int
    samples: int
    max_new_tokens: int
    temperature: float
    top_p: float
    pad_id: int
    stop_token_ids: tuple[int, ...]
    params: dict = field(default_factory=dict)
    rollout_is_cap: float | None = None  # train.rollout_is.cap; None: rollout_is_weights are all 1
    length_caps: dict | None = None  # rollout.length_caps: each prompt's samples capped by a log-normal draw

    @property
    def score_temperature(self) -> float:
        # Greedy sampling (temperature 0) scores under the untempered distribution.
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class HostSpec:
    """Everything a worker needs to build its engines. Small and picklable."""

    model_path: str
    reference_path: str  # frozen copies of the policy (the reference) load the policy as RL began
    device: str
    dtype: str
    threads: int
    decode_engine: str
    train_engine: str
    score_engine: str
    decode_options: dict
    train_options: dict
    algorithm: str  # dags/ name or a path to a DAG file
    reward: str
    settings: IterationSettings
    trainable: tuple[str, ...] = ("actor",)
    frozen: tuple[str, ...] = ("ref",)
    ref_cache_bytes: int = 0  # cross-iteration cache of frozen models' prefixes; 0 disables it
    world_size: int = 1  # data-parallel ranks; >1: engines are built by cluster.form_ranks, not the plugin
    tp_rollout: int = 1  # ranks per tensor-parallel decode engine (consecutive ranks; pipeline/compile/ranks.py)
    weight_sharing: str = "off"  # auto: the decode engine runs on the policy trainer's storage (engines/sharing.py)
    window: WindowSharing = field(default_factory=WindowSharing)  # how work beside decode shares the GPU
    # The run's prompt source (pickled as its recipe: a file dataset is re-read here), so that the
    # driver sends item indices and this worker builds the pixels it reads (tasks.data.PromptStore).
    task: Any = None
    eval_task: Any = None  # the validation prompts (eval.*), built here the same way
    # The run's scheduled iterations by name, installed once: each iteration then sends its name
    # and its prompts' indices, never the graph itself.
    graphs: dict = field(default_factory=dict)
    # A multi-turn run's environment (tasks/environments.py): its registered name, checked options, and
    # the seconds a step may take.
    env_name: str | None = None
    env_options: dict = field(default_factory=dict)
    env_timeout: float = 30.0


def shares_policy_base(decl, policy: str) -> bool:
    """Whether a frozen model is a copy of the policy as RL began (the reference), not a model of its
    own (an engine or a checkpoint of its own: a reward model)."""
    return decl.copy_of == policy and not decl.trainable and decl.engine is None and decl.path is None


class WorkerHost:
    """``engines``/``decode``/``streams``/``partitions`` may be given ready-made (benchmarks build them
    once and run several policies on them); otherwise they are built from the spec."""

    def __init__(self, spec: HostSpec, name: str = "worker", engines: dict | None = None, decode=None,
                 streams: dict | None = None, tokenizer=None, partitions=None) -> None:
        from rollplex.engines.attention_kernels import eager_attention_without_cudnn
        from rollplex.engines.base import EngineContext, get_engine
        from rollplex.pipeline.run.algorithms import load_algorithm
        from rollplex.tasks.rewards import get_reward

        self.spec = spec
        self.name = name
        # torch._C's own setter: once vLLM's CPU worker has loaded in this process it replaces
        # torch.set_num_threads with a no-op, and a run must not inherit the thread count of whatever
        # ran here before it (another thread count sums in another order: other bits).
        torch._C.set_num_threads(spec.threads)
        torch.manual_seed(spec.settings.seed)
        self.device = torch.device(spec.device)
        eager_attention_without_cudnn(self.device)
        dtype = getattr(torch, spec.dtype)
        self.algorithm = load_algorithm(spec.algorithm)
        decl = self.algorithm.reward_fn
        if decl is None:
            self.reward_fn = get_reward(spec.reward)
        else:  # fn(text, answer, **hyperparameters): the config's params override the defaults
            extra = {k: spec.settings.params.get(k, v) for k, v in decl.params.items()}
            self.reward_fn = functools.partial(decl.fn, **extra) if extra else decl.fn
        self.user_files = user_files(self.algorithm, self.reward_fn)  # whose frames make an error the user's
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(spec.model_path)

        def build(engine: str, role: str, path: str, options: dict):
            ctx = EngineContext(path, self.device, dtype, spec.settings.seed, options)
            return get_engine(engine, role).factory(ctx)

        self.engines: dict[str, Any] = dict(engines or {})
        if engines is None:
            # A model may name its own engine and checkpoint (ModelDecl.engine/path); a critic's
            # value head travels as an option. Frozen copies start from the reference. LoRA adapts
            # the policy alone: its base is the reference, and its frozen copies are that base with
            # the adapters off, on the policy's own weights (engines/lora.py).
            decls, policy = self.algorithm.models, self.algorithm.rollout_model
            for model in spec.trainable:
                decl = decls.get(model)
                options = {**spec.train_options, **({"head": decl.head} if decl and decl.head != "lm" else {})}
                if model != policy:
                    options.pop("lora", None)
                base = spec.reference_path if options.get("lora") else spec.model_path
                self.engines[model] = build((decl and decl.engine) or spec.train_engine, "train",
                                            (decl and decl.path) or base, options)
            adapted = getattr(self.engines.get(policy), "peft", None) is not None
            for model in spec.frozen:
                decl = decls.get(model)
                options = {"head": decl.head} if decl and decl.head != "lm" else {}
                if adapted and decl is not None and shares_policy_base(decl, policy):
                    from rollplex.engines.lora import without_adapters

                    options = {**options, "module": without_adapters(self.engines[policy].module),
                               "shares_weights": True}
                self.engines[model] = build((decl and decl.engine) or spec.score_engine, "score",
                                            (decl and decl.path) or spec.reference_path, options)
        self.sharing_note = ""
        if decode is None:
            options = self._decode_options(spec)
            if spec.tp_rollout > 1:
                options = {**options, "tp_group": tensor_parallel_group(spec.tp_rollout)}
            decode = build(spec.decode_engine, "decode", spec.model_path, options)
        self.decode = decode
        self.streams = streams if streams is not None else self._make_streams()
        self.prompts = self.eval_prompts = None
        self.environment = self.render = None
        if spec.env_name is not None:  # a multi-turn run: environments answer, rendered as user turns
            from transformers import AutoProcessor

            from rollplex.tasks.environments import get_environment
            from rollplex.tasks.turns import ObservationRenderer

            from rollplex.tasks.environments import StepPool

            self.environment = get_environment(spec.env_name)
            self.render = ObservationRenderer(AutoProcessor.from_pretrained(spec.model_path))
            self.env_pool = StepPool()
        if spec.task is not None or spec.eval_task is not None:
            from transformers import AutoProcessor

            from rollplex.tasks.data import PromptBuilder, PromptStore

            builder = PromptBuilder(AutoProcessor.from_pretrained(spec.model_path))
            self.prompts, self.eval_prompts = (
                None if task is None else PromptStore(task, builder, dtype=dtype, pin=self.device.type == "cuda")
                for task in (spec.task, spec.eval_task))
        self.refcache = None
        if spec.ref_cache_bytes and self.engines and spec.frozen:
            from rollplex.pipeline.run.refcache import RefPrefixCache

            self.refcache = RefPrefixCache(spec.ref_cache_bytes)
            for model in spec.frozen:
                self.register_frozen(model)
        # Optional SM partitions (pipeline/run/partitions.py), re-chosen from the live decode batch at each
        # decode chunk. A GPU stream runs on its partition while the other GPU stream is busy, and on
        # the whole GPU alone.
        self.partitions = None
        self.window = spec.window
        self._switch_interval = sys.getswitchinterval()  # the process's own, given back on close
        if spec.window.switch_interval_us:
            sys.setswitchinterval(spec.window.switch_interval_us / 1e6)
        self._decode_iteration: int | None = None  # the iteration whose decode last started
        capture = getattr(self.decode, "capture_graphs", None)
        if capture is not None and self.streams.get("decode") is not None:
            capture(self.streams["decode"], top_p=self.nucleus)  # every batch size now, not mid-rollout
        if partitions is not None:
            self.use_partitions(partitions)
        elif spec.window.partitions and self.device.type == "cuda" and self.streams:
            from rollplex.pipeline.run.partitions import make

            self.use_partitions(make(self.device.index or 0, spec.window.decode_sms, spec.window.compute_sms))
        self._busy = {"decode": 0, "compute": 0}
        if self.device.type == "cuda":
            alloc_retries_since_drain(self.device)  # from here on
        self._stream_wait = threading.local()  # per stream thread: its last node's wait for the device
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._remaining: dict[tuple[int, str], int] = {}
        # One OS thread per stream, whatever Dask thread holds the stream's resource. Thread-local
        # state then follows the stream: the CUDA stream or green context it binds, and autograd's
        # per-thread op sequence numbers, which order a backward's gradient accumulation. Without
        # it, where a forward ran would change the bits of the update.
        self._stream_threads = {name: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rollplex-{name}")
                                for name in STREAMS}

    @property
    def nucleus(self) -> bool:
        """Whether the run samples with top-p: its decode steps are other graphs, captured up front
        too, since a capture in the decode window synchronizes the whole device."""
        return self.spec.settings.top_p < 1.0 and self.spec.settings.temperature > 0

    def _decode_options(self, spec: HostSpec) -> dict:
        """With engines.weight_sharing auto, the decode engine runs on the policy trainer's storage
        (its module, fused groups allocated as one buffer for vLLM); where it cannot, say why."""
        from rollplex.pipeline.plan.weightshare import sharing_refusal

        train = self.engines.get(self.algorithm.rollout_model)
        if spec.weight_sharing == "off" or train is None or getattr(train, "role", "") != "train":
            return spec.decode_options
        why = sharing_refusal(spec.decode_engine, spec.train_engine, int(spec.train_options.get("zero_stage", 0)),
                              bool(spec.train_options.get("lora")))
        if why:
            self.sharing_note = f"weight sharing off: {why}"
            return spec.decode_options
        if spec.decode_engine in ("vllm", "torch-graph"):  # both project q|k|v and gate|up as one each
            from rollplex.engines.sharing import fuse_for_rollout

            fuse_for_rollout(train.module, getattr(train, "name", ""))
        return {**spec.decode_options, "share_model": train.module}

    def _make_streams(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {}
        return {"decode": torch.cuda.Stream(self.device), "compute": torch.cuda.Stream(self.device)}

    def register_frozen(self, model: str) -> None:
        """(Re)name a frozen model's weights for the prefix cache; after its weights change."""
        if self.refcache is not None:
            self.refcache.register(model, self.engines[model].model)

    # -- what tasks see -------------------------------------------------------------------------
    def model(self, name: str) -> torch.nn.Module:
        engine = self.engines[name]
        return engine.module if engine.role == "train" else engine.model

    def train_engine(self, name: str):
        return self.engines[name]

    def prompt(self, value: Any) -> Any:
        """A graph input as its nodes read it: a ``PromptRef`` built into its prompt here."""
        return self.prompts.resolve(value) if self.prompts is not None else value

    def graph(self, graph):
        """An iteration graph, or the name of one installed with the host spec."""
        return self.spec.graphs[graph] if isinstance(graph, str) else graph

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- bookkeeping -----------------------------------------------------------------------------
    def release(self, iteration: int, bundles: dict[str, dict], uses: dict[str, int]) -> None:
        """Count one use of each input; drop a value from its producer's bundle after its last use."""
        with self._lock:
            for value, bundle in bundles.items():
                if uses[value] <= 0:  # read on several workers: freed with its Dask key, not counted
                    continue
                key = (iteration, value)
                left = self._remaining.get(key, uses[value]) - 1
                if left <= 0:
                    self._remaining.pop(key, None)
                    # Replaced, not popped: the same bundle may be on its way to another rank right now
                    # (it also holds a value read there), and Dask's serializer walks its items; a
                    # dict that shrinks under it fails that transfer and hangs the iteration.
                    bundle[value] = RELEASED
                else:
                    self._remaining[key] = left

    def record(self, event: dict) -> None:
        with self._lock:
            self.events.append(event)

    def drain(self) -> dict:
        with self._lock:
            events, self.events = self.events, []
        peak, retries = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 0
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            retries = alloc_retries_since_drain(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return {"events": events, "peak_memory_bytes": int(peak), "alloc_retries": int(retries), "worker": self.name,
                "pid": os.getpid()}

    def wait_for_prefill(self, iteration: int, poll: float = 0.002, limit: float = 30.0,
                         start_limit: float = 0.5) -> None:
        """Hold compute work while decode's prefill runs: it is compute-bound, and run beside it on
        a partition both take longer (run 8: the first chunk went from 0.42 to 0.69 s beside the
        reference prefix). Work that became ready with decode (both wait on the vision tower) first
        waits up to ``start_limit`` for this iteration's decode to begin, on a host that decoded in
        an earlier iteration. The engine's state is read without its lock (a chunk holds the lock
        throughout), and ``limit`` bounds the wait, so a misread costs time, never a hang."""
        prefilling = getattr(self.decode, "prefilling", None)
        live = getattr(self.decode, "live_rows", None)
        if prefilling is None or live is None:
            return
        now = time.time()
        # Only on a host whose graphs decode (one has run here before): others never wait for it.
        while self._decode_iteration not in (None, iteration) and time.time() < now + start_limit:
            time.sleep(poll)
        while self._busy.get("decode") and (prefilling() or not live()) and time.time() < now + limit:
            time.sleep(poll)

    def wait_for_light_decode(self, poll: float = 0.002) -> None:
        live = getattr(self.decode, "live_rows", None)
        if live is None:
            return
        while self._busy.get("decode") and live() > self.window.gate_rows:
            time.sleep(poll)

    def use_partitions(self, partitions) -> None:
        """Attach SM partitions (or None). The decode engine captures its graphs on every split's
        stream now: a capture synchronizes the device and empties the allocator's cache, which in
        the middle of a decode window would stall the compute stream."""
        from rollplex.pipeline.run.partitions import sm_target

        self.partitions = partitions
        capture = getattr(self.decode, "capture_graphs", None)
        if partitions is None or capture is None:
            return
        timed = getattr(self.decode, "step_seconds_on", None)
        for stream, sms in partitions.decode_streams():
            with sm_target(sms if self.window.sm_target else None, partitions.total_sms):
                capture(stream, top_p=self.nucleus)
            steps = timed(stream) if timed is not None else {}
            if steps:  # the split is then chosen from these timings
                partitions.measured[sms] = steps

    def last_stream_wait(self) -> float | None:
        """Seconds the calling stream thread's last node waited for its kernels (None off CUDA), then
        forgotten, so a node without a stream does not report its predecessor's."""
        waited = getattr(self._stream_wait, "seconds", None)
        self._stream_wait.seconds = None
        return waited

    def submit(self, stream: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the stream's own thread; a Future of its result."""
        return self._stream_threads[stream].submit(fn, *args)

    def run_on_stream(self, stream: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the stream's thread, inside its CUDA stream where there is one; wait for it."""
        def bound():
            with self.on_stream(stream):
                return fn(*args)

        return self.submit(stream, bound).result()

    @contextmanager
    def on_stream(self, stream: str, keeps_graph: bool = False):
        """Run the body on the stream (its thread's CUDA stream); yields the SMs of the partition it
        got, or None for the whole GPU (or no GPU). A body that ``keeps_graph`` for a later backward
        stays off the partitions unless ``window.grad_on_partition``: autograd runs each backward kernel on
        its forward's stream, so a prefix forwarded on a 36-SM partition in the decode window would
        also be back-propagated on 36 SMs, long after decode has ended."""
        s = self.streams.get(stream)
        if s is None:
            yield None
            return
        other = "compute" if stream == "decode" else "decode"
        sms = None
        with self._lock:
            if self.partitions is not None and stream in ("decode", "compute"):
                if stream == "decode":
                    live = getattr(self.decode, "live_rows", None)
                    self.partitions.choose(live() if live else None)
                if self._busy.get(other) and (self.window.grad_on_partition or not keeps_graph):
                    s = self.partitions.stream(stream)
                    sms = self.partitions.sms_of(stream)
            self._busy[stream] = self._busy.get(stream, 0) + 1
        from rollplex.pipeline.run.partitions import compute_sms, sm_target

        total = self.partitions.total_sms if self.partitions is not None else self._total_sms()
        target = sms if stream == "compute" and self.window.sm_target else None
        if self.partitions is None and stream == "compute":
            target = compute_sms(self.window, bool(self._busy.get("decode")), total)
        try:
            # Decode replays graphs captured with their own target; compute's eager matmuls need one.
            with torch.cuda.stream(s), sm_target(target, total):
                yield sms
            waited = time.time()
            s.synchronize()  # consumers on the other stream may read these outputs next
            # A node's time splits into launching (host) and this wait for its queued kernels (device).
            self._stream_wait.seconds = time.time() - waited
        finally:
            with self._lock:
                self._busy[stream] -= 1

    def _total_sms(self) -> int:
        if not self.window.compute_spare or self.device.type != "cuda":
            return 0
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def close(self) -> None:
        if getattr(self, "env_pool", None) is not None:
            self.env_pool.close()
        for store in (self.prompts, self.eval_prompts):
            if store is not None:
                store.close()
        for engine in [*self.engines.values(), self.decode]:
            engine.close()
        for pool in self._stream_threads.values():
            pool.shutdown(wait=False)
        sys.setswitchinterval(self._switch_interval)


_HOST: WorkerHost | None = None
_ALLOC_RETRIES: dict[int, int] = {}  # per device: the allocator's count when a host last drained


def alloc_retries_since_drain(device: torch.device) -> int:
    """The device's allocator retries since any host on it last drained: hosts that take turns on one
    device (the bench's policies) each count their own iterations'. The count is cumulative (resetting
    the peak leaves it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    now = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    before, _ALLOC_RETRIES[index] = _ALLOC_RETRIES.get(index, now), now
    return now - before


def current_host() -> WorkerHost:
    if _HOST is None:
        raise RuntimeError("this worker has no Rollplex engines; was the RollplexPlugin registered?")
    return _HOST


def tensor_parallel_group(size: int):
    """This rank's tensor-parallel decode group (``ranks.tp_groups``). Every rank makes every group,
    in one order, since torch.distributed.new_group is collective over the whole world."""
    import torch.distributed as dist

    from rollplex.pipeline.compile.ranks import tp_groups

    if not dist.is_initialized() or dist.get_world_size() % size:
        raise RollplexError(f"cluster.tp_rollout={size}: needs a process group of a multiple of {size} ranks "
                            f"(cluster.workers)")
    mine = None
    for members in tp_groups(dist.get_world_size(), size):
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


def decode_tensor_parallel() -> tuple[int, int]:
    """This worker's decode engine's (share, shares) of a tensor-parallel group; (0, 1) alone."""
    return tuple(getattr(current_host().decode, "tensor_parallel", (0, 1)))


def install_host(spec: HostSpec, name: str) -> None:
    global _HOST
    if _HOST is not None:
        _HOST.close()
    _HOST = WorkerHost(spec, name)


def uninstall_host() -> None:
    global _HOST
    if _HOST is not None:
        _HOST.close()
    _HOST = None


class _Released:
    """What a released value's slot in its producer's bundle holds; one instance, also after pickling."""

    def __reduce__(self) -> str:
        return "RELEASED"

    def __repr__(self) -> str:
        return "RELEASED"


RELEASED = _Released()
