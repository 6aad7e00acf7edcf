"""The run configuration's schema: one dataclass per section, each field with its default, range or
choices and a one-line description (``f``); how a value is checked against its field (``build``,
one error naming the field); and the field table ``rollplex train --help-config`` prints."""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from rollplex.errors import ConfigError
from rollplex.yamlio import Dumper


def _range(lo: float | None = None, hi: float | None = None, choices: tuple | None = None, doc: str = "",
           above: bool = False):
    return {"lo": lo, "hi": hi, "choices": choices, "doc": doc, "above": above}


def f(default: Any, lo=None, hi=None, choices=None, doc: str = "", above: bool = False):
    """A config field with its default, allowed range (``above``: strictly above ``lo``) or choices, and
    a one-line description. Every number has both bounds: what its consumer (an engine, numpy) takes."""
    meta = _range(lo, hi, choices, doc, above)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    path: str | None = f(None, doc="HF model directory; null builds the embedded tiny Qwen2.5-VL")
    dtype: str = f("float32", choices=("float32", "bfloat16"), doc="weights and compute dtype")
    device: str = f("auto", choices=("auto", "cpu", "cuda"), doc="where engines run")


@dataclass
class TaskConfig:
    name: str = f("synthetic", choices=("synthetic", "zoom"), doc="the embedded prompt source: synthetic (a shape's "
                  "colour, kind, or count) or zoom (a colour too fine to see at the model's resolution, for a "
                  "multi-turn run with the zoom environment; single-turn, it stays at chance)")
    kinds: list = f(["colour"], doc="synthetic question kinds: colour, shape, count")
    image_size: int = f(112, lo=28, hi=1024, doc="synthetic image side in pixels (multiple of 28): 16 vision tokens")
    size: int = f(512, lo=1, hi=2**24, doc="number of distinct synthetic items")
    reward: str = f("exact_match", doc="reward: a registered name (exact_match, math_answer) or module:function "
                    "or path/to/file.py:function, fn(text, answer) -> float")


@dataclass
class DataConfig:
    path: str | None = f(None, doc="a jsonl or parquet file of prompts (verl/EasyR1 columns) or a Hugging Face "
                         "datasets folder (save_to_disk); null: the embedded synthetic task")
    format: str = f("auto", choices=("auto", "jsonl", "parquet", "datasets"),
                    doc="file format; auto: by suffix, datasets for a folder")
    split: str = f("train", doc="the split to read when data.path is a DatasetDict folder")
    prompt_key: str | None = f(None, doc="prompt column; null: `prompt`, else `problem`")
    image_key: str = f("images", doc="column of image paths (relative to the file), bytes or {bytes, path}")
    video_key: str = f("videos", doc="column of videos, each a list of frames or a directory of frames")
    answer_key: str = f("answer", doc="answer column; dotted for nesting, e.g. reward_model.ground_truth")
    on_bad_row: str = f("reject", choices=("skip", "reject"),
                        doc="a row with a missing/unreadable image, empty prompt or no answer: reject (exit 2, "
                        "naming file and row) or skip (logged, counted in metrics)")
    max_prompt_tokens: int = f(0, lo=0, hi=2**20,
                               doc="longer prompts are bad rows; 0: the longest of the first 32 rows")
    val_path: str | None = f(None, doc="validation prompts (eval.every), a file or folder like data.path in the same "
                             "columns; null: on the embedded task, held-out items it never trains on")


@dataclass
class RolloutConfig:
    prompts_per_iteration: int = f(8, lo=1, hi=65536, doc="P: prompts per iteration")
    samples_per_prompt: int = f(8, lo=1, hi=1024, doc="G: responses per prompt")
    max_new_tokens: int = f(8, lo=1, hi=65536, doc="response length cap")
    chunk_tokens: int = f(4, lo=1, hi=65536, doc="K: tokens per decode_chunk node")
    temperature: float = f(1.0, lo=0.0, hi=10.0, doc="sampling temperature (0 = greedy)")
    top_p: float = f(1.0, lo=0.0, hi=1.0, above=True, doc="nucleus sampling mass, in (0, 1]")
    max_turns: int = f(1, lo=1, hi=64, doc="turns per trajectory: after each, the sample's environment (env.name) "
                       "answers with text and images, until it says done; rollout.max_new_tokens is per turn; "
                       "1: single-turn")
    length_caps: dict | None = f(None, doc="for benchmarks of random-weight models, which never stop on their own: "
                                 "{mean: 96, sigma: 0.8} caps each sample of a prompt at a length drawn log-normal "
                                 "around mean tokens (at most max_new_tokens; `rollplex bench` draws from the same "
                                 "distribution), once per prompt from the seed; null: samples stop at EOS or "
                                 "max_new_tokens")


