"""What the rollout and scoring node kinds compute, on real tensors of a real transformers model (the
update part, rewards to the report, is ``tasks/updates.py``).

Every function here is ``fn(ctx, node, inputs) -> outputs`` (see ``tasks.registry``). ``ctx`` is the
worker's ``NodeContext``: the engines that host each model, the decode engine, the algorithm, the
tokenizer, the iteration's settings and ``ctx.values``, the records of the node's values (their role,
prompts, chunk, model: pipeline/compile/ir.py ``Value``), which say what each input and output is.
Functions never reach into Dask or the scheduler, and never read a value's name.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from rollplex.engines.base import DecodeRequest, FinishedSequence
from rollplex.errors import GraphError
from rollplex.engines import vlm
from rollplex.tasks.registry import register_task


@dataclass
class Responses:
    """The G sampled responses of one prompt, in sample order."""

    prompt_index: int
    sequences: list[FinishedSequence]

    @property
    def token_ids(self) -> list[list[int]]:
        return [s.token_ids for s in self.sequences]

    def mask(self) -> torch.Tensor:
        """[G, R]: 1 at the tokens the policy sampled. A multi-turn trajectory's environment tokens
        are 0 (gaps), so losses and their normalisers count the policy's tokens only."""
        mask = vlm.pad_responses(self.token_ids, 0)[1]
        for row, seq in enumerate(self.sequences):
            gaps = getattr(seq, "policy_mask", None)
            if gaps is not None:
                mask[row, : len(gaps)] = torch.tensor(gaps, dtype=mask.dtype)
        return mask

    @property
    def multi_turn(self) -> bool:
        return any(getattr(seq, "policy_mask", None) is not None for seq in self.sequences)


