"""What each builtin node kind computes, on real tensors of a real transformers model.

Every function here is ``fn(ctx, node, inputs) -> outputs`` (see ``tasks.registry``). ``ctx`` is the
worker's ``NodeContext``: the engines that host each model, the decode engine, the algorithm, the
tokenizer, the iteration's settings and ``ctx.values``, the records of the node's values (their role,
prompts, chunk, model: pipeline/compile/ir.py ``Value``), which say what each input and output is.
Functions never reach into Dask or the scheduler, and never read a value's name.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from rollplex.engines.base import DecodeRequest, FinishedSequence
from rollplex.errors import GraphError
from rollplex.engines import vlm
from rollplex.tasks import mismatch
from rollplex.tasks.registry import register_task
from rollplex.tasks.returns import advantage_tensor, loss_values, reward_value


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
        # meta caps each sample's length (benchmarks' long-tail workloads) gets one request per
        # sample, seeded seed + g as sample g of the group would be.
        requests = []
        # Request ids name prompts by their global index, so a rank's requests are the same as the
        # single-rank run's (a replayed or recorded rollout is keyed by them).
        global_index = node.args.get("prompts", range(len(prompts)))
        for p, (prompt, vis) in enumerate(zip(prompts, visions)):
            base = prompt_request(request_id(ctx.iteration, global_index[p]), prompt, vis, s,
                                  seed=sample_seed(s.seed, ctx.iteration, prompt.prompt_id), n=s.samples,
                                  temperature=s.temperature, top_p=s.top_p)
            caps = prompt.meta.get("max_tokens")
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


@register_task("reward")
def reward(ctx, node, inputs):
    prompt, responses = (inputs[v] for v in node.inputs)
    return {node.outputs[0]: group_rewards(ctx, prompt, responses)}


def group_rewards(ctx, prompt, responses: Responses) -> torch.Tensor:
    """[G]: the reward function on each decoded response of one prompt; a multi-turn trajectory's
    reward is its environment's (the sum of its steps' rewards)."""
    if responses.multi_turn:
        return torch.tensor([float(seq.reward) for seq in responses.sequences], dtype=torch.float32)
    texts = [ctx.decode_text(ids) for ids in responses.token_ids]
    return torch.tensor([reward_value(ctx.reward_fn, ctx.reward_fn(text, prompt.answer)) for text in texts],
                        dtype=torch.float32)


def group_advantages(ctx, values: dict[str, Any], width: int) -> torch.Tensor:
    """A group-scoped advantage function on one group's values: [G], or [G, R] cut to the group's
    own response width R."""
    decl = ctx.algorithm.advantage_fn
    adv = advantage_tensor(decl.fn, decl.call(values, ctx.params), (ctx.settings.samples,)).detach()
    return adv[..., :width] if adv.dim() == 2 else adv


def count_of(agg: str) -> str:
    """What a loss aggregation averages over: the batch's response tokens or its responses."""
    return "tokens" if agg == "token-mean" else "sequences"


def normaliser(stats: dict, count: str, prompts=None) -> int:
    """The batch's ``count`` (``count_of``) from its rollout stats, or that of ``prompts`` alone (a
    mini-batch), at least 1."""
    if prompts is None:
        return max(stats[count], 1)
    at = 0 if count == "tokens" else 1
    return max(sum(stats["by_prompt"][p][at] for p in prompts), 1)


