"""Expand an ``Algorithm`` for one batch shape into the fine-grained iteration DAG.

Per prompt p and model m: one ``vit_encode``, one ``prefix[m]`` and one ``suffix_score[m]``; decode
split into chunks of K tokens; reward and (group-scoped) advantage per prompt; ``loss`` per
micro-batch of prompt groups, each followed by its backward; an ``optimizer_step`` per trained model
(one per mini-batch and epoch with ``mini_batches``/``epochs``: pipeline/compile/updates.py); one
``weight_sync``; and a ``report`` that gathers the iteration's host-side records. Byte estimates on
every value come from the model's dimensions, so planners can reason about memory before running.

With ``prefix_sharing=False`` each model scores every response over its full sequence instead
(what serial runtimes do): no prefix node, one ``suffix_score`` that re-runs the prompt G times.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from rollplex.errors import EngineError, GraphError
from rollplex.pipeline.compile.authoring import Algorithm
from rollplex.pipeline.compile.ir import IterationGraph, Node, gc_paused, get_kind
from rollplex.pipeline.compile.updates import add_updates, token_cap_blocker


@dataclass(frozen=True)
class ModelDims:
    """The byte model of a VLM's language side: what each value of an iteration weighs. The compiler's
    estimates, the planners' footprint (pipeline/plan/footprint.py) and the run's memory plan all read
    these methods, so one formula sizes a value wherever it is sized."""

    hidden: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # trainable LM parameters, for gradient/optimizer bytes
    dtype_bytes: int = 4
    checkpointing: bool = False  # activation checkpointing in training: only each layer's input is kept

    @classmethod
    def from_hf_config(cls, config, dtype_bytes: int = 4) -> "ModelDims":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        layer = 4 * text.hidden_size * head_dim * heads // 2 + 3 * text.hidden_size * text.intermediate_size
        params = text.num_hidden_layers * layer + 2 * text.vocab_size * text.hidden_size
        return cls(text.hidden_size, text.num_hidden_layers, text.num_key_value_heads, head_dim,
                   text.vocab_size, params, dtype_bytes)

    @classmethod
    def of(cls, spec, dtype_bytes: int = 2, checkpointing: bool = False) -> "ModelDims":
        """From a model shape of the planners (engines/modelspec.VLMSpec, read by its fields)."""
        return cls(spec.hidden, spec.layers, spec.kv_heads, spec.head_dim, spec.vocab, spec.params, dtype_bytes,
                   checkpointing)

    def kv_bytes(self, tokens: float) -> int:
        return int(2 * self.layers * self.kv_heads * self.head_dim * tokens * self.dtype_bytes)

    def activation_bytes(self, tokens: float, checkpointed: bool | None = None) -> int:
        """What a forward keeps for its backward: per token and layer 34·h bytes in 16 bits with flash
        attention (Korthikanti et al. 2022), 2·h (the layer input) with checkpointing (``checkpointed``,
        default the model's)."""
        per = 2 if (self.checkpointing if checkpointed is None else checkpointed) else 34
        return int(per * self.hidden * self.layers * tokens * self.dtype_bytes / 2)

    def vision_bytes(self, tokens: float, grad: bool = False) -> int:
        """A prompt's merged vision-tower output, in the LM's hidden size; with ``grad`` (a vision
        tower that trains) the activations its backward keeps, sized as the LM's over the vision
        tokens: the ViT is not in these dimensions, and Qwen2.5-VL's runs 4x the tokens at about a
        third of the width, the same order."""
        # the tower keeps its activations whether or not the language model's layers recompute theirs
        return int(tokens * self.hidden * self.dtype_bytes) + (self.activation_bytes(tokens, False) if grad else 0)

    def prefix_bytes(self, tokens: float, grad: bool = False) -> int:
        """A prompt's prefix: its KV, the fp32 last-position logits, and with ``grad`` its activations."""
        return self.kv_bytes(tokens) + self.vocab * 4 + (self.activation_bytes(tokens) if grad else 0)

    def score_bytes(self, response_tokens: float, grad: bool = False, forward_tokens: float | None = None) -> int:
        """Per-token fp32 scores of responses, and with ``grad`` the activations of the forward that made
        them (``forward_tokens``, default the responses': a full-sequence forward also runs the prompt)."""
        held = self.activation_bytes(response_tokens if forward_tokens is None else forward_tokens) if grad else 0
        return int(response_tokens * 4) + held


@dataclass(frozen=True)
class BatchShape:
    prompts: int
    samples: int
    max_new_tokens: int
    chunk_tokens: int
    micro_batch_groups: int = 1
    prompt_tokens: int = 64  # typical prompt length (text + vision tokens), for byte estimates
    vision_tokens: int = 16
    prefix_sharing: bool = True
    prompts_per_node: int = 1  # prompts per vit_encode / prefix / suffix_score node (batched forwards)
    # Frozen models score the groups that finished in each decode chunk right after it (stage fusion),
    # instead of every group after the last chunk; needs prefix sharing and two chunks or more.
    stage_fusion: bool = False
    # With stage fusion, the policy also trains on those groups per chunk (reward, advantage, suffix
    # with grad, loss and backward), its loss normalised at the optimizer step once the batch's
    # token count is known. Needs an algorithm whose every step is per group (``train_fusable``).
    train_fusion: bool = False
    # With train fusion, the most tokens (prompts plus responses) one backward over a chunk's finished
    # groups holds; 0: micro_batch_groups alone bounds it (tasks/fused_train.handoff_batches).
    fusion_batch_tokens: int = 0
    # Training after decode (no train fusion): the policy's forwards with grad, loss and backward of a
    # micro-batch run in one node, its groups cut after the rollout into backwards of at most this many
    # tokens (prompts plus responses; a group over it trains alone), as verl's dynamic batch size does.
    # 0: the micro-batch's prefix, suffix and loss nodes, one backward each (``token_cap_blocker``).
    micro_batch_tokens: int = 0
    # With stage fusion (and no train fusion), the chunks from this one on are scored by one node
    # after the last chunk: each chunk's node is a forward, and late chunks end after the window,
    # where one forward is cheaper than several. 0: every chunk has its own node.
    window_chunks: int = 0
    # The policy's prefix forward of micro-batch m (its graph is kept for m's backward) waits for the
    # loss of micro-batch m - k: at most k micro-batches of prefix graphs are alive beside the one
    # training. 0: no bound, every prefix may run in the decode window.
    grad_prefix_lookahead: int = 0
    # Optimizer steps per iteration: the prompt groups split into ``mini_batches`` (each one step), passed
    # over ``epochs`` times (pipeline/compile/updates.py). ``ranks``: the data-parallel ranks the split is
    # made for, each taking an equal contiguous share of every mini-batch (IterationSpec sets it).
    mini_batches: int = 1
    epochs: int = 1
    ranks: int = 1
    # The trained models' vision towers train too (train.freeze_vision: false): each of their forwards
    # with grad reads a vision forward with grad of its own micro-batch, and the rollout reads the
    # policy's vision output, not the frozen reference's.
    trains_vision: bool = False
    # Multi-turn rollouts (pipeline/compile/turns.py): up to ``max_turns`` turns of ``max_new_tokens``
    # each, an environment's answer of at most ``observation_tokens`` between two.
    max_turns: int = 1
    observation_tokens: int = 0

    @property
    def fused(self) -> bool:
        """Frozen models score as decode goes: each chunk's finished samples, or each turn's as it ends."""
        return self.stage_fusion and self.prefix_sharing and (self.chunks > 1 or self.max_turns > 1)

    @property
    def continuation_tokens(self) -> int:
        """The longest a sample's tokens after its prompt can be: its turns and the answers between."""
        return self.max_turns * self.max_new_tokens + (self.max_turns - 1) * self.observation_tokens

    def __post_init__(self) -> None:
        for name in ("prompts", "samples", "max_new_tokens", "chunk_tokens", "micro_batch_groups",
                     "prompts_per_node", "mini_batches", "epochs", "ranks", "max_turns"):
            if getattr(self, name) < 1:
                raise GraphError(f"batch shape: {name} must be ≥ 1, got {getattr(self, name)}")
        for name in ("fusion_batch_tokens", "micro_batch_tokens"):
            if getattr(self, name) < 0:
                raise GraphError(f"batch shape: {name} must be ≥ 0, got {getattr(self, name)}")
        if self.steps > 1 and self.prompts % (self.ranks * self.mini_batches):
            raise GraphError(f"batch shape: {self.prompts} prompts do not split into {self.mini_batches} equal "
                             f"mini-batches over {self.ranks} rank(s)")

    @property
    def chunks(self) -> int:
        return math.ceil(self.max_new_tokens / self.chunk_tokens)

    @property
    def steps(self) -> int:
        """Optimizer steps per trained model and iteration."""
        return self.mini_batches * self.epochs

    def mini_batch_prompts(self) -> list[tuple[int, ...]]:
        """The prompts of each mini-batch: from every rank's block of prompts its m-th contiguous share."""
        if self.steps == 1:
            return [tuple(range(self.prompts))]
        block = self.prompts // self.ranks
        share = block // self.mini_batches
        return [tuple(p for r in range(self.ranks) for p in range(r * block + m * share, r * block + (m + 1) * share))
                for m in range(self.mini_batches)]

    def micro_batches(self, mini_batch: int | None = None) -> list[tuple[int, ...]]:
        """The micro-batches of one mini-batch, or of every mini-batch in order; none spans two ranks."""
        if self.steps == 1:
            return _split(range(self.prompts), self.micro_batch_groups)
        minis = self.mini_batch_prompts()
        share = self.prompts // self.ranks // self.mini_batches
        chosen = minis if mini_batch is None else [minis[mini_batch]]
        return [mb for mini in chosen for i in range(0, len(mini), share)
                for mb in _split(mini[i : i + share], self.micro_batch_groups)]

    def node_groups(self, grad: bool) -> list[tuple[int, ...]]:
        """Prompts per vit/prefix/suffix node. A node whose graph is kept for a backward never spans
        two micro-batches: each micro-batch's backward must free exactly its own graphs."""
        if not grad:
            return _split(range(self.prompts), self.prompts_per_node)
        return [part for mb in self.micro_batches() for part in _split(mb, self.prompts_per_node)]


def scoring_tail(window_chunks: int, chunks: int) -> int:
    """The decode chunk whose frozen-scoring node also takes every later chunk's samples
    (``BatchShape.window_chunks``): that chunk where it leaves two or more to merge, else the last
    one, so every chunk keeps its own node."""
    return window_chunks if 0 < window_chunks < chunks - 1 else chunks - 1


def _split(items, size: int) -> list[tuple[int, ...]]:
    items = tuple(items)
    return [items[i : i + size] for i in range(0, len(items), size)]


def span(groups: tuple[int, ...]) -> str:
    """Name suffix of a node over prompts: p3, or p0-3 for a run of prompts."""
    return f"p{groups[0]}" if len(groups) == 1 else f"p{groups[0]}-{groups[-1]}"


@dataclass(frozen=True)
class EngineChoice:
    """Engine name per role, with optional per-kind overrides (``engines.decode_chunk: hf``)."""

    by_role: Mapping[str, str]
    by_kind: Mapping[str, str] = field(default_factory=dict)

    def for_node(self, kind: str, role: str | None) -> str | None:
        if kind in self.by_kind:
            return self.by_kind[kind]
        if role is None:
            return None
        if role not in self.by_role:
            raise EngineError(f"no engine configured for role {role!r} (node kind {kind!r}); "
                              f"set engines.{role}")
        return self.by_role[role]


def train_fusion_blocker(alg: Algorithm, shape: BatchShape) -> str | None:
    """Why a group's whole update (reward, advantage, the policy's suffix with grad, loss and
    backward) cannot run as soon as its responses are done, or None when it can: that needs stage
    fusion; one trained model, the policy, scoring an lm head; every frozen score fused; advantages
    per group from rewards alone; and no node of the algorithm's own."""
    if not shape.train_fusion:
        return "train fusion is off"
    if shape.steps > 1:
        return (f"it takes one optimizer step per iteration; train.mini_batches × train.epochs is "
                f"{shape.mini_batches} × {shape.epochs}")
    if shape.max_turns > 1:
        return "a multi-turn rollout hands its trajectories on after the last turn"
    if not shape.fused:
        return "it needs stage fusion, prefix sharing and two decode chunks or more"
    # What the algorithm trains first: the most basic reason (PPO's critic, before its GAE node).
    policy, advantage = alg.rollout_model, alg.advantage_fn
    if alg.trainable != [policy] or list(alg.losses()) != [policy] or alg.models[policy].head != "lm":
        return f"it trains {alg.trainable}, not the policy {policy!r} alone through its lm head"
    if alg.custom:
        return f"the algorithm has nodes of its own ({', '.join(d.fn.__name__ for d in alg.custom)})"
    if [s.model for s in alg.scores if s.grad] != [policy]:
        return "a score other than the policy's keeps a graph"
    if any(alg.models[s.model].head != "lm" for s in alg.scores):
        return "a scoring model has a value head"
    if advantage.options["scope"] != "group" or set(advantage.reads) - {"rewards", "responses", "mask"}:
        return f"the advantage {advantage.fn.__name__!r} is not per group from rewards alone"
    if set(alg.loss_fn.reads) - {"responses", "rewards", "advantages", "mask", "rollout_is_weights",
                                 *alg.scored_values()}:
        return f"the loss {alg.loss_fn.fn.__name__!r} reads values that are not per group"
    return None


def train_fusable(alg: Algorithm, shape: BatchShape) -> bool:
    return train_fusion_blocker(alg, shape) is None


def loss_name(policy: str, model: str, micro_batch: int, step: int | None = None) -> str:
    """``loss_m0`` for the policy; ``loss_critic_m0`` for another trainable model; ``loss_s2_m0`` for
    micro-batch 0 of optimizer step 2 where an iteration takes several."""
    at = f"s{step}_" if step is not None else ""
    return f"loss_{at}m{micro_batch}" if model == policy else f"loss_{model}_{at}m{micro_batch}"


def compile_iteration(
    alg: Algorithm,
    shape: BatchShape,
    engines: EngineChoice,
    dims: ModelDims,
    name: str | None = None,
) -> IterationGraph:
    with gc_paused():
        return _compile(alg, shape, engines, dims, name)


def _compile(alg: Algorithm, shape: BatchShape, engines: EngineChoice, dims: ModelDims,
             name: str | None) -> IterationGraph:
    alg.validate()
    g = IterationGraph(name or alg.name)
    blocker = train_fusion_blocker(alg, shape)
    if shape.train_fusion and blocker:  # asked for, not possible: trained after decode, and said why
        shape = dataclasses.replace(shape, train_fusion=False)
        g.meta["train_fusion_off"] = blocker
    g.meta.update(algorithm=alg.name, shape=shape, rollout_model=alg.rollout_model)
    P, G, K = shape.prompts, shape.samples, shape.chunk_tokens
    policy = alg.rollout_model
    resp_tokens = G * shape.continuation_tokens

    def role_of(model: str) -> str:
        return "train" if alg.models[model].trainable else "score"

    def add(name: str, kind: str, inputs, outputs, model=None, role=None, args=None, **value_info):
        role = role if role is not None else get_kind(kind).role
        own = alg.models[model].engine if model in alg.models else None  # a model hosted by its own engine
        engine = engines.by_kind.get(kind) or own or engines.for_node(kind, role)
        return g.add(Node(name, kind, tuple(inputs), tuple(outputs), model, engine, dict(args or {})),
                     **value_info)

    # A value's facts say what it is (role, model, prompts, chunk, label); names are only keys.
    def host(nbytes, role, **facts):
        return dict(nbytes=int(nbytes), device="host", role=role, **facts)

    def dev(nbytes, role, **facts):
        return dict(nbytes=int(nbytes), device="device", role=role, **facts)

    logprob_bytes = dims.score_bytes(resp_tokens)
    every = tuple(range(P))

    for p in range(P):
        g.add_input(f"prompt_p{p}", nbytes=shape.vision_tokens * 4 * 14 * 14 * 3 * 4, role="prompt", prompts=(p,))
    # Vision. A frozen tower is one forward per prompt that every model shares. One that trains gives
    # three: the policy's without grad for the rollout (at the iteration's start, before any update);
    # the frozen reference's own (they differ after the first step); and, per micro-batch, each trained
    # model's with grad, kept until that micro-batch's backward (made beside its prefix, below). The
    # rollout does not read the policy's vision output with grad, which would keep every micro-batch's
    # vision graph alive from the first decode chunk on.
    vision = alg.vision_model
    rollout_vision = policy if shape.trains_vision else vision

    def vision_stem(model: str) -> str:
        """The vision values a model's forwards read: ``{stem}_p{p}``."""
        if not shape.trains_vision:
            return "vis"
        if not alg.models[model].trainable:  # the frozen copies share the first one's (as the tower does)
            return f"vis_{vision if not alg.models[vision].trainable else model}"
        return "vis" if model == policy and not any(s.grad for s in alg.scores if s.model == model) else f"vis_{model}"

    def vision_nodes(model: str, groups, grad: bool, stem: str | None = None, **args) -> list[str]:
        stem, made = stem or vision_stem(model), []
        for ps in groups:
            if f"{stem}_p{ps[0]}" in g.values:
                continue
            node = f"vit_{span(ps)}" if stem == "vis" else f"vit_{model}_{span(ps)}"
            add(node, "vit_encode", [f"prompt_p{p}" for p in ps], [f"{stem}_p{p}" for p in ps], model=model,
                role=role_of(model), args={"prompts": list(ps), **({"grad": True} if grad else {}), **args},
                **{f"{stem}_p{p}": dev(dims.vision_bytes(shape.vision_tokens, grad), "vision", model=model,
                                       prompts=(p,)) for p in ps})
            made.append(node)
        return made

    vision_nodes(rollout_vision, shape.node_groups(grad=False), grad=False, stem="vis")
    if shape.trains_vision:  # the frozen models' (and any trained model's read without grad)
        for s in alg.scores:
            if not alg.models[s.model].trainable or vision_stem(s.model) == f"vis_{s.model}" and not s.grad:
                vision_nodes(s.model, shape.node_groups(grad=False), grad=False)

    # Decode: chunk 0 prefills every prompt from its vision embeddings; each chunk advances ≤ K tokens.
    # With stage fusion each chunk also hands on the groups that finished in it (``handoff_c``) and
    # the single samples (``finished_c``): a frozen model scores a sample without its group.
    def fused(score) -> bool:
        """Frozen log-prob scores go per decode chunk (stage fusion), and in a multi-turn rollout per
        turn whatever the schedule, each turn once on its sample's history (pipeline/compile/turns.py):
        the same forwards in the window or after it."""
        per_turn = shape.max_turns > 1 and shape.prefix_sharing
        return (shape.fused or per_turn) and not score.grad and alg.models[score.model].head == "lm"

    state = None
    train_fused = blocker is None  # the shape keeps train fusion only then
    # Frozen models score each chunk's finished samples (they need no group), except under train
    # fusion: a group's frozen scores are read only when it trains, so they score the groups its
    # training takes, in as many forwards as chunks that finish a group rather than one per chunk.
    samples_scored = any(fused(s) for s in alg.scores) and not train_fused

    def prefix_nodes(model: str, ps: tuple[int, ...], grad: bool, **args) -> list[str]:
        """``prefix_{model}_p{p}`` of ``ps``, made once: two scores of one model share its prefix."""
        kvs = [f"prefix_{model}_p{p}" for p in ps]
        if kvs[0] not in g.values:
            add(f"prefix_{model}_{span(ps)}", "prefix", [f"prompt_p{p}" for p in ps]
                + [f"{vision_stem(model)}_p{p}" for p in ps], kvs, model=model, role=role_of(model),
                args={"prompts": list(ps), "grad": grad, **args},
                **{kv: dev(dims.prefix_bytes(shape.prompt_tokens, grad), "kv", model=model, prompts=(p,))
                   for p, kv in zip(ps, kvs)})
        return kvs

    if shape.max_turns > 1:  # turns of decode chunks, environment steps and observations' vision
        from rollplex.pipeline.compile.turns import add_turns

        turn_scores = [s for s in alg.scores if fused(s)]  # each turn's as it ends, on its prefix
        for s in turn_scores:
            for ps in shape.node_groups(grad=False):
                prefix_nodes(s.model, ps, grad=False)
        add_turns(g, shape, add, host, dev, dims, policy, rollout_vision, role_of(rollout_vision), every,
                  scores=[(s.as_, s.model, role_of(s.model)) for s in turn_scores])
    for c in range(shape.chunks if shape.max_turns == 1 else 0):
        last = c == shape.chunks - 1
        inputs = ([f"prompt_p{p}" for p in range(P)] + [f"vis_p{p}" for p in range(P)]) if c == 0 else [state]
        outputs = [] if last else [f"decode_state_c{c}"]
        info = {f"decode_state_c{c}": host(P * resp_tokens * 8, "decode_state", model=policy, prompts=every, chunk=c)}
        if last:
            outputs += [f"responses_p{p}" for p in range(P)] + ["rollout_stats"]
            info.update({f"responses_p{p}": host(resp_tokens * 12, "responses", model=policy, prompts=(p,))
                         for p in range(P)})
            info["rollout_stats"] = host(64, "rollout_stats", model=policy, prompts=every)
        if shape.fused:  # the groups it finished (for training) and the samples (for frozen scores)
            outputs.append(f"handoff_c{c}")
            info[f"handoff_c{c}"] = host(P * resp_tokens * 12 / shape.chunks, "handoff", model=policy, prompts=every,
                                         chunk=c)
        if samples_scored:
            outputs.append(f"finished_c{c}")
            info[f"finished_c{c}"] = host(P * resp_tokens * 12 / shape.chunks, "finished", model=policy,
                                          prompts=every, chunk=c)
        add(f"decode_c{c}", "decode_chunk", inputs, outputs, model=policy,
            args={"chunk": c, "chunks": shape.chunks, "tokens": K}, **info)
        state = f"decode_state_c{c}"

    # Scores that the advantage or a node of the algorithm's own reads are needed before any loss:
    # such forwards are scoring even when they keep a graph (the serial schedule reads this arg).
    early = {r for d in (alg.advantage_fn, *alg.custom) for r in d.reads}
    early_models = {s.model for s in alg.scores if {s.as_, f"old_{s.as_}"} & early}

    # Scoring: prefix once per prompt (independent of the responses), suffix per prompt group.
    grad_nodes: dict[tuple[str, str], list[str]] = {}  # nodes whose graphs a backward will walk
    # With several optimizer steps only the first mini-batch trains on its rollout-time forwards; the
    # others' are scored without grad for their old values and scored anew before their steps.
    first = set(shape.mini_batch_prompts()[0])
    capped = bool(shape.micro_batch_tokens) and not train_fused
    if capped and (why := token_cap_blocker(alg, shape, early)):
        raise GraphError(f"train.micro_batch_tokens: {alg.name} cannot train in token-capped micro-batches: {why}")
    for s in alg.scores:
        role = role_of(s.model)
        if s.grad and (train_fused or capped):
            continue  # the training nodes run the policy's prefixes and suffixes of the groups they train
        for ps in shape.node_groups(grad=s.grad):
            grad = s.grad and ps[0] in first
            outs, score_info = [], {}
            for p in ps:
                if not s.grad or grad:
                    outs.append(f"{s.as_}_p{p}")
                    score_info[f"{s.as_}_p{p}"] = dev(dims.score_bytes(resp_tokens, grad), "score", model=s.model,
                                                      prompts=(p,), label=s.as_)
                if s.grad:
                    outs.append(f"old_{s.as_}_p{p}")
                    score_info[f"old_{s.as_}_p{p}"] = host(logprob_bytes, "score", model=s.model, prompts=(p,),
                                                           label=f"old_{s.as_}")
            args = {"prompts": list(ps), "as": s.as_, "grad": grad, "head": alg.models[s.model].head}
            if grad and s.model in early_models:
                args["feeds_advantage"] = True
            responses = [f"responses_p{p}" for p in ps]
            early_arg = {"feeds_advantage": True} if "feeds_advantage" in args else {}
            # A trained vision tower's forward with grad for this micro-batch's prompts, chained with
            # the forwards whose graphs the same backward walks.
            chain = ("suffix", s.as_) if not shape.prefix_sharing else ("prefix", s.model)
            if grad and shape.trains_vision:
                grad_nodes.setdefault(chain, []).extend(vision_nodes(s.model, [ps], grad=True, **early_arg))
            vis = [f"{vision_stem(s.model)}_p{p}" for p in ps]
            if not shape.prefix_sharing:
                add(f"score_{s.as_}_{span(ps)}", "suffix_score",
                    [f"prompt_p{p}" for p in ps] + vis + responses,
                    outs, model=s.model, role=role, args={**args, "full_sequence": True}, **score_info)
                if grad:
                    grad_nodes.setdefault(("suffix", s.as_), []).append(f"score_{s.as_}_{span(ps)}")
                continue
            kvs = prefix_nodes(s.model, ps, grad, **early_arg)
            if fused(s):
                continue  # scored per decode chunk below, or per turn (pipeline/compile/turns.py)
            add(f"suffix_{s.as_}_{span(ps)}", "suffix_score", kvs + responses, outs,
                model=s.model, role=role, args=args, **score_info)
            if grad:
                grad_nodes.setdefault(("prefix", s.model), []).append(f"prefix_{s.model}_{span(ps)}")
                grad_nodes.setdefault(("suffix", s.as_), []).append(f"suffix_{s.as_}_{span(ps)}")

        if fused(s) and shape.max_turns == 1:
            # Stage fusion: after each decode chunk, the samples (under train fusion, the groups) it
            # finished are scored on the compute stream while decode goes on; a join hands each
            # prompt's scores on under its usual name.
            kvs = [f"prefix_{s.model}_p{p}" for p in range(P)]
            tail = shape.chunks - 1 if train_fused else scoring_tail(shape.window_chunks, shape.chunks)
            chunk_outs = [f"{s.as_}_c{c}" for c in range(tail + 1)]
            for c, out in enumerate(chunk_outs):
                handed = range(c, shape.chunks) if c == tail else [c]  # the last node: every chunk left
                handoffs = [f"{'handoff' if train_fused else 'finished'}_c{k}" for k in handed]
                # What it scores (the cost model reads it): the groups or samples of these chunks.
                add(f"suffix_{s.as_}_c{c}", "suffix_score", kvs + handoffs, [out],
                    model=s.model, role=role, args={"prompts": list(range(P)), "as": s.as_, "grad": False,
                                                    "head": alg.models[s.model].head, "handoff_chunk": c,
                                                    "handed_chunks": list(handed),
                                                    "handed": "groups" if train_fused else "samples"},
                    **{out: dev(logprob_bytes * P * len(handed) / shape.chunks, "score", model=s.model, prompts=every,
                                chunk=c, label=s.as_)})
            add(f"join_{s.as_}", "join", chunk_outs, [f"{s.as_}_p{p}" for p in range(P)],
                args={"prompts": list(range(P)), "samples": G},
                **{f"{s.as_}_p{p}": dev(logprob_bytes, "score", model=s.model, prompts=(p,), label=s.as_)
                   for p in range(P)})

    if train_fused:
        return _compile_train_fusion(g, alg, shape, add, host, dev, logprob_bytes)
    for p in range(P):
        add(f"reward_p{p}", "reward", [f"prompt_p{p}", f"responses_p{p}"], [f"rewards_p{p}"],
            args={"prompt": p}, **{f"rewards_p{p}": host(G * 4, "rewards", prompts=(p,))})

    # Functions (custom nodes, advantage, loss) read values by name; `bind` maps each parameter to
    # the graph value holding it for each prompt group, with the group index where that value is
    # batch-level (one value for all groups).
    group_scope = alg.advantage_fn.options["scope"] == "group"
    batch_level = {c.options["writes"] for c in alg.custom if c.options["per"] == "batch"}
    if not group_scope:
        batch_level.add("advantages")

    def value_of(name: str, p: int) -> tuple[str, int | None]:
        if name in ("responses", "mask", "rollout_is_weights"):  # the weights: from its decode log-probs
            return f"responses_p{p}", None
        if name in ("prompt", "vision"):
            return f"{'vis' if name == 'vision' else name}_p{p}", None
        if name in batch_level:
            return name, p
        return f"{name}_p{p}", None

    def bind(reads, groups) -> tuple[dict, list[str]]:
        binding = {r: [value_of(r, p) for p in groups] for r in reads}
        inputs = list(dict.fromkeys(v for pairs in binding.values() for v, _ in pairs))
        return binding, inputs

    for decl in alg.custom:
        writes, kind = decl.options["writes"], decl.options["kind"]
        groups_list = [[p] for p in range(P)] if decl.options["per"] == "prompt" else [list(range(P))]
        for groups in groups_list:
            binding, inputs = bind(decl.reads, groups)
            out = f"{writes}_p{groups[0]}" if decl.options["per"] == "prompt" else writes
            name = f"{decl.name}_p{groups[0]}" if decl.options["per"] == "prompt" else decl.name
            add(name, kind, inputs, [out], model=decl.options["model"],
                args={"prompts": groups, "bind": binding, "function": decl.name},
                **{out: host(G * len(groups) * 64, "custom", model=decl.options["model"], prompts=tuple(groups),
                             label=writes)})

    adv_reads = tuple(dict.fromkeys(("rewards", "responses", *alg.advantage_fn.reads)))
    if group_scope:
        for p in range(P):
            binding, inputs = bind(adv_reads, [p])
            add(f"advantage_p{p}", "advantage", inputs, [f"advantages_p{p}"],
                args={"prompts": [p], "bind": binding}, **{f"advantages_p{p}": host(G * 4, "advantages", prompts=(p,))})
    else:
        binding, inputs = bind(adv_reads, range(P))
        add("advantage", "advantage", inputs, ["advantages"], args={"prompts": list(range(P)), "bind": binding},
            advantages=host(P * G * 4, "advantages", prompts=every))

    add_updates(g, alg, shape, add, host, dev, dims, bind, value_of, grad_nodes, early)
    return g.lint()


def _compile_train_fusion(g: IterationGraph, alg: Algorithm, shape: BatchShape, add, host, dev,
                          logprob_bytes: int) -> IterationGraph:
    """The update per decode chunk (``train_fusable``): ``train_c{c}`` takes the groups chunk c
    finished, with their frozen scores of that chunk, and runs reward, advantage, the policy's prefix
    and suffix with grad, the loss and its backward. The prefix runs there, not in a node of its own:
    a prefix graph made before decode ends would be held until its group finishes, and its forward
    would run beside the heaviest decode chunks. Joins hand rewards, advantages and
    old log-probs on under their per-prompt names; the optimizer step divides the summed gradient by
    the batch's tokens (or responses), which the last chunk knows."""
    P, G = shape.prompts, shape.samples
    policy = alg.rollout_model
    (score,) = [s for s in alg.scores if s.grad]
    frozen = [s for s in alg.scores if not s.grad]
    every = tuple(range(P))
    old = f"old_{score.as_}"
    per_chunk = {"rewards": host(G * 4 * P / shape.chunks, "rewards"),
                 "advantages": host(G * 4 * P / shape.chunks, "advantages"),
                 old: host(logprob_bytes * P / shape.chunks, "score", model=policy, label=old)}
    losses = []
    for c in range(shape.chunks):
        outs = [f"{name}_c{c}" for name in per_chunk] + [loss_name(policy, policy, c)]
        # A group's samples were scored by the frozen models in this chunk or earlier ones.
        # A vision tower that trains runs with grad inside the node, on the groups it trains.
        vis = [] if shape.trains_vision else [f"vis_p{p}" for p in range(P)]
        inputs = ([f"prompt_p{p}" for p in range(P)] + vis
                  + [f"{s.as_}_c{k}" for s in frozen for k in range(c + 1)] + [f"handoff_c{c}"])
        add(f"train_c{c}", "loss", inputs, outs, model=policy,
            args={"prompts": list(range(P)), "handoff_chunk": c, "handed_chunks": [c], "handed": "groups",
                  "as": score.as_, "frozen": [s.as_ for s in frozen], "agg": alg.loss_fn.options["agg"],
                  "micro_batch_groups": shape.micro_batch_groups,
                  **({"batch_tokens": shape.fusion_batch_tokens} if shape.fusion_batch_tokens else {}),
                  **({"vision_grad": True} if shape.trains_vision else {})},
            **{f"{name}_c{c}": {**info, "prompts": every, "chunk": c} for name, info in per_chunk.items()},
            **{loss_name(policy, policy, c): host(64, "loss", model=policy, prompts=every, chunk=c)})
        losses.append(loss_name(policy, policy, c))
    for name, info in per_chunk.items():
        add(f"join_{name}", "join", [f"{name}_c{c}" for c in range(shape.chunks)], [f"{name}_p{p}" for p in range(P)],
            args={"prompts": list(range(P))}, **{f"{name}_p{p}": {**info, "prompts": (p,)} for p in range(P)})
    add("optimizer_step", "optimizer_step", ["rollout_stats", *losses], ["step"], model=policy,
        args={"deferred_normaliser": "tokens" if alg.loss_fn.options["agg"] == "token-mean" else "sequences"},
        step=host(64, "step", model=policy))
    add("weight_sync", "weight_sync", ["step"], ["synced"], model=policy, synced=host(64, "synced", model=policy))
    report_inputs = ["rollout_stats", "step", "synced", *losses]
    for p in range(P):
        report_inputs += [f"prompt_p{p}", f"responses_p{p}", f"rewards_p{p}", f"advantages_p{p}"]
        report_inputs += [f"old_{s.as_}_p{p}" if s.grad else f"{s.as_}_p{p}" for s in alg.scores]
    add("report", "report", list(dict.fromkeys(report_inputs)), ["report"],
        args={} if shape.prefix_sharing else {"prefix_sharing": False},
        report=host(P * G * 256, "report", prompts=every))
    g.connect()
    for c in range(1, shape.chunks):  # gradients accumulate in chunk order, the same bits under any schedule
        g.add_order(f"train_c{c - 1}", f"train_c{c}", reason="accumulation order")
    return g.lint()
