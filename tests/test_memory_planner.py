"""plan_memory: residency from lifetimes. Invariants on random DAGs under two namings (memory never
over budget, a tensor resident whenever it is used, offload/prefetch pairs consistent), and the
error for an infeasible budget. CPU only."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollplex.errors import MemoryPlanError
from rollplex.pipeline.plan import memory as M
from rollplex.pipeline.plan.costs import NodeCost
from rollplex.pipeline.plan.hardware import hardware
from rollplex.pipeline.compile.ir import IterationGraph, Node
from rollplex.pipeline.plan.memory import Resident, plan_memory
from rollplex.pipeline.plan.schedule import plan

GiB = 1024**3
EPS = 1e-9
KINDS = ("vit_encode", "decode_chunk", "prefix", "suffix_score", "loss", "optimizer_step")


@st.composite
def cases(draw):
    n = draw(st.integers(3, 14))
    kinds = sorted(draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n)), key=KINDS.index)
    spec = []
    for i in range(n):
        preds = sorted(draw(st.sets(st.integers(0, i - 1), max_size=2))) if i else []
        spec.append((kinds[i], preds, draw(st.sampled_from([0.2, 0.5, 1.0, 3.0])),
                     draw(st.sampled_from([0, 1, 2, 4, 8])) * GiB))
    uses = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(["read", "write"])),
                         min_size=1, max_size=4, unique_by=lambda u: u[0]))
    resident = (draw(st.sampled_from([2, 6, 10])) * GiB, uses, draw(st.booleans()))
    return spec, resident, draw(st.sampled_from([0.35, 0.6, 0.85, 1.0])), draw(st.sampled_from(PLAN_KINDS))


PLAN_KINDS = ("serial", "rollplex")


def build(spec, resident, naming: str):
    n = len(spec)
    name = {i: f"n{i}" if naming == "a" else f"w{n - i:02d}x{(i * 31) % 7}" for i in range(n)}
    value = {i: f"v{i}" if naming == "a" else f"t_{name[i]}" for i in range(n)}
    g = IterationGraph("random")
    g.add_input("x", 16, "host")
    costs = {}
    nbytes, uses, frozen = resident
    users = dict(uses)  # as in real graphs, what a node is says which weights it uses, and how
    for i in (range(n) if naming == "a" else reversed(range(n))):
        kind, preds, seconds, size = spec[i]
        g.add(Node(name[i], kind, tuple(value[p] for p in preds) or ("x",), (value[i],),
                   model=f"w-{users[i]}" if i in users else None), **{value[i]: dict(nbytes=size, device="device")})
        costs[name[i]] = NodeCost(seconds, 16 if kind == "decode_chunk" else 0)
    return g.connect().lint(), costs, nbytes, [(name[i], mode) for i, mode in uses], frozen


def independent_peaks(mp: M.MemoryPlan) -> dict[int, float]:
    """Peak per GPU recomputed from the final plan: values by their own producer/consumer times,
    residents by the planner's occupancy (checked to cover every use separately)."""
    p = mp.plan
    ev: dict[int, list[tuple[float, float]]] = {}
    consumers: dict[str, list[str]] = {}
    for node in p.graph:
        for v in node.inputs:
            consumers.setdefault(v, []).append(node.name)
    for v in p.graph.values.values():
        if v.device != "device" or not v.nbytes or v.producer is None:
            continue
        prod = p.slots[v.producer]
        end = max([prod.finish] + [p.slots[c].finish for c in consumers.get(v.name, [])])
        for g in prod.gpus:
            ev.setdefault(g, []).extend([(round(prod.start, 9), v.nbytes / len(prod.gpus)),
                                         (round(end, 9), -v.nbytes / len(prod.gpus))])
    for t in mp.tensors:
        if t.resident:
            for a, b in M._occupancy(p, t, mp.decisions):
                for g in t.gpus:
                    ev.setdefault(g, []).extend([(round(a, 9), t.nbytes), (round(b, 9), -t.nbytes)])
    peaks = {}
    for g, items in ev.items():
        used = best = 0.0
        for _, d in sorted(items):
            used += d
            best = max(best, used)
        peaks[g] = best
    return peaks


