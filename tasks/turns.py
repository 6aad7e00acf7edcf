"""Multi-turn rollouts: decode a turn, let each finished sample's environment answer, decode the next.

The compiler expands ``rollout.max_turns`` turns (pipeline/compile/turns.py). Per turn t and decode
chunk c:

    decode_t{t}_c{c}  (decode)   advances every sample still in turn t by K tokens; the samples that
                                 ended their turn in this chunk are handed on (``turn``)
    env_t{t}_c{c}     (host)     their environments step on their responses, all at once, each bound
                                 by ``env.timeout_s``; the answers are rendered as the next user turn
    vit_obs_t{t}_c{c} (compute)  the vision tower encodes the answers' new images

so the environments and the vision tower of a chunk's samples work while the others still decode.
Turn t+1's first chunk appends each live sample's observation to its context and continues it on the
decode engine without computing its earlier turns again (``DecodeRequest.continues``). After the
last turn, ``episodes`` (a join) hands each prompt's trajectories on as its ``responses``.

A sample's state between nodes is its ``Episode``, which the decode nodes and the join own; an
environment node reads the episodes it is handed and returns what their steps gave (``Answer``).
The trajectory a prompt's group hands on (``Trajectory``) is its samples' turns after the prompt:
tokens, the decode engine's log-probs (0 where the environment wrote), the policy mask (1 where the
policy sampled), the observations' vision embeddings, and what the episode did (turns, tool calls,
reward, why it ended).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from rollplex.engines.base import DecodeRequest, FinishedSequence
from rollplex.engines import vlm
from rollplex.tasks.environments import EnvPrompt, Job, Outcome, step_all
from rollplex.tasks.registry import register_task


@dataclass
class Trajectory(FinishedSequence):
    """One sample's turns after its prompt, what ``responses`` hold in a multi-turn run."""

    policy_mask: list[int] = field(default_factory=list)  # 1: sampled by the policy; 0: the environment's
    image_embeds: torch.Tensor | None = None  # the observations' vision embeddings, in order
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    pixel_values: torch.Tensor | None = None  # their pixels: a vision tower that trains encodes them again
    turns: list[dict] = field(default_factory=list)  # per turn: its span, what its step gave
    tool_calls: int = 0
    reward: float = 0.0
    end_reason: str = ""


@dataclass
class Rendered:
    """An observation as the next user turn: its tokens (images expanded) and pixels."""

    token_ids: list[int]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    sources: list[dict] = field(default_factory=list)
    text: str = ""


class ObservationRenderer:
    """Renders an environment's observation with the processor's chat template: the text the
    template puts between an assistant turn and the next one's start, found as the difference of two
    renderings (a system prompt the template adds stands in both), then tokenized with the images."""

    PROBE = ([{"role": "user", "content": [{"type": "text", "text": "q"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "a"}]}])

    def __init__(self, processor) -> None:
        self.processor = processor
        before = processor.apply_chat_template(self.PROBE)
        self.closing = before[before.rindex("a") + 1:]  # what ends an assistant turn ("<|im_end|>\n")
        tok = processor.tokenizer
        self.end_token_id = tok.encode(self.closing)[0]  # the end-of-turn token a response stops on
        self.end_text = tok.decode([self.end_token_id])
        self._before = before
        self.image_token_id = tok.convert_tokens_to_ids(getattr(processor, "image_token", "<|image_pad|>"))
        self.video_token_id = tok.convert_tokens_to_ids(getattr(processor, "video_token", "<|video_pad|>"))

    def __call__(self, observation, stopped: bool = True) -> Rendered:
        """``stopped``: the response ended with the end-of-turn token, so only the rest of the closing
        text is added; a response cut at its length (or stopped on another token) gets the whole of it."""
        content = [{"type": "image"} for _ in observation.images]
        if observation.text:
            content.append({"type": "text", "text": observation.text})
        after = self.processor.apply_chat_template(self.PROBE + [{"role": "user", "content": content}],
                                                   add_generation_prompt=True)
        if not after.startswith(self._before):
            raise ValueError("the chat template renders an earlier turn differently once another follows")
        closing = self.closing[len(self.end_text):] if stopped and self.closing.startswith(self.end_text) \
            else self.closing
        text = closing + after[len(self._before):]
        enc = self.processor(text=[text], images=list(observation.images) or None, return_tensors="pt")
        return Rendered(enc["input_ids"][0].tolist(), enc.get("pixel_values"), enc.get("image_grid_thw"),
                        image_sources(observation), text)


