"""The training loop: compile once, then run iterations on Dask and write the run directory.

Run directory layout:
    config.yaml                 the resolved config
    metrics.jsonl               one JSON object per iteration (warm-up rows carry "phase": "warmup")
    rollouts/iter_NNNNNN.jsonl  one object per response
    traces/iter_NNNNNN.json     Chrome trace events, one track per worker and stream (Perfetto)
    checkpoints/iter_NNNNNN/    the actor in HF format + optimizer, RNG and data-loader state
Every file is written atomically (temp file + rename); ``--resume`` continues from the last
complete checkpoint and truncates later metric rows, so the sequence has no gaps or duplicates.
A lost Dask worker rolls the run back to its last checkpoint and replays from there, and
SIGINT/SIGTERM stop it after the iteration in flight with a checkpoint (``pipeline/recovery.py``).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollplex.config import RunConfig, dump_config
from rollplex.errors import (ConfigError, EngineError, GraphError, Interrupted, NodeFailure, NonFiniteError,
                             RollplexError, WorkerLost)
from rollplex.pipeline import checkpoints
from rollplex.pipeline.faults import point
from rollplex.pipeline.preflight import check_servable
from rollplex.pipeline.fsio import append_line, atomic_write_text
from rollplex.pipeline.trace import chrome_trace, seconds_by_kind


MOVING_WINDOW = 10  # iterations averaged for stop_at_reward and the summary's final reward


@dataclass
class RunSummary:
    run_dir: Path
    iterations: int
    final_reward: float
    seconds_per_iteration: float


# ------------------------------------------------------------------------------------------------
def resolve_engines(cfg: RunConfig, device: str) -> tuple[str, str, str]:
    from rollplex.engines.base import get_engine

    # decode_chunk is the decode role's only node kind, so its override picks the engine the workers build.
    decode, train = cfg.engines.overrides.get("decode_chunk", cfg.engines.decode), cfg.engines.train
    if decode == "auto":
        # In-process vLLM sets up torch.distributed state of its own: not shared with data-parallel ranks yet.
        decode = "vllm" if get_engine("vllm").installed() and device == "cpu" and cfg.cluster.workers == 1 else "hf"
    if train == "auto":
        train = "deepspeed" if get_engine("deepspeed").installed() else "torch"
    for name, role in ((decode, "decode"), (train, "train"), (cfg.engines.score, "score")):
        try:
            spec = get_engine(name, role)
        except EngineError as exc:
            raise EngineError(f"engines.{role}: {exc}") from None
        if not spec.installed():
            raise EngineError(f"engines.{role}: engine {name!r} is not installed "
                              f"(missing {', '.join(spec.missing())})")
    for kind, name in cfg.engines.overrides.items():
        from rollplex.pipeline.ir import get_kind

        try:
            role = get_kind(kind).role
            get_engine(name, role)
        except RollplexError as exc:
            raise EngineError(f"engines.overrides.{kind}: {exc}") from None
    return decode, train, cfg.engines.score


def resolve_device(cfg: RunConfig) -> str:
    import torch

    if cfg.model.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.model.device == "cuda" and not torch.cuda.is_available():
        raise RollplexError("model.device: cuda requested but no CUDA device is visible")
    return cfg.model.device


def resolve_model_path(cfg: RunConfig) -> str:
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise RollplexError(f"model.path: {path} has no config.json (expected an HF model directory)")
        return str(path)
    from rollplex.engines.models import ensure_tiny_vlm
    from rollplex.tasks.data import default_model_spec

    return str(ensure_tiny_vlm(default_model_spec()))


# FLOPs a vit/prefix/suffix node should carry so that its dispatch (Dask task, Python, kernel launches:
# milliseconds) stays a small share of it: ~0.1-0.5 s of CPU work, a few ms of GPU work.
MIN_NODE_FLOPS = {"cpu": 2e9, "cuda": 2e12}


def auto_prompts_per_node(dims, prompt_tokens: int, prompts: int, device: str) -> int:
    """One prompt per node wherever a prompt's prefix is real work (any real VLM on a GPU); on a tiny
    model, batch prompts until a node is worth its dispatch."""
    per_prompt = 2 * dims.params * max(prompt_tokens, 1)
    return max(1, min(prompts, math.ceil(MIN_NODE_FLOPS.get(device, 2e12) / per_prompt)))


class Session:
    """Everything a run needs on the driver: data, compiled graph, and the cluster connection."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        from transformers import AutoConfig, AutoProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        from rollplex.engines import base  # noqa: F401 - registers engines
        from rollplex.pipeline.algorithms import load_algorithm
        from rollplex.pipeline.compiler import BatchShape, EngineChoice, ModelDims, compile_iteration
        from rollplex.pipeline.schedule import schedule
        from rollplex.tasks.data import PromptBuilder, PromptLoader
        from rollplex.tasks.dataset import make_task, probe_shape

        import rollplex.engines  # noqa: F401

        self.cfg = cfg
        self.run_dir = run_dir
        self.device = resolve_device(cfg)
        self.model_path = resolve_model_path(cfg)
        self.decode_engine, self.train_engine, self.score_engine = resolve_engines(cfg, self.device)
        check_servable(self.model_path, self.decode_engine, self.device)
        self.algorithm = load_algorithm(cfg.algorithm)
        unknown = sorted(set(cfg.params) - set(self.algorithm.hyperparameters()))
        if unknown:
            known = ", ".join(sorted(self.algorithm.hyperparameters())) or "none"
            raise RollplexError(f"params: {unknown} are not hyperparameters of {self.algorithm.name} (known: {known})")
        self.processor = AutoProcessor.from_pretrained(self.model_path)
        self.task = make_task(cfg)  # the synthetic task, or data.path's rows (bad ones refused or left out)
        self.builder = PromptBuilder(self.processor)
        self.loader = PromptLoader(self.task, self.builder, cfg.rollout.prompts_per_iteration, cfg.seed)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        dims = ModelDims.from_hf_config(hf_config, 4 if cfg.model.dtype == "float32" else 2)
        # Video frames add vision tokens (temporal patches), so both pad kinds count.
        prompt_tokens, vision_tokens = probe_shape(self.task, self.builder,
                                                   (hf_config.image_token_id, hf_config.video_token_id))
        if getattr(self.task, "has_video", False) and "vllm" in (
                self.decode_engine, cfg.engines.overrides.get("decode_chunk")):
            raise EngineError(f"data.path: {cfg.data.path} has video prompts, which the vllm decode engine does "
                              "not take yet; set engines.decode: hf")
        shape = BatchShape(
            prompts=cfg.rollout.prompts_per_iteration,
            samples=cfg.rollout.samples_per_prompt,
            max_new_tokens=cfg.rollout.max_new_tokens,
            chunk_tokens=cfg.rollout.chunk_tokens,
            micro_batch_groups=min(cfg.train.micro_batch_groups, cfg.rollout.prompts_per_iteration),
            prompts_per_node=cfg.train.prompts_per_node or auto_prompts_per_node(
                dims, prompt_tokens, cfg.rollout.prompts_per_iteration, self.device),
            prompt_tokens=prompt_tokens,
            vision_tokens=vision_tokens,
            prefix_sharing=cfg.train.prefix_sharing,
            # The serial schedule scores after the rollout by definition; data-parallel ranks split
            # decode per rank (pipeline/ranks.py), which hands groups on only after the last chunk.
            stage_fusion=cfg.train.stage_fusion and cfg.schedule == "rollplex" and cfg.cluster.workers == 1,
        )
        # cluster.workers > 1: data-parallel ranks, one per worker, each with a share of the batch.
        self.world = cfg.cluster.workers
        if self.world > 1:
            import dataclasses

            from rollplex.pipeline.ranks import check_data_parallel, fit_prompts_per_node

            check_data_parallel(self.world, shape.prompts, shape.micro_batch_groups, self.train_engine,
                                cfg.train.zero_stage, self.decode_engine,
                                processes=cfg.cluster.processes or bool(cfg.cluster.scheduler))
            shape = dataclasses.replace(shape, prompts_per_node=fit_prompts_per_node(
                shape.prompts_per_node, shape.prompts // self.world))
        choice = EngineChoice({"decode": self.decode_engine, "train": self.train_engine, "score": self.score_engine},
                              dict(cfg.engines.overrides))
        self.shape = shape
        self.dims = dims
        # After a warm-up the reference is the warmed-up policy, saved once in the run directory.
        warmed = run_dir / "reference"
        self.reference_path = str(warmed) if (warmed / "config.json").exists() else self.model_path
        try:
            from rollplex.pipeline.ranks import distribute

            self.compiled = distribute(compile_iteration(self.algorithm, shape, choice, dims), self.world)
            self.memory_plan = self.plan_memory(self.compiled) if cfg.cluster.memory_plan else None
            self.graph = schedule(self.memory_plan.graph if self.memory_plan else self.compiled, cfg.schedule)
        except GraphError as exc:  # a user DAG file's cycle or dangling value: name the file too
            if not cfg.algorithm.endswith(".py") or cfg.algorithm in str(exc):
                raise
            raise GraphError(f"{cfg.algorithm}: {exc}") from None
        self.tokenizer = self.processor.tokenizer
        from rollplex.pipeline.weightshare import annotate_run  # weight_sync nodes: what is aliased, rebuilt

        self.weight_plan = annotate_run(self.graph, self.model_path, self.decode_engine, self.train_engine,
                                        cfg.model.dtype, cfg.train.zero_stage, cfg.engines.weight_sharing)

    def checkpoint(self, executor, iteration: int, reward: float | None, pids: set[int]) -> Path:
        """The actor and optimizer (from the worker) plus the processor files, so that the
        checkpoint directory loads as is in transformers and vLLM. ``pids``: the workers whose
        engines hold the run's state; a replacement worker refuses to save its fresh weights."""
        def write(directory: str) -> None:
            executor.call(_save, directory, pids)
            self.processor.save_pretrained(directory)

        return checkpoints.save(self.run_dir, iteration, write, loader=self.loader.state_dict(),
                                keep_last=self.cfg.checkpoint.keep_last, reward=reward)

    def plan_memory(self, graph):
        """Offload/prefetch nodes so one device fits ``cluster.memory_budget_gib`` (pipeline/residency.py)."""
        from rollplex.pipeline.residency import GiB, plan_residency

        cfg = self.cfg
        if cfg.cluster.memory_budget_gib is None:
            raise ConfigError("cluster.memory_plan needs cluster.memory_budget_gib: the memory each device may use")
        if self.world > 1:
            raise ConfigError(f"cluster.memory_plan plans one device; cluster.workers is {self.world}")
        return plan_residency(graph, cfg.schedule, model_path=self.model_path, shape=self.shape,
                              budget_bytes=cfg.cluster.memory_budget_gib * GiB, train_engine=self.train_engine,
                              score_engine=self.score_engine, zero_stage=cfg.train.zero_stage, device=self.device)

    def balanced(self, batch: list) -> list:
        """The batch in slot order: rank r's slots get prompts whose predicted prefix + decode cost
        evens out the ranks' loads (pipeline/ranks.py); unchanged on one rank."""
        if self.world <= 1:
            return batch
        from rollplex.pipeline.ranks import balance, prompt_cost

        s, d = self.shape, self.dims
        costs = [prompt_cost(int(p.input_ids.numel()), int(max(p.meta.get("max_tokens") or [s.max_new_tokens])),
                             s.samples, d.params, d.layers, d.hidden) for p in batch]
        return [batch[i] for i in balance(costs, self.world)]

    def host_spec(self):
        from rollplex.pipeline.worker import HostSpec, IterationSettings

        tok = self.tokenizer
        stop = tuple(sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}))
        cfg = self.cfg
        settings = IterationSettings(
            seed=cfg.seed, samples=cfg.rollout.samples_per_prompt, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            pad_id=tok.convert_tokens_to_ids("<|endoftext|>"), stop_token_ids=stop, params=dict(cfg.params))
        micro_batches = len(self.shape.micro_batches()) // self.world  # each rank accumulates its share
        train_options = {"lr": cfg.train.lr, "betas": tuple(cfg.train.betas), "eps": cfg.train.eps,
                         "weight_decay": cfg.train.weight_decay, "grad_clip": cfg.train.grad_clip,
                         "zero_stage": cfg.train.zero_stage, "accumulation_steps": micro_batches,
                         # weight sharing with vLLM: DeepSpeed's flat buffer holds q|k|v, gate|up adjacent
                         "fusion_order": cfg.engines.weight_sharing != "off" and self.decode_engine == "vllm",
                         **cfg.engines.train_options}
        longest = max(256, self.shape.prompt_tokens + cfg.rollout.max_new_tokens + 64)
        sequences = self.shape.prompts * self.shape.samples
        # Size the decode KV pool from the batch: vLLM's CPU default reserves a share of host memory.
        kv_bytes = max(32 << 20, 2 * self.dims.kv_bytes(longest) * sequences)
        decode_options = {"max_model_len": longest, "max_num_seqs": sequences, "kv_cache_bytes": kv_bytes,
                          **cfg.engines.decode_options}
        alg = self.algorithm
        return HostSpec(
            model_path=self.model_path, reference_path=self.reference_path, device=self.device, dtype=cfg.model.dtype,
            threads=cfg.cluster.threads, decode_engine=self.decode_engine, train_engine=self.train_engine,
            score_engine=self.score_engine, decode_options=decode_options, train_options=train_options,
            algorithm=cfg.algorithm, reward=cfg.task.reward, settings=settings,
            trainable=tuple(alg.trainable), frozen=tuple(m for m in alg.models if m not in alg.trainable),
            ref_cache_bytes=int(cfg.train.ref_cache_gib * 2**30), world_size=self.world,
            weight_sharing=cfg.engines.weight_sharing)