@dataclass
class EnvConfig:
    name: str | None = f(None, doc="the environment of a multi-turn run (rollout.max_turns > 1): a registered name "
                         "(zoom); null: zoom on the embedded zoom task")
    options: dict = f({}, doc="the environment's options, e.g. {view: 112} for zoom")
    timeout_s: float = f(30.0, lo=0.001, hi=86400.0, doc="an environment step slower than this ends its sample's "
                         "trajectory (recorded as env_timeout), not the run")


@dataclass
class TrainConfig:
    lr: float = f(1e-3, lo=0.0, hi=1.0, doc="AdamW learning rate")
    betas: list = f([0.9, 0.999], doc="AdamW betas")
    eps: float = f(1e-8, lo=0.0, hi=1.0, doc="AdamW epsilon")
    weight_decay: float = f(0.0, lo=0.0, hi=1.0, doc="AdamW decoupled weight decay")
    grad_clip: float = f(1.0, lo=0.0, hi=1e6, doc="max gradient norm; 0 disables clipping")
    micro_batch_groups: int = f(2, lo=1, hi=65536, doc="prompt groups per loss/backward node")
    prompts_per_node: int = f(0, lo=0, hi=65536, doc="prompts per vit_encode/prefix/suffix_score node (one batched "
                              "forward); 0 = auto: enough prompts that a node's work outweighs its dispatch")
    zero_stage: int = f(2, lo=0, hi=3, doc="DeepSpeed ZeRO stage")
    prefix_sharing: bool = f(True, doc="score the prompt prefix once per group (else full sequences)")
    stage_fusion: bool = f(True, doc="rollplex schedule: frozen models score the samples each decode chunk "
                           "finished while decode goes on (each data-parallel rank its own; vLLM hands an "
                           "n-sample request's samples on together, torch-graph each as it finishes)")
    train_fusion: bool = f(False, doc="with stage fusion, the policy also trains on each chunk's finished groups "
                           "in the decode window, micro_batch_groups at a time, its gradient normalised at "
                           "the step (needs engines.train: "
                           "torch and a per-group algorithm; otherwise the graph trains after decode)")
    fusion_batch_tokens: int = f(0, lo=0, hi=2**31, doc="with train fusion, the most tokens (prompts plus responses) "
                                 "one backward over a chunk's finished groups holds: groups past it start another "
                                 "backward (a group over it trains alone), so the chunk where the longest groups "
                                 "finish together does not hold all their graphs at once; 0 = train.micro_batch_tokens's "
                                 "(0 there too: only micro_batch_groups bounds a backward)")
    micro_batch_tokens: int = f(0, lo=0, hi=2**31, doc="training after decode (serial, or rollplex without "
                                "train fusion): a micro-batch's groups train in backwards of at most this many "
                                "tokens (prompts plus responses; a group over it trains alone), cut once the "
                                "responses are known, as verl's dynamic batch size; the policy's forwards with "
                                "grad run in the loss node. Caps train fusion's backwards too unless "
                                "train.fusion_batch_tokens is set. 0 = one backward per micro-batch")
    window_chunks: int = f(0, lo=0, hi=65536, doc="with stage fusion and no train fusion, the decode chunks from this "
                           "one on are scored by one node after the last chunk (one forward instead of one per "
                           "chunk, for the chunks that end after the decode window); 0 = one node per chunk")
    grad_prefix_lookahead: int = f(0, lo=0, hi=65536, doc="the policy's prefix forward of micro-batch m waits for the "
                                   "loss of micro-batch m - N, so at most N micro-batches of its graphs are "
                                   "held beside the one training; 0 = no bound (all may run in the decode window)")
    ref_cache_gib: float = f(1.0, lo=0.0, hi=2**20, doc="host memory for frozen models' prefixes, reused across "
                             "epochs (0 disables)")
    mini_batches: int = f(1, lo=1, hi=65536, doc="M: the iteration's prompt groups split into M mini-batches, one "
                          "optimizer step each (verl ppo_mini_batch_size, TRL steps_per_generation); each later "
                          "mini-batch is scored anew under the updated weights against the rollout-time old_logprobs")
    epochs: int = f(1, lo=1, hi=1024, doc="E: passes over the mini-batches per iteration, M × E optimizer steps in "
                    "all (verl ppo_epochs, TRL num_iterations)")
    clip_ratio_c: float | None = f(None, lo=1.0, hi=1e6, doc="dual clip (verl clip_ratio_c, e.g. 3): the policy "
                                   "loss of a negative-advantage token is at most c·|A| however far its ratio "
                                   "grows; for the algorithms whose loss takes clip_ratio_c (grpo, dapo, ppo, "
                                   "reinforce_pp); null: off")
    rollout_is: dict = f({}, doc="{cap: C}: truncated importance sampling for the decode engine's mismatch (verl "
                         "rollout_is): the policy loss's policy-gradient term weighted per token by "
                         "min(π_old/π_rollout, C), C ≥ 1, π_rollout the decode engine's log-probs (the loss reads "
                         "rollout_is_weights); {}: off")
    lora: dict | None = f(None, doc="LoRA adapters on the policy's language model (peft): {rank: 8, alpha: 16, "
                          "dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                          "down_proj]}, missing keys take these values (add lm_head where the head is untrained, as in the "
                          "embedded model); the reference is the base model with the adapters off (no second "
                          "copy); null: full fine-tuning")
    gradient_checkpointing: bool = f(False, doc="recompute each decoder layer's activations in the backward "
                                     "instead of keeping them (verl's enable_gradient_checkpointing): a training "
                                     "forward of the language model (prefix, suffix, full sequence) holds each "
                                     "layer's input only, for about a third more layer compute; a vision tower that "
                                     "trains keeps its activations")
    freeze_vision: bool = f(True, doc="keep every vision-tower (*visual*) weight frozen, as EasyR1's "
                            "freeze_vision_tower; false: the policy's vision tower trains too (its vision forward "
                            "keeps a graph per micro-batch; the reference keeps its own frozen one)")


