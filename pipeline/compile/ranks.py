"""Data parallelism: one compiled iteration spread over R ranks, one Dask worker per rank.

``distribute(graph, R)`` is a pure pass from the single-rank iteration to an R-rank one:

    requires  P prompts with P % R == 0; no node over prompts (vision, prefix, suffix, reward, loss)
              spans two ranks' prompts, except host-only work (a batch-level advantage)
    call      rank r owns prompts [r·P/R, (r+1)·P/R). Per-prompt nodes go to their prompts' rank.
              Decode splits into one chain per rank (each rank's engine decodes its own prompts), and a
              host ``gather`` sums the ranks' rollout stats, so every loss still divides by the global
              batch's tokens. optimizer_step, weight_sync and report are replicated per rank; each
              rank's loss is scaled by R because DeepSpeed averages gradients over ranks, so the
              all-reduced update equals the single-rank one. A ``gather`` report merges the ranks'.
              Accumulation-order edges between ranks are dropped: each rank sums its own micro-batches.
              Under stage fusion each rank's chain hands on its own finished samples and groups, and
              the nodes that work on them (frozen scoring, train fusion's ``train_c``) split per rank.
              With ``tp_rollout`` K, each K consecutive ranks form one tensor-parallel decode engine:
              every rank's chain decodes the group's prompts (a step needs every rank of the group)
              and hands on its own; each vision node gets a copy on the group's other ranks.
    ensures   ``node.meta["rank"]`` (and "placement", ``rankR``) on every node; ``check_placement``: a value read on another rank
              than its producer's is host data (and its producer's other outputs too, since Dask moves
              a node's whole output bundle), so device tensors never leave their worker.

The executor turns ranks into Dask ``workers=`` restrictions (``executor.lower``), and the runner feeds
each iteration's prompts to the slots balanced by predicted cost (``balance``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from rollplex.errors import ConfigError, GraphError
from rollplex.pipeline.compile.ir import IterationGraph, Node, Value

REPLICATED = ("optimizer_step", "weight_sync", "report")  # one per rank: each rank steps its own engine


@dataclass(frozen=True)
class RankLayout:
    prompts: int
    ranks: int
    tp_rollout: int = 1  # ranks per tensor-parallel decode group: consecutive ranks decode together

    @property
    def per_rank(self) -> int:
        return self.prompts // self.ranks

    def rank_of(self, prompt: int) -> int:
        return prompt // self.per_rank

    def prompts_of(self, rank: int) -> list[int]:
        return list(range(rank * self.per_rank, (rank + 1) * self.per_rank))

    def tp_peers(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s tensor-parallel decode group, itself included."""
        return next(group for group in tp_groups(self.ranks, self.tp_rollout) if rank in group)

    def decoded_by(self, rank: int) -> list[int]:
        """The prompts ``rank``'s decode engine samples: its own, and with tensor parallelism its
        group's, since every rank of a group runs every step of the same batch."""
        return [p for peer in self.tp_peers(rank) for p in self.prompts_of(peer)]


def tp_groups(ranks: int, size: int) -> list[list[int]]:
    """The tensor-parallel decode groups: each ``size`` consecutive ranks. The graph (which prompts a
    rank decodes) and the workers (which ranks a process group joins) both read it."""
    return [list(range(first, first + size)) for first in range(0, ranks, size)]


def fit_prompts_per_node(prompts_per_node: int, per_rank: int) -> int:
    """The largest prompts-per-node ≤ the wish that divides a rank's prompts (no node spans ranks)."""
    return max(d for d in range(1, per_rank + 1) if per_rank % d == 0 and d <= max(prompts_per_node, 1))


