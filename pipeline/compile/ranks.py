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
              An ordering edge to or from a replicated node (an optimizer step of several per iteration)
              joins each rank's copy to the nodes on that rank.
              Under stage fusion each rank's chain hands on its own finished samples and groups, and
              the nodes that work on them (frozen scoring, train fusion's ``train_c``) split per rank.
              A multi-turn rollout's nodes (each turn's decode chunks, environment steps, observation
              vision and frozen scoring, and the episodes' join) are one per rank over its prompts:
              each rank plays its own samples' episodes.
              With ``tp_rollout`` K, each K consecutive ranks form one tensor-parallel decode engine:
              every rank's chain decodes the group's prompts (a step needs every rank of the group)
              and hands on its own; each vision node gets a copy on the group's other ranks.
    ensures   ``node.meta["rank"]`` (and "placement", ``rankR``) on every node and ``Value.rank`` on every
              value (its producer's rank; a prompt's: its own); a rank's copy of a value keeps the
              original's facts and covers the rank's prompts; ``check_placement``: a value read on
              another rank than its producer's is host data (and its producer's other outputs too,
              since Dask moves a node's whole output bundle), so device tensors never leave their worker.
              What a value is, the pass reads from its facts, never from its name.

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
                        zero_stage: int, decode_engine: str, processes: bool = True, tp_rollout: int = 1,
                        mini_batches: int = 1) -> None:
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
    if per_rank % mini_batches:
        raise ConfigError(f"train.mini_batches ({mini_batches}) must divide the prompts per rank ({per_rank}): every "
                          f"rank takes an equal share of every mini-batch (its optimizer step reduces in lock-step)")
    share = per_rank // mini_batches
    if share % micro_batch_groups:
        what = "the prompts per rank" if mini_batches == 1 else "each rank's share of a mini-batch"
        raise ConfigError(f"train.micro_batch_groups ({micro_batch_groups}) must divide {what} "
                          f"({share}): every rank needs the same number of micro-batches (ZeRO reduces "
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
    group prompt's vision encoding runs on every rank of the group (device tensors stay on their rank).
    What a value is comes from its facts (``Value.role``, ``prompts``), never from its name."""
    if ranks <= 1:
        return graph
    prompts = len([v for v in graph.values.values() if v.producer is None and v.role == "prompt"])
    if prompts % ranks:
        raise GraphError(f"{prompts} prompts cannot be split evenly over {ranks} ranks")
    if tp_rollout < 1 or ranks % tp_rollout:
        raise GraphError(f"tensor-parallel rollout of {tp_rollout} ranks does not divide {ranks} ranks")
    shape = graph.meta.get("shape")
    if shape is not None and shape.steps > 1 and shape.ranks != ranks:
        raise GraphError(f"the iteration's {shape.mini_batches} mini-batches were split for {shape.ranks} rank(s), "
                         f"not {ranks}: compile it with BatchShape(ranks={ranks})")
    layout = RankLayout(prompts, ranks, tp_rollout)
    out = IterationGraph(graph.name)
    out.meta.update(graph.meta, ranks=ranks)
    s = _Split(graph, layout, out)

    for name in graph.inputs:
        v = graph.values[name]
        rank = layout.rank_of(v.prompts[0]) if v.role == "prompt" and len(v.prompts) == 1 else None
        out.add_input(name, **{**v.facts(), "rank": rank})
        s.rank_of_value[name] = rank

    decode = [graph.nodes[n] for n in graph.topological_order() if graph.nodes[n].kind == "decode_chunk"]
    split: set[str] = set()  # nodes over every prompt made one per rank; a join of their outputs splits too
    for name in graph.topological_order():
        node = graph.nodes[name]
        if "turn" in node.args or node.args.get("episodes"):
            _split_turns(s, node)
            continue
        if node.kind == "decode_chunk":
            if node is decode[0]:
                _split_decode(s, decode)
            continue
        if node.kind in REPLICATED:
            _replicate(s, node)
            continue
        if "handoff_chunk" in node.args or (node.kind == "join" and (
                node.args.get("samples") or all(graph.values[v].producer in split for v in node.inputs))):
            _split_per_rank(s, node)
            split.add(name)
            continue
        owners = {layout.rank_of(p) for p in _prompts(node)}
        rank = owners.pop() if len(owners) == 1 else 0
        args = dict(node.args)
        if node.kind == "loss":
            args["world"] = ranks  # DeepSpeed averages gradients over ranks; the sum is wanted
        relayed = {v: s.host_relay(v, rank) for v in node.inputs}
        if "bind" in args:  # the function's parameters read the relayed names
            args["bind"] = {k: [(relayed.get(v, v), i) for v, i in pairs] for k, pairs in args["bind"].items()}
        s.add(replace(node, inputs=tuple(relayed[v] for v in node.inputs), args=args, meta=dict(node.meta)), rank,
              {o: graph.values[o] for o in node.outputs})
        if node.kind == "vit_encode":
            for peer in layout.tp_peers(rank):
                if peer != rank:  # the peer's decode engine needs these embeddings on its own device
                    outputs = {o: f"{o}_tp{peer}" for o in node.outputs}
                    s.add(Node(f"{node.name}_tp{peer}", node.kind, node.inputs, tuple(outputs.values()), node.model,
                               node.engine, dict(node.args), dict(node.meta)), peer,
                          {copy: graph.values[o] for o, copy in outputs.items()})
                    for o, copy in outputs.items():
                        s.peer_vision[o, peer] = copy
    out.connect()
    for u, v, data in graph.g.edges(data=True):
        if data.get("reason") == "value":
            continue
        if u in s.copies or v in s.copies:  # a node made one per rank: each rank keeps the order
            before, after = s.placed(u), s.placed(v)
            for r, copy in after.items():
                if r in before:
                    out.add_order(before[r], copy, reason=data.get("reason", "order"))
            continue
        if u in s.copies and v in out.nodes:  # a node made one per rank, before one on a rank: its copy there
            u = s.copies[u].get(out.nodes[v].meta["rank"], u)
        elif v in s.copies and u in out.nodes:
            v = s.copies[v].get(out.nodes[u].meta["rank"], v)
        if u not in out.nodes or v not in out.nodes:
            continue
        if data.get("reason") == "accumulation order" and out.nodes[u].meta["rank"] != out.nodes[v].meta["rank"]:
            continue  # each rank accumulates its own micro-batches; the all-reduce joins them
        out.add_order(u, v, reason=data.get("reason", "order"))
    out.lint()
    check_placement(out)
    return out


class _Split:
    """What the pass has made so far: the R-rank graph, each value's copy per rank and the rank that
    holds each value."""

    def __init__(self, graph: IterationGraph, layout: RankLayout, out: IterationGraph) -> None:
        self.graph, self.layout, self.out = graph, layout, out
        self.local: dict[tuple[str, int], str] = {}  # (value, rank) -> the name of its copy on that rank
        self.rank_of_value: dict[str, int | None] = {}  # value -> rank of its producer (None: every rank)
        self.copies: dict[str, dict[int, str]] = {}  # node made one per rank -> rank -> its copy
        self.peer_vision: dict[tuple[str, int], str] = {}  # a vision value's copy on a tensor-parallel peer

    def host_relay(self, v: str, rank: int) -> str:
        """``v`` as a node on ``rank`` may read it: itself, or where its producer is on another rank
        and also outputs device tensors (Dask would move them all), a host-only copy made on the
        producer's rank (a batch-level PPO advantage reads every rank's old values so)."""
        home, producer = self.rank_of_value.get(v), self.out.values[v].producer if v in self.out.values else None
        if home in (None, rank) or producer is None:
            return v
        if all(self.out.values[o].device == "host" for o in self.out.nodes[producer].outputs):
            return v
        return self.relay(v, self.graph.values[v])

    def relay(self, v: str, info: Value) -> str:
        """A host-only copy of ``v`` (with ``info``'s facts) made on its producer's rank, so that a node
        on another rank reads it without the rest of that producer's output bundle."""
        copy = f"host_{v}"
        if copy not in self.out.values:
            self.add(Node(f"relay_{v}", "gather", (v,), (copy,), args={"what": "relay"}), self.rank_of_value[v],
                     {copy: info})
        return copy

    def add(self, node: Node, rank: int, infos: dict[str, Value], of: str | None = None) -> None:
        """Add ``node`` on ``rank``, its outputs with the facts of ``infos`` on that rank; ``of``: the
        node of the input graph that it is this rank's copy of."""
        node.meta["rank"] = rank
        node.meta["placement"] = f"rank{rank}"  # printed as %name : rank1/compute ...
        self.out.add(node, **{o: {**infos[o].facts(), "rank": rank} for o in node.outputs})
        for o in node.outputs:
            self.rank_of_value[o] = rank
        if of is not None:
            self.copies.setdefault(of, {})[rank] = node.name

    def placed(self, node: str) -> dict[int, str]:
        """rank -> the node's copy on it: one per rank for a node made per rank, else the node on its own."""
        if node in self.copies:
            return self.copies[node]
        return {self.out.nodes[node].meta["rank"]: node} if node in self.out.nodes else {}

    def reads(self, inputs, rank: int) -> tuple[str, ...]:
        """The values a rank's copy of a node reads: each input's copy on that rank, or the input
        itself where it is on that rank or on every rank; inputs of other ranks are left out."""
        out = []
        for v in inputs:
            if (v, rank) in self.local:
                out.append(self.local[v, rank])
            elif self.rank_of_value.get(v) in (None, rank):
                out.append(v)
        return tuple(out)


def _split_decode(s: _Split, chain: list[Node]) -> None:
    """One decode chain per rank over its own prompts (with tensor parallelism: over its group's,
    handing on its own); ``rollout_stats`` becomes a host gather."""
    graph, layout = s.graph, s.layout
    prompt_of = {v.prompts[0]: v.name for v in graph.values.values() if v.role == "prompt" and v.producer is None}
    vision_of = {graph.values[v].prompts[0]: v for v in chain[0].inputs if graph.values[v].role == "vision"}
    (stats,) = [graph.values[o] for o in chain[-1].outputs if graph.values[o].role == "rollout_stats"]
    stats_parts = []
    for r in range(layout.ranks):
        mine, decoded = layout.prompts_of(r), layout.decoded_by(r)
        state = None
        for node in chain:
            inputs = [prompt_of[p] for p in decoded] + [s.peer_vision.get((vision_of[p], r), vision_of[p])
                                                         for p in decoded] if state is None else [state]
            outputs, infos = [], {}
            for o in node.outputs:
                v = graph.values[o]
                if v.role == "responses":
                    if v.prompts[0] not in mine:
                        continue  # another rank's chain samples it
                    outputs.append(o)
                    infos[o] = v
                    continue
                copy = f"{o}_r{r}"  # the chain's own state, hand-offs and stats
                if v.role in ("handoff", "finished"):  # read by the rank's copies of their readers
                    s.local[o, r] = copy
                covers = decoded if v.role == "decode_state" else mine
                nbytes = v.nbytes // layout.ranks if v.role == "decode_state" else v.nbytes
                outputs.append(copy)
                infos[copy] = replace(v, name=copy, nbytes=nbytes, prompts=tuple(covers))
                if v.role == "decode_state":
                    state = copy
                elif v.role == "rollout_stats":
                    stats_parts.append(copy)
            args = {**node.args, "prompts": decoded} | ({"keep": mine} if decoded != mine else {})
            s.add(Node(f"decode_r{r}_c{node.args['chunk']}", node.kind, tuple(inputs), tuple(outputs), node.model,
                       node.engine, args, dict(node.meta)), r, infos)
    s.add(Node(f"gather_{stats.name}", "gather", tuple(stats_parts), (stats.name,), args={"what": "rollout_stats"}),
          0, {stats.name: stats})
    s.rank_of_value[stats.name] = None  # read on every rank (host data)


def _split_turns(s: _Split, node: Node) -> None:
    """A multi-turn rollout's node (a turn's decode chunk, environment step, observation vision or
    frozen scoring, or the episodes' join; pipeline/compile/turns.py) becomes one per rank over the
    rank's own prompts, fed by that rank's copies: each rank plays its samples' episodes on its own
    decode engine. The join's ``rollout_stats`` becomes a host gather, as a single-turn chain's does."""
    graph, layout = s.graph, s.layout
    if layout.tp_rollout > 1:
        raise GraphError("a multi-turn rollout is not split over tensor-parallel decode groups (tp_rollout 1 only)")
    parts = []
    for r in range(layout.ranks):
        mine = layout.prompts_of(r)
        inputs = []
        for v in node.inputs:
            if (v, r) in s.local:
                inputs.append(s.local[v, r])
            elif len(graph.values[v].prompts) != 1:
                raise GraphError(f"%{node.name} reads {v}, which covers several ranks' prompts")
            elif graph.values[v].prompts[0] in mine:  # a prompt, its vision or a frozen model's prefix
                inputs.append(v)
        outputs, infos = [], {}
        for o in node.outputs:
            v = graph.values[o]
            if len(v.prompts) == 1:  # a prompt's trajectories keep their name, on the prompt's rank
                if v.prompts[0] in mine:
                    outputs.append(o)
                    infos[o] = v
                continue
            copy = f"{o}_r{r}"
            outputs.append(copy)
            infos[copy] = replace(v, name=copy, nbytes=v.nbytes // layout.ranks, prompts=tuple(mine))
            if v.role == "rollout_stats":  # every reader reads the gathered batch's
                parts.append((copy, r))
            else:
                s.local[o, r] = copy
        # a decode chunk keys its episodes by prompt index, so it learns its rank's prompts too
        mapped = "prompts" in node.args or node.kind == "decode_chunk"
        args = {**node.args, "prompts": mine} if mapped else dict(node.args)
        s.add(Node(f"{node.name}_r{r}", node.kind, tuple(inputs), tuple(outputs), node.model, node.engine, args,
                   dict(node.meta)), r, infos, of=node.name)
    if parts:
        (stats,) = [graph.values[o] for o in node.outputs if graph.values[o].role == "rollout_stats"]
        # The join's trajectories carry their observations' vision embeddings (device tensors), and Dask
        # moves a node's whole bundle: another rank's stats come through a host relay on that rank.
        read = [copy if r == 0 else s.relay(copy, stats) for copy, r in parts]
        s.add(Node(f"gather_{stats.name}", "gather", tuple(read), (stats.name,), args={"what": "rollout_stats"}),
              0, {stats.name: stats})
        s.rank_of_value[stats.name] = None  # read on every rank (host data)


def _split_per_rank(s: _Split, node: Node) -> None:
    """Stage and train fusion per rank: a node over every prompt that works on what the decode chains
    handed on (a frozen model's scoring of a chunk's finished samples or groups, train fusion's
    ``train_c``) becomes one node per rank over its prompts, fed by its own chain's hand-off; the join
    that restores the per-prompt names splits the same way. A training node's loss is scaled by R like
    every rank's loss (``world``), and the optimizer step each rank runs reads its own losses."""
    graph, layout = s.graph, s.layout
    for r in range(layout.ranks):
        mine = layout.prompts_of(r)
        args = {**node.args, "prompts": mine} | ({"world": layout.ranks} if node.kind == "loss" else {})
        if node.kind == "join":  # its per-prompt outputs keep their names, on their prompts' rank
            outputs = tuple(o for o in node.outputs if graph.values[o].prompts[0] in mine)
            infos = {o: graph.values[o] for o in outputs}
        else:
            outputs = tuple(f"{o}_r{r}" for o in node.outputs)
            infos = {f"{o}_r{r}": replace(graph.values[o], prompts=tuple(mine)) for o in node.outputs}
            s.local.update({(o, r): f"{o}_r{r}" for o in node.outputs})
        s.add(Node(f"{node.name}_r{r}", node.kind, s.reads(node.inputs, r), outputs, node.model, node.engine,
                   args, dict(node.meta)), r, infos, of=node.name)


def _replicate(s: _Split, node: Node) -> None:
    """A copy per rank reading that rank's share; the report's copies feed a gather report."""
    graph, parts = s.graph, []
    for r in range(s.layout.ranks):
        outputs = tuple(f"{o}_r{r}" for o in node.outputs)
        s.local.update({(o, r): f"{o}_r{r}" for o in node.outputs})
        infos = {f"{o}_r{r}": graph.values[o] for o in node.outputs}
        reads = s.reads(node.inputs, r)
        if node.kind == "report":  # a batch-level value (PPO's whitened advantages) covers this rank's prompts too
            mine = set(s.layout.prompts_of(r))
            reads += tuple(s.host_relay(v, r) for v in node.inputs if v not in reads and (v, r) not in s.local
                           and len(graph.values[v].prompts) > 1 and mine & set(graph.values[v].prompts))
        s.add(Node(f"{node.name}_r{r}", node.kind, reads, outputs, node.model, node.engine,
                   dict(node.args, rank=r), dict(node.meta)), r, infos, of=node.name)
        parts += outputs
    if node.kind == "report":
        (final,) = node.outputs
        (stats,) = [v for v in node.inputs if graph.values[v].role == "rollout_stats"]
        s.add(Node(node.name, "gather", (stats, *parts), (final,), args={"what": "report"}), 0,
              {final: graph.values[final]})


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