def image_sources(observation) -> list[dict]:
    """Where each of an observation's images came from, for the rollout log: the environment's own
    word where it gave one, else the image's identity, the sha256 of its RGB pixels and its size."""
    import hashlib

    given = list(getattr(observation, "sources", []))
    for image in observation.images[len(given):]:
        rgb = image.convert("RGB")
        given.append({"sha256": hashlib.sha256(rgb.tobytes()).hexdigest(), "size": list(rgb.size)})
    return given


@dataclass
class Answer:
    """What one environment step gave a sample: the outcome, the rendered observation (None where the
    episode ended) and the environment, kept for the sample's next turn."""

    outcome: Outcome
    rendered: Rendered | None
    env: Any


@dataclass
class Episode:
    """One sample's episode while the iteration's decode runs."""

    key: tuple[int, int]  # (prompt index, sample)
    prompt: Any  # PromptInputs
    vision: Any  # the prompt's VisionEmbeds
    seed: int
    token_ids: list[int] = field(default_factory=list)  # everything after the prompt, both parties'
    logprobs: list[float] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    image_embeds: list[torch.Tensor] = field(default_factory=list)
    image_grids: list[torch.Tensor] = field(default_factory=list)
    image_pixels: list[torch.Tensor] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    env: Any = None
    tool_calls: int = 0
    reward: float = 0.0
    end_reason: str = ""
    done: bool = False
    finish_reason: str = ""
    last_request: tuple[str, int] | None = None  # the (request, sample) its last turn decoded in
    request_id: str = ""  # its first turn's request

    def add_response(self, seq: FinishedSequence, turn: int) -> None:
        start = len(self.token_ids)
        self.token_ids += seq.token_ids
        self.logprobs += seq.logprobs
        self.policy_mask += [1] * len(seq.token_ids)
        self.finish_reason = seq.finish_reason
        self.last_request = (seq.request_id, seq.index)
        self.turns.append({"turn": turn, "response": [start, len(self.token_ids)]})

    def add_answer(self, answer: Answer, embeds: torch.Tensor | None) -> None:
        o = answer.outcome
        self.env = answer.env
        self.reward += o.reward
        self.tool_calls += o.tool_calls
        self.turns[-1].update(reward=o.reward, tool_calls=o.tool_calls, env_seconds=round(o.seconds, 4))
        if o.done:
            self.done, self.end_reason = True, o.end_reason
            return
        r = answer.rendered
        start = len(self.token_ids)
        self.token_ids += r.token_ids
        self.logprobs += [0.0] * len(r.token_ids)
        self.policy_mask += [0] * len(r.token_ids)
        if r.image_grid_thw is not None:
            self.image_embeds.append(embeds)
            self.image_grids.append(r.image_grid_thw)
            self.image_pixels.append(r.pixel_values)
        self.turns[-1].update(observation=[start, len(self.token_ids)], sources=r.sources)

    def context(self) -> list[int]:
        return self.prompt.input_ids.tolist() + self.token_ids

    def trajectory(self) -> Trajectory:
        return Trajectory(self.request_id, list(self.token_ids), list(self.logprobs), self.finish_reason,
                          index=self.key[1], policy_mask=list(self.policy_mask),
                          image_embeds=torch.cat(self.image_embeds) if self.image_embeds else None,
                          image_grid_thw=torch.cat(self.image_grids).reshape(-1, 3) if self.image_grids else None,
                          pixel_values=torch.cat(self.image_pixels) if self.image_pixels else None,
                          turns=[dict(t) for t in self.turns], tool_calls=self.tool_calls, reward=self.reward,
                          end_reason=self.end_reason)


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """Sample ``sample``'s seed in turn ``turn``: turn 0 draws with seed + sample, as a single turn does."""
    return (seed + sample + 7919 * turn) & 0x3FFFFFFF