def check_memory(mp: M.MemoryPlan) -> None:
    p = mp.plan
    for g, peak in independent_peaks(mp).items():
        assert peak <= mp.budget + 1, f"gpu{g}: {peak / GiB:.2f} GiB over the budget {mp.budget / GiB:.2f}"
    period = p.makespan
    for t in mp.tensors:  # a resident is in HBM whenever a node that uses it runs
        if t.resident:
            spans = M._occupancy(p, t, mp.decisions)
            for a, b in t.busy:
                assert any(x - EPS <= a and b <= y + EPS for x, y in spans), (t.name, a, b, spans)
    transfers: dict[tuple, dict[str, M.Slot]] = {}
    for s in p.slots.values():
        if s.kind in ("offload", "prefetch"):
            args = p.graph.nodes[s.node].args
            key = (args["tensor"], args["after"], args["before"])
            assert s.kind not in transfers.get(key, {}), f"two {s.kind}s for {key}"
            transfers.setdefault(key, {})[s.kind] = s
    for (tensor, after, before), pair in transfers.items():
        assert set(pair) == {"offload", "prefetch"}, (tensor, pair)
        off, pre = pair["offload"], pair["prefetch"]
        if after:
            assert off.start >= p.slots[after].finish - EPS  # leaves after its last use before the gap
        assert pre.finish <= p.slots[before].start + EPS  # back before its next use
        if pre.start >= off.start:  # not a wrap-around (offload at the end, prefetch at the start)
            assert off.finish <= pre.start + EPS
        node = p.graph.nodes[off.node]
        if node.inputs:  # a graph value: nobody reads the original after it left
            src = node.inputs[0]
            for c in (n for n in p.graph if src in n.inputs and n.name != off.node):
                assert p.slots[c.name].finish <= off.start + EPS, (c.name, off.node)
            dev = p.graph.nodes[pre.node].outputs[0]
            assert all(p.slots[c.name].start >= pre.finish - EPS for c in p.graph if dev in c.inputs)
    assert period > 0 or not p.slots


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_planned_memory_never_exceeds_the_budget_under_two_namings(case):
    spec, resident, fraction, policy = case
    outcomes = []
    for naming in ("a", "b"):
        g, costs, nbytes, uses, frozen = build(spec, resident, naming)
        cluster = hardware("h200", 2)
        p = plan(g, cluster, costs, policy)
        rs = [Resident("weights", (0, 1), nbytes, tuple(uses), frozen=frozen)]
        naive = max(plan_memory(p, rs, enabled=False).naive_peak.values())
        budget = max(1.0, naive * fraction)
        try:
            mp = plan_memory(p, rs, budget)
        except MemoryPlanError as exc:
            assert re.search(r"gpu\d needs [\d.]+ GiB at t=", str(exc)) and "largest live tensors" in str(exc)
            outcomes.append(None)
            continue
        check_memory(mp)
        assert max(mp.peak.values()) <= budget + 1
        assert mp.naive_peak == plan_memory(p, rs, enabled=False).naive_peak
        outcomes.append(round(max(mp.peak.values()) / GiB, 6))
    assert (outcomes[0] is None) == (outcomes[1] is None), outcomes


def chain(grad: bool = False):
    """A prefix's KV is made first and read last; decode holds its pool in between (``grad``: the
    prefix is a forward whose graph a backward will walk).

        x -> prefix -(kv 8 GiB)----------------------------------------> suffix
                  \-> vit (1 s) -> decode (10 s) -> post (2 s) ----------^
    """
    g = IterationGraph("kv")
    g.add_input("x", 16, "host")
    small = dict(nbytes=1024, device="device")
    g.add(Node("prefix", "prefix", ("x",), ("kv", "h"), args={"grad": grad}), kv=dict(nbytes=8 * GiB, device="device"),
          h=small)
    g.add(Node("vit", "vit_encode", ("h",), ("vis",)), vis=small)
    g.add(Node("decode", "decode_chunk", ("vis",), ("resp",)), resp=dict(nbytes=0, device="host"))
    g.add(Node("post", "prefix", ("resp",), ("ready",)), ready=small)
    g.add(Node("suffix", "suffix_score", ("kv", "ready"), ("lp",)), lp=small)
    costs = {"prefix": NodeCost(0.5), "vit": NodeCost(1.0), "decode": NodeCost(10.0, 16), "post": NodeCost(2.0),
             "suffix": NodeCost(0.5)}
    return plan(g.connect().lint(), hardware("h200", 1), costs, "rollplex")


