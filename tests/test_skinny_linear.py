"""The decode step's skinny projection kernel (engines/skinny_linear.py) on the CPU, through Triton's
interpreter (fp32; its bf16 tl.dot is wrong, see tests/test_decode_attention.py): every tiling the GPU
benchmark may pick equals F.linear, with and without a bias, at row counts and widths that leave
partial tiles. The interpreter is chosen when Triton is imported, hence a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from rollplex.engines.skinny_linear import CONFIGS, skinny_linear

    torch.manual_seed(0)
    checked = 0
    for m, n, k in ((1, 40, 96), (8, 72, 160), (17, 33, 300), (64, 48, 64)):
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        for config in CONFIGS[:3] + CONFIGS[-1:]:
            for bias in (None, b):
                err = (skinny_linear(x, w, bias, config) - F.linear(x, w, bias)).abs().max().item()
                assert err < 1e-4, (m, n, k, config, bias is not None, err)
                checked += 1
    try:
        skinny_linear(torch.randn(65, 8), torch.randn(4, 8))
    except ValueError as exc:
        assert "≤ 64 rows" in str(exc)
    else:
        raise AssertionError("65 rows were not refused")
    print(checked, "ok")
""")


def test_skinny_linear_in_triton_interpreter_equals_f_linear():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "32 ok", out.stdout[-2000:] + out.stderr[-3000:]