# --------------------------------------------------------------------------------------------------
def decode_turn_chunk(ctx, node, inputs):
    """A decode chunk of turn ``args["turn"]`` (see the module docstring)."""
    from rollplex.tasks.nodes import prompt_request, request_id, sample_key, sample_seed, the, with_role

    engine, s = ctx.decode_engine, ctx.settings
    turn, turns, chunk, chunks = (node.args[k] for k in ("turn", "turns", "chunk", "chunks"))
    if turn == 0 and chunk == 0:
        prompts = [inputs[v] for v in with_role(ctx, node.inputs, "prompt")]
        visions = [inputs[v] for v in with_role(ctx, node.inputs, "vision")]
        index = node.args.get("prompts", range(len(prompts)))
        state = {"episodes": {}, "requests": {}, "waiting": set(), "prefill": dict.fromkeys(PREFILL, 0)}
        requests = []
        for p, (prompt, vis) in enumerate(zip(prompts, visions)):
            seed = sample_seed(s.seed, ctx.iteration, prompt.prompt_id)
            rid = request_id(ctx.iteration, index[p])
            requests.append(dataclasses.replace(
                prompt_request(rid, prompt, vis, s, seed=seed, n=s.samples, temperature=s.temperature, top_p=s.top_p),
                keep_kv=turns > 1))
            for g in range(s.samples):
                key = (index[p], g)
                state["episodes"][key] = Episode(key, prompt, vis, seed, request_id=rid)
                state["requests"][(rid, g)] = key
                state["waiting"].add(key)
        engine.add_requests(requests)
    else:
        previous = inputs[the(ctx, node.inputs, "decode_state")]
        state = {**previous, "waiting": set(previous["waiting"]), "prefill": dict(previous["prefill"])}
    if chunk == 0 and turn > 0:
        _continue(ctx, node, inputs, state, turn, turns)
    episodes, handed = state["episodes"], []

    def take(seqs) -> None:
        for seq in seqs:
            key = state["requests"].pop(sample_key(seq))
            episode = episodes[key]
            if turn > 0:  # what the engine computed of the continued context
                context = len(episode.context())
                cached = seq.cached_tokens if seq.cached_tokens is not None else 0
                state["prefill"]["context"] += context
                state["prefill"]["computed"] += context - cached
                state["prefill"]["new"] += context - state["held"].pop(key)
            episode.add_response(seq, turn)
            state["waiting"].discard(key)
            handed.append(key)

    take(engine.step(node.args["tokens"]))
    if chunk == chunks - 1:
        while state["waiting"] and engine.has_unfinished():  # max_tokens bounds this loop
            take(engine.step(node.args["tokens"]))
        if state["waiting"]:
            raise RuntimeError(f"%{node.name}: turn {turn} ended with samples {sorted(state['waiting'])} undecoded")
    out = {the(ctx, node.outputs, "decode_state"): state}
    out[the(ctx, node.outputs, "turn")] = {key: episodes[key] for key in sorted(handed)}
    return out


# Per iteration: the continued contexts' tokens, those the engine computed, and those past each sample's last turn.
PREFILL = ("context", "computed", "new")


