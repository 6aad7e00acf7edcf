"""The update of a compiled iteration: losses with their backwards, optimizer steps, the weight sync
and the report (``compiler.compile_iteration`` calls ``add_updates`` once the advantages are placed).

One loss per trainable model (the policy's first) per micro-batch, each with its backward on that
model's engine, then an optimizer step per trained model. With ``BatchShape.mini_batches`` M and
``epochs`` E (``train.mini_batches``, ``train.epochs``) the prompt groups split into M mini-batches,
each an optimizer step, passed over E times: M·E steps per trained model, ``s0`` … ``s{M·E−1}``,
mini-batch ``k mod M`` at step k. Step 0 trains on the forwards made at rollout time (the policy's
prefix in the decode window, as with one step). Every later step scores its mini-batch anew under the
weights the steps before it left, prefix once per prompt and suffix with grad
(``prefix_actor_s2_p0``, ``suffix_logprobs_s2_p0``); its ``old_`` values are still those of rollout
time, so the ratio π/π_old moves away from 1 and the clip binds. Each step's loss is the mean over
its own mini-batch's tokens (or responses). One weight sync follows the policy's last step. With
``micro_batch_tokens`` (one step only, ``token_cap_blocker``) the policy's loss node makes its
forwards with grad and old log-probs itself, in backwards cut by tokens (tasks/capped_train.py).

Ordering edges make the update the same under every schedule:

    rollout-time forwards of model X ──▶ X's step 0        (old values are the rollout-time weights')
    X's step k−1 ──▶ X's forwards of step k ──▶ its losses ──▶ X's step k
    within a step, micro-batches (and the forwards their backwards walk) in order
"""
from __future__ import annotations

from rollplex.errors import GraphError
from rollplex.pipeline.compile.ir import IterationGraph


def step_name(policy: str, model: str, step: int | None) -> tuple[str, str]:
    """(optimizer step node, its output value) of ``model`` at ``step`` (None: the only one)."""
    at = "" if step is None else f"_s{step}"
    if model == policy:
        return f"optimizer_step{at}", f"step{at}"
    return f"optimizer_step_{model}{at}", f"step_{model}{at}"


