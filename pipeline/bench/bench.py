"""``rollplex bench``: full GRPO iterations of a VLM-shaped model under each policy, side by side.

One process, one set of engines: a Qwen2.5-VL model with random weights built from a preset config
(3B by default), its frozen reference copy, and the static-KV CUDA-graph decode engine running on the
actor's own weights (no second copy). Every policy starts each measured iteration from the same
weights and optimizer state and the same prompts, so their updates can be compared and their times
are the medians of the iterations after a warm-up one.

Policies:
- ``plain``: the same GRPO iteration written with plain transformers/torch calls after a rollout on
  the same decode engine (``pipeline/bench/plain.py``): the reference for "today's serial runtimes",
  against which every ratio is also printed.
- ``serial-noshare``: phase barriers, and every response is scored and trained over its full sequence
  (the prompt re-run G times).
- ``serial``: phase barriers, prefix sharing on (prefix once per prompt, G suffixes on its KV).
- ``rollplex``: no barriers. Vision and prefix work run on the compute stream inside the decode window;
  with ``sp=1``, while both streams are busy each runs on its own green context (SM partition), and
  alone each gets the whole GPU.
- ``rollplex-nofusion``: rollplex with every suffix scored after the last decode chunk (no stage
  fusion). Each gain is then a ratio of neighbours: prefix sharing (serial ÷ serial-noshare), the
  decode window (rollplex-nofusion ÷ serial) and stage fusion (rollplex ÷ rollplex-nofusion).
- ``disaggregated``, ``disaggregated-noshare`` and ``rollplex-dp2``, on two GPUs: see
  ``pipeline/bench/multi.py``.
- ``serial#aa`` (added by default): serial once more under its own name. Its ratio to serial, with
  its 95% interval, is the noise floor; a run whose A/A interval misses 1 does not count.

The one-GPU policies take turns iteration by iteration, serial first in every round (its first update
is the reference) and the others in an order that rotates each round; ratios are medians of the
per-iteration pairs with a distribution-free 95% interval (``results.median_interval``), which needs
at least 6 timed iterations (the default, after one warm-up).

A rollplex policy may carry options (``rollplex:gate=32:target=0``), so variants run side by side
against the same serial run. What is measured and reported lives in ``pipeline/bench/results.py``.
"""
from __future__ import annotations

import copy
import itertools
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollplex.errors import RollplexError
from rollplex.pipeline.bench.multi import TWO_GPU_POLICIES
from rollplex.pipeline.run.recovery import out_of_memory
from rollplex.pipeline.bench.results import (  # noqa: F401 - POLICIES, ALL_POLICIES: the CLI's names
    ALL_POLICIES,
    POLICIES,
    PolicyResult,
    allocator_backend,
    compare_update,
    file_stem,
    measure_rates,
    note_iteration,
    parse_policy,
    policy_shape,
    profile_iteration,
    record_iteration,
    report,
    same_graph_as,
    update_difference,
)

