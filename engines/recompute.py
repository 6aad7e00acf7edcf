"""Activation checkpointing of the language model's decoder layers (``train.gradient_checkpointing``).

A training forward over long responses keeps every layer's activations until the backward: about
4.7 MB a token at 3B, so one group of 8 × 1,024 responses holds some 38 GB. With checkpointing each
decoder layer keeps only its input, and its forward runs again in the backward (about a third more
compute for the layers), as verl's and TRL's ``gradient_checkpointing`` do.

transformers' own checkpointing drops the KV cache a layer is given, and the suffix forwards read
their prompt's KV from one (``vlm.suffix_forward_packed``), the prefix forward makes its KV into one.
Here a layer is checkpointed when it runs with grad and either no cache, a ``PrefixCache`` (the
prompts' KV, read and never written) or a ``KVRecorder`` (the prefix forward's own KV, recorded
rather than appended): a layer's second run then sees what its first saw and changes nothing the
forward returned.
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint
from transformers import DynamicCache


class PrefixCache(DynamicCache):
    """The prompts' KV under a forward that adds none of its own: ``update`` returns prefix + new
    without storing them, so a layer gives the same keys however often it runs."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2)


class KVRecorder(DynamicCache):
    """A forward's own KV from nothing (the prefix forward): each layer's keys and values are recorded
    as it makes them (``made``) and nothing is stored, so a layer that runs again records over its
    first run instead of adding to it."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.made[layer_idx] = (key_states, value_states)
        return key_states, value_states


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Make ``model``'s decoder layers recompute their activations in the backward (see the module
    docstring for when); returns how many layers were changed. The layers' parameters and state-dict
    names stay as they were."""
    changed = 0
    for layer in model.model.language_model.layers:
        if getattr(layer, "_rollplex_recompute", False):
            continue
        run = layer.forward

        def forward(hidden_states, *args, _run=run, **kwargs):
            cache = kwargs.get("past_key_values")
            if torch.is_grad_enabled() and (cache is None or isinstance(cache, (PrefixCache, KVRecorder))):
                return torch.utils.checkpoint.checkpoint(_run, hidden_states, *args, use_reentrant=False, **kwargs)
            return _run(hidden_states, *args, **kwargs)

        layer.forward = forward
        layer._rollplex_recompute = True
        changed += 1
    return changed