def add_updates(g: IterationGraph, alg, shape, add, host, dev, dims, bind, value_of, grad_nodes, early) -> None:
    """Add the losses, optimizer steps, weight sync and report of ``shape`` to ``g`` (the compiler's
    expansion up to the advantages), connect it and add the ordering edges. ``grad_nodes`` holds the
    rollout-time forwards whose graphs step 0's backwards walk, keyed ("prefix", model) or
    ("suffix", score); ``early`` the values the advantage or a node of the algorithm's own reads."""
    from rollplex.pipeline.compile.compiler import loss_name

    policy, P, G = alg.rollout_model, shape.prompts, shape.samples
    steps, minis = shape.steps, shape.mini_batch_prompts()
    trained = list(alg.losses())
    if steps > 1:
        _check_rescorable(alg, early)
    # What a model's forwards at rollout time are: they must all run before its first step.
    rollout_time = {m: [n.name for n in g if n.model == m and n.kind in ("prefix", "suffix_score")] for m in trained}
    others = {v for v, m in alg.scored_values().items() if m != policy and alg.models[m].trainable}
    chains: list[list[str]] = []
    orders: list[tuple[str, str, str]] = []
    loss_outputs: dict[str, list[str]] = {}
    step_values: list[str] = []
    last: dict[str, str] = {}  # model -> its latest optimizer step node
    early_models = {s.model for s in alg.scores if {s.as_, f"old_{s.as_}"} & early}
    for k in range(steps):
        mini = k % shape.mini_batches
        micro = shape.micro_batches(mini)
        at = k if steps > 1 else None
        if k == 0:
            forwards, renamed = grad_nodes, {}
        else:
            forwards, renamed = _rescore(g, alg, shape, add, dev, dims, k, mini)
            for model, step in last.items():
                orders += [(step, n, "update order") for (kind, key), names in forwards.items() for n in names
                           if g.nodes[n].model == model]
        # A loss holds the grad-scored values of its own model (their graphs live until its backward)
        # and what its function reads.
        losses: dict[str, list[str]] = {}
        for model, decl in alg.losses().items():
            own = {v for v, m in alg.scored_values().items() if m == model}
            scored = [v for v in alg.scored_values() if v not in others] if model == policy else sorted(own)
            reads = tuple(dict.fromkeys(("responses", "rewards", "advantages", *scored, *decl.reads)))
            # train.micro_batch_tokens: the micro-batch's node makes the policy's log-probs itself
            # (token_cap_blocker held), in backwards it cuts by tokens once the responses are known.
            made = next(s.as_ for s in alg.scores if s.grad) if model == policy and shape.micro_batch_tokens else None
            if made:
                reads = tuple(r for r in reads if r not in (made, f"old_{made}"))
            for j, groups in enumerate(micro):
                binding, inputs = bind(reads, groups)
                if renamed:  # this step's forwards in place of rollout time's
                    binding = {r: [(renamed.get(v, v), i) for v, i in pairs] for r, pairs in binding.items()}
                    inputs = list(dict.fromkeys(v for pairs in binding.values() for v, _ in pairs))
                out = loss_name(policy, model, j, at)
                args = {"prompts": list(groups), "bind": binding}
                if at is not None:  # normalised over its own mini-batch
                    args.update(step=k, normalise=list(minis[mini]))
                outputs, info = [out], {out: host(64, "loss", model=model, prompts=tuple(groups))}
                if made:
                    inputs = list(dict.fromkeys([*(f"prompt_p{p}" for p in groups), *(f"vis_p{p}" for p in groups),
                                                 *inputs]))
                    args.update({"as": made, "micro_batch_tokens": shape.micro_batch_tokens})
                    outputs += [f"old_{made}_p{p}" for p in groups]
                    info.update({f"old_{made}_p{p}": host(dims.score_bytes(G * shape.continuation_tokens), "score",
                                                          model=model, prompts=(p,), label=f"old_{made}")
                                 for p in groups})
                add(out, "loss", ["rollout_stats", *inputs], outputs, model=model, args=args, **info)
                losses.setdefault(model, []).append(out)
        # Gradients accumulate in floating point, so their order fixes the bits of the update: chain
        # the micro-batches, and the forwards whose graphs they walk (autograd orders a backward by the
        # creation order of the forward's ops), so that every schedule sums them in the same order.
        chains += [*losses.values(), *forwards.values()]
        chains += _memory_bounds(g, shape, policy, forwards, micro, at, early if k == 0 else set(),
                                 early_models if k == 0 else set())
        previous_step = None
        for model, outs in losses.items():
            node, value = step_name(policy, model, at)
            add(node, "optimizer_step", outs, [value], model=model, **{value: host(64, "step", model=model)})
            # Two trained models (PPO's actor and critic) reduce gradients over the same ranks: one
            # model's backwards and step before the next's, so every rank meets the collectives in
            # the same order.
            if previous_step is not None:
                orders += [(previous_step, loss, "collective order") for loss in outs]
            previous_step = node
            if k == 0 and steps > 1:
                orders += [(n, node, "rollout-time weights") for n in rollout_time[model]]
            last[model] = node
            step_values.append(value)
            loss_outputs.setdefault(model, []).extend(outs)
    add("weight_sync", "weight_sync", [step_name(policy, policy, steps - 1 if steps > 1 else None)[1]], ["synced"],
        model=policy, synced=host(64, "synced", model=policy))

    report_inputs = ["rollout_stats", *step_values, "synced", *(o for outs in loss_outputs.values() for o in outs)]
    for p in range(P):
        report_inputs += [f"prompt_p{p}", f"responses_p{p}", f"rewards_p{p}", value_of("advantages", p)[0]]
        for s in alg.scores:
            report_inputs.append(f"old_{s.as_}_p{p}" if s.grad else f"{s.as_}_p{p}")
    add("report", "report", list(dict.fromkeys(report_inputs)), ["report"],
        args={**({"steps": steps, "epochs": shape.epochs} if steps > 1 else {}),
              **({} if shape.prefix_sharing else {"prefix_sharing": False})},
        report=host(P * G * 256, "report", prompts=tuple(range(P))))
    g.connect()
    for chain in chains:
        for before, after in zip(chain, chain[1:]):
            if before in g.nodes and after in g.nodes:
                g.add_order(before, after, reason="accumulation order")
    for before, after, reason in orders:
        g.add_order(before, after, reason=reason)


def token_cap_blocker(alg, shape, early: set[str]) -> str | None:
    """Why the policy's micro-batches cannot train in token-capped backwards of one node each
    (``BatchShape.micro_batch_tokens``), or None: one optimizer step, one turn, prefix sharing, the
    policy alone trained through its lm head with a frozen vision tower, and its log-probs read by
    the loss only (the node makes them)."""
    policy = alg.rollout_model
    if shape.steps > 1:
        return f"it takes {shape.steps} optimizer steps per iteration (train.mini_batches × train.epochs)"
    if shape.max_turns > 1:
        return "a multi-turn rollout scores whole trajectories"
    if not shape.prefix_sharing:
        return "it needs prefix sharing"
    if shape.trains_vision:
        return "the vision tower trains (train.freeze_vision: false)"
    if alg.trainable != [policy] or list(alg.losses()) != [policy] or alg.models[policy].head != "lm":
        return f"it trains {alg.trainable}, not the policy {policy!r} alone through its lm head"
    grad = [s for s in alg.scores if s.grad]
    if [s.model for s in grad] != [policy]:
        return "a score other than the policy's keeps a graph"
    if {grad[0].as_, f"old_{grad[0].as_}"} & early:
        return f"the advantage or a node of the algorithm's own reads {grad[0].as_!r} before the loss"
    return None