@dataclass
class WarmupConfig:
    steps: int | None = f(None, lo=0, hi=10**9, doc="supervised answer-format steps toward random valid answers "
                          "before RL, whose result becomes the reference (0 disables); null: 40 on the embedded "
                          "task (README), 100 on the zoom task, 0 on data.path")
    batch_size: int = f(32, lo=1, hi=65536, doc="warm-up examples per step")
    lr: float = f(2e-3, lo=0.0, hi=1.0, doc="warm-up learning rate")


@dataclass
class EvalConfig:
    every: int = f(0, lo=0, hi=10**9, doc="validate after every N-th RL iteration and after the last (0: never): decode "
                   "and reward only, on the current policy, no update")
    before_train: bool = f(False, doc="also validate the policy RL starts from (after any warm-up)")
    prompts: int = f(32, lo=0, hi=2**24, doc="validation prompts: the first N rows of data.val_path (0: all of them), or "
                     "N held-out items of the embedded task (items task.size.. the training loader never visits)")
    samples: int = f(1, lo=1, hi=1024, doc="responses per validation prompt; pass@k is logged for k = 1 and k = "
                     "this (the unbiased estimator)")
    temperature: float = f(0.0, lo=0.0, hi=10.0, doc="validation sampling temperature (0 = greedy; above 0 it "
                           "samples with rollout.top_p)")
    pass_reward: float = f(1.0, lo=-1e9, hi=1e9,
                           doc="a response passes (for pass@k) when its reward is at least this")


@dataclass
class LoggingConfig:
    backends: list = f(["jsonl"], doc="where metrics go: jsonl (metrics.jsonl, always on: the record), "
                       "tensorboard (event files in RUN_DIR/tensorboard), wandb (when installed; honours "
                       "WANDB_MODE, WANDB_DIR, WANDB_ENTITY)")
    wandb_project: str = f("rollplex", doc="the W&B project a run logs to")