def sample_seed(run_seed: int, iteration: int, prompt_id: str) -> int:
    """A stable sampling seed per prompt and iteration (sample g draws with seed + g): independent
    of batch order, schedule and worker."""
    digest = hashlib.sha256(f"{run_seed}/{iteration}/{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFFFFFF


def lognormal_lengths(gen: torch.Generator, n: int, mean: float, sigma: float, most: int, least: int = 1) -> list[int]:
    """``n`` response lengths drawn log-normal around ``mean`` tokens (spread ``sigma``) from ``gen``,
    in [least, most]: the bench's long-tailed workload and ``rollout.length_caps``."""
    drawn = torch.exp(math.log(mean) + sigma * torch.randn(n, generator=gen))
    return [int(min(most, max(least, x))) for x in drawn.tolist()]


def length_caps(settings, prompt_id: str) -> list[int]:
    """rollout.length_caps: each of a prompt's samples capped at a log-normal length, in [1,
    max_new_tokens]; one draw per prompt and run seed, so a prompt brings the same workload to every
    iteration and every schedule that meets it."""
    digest = hashlib.sha256(f"{settings.seed}/length_caps/{prompt_id}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    caps = settings.length_caps
    return lognormal_lengths(gen, settings.samples, caps["mean"], caps["sigma"], settings.max_new_tokens)


def request_id(iteration: int, prompt: int) -> str:
    return f"it{iteration}-p{prompt}"


def with_role(ctx, names, role: str, **facts) -> list[str]:
    """Those of ``names`` (a node's inputs or outputs) whose record has ``role`` (and ``facts``)."""
    found = []
    for name in names:
        v = ctx.values[name]
        if v.role == role and all(getattr(v, k) == x for k, x in facts.items()):
            found.append(name)
    return found


def the(ctx, names, role: str, **facts) -> str | None:
    """The one of ``names`` with ``role`` (and ``facts``), or None."""
    found = with_role(ctx, names, role, **facts)
    if len(found) > 1:
        raise GraphError(f"{len(found)} values have role {role!r} {facts or ''} where one was expected: {found}")
    return found[0] if found else None


def by_prompt(ctx, names, role: str, **facts) -> dict[int, str]:
    """{prompt: name} of the per-prompt values among ``names`` with ``role``."""
    return {ctx.values[n].prompts[0]: n for n in with_role(ctx, names, role, **facts)}


def prompt_request(request_id: str, prompt, vis, settings, *, seed: int, n: int, temperature: float,
                   top_p: float) -> DecodeRequest:
    """A request for ``n`` samples of one prompt, its vision embeddings attached, capped and stopped
    as the run's ``settings`` say; sample g draws with ``seed + g``."""
    return DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt.input_ids.tolist(),
        image_embeds=vis.image,
        image_grid_thw=prompt.image_grid_thw,
        max_tokens=settings.max_new_tokens,
        seed=seed,
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=tuple(settings.stop_token_ids),
        n=n,
        video_embeds=vis.video,
        video_grid_thw=prompt.video_grid_thw,
        second_per_grid_ts=prompt.second_per_grid_ts,
    )


def sample_key(seq: FinishedSequence) -> tuple[str, int]:
    """(prompt's request id, sample) for a group request (n samples) or a per-sample one (id/g)."""
    parent, _, sample = seq.request_id.partition("/")
    return (parent, int(sample)) if sample else (parent, seq.index)


# --------------------------------------------------------------------------------------------------
@register_task("vit_encode")
def vit_encode(ctx, node, inputs):
    prompts = [inputs[v] for v in node.inputs]
    # grad: a vision tower that trains; the graph lives until the backward of the loss that reads it.
    visions = vlm.vision_embeds_batch(ctx.model(node.model), prompts, grad=bool(node.args.get("grad")))
    return dict(zip(node.outputs, visions))


@register_task("prefix")
def prefix(ctx, node, inputs):
    n = len(node.args["prompts"])
    prompts = [inputs[v] for v in node.inputs[:n]]
    visions = [inputs[v] for v in node.inputs[n:]]
    model = ctx.model(node.model)
    grad = bool(node.args["grad"])
    if ctx.refcache is not None and not grad and node.model in ctx.host.spec.frozen:
        # A frozen model's prefix is the same every epoch: computed once, then loaded.
        states = ctx.refcache.lookup_or_compute(
            node.model, prompts, visions, lambda ps, vs: vlm.prefix_forward_batch(model, ps, vs, grad=False),
            device=ctx.host.device)
    else:
        states = vlm.prefix_forward_batch(model, prompts, visions, grad=grad)
    return dict(zip(node.outputs, states))


@register_task("decode_chunk")
def decode_chunk(ctx, node, inputs):
    if "turn" in node.args:  # a multi-turn rollout's chunk
        from rollplex.tasks.turns import decode_turn_chunk

        return decode_turn_chunk(ctx, node, inputs)
    engine = ctx.decode_engine
    s = ctx.settings
    chunk, chunks = node.args["chunk"], node.args["chunks"]
    if chunk == 0:
        prompts = [inputs[v] for v in with_role(ctx, node.inputs, "prompt")]
        visions = [inputs[v] for v in with_role(ctx, node.inputs, "vision")]
        # One request per prompt with n = G samples: the prompt and its image embeddings are
        # processed once, and a group is handed on when all its samples are done. A prompt whose
        # meta caps each sample's length (the bench's long-tail workload), or any prompt of a run
        # with rollout.length_caps, gets one request per sample, seeded seed + g as sample g of the
        # group would be.
        requests = []
        # Request ids name prompts by their global index, so a rank's requests are the same as the
        # single-rank run's (a replayed or recorded rollout is keyed by them).
        global_index = node.args.get("prompts", range(len(prompts)))
        for p, (prompt, vis) in enumerate(zip(prompts, visions)):
            base = prompt_request(request_id(ctx.iteration, global_index[p]), prompt, vis, s,
                                  seed=sample_seed(s.seed, ctx.iteration, prompt.prompt_id), n=s.samples,
                                  temperature=s.temperature, top_p=s.top_p)
            caps = prompt.meta.get("max_tokens")
            if caps is None and s.length_caps is not None:
                caps = length_caps(s, prompt.prompt_id)
            if caps is None:
                requests.append(base)
                continue
            requests += [replace(base, request_id=f"{base.request_id}/{g}", max_tokens=int(cap), seed=base.seed + g, n=1)
                         for g, cap in enumerate(caps)]
        engine.add_requests(requests)
        finished: dict[tuple[str, int], FinishedSequence] = {}
        expected = sum(r.n for r in requests)
        handed: frozenset[int] = frozenset()
        handed_samples: frozenset[tuple[str, int]] = frozenset()
    else:
        previous = inputs[the(ctx, node.inputs, "decode_state")]
        finished, expected = dict(previous["finished"]), previous["expected"]
        handed = previous.get("handed", frozenset())
        handed_samples = previous.get("handed_samples", frozenset())
    for seq in engine.step(node.args["tokens"]):
        finished[sample_key(seq)] = seq
    num_prompts = expected // s.samples
    # A rank's decode (pipeline/compile/ranks.py) holds a slice of the batch: outputs by position, and the
    # prompts' global indices from args.
    index = node.args.get("prompts", range(num_prompts))
    # A tensor-parallel rank decodes its group's prompts and hands on only its own ("keep").
    keep = set(node.args.get("keep", index))
    kept = [p for p in range(num_prompts) if index[p] in keep]
    groups_out = the(ctx, node.outputs, "handoff")
    samples_out = the(ctx, node.outputs, "finished")
    fused = groups_out is not None

    def group(p: int) -> Responses | None:
        keys = [(request_id(ctx.iteration, index[p]), g) for g in range(s.samples)]
        return Responses(index[p], [finished[k] for k in keys]) if all(k in finished for k in keys) else None

    def new_samples() -> tuple[dict[int, dict[int, FinishedSequence]], set[tuple[str, int]]]:
        """{prompt: {sample: sequence}} finished since the last chunk (each handed on exactly once):
        frozen models score single samples, which need no group. Also their keys, now handed."""
        by_prompt: dict[int, dict[int, FinishedSequence]] = {}
        keys = set()
        for p in kept:
            for g in range(s.samples):
                key = (request_id(ctx.iteration, index[p]), g)
                if key in finished and key not in handed_samples:
                    by_prompt.setdefault(index[p], {})[g] = finished[key]
                    keys.add(key)
        return by_prompt, keys

    out: dict[str, Any] = {}
    if chunk < chunks - 1:
        if fused:  # stage fusion: groups whose every sample finished in this chunk go on now
            done = {p: r for p in kept if p not in handed and (r := group(p)) is not None}
            handed = handed | done.keys()
            out[groups_out] = {index[p]: r for p, r in done.items()}
        if samples_out is not None:
            out[samples_out], keys = new_samples()
            handed_samples = handed_samples | keys
        out[the(ctx, node.outputs, "decode_state")] = {"finished": finished, "expected": expected, "handed": handed,
                                                       "handed_samples": handed_samples}
        return out
    while len(finished) < expected and engine.has_unfinished():  # max_tokens bounds this loop
        for seq in engine.step(node.args["tokens"]):
            finished[sample_key(seq)] = seq
    if len(finished) != expected:
        raise RuntimeError(f"decode finished {len(finished)} of {expected} sequences")
    responses = {p: group(p) for p in kept}
    named = by_prompt(ctx, node.outputs, "responses")
    for p in kept:
        out[named[index[p]]] = responses[p]
    lengths = [len(q) for p in kept for q in responses[p].token_ids]
    # Per prompt too: a mini-batch's loss divides by its own tokens (or responses).
    counts = {index[p]: (sum(map(len, responses[p].token_ids)), len(responses[p].sequences)) for p in kept}
    out[the(ctx, node.outputs, "rollout_stats")] = {"tokens": sum(lengths), "sequences": len(lengths),
                                                    "max_len": max(lengths, default=0), "by_prompt": counts}
    if fused:
        out[groups_out] = {index[p]: responses[p] for p in kept if p not in handed}
    if samples_out is not None:
        out[samples_out] = new_samples()[0]
    return out


@register_task("suffix_score")
def suffix_score(ctx, node, inputs):
    if "turn" in node.args:  # stage fusion across turns: the samples one chunk ended a turn of
        from rollplex.tasks.turns import score_turn

        return score_turn(ctx, node, inputs)
    model = ctx.model(node.model)
    grad = bool(node.args["grad"])
    s = ctx.settings
    if "handoff_chunk" in node.args:  # stage fusion: the samples (or, under train fusion, the groups)
        kv_of = by_prompt(ctx, node.inputs, "kv")  # one decode chunk, or the last few, finished
        handoff: dict[int, dict[int, FinishedSequence]] = {}  # {prompt: {sample: FinishedSequence}}
        for chunk in (v for v in node.inputs if ctx.values[v].role in ("finished", "handoff")):
            for p, samples in inputs[chunk].items():
                handoff.setdefault(p, {}).update(dict(enumerate(samples.sequences)) if isinstance(samples, Responses)
                                                 else samples)
        ready = sorted(p for p in handoff if handoff[p])
        samples = {p: sorted(handoff[p]) for p in ready}
        scored: dict[int, dict[int, torch.Tensor]] = {}
        # As few forwards as the logits budget allows, each over every prompt with samples finished
        # in this chunk: eager scoring is host-bound, so one forward per prompt would cost the window
        # a launch sequence each. A sample's row is cut to its own length (join_samples pads back).
        tokens = [sum(len(handoff[p][g].token_ids) for g in samples[p]) for p in ready]
        for run in vlm.batches_within(tokens, model.config.get_text_config().vocab_size, grad=False):
            batch = [ready[i] for i in run]
            logprobs = vlm.suffix_logprobs_batch(model, [inputs[kv_of[p]] for p in batch],
                                                [[handoff[p][g].token_ids for g in samples[p]] for p in batch],
                                                pad_id=s.pad_id, temperature=s.score_temperature, grad=False)
            for p, (lp, _) in zip(batch, logprobs):
                scored[p] = {g: lp[row, : len(handoff[p][g].token_ids)].detach() for row, g in enumerate(samples[p])}
        return {node.outputs[0]: scored}
    n = len(node.args["prompts"])
    responses = [inputs[v].token_ids for v in node.inputs[-n:]]
    head = node.args.get("head", "lm")  # "value": the model's head is scalar, its outputs are values
    if inputs[node.inputs[-1]].multi_turn and not node.args.get("full_sequence"):
        from rollplex.tasks.turns import score_trajectories

        values = score_trajectories(ctx, model, [inputs[v] for v in node.inputs[:n]],
                                    [inputs[v] for v in node.inputs[-n:]], grad=grad, head=head)
    elif node.args.get("full_sequence") and inputs[node.inputs[-1]].multi_turn:
        from rollplex.tasks.turns import score_trajectories_unshared

        values = score_trajectories_unshared(ctx, model, [inputs[v] for v in node.inputs[:n]],
                                             [inputs[v] for v in node.inputs[n:2 * n]],
                                             [inputs[v] for v in node.inputs[-n:]], grad=grad, head=head)
    elif node.args.get("full_sequence"):
        prompts, visions = [inputs[v] for v in node.inputs[:n]], [inputs[v] for v in node.inputs[n:2 * n]]
        values = [vlm.full_sequence_logprobs(model, p, r, pad_id=s.pad_id, temperature=s.score_temperature,
                                            grad=grad, vis=v, head=head)[0]
                  for p, v, r in zip(prompts, visions, responses)]
    elif head == "value":
        states = [inputs[v] for v in node.inputs[:n]]
        values = [out.squeeze(-1) for out in vlm.suffix_logits_batch(model, states, responses, grad=grad)]
    else:
        states = [inputs[v] for v in node.inputs[:n]]
        values = [lp for lp, _ in vlm.suffix_logprobs_batch(model, states, responses, pad_id=s.pad_id,
                                                            temperature=s.score_temperature, grad=grad)]
    # Per prompt, the value itself (with its graph when grad) and/or its old_ copy: detached, on the host.
    out = {}
    for p, value in zip(node.args["prompts"], values):
        for name in (o for o in node.outputs if ctx.values[o].prompts == (p,)):
            if ctx.values[name].label == f"old_{node.args['as']}":
                out[name] = value.detach().cpu()
            else:
                out[name] = value if grad else value.detach()
    return out


@register_task("join")
def join(ctx, node, inputs):
    """Per-chunk values (stage and train fusion) under the per-prompt names the rest of the graph
    reads. With ``samples``, each chunk scored single samples: a prompt's rows come together into
    one [G, R] tensor, as an unfused node would have made it."""
    if node.args.get("episodes"):  # after a multi-turn rollout's last turn
        from rollplex.tasks.turns import join_episodes

        return join_episodes(ctx, node, inputs)
    samples = node.args.get("samples")
    merged: dict[int, Any] = {}
    for v in node.inputs:
        if samples is None:
            merged.update(inputs[v])
            continue
        for p, rows in inputs[v].items():
            merged.setdefault(p, {}).update(rows)
    missing = [p for p in node.args["prompts"]
               if p not in merged or (samples is not None and len(merged[p]) != samples)]
    if missing:
        raise RuntimeError(f"%{node.name}: no chunk scored prompts {missing}" if samples is None else
                           f"%{node.name}: prompts {missing} lack some of their {samples} samples' scores")
    if samples is not None:
        merged = {p: join_samples(rows) for p, rows in merged.items()}
    return {out: merged[p] for p, out in zip(node.args["prompts"], node.outputs)}


def join_samples(rows: dict[int, torch.Tensor], width: int | None = None) -> torch.Tensor:
    """{sample: [len]} -> [G, width] in sample order, right-padded with zeros (masked positions)."""
    ordered = [rows[g] for g in sorted(rows)]
    width = width if width is not None else max(1, max(len(r) for r in ordered))
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in ordered])