# ------------------------------------------------------------------------------------------------
def _warmup(host, examples: list, lr: float) -> float:
    """One supervised answer-format step: -mean log p(target | prompt) on the policy."""
    from rollplex.tasks import lm
    from rollplex.tasks.data import warmup_target_ids

    policy = host.algorithm.rollout_model
    engine = host.train_engine(policy)
    vision_model = host.model(host.algorithm.vision_model)
    engine.set_lr(lr)
    targets = [warmup_target_ids(host.tokenizer, t) for _, t in examples]
    total = sum(len(ids) for ids in targets)
    loss_sum = 0.0
    for (prompt, _), ids in zip(examples, targets):
        vis = lm.vision_embeds(vision_model, prompt)
        state = lm.prefix_forward(engine.module, prompt, vis, grad=True)
        logp, mask = lm.suffix_logprobs(engine.module, state, [ids], pad_id=host.spec.settings.pad_id, grad=True)
        loss = -(logp * mask).sum() / total
        engine.backward(loss)
        loss_sum += float(loss.detach())
    engine.step()
    engine.set_lr(host.spec.train_options["lr"])
    return loss_sum


def _end_warmup(host) -> None:
    host.train_engine(host.algorithm.rollout_model).reset_optimizer_state()


def _sync_decode(host) -> None:
    engine = host.train_engine(host.algorithm.rollout_model)
    host.decode.load_weights(engine.state_dict_for_sync(trainable_only=True))


