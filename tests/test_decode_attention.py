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


LAYER_SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from rollplex.engines import decode_attention
    from rollplex.engines.decode_attention import (PREFIX_MEMBERS, decode_layer_attention, prefix_splits_for,
                                                   shared_prefix_attention_sdpa, splits_for)

    decode_attention.PREFIX_TOKENS_PER_SPLIT = 64  # several stretches of these short prompts

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    torch.manual_seed(0)
    for heads, kv_heads, with_prefix in ((16, 2, True), (28, 4, True), (8, 8, False)):
        dim, slots, prefix_len, max_len = 32, 3, 150, 140
        slot_of_row = [0, 2, 0, 0, 2, 0, 0, 0, 0, 0]  # nine rows of prompt 0: two entries
        prompt_of_slot = {0: 140, 2: 17}
        n = len(slot_of_row) + 1  # and a padding row, in no entry
        lengths = torch.randint(1, max_len + 1, (n,), dtype=torch.int32)
        lengths[3], lengths[4] = 1, max_len
        last = (lengths - 1).long()
        qkv = torch.randn(n, (heads + 2 * kv_heads) * dim)
        angle = torch.randint(0, 500, (n, 1)).float() * torch.rand(1, dim // 2)
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        k_cache, v_cache = torch.randn(n, kv_heads, max_len, dim), torch.randn(n, kv_heads, max_len, dim)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q = rope(q.view(n, heads, dim), cos.view(n, 1, dim), sin.view(n, 1, dim))
        k = rope(k.view(n, kv_heads, dim), cos.view(n, 1, dim), sin.view(n, 1, dim))
        k_want, v_want = k_cache.clone(), v_cache.clone()
        rows = torch.arange(n)
        k_want[rows, :, last], v_want[rows, :, last] = k, v.view(n, kv_heads, dim)
        own = torch.arange(max_len).view(1, -1) < lengths.view(-1, 1).long()
        if with_prefix:
            pk, pv = torch.randn(slots, kv_heads, prefix_len, dim), torch.randn(slots, kv_heads, prefix_len, dim)
            entries = [(s, rs[i: i + PREFIX_MEMBERS]) for s in prompt_of_slot
                       for rs in [[r for r, t in enumerate(slot_of_row) if t == s]]
                       for i in range(0, len(rs), PREFIX_MEMBERS)]
            entry_slot, entry_len = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
            members = torch.full((n, PREFIX_MEMBERS), -1, dtype=torch.int32)
            for e, (s, rs) in enumerate(entries):
                entry_slot[e], entry_len[e] = s, prompt_of_slot[s]
                members[e, : len(rs)] = torch.tensor(rs)
            prompt_len = torch.tensor([prompt_of_slot[s] for s in slot_of_row] + [0])
            valid = torch.cat([torch.arange(prefix_len).view(1, -1) < prompt_len.view(-1, 1), own], 1)
            mask = torch.zeros(n, 1, 1, prefix_len + max_len).masked_fill(~valid.view(n, 1, 1, -1), float("-inf"))
            want = shared_prefix_attention_sdpa(q, pk, pv, torch.tensor(slot_of_row + [0]), k_want, v_want, mask,
                                                dim ** -0.5)
            for s in range(slots):  # NaN past each prompt: a kernel that read there returns NaN
                pk[s, :, prompt_of_slot.get(s, 0):] = float("nan")
                pv[s, :, prompt_of_slot.get(s, 0):] = float("nan")
            prefix = (pk, pv, entry_slot, entry_len, members, prompt_len)
            checked = n - 1
        else:
            mask = torch.zeros(n, 1, 1, max_len).masked_fill(~own.view(n, 1, 1, -1), float("-inf"))
            want = F.scaled_dot_product_attention(q.view(n, heads, 1, dim), k_want, v_want, attn_mask=mask,
                                                  scale=dim ** -0.5, enable_gqa=True).view(n, heads, dim)
            prefix, checked = (None,) * 6, n
        # NaN past each row's length and in the slot the kernel writes: it must use this step's k, v.
        unread = ~own.view(n, 1, max_len, 1)
        unread[rows, :, last] = True
        k_cache, v_cache = k_cache.masked_fill(unread, float("nan")), v_cache.masked_fill(unread, float("nan"))
        got = decode_layer_attention(qkv, cos, sin, lengths, k_cache, v_cache, *prefix, heads, dim ** -0.5)
        err = (got[:checked] - want[:checked]).abs().max().item()
        written = torch.cat([(k_cache[rows, :, last] - k_want[rows, :, last]).flatten(),
                             (v_cache[rows, :, last] - v_want[rows, :, last]).flatten()]).abs().max().item()
        stretches = prefix_splits_for(2, kv_heads, prefix_len) if with_prefix else 0
        print(heads, kv_heads, with_prefix, stretches, splits_for(n, kv_heads, max_len), err, written)
        assert err < 1e-5 and written < 1e-6, (err, written)  # NaN fails both
    print("ok")
""")


def test_layer_kernel_in_triton_interpreter_rotates_writes_the_step_and_attends_as_sdpa():
    """``decode_layer_attention`` from an unrotated q|k|v against RoPE, the cache write and SDPA over
    each row's prompt slot then its own filled slots; with and without a prefix cache, a group of
    nine rows over two entries, a padding row in none, rows of length 1 and of the whole cache."""
    out = subprocess.run([sys.executable, "-c", LAYER_SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines()[:-1]]
    assert int(rows[0][3]) > 1 and int(rows[0][4]) > 1  # prompt and own slots in several stretches, merged


def test_chunked_argmax_is_argmax_first_of_ties_included():
    """The sampler's argmax over chunks of the vocabulary (``decode_step._argmax_rows``) picks what
    ``argmax`` picks, the first of equal maxima included, for vocabularies the chunks do and do not
    divide."""
    import torch

    from rollplex.engines.decode_step import _argmax_rows

    torch.manual_seed(0)
    for vocab in (151936, 1000, 997):
        scores = torch.randn(6, vocab)
        scores[1, 10] = scores[1, vocab - 3] = 50.0  # a tie across chunks: the first wins
        scores[2, 1185:1190] = 50.0  # a tie across a chunk boundary (1187 of 151936)
        scores[3] = 0.0  # every score equal: index 0
        assert torch.equal(_argmax_rows(scores), scores.argmax(-1)), vocab


COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from rollplex.engines import decode_kernels as kernels

    def signature(fn, pointers, floats, constants):
        return {name: "constexpr" if name in constants else pointers.get(name)
                or ("fp32" if name in floats else "i32") for name in fn.arg_names}

    bf16, f32, i32 = "*bf16", "*fp32", "*i32"
    pointers = dict(qkv_ptr=bf16, cos_ptr=f32, sin_ptr=f32, len_ptr=i32, k_ptr=bf16, v_ptr=bf16, pk_ptr=bf16,
                    pv_ptr=bf16, slot_ptr=i32, elen_ptr=i32, members_ptr=i32, acc_ptr=f32, m_ptr=f32, l_ptr=f32,
                    q_ptr=bf16, out_ptr=bf16, prompt_ptr="*i64")
    cases = [
        (kernels.layer_partials, dict(HEADS=16, KV=2, GROUP=8, GROUP_PAD=8, ROW_PAD=16, MEMBERS=8, D=128, SPLITS=33,
                                      PREFIX_SPLITS=17, FIRST=17, ROW_SPLITS=16, BLOCK=64, IEEE=False)),
        (kernels.layer_partials, dict(HEADS=28, KV=4, GROUP=7, GROUP_PAD=8, ROW_PAD=16, MEMBERS=8, D=128, SPLITS=16,
                                      PREFIX_SPLITS=1, FIRST=0, ROW_SPLITS=16, BLOCK=64, IEEE=False)),
        (kernels.partial_attention, dict(GROUP=8, GROUP_PAD=16, D=128, SPLITS=16, FIRST=0, BLOCK=64, IEEE=False)),
        (kernels.prefix_partial_attention, dict(GROUP=8, GROUP_PAD=8, MEMBERS=8, D=128, SPLITS=20, BLOCK=64,
                                                IEEE=False)),
        (kernels.merge_stretches, dict(SPLITS=33, SPLITS_PAD=64, D=128, HEADS=16, PREFIX_SPLITS=17)),
    ]
    for fn, constants in cases:
        source = ASTSource(fn, signature(fn, pointers, {"scale"}, constants), constants)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print(fn.__name__, "compiled")
    print("ok")
""")


def test_decode_kernels_compile_for_hopper_without_a_gpu():
    """Triton's interpreter (the tests above) runs a kernel as Python and misses what only its
    compiler refuses, such as a variable typed differently on the two sides of a branch: compile
    each kernel for sm_90 here, as the GPU would on first use."""
    out = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
