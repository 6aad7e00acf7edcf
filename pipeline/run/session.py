"""A run on the driver: which engines and device it uses, its data, and its compiled iteration.

``Session`` resolves the config against what is installed and visible (engines, device, model
path), builds the prompt loader, compiles the algorithm for the batch shape (data-parallel ranks,
stage fusion, the memory plan when asked) and schedules it. ``pipeline/run/runner.py`` drives it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from rollplex.config import RunConfig, resolve_task_defaults, rollout_is_cap
from rollplex.errors import ConfigError, EngineError, GraphError, RollplexError
from rollplex.pipeline.run import checkpoints
from rollplex.fsio import atomic_write_bytes
from rollplex.pipeline.plan.autoschedule import DROPPED_FILE, Choice, candidates, next_schedule, policy_of
from rollplex.pipeline.run.hostops import _save
from rollplex.pipeline.run.preflight import check_servable


def resolve_engines(cfg: RunConfig, device: str) -> tuple[str, str, str]:
    from rollplex.engines.base import get_engine

    # decode_chunk is the decode role's only node kind, so its override picks the engine the workers build.
    decode, train = cfg.engines.overrides.get("decode_chunk", cfg.engines.decode), cfg.engines.train
    if decode == "auto":
        if device != "cpu" or cfg.cluster.tp_rollout > 1:
            # vLLM's CUDA build is not assumed: torch-graph is the GPU engine (CUDA graphs, static KV)
            # and the one that decodes tensor-parallel over ranks.
            decode = "torch-graph"
        else:
            # In-process vLLM sets up torch.distributed state of its own: not shared with data-parallel ranks yet.
            decode = "vllm" if get_engine("vllm").installed() and cfg.cluster.workers == 1 else "hf"
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
    from rollplex.engines.base import check_options

    check_options(get_engine(decode), cfg.engines.decode_options, "engines.decode_options")
    check_options(get_engine(train), cfg.engines.train_options, "engines.train_options",
                  elsewhere={k: f"train.{k}" for k in ("lr", "betas", "eps", "weight_decay", "grad_clip",
                                                        "zero_stage")})
    for kind, name in cfg.engines.overrides.items():
        from rollplex.pipeline.compile.ir import get_kind

        try:
            role = get_kind(kind).role
            get_engine(name, role)
        except RollplexError as exc:
            raise EngineError(f"engines.overrides.{kind}: {exc}") from None
    return decode, train, cfg.engines.score


def check_hyperparameters(algorithm, params: dict) -> None:
    """Each of ``params`` names a hyperparameter of ``algorithm`` and has its default's type (a default
    of None: its annotation's, ``float | None``): a number for a number (finite), a bool for a bool, a
    string for a string. A loss given ``kl_coef: abc`` otherwise failed inside its first node, after the
    engines had started."""
    defaults = algorithm.hyperparameters()
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        known = ", ".join(sorted(defaults)) or "none"
        raise ConfigError(f"params: {unknown} are not hyperparameters of {algorithm.name} (known: {known})")
    annotated = algorithm.hyperparameter_types()
    for name, value in params.items():
        default = defaults[name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if default is None:  # the annotation says what it takes (float | None), if there is one
            kinds = _annotated_kinds(annotated.get(name))
            fits = kinds is None or any(_is_kind(value, kind) for kind in kinds)
            shown = " or ".join("null" if k is type(None) else k.__name__ for k in kinds or ())
        else:
            fits = _is_kind(value, type(default))
            shown = f"{type(default).__name__} like its default {default!r}"
        if not fits:
            raise ConfigError(f"params.{name}: expected {shown}, got {type(value).__name__} {value!r}")
        if number and not math.isfinite(value):
            raise ConfigError(f"params.{name}: expected a finite number, got {value}")


def _annotated_kinds(annotation) -> tuple[type, ...] | None:
    """The plain types of a hyperparameter's annotation (``float | None`` → float, NoneType); None when
    there is none, or it names something else (a Literal, a generic), which is then not checked here."""
    import types
    import typing

    if annotation is None:
        return None
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    return members if all(isinstance(m, type) and m in (bool, int, float, str, type(None)) for m in members) else None


def _is_kind(value, kind: type) -> bool:
    """A value given for a hyperparameter of type ``kind``: a float takes an int, a bool is no number."""
    if kind in (int, float):
        return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    return type(value) is kind


def check_sequence_length(cfg: RunConfig, hf_config, prompt_tokens: int) -> int:
    """A prompt and its response fit the model's positions and the decode engine's max_model_len
    (else vLLM refuses at construction and the torch engines fail mid-rollout). Returns the former."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    positions = int(getattr(text, "max_position_embeddings", 0) or 2**20)
    after = continuation_tokens(cfg)
    longest = prompt_tokens + after
    what = (f"rollout.max_new_tokens {cfg.rollout.max_new_tokens}" if cfg.rollout.max_turns == 1 else
            f"{cfg.rollout.max_turns} turns of rollout.max_new_tokens {cfg.rollout.max_new_tokens} and the "
            f"environment's answers between them, {after} tokens")
    if longest > positions:
        raise ConfigError(f"rollout.max_new_tokens: {what} after prompts of {prompt_tokens} is {longest}, past the "
                          f"model's max_position_embeddings ({positions})")
    asked = cfg.engines.decode_options.get("max_model_len")
    if asked is not None and asked < longest:
        raise ConfigError(f"engines.decode_options.max_model_len: {asked} is shorter than a prompt and its response "
                          f"({prompt_tokens} + {what})")
    return positions