def _adopt_reference(host, directory: str) -> None:
    """Make the frozen copies of the policy equal to it now, and save it for resumed runs."""
    alg = host.algorithm
    policy = host.train_engine(alg.rollout_model)
    weights = dict(policy.state_dict_for_sync())
    for name, decl in alg.models.items():
        # A critic trains its own weights; a model on an engine of its own (a reward model) keeps its.
        if decl.copy_of == alg.rollout_model and not decl.trainable and decl.engine is None:
            host.engines[name].model.load_state_dict(weights)
            host.register_frozen(name)  # cached prefixes of the old weights no longer match
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:  # one writer per run
        policy.module.save_pretrained(directory)


def _save(host, directory: str, pids: set[int]) -> None:
    from rollplex.pipeline.recovery import expect_host

    expect_host(pids)
    host.train_engine(host.algorithm.rollout_model).save(directory)
    for model in host.algorithm.model_losses:  # other trained models (a critic): a subdirectory each
        host.train_engine(model).save(os.path.join(directory, model))
    point("save:model")


def _load(host, directory: str) -> None:
    host.train_engine(host.algorithm.rollout_model).load(directory)
    for model in host.algorithm.model_losses:
        host.train_engine(model).load(os.path.join(directory, model))
    _sync_decode(host)


def _restore(host, directory: str, reference: str | None) -> None:
    """Bring a host's engines to a checkpoint after a lost worker: finish requests a failed iteration
    left in the decode engine, reload the frozen copies of the policy (a fresh worker built them from
    the initial model), then the policy and its optimizer."""
    from rollplex.engines.torch_train import load_hf_weights

    while host.decode.has_unfinished():
        host.decode.step(host.spec.settings.max_new_tokens)
    alg = host.algorithm
    for name, decl in alg.models.items():
        if reference and decl.copy_of == alg.rollout_model and not decl.trainable and decl.engine is None:
            load_hf_weights(host.engines[name].model, reference)
            host.register_frozen(name)
    _load(host, directory)


