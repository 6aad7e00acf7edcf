"""Two data-parallel ranks on two GPUs (NCCL), one LocalCluster worker per GPU, against one GPU with the
same global batch. Run on the 2-GPU machine with ``pytest -m gpu tests/test_distributed_gpu.py``.

fp32 and the tiny model, so the comparison is about the runtime (placement, NCCL all-reduce, loss
normalisation), not bf16 rounding; GPU kernels and NCCL's reduction order still differ between the
runs, so the tolerance is that of tests/test_distributed.py (1% of one Adam step).
"""
from __future__ import annotations

import pytest
import torch
from test_distributed import ARGS, assert_same_update, rl_rows, train

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
GPU = ["--set", "model.device=cuda", "--set", "model.dtype=float32"]


def test_one_worker_per_gpu_equals_one_gpu_with_the_same_global_batch(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 CUDA devices, found {torch.cuda.device_count()}; run it on the 2-GPU machine")
    assert "--workers" not in ARGS
    one, two = tmp_path / "one", tmp_path / "two"
    # One after the other: the 1-GPU run would otherwise share GPU 0 with rank 0.
    train(one, *GPU)
    train(two, *GPU, "--workers", "2")
    a, b = rl_rows(one), rl_rows(two)
    assert [r["iteration"] for r in b] == [0, 1]
    for x, y in zip(a, b):
        assert y["reward_mean"] == x["reward_mean"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    assert_same_update(one, two)
    trace = (two / "traces" / "iter_000001.json").read_text()
    assert '"rank0"' in trace and '"rank1"' in trace


def test_a_tensor_parallel_rollout_over_two_gpus_trains_as_the_data_parallel_one(tmp_path):
    """cluster.tp_rollout=2 on two GPUs: the torch-graph engines' NCCL all-reduces run inside their
    CUDA graphs while DeepSpeed all-reduces gradients on the same ranks."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 CUDA devices, found {torch.cuda.device_count()}; run it on the 2-GPU machine")
    common = (*GPU, "--workers", "2", "--set", "engines.decode=torch-graph")
    dp, tp = tmp_path / "dp", tmp_path / "tp"
    train(dp, *common)
    log = train(tp, *common, "--set", "cluster.tp_rollout=2")
    assert "decode tensor parallel: rank0 1/2, rank1 2/2" in log.stdout + log.stderr
    for x, y in zip(rl_rows(dp), rl_rows(tp)):
        assert y["reward_mean"] == x["reward_mean"] and y["response_len_mean"] == x["response_len_mean"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    assert_same_update(dp, tp)


def test_two_gpus_training_in_their_windows_with_the_torch_engine_equal_one_gpu(tmp_path):
    """Train fusion over two GPU ranks: each trains the groups its decode chain finished, and the torch
    engine all-reduces the gradients over NCCL at the step, so loss, gradient norm and weights are the
    one-GPU fused run's."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs 2 CUDA devices, found {torch.cuda.device_count()}; run it on the 2-GPU machine")
    fused = (*GPU, "--set", "engines.train=torch", "--set", "schedule=rollplex", "--set", "train.train_fusion=true")
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, *fused)
    log = train(two, *fused, "--workers", "2")
    assert "train fusion off" not in log.stdout + log.stderr
    trace = (two / "traces" / "iter_000001.json").read_text()
    assert '"train_c0_r0"' in trace and '"train_c0_r1"' in trace
    a, b = rl_rows(one), rl_rows(two)
    assert [r["grad_norm"] for r in b] == pytest.approx([r["grad_norm"] for r in a], rel=1e-4)
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-4, abs=1e-7)
    assert_same_update(one, two)