def environment(cfg: RunConfig):
    """(name, its registered spec, its checked options) of a multi-turn run's environment, or None."""
    if cfg.rollout.max_turns == 1:
        return None
    from rollplex.tasks.environments import check_env_options, get_environment

    name = cfg.env.name or "zoom"  # config.validate allows no name on the embedded zoom task alone
    spec = get_environment(name)
    return name, spec, check_env_options(spec, cfg.env.options)


def continuation_tokens(cfg: RunConfig) -> int:
    """The most tokens a sample's turns after its prompt take: every turn and the answers between."""
    env = environment(cfg)
    answers = env[1].observation_tokens(env[2]) if env else 0
    return cfg.rollout.max_turns * cfg.rollout.max_new_tokens + (cfg.rollout.max_turns - 1) * answers


def check_group_size(algorithm, samples: int) -> None:
    """Refuse G below what the advantage is defined for: a group-normalised advantage divides by
    the std of the group's rewards, which for one response is NaN and would stop the run (exit 3)
    at its first step. verl instead takes mean 0 and std 1 for a group of one (Â = r, REINFORCE
    without a baseline); refusing says so up front rather than training a different algorithm."""
    decl = algorithm.advantage_fn
    needed = decl.options.get("min_samples", 1) if decl is not None else 1
    if samples < needed:
        raise ConfigError(f"rollout.samples_per_prompt: {samples} is too few for {algorithm.name}, whose advantage "
                          f"{decl.name}() normalises within a prompt's group and needs at least {needed} samples; "
                          f"set rollout.samples_per_prompt ≥ {needed}, or use an algorithm without group normalisation "
                          "(rloo, ppo, reinforce_pp)")


def resolve_device(cfg: RunConfig) -> str:
    import torch

    if cfg.model.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.model.device == "cuda" and not torch.cuda.is_available():
        raise RollplexError("model.device: cuda requested but no CUDA device is visible")
    return cfg.model.device


def read_dropped(path: Path) -> dict[str, str]:
    """``schedule: auto``'s dropped candidates, {name: why}, as ``Session.drop_schedule`` wrote them."""
    try:
        dropped = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        dropped = exc
    if not isinstance(dropped, dict) or not all(isinstance(v, str) for v in dropped.values()):
        raise RollplexError(f"{path}: not the {{candidate: reason}} object a run writes ({dropped}); "
                            "delete it to time every candidate again")
    return dropped