# ------------------------------------------------------------------------------------------------
def write_iteration_files(run_dir: Path, iteration: int, rows: list[dict], trace: dict) -> None:
    atomic_write_text(run_dir / "rollouts" / f"iter_{iteration:06d}.jsonl",
                      "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    atomic_write_text(run_dir / "traces" / f"iter_{iteration:06d}.json", json.dumps(trace))


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, progress: bool = True,
          log=print) -> RunSummary:
    import contextlib

    import dask

    from rollplex import runtime
    from rollplex.pipeline import faults
    from rollplex.pipeline.cluster import connect, install_engines, uninstall_engines
    from rollplex.pipeline.recovery import StopSignals, children_ignore_sigint, quiet_task_errors

    runtime.configure(threads=cfg.cluster.threads, device=resolve_device(cfg))
    run_dir = Path(run_dir)
    state = None
    metrics_path = run_dir / "metrics.jsonl"
    if resume:
        state = checkpoints.latest(run_dir)  # verified; a corrupt one is refused here
        if state is None:  # killed before the first checkpoint: nothing to keep, start again
            log(f"--resume: {run_dir} has no complete checkpoint yet; starting the run from the beginning")
    elif metrics_path.exists():
        raise RollplexError(f"{run_dir} already holds a run; pass --resume to continue it or pick another --out")
    session = Session(cfg, run_dir)
    session.loader.log = log
    for bad in getattr(session.task, "bad_rows", [])[:20]:
        log(f"data: skipped a bad row: {bad}")
    if len(getattr(session.task, "bad_rows", [])) > 20:
        log(f"data: ... {len(session.task.bad_rows) - 20} more bad rows skipped (data_skipped_rows in metrics.jsonl)")
    if state is not None:
        session.loader.load_state_dict(state.loader)  # refuses a checkpoint of another task or seed
        if cfg.warmup.steps and session.reference_path == session.model_path:
            raise RollplexError(f"--resume: {run_dir / 'reference'} (the warmed-up reference model) is missing")
    else:
        session.reference_path = session.model_path  # a killed attempt's reference is rebuilt by warm-up
    spec = session.host_spec()
    if session.memory_plan is not None:
        log(session.memory_plan.describe())
    elif cfg.cluster.memory_budget_gib is not None:  # without a plan, everything stays resident
        from rollplex.pipeline import preflight

        preflight.check_memory_budget(cfg.cluster.memory_budget_gib, preflight.memory_terms(
            *preflight.parameter_counts(session.model_path), 4 if cfg.model.dtype == "float32" else 2,
            session.train_engine, len(spec.frozen), spec.decode_options.get("kv_cache_bytes", 0),
            None if session.weight_plan is None else session.weight_plan.per_gpu("extra")))
    log(f"rollplex: {session.algorithm.name} on {session.device}, schedule={cfg.schedule}, "
        f"engines decode={session.decode_engine} train={session.train_engine} score={session.score_engine}, "
        f"{len(session.graph)} nodes/iteration → {run_dir}")
    if session.weight_plan is not None:  # engines.weight_sharing
        plan = session.weight_plan
        log(f"weight sharing: the decode engine runs on the trainer's weights ({plan.per_gpu('aliased') / 2**20:.1f} "
            f"MiB as views, {plan.per_gpu('extra') / 2**20:.1f} MiB rebuilt)")
    elif cfg.engines.weight_sharing != "off":  # asked for, but these engines cannot (ZeRO-3, say): say why
        from rollplex.pipeline.weightshare import sharing_refusal

        log(f"weight sharing off: {sharing_refusal(session.decode_engine, session.train_engine, cfg.train.zero_stage)}")
    stop = StopSignals()
    with contextlib.ExitStack() as stack:
        # A task on a dead worker fails at once (KilledWorker) instead of being re-run on a fresh
        # worker's engines; the runner replays it from a checkpoint (LocalCluster only: an external
        # scheduler keeps its own setting, and WorkerWatch catches the re-run instead).
        stack.enter_context(dask.config.set({"distributed.scheduler.allowed-failures": 0}))
        with children_ignore_sigint():
            client = stack.enter_context(connect(cfg.cluster.scheduler, cfg.cluster.workers, cfg.cluster.threads,
                                                 cfg.cluster.processes, cfg.cluster.dashboard,
                                                 security=cluster_security(cfg)))
        stop.install()
        stack.callback(stop.uninstall)
        t0 = time.time()
        if cfg.cluster.dashboard:
            log(f"Dask dashboard: {dashboard_link(client)}")
        install_engines(client, spec)
        ranks = None
        if session.world > 1:
            from rollplex.pipeline.cluster import form_ranks

            ranks = form_ranks(client, spec, session.world)
            log(f"{session.world} data-parallel ranks: {', '.join(ranks)}")
        client.run(quiet_task_errors)
        if faults.active():
            client.run(faults.install_task_hooks)
        # Written only now: bad input (config, DAG, engines, cluster) fails above with nothing on disk.
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoints.clean_stale(run_dir)
        checkpoints.retain(run_dir, cfg.checkpoint.keep_last)
        atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
        atomic_write_text(run_dir / "graph.txt", str(session.graph) + "\n")
        try:
            return _train_loop(cfg, session, client, state, metrics_path, progress, log, t0, stop, ranks)
        finally:
            if cfg.cluster.scheduler:
                uninstall_engines(client)


