"""The split-KV decode attention kernel (engines/decode_attention.py) on the CPU, through Triton's
interpreter: the same kernel source the GPU compiles, run on CPU tensors. fp32 only: the
interpreter's bf16 tl.dot is wrong (a 16x32 product came out 1e10 off), so bf16 is checked on the GPU
(tests/test_gpu.py). The interpreter is chosen when Triton is imported, hence a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from rollplex.engines.decode_attention import splits_for, split_kv_attention

    torch.manual_seed(0)
    for heads, kv_heads, max_len in ((16, 2, 300), (4, 4, 300), (8, 2, 700)):
        n, dim = 6, 128
        lengths = torch.tensor([1, 2, 63, 64, 133, max_len], dtype=torch.int32)
        q = torch.randn(n, heads, dim)
        k, v = torch.randn(n, kv_heads, max_len, dim), torch.randn(n, kv_heads, max_len, dim)
        filled = torch.arange(max_len).view(1, -1) < lengths.view(-1, 1)
        mask = torch.zeros(n, 1, 1, max_len).masked_fill(~filled.view(n, 1, 1, -1), float("-inf"))
        want = F.scaled_dot_product_attention(q.view(n, heads, 1, dim), k, v, attn_mask=mask, scale=dim ** -0.5,
                                              enable_gqa=True).view(n, heads, dim)
        past = ~filled.view(n, 1, max_len, 1)  # NaN there: a kernel that read past a row's length returns NaN
        got = split_kv_attention(q, k.masked_fill(past, float("nan")), v.masked_fill(past, float("nan")),
                                 lengths, dim ** -0.5)
        err = (got - want).abs().max().item()
        print(heads, kv_heads, max_len, splits_for(n, kv_heads, max_len), err)
        assert err < 1e-5, err
    print("ok")
""")


def test_split_kv_kernel_in_triton_interpreter_equals_sdpa_over_each_rows_filled_slots():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
    splits = [int(line.split()[3]) for line in out.stdout.splitlines()[:-1]]
    assert splits[2] > 1  # several stretches per row, merged, were checked