def resolve_worker_processes(processes: bool | str, workers: int, device: str, scheduler: str | None = None) -> bool:
    """Whether the workers run in processes of their own. An external scheduler's always do (stock
    `dask worker` processes); a LocalCluster's as ``processes`` says. ``auto``: not for one CPU
    worker, which would import torch and transformers a second time (about 12 s of a core on a slow
    host) for an isolation a CPU run does not need; yes for GPUs (a CUDA fault or an OOM kill costs
    the worker, and the driver replays from a checkpoint) and for data-parallel ranks (one process
    group rank each)."""
    if scheduler:
        return True
    if processes != "auto":
        return bool(processes)
    return workers > 1 or device != "cpu"


def resolve_model_path(cfg: RunConfig) -> str:
    if cfg.model.path:
        path = Path(cfg.model.path)
        if path.is_file():
            raise RollplexError(f"model.path: {path} is a file; expected an HF model directory")
        if not (path / "config.json").exists():
            raise RollplexError(f"model.path: {path} has no config.json (expected an HF model directory)")
        return str(path)
    from rollplex.engines.models import ensure_tiny_vlm
    from rollplex.tasks.data import default_model_spec

    return str(ensure_tiny_vlm(default_model_spec(cfg.task.name)))


# FLOPs a vit/prefix/suffix node should carry so that its dispatch stays a small share of it: on the
# CPU ~0.1-0.5 s of work. On a GPU an eager HF forward is launch-bound well past that: one 3B prompt
# of 1090 tokens (6.5 TFLOP, 0.04 s of kernels) costs more host time than device time, and 8 prompts
# per node made serial 1.26-1.49x faster on an H200 (BENCHMARKS.md, runs 7-10). 50 TFLOP per node is
# those 8 prompts.
MIN_NODE_FLOPS = {"cpu": 2e9, "cuda": 5e13}


def auto_prompts_per_node(dims, prompt_tokens: int, prompts: int, device: str) -> int:
    """Batch prompts until a node's forward is worth its dispatch and kernel launches."""
    per_prompt = 2 * dims.params * max(prompt_tokens, 1)
    return max(1, min(prompts, math.ceil(MIN_NODE_FLOPS.get(device, 2e12) / per_prompt)))