def dashboard_link(client) -> str:
    """The scheduler's dashboard address, or why there is none (it needs bokeh, an optional package)."""
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return "unavailable: `pip install bokeh` (the dashboard's optional dependency)"
    return client.dashboard_link


def cluster_security(cfg: RunConfig):
    """Dask TLS from cluster.tls_* (mutual TLS to a remote scheduler), or None."""
    c = cfg.cluster
    if not c.tls_ca_file:
        return None
    from distributed.security import Security

    return Security(tls_ca_file=c.tls_ca_file, tls_client_cert=c.tls_cert, tls_client_key=c.tls_key,
                    require_encryption=True)


def _start_from(cfg: RunConfig, session: Session, executor, watch, state, metrics_path: Path, log, stop,
                recovering: bool) -> tuple[int, list[float]]:
    """Bring the driver (loader, RNG, metrics) and every host's engines to ``state``, a checkpoint or
    the very beginning. Returns the first iteration to run and the RL rewards logged before it."""
    import random

    import torch

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if state is None:
        if recovering and watch.survived:
            raise RollplexError("a Dask worker was lost before the first checkpoint while others kept their "
                                "state, so there is nothing consistent to roll back to; start the run again")
        metrics_path.unlink(missing_ok=True)
        session.loader.load_state_dict({**session.loader.state_dict(), "epoch": 0, "position": 0})
        if cfg.warmup.steps:
            _run_warmup(cfg, session, executor, metrics_path, log, stop)
            session.checkpoint(executor, -1, reward=None, pids=set(watch.known.values()))
        return 0, []
    session.loader.load_state_dict(state.loader)
    checkpoints.restore_rng(state.rng)
    checkpoints.truncate_metrics(metrics_path, state.iteration)
    reference = session.run_dir / "reference"
    watch.on_each(_restore, str(state.directory),
                  str(reference) if recovering and (reference / "config.json").exists() else None)
    return state.iteration + 1, checkpoints.rl_rewards(metrics_path)


