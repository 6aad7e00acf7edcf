"""The decode step's skinny projection kernel (engines/skinny_linear.py) on the CPU, through Triton's
interpreter (fp32; its bf16 tl.dot is wrong, see tests/test_decode_attention.py): every tiling the GPU
benchmark may pick equals F.linear, with and without a bias, at row counts and widths that leave
partial tiles, and with K cut into stretches summed by a second launch. The interpreter is chosen
when Triton is imported, hence a process of its own."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

def interpreted(script: str) -> str:
    """The script's stdout, run in a process of its own under Triton's interpreter; its stderr on failure."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout.strip()


SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from rollplex.engines.skinny_linear import CONFIGS, skinny_linear

    torch.manual_seed(0)
    checked = 0
    split = tuple(c for c in CONFIGS if c[4] > 1)
    for m, n, k in ((1, 40, 96), (8, 72, 160), (17, 33, 300), (64, 48, 64), (8, 40, 1000)):
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        for config in CONFIGS[:3] + split[:2] + split[-1:]:
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
    said = interpreted(SCRIPT)
    assert said == "60 ok", said


LAYER_SCRIPT = textwrap.dedent("""
    import torch
    from torch._inductor.utils import run_and_get_code
    from rollplex.engines.decode_step import _decoder_layer
    from rollplex.engines.projections import linear_for
    from rollplex.engines.skinny_linear import CONFIGS

    torch.manual_seed(0)
    n, heads, kv_heads, head_dim, hidden, mlp, slots = 4, 4, 2, 16, 64, 128, 8
    w = lambda *shape: torch.randn(*shape) * 0.1
    weights = (w(hidden) + 1, w((heads + 2 * kv_heads) * head_dim, hidden), w((heads + 2 * kv_heads) * head_dim),
               w(hidden, heads * head_dim), w(hidden) + 1, w(2 * mlp, hidden), w(hidden, mlp))
    x, residual = w(n, hidden), w(n, hidden)
    angle = torch.rand(n, 1, 1, head_dim)
    filled = torch.tensor([3, 5, 1, 8])
    visible = torch.zeros(n, 1, 1, slots).masked_fill(
        torch.arange(slots).view(1, 1, 1, -1) >= filled.view(-1, 1, 1, 1), float("-inf"))
    where = (torch.arange(n).view(-1, 1), torch.arange(kv_heads).view(1, -1), (filled - 1).view(-1, 1))
    caches = [w(n, kv_heads, slots, head_dim) for _ in range(2)]

    def layer(x, residual, k_cache, v_cache, linear):
        return _decoder_layer(x, residual, angle.cos(), angle.sin(), visible, where, k_cache, v_cache, weights,
                              (1e-6, 1e-6), heads, kv_heads, head_dim, head_dim ** -0.5, linear=linear)

    want = layer(x, residual, *(c.clone() for c in caches), None)
    skinny = linear_for(lambda n, k: CONFIGS[0])
    eager = layer(x, residual, *(c.clone() for c in caches), skinny)
    compiled, code = run_and_get_code(torch.compile(lambda *a: layer(*a, skinny), dynamic=False), x, residual,
                                      *(c.clone() for c in caches))
    code = "\\n".join(code)
    assert code.count("torch.ops.rollplex.skinny_linear.default(") == 4, "q|k|v, o, gate|up and down"
    assert "extern_kernels.mm(" not in code and "extern_kernels.addmm(" not in code
    for got in (eager, compiled):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    print("ok")
""")


def test_the_decode_layer_projects_through_the_kernel_eager_and_compiled():
    """engines/projections.py's custom op in the decode layer (fused q|k|v and gate|up, as a run
    sharing the trainer's weights has them): the same outputs as F.linear, and torch.compile keeps
    the four projections as the op."""
    said = interpreted(LAYER_SCRIPT)
    assert said.endswith("ok"), said