def iteration_spec(cfg: RunConfig, dims, prompt_tokens: int, vision_tokens: int, device: str, engines,
                   policy: str = "rollplex"):
    """The ``IterationSpec`` a run of ``cfg`` builds, for prompts of ``prompt_tokens`` (``vision_tokens``
    of them vision) on ``device`` with ``engines`` (compiler.EngineChoice), under ``policy``."""
    from rollplex.pipeline.compile.compiler import BatchShape
    from rollplex.pipeline.compile.ranks import fit_prompts_per_node
    from rollplex.pipeline.compile.spec import IterationSpec

    prompts, world = cfg.rollout.prompts_per_iteration, cfg.cluster.workers
    per_node = cfg.train.prompts_per_node or auto_prompts_per_node(dims, prompt_tokens, prompts, device)
    if world > 1 and prompts % world == 0:  # each rank's nodes cover its own prompts only
        per_node = fit_prompts_per_node(per_node, prompts // world)
    shape = BatchShape(
        prompts=prompts,
        samples=cfg.rollout.samples_per_prompt,
        max_new_tokens=cfg.rollout.max_new_tokens,
        chunk_tokens=cfg.rollout.chunk_tokens,
        micro_batch_groups=min(cfg.train.micro_batch_groups, prompts // cfg.train.mini_batches),
        prompts_per_node=per_node,
        prompt_tokens=prompt_tokens,
        vision_tokens=vision_tokens,
        prefix_sharing=cfg.train.prefix_sharing,
        # Under rollplex only (IterationSpec.compiled_shape); with data-parallel ranks, each rank scores
        # its own decode chain's samples (pipeline/compile/ranks.py).
        stage_fusion=cfg.train.stage_fusion,
        train_fusion=cfg.train.train_fusion,
        # One cap for all training unless train fusion's is set apart.
        fusion_batch_tokens=cfg.train.fusion_batch_tokens or cfg.train.micro_batch_tokens,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        window_chunks=cfg.train.window_chunks,
        grad_prefix_lookahead=cfg.train.grad_prefix_lookahead,
        mini_batches=cfg.train.mini_batches,
        epochs=cfg.train.epochs,
        trains_vision=not cfg.train.freeze_vision,
        max_turns=cfg.rollout.max_turns,
        observation_tokens=(continuation_tokens(cfg) - cfg.rollout.max_turns * cfg.rollout.max_new_tokens)
        // max(cfg.rollout.max_turns - 1, 1),
    )
    return IterationSpec(shape, engines, policy, world, cfg.cluster.tp_rollout)


def check_lora(cfg: RunConfig, model_path: str, train_engine: str) -> None:
    """train.lora against the model and the train engine, before any worker starts: its targets
    name linear layers of the language model (checked on the meta device), and ZeRO-3 is out."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from rollplex.engines.lora import target_names

    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError("train.lora: needs peft, which is not installed (pip install 'rollplex[lora]')") from None
    if train_engine == "deepspeed" and cfg.train.zero_stage == 3:
        raise ConfigError("train.lora: ZeRO-3 would partition the frozen base model as well, which the merged "
                          "weight sync and export do not gather; use train.zero_stage 0, 1 or 2")
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(model_path))
    target_names(model, cfg.train.lora["target_modules"])


class Session:
    """Everything a run needs on the driver: data, compiled graph, and the cluster connection."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        import rollplex.engines  # noqa: F401 - registers the builtin engines (light: no transformers yet)
        from rollplex.pipeline.run.algorithms import load_algorithm

        # What needs only the config and the DAG file is checked first: a typo is refused in a second
        # or two, not after transformers' imports (about 8 s on a slow 2-core host).
        self.algorithm = load_algorithm(cfg.algorithm)
        check_hyperparameters(self.algorithm, cfg.params)
        if cfg.train.clip_ratio_c is not None:
            if "clip_ratio_c" not in self.algorithm.hyperparameters():
                raise ConfigError(f"train.clip_ratio_c: the loss of {self.algorithm.name} has no dual clip (it takes "
                                  f"no clip_ratio_c hyperparameter)")
            if "clip_ratio_c" in cfg.params:
                raise ConfigError("train.clip_ratio_c and params.clip_ratio_c are both set; keep train.clip_ratio_c")
        if rollout_is_cap(cfg) is not None and "rollout_is_weights" not in self.algorithm.loss_fn.reads:
            raise ConfigError(f"train.rollout_is: the policy loss {self.algorithm.loss_fn.name}() of "
                              f"{self.algorithm.name} does not read rollout_is_weights, so nothing would weigh it")
        check_group_size(self.algorithm, cfg.rollout.samples_per_prompt)
        self.environment = environment(cfg)  # a multi-turn run's (name, spec, options), checked by name
        warmup = resolve_task_defaults(cfg).warmup.steps
        if self.environment is not None and warmup and self.environment[1].warmup is None:
            raise ConfigError(f"warmup.steps: environment {self.environment[0]!r} gives no warm-up trajectories; "
                              "set warmup.steps: 0")
        self.cfg = cfg
        self.run_dir = run_dir
        self.device = resolve_device(cfg)
        self.worker_processes = resolve_worker_processes(cfg.cluster.processes, cfg.cluster.workers, self.device,
                                                         cfg.cluster.scheduler)
        self.decode_engine, self.train_engine, self.score_engine = resolve_engines(cfg, self.device)
        if self.environment is not None and self.decode_engine not in ("vllm", "hf"):
            raise EngineError(f"engines.decode: {self.decode_engine!r} does not continue a sequence across turns yet; "
                              "a multi-turn run (rollout.max_turns > 1) decodes with vllm or hf")

        from transformers import AutoConfig, AutoProcessor
        from transformers.utils import logging as hf_logging

        from rollplex.pipeline.compile.compiler import EngineChoice, ModelDims
        from rollplex.tasks.data import PromptBuilder, PromptLoader
        from rollplex.tasks.dataset import make_task, probe_shape

        hf_logging.disable_progress_bar()
        self.model_path = resolve_model_path(cfg)
        check_servable(self.model_path, self.decode_engine, self.device)
        self.processor = AutoProcessor.from_pretrained(self.model_path)
        self.task = make_task(cfg)  # the synthetic task, or data.path's rows (bad ones refused or left out)
        self.builder = PromptBuilder(self.processor)
        self.loader = PromptLoader(self.task, self.builder, cfg.rollout.prompts_per_iteration, cfg.seed)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        dims = dataclasses.replace(ModelDims.from_hf_config(hf_config, 4 if cfg.model.dtype == "float32" else 2),
                                   checkpointing=cfg.train.gradient_checkpointing)
        # Video frames add vision tokens (temporal patches), so both pad kinds count.
        prompt_tokens, vision_tokens = probe_shape(self.task, self.builder,
                                                   (hf_config.image_token_id, hf_config.video_token_id))
        if getattr(self.task, "has_video", False) and "vllm" in (
                self.decode_engine, cfg.engines.overrides.get("decode_chunk")):
            raise EngineError(f"data.path: {cfg.data.path} has video prompts, which the vllm decode engine does "
                              "not take yet; set engines.decode: hf")
        # eval.*: the validation prompts, held to data.max_prompt_tokens (else the training prompts'
        # length), which the decode engine is sized for too
        self.eval_task, self.eval_prompt_tokens = None, 0
        if cfg.eval.every or cfg.eval.before_train:
            from rollplex.pipeline.run.evaluation import probe
            from rollplex.tasks.dataset import make_eval_task

            self.eval_prompt_tokens = max(cfg.data.max_prompt_tokens, prompt_tokens)
            self.eval_task = make_eval_task(cfg, self.task, self.eval_prompt_tokens)
            if getattr(self.eval_task, "has_video", False) and "vllm" in (
                    self.decode_engine, cfg.engines.overrides.get("decode_chunk")):
                raise EngineError(f"data.val_path: {cfg.data.val_path} has video prompts, which the vllm decode "
                                  "engine does not take yet; set engines.decode: hf")
            probe(self.eval_task, self.builder)
        choice = EngineChoice({"decode": self.decode_engine, "train": self.train_engine, "score": self.score_engine},
                              dict(cfg.engines.overrides))
        spec = iteration_spec(cfg, dims, prompt_tokens, vision_tokens, self.device, choice)
        shape = spec.shape
        self.max_positions = check_sequence_length(cfg, hf_config, max(prompt_tokens, self.eval_prompt_tokens))
        if cfg.train.lora is not None:
            check_lora(cfg, self.model_path, self.train_engine)
        if cfg.train.train_fusion and self.train_engine != "torch":
            raise ConfigError(f"train.train_fusion: the {self.train_engine} train engine cannot rescale its "
                              "accumulated gradients at the step; set engines.train: torch or train.train_fusion: false")
        # cluster.workers > 1: data-parallel ranks, one per worker, each with a share of the batch.
        self.world = cfg.cluster.workers
        from rollplex.pipeline.compile.ranks import check_data_parallel

        check_data_parallel(self.world, shape.prompts, shape.micro_batch_groups, self.train_engine,
                            cfg.train.zero_stage, self.decode_engine,
                            processes=self.worker_processes,
                            tp_rollout=cfg.cluster.tp_rollout, mini_batches=shape.mini_batches)
        self.shape = shape
        self.dims = dims
        # After a warm-up the reference is the warmed-up policy, saved once in the run directory.
        warmed = run_dir / "reference"
        self.reference_path = str(warmed) if (warmed / "config.json").exists() else self.model_path
        # schedule: auto times each candidate's graph and keeps the fastest (pipeline/plan/autoschedule.py).
        self.schedules = candidates(cfg.train.train_fusion) if cfg.schedule == "auto" else (cfg.schedule,)
        self.graphs, self.memory_plans, compiled_graphs = {}, {}, {}
        self.train_fusion_off: str | None = None  # asked for, but the rollplex graph trains after decode: why
        try:
            from rollplex.pipeline.plan.build import build_iteration

            for name in self.schedules:
                policy, fusing, lookahead = policy_of(name)
                if not fusing and self.train_fusion_off:  # rollplex's graph is unfused already: one is enough
                    continue
                candidate = spec.under(policy, train_fusion=fusing)
                if lookahead and not candidate.shape.grad_prefix_lookahead:
                    candidate = dataclasses.replace(
                        candidate, shape=dataclasses.replace(candidate.shape, grad_prefix_lookahead=lookahead))
                built = build_iteration(self.algorithm, candidate, dims,
                                        self.plan_memory if cfg.cluster.memory_plan else None)
                if name == "rollplex":
                    self.train_fusion_off = built.compiled.meta.get("train_fusion_off")
                compiled_graphs[name], self.memory_plans[name] = built.compiled, built.memory_plan
                self.graphs[name] = built.graph
        except GraphError as exc:  # a user DAG file's cycle or dangling value: name the file too
            if not cfg.algorithm.endswith(".py") or cfg.algorithm in str(exc):
                raise
            raise GraphError(f"{cfg.algorithm}: {exc}") from None
        self.schedules = tuple(name for name in self.schedules if name in self.graphs)
        # Candidates that ran out of memory earlier in this run (drop_schedule) stay out after a resume.
        self.dropped: dict[str, str] = {}
        if len(self.schedules) > 1 and (run_dir / DROPPED_FILE).exists():
            self.dropped = read_dropped(run_dir / DROPPED_FILE)
            self.schedules = tuple(name for name in self.schedules if name not in self.dropped) or self.schedules
        # train.fusion_batch_tokens caps the backwards of train fusion's nodes; with none in any graph
        # (train fusion off, or a schedule that trains after decode) the setting does nothing: say so.
        self.fusion_cap_unused = bool(cfg.train.fusion_batch_tokens) and not any(
            "batch_tokens" in node.args for g in compiled_graphs.values() for node in g.nodes.values())
        # The first schedule's: what `rollplex graph` prints and graph.txt holds.
        self.compiled, self.graph = compiled_graphs[self.schedules[0]], self.graphs[self.schedules[0]]
        self.memory_plan = self.memory_plans[self.schedules[0]]
        self.tokenizer = self.processor.tokenizer
        from rollplex.pipeline.plan.weightshare import annotate_run  # weight_sync nodes: what is aliased, rebuilt

        self.weight_plan = annotate_run(self.graphs.values(), self.model_path, self.decode_engine, self.train_engine,
                                        cfg.model.dtype, cfg.train.zero_stage, cfg.engines.weight_sharing,
                                        lora_targets=(cfg.train.lora or {}).get("target_modules", ()))

    def checkpoint(self, executor, iteration: int, reward: float | None, pids: set[int]) -> Path:
        """The actor and optimizer (from the worker) plus the processor files, so that the
        checkpoint directory loads as is in transformers and vLLM. ``pids``: the workers whose
        engines hold the run's state; a replacement worker refuses to save its fresh weights."""
        def write(directory: str) -> None:
            executor.call(_save, directory, pids)
            for model in ("", *self.algorithm.model_losses):  # the policy's folder, a critic's subfolder
                self.processor.save_pretrained(str(Path(directory) / model))

        return checkpoints.save(self.run_dir, iteration, write, loader=self.loader.state_dict(),
                                keep_last=self.cfg.checkpoint.keep_last, reward=reward, config=self.cfg.to_dict())

    def plan_memory(self, graph, schedule_name: str):
        """Offload/prefetch nodes so one device fits ``cluster.memory_budget_gib`` (pipeline/plan/residency.py)."""
        from rollplex.pipeline.plan.residency import GiB, plan_residency

        cfg = self.cfg
        if cfg.cluster.memory_budget_gib is None:
            raise ConfigError("cluster.memory_plan needs cluster.memory_budget_gib: the memory each device may use")
        if self.world > 1:
            raise ConfigError(f"cluster.memory_plan plans one device; cluster.workers is {self.world}")
        return plan_residency(graph, schedule_name, model_path=self.model_path, shape=self.shape,
                              budget_bytes=cfg.cluster.memory_budget_gib * GiB, train_engine=self.train_engine,
                              score_engine=self.score_engine, zero_stage=cfg.train.zero_stage, device=self.device,
                              weight_sharing=cfg.engines.weight_sharing != "off")

    def balanced(self, batch: list) -> list:
        """The batch (prompts or their refs) in slot order: rank r's slots get prompts whose predicted
        prefix + decode cost evens out the ranks' loads (pipeline/compile/ranks.py); unchanged on one
        rank."""
        if self.world <= 1:
            return batch
        from rollplex.pipeline.compile.ranks import balance, prompt_cost

        s, d = self.shape, self.dims
        costs = []
        for p in batch:
            tokens = self.loader.tokens(p.index) if hasattr(p, "index") else p.num_tokens
            longest = max(getattr(p, "meta", {}).get("max_tokens") or [s.max_new_tokens])
            costs.append(prompt_cost(tokens, int(longest), s.samples, d.params, d.layers, d.hidden))
        return [batch[i] for i in balance(costs, self.world)]

    def host_spec(self):
        from rollplex.pipeline.run.partitions import WindowSharing
        from rollplex.pipeline.run.worker import HostSpec, IterationSettings

        tok = self.tokenizer
        stop = tuple(sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}))
        cfg = self.cfg
        settings = IterationSettings(
            seed=cfg.seed, samples=cfg.rollout.samples_per_prompt, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            pad_id=tok.convert_tokens_to_ids("<|endoftext|>"), stop_token_ids=stop,
            params={**cfg.params, **({"clip_ratio_c": cfg.train.clip_ratio_c} if cfg.train.clip_ratio_c else {})},
            rollout_is_cap=rollout_is_cap(cfg), length_caps=cfg.rollout.length_caps)
        # Each rank accumulates its share of one optimizer step's micro-batches.
        micro_batches = len(self.shape.micro_batches()) // self.world // self.shape.mini_batches
        train_options = {"lr": cfg.train.lr, "betas": tuple(cfg.train.betas), "eps": cfg.train.eps,
                         "weight_decay": cfg.train.weight_decay, "grad_clip": cfg.train.grad_clip,
                         "zero_stage": cfg.train.zero_stage, "accumulation_steps": micro_batches,
                         # weight sharing with vLLM: DeepSpeed's flat buffer holds q|k|v, gate|up adjacent
                         "fusion_order": cfg.engines.weight_sharing != "off" and self.decode_engine == "vllm",
                         "freeze_vision": cfg.train.freeze_vision, "lora": cfg.train.lora,
                         "gradient_checkpointing": cfg.train.gradient_checkpointing,
                         **cfg.engines.train_options}
        longest = min(self.max_positions, max(256, max(self.shape.prompt_tokens, self.eval_prompt_tokens)
                                              + self.shape.continuation_tokens + 64))
        sequences = self.shape.prompts * self.shape.samples
        # Size the decode KV pool from the batch: vLLM's CPU default reserves a share of host memory.
        kv_bytes = max(32 << 20, 2 * self.dims.kv_bytes(longest) * sequences)
        decode_options = {"max_model_len": longest, "max_num_seqs": sequences, "kv_cache_bytes": kv_bytes}
        if self.environment is not None and self.decode_engine == "vllm":
            # A prompt's image and one per environment answer. Each sample keeps its own KV between
            # turns; blocks of 32 tokens (the least vLLM's CPU attention takes, its default 128) let
            # the prefix cache share more of a group's prompt.
            decode_options["limit_images"] = 1 + (cfg.rollout.max_turns - 1) * self.environment[1].observation_images
            if self.device == "cpu":
                decode_options["vllm_kwargs"] = {"block_size": 32}
        if self.decode_engine == "torch-graph":  # its two caches: prompts once per group, then responses
            eval_prompts = sequences // cfg.eval.samples if self.eval_task is not None else 0
            decode_options.update(max_prompt_len=longest - cfg.rollout.max_new_tokens,
                                  max_response_len=cfg.rollout.max_new_tokens + 1,
                                  prefix_slots=min(sequences, max(self.shape.prompts, eval_prompts)))
        decode_options.update(cfg.engines.decode_options)
        alg = self.algorithm
        return HostSpec(
            model_path=self.model_path, reference_path=self.reference_path, device=self.device, dtype=cfg.model.dtype,
            threads=cfg.cluster.threads, decode_engine=self.decode_engine, train_engine=self.train_engine,
            score_engine=self.score_engine, decode_options=decode_options, train_options=train_options,
            algorithm=cfg.algorithm, reward=cfg.task.reward, settings=settings,
            trainable=tuple(alg.trainable), frozen=tuple(m for m in alg.models if m not in alg.trainable),
            ref_cache_bytes=0 if self.ref_cache_off else int(cfg.train.ref_cache_gib * 2**30), world_size=self.world,
            tp_rollout=cfg.cluster.tp_rollout,
            weight_sharing=cfg.engines.weight_sharing,
            # Partitions serve work beside decode, which only the rollplex schedule runs.
            window=WindowSharing(partitions=cfg.cluster.sm_partitions and "rollplex" in self.schedules,
                                 compute_sms=cfg.cluster.compute_sms, switch_interval_us=cfg.cluster.switch_interval_us),
            task=self.task, eval_task=self.eval_task, graphs=self.graphs,
            env_name=self.environment[0] if self.environment else None,
            env_options=self.environment[2] if self.environment else {}, env_timeout=cfg.env.timeout_s)

    @property
    def ref_cache_off(self) -> str | None:
        """Why the frozen models' prefix cache would never hit in this run (None: it may). An entry
        is one prompt's prefix KV and last logits per frozen model; items come back once an epoch
        later, so an LRU smaller than an epoch's entries has evicted each before its return, and a
        run within one epoch never returns at all. Off, it costs nothing (3B, 8 prompts: about 313 MB
        copied to host per iteration for no hit)."""
        cfg, frozen = self.cfg, [m for m in self.algorithm.models if m not in self.algorithm.trainable]
        capacity = cfg.train.ref_cache_gib * 2**30
        if not capacity or not frozen:
            return None  # off by config, or nothing to cache
        entry = self.dims.kv_bytes(self.shape.prompt_tokens) + self.dims.vocab * 4
        epoch = entry * len(frozen) * len(self.task)
        if epoch > capacity:
            return (f"an epoch's prefixes ({epoch / 2**30:.2f} GiB for {len(self.task)} prompts) exceed "
                    f"train.ref_cache_gib={cfg.train.ref_cache_gib}, so each would be evicted before its next use")
        if cfg.iterations * cfg.rollout.prompts_per_iteration <= len(self.task):
            return f"the run's {cfg.iterations} iterations end within its first epoch of {len(self.task)} prompts"
        return None

    def drop_schedule(self, name: str, reason: str) -> None:
        """``schedule: auto`` stops timing ``name`` (it ran out of device memory) for the rest of the
        run, a resumed one included."""
        self.dropped[name] = reason
        atomic_write_bytes(self.run_dir / DROPPED_FILE, json.dumps(self.dropped, indent=1).encode())
        self.schedules = tuple(schedule for schedule in self.schedules if schedule != name)

    def schedule_for(self, history: list[tuple[str, float]]) -> Choice:
        """The schedule of the next RL iteration, from the (schedule, seconds) of those before it."""
        if len(self.schedules) == 1:
            return Choice(self.schedules[0], True)
        return next_schedule(history, self.cfg.schedule_trials, self.schedules)