def _continue(ctx, node, inputs, state, turn: int, turns: int) -> None:
    """Turn ``turn``'s first chunk: every sample's answer from the environment joins its episode, and
    the live ones continue on the decode engine, in sample order (a batch the same under any schedule)."""
    from rollplex.tasks.nodes import with_role

    s = ctx.settings
    answers: dict = {}
    for v in with_role(ctx, node.inputs, "observation"):
        answers.update(inputs[v])
    embeds: dict = {}
    for v in with_role(ctx, node.inputs, "vision"):
        embeds.update(inputs[v])
    continued, ended = next_turn_requests(state["episodes"], answers, embeds, turn, turns, s,
                                          temperature=s.temperature, top_p=s.top_p)
    state["held"] = {}
    for key, request, held in continued:
        state["requests"][(request.request_id, 0)] = key
        state["waiting"].add(key)
        state["held"][key] = held
    ctx.decode_engine.release(ended)  # the KV it kept for them: nothing continues them
    ctx.decode_engine.add_requests([request for _, request, _ in continued])


def next_turn_requests(episodes: dict, answers: dict, embeds: dict, turn: int, turns: int, s, *,
                       temperature: float, top_p: float) -> tuple[list, list]:
    """Each answer joins its episode; ``([(key, the request that continues it in turn ``turn``, the
    context tokens the engine holds of it)], [(request, sample) of the episodes that ended])``."""
    continued, ended = [], []
    for key in sorted(answers):
        episode = episodes[key]
        held = len(episode.context()) - 1  # the engine holds the context but the last sampled token
        episode.add_answer(answers[key], embeds.get(key))
        if episode.done:
            ended.append(episode.last_request)
            continue
        prompt, vis, g = episode.prompt, episode.vision, key[1]
        images = [t for t in (vis.image, *episode.image_embeds) if t is not None]
        grids = [t.reshape(-1, 3) for t in (prompt.image_grid_thw, *episode.image_grids) if t is not None]
        continued.append((key, DecodeRequest(
            request_id=f"{episode.request_id}-t{turn}-s{g}", prompt_token_ids=episode.context(),
            image_embeds=torch.cat(images) if images else None, image_grid_thw=torch.cat(grids) if grids else None,
            max_tokens=s.max_new_tokens, seed=turn_seed(episode.seed, g, turn), temperature=temperature, top_p=top_p,
            stop_token_ids=tuple(s.stop_token_ids), keep_kv=turn < turns - 1, continues=episode.last_request), held))
    return continued, ended


@register_task("env_step")
def env_step(ctx, node, inputs):
    """The environments of the samples one decode chunk finished their turn in, stepped all at once."""
    final = node.args["turn"] == node.args["turns"] - 1
    return {node.outputs[0]: answer_turns(ctx.host, inputs[node.inputs[0]], final, ctx.settings.max_new_tokens)}


def answer_turns(host, handed: dict, final: bool, max_new_tokens: int) -> dict:
    """Each handed episode's environment steps on its last response (all at once, each bound by the
    host's timeout); what each gave, rendered as the next user turn where the episode goes on."""
    spec, options, timeout = host.environment, host.spec.env_options, host.spec.env_timeout
    jobs = [Job(e.env, _env_prompt(e), host.decode_text(e.token_ids[slice(*e.turns[-1]["response"])]))
            for e in handed.values()]
    limit = int(host.spec.decode_options.get("max_model_len") or 0)
    placeholders = {host.render.image_token_id, host.render.video_token_id}
    out = {}
    stepped = step_all(spec, options, jobs, timeout, host.env_pool)
    for (key, episode), (env, outcome) in zip(handed.items(), stepped):
        rendered = None
        response = episode.token_ids[slice(*episode.turns[-1]["response"])]
        if not outcome.done and final:
            outcome = dataclasses.replace(outcome, done=True, end_reason="max_turns")
        if not outcome.done and placeholders & set(response):
            # A sampled image placeholder would read as an image in the next turn's context.
            outcome = dataclasses.replace(outcome, done=True, end_reason="placeholder_in_response")
        if not outcome.done:
            try:
                rendered = host.render(outcome.observation, stopped=response[-1:] == [host.render.end_token_id])
            except Exception as exc:  # noqa: BLE001 - an observation the processor cannot take ends the episode
                outcome = dataclasses.replace(outcome, done=True, end_reason=f"env_error: render: {exc}")
        if rendered is not None and limit and (len(episode.context()) + len(rendered.token_ids)
                                               + max_new_tokens > limit):
            outcome, rendered = dataclasses.replace(outcome, done=True, end_reason="context_full"), None
        out[key] = Answer(outcome, rendered, env)
    return out