@dataclass
class BenchConfig:
    model: str = "qwen2.5-vl-3b"
    prompts: int = 8
    samples: int = 8
    vision_tokens: int = 1024  # merged vision tokens per prompt (one image)
    text_tokens: int = 64
    max_new_tokens: int = 256
    mean_new_tokens: int = 96  # response lengths: a long-tailed (log-normal) spread capped at max
    # Each prompt's sample caps, the same every iteration (``--lengths``: a run's rollout.length_caps,
    # so the bench meets `rollplex train`'s exact work); None: drawn afresh each iteration.
    lengths: tuple[tuple[int, ...], ...] | None = None
    chunk_tokens: int = 32
    iterations: int = 7  # the first is a warm-up (graph capture, allocator) and is not timed: 6 timed pairs
    policies: tuple[str, ...] = POLICIES
    # The first one-GPU policy (serial where run) once more under its own name, ``serial#aa``: its ratio
    # to itself is the noise a ratio must clear (results.speedups).
    aa: bool = True
    train_engine: str = "torch"
    gradient_checkpointing: bool = False  # every policy's training forwards recompute layer activations
    decode_sms: int = 0  # SMs for decode while both streams are busy; 0: re-chosen per chunk from the live batch
    gate_rows: int = 0  # rollplex: prefix work waits until decode has at most this many live rows
    seed: int = 0
    out: str = "bench"
    device: str = "cuda"
    dtype: str = "bfloat16"
    layers: int | None = None  # override the preset's depth (smoke tests on small machines)
    prompts_per_node: int = 1  # prompts per vit/prefix/suffix node: batched forwards (ViT batching)
    stage_fusion: bool = True  # rollplex: the reference scores the samples each decode chunk finished
    train_fusion: bool = False  # rollplex: and the policy trains on them (compiler.train_fusable)
    second_device: str = ""  # the two-GPU policies' other device; default cuda:1 (cpu: cpu, for tests)
    # The decode engine's layer through torch.compile; None: on for CUDA (a 3B step at 64 rows 8.2 ->
    # 5.4 ms, benchmarks/decode_profile.py), off for the CPU (compile time outweighs a smoke run).
    compile_decode: bool | None = None
    # The decode step's attention (engines/decode_attention.py): fused (split-KV with the rotary and the
    # cache write in the kernel) where CUDA and Triton are, else SDPA over every slot (auto); or by name.
    decode_attention: str = "auto"
    # The decode step's projections (engines/projections.py): cublas, skinny or skinny-norm.
    decode_linear: str = "cublas"
    # Each prompt's KV once for its samples in the decode cache (engines/graph_decode.py), or copied
    # into each of its rows (False).
    shared_prefix_decode: bool = True
    profile: tuple[str, ...] = ()  # policies to run once more under torch.profiler (untimed): profile_<policy>.txt
    # One-GPU policies take turns iteration by iteration (every iteration starts from the same
    # weights, so the order changes nothing they compute): a drift in the machine's speed, or the
    # process's first-iteration costs, reach every policy alike. False: each policy's iterations in
    # a row. The two-GPU policies always run in a row after them (their copies on the second GPU).
    interleave: bool = True

    def __post_init__(self) -> None:
        if self.compile_decode is None:  # not under the stream-ordered pool: engines/graph_decode.py says why
            # (read from the variable torch reads: a CPU build of torch cannot be asked for its backend)
            self.compile_decode = self.device == "cuda" and "cudaMallocAsync" not in os.environ.get(
                "PYTORCH_CUDA_ALLOC_CONF", "")
        if not self.second_device:
            self.second_device = "cuda:1" if self.device == "cuda" else self.device


class _Tokenizer:
    """The bench's prompts are token ids; text only feeds the reward, so ids print as text."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def bench_reward(text: str, answer: str) -> float:
    """A reward with real variance: whether the response's first token id is even. Random weights
    make it a coin flip per sample, so GRPO's advantages and the loss are not trivially zero."""
    first = text.split(" ", 1)[0]
    return float(first.isdigit() and int(first) % 2 == 0)


def hf_config(cfg: BenchConfig):
    from transformers import Qwen2_5_VLConfig

    from rollplex.engines.modelspec import load_model

    spec = load_model(cfg.model)
    half = spec.head_dim // 2
    mrope = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                         num_hidden_layers=cfg.layers or spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope},
                         tie_word_embeddings=spec.tied),
        vision_config=dict(depth=spec.vit_depth, hidden_size=spec.vit_hidden, intermediate_size=spec.vit_intermediate,
                           num_heads=spec.vit_heads, out_hidden_size=spec.hidden, fullatt_block_indexes=[7, 15, 23, 31],
                           window_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=spec.vocab - 5, video_token_id=spec.vocab - 4, vision_start_token_id=spec.vocab - 3,
        vision_end_token_id=spec.vocab - 2, tie_word_embeddings=spec.tied,
    ), spec


