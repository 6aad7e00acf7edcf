"""Which attention kernels run on CUDA: eager forwards without cuDNN's, captured graphs with it.

cuDNN's attention builds an execution plan for every new shape. A training node's packed forward
meets a new width every iteration (the groups' response tokens), and on an H200 its first forward
and backward at a new width took 151–186 ms longer than the same call again (median of 5 widths,
3B, two groups; `benchmarks/shape_cost.py`); with cuDNN's attention off the two were alike (44 ms
apart, within the calls' spread). The flash and memory-efficient kernels need no plan. A decode
graph is captured once per batch size and replayed for the whole run, so it keeps cuDNN.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def eager_attention_without_cudnn(device: torch.device | str) -> None:
    """Process-wide: eager forwards on ``device`` pick flash or memory-efficient attention."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


@contextmanager
def graph_attention_kernels():
    """Every attention kernel allowed while a graph is captured (cuDNN's plan is built once, there),
    then the process's choice again."""
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)