def _env_prompt(episode) -> EnvPrompt:
    p = episode.prompt
    return EnvPrompt(p.prompt_id, p.text, p.answer, (), dict(p.meta), episode.key[1],
                     turn_seed(episode.seed, episode.key[1], 0))


@register_task("vit_observation")
def vit_observation(ctx, node, inputs):
    """The vision tower on the observation images of one chunk's answers, in one call."""
    return {node.outputs[0]: observation_embeds(ctx.model(node.model), inputs[node.inputs[0]])}


def observation_embeds(vision_model, answers: dict) -> dict:
    """Each answer's observation images through ``vision_model``, in one call; by key."""
    keys = [k for k in sorted(answers) if answers[k].rendered is not None and answers[k].rendered.image_grid_thw
            is not None]
    prompts = [vlm.PromptInputs(f"obs-{k}", torch.tensor(answers[k].rendered.token_ids),
                                pixel_values=answers[k].rendered.pixel_values,
                                image_grid_thw=answers[k].rendered.image_grid_thw) for k in keys]
    embeds = vlm.vision_embeds_batch(vision_model, prompts) if prompts else []
    return {k: e.image for k, e in zip(keys, embeds)}


def score_turn(ctx, node, inputs):
    """A frozen model's log-probs of the samples whose turn ``args["turn"]`` ended in one decode chunk
    (stage fusion across turns), each on its own history: the prompt's prefix for the first turn, else
    the state its previous turn's node left. The segment is the turn's response and, where the
    trajectory goes on, the environment's answer with its images, whose KV the next turn reads; a
    trajectory that ends here hands on its log-probs, every turn's, as ``{prompt: {sample: [n]}}``."""
    from rollplex.engines import trajectory
    from rollplex.tasks.nodes import by_prompt, the, with_role

    s, turn = ctx.settings, node.args["turn"]
    model = ctx.model(node.model)
    handed = inputs[the(ctx, node.inputs, "turn")]
    answers = inputs[the(ctx, node.inputs, "observation")]
    images = inputs[v] if (v := the(ctx, node.inputs, "vision")) else {}
    if turn == 0:
        kv_of = by_prompt(ctx, node.inputs, "kv")
        before = {key: trajectory.History.of_prefix(inputs[kv_of[key[0]]]) for key in handed}
    else:
        before = {}
        for v in with_role(ctx, node.inputs, "score_state"):
            before.update({key: h for key, h in inputs[v].items() if key in handed})
    keys = sorted(handed)
    segments, keep = [], []
    for key in keys:
        episode, answer = handed[key], answers[key]
        ids = episode.token_ids[slice(*episode.turns[turn]["response"])]
        segment = trajectory.Continuation(list(ids), policy_mask=[1] * len(ids))
        if not answer.outcome.done:  # the answer is the next turn's context: its KV goes on too
            r = answer.rendered
            segment = trajectory.Continuation(segment.token_ids + r.token_ids, images.get(key), r.image_grid_thw,
                                              segment.policy_mask + [0] * len(r.token_ids))
        segments.append(segment)
        keep.append(not answer.outcome.done)
    scores: dict[int, dict[int, torch.Tensor]] = {}
    states: dict[tuple[int, int], trajectory.History] = {}
    vocab = model.config.get_text_config().vocab_size
    for run in vlm.batches_within([len(x.token_ids) for x in segments], vocab, grad=False):
        after = trajectory.extend_histories(model, [before[keys[i]] for i in run], [segments[i] for i in run],
                                            keep=[keep[i] for i in run], pad_id=s.pad_id,
                                            temperature=s.score_temperature)
        for i, history in zip(run, after):
            if keep[i]:
                states[keys[i]] = history
            else:
                scores.setdefault(keys[i][0], {})[keys[i][1]] = history.logprobs
    out = {the(ctx, node.outputs, "score"): scores}
    if (state := the(ctx, node.outputs, "score_state")) is not None:
        out[state] = states
    return out