def test_an_idle_value_is_offloaded_and_prefetched_before_its_consumer():
    p = chain()
    pool = Resident("pool", (0,), 20 * GiB, (("decode", "write"),))
    mp = plan_memory(p, [pool], budget=25 * GiB)
    check_memory(mp)
    g = mp.plan.graph
    assert [n.kind for n in g if n.kind in ("offload", "prefetch")] == ["offload", "prefetch"]
    off, pre = (n for n in g if n.kind in ("offload", "prefetch"))
    assert off.inputs == ("kv",) and g.nodes["suffix"].inputs[0] == pre.outputs[0] == "kv@dev0"
    assert g.values["kv@host0"].device == "host"
    assert mp.plan.slots[pre.name].start >= mp.plan.slots["decode"].finish - EPS  # after the pool is freed
    assert mp.plan.makespan == pytest.approx(p.makespan)  # both copies hide in the gap
    assert {(a.tensor, a.kind) for a in mp.actions} == {("kv", "offload"), ("pool", "free")}
    assert "peak 28.0 GiB → 20.0 GiB" in mp.log
    assert g.nodes["prefix"].meta["residency"] == {"kv": f"offload by %{off.name}", "h": "keep"}
    assert g.meta["residency"]["pool"] == ["free between %decode and %decode"]


def test_a_value_kept_for_a_backward_is_never_offloaded():
    """The same idle KV, made by a forward with grad: its autograd graph (activations saved for the
    backward) stays on the device whatever happens to the tensor, and a host copy would be detached
    from it. The plan keeps it and names it when the budget cannot be met."""
    p = chain(grad=True)
    pool = Resident("pool", (0,), 20 * GiB, (("decode", "write"),))
    with pytest.raises(MemoryPlanError, match=r"kv 8\.00 GiB"):
        plan_memory(p, [pool], budget=25 * GiB)
    mp = plan_memory(p, [pool], budget=29 * GiB)
    assert not [n for n in mp.plan.graph if n.kind in ("offload", "prefetch")]


def test_a_dead_resident_is_freed_without_copies():
    """The pool is rewritten by decode: between its uses it holds nothing worth keeping."""
    p = chain()
    pool = Resident("pool", (0,), 20 * GiB, (("decode", "write"),))
    optim = Resident("optim", (0,), 4 * GiB, (("suffix", "read"),))
    mp = plan_memory(p, [pool, optim], budget=24.5 * GiB)
    check_memory(mp)
    kinds = {(a.tensor, a.kind) for a in mp.actions}
    assert ("pool", "free") in kinds and ("pool", "offload") not in kinds


def test_a_frozen_resident_offloads_for_free():
    p = chain()
    ref = Resident("ref.weights", (0,), 12 * GiB, (("prefix", "read"), ("suffix", "read")), frozen=True)
    pool = Resident("pool", (0,), 6 * GiB, (("decode", "write"),))
    mp = plan_memory(p, [ref, pool], budget=21 * GiB)
    check_memory(mp)
    offloads = [n for n in mp.plan.graph if n.kind == "offload" and n.args["tensor"] == "ref.weights"]
    assert offloads and all(n.args["bytes_per_gpu"] == 0 for n in offloads)
    assert all(n.args["bytes_per_gpu"] == 12 * GiB for n in mp.plan.graph
               if n.kind == "prefetch" and n.args["tensor"] == "ref.weights")


def test_an_infeasible_budget_names_the_gpu_the_moment_and_the_tensors():
    p = chain()
    pool = Resident("rollout.kv_pool", (0,), 30 * GiB, (("decode", "read"),))
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(p, [pool], budget=16 * GiB)
    msg = str(err.value)
    assert re.match(r"gpu0 needs 3\d\.\d GiB at t=\d\.\d+s of the rollplex plan \(while %\w+ run\)", msg), msg
    assert "rollout.kv_pool 30.00 GiB (" in msg and "budget is 16.0 GiB" in msg


def test_measuring_only_changes_nothing():
    p = chain()
    mp = plan_memory(p, [Resident("pool", (0,), 20 * GiB, (("decode", "read"),))], budget=1, enabled=False)
    assert mp.plan is p and not mp.actions and mp.peak == mp.naive_peak
