"""Eager forwards without cuDNN's attention, graph captures with it (engines/attention_kernels.py)."""
from __future__ import annotations

import pytest
import torch

from rollplex.engines.attention_kernels import eager_attention_without_cudnn, graph_attention_kernels


@pytest.fixture
def cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_only_a_cuda_host_turns_cudnn_attention_off(cudnn_flag):
    eager_attention_without_cudnn("cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    eager_attention_without_cudnn(torch.device("cuda", 0))
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_capture_has_cudnn_attention_and_leaves_the_eager_choice_as_it_was(cudnn_flag):
    eager_attention_without_cudnn("cuda")
    with graph_attention_kernels():
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError), graph_attention_kernels():
        raise RuntimeError("capture failed")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
