"""What occupies a GPU during an iteration, in bytes, from the model, the workload and the layout.

- ``annotate``: a copy of the compiled graph whose scores weigh what the sampled response lengths
  make them (the compiler sizes them at the length cap), through the one byte model
  (``compiler.ModelDims``), and whose nodes carry ``meta["workspace"]``, the transient bytes per GPU
  while they run.
- ``residents``: the tensors outside the graph, each with the nodes that use it: actor weights,
  gradients, fp32 master weights and Adam moments (sharded by TP and, per ZeRO stage, by DP),
  frozen reference weights, the rollout engine's weights in its own TP layout, and its KV pool.
- ``breakdown``: the bytes live at one moment, grouped into the terms people reason with.
"""
from __future__ import annotations

from dataclasses import replace

from rollplex.pipeline.plan.costs import MAX_LOGIT_TOKENS, CostModel
from rollplex.pipeline.compile.ir import IterationGraph, Node
from rollplex.pipeline.plan.memory import Resident
from rollplex.pipeline.plan.schedule import copy_graph, rebuild

GiB = 1024**3


def annotate(graph: IterationGraph, cm: CostModel) -> IterationGraph:
    """bf16 value bytes, ``workspace`` per node, and in ``actor_forward="recompute"`` mode actor
    forwards that score without grad, re-run by the loss: the suffix always, the prefix too when
    ``cm.recompute_prefix`` (barrier policies: verl computes old log-probs in a separate pass)."""
    w, dims = cm.w, cm.dims
    L = w.prefix_tokens
    recompute = w.actor_forward == "recompute"
    nodes, infos = [], {}
    for node in graph:
        args = dict(node.args)
        prompts = list(args.get("prompts", [args["prompt"]] if "prompt" in args else []))
        if recompute and args.get("grad") and (node.kind == "suffix_score"
                                               or (node.kind == "prefix" and cm.recompute_prefix)):
            args.update(grad=False, recompute_in_loss=True)
        grad = bool(args.get("grad"))
        full = bool(args.get("full_sequence"))
        for out in node.outputs:
            v = graph.values[out]
            if v.device != "device":
                continue
            p = v.prompts[0] if len(v.prompts) == 1 else None
            nbytes = v.nbytes
            if node.kind == "vit_encode":
                nbytes = dims.vision_bytes(w.vision_total)
            elif node.kind == "prefix":
                nbytes = dims.prefix_bytes(L, grad)
            elif node.kind == "suffix_score" and p is not None:  # the sampled lengths, not the cap
                nbytes = dims.score_bytes(sum(cm.profile.lengths[p]), grad, cm.tokens(p, full))
            infos[out] = replace(v, nbytes=int(nbytes))
        meta = dict(node.meta)
        meta["workspace"] = int(_workspace(cm, node.kind, prompts, full))
        nodes.append(Node(node.name, node.kind, node.inputs, node.outputs, node.model, node.engine, args, meta))
    out = rebuild(graph, nodes, infos)
    # A forward that no longer keeps a graph for the backward need not follow the accumulation
    # order (the compiler chains grad forwards with each other and after the previous backward).
    for node in nodes:
        if node.args.get("recompute_in_loss"):
            for u in list(out.g.predecessors(node.name)):
                if out.g.edges[u, node.name]["reason"] == "accumulation order":
                    out.remove_edge(u, node.name)
    return out


def _workspace(cm: CostModel, kind: str, prompts: list[int], full: bool) -> float:
    """Transient bytes per GPU: fp32 logits of one chunk of tokens and one layer's activations."""
    m, w, lay = cm.m, cm.w, cm.layout
    if kind not in ("vit_encode", "prefix", "suffix_score", "loss"):
        return 0.0
    if kind == "vit_encode":
        return len(prompts) * w.vision_total * 4 * m.vit_hidden * 34 / lay.tp_train
    if kind == "prefix":
        tokens = len(prompts) * w.prefix_tokens
    else:
        tokens = sum(cm.tokens(p, full) for p in prompts)
    gpus = lay.tp_train if kind != "loss" else len(lay.train)
    logits = min(tokens, MAX_LOGIT_TOKENS) * m.vocab * 4 * (2 if kind == "loss" else 1) / lay.tp_train
    layer = (34 if kind == "loss" else 8) * m.hidden * tokens / gpus
    return logits + layer