def score_trajectories(ctx, model, prefixes: list, responses: list, *, grad: bool, head: str) -> list[torch.Tensor]:
    """Per-token outputs [G, R] of each group's trajectories on its prompt's prefix (suffix_score)."""
    from rollplex.engines import trajectory

    s = ctx.settings
    groups = continuations(model, responses, grad=grad)
    if head == "value":
        return trajectory.head_outputs_batch(model, prefixes, groups, grad=grad)
    return trajectory.logprobs_batch(model, prefixes, groups, pad_id=s.pad_id, temperature=s.score_temperature,
                                     grad=grad)


def continuations(model, responses: list, *, grad: bool) -> list[list]:
    """Each group's trajectories as ``trajectory.Continuation``s. Where ``model``'s vision tower
    trains (and grad is asked), their observations' images are encoded again by that tower, with
    grad, so that the loss reaches it through them as through the prompt's images (the rollout
    encoded them with the policy's tower as it was, without grad)."""
    from rollplex.engines import trajectory
    from rollplex.engines.torch_train import trains_vision

    to_encode = [q for r in responses for q in r.sequences if q.pixel_values is not None] \
        if grad and trains_vision(model) else []
    encoded = vlm.vision_embeds_batch(model, [vlm.PromptInputs(f"obs-{i}", torch.tensor(q.token_ids),
                                                               pixel_values=q.pixel_values,
                                                               image_grid_thw=q.image_grid_thw)
                                              for i, q in enumerate(to_encode)], grad=True) if to_encode else []
    again = {id(q): e.image for q, e in zip(to_encode, encoded)}

    def continuation(q):
        c = trajectory.continuation_of(q)
        return dataclasses.replace(c, image_embeds=again[id(q)]) if id(q) in again else c

    return [[continuation(q) for q in r.sequences] for r in responses]


def score_trajectories_unshared(ctx, model, prompts: list, visions: list, responses: list, *, grad: bool,
                                head: str) -> list[torch.Tensor]:
    """``train.prefix_sharing: false``: the same per-token outputs [G, R], each trajectory computed
    over its whole sequence, its prompt again for every sample, as a runtime without prefix reuse
    computes them (the baseline the shared scoring is measured against)."""
    from rollplex.engines import trajectory

    s, out = ctx.settings, []
    for prompt, vis, group in zip(prompts, visions, responses):
        alone = [[c] for c in continuations(model, [group], grad=grad)[0]]
        prefixes = vlm.prefix_forward_batch(model, [prompt] * len(alone), [vis] * len(alone), grad=grad)
        if head == "value":
            rows = trajectory.head_outputs_batch(model, prefixes, alone, grad=grad)
        else:
            rows = trajectory.logprobs_batch(model, prefixes, alone, pad_id=s.pad_id,
                                             temperature=s.score_temperature, grad=grad)
        width = max(r.shape[1] for r in rows)
        out.append(torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows]))
    return out