NORM_SCRIPT = textwrap.dedent("""
    import torch
    from torch._inductor.utils import run_and_get_code
    from rollplex.engines.decode_step import _norm_linear_of
    from rollplex.engines.projections import linear_for
    from rollplex.engines.skinny_linear import CONFIGS

    torch.manual_seed(0)
    separate = _norm_linear_of(torch.nn.functional.linear)
    fused = _norm_linear_of(linear_for(lambda n, k: CONFIGS[1], norm=True))
    checked = 0
    for m, k, n, silu in ((1, 96, 40, False), (8, 160, 72, True), (17, 300, 33, False), (8, 200, 48, True)):
        x, residual = torch.randn(m, k), torch.randn(m, k)
        norm_weight, w = torch.rand(k) + 0.5, torch.randn(2 * n if silu else n, k) * 0.1
        for b in (None, torch.randn(w.shape[0])) if not silu else (None,):
            want = separate(x, residual, norm_weight, 1e-6, w, b, silu)
            for got in (fused(x, residual, norm_weight, 1e-6, w, b, silu),
                        torch.compile(lambda *a: fused(*a), dynamic=False)(x, residual, norm_weight, 1e-6, w, b, silu)):
                for a, c in zip(got, want):
                    torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)
            checked += 1
    _, code = run_and_get_code(torch.compile(lambda *a: fused(*a), dynamic=False), x, residual, norm_weight, 1e-6, w,
                               None, True)
    assert "torch.ops.rollplex.skinny_norm_linear.default(" in "\\n".join(code)
    unfused = _norm_linear_of(linear_for(lambda n, k: None, norm=True))
    for a, c in zip(unfused(x, residual, norm_weight, 1e-6, w, None, True), separate(x, residual, norm_weight, 1e-6, w,
                                                                                    None, True)):
        torch.testing.assert_close(a, c, atol=0, rtol=0)
    print(checked, "ok")
""")


def test_the_norm_and_silu_fused_into_the_projection_equal_the_separate_ops():
    """``linear: skinny-norm``: the residual add and RMS norm ahead of q|k|v and gate|up, and
    gate|up's SiLU product, in the projection's launch (skinny_norm_linear) against the layer's
    separate ops, eager and compiled (fp32, the interpreter); a shape the table sends to cuBLAS
    takes the separate ops."""
    said = interpreted(NORM_SCRIPT)
    assert said == "6 ok", said


FUSED_LAYER_SCRIPT = textwrap.dedent("""
    import torch
    from rollplex.engines.decode_step import _decoder_layer
    from rollplex.engines.projections import linear_for
    from rollplex.engines.skinny_linear import CONFIGS

    torch.manual_seed(0)
    n, heads, kv_heads, dim, hidden, mlp, slots = 4, 4, 2, 16, 64, 96, 8
    w = lambda *shape: torch.randn(*shape) * 0.1
    weights = (w(hidden) + 1, w((heads + 2 * kv_heads) * dim, hidden), w((heads + 2 * kv_heads) * dim),
               w(hidden, heads * dim), w(hidden) + 1, w(2 * mlp, hidden), w(hidden, mlp))
    x, residual = w(n, hidden), w(n, hidden)
    lengths = torch.tensor([3, 5, 1, 8], dtype=torch.int32)
    angle = torch.rand(n, dim // 2) * 5
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    caches = [w(n, kv_heads, slots, dim) for _ in range(2)]

    def layer(linear):
        k_cache, v_cache = (c.clone() for c in caches)
        out = _decoder_layer(x, residual, cos, sin, lengths, None, k_cache, v_cache, weights, (1e-6, 1e-6), heads,
                             kv_heads, dim, dim ** -0.5, prefix=("layer",) + (None,) * 6, linear=linear)
        return (*out, k_cache, v_cache)

    want = layer(None)
    for got in (layer(linear_for(lambda n, k: CONFIGS[0], norm=True)), layer(linear_for(lambda n, k: CONFIGS[0]))):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    print("ok")
""")


def test_the_fused_attention_layer_with_the_norm_in_the_projections_equals_the_cublas_layer():
    """The decode layer as the GPU runs it (``decode_layer_attention``), its projections through
    ``linear: skinny`` and ``skinny-norm``, against F.linear and the separate norm (interpreter, fp32):
    the same hidden state, MLP output and cache writes."""
    said = interpreted(FUSED_LAYER_SCRIPT)
    assert said.endswith("ok"), said