def residents(graph: IterationGraph, cm: CostModel) -> list[Resident]:
    """The tensors outside the graph, placed per the cost model's layout."""
    lay, m = cm.layout, cm.m
    policy = graph.meta.get("rollout_model", "actor")
    by_kind: dict[str, list[Node]] = {}
    for node in graph:
        by_kind.setdefault(node.kind, []).append(node)
    order = {n: i for i, n in enumerate(graph.topological_order())}

    def named(kinds, model=None):
        return [n.name for k in kinds for n in by_kind.get(k, []) if model is None or n.model == model]

    # The vision tower is frozen (common in RL recipes, and the graph has no ViT backward): one
    # frozen copy serves rollout, reference and actor; only the LM trains.
    actor_reads = named(["prefix", "suffix_score", "loss"], policy) + named(["weight_sync"])
    losses = sorted(named(["loss"]), key=order.__getitem__)
    opt = named(["optimizer_step"])
    train = tuple(lay.train)
    W = m.lm_params
    vit_pool, vit_tp = (lay.train, lay.tp_train) if lay.colocated else (lay.rollout, lay.tp_rollout)
    def resident(model: str, part: str, *args, **kw) -> Resident:  # named <model>.<part>
        return Resident(f"{model}.{part}", *args, model=model, part=part, **kw)

    out = [
        resident("vision", "weights", tuple(vit_pool), m.vit_params * 2 / vit_tp,
                 tuple((n, "read") for n in named(["vit_encode"])), frozen=True, what="weights"),
        resident(policy, "weights", train, W * 2 / cm.shard("weights"),
                 tuple((n, "read") for n in actor_reads) + tuple((n, "write") for n in opt), what="weights"),
        resident(policy, "grads", train, W * 2 / cm.shard("grads"),
                 tuple((n, "write" if i == 0 else "read") for i, n in enumerate(losses))
                 + tuple((n, "read") for n in opt), what="grads"),
        resident(policy, "master", train, W * 4 / cm.shard("optimizer"),
                 tuple((n, "read") for n in opt), what="optimizer"),
        resident(policy, "adam", train, W * 8 / cm.shard("optimizer"),
                 tuple((n, "read") for n in opt), what="optimizer"),
    ]
    frozen = sorted({n.model for n in graph if n.model and n.model != policy and n.kind in ("prefix", "suffix_score")})
    for model in frozen:
        uses = [n.name for k in ("prefix", "suffix_score") for n in by_kind.get(k, [])
                if n.model == model and not n.args.get("cached")]
        shard = lay.tp_train * (lay.train_dp if cm.w.zero >= 3 else 1)
        out.append(resident(model, "weights", train, W * 2 / shard, tuple((n, "read") for n in uses),
                            frozen=True, what="weights"))
    decode = sorted(named(["decode_chunk"]), key=order.__getitem__)
    rollout = tuple(lay.rollout)
    out.append(resident("rollout", "weights", rollout, cm.rollout_copy_bytes(),
                        tuple((n, "read") for n in decode) + tuple((n, "write") for n in named(["weight_sync"])),
                        what="weights"))
    out.append(resident("rollout", "kv_pool", rollout, cm.kv_pool_bytes(),
                        tuple((n, "write" if i == 0 else "read") for i, n in enumerate(decode)), what="kv pool"))
    return out


TERMS = (("weights", "weights (actor, frozen, rollout copy)"), ("grads", "gradients"),
         ("optimizer", "optimizer (fp32 master + Adam m, v)"), ("kv pool", "decode KV pool"),
         ("kv", "prefix KV + activations kept for the backward"), ("embeddings", "vision embeddings"),
         ("logprobs", "suffix outputs (+ activations)"), ("workspace", "transient workspace (logits, one layer)"))
TERM_OF_ROLE = {"kv": "kv", "vision": "embeddings", "score": "logprobs"}  # a device value's term; others: its role


def breakdown(live: list[tuple[str, float]], graph: IterationGraph, rs: list[Resident]) -> list[tuple[str, float]]:
    """Group ``(tensor, bytes)`` (graph values, residents and ``memory``'s workspaces) into TERMS
    (plus one row per other kind)."""
    what = {r.name: r.what for r in rs}
    totals: dict[str, float] = {}
    for name, nbytes in live:
        if name in what:
            key = what[name]
        elif name in graph.values:
            role = graph.values[name].role
            key = TERM_OF_ROLE.get(role, role)
        else:  # not a tensor of the graph or a resident: a node's transient workspace
            key = "workspace"
        totals[key] = totals.get(key, 0.0) + nbytes
    rows = [(label, totals.pop(key, 0.0)) for key, label in TERMS]
    rows += [(key, b) for key, b in sorted(totals.items())]
    return [(label, b) for label, b in rows if b > 0]


def copy_with_cache_hits(graph: IterationGraph, cm: CostModel, hit) -> IterationGraph:
    """Reference prefix nodes whose prompts all hit the cross-iteration cache load their KV and
    last logits from host memory (a copy) instead of running: ``hit(prompt) -> bool``."""
    policy = graph.meta.get("rollout_model", "actor")
    responses = {v.prompts[0]: v.name for v in graph.of_role("responses") if len(v.prompts) == 1}
    nodes = []
    kv = cm.dims.prefix_bytes(cm.w.prefix_tokens)
    for node in graph:
        prompts = list(node.args.get("prompts", []))
        if node.kind == "prefix" and node.model != policy and prompts and all(hit(p) for p in prompts):
            # No vision tower needed; loaded once its group's responses exist, just before its suffix.
            inputs = tuple(v for v in node.inputs if graph.values[v].role != "vision") + tuple(
                responses[p] for p in prompts if p in responses)
            node = Node(node.name, node.kind, inputs, node.outputs, node.model, node.engine,
                        {**node.args, "cached": True, "bytes_per_gpu": kv * len(prompts) / cm.layout.tp_train},
                        dict(node.meta))
        nodes.append(node)
    return rebuild(graph, nodes) if nodes else copy_graph(graph)