@dataclass
class EnginesConfig:
    decode: str = f("auto", doc="decode engine: vllm | hf | torch-graph | auto (on the CPU vllm when installed "
                    "and one worker, else hf; on CUDA or with cluster.tp_rollout, torch-graph)")
    train: str = f("auto", doc="train engine: deepspeed | torch | auto (deepspeed when installed)")
    score: str = f("transformers", doc="engine for frozen models (reference, vision tower)")
    overrides: dict = f({}, doc="per-node-kind engine, e.g. {decode_chunk: hf}")
    decode_options: dict = f({}, doc="extra options for the decode engine")
    train_options: dict = f({}, doc="extra options for the train engine")
    weight_sharing: str = f("auto", choices=("auto", "off"), doc="auto: the decode engine runs on the trainer's "
                            "weights (views, no second copy) where the engines allow; off: a copy synced each step")


@dataclass
class ClusterConfig:
    scheduler: str | None = f(None, doc="address of an existing Dask scheduler; null starts a LocalCluster")
    workers: int = f(1, lo=1, hi=4096, doc="data-parallel ranks, one Dask worker (GPU) each; a LocalCluster "
                     "starts this many, an external cluster must have this many (docs/distributed.md)")
    tp_rollout: int = f(1, lo=1, hi=64, doc="ranks per tensor-parallel decode engine (torch-graph): each group of "
                        "this many consecutive workers decodes its prompts together, one share of the heads per "
                        "rank; it divides cluster.workers")
    threads: int = f(1, lo=1, hi=256, doc="torch/OMP threads per stream thread; streams × threads ≤ cores")
    processes: bool | str = f("auto", choices=("auto", True, False),
                              doc="LocalCluster workers in processes of their own; auto: one CPU worker shares "
                                  "the driver's process (a second process would import the same stack again "
                                  "for nothing a CPU run needs), GPUs and data-parallel ranks get their own")
    lowering: str = f("auto", choices=("auto", "nodes", "iteration"),
                      doc="what a Dask task is: nodes (one task per node, Dask's scheduler between every two), "
                          "iteration (one task per iteration on its worker, whose streams run the nodes); auto: "
                          "iteration with one worker, nodes with data-parallel ranks")
    dashboard: bool = f(False, doc="serve the Dask dashboard")
    memory_budget_gib: float | None = f(None, lo=0.0, hi=2**20, doc="memory per device the engines may hold; checked "
                                        "before they start (null: no check)")
    sm_partitions: bool = f(False, doc="rollplex schedule on CUDA: while decode and compute-stream work run "
                            "together each gets its own SMs (green contexts), the split re-chosen per decode "
                            "chunk from the live batch; false: plain streams, which were as fast or faster on "
                            "an H200 (BENCHMARKS.md runs 23 and 34)")
    compute_sms: int = f(0, lo=0, hi=4096, doc="with sm_partitions: the SMs compute-stream work keeps while decode "
                         "runs (0: the GPU's less decode's); set, decode keeps the whole GPU and only compute is "
                         "fenced in")
    cuda_allocator: str = f("native", choices=("native", "async"), doc="CUDA memory: native (torch's caching "
                            "allocator, blocks cached per stream) or async (cudaMallocAsync, one stream-ordered "
                            "pool for every stream); chosen before torch loads, through PYTORCH_CUDA_ALLOC_CONF")
    switch_interval_us: int = f(0, lo=0, hi=1_000_000, doc="Python's thread switch interval in the worker's "
                                "process, µs (0: Python's 5,000): how long eager work on a compute stream may "
                                "hold the GIL that the decode stream's thread wants after each graph launch")
    memory_plan: bool = f(False, doc="plan residency so each device fits memory_budget_gib: what the engines "
                          "can move (optimizer state, frozen weights, device values) leaves between its uses")
    tls_ca_file: str | None = f(None, doc="CA bundle for TLS to a tls:// scheduler (with tls_cert and tls_key)")
    tls_cert: str | None = f(None, doc="this client's TLS certificate (PEM)")
    tls_key: str | None = f(None, doc="this client's TLS private key (PEM)")


@dataclass
class CheckpointConfig:
    every: int = f(25, lo=0, hi=10**9, doc="iterations between checkpoints (0: only the last)")
    keep_last: int = f(2, lo=1, hi=10**6, doc="checkpoints kept besides the best")