def _failure(exc: BaseException, where: str, run_dir: Path) -> BaseException:
    """A NaN/Inf refusal becomes one line naming the iteration; anything else stays as it is."""
    detail = exc.detail if isinstance(exc, NodeFailure) else ""
    if isinstance(exc, FloatingPointError) or detail.startswith("FloatingPointError"):
        done = checkpoints.latest_name(run_dir)
        kept = f"the last good checkpoint, {done}, is intact" if done else "no checkpoint was written yet"
        return NonFiniteError(f"{where} stopped before its update: {exc}; nothing of it was applied or written; "
                              f"{kept} (rollplex train --resume --out {run_dir} continues from it)")
    return exc


def _train_loop(cfg: RunConfig, session: Session, client, state, metrics_path: Path, progress: bool, log,
                t0: float, stop, ranks: list[str] | None = None) -> RunSummary:
    from tqdm import tqdm

    from rollplex.pipeline import faults
    from rollplex.pipeline.executor import DaskExecutor, task_key
    from rollplex.pipeline.recovery import WorkerWatch, drop_tracebacks, quiet_task_errors

    run_dir = session.run_dir
    executor = DaskExecutor(client, ranks)
    watch = WorkerWatch(client)
    log(f"engines ready in {time.time() - t0:.1f}s")
    bar = tqdm(disable=not progress, desc=session.algorithm.name, unit="it", total=cfg.iterations)
    iteration_seconds: list[float] = []
    iteration, recovering, where = None, False, "warm-up"
    while True:
        try:
            if iteration is None:
                iteration, rewards = _start_from(cfg, session, executor, watch, state, metrics_path, log, stop,
                                                 recovering)
                bar.n = iteration
                bar.refresh()
            while iteration < cfg.iterations:
                if stop.requested:
                    raise _interrupted(stop, run_dir, iteration - 1)
                where = f"iteration {iteration}"
                point("iteration:start")
                batch = session.balanced(session.loader.next_batch())
                inputs = {f"prompt_p{p}": prompt for p, prompt in enumerate(batch)}
                result = executor.run(session.graph, iteration, inputs)
                watch.check()  # results computed (even partly) on a replaced worker are not the run's
                out = result.output["report"]
                trace = chrome_trace(result.events, iteration, cfg.schedule)
                write_iteration_files(run_dir, iteration, out["rows"], trace)
                metrics = {"iteration": iteration, "phase": "rl", **out["metrics"],
                           "iter_seconds": round(result.seconds, 4),
                           "seconds_by_kind": seconds_by_kind(result.events),
                           "peak_memory_bytes": result.peak_memory_bytes, "reward_chance": session.task.chance,
                           **session.loader.metrics()}
                append_line(metrics_path, json.dumps(metrics, sort_keys=True))
                point("iteration:written")
                rewards.append(metrics["reward_mean"])
                iteration_seconds.append(result.seconds)
                line = (f"it {iteration:4d}  reward {metrics['reward_mean']:.3f}  kl {metrics['kl']:.4f}  "
                        f"loss {metrics['loss']:+.4f}  |g| {metrics['grad_norm']:.3f}  "
                        f"len {metrics['response_len_mean']:.1f}  {result.seconds:.2f}s")
                bar.write(line) if progress else log(line)
                bar.update(1)
                moving = sum(rewards[-MOVING_WINDOW:]) / len(rewards[-MOVING_WINDOW:])
                done = (cfg.stop_at_reward is not None and len(rewards) >= MOVING_WINDOW
                        and moving >= cfg.stop_at_reward)
                if checkpoints.due(iteration, cfg) or done or stop.requested:
                    session.checkpoint(executor, iteration, reward=metrics["reward_mean"],
                                       pids=set(watch.known.values()))
                iteration += 1
                if done:
                    bar.write(f"mean reward of the last {MOVING_WINDOW} iterations {moving:.3f} ≥ "
                              f"{cfg.stop_at_reward}: stopping")
                    break
            break
        except Interrupted:
            raise
        except Exception as exc:
            lost = str(exc) if isinstance(exc, WorkerLost) else watch.lost()
            if lost is None:
                raise _failure(exc, where, run_dir) from exc
            if stop.requested:
                raise _interrupted(stop, run_dir, None) from None
            drop_tracebacks(exc)
        # A lost worker. Out of the except block: the exception's traceback holds the failed
        # iteration's future, and the scheduler releases its tasks only once nothing does.
        state = checkpoints.latest(run_dir)
        log(f"{where}: lost a Dask worker: {lost}; rolling back to "
            f"{state.directory.name if state else 'the beginning'} and replaying from there")
        if session.world > 1:  # the survivors' process group lost a member: restart every rank afresh
            from rollplex.pipeline.cluster import reform_ranks

            executor.ranks = reform_ranks(client, session.host_spec(), session.world, watch, log)
        if iteration is not None:
            watch.forget(task_key(iteration, ""))
        if session.world == 1:
            watch.await_replacements(log)
        client.run(quiet_task_errors)
        if faults.active():
            client.run(faults.install_task_hooks)
        iteration, recovering = None, True
    bar.close()
    steady = iteration_seconds[2:] or iteration_seconds
    final = sum(rewards[-MOVING_WINDOW:]) / len(rewards[-MOVING_WINDOW:]) if rewards else float("nan")
    return RunSummary(run_dir, len(rewards), final, sum(steady) / max(len(steady), 1))