def check_data_parallel(workers: int, prompts: int, micro_batch_groups: int, train_engine: str,
                        zero_stage: int, decode_engine: str, processes: bool = True, tp_rollout: int = 1) -> None:
    """Refuse settings a multi-rank run cannot honour, naming the config field."""
    if tp_rollout > 1:
        if workers % tp_rollout:
            raise ConfigError(f"cluster.tp_rollout ({tp_rollout}) must divide cluster.workers ({workers}): each "
                              f"tensor-parallel decode group is that many workers")
        if decode_engine != "torch-graph":
            raise ConfigError(f"cluster.tp_rollout={tp_rollout} needs engines.decode=torch-graph, the decode engine "
                              f"that splits its heads over ranks; engines.decode is {decode_engine!r}")
    if workers <= 1:
        return
    if not processes:
        raise ConfigError(f"cluster.processes: false puts all {workers} workers in one process, which can hold "
                          f"only one torch.distributed rank; data-parallel ranks need processes: true")
    if prompts % workers:
        raise ConfigError(f"rollout.prompts_per_iteration ({prompts}) must be a multiple of cluster.workers "
                          f"({workers}): each rank takes an equal share of the batch")
    per_rank = prompts // workers
    if per_rank % micro_batch_groups:
        raise ConfigError(f"train.micro_batch_groups ({micro_batch_groups}) must divide the prompts per rank "
                          f"({per_rank}): every rank needs the same number of micro-batches (ZeRO reduces "
                          f"gradients in lock-step)")
    if train_engine not in ("deepspeed", "torch"):
        raise ConfigError(f"cluster.workers={workers} trains data-parallel with DeepSpeed or the torch engine "
                          f"(each averages the ranks' gradients); engines.train is {train_engine!r}")
    if zero_stage > 2:
        raise ConfigError(f"train.zero_stage 3 with cluster.workers={workers}: ZeRO-3 gathers parameters in "
                          f"every forward, which would need every rank's forwards in lock-step; use 0-2")
    if decode_engine == "vllm":
        raise ConfigError(f"engines.decode=vllm with cluster.workers={workers} is not supported yet: in-process "
                          f"vLLM sets up torch.distributed state of its own, which has not been made to share the "
                          f"ranks' group; use engines.decode=hf or torch-graph")


def _prompts(node: Node) -> list[int]:
    if "prompts" in node.args:
        return list(node.args["prompts"])
    if "prompt" in node.args:
        return [int(node.args["prompt"])]
    return []


