"""Multi-turn decode on vLLM that computes no earlier turn again: each sample is a resumable request.

vLLM 0.32's streaming input keeps a *resumable* request's KV blocks when it stops
(``WAITING_FOR_STREAMING_REQ``) and appends the next input to it: the scheduler keeps the tokens
it computed (the prompt and every sampled token but the last), extends the prompt with the new
tokens and their images (multimodal positions shifted past the session's tokens), and the worker
recomputes the M-RoPE positions over the whole sequence. Only the new tokens are prefilled: the
last sampled token and the environment's answer. A whole-context request through the prefix cache
instead computes again every token past the last full block of the earlier turns (up to 31 per
sample with the 32-token blocks CPU attention takes).

``AsyncLLM`` offers streaming input as an async generator of inputs; the in-process ``LLMEngine``
has no entry for it, so this module drives the same three parts (input processor, output
processor, engine core) the way ``AsyncLLM._add_streaming_input_request`` does. Traps:

- In process, the output processor and the scheduler hold the same ``prompt_token_ids`` list, and
  both extend it with a continuation's tokens: the scheduler gets a copy, else its prompt counts
  them twice and the request never leaves prefill.
- A turn's output is cumulative (the token and log-prob lists are not reset between inputs): each
  turn's tokens are those past what the session's earlier turns returned.
- The worker keeps a request's sampling generator across inputs: it is seeded again with the
  turn's seed, so a continuation samples as a fresh request with that seed would.
- A parked session holds its blocks and counts against ``max_num_seqs``. Its last turn is queued
  with a non-resumable request of its id (vLLM's end of a stream), so it ends when that turn stops;
  ``release`` aborts the session of a sample whose episode ended.
- n samples are n requests, sample i seeded with seed + i, as vLLM's own fan-out does.

What vLLM computes is counted, not inferred: the scheduler's ``schedule`` is wrapped to add up the
tokens it schedules per request. A turn's prompt tokens computed are its scheduled tokens less one
per sampled token after the first (each decode step computes the token sampled before it);
``FinishedSequence.cached_tokens`` is the context's length less those.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from rollplex.engines.base import DecodeRequest, FinishedSequence
from rollplex.engines.vllm_decode import collapse_pads
from rollplex.errors import EngineError


@dataclass
class _Turn:
    """A session's turn in flight."""

    internal: str  # the engine core's request id (the session's)
    request_id: str  # the DecodeRequest's
    index: int  # its sample
    n: int  # the request's samples, handed on together
    context: list[int]  # the ids the turn decodes on (HF-expanded), for the session's next turn
    keep: bool  # the session is parked after this turn
    returned: int  # tokens the session's earlier turns returned
    scheduled: int  # the scheduler's count for the session when the turn was queued


@dataclass
class _Parked:
    internal: str
    external: str
    held: list[int]  # the ids whose KV the session holds: its context and tokens but the last sampled
    returned: int


