"""What one iteration is, before it is built: the one input of ``plan.build.build_iteration``.

A run's config (``pipeline/run/session.py``), a bench policy (``pipeline/bench/``) and a simulated
scenario (``pipeline/plan/simulator.py``) each become an ``IterationSpec``; nothing builds an
iteration from anything else, so what the bench measures and the simulator predicts is what a run
executes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rollplex.errors import GraphError
from rollplex.pipeline.compile.compiler import BatchShape, EngineChoice

POLICIES = ("serial", "rollplex")


@dataclass(frozen=True)
class IterationSpec:
    """``shape``: the batch and how the algorithm runs over it (micro-batches, prompts per node,
    prefix sharing, stage and train fusion); ``engines``: the engine per role; ``policy``: the
    schedule (``serial`` puts phase barriers in, ``rollplex`` none, and only it fuses stages);
    ``world`` data-parallel ranks, ``tp_rollout`` ranks per tensor-parallel decode engine."""

    shape: BatchShape
    engines: EngineChoice
    policy: str = "rollplex"
    world: int = 1
    tp_rollout: int = 1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise GraphError(f"iteration spec: policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.world < 1 or self.tp_rollout < 1 or self.world % self.tp_rollout:
            raise GraphError(f"iteration spec: {self.world} ranks cannot form tensor-parallel decode groups of "
                             f"{self.tp_rollout}")

    @property
    def compiled_shape(self) -> BatchShape:
        """The shape the compiler expands: stage fusion only under the rollplex policy (serial scores
        after the rollout by definition); several mini-batches split for the spec's ranks."""
        fused = self.shape.stage_fusion and self.policy == "rollplex"
        changes = {"stage_fusion": fused} if fused != self.shape.stage_fusion else {}
        if self.shape.steps > 1 and self.shape.ranks != self.world:
            changes["ranks"] = self.world
        return dataclasses.replace(self.shape, **changes) if changes else self.shape

    def under(self, policy: str, train_fusion: bool = True) -> IterationSpec:
        """The same iteration under another schedule policy; ``train_fusion=False``: with the
        policy's training after decode even where the shape asks for train fusion."""
        shape = self.shape if train_fusion else dataclasses.replace(self.shape, train_fusion=False)
        return dataclasses.replace(self, policy=policy, shape=shape)
