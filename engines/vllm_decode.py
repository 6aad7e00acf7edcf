"""vLLM decode engine: in-process ``LLMEngine`` fed with precomputed vision embeddings.

Traps handled here (see shared/STACK.md):
- vLLM expands each ``<|image_pad|>`` itself from ``image_grid_thw``, so the HF-expanded prompt ids
  are collapsed back to one pad per image before they are handed over.
- The ``LLM`` object is not thread-safe: every call into it holds ``self._lock``.
- Weights are replaced with ``reload_weights`` (in place, HF names); the prefix cache is then reset,
  because cached KV blocks were computed with the old weights.
- ``vllm`` is imported inside the constructor, so ``import rollplex.engines`` stays fast.
- Multi-turn: a request that ``continues`` a finished sample is a new request over the whole
  context, all its images' embeddings attached; the prefix cache holds the earlier turns' KV (the
  finished sample's blocks), so only the tokens past its last full block are prefilled again. Its
  ``num_cached_tokens`` is reported as ``FinishedSequence.cached_tokens``.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence

import torch

from rollplex.engines.base import (
    DecodeEngine,
    DecodeRequest,
    EngineContext,
    EngineSpec,
    FinishedSequence,
    Option,
    register_engine,
)
from rollplex.engines.torch_decode import eos_token_ids
from rollplex.errors import EngineError

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def collapse_pads(ids: Sequence[int], pad_ids: Iterable[int]) -> tuple[list[int], dict[int, int]]:
    """Collapse each run of one vision pad token to a single pad; also count the runs per pad id."""
    pads = set(pad_ids)
    out: list[int] = []
    runs: dict[int, int] = {p: 0 for p in pads}
    prev = None
    for t in ids:
        if t in pads:
            if t == prev:
                continue
            runs[t] += 1
        out.append(t)
        prev = t
    return out, runs


class VLLMDecodeEngine(DecodeEngine):
    """Options: max_model_len, max_num_seqs, kv_cache_bytes, enforce_eager (True), limit_images (1),
    limit_videos (0), enable_prefix_caching (True), vllm_kwargs (passed to ``LLM`` unchanged, once
    checked: ``_engine_args``),
    share_model (a colocated trainer's HF module: vLLM then runs on its storage, see ``_share``)."""

    def __init__(self, ctx: EngineContext) -> None:
        from vllm import LLM

        opts = dict(ctx.options)
        if ctx.dtype not in _DTYPE_NAMES:
            raise EngineError(f"engine 'vllm': dtype {ctx.dtype} is not one of {sorted(_DTYPE_NAMES.values())}")
        kwargs = dict(
            model=str(ctx.model_path),
            enable_mm_embeds=True,  # we hand over vit_encode's output, not pixels
            limit_mm_per_prompt={"image": int(opts.get("limit_images", 1)), "video": int(opts.get("limit_videos", 0))},
            dtype=_DTYPE_NAMES[ctx.dtype],
            seed=ctx.seed,
            enforce_eager=bool(opts.get("enforce_eager", True)),  # skips graph capture: 4 s vs 30 s to start
            enable_prefix_caching=bool(opts.get("enable_prefix_caching", True)),  # G samples share a prefill
            # vLLM's default reports log-probs of the raw logits (temperature 1, no top-p), whatever the
            # request's temperature. "processed_logprobs" reports log_softmax of the logits after
            # temperature and top-p, i.e. the distribution the token was actually drawn from, which is
            # what the torch engine reports and what importance ratios need. Greedy requests get the
            # log_softmax of the raw logits in both engines (vLLM applies their top_p only when they
            # share a batch with sampled requests; leave top_p at 1 for greedy requests).
            logprobs_mode="processed_logprobs",
        )
        for opt, arg in (("max_model_len", "max_model_len"), ("max_num_seqs", "max_num_seqs"),
                         ("kv_cache_bytes", "kv_cache_memory_bytes")):
            if opts.get(opt) is not None:
                kwargs[arg] = int(opts[opt])
        if torch.device(ctx.device).type == "cpu":
            kwargs.update(_whole_prefills())
        kwargs.update(opts.get("vllm_kwargs", {}))
        if torch.device(ctx.device).type == "cpu":
            _rank_tokens_eagerly()
        # vLLM adopts this process's group; one of its own would listen on every interface.
        from rollplex.runtime import init_local_group

        init_local_group(torch.device(ctx.device).type)
        self._lock = threading.Lock()
        with self._lock:
            self.llm = LLM(**kwargs)
            self._engine = self.llm.llm_engine
            hf = self._engine.model_config.hf_config
        self.image_token_id = int(hf.image_token_id)
        self.video_token_id = int(hf.video_token_id)
        self.eos_token_ids = eos_token_ids(ctx.model_path, hf)
        self._live: set[str] = set()
        self.shared = None  # engines.sharing.SharedWeights when running on a trainer's storage
        if opts.get("share_model") is not None:
            self._share(opts["share_model"], ctx.dtype)

    def _share(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        """Point every vLLM weight at the trainer's storage (in-process vLLM only).

        On CPU vLLM packs each linear weight for oneDNN/sgl at load time and drops the parameter, so
        the packed copy, not the parameter, is what runs. Sharing therefore sets the layer's weight
        (and bias) to the trainer's tensor and its GEMM to ``F.linear`` on that weight, and the packed
        copy is freed. Fused tensors (qkv_proj, gate_up_proj) are views when the trainer allocated the
        group as one buffer (``sharing.fuse_parameters``), else copies that ``load_weights`` refreshes.
        The vocabulary is vLLM's padded size; the trainer's unpadded tensor serves it, since no
        token id reaches the padding rows and logits are cut to the real vocabulary."""
        import torch.nn.functional as F

        from rollplex.engines.sharing import SharedWeights, layouts_for_module

        with self._lock:
            workers = self.llm.collective_rpc(lambda worker: worker.model_runner.model)
            if len(workers) != 1 or not isinstance(workers[0], torch.nn.Module):
                raise EngineError("engine 'vllm': weight sharing needs in-process vLLM with one worker "
                                  "(VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_parallel_size 1)")
            model = workers[0]
            shared = SharedWeights(module, layouts_for_module(module), fused=True, dtype=dtype)
            modules = dict(model.named_modules())
            for name, st in shared.tensors.items():
                vname = name if name.startswith("visual.") else (
                    "language_model." + name if name.startswith("lm_head.") else "language_model.model." + name)
                path, attr = vname.rsplit(".", 1)
                layer = modules.get(path)
                if layer is None or not hasattr(layer, attr):
                    raise EngineError(f"engine 'vllm': weight sharing found no vLLM tensor {vname!r} for {name!r}")
                old = getattr(layer, attr)
                if old.numel() and old.shape[1:] != st.tensor.shape[1:]:
                    raise EngineError(f"engine 'vllm': {vname} has shape {tuple(old.shape)}, the trainer's "
                                      f"{name} {tuple(st.tensor.shape)}")
                setattr(layer, attr, torch.nn.Parameter(st.tensor, requires_grad=False))
                if hasattr(layer, "cpu_linear"):  # the packed copy goes; the shared weight runs
                    layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)
            self.shared = shared

    # ----------------------------------------------------------------------------------------------
    def _prompt(self, req: DecodeRequest) -> dict:
        ids, runs = collapse_pads(req.prompt_token_ids, (self.image_token_id, self.video_token_id))
        if runs[self.video_token_id]:
            raise EngineError(f"request {req.request_id}: video prompts are not supported by the vllm engine "
                              "(DecodeRequest carries no video embeddings)")
        n_images = runs[self.image_token_id]
        if not n_images:
            if req.image_embeds is not None:
                raise EngineError(f"request {req.request_id}: image_embeds given but the prompt has no image pad")
            return {"prompt_token_ids": ids}
        if req.image_embeds is None or req.image_grid_thw is None:
            raise EngineError(f"request {req.request_id}: prompt has {n_images} image(s) but image_embeds or "
                              "image_grid_thw is missing")
        n_pads = sum(1 for t in req.prompt_token_ids if t == self.image_token_id)
        if n_pads != req.image_embeds.shape[0]:
            raise EngineError(f"request {req.request_id}: {n_pads} image pad tokens but image_embeds has "
                              f"{req.image_embeds.shape[0]} rows")
        grid = req.image_grid_thw.reshape(-1, 3)  # vLLM wants [n_images, 3], never [3]
        if grid.shape[0] != n_images:
            raise EngineError(f"request {req.request_id}: {n_images} runs of image pads but image_grid_thw "
                              f"describes {grid.shape[0]} image(s)")
        # vLLM hashes the embeddings for its caches, on the host
        mm = {"image": {"image_embeds": req.image_embeds.detach().cpu(), "image_grid_thw": grid.cpu()}}
        return {"prompt_token_ids": ids, "multi_modal_data": mm}

    def _params(self, req: DecodeRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=req.n,  # one prompt, processed once; vLLM seeds sample i with seed + i
            max_tokens=req.max_tokens,
            temperature=req.temperature,  # 0 means greedy, as in the torch engine
            top_p=req.top_p,
            seed=req.seed,  # a per-request generator: reproducible whatever else is in the batch
            logprobs=0,  # only the sampled token's log-prob
            flat_logprobs=True,
            stop_token_ids=sorted(set(req.stop_token_ids) | set(self.eos_token_ids)),
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,  # we only read finished sequences
        )

    def add_requests(self, requests: Sequence[DecodeRequest]) -> None:
        prepared = [(r.request_id, self._prompt(r), self._params(r)) for r in requests]
        with self._lock:
            for rid, prompt, params in prepared:
                if rid in self._live:
                    raise EngineError(f"request {rid}: a live request has this id already")
                self._engine.add_request(rid, prompt, params)
                self._live.add(rid)

    def step(self, max_tokens: int) -> list[FinishedSequence]:
        done: list[FinishedSequence] = []
        with self._lock:
            for _ in range(max_tokens):
                if not self._engine.has_unfinished_requests():
                    break
                for out in self._engine.step():
                    if out.finished:
                        self._live.discard(out.request_id)
                        done.extend(_finished(out))
        return done

    def has_unfinished(self) -> bool:
        with self._lock:
            return self._engine.has_unfinished_requests()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """With shared weights the trainer's update is here already: only rebuilt tensors are copied,
        and of ``named_tensors`` only those no shared tensor covers are loaded (LoRA's targets, merged:
        their layers are renamed in the trainer, so vLLM keeps its own copy of them). The caches
        computed with the old weights are dropped."""
        covered = self.shared.covered if self.shared is not None else set()
        weights = [(n, t) for n, t in named_tensors if n not in covered]
        with self._lock:
            if self._engine.has_unfinished_requests():
                raise EngineError(f"engine 'vllm': load_weights while {len(self._live)} request(s) are live; "
                                  "finish or drop them first")
            if self.shared is not None:
                self.shared.refresh()
            if weights:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            # The worker's reload drops its own encoder and multimodal caches but not the scheduler's
            # or the renderer's records of them; left alone, the next request with an image seen
            # before fails with "Encoder cache miss". Reset all three layers together, while idle.
            self._engine.reset_encoder_cache()
            self._engine.reset_mm_cache()
            self._engine.reset_prefix_cache()  # its KV blocks came from the old weights

    def close(self) -> None:
        with self._lock:
            self.llm = self._engine = None


def _whole_prefills() -> dict:
    """No chunked prefill on CPU. A request whose prompt is cut over two steps has the token sampled
    at the first one discarded, and vLLM rewinds its seeded generator for that with
    ``Generator.set_offset``, which only CUDA's Philox generator has: on CPU every batch whose
    prompts outgrow one step's token budget (16 prompts × 8 samples of the embedded task) failed
    with "CPU Generator does not use offset". Whole prefills never discard a sample; vLLM then
    raises the step's budget to at least the longest prompt by itself."""
    return {"enable_chunked_prefill": False}


def _rank_tokens_eagerly() -> None:
    """vLLM ranks each sampled token within the vocabulary through a ``torch.compile``d count
    (inductor on CPU, compiled in every new process): the first decode step spent 1.8 s of 1.9 in
    that compile on 2 cores, for a rank this engine never reads. On CPU the same count runs eagerly
    (the compile spares GPU memory for large vocabularies, not time)."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = lambda x, values: (x >= values).sum(-1)


def _finished(out) -> list[FinishedSequence]:
    done = []
    # The prompt tokens the prefix cache served; for a request of one sample only (an n-sample
    # request's output reports one of its samples').
    cached = out.num_cached_tokens if len(out.outputs) == 1 else None
    for comp in out.outputs:  # the n samples of the request, once all have finished
        tokens = list(comp.token_ids)
        lps = comp.logprobs
        flat = getattr(lps, "logprobs", None)
        if flat is not None and len(flat) == len(tokens):  # FlatLogprobs with logprobs=0: one per position
            logprobs = [float(x) for x in flat]
        else:
            logprobs = [float(pos[t].logprob) for pos, t in zip(lps, tokens)]
        reason = comp.finish_reason if comp.finish_reason in ("stop", "length") else "stop"
        done.append(FinishedSequence(out.request_id, tokens, logprobs, reason, index=comp.index, cached_tokens=cached))
    return sorted(done, key=lambda f: f.index)


# Engine arguments the constructor sets from a field of its own, or that Rollplex depends on: given in
# vllm_kwargs they would override it in silence (a `logprobs_mode` of raw logits skews every ratio).
_SET_ELSEWHERE = {
    "model": "model.path", "dtype": "model.dtype", "seed": "seed",
    "max_model_len": "engines.decode_options.max_model_len", "max_num_seqs": "engines.decode_options.max_num_seqs",
    "kv_cache_memory_bytes": "engines.decode_options.kv_cache_bytes",
    "enforce_eager": "engines.decode_options.enforce_eager",
    "enable_prefix_caching": "engines.decode_options.enable_prefix_caching",
    "limit_mm_per_prompt": "engines.decode_options.limit_images and limit_videos",
}
_RESERVED = {"logprobs_mode": "the log-probs of the distribution sampled from (processed_logprobs), which "
                              "importance ratios need",
             "enable_mm_embeds": "image embeddings handed over from vit_encode"}


def _engine_args(kwargs: dict) -> str | None:
    """vllm_kwargs go to ``LLM`` as they are: each must name one of vLLM's engine arguments that
    Rollplex does not set itself, with a value the vLLM config field of its name takes."""
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(str(k) for k in kwargs if k not in known)
    if unknown:
        return f"vLLM has no engine argument {', '.join(map(repr, unknown))}"
    for key, value in kwargs.items():
        if key in _SET_ELSEWHERE:
            return f"{key}: set {_SET_ELSEWHERE[key]} instead (the engine passes it to vLLM)"
        if key in _RESERVED:
            return f"{key}: Rollplex sets it, to {_RESERVED[key]}"
        problem = _refused_by_vllm_config(key, value)
        if problem:
            return f"{key}: {problem}"
    return None


def _refused_by_vllm_config(key: str, value) -> str | None:
    """What vLLM says of ``value`` for its engine argument ``key``: the argument's own type (a
    kv_cache_dtype is one of a list) and the bounds of the config fields of its name (pydantic
    dataclasses: gpu_memory_utilization in (0, 1], say), checked here rather than as a traceback from
    inside the engine's construction. Speculative decoding's config repeats some names for its draft
    model and is left out."""
    import inspect
    from typing import Annotated

    import pydantic
    import vllm.config
    from vllm.engine.arg_utils import EngineArgs

    argument = next(f for f in dataclasses.fields(EngineArgs) if f.name == key)
    checks = [("EngineArgs", argument.type)]
    for name, cls in sorted(vars(vllm.config).items()):
        info = getattr(cls, "__pydantic_fields__", {}).get(key) if inspect.isclass(cls) else None
        if info is not None and name != "SpeculativeConfig":
            checks.append((name, Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation))
    for name, annotation in checks:
        try:
            pydantic.TypeAdapter(annotation).validate_python(value)
        except pydantic.ValidationError as exc:
            return f"vLLM's {name} refuses {value!r}: {exc.errors()[0]['msg']}"
        except Exception:  # noqa: BLE001 - a type pydantic cannot build alone (a string, a callable): vLLM's to check
            continue
    return None


SPEC = register_engine(EngineSpec(
    name="vllm",
    role="decode",
    factory=VLLMDecodeEngine,
    requires=("vllm",),
    description="vLLM in-process engine with precomputed image embeddings and in-place weight reload",
    options={"max_model_len": Option(int, 1, 2**20), "max_num_seqs": Option(int, 1, 2**20),
             "kv_cache_bytes": Option(int, 1, 2**50), "enforce_eager": Option(bool), "limit_images": Option(int, 0, 64),
             "limit_videos": Option(int, 0, 64), "enable_prefix_caching": Option(bool),
             "vllm_kwargs": Option(dict, check=_engine_args)},
))