def join_episodes(ctx, node, inputs):
    """After the last turn: the last answers join their episodes, and each prompt's trajectories are
    handed on as its ``responses``, with the batch's rollout statistics."""
    from rollplex.tasks.nodes import Responses, by_prompt, the, with_role

    state = inputs[the(ctx, node.inputs, "decode_state")]
    episodes = state["episodes"]
    for v in with_role(ctx, node.inputs, "observation"):
        for key, answer in sorted(inputs[v].items()):
            episodes[key].add_answer(answer, None)
    out, counts, lengths = {}, {}, []
    named = by_prompt(ctx, node.outputs, "responses")
    for p in node.args["prompts"]:
        trajectories = [episodes[(p, g)].trajectory() for g in range(ctx.settings.samples)]
        out[named[p]] = Responses(p, trajectories)
        policy = [sum(t.policy_mask) for t in trajectories]
        counts[p] = (sum(policy), len(trajectories))
        lengths += policy
    out[the(ctx, node.outputs, "rollout_stats")] = {
        "tokens": sum(lengths), "sequences": len(lengths), "max_len": max(lengths, default=0), "by_prompt": counts,
        "prefill": dict(state["prefill"])}
    return out


def turn_row(ctx, seq) -> dict:
    """A trajectory's log fields: its policy mask, and per turn the response's text and span, what the
    environment answered (its observation's span and images' sources) and the step's reward."""
    turns = []
    for t in seq.turns:
        start, end = t["response"]
        turns.append({"turn": t["turn"], "response": ctx.decode_text(seq.token_ids[start:end]), "span": [start, end],
                      **{k: t[k] for k in ("reward", "tool_calls", "observation", "sources") if k in t}})
    return {"response_mask": list(seq.policy_mask), "turns": turns, "tool_calls": seq.tool_calls,
            "end_reason": seq.end_reason}


# turn_metrics' keys that a data-parallel report gather adds up (the decode_* counts are the batch's already).
TURN_SUMS = ("turns_mean", "tool_calls_mean", "tool_use_rate", "forward_tokens", "forward_tokens_per_sample",
             "forward_tokens_per_turn")


def turn_metrics(rows: list[dict], stats: dict, prompt_tokens: list[int], samples: int,
                 shared: bool = True) -> dict:
    """What a multi-turn rollout did: turns and tool calls per trajectory, the share that used a tool,
    how episodes ended (``episodes_<reason>``, shares); the decode engine's prefill of the continued
    contexts (``decode_prefill_tokens``) against their length, what a recompute of each would prefill
    (``decode_continued_tokens``), and the tokens new since each sample's last turn
    (``decode_new_tokens``); and the tokens one scoring forward computes, with the group's prompt as
    one prefix and each sample's turns on it (``forward_tokens``), against a forward per sample
    (``..._per_sample``) and one per turn, each with its history (``..._per_turn``).

    Without prefix sharing (``shared`` false) the scoring forwards are the per-sample ones, and
    ``forward_tokens`` says so. ``rows`` are this rank's; ``stats`` are the whole batch's (gathered
    over data-parallel ranks), so every mean divides by the batch's trajectories and the ranks'
    reports add up (``TURN_SUMS``)."""
    n = max(stats["sequences"], 1)
    ends: dict[str, int] = {}
    for r in rows:
        reason = r["end_reason"].split(":")[0]
        ends[reason] = ends.get(reason, 0) + 1
    pre = stats["prefill"]
    prompt_of = [prompt_tokens[i // samples] for i in range(len(rows))]
    lengths = [len(r["response_token_ids"]) for r in rows]
    per_sample = sum(prompt_of) + sum(lengths)
    return {
        "turns_mean": sum(len(r["turns"]) for r in rows) / n,
        "tool_calls_mean": sum(r["tool_calls"] for r in rows) / n,
        "tool_use_rate": sum(r["tool_calls"] > 0 for r in rows) / n,
        **{f"episodes_{k}": v / n for k, v in sorted(ends.items())},
        "decode_continued_tokens": pre["context"], "decode_prefill_tokens": pre["computed"],
        "decode_new_tokens": pre["new"],
        "forward_tokens": sum(prompt_tokens) + sum(lengths) if shared else per_sample,
        "forward_tokens_per_sample": per_sample,
        "forward_tokens_per_turn": sum(p + t["span"][1] for p, r in zip(prompt_of, rows) for t in r["turns"]),
    }
