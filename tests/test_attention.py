"""Tier 2: paged attention over a mixed batch against plain SDPA on gathered tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.model.cpu import kernels as cpu_kernels
from phasewise.model.attention import AttentionMetadata, paged_attention, write_kv


def reference(q_all, k_all, v_all, ctx, n, scale):
    """SDPA over one request's whole sequence; returns the rows of its last ``n`` tokens."""
    total = ctx + n
    q = q_all[ctx:total].transpose(0, 1)  # [H, n, D]
    k = k_all[:total].transpose(0, 1)
    v = v_all[:total].transpose(0, 1)
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    mask = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    n_decode=st.integers(0, 4),
    n_prefill=st.integers(0, 3),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
)
def test_paged_attention_matches_sdpa(data, n_decode, n_prefill, block_size, heads):
    if n_decode + n_prefill == 0:
        n_decode = 1
    n_heads, n_kv = heads
    hd = 8
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    chunk_lens = [1] * n_decode + [data.draw(st.integers(1, 20)) for _ in range(n_prefill)]
    context_lens = [data.draw(st.integers(0 if i >= n_decode else 0, 30))
                    for i in range(len(chunk_lens))]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(context_lens, chunk_lens)) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for c, n in zip(context_lens, chunk_lens):
        nb = -(-(c + n) // block_size)
        tables.append(perm[used:used + nb])
        used += nb

    k_cache = torch.randn(num_blocks, block_size, n_kv, hd, generator=g)
    v_cache = torch.randn(num_blocks, block_size, n_kv, hd, generator=g)
    seqs = []  # per request: full q, k, v over context + chunk
    for c, n, table in zip(context_lens, chunk_lens, tables):
        q = torch.randn(c + n, n_heads, hd, generator=g)
        k = torch.randn(c + n, n_kv, hd, generator=g)
        v = torch.randn(c + n, n_kv, hd, generator=g)
        for pos in range(c):  # the context is already in the cache
            blk, off = table[pos // block_size], pos % block_size
            k_cache[blk, off], v_cache[blk, off] = k[pos], v[pos]
        seqs.append((q, k, v))

    meta = AttentionMetadata.build(chunk_lens=chunk_lens, context_lens=context_lens,
                                   block_tables=tables, block_size=block_size,
                                   device=torch.device("cpu"))
    q_flat = torch.cat([q[c:] for (q, _, _), c in zip(seqs, context_lens)])
    k_flat = torch.cat([k[c:] for (_, k, _), c in zip(seqs, context_lens)])
    v_flat = torch.cat([v[c:] for (_, _, v), c in zip(seqs, context_lens)])
    write_kv(k_flat, v_flat, k_cache, v_cache, meta.slot_mapping)
    scale = hd**-0.5
    out = paged_attention(q_flat, k_flat, v_flat, k_cache, v_cache, meta, scale)

    start = 0
    for (q, k, v), c, n in zip(seqs, context_lens, chunk_lens):
        ref = reference(q, k, v, c, n, scale)
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-5)
        start += n


def test_write_kv_puts_each_token_in_its_slot():
    k_cache = torch.zeros(3, 2, 1, 4)
    v_cache = torch.zeros(3, 2, 1, 4)
    meta = AttentionMetadata.build(chunk_lens=[3], context_lens=[0], block_tables=[[2, 0]],
                                   block_size=2, device=torch.device("cpu"))
    assert meta.slot_mapping.tolist() == [4, 5, 0]
    k = torch.arange(12.0).view(3, 1, 4)
    write_kv(k, -k, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache[2, 0, 0], k[0, 0]) and torch.equal(k_cache[2, 1, 0], k[1, 0])
    assert torch.equal(k_cache[0, 0, 0], k[2, 0]) and torch.equal(v_cache[0, 0, 0], -k[2, 0])
    assert k_cache[1].abs().sum() == 0


def test_decode_group_must_lead_the_batch():
    meta = AttentionMetadata.build(chunk_lens=[1, 1, 5, 1], context_lens=[3, 0, 2, 4],
                                   block_tables=[[0], [1], [2, 3], [4, 5]], block_size=4,
                                   device=torch.device("cpu"))
    # Only the leading single-token chunks form the decode group; the trailing one is a span.
    assert meta.num_decode_tokens == 2
    assert [(p.start, p.end, p.context_len) for p in meta.prefills] == [(2, 7, 2), (7, 8, 4)]


@pytest.mark.parametrize("kernel", ["amx", "avx512bf16"])
@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    ctx=st.sampled_from([0, 0, 1, 31, 70]),
    n=st.sampled_from([2, 5, 16, 17, 33, 64, 100]),  # 1 token: a decode, not a prefill
    block_size=st.sampled_from([4, 16]),
    heads=st.sampled_from([(4, 4), (4, 2), (14, 2), (6, 1)]),
    hd=st.sampled_from([32, 64, 128, 256]),
)
def test_prefill_attention_kernels_match_sdpa(kernel, data, ctx, n, block_size, heads, hd):
    """The AMX flash attention and the AVX512_BF16 one (K/V from the paged cache, causal,
    GQA, a context before the chunk, the tasks' tails) against SDPA in fp32 on the same bf16
    inputs: within bf16 rounding of the weights and the output. AMX takes head sizes up to
    128, the AVX512_BF16 kernel up to 256."""
    from unittest import mock

    from phasewise.model.cpu.linear import LinearDispatch
    from phasewise.model.cpu.ops import CpuKernelOps

    if kernel == "amx" and not cpu_kernels.amx_available():
        pytest.skip(f"AMX kernels unavailable: {cpu_kernels.KERNELS.amx_reason}")
    if kernel == "avx512bf16" and not cpu_kernels.avx512bf16_available():
        pytest.skip(f"AVX512_BF16 kernels unavailable: {cpu_kernels.KERNELS.avx512bf16_reason}")
    if kernel == "amx" and hd > 128:
        hd = 128

    n_heads, n_kv = heads
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    nb = -(-(ctx + n) // block_size)
    num_blocks = nb + 3
    table = torch.randperm(num_blocks, generator=g)[:nb].tolist()
    k_cache = torch.randn(num_blocks, block_size, n_kv, hd, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, n_kv, hd, generator=g).bfloat16()
    q = (torch.randn(ctx + n, n_heads, hd, generator=g) * 2).bfloat16()
    k = torch.randn(ctx + n, n_kv, hd, generator=g).bfloat16()
    v = torch.randn(ctx + n, n_kv, hd, generator=g).bfloat16()
    for pos in range(ctx):  # the context is already in the cache
        blk, off = table[pos // block_size], pos % block_size
        k_cache[blk, off], v_cache[blk, off] = k[pos], v[pos]
    meta = AttentionMetadata.build(chunk_lens=[n], context_lens=[ctx], block_tables=[table],
                                   block_size=block_size, device=torch.device("cpu"))
    # the chunk's q as a view into a wider buffer, as the model's qkv rows are
    wide = torch.zeros(n, n_heads + 3, hd).bfloat16()
    wide[:, 1:1 + n_heads] = q[ctx:]
    write_kv(k[ctx:], v[ctx:], k_cache, v_cache, meta.slot_mapping)
    ops = CpuKernelOps(LinearDispatch(kernel_max_rows=0, large="torch"))
    taken = []

    def prefill_fn(*args):
        taken.append(ops.prefill_attention(*args))
        return taken[-1]

    scale = hd**-0.5
    # the AVX512_BF16 kernel where the CPU also has AMX: as if it had not
    no_amx = mock.patch.object(cpu_kernels, "amx_available", lambda: False)
    with no_amx if kernel == "avx512bf16" else contextlib.nullcontext():
        out = paged_attention(wide[:, 1:1 + n_heads], k[ctx:], v[ctx:], k_cache, v_cache, meta,
                              scale, prefill_fn=prefill_fn)
    assert taken == [True]
    ref = reference(q.float(), k.float(), v.float(), ctx, n, scale)
    torch.testing.assert_close(out.float(), ref, atol=0.03, rtol=0.03)
