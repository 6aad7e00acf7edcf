"""The training loop: compile once, then run iterations on Dask and write the run directory.

Run directory layout:
    config.yaml                 the resolved config
    metrics.jsonl               one JSON object per iteration (warm-up rows carry "phase": "warmup")
    rollouts/iter_NNNNNN.jsonl  one object per response
    traces/iter_NNNNNN.json     Chrome trace events, one track per worker and stream (Perfetto)
    checkpoints/iter_NNNNNN/    the actor in HF format + optimizer, RNG and data-loader state
Every file is written atomically (temp file + rename); ``--resume`` continues from the last
complete checkpoint and truncates later metric rows, so the sequence has no gaps or duplicates.
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
from rollplex.errors import EngineError, RollplexError
from rollplex.pipeline import checkpoints
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

    decode, train = cfg.engines.decode, cfg.engines.train
    if decode == "auto":
        decode = "vllm" if get_engine("vllm").installed() and device == "cpu" else "hf"
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
        from rollplex.tasks.data import PromptBuilder, PromptLoader, SyntheticVisualTask, build_item

        import rollplex.engines  # noqa: F401

        self.cfg = cfg
        self.run_dir = run_dir
        self.device = resolve_device(cfg)
        self.model_path = resolve_model_path(cfg)
        self.decode_engine, self.train_engine, self.score_engine = resolve_engines(cfg, self.device)
        self.algorithm = load_algorithm(cfg.algorithm)
        unknown = sorted(set(cfg.params) - set(self.algorithm.hyperparameters()))
        if unknown:
            known = ", ".join(sorted(self.algorithm.hyperparameters())) or "none"
            raise RollplexError(f"params: {unknown} are not hyperparameters of {self.algorithm.name} (known: {known})")
        self.processor = AutoProcessor.from_pretrained(self.model_path)
        self.task = SyntheticVisualTask(kinds=tuple(cfg.task.kinds), image_size=cfg.task.image_size,
                                        size=cfg.task.size, seed=cfg.seed, reward=cfg.task.reward)
        self.builder = PromptBuilder(self.processor)
        self.loader = PromptLoader(self.task, self.builder, cfg.rollout.prompts_per_iteration, cfg.seed)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        dims = ModelDims.from_hf_config(hf_config, 4 if cfg.model.dtype == "float32" else 2)
        sample = build_item(self.task, self.builder, 0)
        shape = BatchShape(
            prompts=cfg.rollout.prompts_per_iteration,
            samples=cfg.rollout.samples_per_prompt,
            max_new_tokens=cfg.rollout.max_new_tokens,
            chunk_tokens=cfg.rollout.chunk_tokens,
            micro_batch_groups=min(cfg.train.micro_batch_groups, cfg.rollout.prompts_per_iteration),
            prompts_per_node=cfg.train.prompts_per_node or auto_prompts_per_node(
                dims, sample.num_tokens, cfg.rollout.prompts_per_iteration, self.device),
            prompt_tokens=sample.num_tokens,
            vision_tokens=int((sample.input_ids == hf_config.image_token_id).sum()),
            prefix_sharing=cfg.train.prefix_sharing,
        )
        choice = EngineChoice({"decode": self.decode_engine, "train": self.train_engine, "score": self.score_engine},
                              dict(cfg.engines.overrides))
        self.shape = shape
        self.dims = dims
        # After a warm-up the reference is the warmed-up policy, saved once in the run directory.
        warmed = run_dir / "reference"
        self.reference_path = str(warmed) if (warmed / "config.json").exists() else self.model_path
        self.graph = schedule(compile_iteration(self.algorithm, shape, choice, dims), cfg.schedule)
        self.tokenizer = self.processor.tokenizer

    def checkpoint(self, executor, iteration: int, reward: float | None) -> Path:
        """The actor and optimizer (from the worker) plus the processor files, so that the
        checkpoint directory loads as is in transformers and vLLM."""
        def write(directory: str) -> None:
            executor.call(_save, directory)
            self.processor.save_pretrained(directory)

        return checkpoints.save(self.run_dir, iteration, write, loader=self.loader.state_dict(),
                                keep_last=self.cfg.checkpoint.keep_last, reward=reward)

    def host_spec(self):
        from rollplex.pipeline.worker import HostSpec, IterationSettings

        tok = self.tokenizer
        stop = tuple(sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}))
        cfg = self.cfg
        settings = IterationSettings(
            seed=cfg.seed, samples=cfg.rollout.samples_per_prompt, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            pad_id=tok.convert_tokens_to_ids("<|endoftext|>"), stop_token_ids=stop, params=dict(cfg.params))
        micro_batches = len(self.shape.micro_batches())
        train_options = {"lr": cfg.train.lr, "betas": tuple(cfg.train.betas), "eps": cfg.train.eps,
                         "weight_decay": cfg.train.weight_decay, "grad_clip": cfg.train.grad_clip,
                         "zero_stage": cfg.train.zero_stage, "accumulation_steps": micro_batches,
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
            trainable=tuple(alg.trainable), frozen=tuple(m for m in alg.models if m not in alg.trainable))


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
        if decl.copy_of == alg.rollout_model:
            host.engines[name].model.load_state_dict(weights)
    policy.module.save_pretrained(directory)


def _save(host, directory: str) -> None:
    host.train_engine(host.algorithm.rollout_model).save(directory)


def _load(host, directory: str) -> None:
    host.train_engine(host.algorithm.rollout_model).load(directory)
    _sync_decode(host)


# ------------------------------------------------------------------------------------------------
def write_iteration_files(run_dir: Path, iteration: int, rows: list[dict], trace: dict) -> None:
    atomic_write_text(run_dir / "rollouts" / f"iter_{iteration:06d}.jsonl",
                      "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    atomic_write_text(run_dir / "traces" / f"iter_{iteration:06d}.json", json.dumps(trace))


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, progress: bool = True,
          log=print) -> RunSummary:
    import random

    import torch

    from rollplex import runtime
    from rollplex.pipeline.cluster import connect, install_engines, uninstall_engines

    runtime.configure(threads=cfg.cluster.threads, device=resolve_device(cfg))
    run_dir = Path(run_dir)
    start_iteration, state = 0, None
    metrics_path = run_dir / "metrics.jsonl"
    if resume:
        state = checkpoints.latest(run_dir)
        if state is None:  # killed before the first checkpoint: nothing to keep, start again
            log(f"--resume: {run_dir} has no complete checkpoint yet; starting the run from the beginning")
            metrics_path.unlink(missing_ok=True)
    elif metrics_path.exists():
        raise RollplexError(f"{run_dir} already holds a run; pass --resume to continue it or pick another --out")
    session = Session(cfg, run_dir)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if state is not None:
        start_iteration = state.iteration + 1
        session.loader.load_state_dict(state.loader)
        checkpoints.restore_rng(state.rng)
        checkpoints.truncate_metrics(metrics_path, state.iteration)
    log(f"rollplex: {session.algorithm.name} on {session.device}, schedule={cfg.schedule}, "
        f"engines decode={session.decode_engine} train={session.train_engine} score={session.score_engine}, "
        f"{len(session.graph)} nodes/iteration → {run_dir}")
    with connect(cfg.cluster.scheduler, cfg.cluster.workers, cfg.cluster.threads, cfg.cluster.processes,
                 cfg.cluster.dashboard) as client:
        t0 = time.time()
        install_engines(client, session.host_spec())
        # Written only now: bad input (config, DAG, engines, cluster) fails above with nothing on disk.
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
        atomic_write_text(run_dir / "graph.txt", str(session.graph) + "\n")
        try:
            summary = _train_loop(cfg, session, client, state, start_iteration, metrics_path, progress, log, t0)
        finally:
            if cfg.cluster.scheduler:
                uninstall_engines(client)
    return summary


def _train_loop(cfg: RunConfig, session: Session, client, state, start_iteration: int, metrics_path: Path,
                progress: bool, log, t0: float) -> RunSummary:
    from tqdm import tqdm

    from rollplex.pipeline.executor import DaskExecutor

    run_dir = session.run_dir
    executor = DaskExecutor(client)
    log(f"engines ready in {time.time() - t0:.1f}s")
    if state is not None:
        executor.call(_load, str(state.directory))
    elif cfg.warmup.steps:
        _run_warmup(cfg, session, executor, metrics_path, log)
        session.checkpoint(executor, -1, reward=None)
    bar = tqdm(range(start_iteration, cfg.iterations), disable=not progress, desc=session.algorithm.name,
               unit="it", initial=start_iteration, total=cfg.iterations)
    rewards: list[float] = []
    iteration_seconds: list[float] = []
    for iteration in bar:
        batch = session.loader.next_batch()
        inputs = {f"prompt_p{p}": prompt for p, prompt in enumerate(batch)}
        result = executor.run(session.graph, iteration, inputs)
        out = result.output["report"]
        trace = chrome_trace(result.events, iteration, cfg.schedule)
        write_iteration_files(run_dir, iteration, out["rows"], trace)
        metrics = {"iteration": iteration, "phase": "rl", **out["metrics"],
                   "iter_seconds": round(result.seconds, 4),
                   "seconds_by_kind": seconds_by_kind(result.events),
                   "peak_memory_bytes": result.peak_memory_bytes, "reward_chance": session.task.chance}
        append_line(metrics_path, json.dumps(metrics, sort_keys=True))
        rewards.append(metrics["reward_mean"])
        iteration_seconds.append(result.seconds)
        line = (f"it {iteration:4d}  reward {metrics['reward_mean']:.3f}  kl {metrics['kl']:.4f}  "
                f"loss {metrics['loss']:+.4f}  |g| {metrics['grad_norm']:.3f}  "
                f"len {metrics['response_len_mean']:.1f}  {result.seconds:.2f}s")
        bar.write(line) if progress else log(line)
        moving = sum(rewards[-MOVING_WINDOW:]) / len(rewards[-MOVING_WINDOW:])
        stop = cfg.stop_at_reward is not None and len(rewards) >= MOVING_WINDOW and moving >= cfg.stop_at_reward
        if checkpoints.due(iteration, cfg) or stop:
            session.checkpoint(executor, iteration, reward=metrics["reward_mean"])
        if stop:
            bar.write(f"mean reward of the last {MOVING_WINDOW} iterations {moving:.3f} ≥ {cfg.stop_at_reward}: "
                      "stopping")
            break
    bar.close()
    steady = iteration_seconds[2:] or iteration_seconds
    final = sum(rewards[-MOVING_WINDOW:]) / len(rewards[-MOVING_WINDOW:]) if rewards else float("nan")
    return RunSummary(run_dir, len(rewards), final, sum(steady) / max(len(steady), 1))


def _run_warmup(cfg: RunConfig, session: Session, executor, metrics_path: Path, log) -> None:
    import numpy as np

    from rollplex.tasks.data import format_warmup_batch

    rng = np.random.default_rng([cfg.seed, 7919])
    log(f"warm-up: {cfg.warmup.steps} supervised steps on the answer format (targets are random valid "
        f"answers, not the true ones, so the reward stays at chance ≈ {session.task.chance:.2f})")
    for step in range(cfg.warmup.steps):
        examples = format_warmup_batch(session.task, session.builder, rng, cfg.warmup.batch_size)
        t = time.time()
        loss = executor.call(_warmup, examples, cfg.warmup.lr)
        row: dict[str, Any] = {"iteration": -cfg.warmup.steps + step, "phase": "warmup", "warmup_step": step,
                               "warmup_loss": loss, "iter_seconds": round(time.time() - t, 4)}
        append_line(metrics_path, json.dumps(row, sort_keys=True))
    executor.call(_end_warmup)
    executor.call(_sync_decode, stream="decode")
    target = session.run_dir / "reference"
    staging = session.run_dir / ".reference-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    executor.call(_adopt_reference, str(staging))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    log(f"warm-up done: loss {loss:.3f}; the reference model is now the warmed-up policy")
