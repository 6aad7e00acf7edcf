"""The bench's two-GPU policies, run in the bench's one process beside the one-GPU ones.

- ``disaggregated``: split roles. Rollout runs on its own GPU with its own copy of the actor;
  vision, reference and training run on the other; phases are serial (the serial schedule, prefix
  sharing on), and after the optimizer step ``weight_sync`` ships the weights across.
- ``disaggregated-noshare``: the same placement, every response scored and trained over its full
  sequence, as today's split runtimes (OpenRLHF, verl's split placement) do.
- ``rollplex-dp2``: rollplex on both GPUs as two data-parallel ranks (``pipeline/compile/ranks.distribute``).
  Each GPU holds a replica of actor, reference and decode engine and runs half the prompts under the
  rollplex schedule. At the optimizer step the ranks' gradients become their mean: a copy across the
  GPUs and an add, standing in for the NCCL all-reduce that DeepSpeed's ranks do in a multi-process
  run (``rollplex train --workers 2``), since one process cannot hold two torch.distributed ranks.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rollplex.engines.sharing import fuse_for_rollout
from rollplex.errors import EngineError

TWO_GPU_POLICIES = ("disaggregated", "disaggregated-noshare", "rollplex-dp2")
SPLIT_ROLES = ("disaggregated", "disaggregated-noshare")  # rollout on one GPU, training on the other


class InProcessAllReduce:
    """Data-parallel ranks of one process: each rank's ``step`` waits for every rank, the gradients
    are replaced by their mean (summed in fp32), and then every rank steps on identical gradients,
    so the replicas stay equal."""

    def __init__(self, ranks: int) -> None:
        self.engines: list[Any] = [None] * ranks
        self._barrier = threading.Barrier(ranks, action=self._average)

    def wrap(self, engine, rank: int) -> "RankTrainEngine":
        self.engines[rank] = engine
        return RankTrainEngine(engine, self)

    def _average(self) -> None:
        with torch.no_grad():
            for params in zip(*([p for _, p in e._trainable] for e in self.engines)):
                grads = [p.grad for p in params]
                if all(g is None for g in grads):
                    continue
                if any(g is None for g in grads):
                    raise EngineError("data-parallel step: a parameter has a gradient on some ranks only")
                home = grads[0].device
                mean = sum(g.to(home, torch.float32) for g in grads) / len(grads)
                for g in grads:
                    g.copy_(mean)

    def step(self, engine):
        self._barrier.wait()
        return engine.step()


class RankTrainEngine:
    """A train engine whose ``step`` is the group's synchronised step; everything else is the engine's."""

    def __init__(self, inner, group: InProcessAllReduce) -> None:
        self.inner = inner
        self.group = group

    def step(self):
        return self.group.step(self.inner)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@dataclass
class Replicas:
    """What a two-GPU policy adds on the second GPU, and how to put it back at the common start."""

    hosts_engines: list[dict]  # per rank: {"actor": train engine, "ref": score engine, "decode": engine}
    resets: list[Callable[[], None]] = field(default_factory=list)

    def reset(self) -> None:
        for fn in self.resets:
            fn()

    def release(self) -> None:
        """Drop the second GPU's copies (the engines hold them), so the next policy's peak memory is
        its own. The caller holds no host or executor of the policy any more."""
        self.hosts_engines.clear()
        self.resets.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def decode_engine(cfg, device, dtype, module, rows: int, longest: int):
    """The bench's torch-graph decode engine on ``device``, decoding in place on ``module``'s weights."""
    from rollplex.engines.base import EngineContext, get_engine

    return get_engine("torch-graph", "decode").factory(EngineContext(
        "", torch.device(device), dtype, cfg.seed, {"share_model": module, "max_num_seqs": rows,
                                                    "max_model_len": longest, "compile": cfg.compile_decode,
                                                    "attention": cfg.decode_attention,
                                                    "linear": cfg.decode_linear,
                                                    "shared_prefix": cfg.shared_prefix_decode,
                                                    "prefix_slots": -(-rows // cfg.samples),
                                                    "max_prompt_len": longest - cfg.max_new_tokens,
                                                    "max_response_len": cfg.max_new_tokens + 1}))


def disaggregated(cfg, actor, ref_engine, start_state: dict, dtype, longest: int) -> Replicas:
    """The rollout GPU: a copy of the actor (weights shipped by ``weight_sync``) and its decode engine."""
    rollout = copy.deepcopy(actor.module).to(cfg.second_device).requires_grad_(False)
    fuse_for_rollout(rollout)  # frozen: every group (.to() gave each tensor its own storage)
    decode = decode_engine(cfg, cfg.second_device, dtype, rollout, cfg.prompts * cfg.samples, longest)
    return Replicas([{"actor": actor, "ref": ref_engine, "decode": decode}],
                    resets=[lambda: rollout.load_state_dict(start_state)])


def data_parallel(cfg, actor, ref_engine, decode, start_state: dict, start_optim: dict, dtype,
                  longest: int) -> Replicas:
    """Rank 1 on the second GPU: actor (with its optimizer), reference and decode engine replicas;
    rank 0 keeps the bench's engines. Both ranks' train engines step through one all-reduce."""
    from rollplex.engines.base import EngineContext, get_engine

    device = torch.device(cfg.second_device)
    module = copy.deepcopy(actor.module).to(device)
    fuse_for_rollout(module, cfg.train_engine)  # before its trainer exists, as on rank 0
    train_ctx = EngineContext("", device, dtype, cfg.seed, {"module": module, "lr": 1e-6, "grad_clip": 1.0,
                                                           "zero_stage": 2, "accumulation_steps": cfg.prompts})
    actor1 = get_engine(cfg.train_engine, "train").factory(train_ctx)
    actor1.optimizer.load_state_dict(start_optim)
    ref1 = copy.deepcopy(ref_engine.model).to(device)
    ref1_engine = get_engine("transformers", "score").factory(EngineContext("", device, dtype, cfg.seed,
                                                                           {"module": ref1}))
    decode1 = decode_engine(cfg, device, dtype, actor1.module, cfg.prompts * cfg.samples // 2, longest)
    group = InProcessAllReduce(2)

    def reset() -> None:
        actor1.module.load_state_dict(start_state)
        actor1.optimizer.load_state_dict(start_optim)

    return Replicas([{"actor": group.wrap(actor, 0), "ref": ref_engine, "decode": decode},
                     {"actor": group.wrap(actor1, 1), "ref": ref1_engine, "decode": decode1}],
                    resets=[reset])


def ranks_disagree(replicas: Replicas) -> float:
    """Largest |w_rank1 − w_rank0| over the trainable weights after a step (0 when the ranks agree)."""
    if len(replicas.hosts_engines) < 2:
        return 0.0
    a, b = (dict(r["actor"].module.named_parameters()) for r in replicas.hosts_engines[:2])
    return max(float((a[k].detach().float() - b[k].detach().to(a[k].device).float()).abs().max())
               for k in a if a[k].requires_grad)