def _interrupted(stop, run_dir: Path, finished: int | None) -> Interrupted:
    done = checkpoints.latest_name(run_dir)
    if done is None:
        what = "before the first checkpoint; --resume starts the run again"
    elif finished is None:
        what = f"the last checkpoint is {done}"
    else:
        what = f"after iteration {finished}, checkpoint {done} written"
    return Interrupted(f"{stop.name}: stopped {what}; continue with: rollplex train --resume --out {run_dir}",
                       stop.signum)


def _run_warmup(cfg: RunConfig, session: Session, executor, metrics_path: Path, log, stop) -> None:
    import numpy as np

    from rollplex.tasks.data import format_warmup_batch

    rng = np.random.default_rng([cfg.seed, 7919])
    log(f"warm-up: {cfg.warmup.steps} supervised steps on the answer format (targets are random valid "
        f"answers, not the true ones, so the reward stays at chance ≈ {session.task.chance:.2f})")
    for step in range(cfg.warmup.steps):
        if stop.requested:  # no state worth a checkpoint before warm-up ends: abandon it
            raise _interrupted(stop, session.run_dir, None)
        examples = format_warmup_batch(session.task, session.builder, rng, cfg.warmup.batch_size)
        t = time.time()
        loss = executor.call(_warmup, examples, cfg.warmup.lr)
        row: dict[str, Any] = {"iteration": -cfg.warmup.steps + step, "phase": "warmup", "warmup_step": step,
                               "warmup_loss": loss, "iter_seconds": round(time.time() - t, 4)}
        append_line(metrics_path, json.dumps(row, sort_keys=True))
        point("warmup:step")
    executor.call(_end_warmup)
    executor.call(_sync_decode, stream="decode")
    target = session.run_dir / "reference"
    staging = session.run_dir / ".reference-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    executor.call(_adopt_reference, str(staging))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    log(f"warm-up done: loss {loss:.3f}; the reference model is now the warmed-up policy")
