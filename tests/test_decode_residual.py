"""The compiled decode layer adds each residual inside the RMS norm that reads it: as ``x + mm(...)``,
Inductor makes cuBLAS's addmm, which copies x into the output first (on the GPU, two copies per layer
and step) and rounds the sum once where the eager layer rounds mm first (engines/decode_step.py)."""
from __future__ import annotations

import torch
from torch._inductor.utils import run_and_get_code

from rollplex.engines.decode_step import _decoder_layer


def test_the_compiled_layer_folds_no_residual_into_a_matmul_and_equals_the_eager_layer():
    torch.manual_seed(0)
    n, heads, kv_heads, head_dim, hidden, mlp, slots = 4, 4, 2, 16, 64, 128, 8
    bf16 = torch.bfloat16

    def w(*shape):
        return (torch.randn(*shape) * 0.1).to(bf16)

    weights = (w(hidden) + 1, w(heads * head_dim, hidden), w(heads * head_dim), w(kv_heads * head_dim, hidden),
               w(kv_heads * head_dim), w(kv_heads * head_dim, hidden), w(kv_heads * head_dim),
               w(hidden, heads * head_dim), w(hidden) + 1, w(mlp, hidden), w(mlp, hidden), w(hidden, mlp))
    x, residual = w(n, hidden), w(n, hidden)
    angle = torch.rand(n, 1, 1, head_dim)
    cos, sin = angle.cos().to(bf16), angle.sin().to(bf16)
    filled = torch.tensor([3, 5, 1, 8])
    visible = torch.zeros(n, 1, 1, slots, dtype=bf16).masked_fill(
        torch.arange(slots).view(1, 1, 1, -1) >= filled.view(-1, 1, 1, 1), float("-inf"))
    where = (torch.arange(n).view(-1, 1), torch.arange(kv_heads).view(1, -1), (filled - 1).view(-1, 1))

    def layer(x, residual, k_cache, v_cache):
        return _decoder_layer(x, residual, cos, sin, visible, where, k_cache, v_cache, weights, (1e-6, 1e-6),
                              heads, kv_heads, head_dim, head_dim ** -0.5)

    caches = [w(n, kv_heads, slots, head_dim) for _ in range(2)]
    eager = layer(x, residual, *(c.clone() for c in caches))
    compiled, code = run_and_get_code(torch.compile(layer, dynamic=False), x, residual, *(c.clone() for c in caches))
    # q, k and v carry biases (addmm is right there); a residual folded into o or down would add more
    assert "\n".join(code).count("extern_kernels.addmm(") == 3
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