@dataclass
class RunConfig:
    seed: int = f(0, lo=0, hi=2**31 - 1, doc="run seed: data order, sampling, init")
    iterations: int = f(300, lo=0, hi=10**9, doc="RL iterations (at most; see stop_at_reward)")
    schedule: str = f("rollplex", choices=("serial", "rollplex", "auto"),
                      doc="iteration schedule policy; auto: alternate rollplex and serial first (and, with "
                          "train.train_fusion, rollplex with the training after decode), then keep the fastest "
                          "(the update is the same under each); one that runs out of device memory is dropped "
                          "and the run rolls back to its last checkpoint")
    schedule_trials: int = f(3, lo=1, hi=1000, doc="schedule auto: timed iterations per schedule before keeping "
                                                   "the fastest median (each one's first iteration is not counted)")
    algorithm: str = f("grpo", doc="a dags/ name (grpo) or a path to a DAG .py file")
    params: dict = f({}, doc="algorithm hyperparameter overrides, e.g. {kl_coef: 0.0}")
    stop_at_reward: float | str | None = f("auto", lo=0.0, hi=1.0,
                                           doc="stop once the mean reward of the last 10 iterations reaches this "
                                               "(null: never); auto: 0.9 on the embedded task, never on data.path")
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(known)}"


def check_type(path: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        if len(inner) == 1:
            return check_type(path, value, inner[0])
        for option in inner:  # e.g. bool | str: the first type the value has
            try:
                return check_type(path, value, option)
            except ConfigError:
                if isinstance(value, option) and not isinstance(value, bool):
                    raise  # of the right type, but not a value it takes (nan, an empty string)
        names = " or ".join(getattr(o, "__name__", str(o)) for o in inner)
        raise ConfigError(f"{path}: expected {names}, got {type(value).__name__} {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise ConfigError(f"{path}: an integer this large does not fit a float") from None
            if math.isnan(number):
                raise ConfigError(f"{path}: expected a number, got nan")
            return number
    elif annotation is str:
        if isinstance(value, str):
            if not value.strip():  # else `model.path: ""` ran the embedded model, as if null were meant
                raise ConfigError(f"{path}: is empty; give a value (or null where the field takes one)")
            return value
    elif annotation is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    elif annotation is dict:
        if isinstance(value, dict):
            return dict(value)
    else:  # pragma: no cover - every field above uses one of these types
        return value
    expected = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(f"{path}: expected {expected}, got {type(value).__name__} {value!r}")


def build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {fl.name: fl for fl in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            shown = f"{prefix}{key}"
            shown = shown if shown.isprintable() else repr(shown)  # one line, whatever the key holds
            raise ConfigError(f"unknown field {shown}{did_you_mean(str(key), list(fields))}")
    kwargs = {}
    for name, fl in fields.items():
        path = f"{prefix}{name}"
        if name not in data:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build(hint, data[name] if data[name] is not None else {}, path + ".")
            continue
        value = check_type(path, data[name], hint)
        meta = fl.metadata
        if value is not None and meta.get("choices") and value not in meta["choices"]:
            shown = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in meta["choices"])
            raise ConfigError(f"{path}: {value!r} is not one of {shown}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if meta.get("above") and value <= meta["lo"]:
                raise ConfigError(f"{path}: {value} is not above {meta['lo']}")
            if meta.get("lo") is not None and value < meta["lo"]:
                raise ConfigError(f"{path}: {value} is below the minimum {meta['lo']}")
            if meta.get("hi") is not None and value > meta["hi"]:
                raise ConfigError(f"{path}: {value} is above the maximum {meta['hi']}")
        kwargs[name] = value
    return cls(**kwargs)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def describe_fields(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default as YAML, description) for every field, for `rollplex train --help-config`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for fl in dataclasses.fields(cls):
        hint = hints[fl.name]
        if dataclasses.is_dataclass(hint):
            rows += describe_fields(hint, f"{prefix}{fl.name}.")
            continue
        default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()
        shown = yaml.dump(default, Dumper=Dumper, default_flow_style=True, width=10**6).strip().removesuffix("...")
        kind = _type_name(hint)
        if fl.metadata.get("choices"):
            kind = " | ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in fl.metadata["choices"])
        elif default == "auto":  # a number or the word auto (stop_at_reward)
            kind = kind.replace("str", "auto")
        rows.append((f"{prefix}{fl.name}", kind, shown.strip(), fl.metadata.get("doc", "")))
    return rows


def format_fields() -> str:
    """Every field as `path  type  default  meaning`, one per line: what `--help-config` prints."""
    rows = describe_fields()
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    head = ("field", "type", "default", "meaning")
    lines = ["  ".join(c.ljust(w) for c, w in zip(head[:3], widths)) + "  " + head[3]]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    return "\n".join(lines) + "\n"
