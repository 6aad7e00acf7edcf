"""Rollplex: synchronous on-policy RL for vision-language models, compiled to a DAG per iteration.

The public API for writing algorithms is ``Algorithm``; see ``rollplex.dags.grpo`` for an example.
"""
from rollplex.errors import RollplexError
from rollplex.pipeline.authoring import Algorithm

__all__ = ["Algorithm", "RollplexError"]
__version__ = "0.1.0"