class Sessions:
    """The resumable requests of a ``VLLMDecodeEngine`` (its lock held by every caller)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        core = getattr(engine._engine.engine_core, "engine_core", None)
        if core is None or not hasattr(core, "scheduler"):
            raise EngineError("engine 'vllm': multi-turn decode continues a sample in vLLM's in-process engine core; "
                              "set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        self.scheduled: dict[str, int] = {}  # the open sessions' tokens scheduled so far, by internal id
        schedule = core.scheduler.schedule

        def counted(*args, **kwargs):
            out = schedule(*args, **kwargs)
            for rid, n in out.num_scheduled_tokens.items():
                if rid in self.scheduled:
                    self.scheduled[rid] += n
            return out

        core.scheduler.schedule = counted
        self.turns: dict[str, _Turn] = {}  # external id -> its turn in flight
        self.parked: dict[tuple[str, int], _Parked] = {}  # (request id, sample) -> its session
        self._children: dict[str, list[FinishedSequence]] = {}
        self._end_template = None

    # ----------------------------------------------------------------------------------------------
    def add(self, req: DecodeRequest) -> None:
        """Queue ``req`` (``keep_kv`` or ``continues``): a turn on the session it continues where one
        is parked and its ids extend the session's, else new sessions over the whole context."""
        parked = self.parked.pop(req.continues, None) if req.continues is not None else None
        if parked is not None and (req.n != 1 or req.prompt_token_ids[: len(parked.held)] != parked.held
                                   or len(req.prompt_token_ids) == len(parked.held)):
            self._end(parked)
            parked = None
        if parked is None:  # processed once, its samples copies (as vLLM's fan-out of n does)
            base = self._process(f"{req.request_id}#0", self.engine._prompt(req),
                                 self.engine._params(dataclasses.replace(req, n=1)), resumable=req.keep_kv)
            for i in range(req.n):
                external = f"{req.request_id}#{i}"
                sample = copy.copy(base)
                sample.sampling_params = base.sampling_params.clone()
                sample.sampling_params.seed = req.seed + i
                internal = self._enqueue(sample, external)
                self.scheduled[internal] = 0
                self.turns[external] = _Turn(internal, req.request_id, i, req.n, list(req.prompt_token_ids),
                                             req.keep_kv, 0, 0)
            return
        new = req.prompt_token_ids[len(parked.held):]
        pads = sum(t == self.engine.image_token_id for t in new)
        images = collapse_pads(new, (self.engine.image_token_id,))[1][self.engine.image_token_id]
        segment = dataclasses.replace(
            req, prompt_token_ids=new,
            image_embeds=req.image_embeds[req.image_embeds.shape[0] - pads:] if pads else None,
            image_grid_thw=req.image_grid_thw.reshape(-1, 3)[-images:] if images else None)
        self._enqueue(self._process(parked.external, self.engine._prompt(segment), self.engine._params(req),
                                    resumable=True), parked.external, parked.internal)
        if not req.keep_kv:  # its last turn: the session ends when it stops
            self._enqueue(self._end_of_stream(), parked.external, parked.internal)
        self._reseed(parked.internal, req.seed, req.temperature)
        self.turns[parked.external] = _Turn(parked.internal, req.request_id, 0, 1, list(req.prompt_token_ids),
                                            req.keep_kv, parked.returned, self.scheduled[parked.internal])

    def finished(self, out) -> list[FinishedSequence]:
        """A session's turn ended (``out``: its cumulative output); its requests' samples once all are in."""
        turn = self.turns.pop(out.request_id)
        comp = out.outputs[0]
        tokens = list(comp.token_ids)[turn.returned:]
        flat = getattr(comp.logprobs, "logprobs", None)
        logprobs = ([float(x) for x in flat[turn.returned:]] if flat is not None else
                    [float(pos[t].logprob) for pos, t in zip(list(comp.logprobs)[turn.returned:], tokens)])
        scheduled = self.scheduled[turn.internal] - turn.scheduled
        cached = len(turn.context) - (scheduled - max(len(tokens) - 1, 0))
        if turn.keep:
            self.parked[(turn.request_id, turn.index)] = _Parked(turn.internal, out.request_id,
                                                                 turn.context + tokens[:-1], turn.returned + len(tokens))
        else:
            self.scheduled.pop(turn.internal, None)
        reason = comp.finish_reason if comp.finish_reason in ("stop", "length") else "stop"
        seqs = self._children.setdefault(turn.request_id, [])
        seqs.append(FinishedSequence(turn.request_id, tokens, logprobs, reason, index=turn.index, cached_tokens=cached))
        if len(seqs) < turn.n:
            return []
        return sorted(self._children.pop(turn.request_id), key=lambda f: f.index)

    def release(self, keys=None) -> None:
        """End the parked sessions of ``keys`` ((request id, sample) pairs; None: all), freeing their KV."""
        for key in list(self.parked) if keys is None else keys:
            parked = self.parked.pop(key, None)
            if parked is not None:
                self._end(parked)

    # ----------------------------------------------------------------------------------------------
    def _process(self, external: str, prompt: dict, params, *, resumable: bool):
        llm = self.engine._engine
        return llm.input_processor.process_inputs(external, prompt, params, supported_tasks=llm.get_supported_tasks(),
                                                  resumable=resumable)

    def _enqueue(self, req, external: str, internal: str | None = None) -> str:
        """Hand ``req`` (an EngineCoreRequest) to the output processor and the engine core: a new request
        (``internal`` None: vLLM names it) or the next input of session ``internal``. Each part gets its
        own prompt and multimodal lists: in process, both extend theirs on a continuation."""
        llm = self.engine._engine
        req.request_id, req.external_req_id = internal or external, None
        if internal is None:
            llm.input_processor.assign_request_id(req)
        else:
            req.external_req_id = external
        req.prompt_token_ids = list(req.prompt_token_ids or ())
        req.mm_features = list(req.mm_features) if req.mm_features is not None else None
        llm.output_processor.add_request(req, None, None, 0)
        core = copy.copy(req)
        core.prompt_token_ids = list(req.prompt_token_ids)
        core.mm_features = list(req.mm_features) if req.mm_features is not None else None
        llm.engine_core.add_request(core)
        return req.request_id

    def _end_of_stream(self):
        """A non-resumable request: queued after a session's input, it ends the session when that stops."""
        if self._end_template is None:
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            self._end_template = self._process("end", {"prompt_token_ids": [0]},
                                               SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY,
                                                              detokenize=False), resumable=False)
        return copy.copy(self._end_template)

    def _end(self, parked: _Parked) -> None:
        """End a parked session now: abort it, which frees its blocks."""
        self.engine._engine.abort_request([parked.internal], internal=True)
        self.scheduled.pop(parked.internal, None)

    def _reseed(self, internal: str, seed: int, temperature: float) -> None:
        def reseed(worker) -> bool:
            state = worker.model_runner.requests.get(internal)
            if state is None:
                return False
            if temperature > 0:
                if state.generator is None:  # a greedy turn before: none was made
                    state.generator = torch.Generator(device=worker.model_runner.device)
                state.generator.manual_seed(seed)
            return True

        if not all(self.engine.llm.collective_rpc(reseed)):
            raise EngineError(f"engine 'vllm': the worker holds no state for session {internal}")