def summed_loss(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """The loss summed over the batch's tokens (token-mean) or responses (the seq-mean modes): divided
    by ``normaliser`` it is the batch's mean, so micro-batches (or groups) add up."""
    if agg == "token-mean":
        return (per_token * mask).sum()
    per_seq = (per_token * mask).sum(-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    return per_seq.sum()


def loss_metrics(metrics: dict, mask: torch.Tensor) -> tuple[dict[str, float], dict[str, float]]:
    """Per-token metrics [B, R] summed over the mask (token means over the batch in report) and
    scalar metrics (means over micro-batches in report)."""
    sums = {k: float((v.detach() * mask).sum()) for k, v in metrics.items() if torch.is_tensor(v) and v.dim() == 2}
    return sums, {k: float(v) for k, v in metrics.items() if k not in sums}


def bound_values(inputs: dict[str, Any], binding: dict) -> dict[str, list]:
    """Each function parameter's value for each prompt group of the node (see compiler ``bind``)."""
    out = {}
    for param, pairs in binding.items():
        values = []
        for value_name, group in pairs:
            value = inputs[value_name]
            if group is not None:  # a batch-level value, indexed by prompt group
                value = value[group]
            values.append(value.mask() if param == "mask" else value)
        out[param] = values
    return out


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def join_groups(values: list, how: str) -> Any:
    """Tensors of several groups as one: ``cat`` along responses or ``stack`` per group; 2-D
    per-token tensors are right-padded to a common length first. Other values stay a list."""
    if not all(torch.is_tensor(v) for v in values):
        return values
    if values[0].dim() >= 2:
        width = max(v.shape[-1] for v in values)
        values = [_pad_to(v, width) for v in values]
    return torch.cat(values) if how == "cat" else torch.stack(values)


@register_task("custom")
def custom(ctx, node, inputs):
    decl = next(c for c in ctx.algorithm.custom if c.name == node.args["function"])
    values = bound_values(inputs, node.args["bind"])
    if decl.options["per"] == "prompt":
        args = {k: v[0] for k, v in values.items()}
    else:
        args = values
    return {node.outputs[0]: decl.call(args, ctx.params)}


@register_task("advantage")
def advantage(ctx, node, inputs):
    decl = ctx.algorithm.advantage_fn
    values = bound_values(inputs, node.args["bind"])
    # Per-response advantages are [G]; per-token ones [G, R] come back at each group's own width R
    # (batch-scope inputs are padded to the batch's longest response).
    widths = [r.mask().shape[-1] for r in values["responses"]]
    if decl.options["scope"] == "group":
        return {node.outputs[0]: group_advantages(ctx, {k: v[0] for k, v in values.items()}, widths[0])}
    adv = advantage_tensor(decl.fn, decl.call({k: join_groups(v, "stack") for k, v in values.items()}, ctx.params),
                           (len(node.args["prompts"]), ctx.settings.samples))
    return {node.outputs[0]: {p: (adv[i][..., : widths[i]] if adv.dim() == 3 else adv[i]).detach().float()
                              for i, p in enumerate(node.args["prompts"])}}


@register_task("loss")
def loss(ctx, node, inputs):
    """The micro-batch's loss, normalised to the whole batch, then its backward.

    token-mean divides by the batch's total response tokens, the seq-mean modes by its number of
    responses, so the M micro-batch backwards add up to exactly the full-batch gradient.
    """
    if "handoff_chunk" in node.args:  # train fusion: the groups one decode chunk finished
        from rollplex.tasks.fused_train import train_handoff

        return train_handoff(ctx, node, inputs)
    decl, engine = ctx.algorithm.losses()[node.model], ctx.train_engine(node.model)
    stats = inputs[the(ctx, node.inputs, "rollout_stats")]
    bound = bound_values(inputs, node.args["bind"])
    bound.pop("rollout_is_weights", None)  # bound to the responses; computed below
    values = {k: join_groups(v, "cat") for k, v in bound.items()}
    values["mask"] = join_groups([r.mask() for r in bound["responses"]], "cat")
    values = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in values.items()}
    mask = values["mask"]
    weighted = "rollout_is_weights" in decl.reads
    if weighted:
        old = values[f"old_{ctx.algorithm.policy_logprobs()}"]
        values["rollout_is_weights"] = mismatch.rollout_is_weights(ctx.settings.rollout_is_cap, old, bound["responses"])
    per_token, metrics = loss_values(decl.fn, decl.call(values, ctx.params), mask)
    if weighted and ctx.settings.rollout_is_cap is not None:
        metrics = {**metrics, "rollout_is_weight": values["rollout_is_weights"]}
    agg = decl.options["agg"]
    contribution = summed_loss(per_token, mask, agg) / normaliser(stats, count_of(agg), node.args.get("normalise"))
    if not torch.isfinite(contribution):
        raise FloatingPointError(f"non-finite loss {contribution.item()} in micro-batch {node.name}")
    # With R data-parallel ranks DeepSpeed averages the ranks' gradients; each rank's share of the
    # global-batch loss is scaled by R so that the all-reduce yields their sum.
    world = int(node.args.get("world", 1))
    engine.backward(contribution * world if world != 1 else contribution)
    sums, scalars = loss_metrics(metrics, mask)
    return {node.outputs[0]: {"loss": float(contribution.detach()), "tokens": float(mask.sum()),
                              "sums": sums, "scalars": scalars, "step": node.args.get("step", 0)}}


@register_task("optimizer_step")
def optimizer_step(ctx, node, inputs):
    engine = ctx.train_engine(node.model)
    if "deferred_normaliser" in node.args:  # train fusion summed the losses: divide by the batch's count now
        stats = inputs[the(ctx, node.inputs, "rollout_stats")]
        engine.scale_gradients(1.0 / normaliser(stats, node.args["deferred_normaliser"]))
    stats = engine.step()
    return {node.outputs[0]: {"grad_norm": stats.grad_norm, "lr": stats.lr}}


@register_task("weight_sync")
def weight_sync(ctx, node, inputs):
    # Only what training changes travels (with LoRA adapters: the targets, merged), less the vision
    # tower, which decode engines never run: vit_encode feeds them.
    weights = ctx.train_engine(node.model).state_dict_for_sync(trainable_only=True)
    ctx.decode_engine.load_weights(weights)
    return {node.outputs[0]: {"version": ctx.iteration + 1}}


@register_task("report")
def report(ctx, node, inputs):
    """Host-side records of the iteration: one row per response, plus the batch metrics. With several
    optimizer steps (``args["steps"]``, passing ``epochs`` times over the batch) a loss is the mean of
    the steps' losses, a per-token metric the mean over every token of every step, a grad norm the
    mean of the steps'."""
    alg = ctx.algorithm
    read = node.inputs
    steps, epochs = node.args.get("steps", 1), node.args.get("epochs", 1)
    stats = inputs[the(ctx, read, "rollout_stats")]
    rows, rewards, losses, sums, scalars = [], [], 0.0, {}, {}
    # The policy's loss is "loss"; another trained model's (a critic's) is "loss_<model>". Metrics
    # its loss function returns are merged by name.
    extra_losses = {}
    for model in (alg.rollout_model, *alg.model_losses):
        micro_batches = [inputs[v] for v in with_role(ctx, read, "loss", model=model)]
        micro_batches = [v for v in micro_batches if not (v.get("deferred") and not v["tokens"])]  # a fused
        for value in micro_batches:  # chunk that trained no group has nothing to report
            if value.get("deferred"):  # train fusion: a sum, divided by the batch's count only now
                value = dict(value, loss=value["loss"] / normaliser(stats, value["deferred"]))
            if model == alg.rollout_model:
                losses += value["loss"]
            else:
                extra_losses[f"loss_{model}"] = extra_losses.get(f"loss_{model}", 0.0) + value["loss"]
            for k, v in value["sums"].items():
                sums[k] = sums.get(k, 0.0) + v
            for k, v in value["scalars"].items():
                scalars[k] = scalars.get(k, 0.0) + v / len(micro_batches)
    prompts, responses_of = by_prompt(ctx, read, "prompt"), by_prompt(ctx, read, "responses")
    rewards_of = by_prompt(ctx, read, "rewards")
    advantages: dict[int, torch.Tensor] = {}
    for v in with_role(ctx, read, "advantages"):  # a group's, or a batch's (by prompt)
        value = inputs[v]
        advantages.update(value if isinstance(value, dict) else {ctx.values[v].prompts[0]: value})
    scores = {s.as_: by_prompt(ctx, read, "score", label=f"old_{s.as_}" if s.grad else s.as_) for s in alg.scores}
    policy_lp = alg.policy_logprobs()
    gap = dict.fromkeys(mismatch.METRICS, 0.0)  # the decode engine's log-probs against old_<policy_lp>
    for p in sorted(responses_of):
        prompt, responses, r = inputs[prompts[p]], inputs[responses_of[p]], inputs[rewards_of[p]]
        adv = advantages[p]
        scored = {name: inputs[of[p]] for name, of in scores.items()}
        sampled = mismatch.sampled_logprobs(responses) if policy_lp is not None else None
        policy_mask = responses.mask() if responses.multi_turn else None
        for g, seq in enumerate(responses.sequences):
            n = len(seq.token_ids)
            row = {
                "prompt_id": prompt.prompt_id,
                "sample": g,
                "prompt_token_ids": prompt.input_ids.tolist(),
                # where each image came from (a path, a sha256, or the embedded task's seed and index),
                # so a log-prob can be recomputed without the run
                "images": prompt.meta.get("images", []),
                **({"videos": prompt.meta["videos"]} if prompt.meta.get("videos") else {}),
                "response_token_ids": list(seq.token_ids),
                "text": ctx.decode_text(seq.token_ids),
                "answer": prompt.answer,
                "reward": float(r[g]),
                # a per-token advantage [G, R] (GAE, REINFORCE++) is logged as its mean over the policy's tokens
                "advantage": (float(adv[g, :max(n, 1)].mean()) if policy_mask is None else
                              float((adv[g, :n] * policy_mask[g, :n]).sum() / policy_mask[g, :n].sum().clamp(min=1)))
                if adv.dim() == 2 else float(adv[g]),
                "rollout_logprobs": [float(x) for x in seq.logprobs],
            }
            if policy_mask is not None:  # a multi-turn trajectory: which tokens are the policy's, and its turns
                from rollplex.tasks.turns import turn_row

                row.update(turn_row(ctx, seq))
            for s in alg.scores:
                key = f"old_{s.as_}" if s.grad else s.as_
                row[key] = [float(x) for x in scored[s.as_][g, :n].tolist()]
            if policy_lp is not None:
                own = slice(None) if policy_mask is None else policy_mask[g, :n].bool()
                for k, v in mismatch.mismatch_sums(scored[policy_lp][g, :n][own], sampled[g, :n][own]).items():
                    gap[k] += v
            rows.append(row)
            rewards.append(float(r[g]))
    tokens = max(stats["tokens"], 1)
    if steps > 1:
        losses, extra_losses = losses / steps, {k: v / steps for k, v in extra_losses.items()}
        tokens *= epochs  # each epoch visits every token once more

    def steps_of(model: str) -> list[dict]:
        return [inputs[v] for v in with_role(ctx, read, "step", model=model)]

    def grad_norm(records: list[dict]) -> float:
        return records[0]["grad_norm"] if len(records) == 1 else sum(r["grad_norm"] for r in records) / len(records)

    policy_steps = steps_of(alg.rollout_model)
    rt = torch.tensor(rewards)
    metrics = {
        "reward_mean": float(rt.mean()) if rewards else 0.0,
        "reward_std": float(rt.std()) if len(rewards) > 1 else 0.0,
        "loss": losses,
        "grad_norm": grad_norm(policy_steps),
        "lr": policy_steps[-1]["lr"],
        "response_len_mean": stats["tokens"] / max(stats["sequences"], 1),
    }
    metrics.update(extra_losses)
    for model in alg.model_losses:
        metrics[f"grad_norm_{model}"] = grad_norm(steps_of(model))
    metrics.update({k: v / tokens for k, v in sums.items()})
    if policy_lp is not None:  # over the rollout's tokens, once each
        metrics.update({k: v / max(stats["tokens"], 1) for k, v in gap.items()})
    if ctx.refcache is not None:
        cache = ctx.refcache.stats()
        metrics.update(ref_cache_hit_rate=cache.hit_rate, ref_cache_bytes=cache.host_bytes + cache.disk_bytes)
    metrics.update(scalars)
    if "prefill" in stats:  # a multi-turn rollout
        from rollplex.tasks.turns import turn_metrics

        metrics.update(turn_metrics(rows, stats, [inputs[prompts[p]].num_tokens for p in sorted(responses_of)],
                                    ctx.settings.samples))
    if "kl" not in metrics:
        metrics["kl"] = 0.0
    # "additive": metrics that are sums over the batch, which a data-parallel gather adds up.
    additive = ["loss", *sums, *(gap if policy_lp is not None else ())]
    return {node.outputs[0]: {"rows": rows, "metrics": metrics, "additive": additive}}