def check_bench_memory(cfg: BenchConfig) -> None:
    """Refuse a bench whose weights, reference copy, gradients, optimizer state and KV pool alone
    exceed the device's free memory (the 3B preset on a 24 GB CPU host was killed after five minutes)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from rollplex.pipeline.run.preflight import available_memory, check_fits, memory_terms

    config, spec = hf_config(cfg)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)
    width = 2 if cfg.dtype == "bfloat16" else 4
    per_token = spec.kv_bytes_per_token(width) * (cfg.layers or spec.layers) // spec.layers
    kv = per_token * (cfg.vision_tokens + 64 + cfg.max_new_tokens) * cfg.prompts * cfg.samples
    terms = memory_terms(total, trainable, width, cfg.train_engine, 1, kv, decode_weight_bytes=0)
    check_fits(terms, available_memory(cfg.device), f"rollplex bench --model {cfg.model} on {cfg.device}",
               "use --layers N for a smoke run or a smaller --model" + (", or --dtype bfloat16" if width == 4 else ""))


def build_model(cfg: BenchConfig):
    from transformers import Qwen2_5_VLForConditionalGeneration

    config, spec = hf_config(cfg)
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    with torch.device(cfg.device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.eval()
    from rollplex.engines.vision_attention import batch_vision_attention

    batch_vision_attention(model)  # one attention call per run of equal windows, not one per window
    for name, p in model.named_parameters():
        p.requires_grad_("visual" not in name)
    return model, spec


def make_prompts(cfg: BenchConfig, config, iteration: int) -> list:
    """P prompts: vision start, one image of ``vision_tokens`` merged tokens, text, generation
    header; random pixels; per-sample response lengths drawn from a long-tailed distribution."""
    from rollplex.engines.vlm import PromptInputs
    from rollplex.tasks.nodes import lognormal_lengths

    gen = torch.Generator().manual_seed(cfg.seed * 1000 + iteration)
    side = int(math.sqrt(cfg.vision_tokens)) * 2  # merged tokens = (side/2)²
    prompts = []
    for p in range(cfg.prompts):
        text = torch.randint(100, config.get_text_config().vocab_size - 100, (cfg.text_tokens,), generator=gen)
        ids = torch.cat([torch.tensor([config.vision_start_token_id]),
                         torch.full((side * side // 4,), config.image_token_id),
                         torch.tensor([config.vision_end_token_id]), text])
        pixels = torch.randn(side * side, 3 * 2 * 14 * 14, generator=gen).to(getattr(torch, cfg.dtype))
        # Log-normal, from this iteration's generator: the workload of iteration i is the same under
        # every policy whatever ran before it (torch.distributions would draw from the global RNG).
        lengths = lognormal_lengths(gen, cfg.samples, cfg.mean_new_tokens, 0.8, cfg.max_new_tokens, least=4)
        if cfg.lengths is not None:  # drawn anyway: the prompts' ids and pixels stay what they were
            lengths = list(cfg.lengths[p])
        prompts.append(PromptInputs(f"bench-{iteration}-{p}", ids, pixels, torch.tensor([[1, side, side]]),
                                    meta={"max_tokens": lengths}))
    return prompts


# ------------------------------------------------------------------------------------------------
def window_sharing(cfg: BenchConfig, policy: str):
    """How a policy shares the decode window (``run.partitions.WindowSharing``): its options over the
    runtime's defaults; SM partitions only for a rollplex policy that asks for them (``sp=1``)."""
    from rollplex.pipeline.run.partitions import WindowSharing

    base, options = parse_policy(policy)
    if not base.startswith("rollplex"):
        return WindowSharing()
    return WindowSharing(partitions=bool(options.get("sp", 0)), decode_sms=options.get("sms", cfg.decode_sms),
                         sm_target=bool(options.get("target", 1)), grad_on_partition=bool(options.get("gp", 0)),
                         prefill_gate=bool(options.get("pf", 1)), gate_rows=options.get("gate", cfg.gate_rows),
                         compute_spare=options.get("spare", 0), compute_sms=options.get("cs", 0))


def _host(cfg: BenchConfig, actor_engine, ref_engine, decode, policy: str, streams: dict, device: str = "",
          partitions=None):
    from rollplex.pipeline.run.worker import HostSpec, IterationSettings, WorkerHost

    settings = IterationSettings(seed=cfg.seed, samples=cfg.samples, max_new_tokens=cfg.max_new_tokens,
                                 temperature=1.0, top_p=1.0, pad_id=0, stop_token_ids=(), params={})
    spec = HostSpec(model_path="", reference_path="", device=device or cfg.device, dtype=cfg.dtype, threads=8,
                    decode_engine="torch-graph", train_engine=cfg.train_engine, score_engine="transformers",
                    decode_options={}, train_options={}, algorithm="grpo", reward="bench_parity",
                    settings=settings, window=window_sharing(cfg, policy))
    return WorkerHost(spec, name=f"{device or cfg.device}/{policy}", engines={"actor": actor_engine, "ref": ref_engine},
                      decode=decode, streams=streams, tokenizer=_Tokenizer(), partitions=partitions)


