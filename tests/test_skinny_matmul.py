"""The decode step's skinny matmul kernel (engines/skinny_matmul.py) on the CPU, through Triton's
interpreter, in fp32 (the interpreter's bf16 tl.dot is wrong; bf16 is checked on the GPU in
tests/test_gpu.py). The interpreter is chosen when Triton is imported, hence a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from rollplex.engines import skinny_matmul as sm

    torch.manual_seed(0)
    sm.BLOCK_K = 32  # small tiles, so that a small K still splits into several stretches
    for rows, n, k, bias in ((1, 40, 600, True), (8, 16, 64, False), (17, 33, 200, True), (64, 20, 100, False)):
        # The weight is a column slice of a wider tensor (a tensor-parallel rank's share), with NaN
        # in the columns it does not own: a kernel that read past its K returns NaN.
        wide = torch.full((n, k + 24), float("nan"))
        wide[:, 8:8 + k] = torch.randn(n, k)
        weight = wide[:, 8:8 + k]
        x, b = torch.randn(rows, k), (torch.randn(n) if bias else None)
        got = sm.skinny_linear(x, weight, b)
        want = F.linear(x, weight, b)
        err = (got - want).abs().max().item()
        print(rows, n, k, sm.splits_for(n, k), err)
        assert got.shape == want.shape and err < 1e-4, err
    print("ok")
""")


def test_skinny_kernel_in_triton_interpreter_equals_linear():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
    splits = [int(line.split()[3]) for line in out.stdout.splitlines()[:-1]]
    assert max(splits) > 1 and min(splits) == 1  # both the summed stretches and the one-stretch path ran