def _check_rescorable(alg, early: set[str]) -> None:
    """A later step's forwards are scored anew, after the steps before it; a value read before any
    step (by the advantage or a node of the algorithm's own) can only be the rollout-time one."""
    grad_scores = {s.as_ for s in alg.scores if s.grad}
    read = sorted(grad_scores & early)
    if read:
        raise GraphError(f"train.mini_batches × train.epochs > 1: the advantage or a node of {alg.name} reads "
                         f"{read}, which later steps score anew under updated weights; read "
                         f"{', '.join('old_' + r for r in read)} (the rollout-time values) instead")


def _rescore(g: IterationGraph, alg, shape, add, dev, dims, k: int, mini: int):
    """Step k's forwards with grad of every trained model's scores over mini-batch ``mini``: a prefix
    per prompt (shared by two scores of one model) and the suffix on it, or one full-sequence forward
    without prefix sharing. Returns them as ``grad_nodes`` does and {rollout-time value: step-k value}."""
    from rollplex.pipeline.compile.compiler import _split, span

    resp_tokens = shape.samples * shape.max_new_tokens
    forwards: dict[tuple[str, str], list[str]] = {}
    renamed: dict[str, str] = {}
    groups = [part for mb in shape.micro_batches(mini) for part in _split(mb, shape.prompts_per_node)]
    for s in (s for s in alg.scores if s.grad):
        head, model = alg.models[s.model].head, s.model
        for ps in groups:
            outs = [f"{s.as_}_s{k}_p{p}" for p in ps]
            renamed.update({f"{s.as_}_p{p}": out for p, out in zip(ps, outs)})
            info = {out: dev(dims.score_bytes(resp_tokens, True), "score", model=model, prompts=(p,), label=s.as_)
                    for p, out in zip(ps, outs)}
            args = {"prompts": list(ps), "as": s.as_, "grad": True, "head": head, "step": k}
            prompts, visions = [f"prompt_p{p}" for p in ps], [f"vis_p{p}" for p in ps]
            responses = [f"responses_p{p}" for p in ps]
            if not shape.prefix_sharing:
                name = f"score_{s.as_}_s{k}_{span(ps)}"
                add(name, "suffix_score", prompts + visions + responses, outs, model=model, role="train",
                    args={**args, "full_sequence": True}, **info)
                forwards.setdefault(("suffix", s.as_), []).append(name)
                continue
            kvs = [f"prefix_{model}_s{k}_p{p}" for p in ps]
            if kvs[0] not in g.values:  # two scores of one model share its prefix
                name = f"prefix_{model}_s{k}_{span(ps)}"
                add(name, "prefix", prompts + visions, kvs, model=model, role="train",
                    args={"prompts": list(ps), "grad": True, "step": k},
                    **{kv: dev(dims.prefix_bytes(shape.prompt_tokens, True), "kv", model=model, prompts=(p,))
                       for p, kv in zip(ps, kvs)})
                forwards.setdefault(("prefix", model), []).append(name)
            name = f"suffix_{s.as_}_s{k}_{span(ps)}"
            add(name, "suffix_score", kvs + responses, outs, model=model, role="train", args=args, **info)
            forwards.setdefault(("suffix", s.as_), []).append(name)
    return forwards, renamed


def _memory_bounds(g: IterationGraph, shape, policy: str, forwards, micro, at, early, early_models) -> list[list[str]]:
    """Ordering pairs that bound the graphs alive at once within one step. A micro-batch's suffix
    forward with grad starts after the previous micro-batch's backward of its model: at most one
    micro-batch of suffix graphs is alive (prefix graphs, made in the decode window, wait), and with
    ``grad_prefix_lookahead`` N a prefix waits for the loss N micro-batches before its own. Not for
    rollout-time scores the advantage or a node of the algorithm's own reads (GAE reads a critic's
    values): they are scoring, needed before any loss, and all their graphs are alive at once."""
    from rollplex.pipeline.compile.compiler import loss_name

    mb_of = {p: m for m, groups in enumerate(micro) for p in groups}
    lookahead, pairs = shape.grad_prefix_lookahead, []
    for (kind, key), nodes in forwards.items():
        if kind == "suffix" and not {key, f"old_{key}"} & early:
            for name in nodes:
                m = mb_of[g.nodes[name].args["prompts"][0]]
                if m > 0:
                    pairs.append([loss_name(policy, g.nodes[name].model, m - 1, at), name])
        elif kind == "prefix" and lookahead and key not in early_models:  # key: the model, for prefixes
            for name in nodes:
                m = mb_of[g.nodes[name].args["prompts"][0]]
                if m >= lookahead:
                    pairs.append([loss_name(policy, g.nodes[name].model, m - lookahead, at), name])
    return pairs