def bench_spec(cfg: BenchConfig, policy: str):
    """The ``IterationSpec`` of a bench policy: its shape options over the bench's defaults
    (``policy_shape``), prefix sharing unless ``-noshare``, the rollplex schedule for the rollplex
    policies and serial's for the rest. ``disaggregated[-noshare]`` is serial's iteration (the
    rollout GPU is a placement, not a graph change); ``rollplex-dp2`` rollplex's over two ranks,
    each scoring (and with train fusion training) what its own decode chain finished."""
    from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice
    from rollplex.pipeline.compile.ranks import fit_prompts_per_node
    from rollplex.pipeline.compile.spec import IterationSpec

    fields = policy_shape(policy, prompts_per_node=cfg.prompts_per_node, stage_fusion=cfg.stage_fusion,
                          train_fusion=cfg.train_fusion)
    base, _ = parse_policy(policy)
    ranks = 2 if base == "rollplex-dp2" else 1
    for name in ("prompts_per_node", "micro_batch_groups"):  # no node or micro-batch spans two ranks
        fields[name] = fit_prompts_per_node(fields[name], cfg.prompts // ranks)
    shape = BatchShape(prompts=cfg.prompts, samples=cfg.samples, max_new_tokens=cfg.max_new_tokens,
                       chunk_tokens=cfg.chunk_tokens, prompt_tokens=cfg.vision_tokens + cfg.text_tokens + 2,
                       vision_tokens=cfg.vision_tokens, prefix_sharing=not base.endswith("-noshare"), **fields)
    engines = EngineChoice({"decode": "torch-graph", "train": cfg.train_engine, "score": "transformers"})
    return IterationSpec(shape, engines, "rollplex" if base.startswith("rollplex") else "serial", world=ranks)


def compile_for(cfg: BenchConfig, policy: str, config):
    """The scheduled iteration of a bench policy, built as a run builds it (``plan.build``); None for
    ``plain``, which is no graph (pipeline/bench/plain.py)."""
    from rollplex.dags.grpo import grpo

    if parse_policy(policy)[0] == "plain":
        return None
    from rollplex.pipeline.compile.compiler import ModelDims
    from rollplex.pipeline.plan.build import build_iteration

    built = build_iteration(grpo, bench_spec(cfg, policy), ModelDims.from_hf_config(config, 2))
    if "train_fusion_off" in built.compiled.meta:  # a policy named tf=1 that trains after decode would mislabel its row
        raise RollplexError(f"--policies: {policy!r}: train fusion is off: {built.compiled.meta['train_fusion_off']}")
    return built.graph


def run(cfg: BenchConfig, log=print) -> dict[str, Any]:
    from rollplex.engines.attention_kernels import eager_attention_without_cudnn
    from rollplex.engines.base import EngineContext, get_engine
    from rollplex.engines.replay_decode import Recorder, ReplayDecodeEngine
    from rollplex.engines.sharing import fuse_for_rollout
    from rollplex.pipeline.bench import multi as bench_multi
    from rollplex.pipeline.run.local import LocalExecutor
    from rollplex.tasks.rewards import get_reward, register_reward

    import rollplex.engines  # noqa: F401 - registers the engines

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RollplexError("rollplex bench: no CUDA device (use --device cpu with a small --model for a smoke run)")
    bases = {parse_policy(p)[0] for p in cfg.policies}  # names the first bad one
    if (bases & set(TWO_GPU_POLICIES) and cfg.device == "cuda"
            and torch.cuda.device_count() < 2 and cfg.second_device.startswith("cuda:")):
        raise RollplexError(f"--policies: {', '.join(TWO_GPU_POLICIES)} need two GPUs; this machine has "
                            f"{torch.cuda.device_count()}")
    try:
        get_reward("bench_parity")
    except RollplexError:
        register_reward("bench_parity", bench_reward)
    check_bench_memory(cfg)  # before anything is written
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "iterations.jsonl").unlink(missing_ok=True)  # this run's iterations only
    t0 = time.time()
    model, spec = build_model(cfg)
    config = model.config
    eager_attention_without_cudnn(cfg.device)  # as the runtime's hosts do; a policy's cudnn=1 turns it on
    ref = copy.deepcopy(model).requires_grad_(False)
    dtype = getattr(torch, cfg.dtype)
    device = torch.device(cfg.device)
    train_ctx = EngineContext("", device, dtype, cfg.seed, {"module": model, "lr": 1e-6, "grad_clip": 1.0,
                                                           "zero_stage": 2, "accumulation_steps": cfg.prompts,
                                                           "gradient_checkpointing": cfg.gradient_checkpointing})
    actor = get_engine(cfg.train_engine, "train").factory(train_ctx)
    ref_engine = get_engine("transformers", "score").factory(EngineContext("", device, dtype, cfg.seed, {"module": ref}))
    longest = cfg.vision_tokens + cfg.text_tokens + 2 + cfg.max_new_tokens + 8
    fuse_for_rollout(actor.module, cfg.train_engine)  # as the runtime's hosts do (pipeline/run/worker.py)
    decode = bench_multi.decode_engine(cfg, device, dtype, actor.module, cfg.prompts * cfg.samples, longest)
    start_state = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}
    weight_bytes = sum(p.numel() * p.element_size() for n, p in actor.module.named_parameters() if "visual" not in n)
    start_optim = copy.deepcopy(actor.optimizer.state_dict())
    log(f"bench: {cfg.model} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {cfg.dtype}) on "
        f"{torch.cuda.get_device_name() if cfg.device == 'cuda' else 'cpu'}; built in {time.time() - t0:.1f}s"
        + (f"; CUDA allocator {allocator_backend()} (PYTORCH_CUDA_ALLOC_CONF)" if cfg.device == "cuda" else ""))
    rates = measure_rates(device, dtype)  # the true lower bound's rates, this device's own
    log(f"bench: the bound's rates, measured: copy {rates.copy_bytes_per_s / 1e12:.2f} TB/s, matmul "
        f"{rates.matmul_flops_per_s / 1e12:.0f} TFLOP/s ({cfg.dtype})")
    partitions: dict[tuple[str, int, int], Any] = {}  # (device, decode SMs or 0, compute SMs or 0) -> Partitions
    results: dict[str, PolicyResult] = {}
    recorder = Recorder(decode)  # serial's rollouts, replayed below so updates compare on one rollout

    @contextmanager
    def process_settings(policy: str):
        """The policy's process-wide options (``gil``, ``cudnn``) for one timed iteration, then the
        process's own again. Decode graphs are captured outside it, with cuDNN's attention on either way
        (engines/attention_kernels.py)."""
        options = parse_policy(policy)[1]
        switch, cudnn = sys.getswitchinterval(), torch.backends.cuda.cudnn_sdp_enabled()
        sys.setswitchinterval(options.get("gil", round(switch * 1e6)) / 1e6)
        torch.backends.cuda.enable_cudnn_sdp(bool(options.get("cudnn", cudnn)))
        try:
            yield
        finally:
            sys.setswitchinterval(switch)
            torch.backends.cuda.enable_cudnn_sdp(cudnn)

    def use_steps_per_graph(policy: str, decodes: list) -> None:
        """The policy's decode steps per graph launch (``spg``), an engine-wide setting: set before a
        host captures its graphs, and again before each of the policy's iterations, since policies
        take turns on one engine."""
        for engine in decodes:
            engine = getattr(engine, "inner", engine)  # through serial's Recorder
            if hasattr(engine, "steps_per_graph"):
                engine.steps_per_graph = parse_policy(policy)[1].get("spg", 1)

    def executor_for(policy: str, ranks: list[dict]) -> LocalExecutor:
        """One host per rank: ``ranks[r]`` holds its actor, ref and decode engines; a decode engine on
        another device than the trainer's (disaggregated) gets its stream there."""
        hosts = []
        base, options = parse_policy(policy)
        if base == "plain":
            from rollplex.pipeline.bench.plain import PlainExecutor

            return PlainExecutor(cfg, ranks[0]["actor"], ranks[0]["ref"], ranks[0]["decode"], bench_reward,
                                 options.get("seq", 0))
        use_steps_per_graph(policy, [engines["decode"] for engines in ranks])
        for rank, engines in enumerate(ranks):
            home = cfg.device if rank == 0 else cfg.second_device
            streams = {}
            if cfg.device == "cuda":
                # prio=1: the block scheduler issues decode's blocks ahead of compute's as SMs free up
                priority = -1 if options.get("prio", 0) else 0
                streams = {"decode": torch.cuda.Stream(getattr(engines["decode"], "device", home), priority=priority),
                           "compute": torch.cuda.Stream(home)}
            window, split = window_sharing(cfg, policy), None
            if window.partitions and cfg.device == "cuda":
                # made once per (device, split) and shared by the policies that ask for it: attaching
                # them captures the decode engine's graphs on every split's stream
                key = (home, window.decode_sms, window.compute_sms)
                if key not in partitions:
                    partitions[key] = sm_partitions(key[1], torch.device(home).index or 0, key[2])
                split = partitions[key]
            hosts.append(_host(cfg, engines["actor"], engines["ref"], engines["decode"], policy, streams, home, split))
        return LocalExecutor(hosts)

    def recover_from_failed_policy() -> None:
        """After a policy ran out of memory, the next starts as every policy does: no gradients
        left over, no rows left in the decode engine, the freed memory returned to the allocator."""
        import gc

        actor.module.zero_grad(set_to_none=True)
        while decode.has_unfinished():
            decode.step(cfg.max_new_tokens)
        gc.collect()
        if cfg.device == "cuda":
            torch.cuda.empty_cache()

    def restart(extra: bench_multi.Replicas | None) -> None:  # every policy, every iteration: the same start
        actor.module.load_state_dict(start_state)
        actor.optimizer.load_state_dict(start_optim)
        if extra is not None:
            extra.reset()

    def trained_weights() -> dict[str, torch.Tensor]:  # the vision tower is frozen
        return {k: v.detach() for k, v in actor.module.state_dict().items() if "visual" not in k}

    def host_copy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # in their dtype: 2 bytes/param
        return {k: v.to("cpu", copy=True) for k, v in weights.items()}

    def replicas_for(policy: str) -> bench_multi.Replicas | None:
        policy, _ = parse_policy(policy)
        if policy in bench_multi.SPLIT_ROLES:
            return bench_multi.disaggregated(cfg, actor, ref_engine, start_state, dtype, longest)
        if policy == "rollplex-dp2":
            return bench_multi.data_parallel(cfg, actor, ref_engine, decode, start_state, start_optim, dtype, longest)
        return None

    def synchronize() -> None:
        if cfg.device == "cuda":
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)
                torch.cuda.reset_peak_memory_stats(d)

    def inputs_for(graph, iteration: int) -> dict[str, Any]:
        prompts = make_prompts(cfg, config, iteration)
        return graph.feed(prompts) if graph is not None else {f"prompt_p{p}": x for p, x in enumerate(prompts)}

    def run_policy(policy: str, graph, extra: bench_multi.Replicas | None):
        """A generator: each ``next`` runs one iteration (the first a warm-up), the one after the last
        runs iteration 0 again on serial's recorded rollout and returns the ``PolicyResult``. Its own
        scope, so that its hosts and executors are gone when the caller releases the second GPU's copies."""
        ranks = extra.hosts_engines if extra else [{"actor": actor, "ref": ref_engine, "decode": decode}]
        if policy == reference:
            ranks = [dict(ranks[0], decode=recorder)]
        executor = executor_for(policy, ranks)
        decodes = [r["decode"] for r in ranks]
        res = running[policy] = PolicyResult(policy, same_graph_as=repeats.get(policy))
        for iteration in range(cfg.iterations):
            yield
            use_steps_per_graph(policy, decodes)
            restart(extra)
            synchronize()
            steps_before = sum(d.steps_run for d in decodes)
            with process_settings(policy):
                result = executor.run(graph, iteration, inputs_for(graph, iteration))
            note_iteration(out_dir, policy, iteration, result, log)
            if iteration == 0:  # the update from the common start, compared across policies
                if policy == reference:
                    res.weights = host_copy(trained_weights())
                elif reference in running:
                    res.sampled_difference = update_difference(trained_weights(), running[reference].weights,
                                                               start_state)
                res.responses = [r["response_token_ids"] for r in result.output["report"]["rows"]]
                res.ranks_disagree = bench_multi.ranks_disagree(extra) if extra else 0.0
                continue
            record_iteration(cfg, spec, weight_bytes, res, result, sum(d.steps_run for d in decodes) - steps_before,
                             policy, rates)
        if policy == reference:
            log(f"  {reference}'s rollouts recorded for replay: {len(recorder.recorded)} sequences")
        if policy in cfg.profile:
            restart(extra)
            profile_iteration(executor, graph, inputs_for(graph, 1), out_dir / f"profile_{file_stem(policy)}.txt")
        if recorder.recorded:  # iteration 0 again on serial's recorded rollout (serial's own: the replay itself)
            replay = [dict(r, decode=ReplayDecodeEngine(recorder.recorded)) for r in ranks]
            restart(extra)
            executor_for(policy, replay).run(graph, 0, inputs_for(graph, 0))
            weights = trained_weights()
            if policy == reference:  # the replay against its own sampled run: the replay itself
                res.replayed_weights = host_copy(weights)
                res.replayed_difference = update_difference(weights, res.weights, start_state)
            elif reference in running and running[reference].replayed_weights is not None:
                res.replayed_difference = update_difference(weights, running[reference].replayed_weights, start_state)
        return res

    # Serial first: its recorded rollout is what the others replay right after their timed runs, and
    # its update is what theirs are compared with, once, as each policy ends.
    policies = list(cfg.policies)
    one_gpu_named = [p for p in policies if parse_policy(p)[0] not in TWO_GPU_POLICIES]
    # The reference: serial, under whatever options it runs (the first such row).
    reference = next((p for p in policies if parse_policy(p)[0] == "serial"), None)
    if cfg.aa and one_gpu_named:
        policies.append((reference or one_gpu_named[0]) + "#aa")
    graphs = {policy: compile_for(cfg, policy, config) for policy in sorted(policies, key=lambda p: p != reference)}
    repeats = same_graph_as(graphs)  # the order they meet each iteration's inputs in
    failed: dict[str, str] = {}  # policy -> why it stopped (out of memory), reported with the rest
    running: dict[str, PolicyResult] = {}  # every started policy's result so far (serial's update is the reference)

    def advance(policy: str, runner) -> bool:
        """One ``next`` of the policy's run; True once it is over (finished, or out of memory)."""
        try:
            next(runner)
            return False
        except StopIteration as done:
            res = done.value
            res.comparison = compare_update(res, res if policy == reference else results.get(reference))
            results[policy] = res
            log(f"  {policy:15s} {res.median:7.3f} s/it   "
                + "  ".join(f"{k} {v:.2f}" for k, v in sorted(res.by_kind.items())))
        except Exception as exc:  # noqa: BLE001 - out of memory only; anything else propagates
            if not out_of_memory(exc):
                raise
            failed[policy] = str(exc)
            running.pop(policy, None)
            log(f"  {policy}: out of memory, skipped: {exc}")
            runner.close()
        if policy in failed:
            # Outside the except clause: until it ends, the traceback's frames hold the failed
            # iteration's tensors, and the allocator could not return them.
            recover_from_failed_policy()
        report(cfg, spec, results, out_dir, lambda *a: None, failed, rates)  # partial results survive a later failure
        return True

    one_gpu = [p for p in graphs if parse_policy(p)[0] not in TWO_GPU_POLICIES]
    if cfg.interleave and len(one_gpu) > 1:
        turns = {policy: run_policy(policy, graphs[policy], None) for policy in one_gpu}
        # Serial first in every round: its first update is the reference and its recorded rollout the
        # one the others replay as they end. The others' order rotates by one each round, so none always
        # follows the same policy; serial#aa, rotating with them, measures what that order is worth.
        for round_ in itertools.count():
            if not turns:
                break
            first = [p for p in turns if p == reference]
            rest = [p for p in turns if p != reference]
            shift = round_ % len(rest) if rest else 0
            for policy in first + rest[shift:] + rest[:shift]:
                if round_ == 0 and cfg.device == "cuda":
                    # A policy's first (untimed) iteration creates its stream threads' cuBLAS handles
                    # with cudaMalloc, outside the caching allocator: the blocks the policy before it
                    # left cached must go back first (at 3B with 1,024-token responses rollplex's
                    # first decode chunk failed in cublasCreate after serial's iteration).
                    torch.cuda.empty_cache()
                if advance(policy, turns[policy]):
                    del turns[policy]
    else:
        one_gpu = []
    for policy, graph in graphs.items():
        if policy in one_gpu:
            continue
        extra = replicas_for(policy)
        try:
            runner = run_policy(policy, graph, extra)
            while not advance(policy, runner):
                pass
        finally:
            del runner  # its hosts and executors go before the second GPU's copies
            if extra is not None:
                extra.release()
    return report(cfg, spec, results, out_dir, log, failed, rates)


def sm_partitions(decode_sms: int, device_index: int = 0, compute_sms: int = 0):
    """Green-context streams for decode and compute while both run (pipeline/run/partitions.py): the one
    split ``decode_sms`` names, or with 0 one per row of the live-batch table, re-chosen per chunk;
    ``compute_sms`` fences compute alone (decode on the whole GPU unless ``decode_sms`` says)."""
    from rollplex.pipeline.run.partitions import make

    return make(device_index, decode_sms, compute_sms)


