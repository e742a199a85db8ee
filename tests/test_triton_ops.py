"""The CUDA path's fused Triton kernels (``phasewise.model.triton_ops``) against ``TorchOps``,
run on CPU through Triton's interpreter, and a whole model generating through them.

RoPE and the residual sum round where torch rounds, so in fp32 they must match torch's bits;
in bf16 within one unit in the last place, because Triton's interpreter truncates its casts to
bf16 where the GPU (and torch) round to nearest even. The norm and SiLU may differ by a unit
or two in the last place (fp32 reduction order, exp implementations); attention keeps fp32
scores and probabilities, so against torch's fp32 path it agrees to fp32 rounding.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

# conftest.py sets TRITON_INTERPRET=1 before anything imports triton: the kernels run on CPU
pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET)", allow_module_level=True)

from phasewise import LLM, SamplingParams
from phasewise.model import triton_ops
from phasewise.model.attention import AttentionMetadata, decode_attention_torch
from phasewise.model.ops import TorchOps

TORCH, TRITON = TorchOps(), triton_ops.TritonOps()


def ulp_close(a: torch.Tensor, b: torch.Tensor, ulps: int = 1) -> bool:
    """Within ``ulps`` units in the last place of ``a``'s dtype (relative), or tiny; in
    bf16, two more per cast the interpreter truncates along the way (at most two)."""
    eps = torch.finfo(a.dtype).eps
    if a.dtype == torch.bfloat16:
        ulps += 2
    diff = (a.float() - b.float()).abs()
    return bool((diff <= ulps * eps * torch.maximum(a.float().abs(), b.float().abs())
                 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [64, 96, 896])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype, cols, with_delta):
    g = torch.Generator().manual_seed(cols)
    hidden = torch.randn(5, cols, generator=g).to(dtype) * 3
    delta = torch.randn(5, cols, generator=g).to(dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype)
    want_n, want_h = TORCH.add_rms_norm(delta, hidden, weight, 1e-6)
    got_n, got_h = TRITON.add_rms_norm(delta, hidden, weight, 1e-6)
    if dtype == torch.float32:
        assert torch.equal(got_h, want_h)  # the residual stream: torch's rounding
    assert ulp_close(got_h, want_h)
    assert got_n.dtype == dtype and ulp_close(got_n, want_n, ulps=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,hd", [(6, 16), (3, 64), (20, 128)])
def test_rope(dtype, heads, hd):
    g = torch.Generator().manual_seed(heads)
    t = 7
    # a strided view, as the layer passes q and k: columns of the fused qkv output
    qkv = torch.randn(t, (heads + 2) * hd, generator=g).to(dtype)
    x = qkv[:, :heads * hd].view(t, heads, hd)
    pos = torch.tensor([0, 1, 5, 9, 100, 3, 40])
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(128).float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    tables = TORCH.rope_tables(cos, sin, pos, dtype)
    got, want = TRITON.rope(x, tables), TORCH.rope(x, tables)
    assert got.shape == want.shape
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # a sum of two rounded products: its error scales with the terms, not the sum
        tol = 4 * torch.finfo(dtype).eps * x.float().abs().max()
        assert ((got.float() - want.float()).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [96, 1000, 2500])
def test_silu_mul(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(3, 2 * inter, generator=g) * 4).to(dtype)
    want, got = TORCH.silu_mul(gate_up), TRITON.silu_mul(gate_up)
    assert got.shape == want.shape and ulp_close(got, want, ulps=2)


def paged_case(n_heads: int, n_kv: int, hd: int, lens: list[int], bs: int = 16,
               num_blocks: int = 40, pad_to: int = 0):
    """A paged cache, shuffled block tables for rows of ``lens`` keys (each padded to
    ``pad_to`` blocks with block 0, as a captured graph pads them), and a strided q."""
    rng = random.Random(n_heads * 100 + n_kv + sum(lens))
    g = torch.Generator().manual_seed(n_heads + hd)
    k_cache = torch.randn(num_blocks, bs, n_kv, hd, generator=g)
    v_cache = torch.randn(num_blocks, bs, n_kv, hd, generator=g)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    meta = AttentionMetadata.build(chunk_lens=[1] * len(lens), context_lens=[n - 1 for n in lens],
                                   block_tables=tables, block_size=bs,
                                   device=torch.device("cpu"))
    if pad_to:
        wide = torch.zeros(len(lens), pad_to, dtype=meta.decode_block_tables.dtype)
        wide[:, :meta.decode_block_tables.shape[1]] = meta.decode_block_tables
        meta.decode_block_tables = wide
    q = torch.randn(len(lens), n_heads + n_kv, hd, generator=g)[:, :n_heads]  # strided
    return q, k_cache, v_cache, meta, hd ** -0.5


LENS = [1, 16, 17, 100, 5, 64]  # with the new token; block edges both sides


@pytest.mark.parametrize("n_heads,n_kv,hd", [(4, 4, 16), (4, 2, 32), (14, 2, 64), (8, 1, 16)])
def test_paged_decode_attention(n_heads, n_kv, hd):
    q, k_cache, v_cache, meta, scale = paged_case(n_heads, n_kv, hd, LENS)
    want = decode_attention_torch(q, k_cache, v_cache, meta, scale)
    got = TRITON.decode_attention(q, k_cache, v_cache, meta, scale)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("programs", [30, 100, 10 ** 6])
@pytest.mark.parametrize("n_heads,n_kv,hd,pad_to", [(4, 2, 32, 0), (14, 2, 64, 16),
                                                    (8, 1, 16, 32)])
def test_paged_decode_attention_split_across_programs(programs, n_heads, n_kv, hd, pad_to):
    """Rows' blocks shared among several programs, then combined: torch's attention, whether
    a split holds several blocks, one, or none (more splits than the row has blocks, as a
    short row in a wide captured table gets)."""
    ops = triton_ops.TritonOps(decode_programs=programs)
    q, k_cache, v_cache, meta, scale = paged_case(n_heads, n_kv, hd, LENS, pad_to=pad_to)
    splits = triton_ops.decode_splits(len(LENS), n_kv, meta.decode_block_tables.shape[1],
                                      programs)
    assert splits > 1
    want = decode_attention_torch(q, k_cache, v_cache, meta, scale)
    got = ops.decode_attention(q, k_cache, v_cache, meta, scale)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_split_keeps_extreme_scores():
    """A split whose keys all score far below another's (exp underflows to 0 in its own
    scale) must still weigh in at its true, tiny weight, and one far above must dominate:
    the combine rescales every split to the common max."""
    ops = triton_ops.TritonOps(decode_programs=10 ** 6)
    q, k_cache, v_cache, meta, scale = paged_case(4, 1, 32, [80], num_blocks=8)
    blocks = meta.decode_block_tables[0].tolist()
    k_cache[blocks[0]] *= 40  # scores in the hundreds in the first split...
    k_cache[blocks[3]] *= -40  # ...and far below in another
    want = decode_attention_torch(q, k_cache, v_cache, meta, scale)
    got = ops.decode_attention(q, k_cache, v_cache, meta, scale)
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_decode_splits():
    # a wave's worth of (row, KV head) pairs already: one program each
    assert triton_ops.decode_splits(32, 8, 16, programs=264) == 1
    assert triton_ops.decode_splits(1, 8, 16, programs=0) == 1
    # batch 1 of 8 KV heads on 132 multiprocessors: 33 splits wanted, the table's 16 blocks
    assert triton_ops.decode_splits(1, 8, 16, programs=264) == 16
    assert triton_ops.decode_splits(2, 8, 1024, programs=264) == 17
    assert triton_ops.decode_splits(1, 8, 1024, programs=264) == triton_ops.MAX_DECODE_SPLITS
    assert triton_ops.decode_splits(8, 8, 64, programs=264) == 5
    for rows in range(1, 70):
        for width in (1, 16, 64, 4096):
            n = triton_ops.decode_splits(rows, 8, width, programs=264)
            assert 1 <= n <= min(width, triton_ops.MAX_DECODE_SPLITS)
            assert n == 1 or rows * 8 * 2 < 264


@pytest.mark.parametrize("programs", [0, 10 ** 6])
def test_a_model_generates_the_same_tokens_through_the_kernels(llama_dir, programs):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7] * 4, [3, 4, 5], [11] * 30]
    want = LLM(str(llama_dir), dtype="float32", kernels="torch").generate(prompts, params)
    llm = LLM(str(llama_dir), dtype="float32", kernels="torch")
    llm.engine.model.ops = triton_ops.TritonOps(decode_programs=programs)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]



def test_padded_graph_steps_split_rows_as_the_eager_kernel_walks_them(llama_dir):
    """The CUDA-graph runner's padded static buffers (run eagerly on CPU), whose tables are
    padded to a power-of-two width with the scratch block and whose padded rows attend to
    one key: with every row's blocks split across programs, the greedy tokens are those of
    the unsplit kernel on the unpadded path."""
    from conftest import padded

    # 3 rows (a bucket of 4) of 1, 2 and 3 blocks; the longest crosses into a fourth block
    # at its third decode step (position 48)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7] * 9, [3, 4, 5], [11] * 30]
    kw = {"dtype": "float32", "kernels": "torch", "max_model_len": 512, "block_size": 16}
    eager = LLM(str(llama_dir), **kw)
    eager.engine.model.ops = triton_ops.TritonOps(decode_programs=0)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    llm = padded(LLM(str(llama_dir), **kw))
    eng = llm.engine
    eng.model.ops = triton_ops.TritonOps(decode_programs=10 ** 6)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert eng.runner.graphs.replays >= 5