def distribute(graph: IterationGraph, ranks: int, tp_rollout: int = 1) -> IterationGraph:
    """The R-rank iteration of a compiled single-rank one (see the module docstring). With
    ``tp_rollout`` K > 1, each K consecutive ranks decode their prompts together as one tensor-parallel
    engine: a rank's decode chain takes its group's prompts and hands on only its own, and each
    group prompt's vision encoding runs on every rank of the group (device tensors stay on their rank)."""
    if ranks <= 1:
        return graph
    prompts = len([v for v in graph.inputs if v.startswith("prompt_p")])
    if prompts % ranks:
        raise GraphError(f"{prompts} prompts cannot be split evenly over {ranks} ranks")
    if tp_rollout < 1 or ranks % tp_rollout:
        raise GraphError(f"tensor-parallel rollout of {tp_rollout} ranks does not divide {ranks} ranks")
    layout = RankLayout(prompts, ranks, tp_rollout)
    out = IterationGraph(graph.name)
    out.meta.update(graph.meta, ranks=ranks)
    renamed: dict[tuple[str, int], str] = {}  # (value, rank) -> its name on that rank (replicas)
    rank_of_value: dict[str, int | None] = {}  # value -> rank of its producer (None: every rank)

    for name in graph.inputs:
        v = graph.values[name]
        out.add_input(name, v.nbytes, v.device, v.what)
        rank_of_value[name] = layout.rank_of(int(name.removeprefix("prompt_p"))) if name.startswith("prompt_p") else None

    def add(node: Node, rank: int, infos: dict[str, Value]) -> None:
        node.meta["rank"] = rank
        node.meta["placement"] = f"rank{rank}"  # printed as %name : rank1/compute ...
        out.add(node, **{o: {"nbytes": infos[o].nbytes, "device": infos[o].device, "what": infos[o].what}
                         for o in node.outputs})

    decode = [graph.nodes[n] for n in graph.topological_order() if graph.nodes[n].kind == "decode_chunk"]
    split: set[str] = set()  # nodes over every prompt made one per rank; a join of their outputs splits too
    orders: list[tuple[str, str]] = []  # each rank's training nodes in chunk order (accumulation order)
    for name in graph.topological_order():
        node = graph.nodes[name]
        if node.kind == "decode_chunk":
            if node is decode[0]:
                _split_decode(graph, decode, layout, add, rank_of_value)
            continue
        if node.kind in REPLICATED:
            _replicate(graph, node, layout, add, renamed, rank_of_value)
            continue
        if node.kind == "loss" and "handoff_chunk" in node.args:
            orders += _split_fused_training(graph, node, layout, add, renamed, rank_of_value)
            split.add(name)
            continue
        if "handoff_chunk" in node.args or (node.kind == "join" and (
                node.args.get("samples") or all(graph.values[v].producer in split for v in node.inputs))):
            _split_fused_scoring(graph, node, layout, add, rank_of_value)
            split.add(name)
            continue
        owners = {layout.rank_of(p) for p in _prompts(node)}
        rank = owners.pop() if len(owners) == 1 else 0
        args = dict(node.args)
        if node.kind == "loss":
            args["world"] = ranks  # DeepSpeed averages gradients over ranks; the sum is wanted
        add(replace(node, args=args, meta=dict(node.meta)), rank, graph.values)
        for o in node.outputs:
            rank_of_value[o] = rank
        if node.kind == "vit_encode":
            for peer in layout.tp_peers(rank):
                if peer != rank:  # the peer's decode engine needs these embeddings on its own device
                    outputs = tuple(_on_peer(o, peer) for o in node.outputs)
                    add(Node(f"{node.name}_tp{peer}", node.kind, node.inputs, outputs, node.model, node.engine,
                             dict(node.args), dict(node.meta)), peer,
                        {_on_peer(o, peer): graph.values[o] for o in node.outputs})
                    for o in outputs:
                        rank_of_value[o] = peer
    out.connect()
    for u, v, data in graph.g.edges(data=True):
        if data.get("reason") == "value" or u not in out.nodes or v not in out.nodes:
            continue
        if data.get("reason") == "accumulation order" and out.nodes[u].meta["rank"] != out.nodes[v].meta["rank"]:
            continue  # each rank accumulates its own micro-batches; the all-reduce joins them
        out.add_order(u, v, reason=data.get("reason", "order"))
    for u, v in orders:
        out.add_order(u, v, reason="accumulation order")
    out.lint()
    check_placement(out)
    return out


def _on_peer(value: str, peer: int) -> str:
    """The name of a vision encoding's copy on a tensor-parallel peer's rank."""
    return f"{value}_tp{peer}"


def _split_decode(graph: IterationGraph, chain: list[Node], layout: RankLayout, add, rank_of_value) -> None:
    """One decode chain per rank over its own prompts (with tensor parallelism: over its group's,
    handing on its own); ``rollout_stats`` becomes a host gather."""
    stats_parts = []
    for r in range(layout.ranks):
        mine, decoded = layout.prompts_of(r), layout.decoded_by(r)
        vis = [f"vis_p{p}" if layout.rank_of(p) == r else _on_peer(f"vis_p{p}", r) for p in decoded]
        state = None
        for node in chain:
            last, chunk = node is chain[-1], node.args["chunk"]
            inputs = ([f"prompt_p{p}" for p in decoded] + vis) if state is None else [state]
            outputs = [f"responses_p{p}" for p in mine] + [f"rollout_stats_r{r}"] if last else \
                [f"decode_state_r{r}_c{chunk}"]
            infos = {o: graph.values.get(o) or Value(o, node.name, 64, "host", "scalars") for o in outputs}
            if not last:
                old = graph.values[node.outputs[0]]
                infos = {outputs[0]: Value(outputs[0], None, old.nbytes // layout.ranks, old.device, old.what)}
            for handed in (f"finished_c{chunk}", f"handoff_c{chunk}"):  # stage fusion: samples, groups
                if handed in node.outputs:
                    outputs.append(f"{handed}_r{r}")
                    infos[outputs[-1]] = graph.values[handed]
                    rank_of_value[outputs[-1]] = r
            args = {**node.args, "prompts": decoded} | ({"keep": mine} if decoded != mine else {})
            add(Node(f"decode_r{r}_c{node.args['chunk']}", node.kind, tuple(inputs), tuple(outputs), node.model,
                     node.engine, args, dict(node.meta)), r, infos)
            for o in outputs:
                rank_of_value[o] = r
            state = None if last else outputs[0]
        stats_parts.append(f"rollout_stats_r{r}")
    info = graph.values["rollout_stats"]
    add(Node("gather_rollout_stats", "gather", tuple(stats_parts), ("rollout_stats",), args={"what": "rollout_stats"}),
        0, {"rollout_stats": info})
    rank_of_value["rollout_stats"] = None  # read on every rank (host data)


def _split_fused_scoring(graph: IterationGraph, node: Node, layout: RankLayout, add, rank_of_value) -> None:
    """Stage fusion per rank: a frozen model's scoring of a chunk's finished samples (over every
    prompt) becomes one node per rank over its prompts, fed by its own decode chain's hand-off, and
    the join that restores the per-prompt names splits the same way."""
    for r in range(layout.ranks):
        mine = layout.prompts_of(r)
        if node.kind == "join":
            inputs = tuple(f"{v}_r{r}" for v in node.inputs)
            outputs = tuple(o for p, o in zip(node.args["prompts"], node.outputs) if p in mine)
            infos = {o: graph.values[o] for o in outputs}
        else:
            n = len(node.args["prompts"])
            kvs = tuple(v for p, v in zip(node.args["prompts"], node.inputs[:n]) if p in mine)
            inputs = kvs + tuple(f"{v}_r{r}" for v in node.inputs[n:])
            outputs = tuple(f"{o}_r{r}" for o in node.outputs)
            infos = {f"{o}_r{r}": graph.values[o] for o in node.outputs}
        add(Node(f"{node.name}_r{r}", node.kind, inputs, outputs, node.model, node.engine,
                 {**node.args, "prompts": mine}, dict(node.meta)), r, infos)
        for o in outputs:
            rank_of_value[o] = r


def _split_fused_training(graph: IterationGraph, node: Node, layout: RankLayout, add, renamed,
                          rank_of_value) -> list[tuple[str, str]]:
    """Train fusion per rank: ``train_c{c}`` becomes one node per rank training the groups of its
    prompts that its own decode chain finished in chunk c, on its frozen scores. Its loss is scaled by
    R like every rank's loss (``world``), and the optimizer step each rank runs reads its own losses.
    Returns the order edges that keep each rank's training nodes in chunk order."""
    orders = []
    for r in range(layout.ranks):
        mine = layout.prompts_of(r)
        own = {f"prompt_p{p}" for p in mine} | {f"vis_p{p}" for p in mine}
        inputs = tuple(v for v in node.inputs if v in own) + tuple(
            f"{v}_r{r}" for v in node.inputs if not v.startswith(("prompt_p", "vis_p")))
        outputs = tuple(f"{o}_r{r}" for o in node.outputs)
        name = f"{node.name}_r{r}"
        add(Node(name, node.kind, inputs, outputs, node.model, node.engine,
                 {**node.args, "prompts": mine, "world": layout.ranks}, dict(node.meta)), r,
            {f"{o}_r{r}": graph.values[o] for o in node.outputs})
        for o in node.outputs:
            renamed[o, r] = f"{o}_r{r}"
            rank_of_value[f"{o}_r{r}"] = r
        chunk = node.args["handoff_chunk"]
        if chunk:
            orders.append((f"{node.name.rsplit('_c', 1)[0]}_c{chunk - 1}_r{r}", name))
    return orders


def _replicate(graph: IterationGraph, node: Node, layout: RankLayout, add, renamed, rank_of_value) -> None:
    """A copy per rank reading that rank's share; the report's copies feed a gather report."""
    parts = []
    for r in range(layout.ranks):
        inputs = []
        for v in node.inputs:
            if (v, r) in renamed:
                inputs.append(renamed[v, r])
            elif rank_of_value.get(v) in (None, r):
                inputs.append(v)
        outputs = []
        infos = {}
        for o in node.outputs:
            renamed[o, r] = f"{o}_r{r}"
            outputs.append(renamed[o, r])
            infos[renamed[o, r]] = graph.values[o]
            rank_of_value[renamed[o, r]] = r
        args = dict(node.args, rank=r, names={v: n for (v, rr), n in renamed.items() if rr == r})
        add(Node(f"{node.name}_r{r}", node.kind, tuple(inputs), tuple(outputs), node.model, node.engine, args,
                 dict(node.meta)), r, infos)
        parts += outputs
    if node.kind == "report":
        (final,) = node.outputs
        add(Node(node.name, "gather", ("rollout_stats", *parts), (final,), args={"what": "report"}), 0,
            {final: graph.values[final]})
        rank_of_value[final] = 0


def check_placement(graph: IterationGraph) -> None:
    """Raise ``GraphError`` where a device value would cross ranks: a node read on another rank must
    produce host data only (Dask moves a node's whole output bundle to the reading worker)."""
    for u, v, data in graph.g.edges(data=True):
        ru, rv = graph.nodes[u].meta.get("rank", 0), graph.nodes[v].meta.get("rank", 0)
        if ru == rv or data.get("reason") != "value":
            continue
        for o in graph.nodes[u].outputs:
            if graph.values[o].device != "host":
                raise GraphError(f"%{v} on rank {rv} reads from %{u} on rank {ru}, whose output {o!r} is a device "
                                 f"tensor; device tensors stay on their worker: read only host values across "
                                 f"ranks, or keep %{v} with its prompts")


def rank_uses(graph: IterationGraph) -> dict[tuple[str, int], int]:
    """(value, rank) -> consumers on that rank; 0 for a value read on several ranks (freed with its key:
    counting down on one worker's copy could drop it before another worker has fetched it)."""
    counts: dict[tuple[str, int], int] = {}
    spread: dict[str, set[int]] = {}
    for node in graph:
        r = node.meta.get("rank", 0)
        for v in node.inputs:
            counts[v, r] = counts.get((v, r), 0) + 1
            spread.setdefault(v, set()).add(r)
    for v, rs in spread.items():
        producer = graph.values[v].producer
        home = graph.nodes[producer].meta.get("rank", 0) if producer else next(iter(rs))
        if rs != {home}:
            for r in rs:
                counts[v, r] = 0
    return counts


# -- balancing prompts over the ranks' decode engines ----------------------------------------------
def prompt_cost(prompt_tokens: int, new_tokens: int, samples: int, params: int, layers: int, hidden: int) -> float:
    """Predicted FLOPs of a prompt's prefix (once) and its G responses' decode, attention included."""
    prefix = 2.0 * params * prompt_tokens + 2.0 * layers * hidden * prompt_tokens ** 2
    decode = samples * new_tokens * (2.0 * params + 4.0 * layers * hidden * (prompt_tokens + new_tokens / 2))
    return prefix + decode


def balance(costs: list[float], ranks: int) -> list[int]:
    """Slot order: ``order[s]`` is the prompt that fills slot s, where rank r owns slots
    [r·P/R, (r+1)·P/R). Longest cost first onto the least-loaded rank with room (LPT with equal
    counts); ties go to the lower prompt index and rank, so equal costs keep a fixed order."""
    n = len(costs)
    if ranks <= 1 or n % ranks:
        return list(range(n))
    per = n // ranks
    load = [0.0] * ranks
    members: list[list[int]] = [[] for _ in range(ranks)]
    for p in sorted(range(n), key=lambda i: (-costs[i], i)):
        r = min((r for r in range(ranks) if len(members[r]) < per), key=lambda r: (load[r], r))
        members[r].append(p)
        load[r] += costs[p]
    return [p for group in members for p in sorted(group)]


def rank_loads(costs: list[float], order: list[int], ranks: int) -> list[float]:
    per = len(order) // ranks
    return [sum(costs[p] for p in order[r * per:(r + 1) * per]) for r in range(ranks)]
