"""Tier 2: the hand-written CPU linear kernel and the dispatch against fp32 references."""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpu_helpers import op_by_op

from phasewise.model.cpu import kernels as cpu_kernels
from phasewise.model.cpu import linear
from phasewise.model.cpu.kernels import ProjMode
from phasewise.model.cpu.linear import ALL_ROWS, LinearDispatch, Upcast
from phasewise.model.cpu.ops import CpuKernelOps
from phasewise.model.cpu.quant import dequantize_rows, quantize_rows_int8
from phasewise.model.linear_types import Int8Linear, PanelLinear
from phasewise.model.ops import TorchOps

_BENCH: list[cpu_kernels.KernelLibrary] = []  # the benchmark build, compiled once


def bench_library() -> cpu_kernels.KernelLibrary:
    """The benchmark build, loaded (compiled once per test session)."""
    if not _BENCH:
        _BENCH.append(cpu_kernels.KernelLibrary(bench_knobs=True))
    assert _BENCH[0].load() is not None, _BENCH[0].reason
    return _BENCH[0]


@contextlib.contextmanager
def bench_build():
    """The benchmark build of the library (-DPW_BENCH_KNOBS: the comparison switches as C
    globals) as the module's library for the block: its kernels run through it there."""
    lib, before = bench_library(), cpu_kernels.KERNELS
    cpu_kernels.KERNELS = lib
    try:
        yield lib
    finally:
        cpu_kernels.KERNELS = before


@contextlib.contextmanager
def kernel_global(name: str, value: int, lib=None):
    """A C global int of the benchmark build (a comparisons switch: pw_pk_nta, pw_pk_spread,
    pw_avx512bf16_attn_kl, each 1 by default; ``bench_kernels``) set to ``value`` for the
    block, then put back to 1."""
    flag = ctypes.c_int.in_dll(lib or cpu_kernels.load(), name)
    flag.value = value
    try:
        yield
    finally:
        flag.value = 1


needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.KERNELS.reason}")
needs_amx = pytest.mark.skipif(not cpu_kernels.amx_available(),
                               reason=f"AMX kernels unavailable: {cpu_kernels.KERNELS.amx_reason}")


def reference(x, w, b):
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


@needs_kernels
@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 300), k=st.integers(1, 600), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1),
       # linear_avx512bf16 where the AVX512_BF16 kernels run: every tile shape (1-6 tokens of 4
       # weight rows, 7-8 of 3, the N % 4 or N % 3 rows left over), K not a multiple of 32
       fn=st.sampled_from(["linear_bf16", "gemm_bf16",
                           *(["linear_avx512bf16"] if cpu_kernels.avx512bf16_available() else [])]))
def test_kernels_match_fp32_reference(m, n, k, bias, seed, fn):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = getattr(cpu_kernels, fn)(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = reference(x, w, b)
    # Exact fp32 accumulation then one bf16 rounding: within one bf16 ulp of the reference,
    # give or take fp32 summation order.
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-4 * k)


needs_avx512bf16 = pytest.mark.skipif(
    not cpu_kernels.avx512bf16_available(),
    reason=f"AVX512_BF16 kernels unavailable: {cpu_kernels.KERNELS.avx512bf16_reason}")


@needs_avx512bf16
def test_avx512bf16_linear_rounds_once_and_keeps_nans():
    """Past a block of tokens (512 KiB of bf16 rows: 436 rows of 600) the results hold; the
    one rounding is to nearest even (as torch's), and a NaN in a token's row makes that
    row's outputs NaN and no other's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(501, 600, generator=g).bfloat16()
    w = torch.randn(530, 600, generator=g).bfloat16()
    b = torch.randn(530, generator=g).bfloat16()
    y = cpu_kernels.linear_avx512bf16(x, w, b)
    torch.testing.assert_close(y.float(), reference(x, w, b), rtol=2**-7, atol=0.03)
    # one value a row: the products are exact in fp32, so the rounding alone sets the bits
    xs = torch.randn(64, 1, generator=g).bfloat16()
    ws = torch.randn(37, 1, generator=g).bfloat16()
    assert torch.equal(cpu_kernels.linear_avx512bf16(xs, ws),
                       (xs.float() @ ws.float().T).bfloat16())
    x[7, 100] = float("nan")
    out = cpu_kernels.linear_avx512bf16(x[:12], w)
    assert out[7].isnan().all() and not out[torch.arange(12) != 7].isnan().any()


@needs_avx512bf16
@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 230), blocks=st.integers(1, 12), pairs=st.integers(1, 1100),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_panels_linear_matches_fp32_reference_and_each_row_alone(m, blocks, pairs, bias, seed):
    """The panels layout (pack_panels) holds the weight's bytes (unpack gives them back),
    and linear_pk over it computes x w^T + b within one bf16 rounding: every tile (a group
    of 2 blocks, a block left over alone; 1-12 tokens a tile; more than one token block past
    96; K in more than one chunk past 1024 values). A token's
    result does not depend on the tokens beside it: the same bits alone."""
    n, k = 16 * blocks, 2 * pairs
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    wp = cpu_kernels.pack_panels(w)
    assert wp.shape == (blocks, pairs, 16) and wp.dtype == torch.int32
    assert torch.equal(cpu_kernels.unpack_panels(wp), w)
    w2 = w.clone()
    wp2 = cpu_kernels.pack_panels(w2, in_place=True)  # group by group, in w2's own bytes
    assert wp2.data_ptr() == w2.data_ptr() and torch.equal(wp2, wp)
    # the word of (row, pair): the row's values 2p (low half) and 2p + 1 (high half)
    flat = wp.flatten()
    for row in {0, 3, 16 * (blocks - 1) + 5, n // 2 + 1}:
        for pair in {0, pairs // 2, pairs - 1}:
            word = int(flat[cpu_kernels.panels_word(n, k, row, pair)])
            assert word & 0xFFFF == w[row, 2 * pair].view(torch.int16).item() & 0xFFFF
            assert (word >> 16) & 0xFFFF == w[row, 2 * pair + 1].view(torch.int16).item() & 0xFFFF
    y = cpu_kernels.linear_pk(x, wp, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    torch.testing.assert_close(y.float(), reference(x, w, b), rtol=2**-7, atol=1e-4 * k)
    for r in {0, m // 2, m - 1}:
        assert torch.equal(cpu_kernels.linear_pk(x[r:r + 1], wp, b)[0], y[r])
    # (the benchmark build, whose switches are globals, computes the production bits)
    with bench_build():
        # up to 12 tokens the weights are prefetched non-temporally (pw_pk_nta; up to 6 a
        # few pairs ahead, from 7 in shorter chunks): the same bits as without
        for few in (x[:6], x[:12]):
            on = cpu_kernels.linear_pk(few, wp, b)
            assert torch.equal(on, y[:few.shape[0]])
            with kernel_global("pw_pk_nta", 0):
                assert torch.equal(cpu_kernels.linear_pk(few, wp, b), on)
        # 13-72 tokens: a chunk's tiles share its next chunk's prefetch (pw_pk_spread): the
        # same bits as the first tile's alone
        on = cpu_kernels.linear_pk(x, wp, b)
        assert torch.equal(on, y)
        with kernel_global("pw_pk_spread", 0):
            assert torch.equal(cpu_kernels.linear_pk(x, wp, b), on)
    # widened as written (the decode step's logits): the same values, as fp32
    yf = cpu_kernels.linear_pk(x, wp, b, out_dtype=torch.float32)
    assert yf.dtype == torch.float32 and torch.equal(yf, y.float())


@needs_avx512bf16
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 200), units=st.integers(1, 7), pairs=st.integers(1, 1100),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
# pinned: an odd number of units and K in two chunks; a second token block; one unit, K just
# past a chunk
@example(m=3, units=3, pairs=600, bias=True, seed=1)
@example(m=97, units=2, pairs=1100, bias=False, seed=2)
@example(m=5, units=1, pairs=513, bias=True, seed=3)
def test_panels_glu_is_the_projection_then_silu_mul_bit_for_bit(m, units, pairs, bias, seed):
    """glu_pk (the gate/up projection on panels packed in units, gate block i with up block
    i, the SiLU-and-multiply in its tiles' epilogue) gives the bits of linear_pk over the
    plainly packed rows then silu_mul's AVX-512 kernel: any number of units, 1-12 tokens a
    tile, K in chunks past 1024 values, token blocks past 96. The fused decode layer's
    epilogue is the same code."""
    inter, k = 16 * units, 2 * pairs
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(2 * inter, k, generator=g) * k**-0.5).bfloat16()
    b = torch.randn(2 * inter, generator=g).bfloat16() if bias else None
    wp = cpu_kernels.pack_panels(w, glu=True)
    assert torch.equal(cpu_kernels.unpack_panels(wp, glu=True), w)
    w2 = w.clone()
    assert torch.equal(cpu_kernels.pack_panels(w2, in_place=True, glu=True), wp)
    y = cpu_kernels.glu_pk(x, wp, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, inter)
    proj = cpu_kernels.linear_pk(x, cpu_kernels.pack_panels(w), b)
    assert torch.equal(y, CpuKernelOps(LinearDispatch(0, "torch")).silu_mul(proj))
    ref = torch.nn.functional.silu(proj[:, :inter].float()) * proj[:, inter:].float()
    torch.testing.assert_close(y.float(), ref, rtol=2**-6, atol=1e-3)
    with pytest.raises(ValueError, match="even number"):
        cpu_kernels.glu_pk(x, cpu_kernels.pack_panels(w[:16 * (2 * units - 1)]))
    with pytest.raises(ValueError, match="I % 16"):
        cpu_kernels.pack_panels(w[:16 * (2 * units - 1)], glu=True)


@needs_avx512bf16
def test_panels_linear_rounds_once_keeps_nans_and_refuses_what_it_cannot_take():
    g = torch.Generator().manual_seed(4)
    # one pair a row, the second value 0: each sum is one exact product, so the rounding
    # alone sets the bits (to nearest even, as torch's)
    xs = torch.zeros(40, 2).bfloat16()
    xs[:, 0] = torch.randn(40, generator=g).bfloat16()
    ws = torch.zeros(48, 2).bfloat16()
    ws[:, 0] = torch.randn(48, generator=g).bfloat16()
    assert torch.equal(cpu_kernels.linear_pk(xs, cpu_kernels.pack_panels(ws)),
                       (xs.float() @ ws.float().T).bfloat16())
    x = torch.randn(12, 64, generator=g).bfloat16()
    w = torch.randn(32, 64, generator=g).bfloat16()
    x[7, 10] = float("nan")
    out = cpu_kernels.linear_pk(x, cpu_kernels.pack_panels(w))
    assert out[7].isnan().all() and not out[torch.arange(12) != 7].isnan().any()
    wide = cpu_kernels.linear_pk(x, cpu_kernels.pack_panels(w), out_dtype=torch.float32)
    assert wide[7].isnan().all() and torch.equal(wide[:7], out[:7].float())
    with pytest.raises(ValueError, match="out_dtype must be torch.bfloat16 or torch.float32"):
        cpu_kernels.linear_pk(x, cpu_kernels.pack_panels(w), out_dtype=torch.float16)
    for bad in (torch.randn(24, 64).bfloat16(), torch.randn(32, 63).bfloat16(),
                torch.randn(32, 64)):
        assert not cpu_kernels.can_pack_panels(bad)
        with pytest.raises(ValueError, match="N % 16"):
            cpu_kernels.pack_panels(bad)
    wp = cpu_kernels.pack_panels(w)
    with pytest.raises(ValueError, match="width 62"):
        cpu_kernels.linear_pk(torch.randn(3, 62).bfloat16(), wp)
    with pytest.raises(ValueError, match="contiguous panels"):
        cpu_kernels.linear_pk(x, wp.transpose(0, 1).contiguous().transpose(0, 1))
    for bias in (torch.randn(32), torch.randn(16).bfloat16(), torch.randn(64).bfloat16()[::2]):
        with pytest.raises(ValueError, match="32 values"):
            cpu_kernels.linear_pk(x, wp, bias)


@needs_avx512bf16
def test_panels_rows_are_the_rows():
    """A lookup in a table packed into panels reads the rows' own values, for any shape of
    ids (the odd last block, the threads' path for 64 ids and more), and refuses an id
    outside the table as an embedding does."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 10, generator=g).bfloat16()  # 3 blocks: a group of 2 and 1 alone
    wp = cpu_kernels.pack_panels(w)
    ids = torch.tensor([[0, 47, 16], [17, 31, 5]])
    assert torch.equal(cpu_kernels.panels_rows(wp, ids), w[ids])
    many = torch.randint(0, 48, (100,), generator=g)
    assert torch.equal(cpu_kernels.panels_rows(wp, many), w[many])
    assert cpu_kernels.panels_rows(wp, torch.tensor([], dtype=torch.long)).shape == (0, 10)
    strided = many.view(10, 10)[:, ::3]  # not contiguous, int32: the same rows
    assert torch.equal(cpu_kernels.panels_rows(wp, strided.to(torch.int32)), w[strided])
    with pytest.raises(TypeError, match="int32 or int64"):
        cpu_kernels.panels_rows(wp, torch.tensor([3.7]))
    for bad in (48, -1):
        with pytest.raises(IndexError, match=r"out of range \[0, 48\)"):
            cpu_kernels.panels_rows(wp, torch.tensor([3, bad]))


@needs_avx512bf16
@pytest.mark.parametrize("vocab,tie", [(None, False), (None, True), (320, False),
                                       (320, True)])
def test_panels_are_packed_in_place_and_only_where_they_are_the_path(tmp_path, monkeypatch,
                                                                     vocab, tie):
    """pack_panels packs every decoder projection in the same bytes (no second copy), and
    the LM head where its vocabulary is a multiple of 16 (the bundled tokenizer's ~300
    tokens are not: it stays in rows), a tied table then looked up from the panels; and runs
    them there; int8 weights leave every weight as it was. (Whether an engine packs at
    all is its plan's: tests/test_kernel_plan.py.)"""
    from conftest import build_hf_checkpoint

    from phasewise.model.cpu import ops as ops_mod
    from phasewise.model.config import ModelConfig
    from phasewise.model.loader import load_model
    from phasewise.model.cpu.quant import quantize_model_int8

    build_hf_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype=torch.bfloat16, seed=2,
                        tie_word_embeddings=tie, **({"vocab_size": vocab} if vocab else {}))
    cfg = ModelConfig.from_file(tmp_path)
    head_name = "embed_tokens.weight" if tie else "lm_head.weight"
    packs_head = cfg.vocab_size % 16 == 0
    assert packs_head == (vocab is not None)

    def fresh():
        return load_model(tmp_path, cfg, dtype=torch.bfloat16, device=torch.device("cpu"),
                          max_positions=64)

    model = fresh()
    rows = {n: p.detach().clone() for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    ops = CpuKernelOps(LinearDispatch(0, "torch"))
    why = ops.pack_panels(model)  # wherever the AVX512_BF16 kernels run, AMX or not
    assert why == "" and ops.panels
    for name, p in model.named_parameters():
        assert p.data_ptr() == ptrs[name]  # the same memory
        if name.split(".")[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") \
                and name.endswith("weight"):
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            assert isinstance(mod, PanelLinear) and cpu_kernels.is_panels(p)
            glu = name.split(".")[-2] == "gate_up_proj"  # units of gate and up blocks
            assert ops_mod.glu_packed(mod) == glu and mod.glu == glu
            assert torch.equal(mod.dense(), rows[name])
            assert (mod.out_features, mod.in_features) == tuple(rows[name].shape)
            assert torch.equal(cpu_kernels.unpack_panels(p, glu=glu), rows[name])
        elif name == head_name and packs_head:
            assert isinstance(model.lm_head_module, PanelLinear) and cpu_kernels.is_panels(p)
            assert torch.equal(cpu_kernels.unpack_panels(p), rows[name])
        else:
            assert torch.equal(p, rows[name])
    assert isinstance(model.embed_tokens, ops_mod.PanelsEmbedding) == (packs_head and tie)
    ids = torch.tensor([[1, cfg.vocab_size - 1], [7, 0]])
    assert torch.equal(model.embed_tokens(ids),
                       torch.nn.functional.embedding(ids, rows["embed_tokens.weight"]))
    h = torch.randn(3, cfg.hidden_size).bfloat16()
    logits = ops.proj(h, model.lm_head_module)
    if packs_head:  # one kernel, whatever the rows
        assert torch.equal(logits, cpu_kernels.linear_pk(h, model.lm_head_weight))
        assert torch.equal(ops.proj(h[1:2], model.lm_head_module), logits[1:2])
    torch.testing.assert_close(logits.float(), (h.float() @ rows[head_name].float().T),
                               rtol=0.02, atol=0.02)
    x = torch.randn(5, cfg.hidden_size).bfloat16()
    lin = model.layers[0].o_proj
    assert torch.equal(ops.proj(x[:, :cfg.q_size] if cfg.q_size != cfg.hidden_size else x, lin),
                       cpu_kernels.linear_pk(x[:, :cfg.q_size] if cfg.q_size != cfg.hidden_size
                                             else x, lin.weight, lin.bias))
    # a prompt's MLP past MLP_CHUNK_ROWS runs in chunks: each row as alone
    layer = model.layers[0]
    xs = torch.randn(ops_mod.MLP_CHUNK_ROWS + 77, cfg.hidden_size).bfloat16()
    y = ops.mlp(xs, layer.gate_up_proj, layer.down_proj)
    assert y.shape == xs.shape
    assert torch.equal(y[-3:], ops.mlp(xs[-3:], layer.gate_up_proj, layer.down_proj))
    # the fused layer reads gate/up as units wherever I % 16 == 0: a gate/up packed
    # plainly there (not by pack_panels(model)) is refused, and runs op by op, correctly
    assert cfg.intermediate_size % 16 == 0 and ops._static_args(layer) is not None
    gu = layer.gate_up_proj
    plain = cpu_kernels.pack_panels(cpu_kernels.unpack_panels(gu.weight, glu=True))
    glu_weight, gu.weight = gu.weight, torch.nn.Parameter(plain, requires_grad=False)
    gu.glu = False
    assert ops._static_args(layer) is None
    x8 = torch.randn(3, cfg.hidden_size).bfloat16()
    assert torch.equal(ops.gate_up_silu(x8, gu), ops.silu_mul(cpu_kernels.linear_pk(x8, plain)))
    gu.weight, gu.glu = glu_weight, True
    assert torch.equal(ops.gate_up_silu(x8, gu), ops.silu_mul(cpu_kernels.linear_pk(x8, plain)))
    again = CpuKernelOps(LinearDispatch(0, "torch"))  # a packed model, packed again: as is
    assert again.pack_panels(model) == "" and again.panels
    assert torch.equal(cpu_kernels.unpack_panels(lin.weight), rows["layers.0.o_proj.weight"])
    with pytest.raises(ValueError, match="packed into panels"):
        quantize_model_int8(model)
    if packs_head and not tie:  # an untied head on the table's own bytes: left in rows
        model = fresh()
        model.lm_head.weight = model.embed_tokens.weight
        assert CpuKernelOps(LinearDispatch(0, "torch")).pack_panels(model) == ""
        assert torch.equal(model.lm_head.weight, rows["embed_tokens.weight"])
    model = fresh()
    quantize_model_int8(model)
    assert CpuKernelOps(LinearDispatch(0, "torch")).pack_panels(model) == "int8 weights"
    assert model.layers[0].qkv_proj.weight.dtype == torch.int8
    assert isinstance(model.layers[0].qkv_proj, Int8Linear)


@needs_amx
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 70), n=st.integers(16, 200), k=st.integers(1, 300), bias=st.booleans(),
       offset=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_amx_linear_matches_fp32_reference(m, n, k, bias, offset, seed):
    """The AMX tiles: any row count (several 32-token blocks), K tails (K % 32), N tails (the
    shifted last tile), activations that start off a 64-byte line (a view into a larger
    tensor)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m + offset, k, generator=g).bfloat16()[offset:]
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = cpu_kernels.linear_amx(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # bf16 x bf16 products are exact in fp32: as the fp32 kernels, one rounding at the end
    torch.testing.assert_close(y.float(), reference(x, w, b), rtol=2**-7, atol=1e-4 * k)


@needs_amx
def test_amx_linear_blocks_long_prompts_and_streams_large_outputs():
    """Enough tokens for several L2-sized token blocks (K = 4864: 96 tokens a block), K in
    chunks whose C tiles wait in memory between them (300 rows, K = 600: 18 blocks and a
    tail), and an output large enough for the streaming stores; the fused SiLU pass too."""
    g = torch.Generator().manual_seed(3)
    for m, n, k in ((200, 64, 4864), (300, 80, 600), (700, 3072, 64)):
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        y = cpu_kernels.linear_amx(x, w, b)
        torch.testing.assert_close(y.float(), reference(x, w, b), rtol=2**-7, atol=1e-4 * k)
        if n % 2 == 0:
            ops = CpuKernelOps(LinearDispatch(kernel_max_rows=0, large="torch"))
            assert torch.equal(cpu_kernels.glu_amx(x, w, b), ops.silu_mul(y))


@needs_amx
def test_amx_linear_k_outer_blocking():
    """Prompts whose token blocks over all of K would not fit in L2 run K-outer: K in chunks
    whose C tiles wait between them per panel and token pair, tokens in blocks of 256. The
    chunk ends: a K tail that joins the chunk before it (K = 3088: 96 full blocks + 16), a
    tail inside a chunk (K = 4900), several token blocks with a short last one (600 rows);
    the SiLU epilogue; against the fp32 reference and against the same call in
    pieces of rows small enough to run over all of K at once (the same bits: every C tile
    takes its K blocks in order)."""
    g = torch.Generator().manual_seed(5)
    for m, n, k in ((600, 48, 3088), (520, 96, 4900), (300, 200, 2400)):
        x = torch.randn(m, k, generator=g).bfloat16()
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        y = cpu_kernels.linear_amx(x, w, b)
        torch.testing.assert_close(y.float(), reference(x, w, b), rtol=2**-7, atol=1e-4 * k)
        pieces = torch.cat([cpu_kernels.linear_amx(x[i:i + 32], w, b) for i in range(0, m, 32)])
        assert torch.equal(y, pieces)
        ops = CpuKernelOps(LinearDispatch(kernel_max_rows=0, large="torch"))
        assert torch.equal(cpu_kernels.glu_amx(x, w, b), ops.silu_mul(y))


@needs_amx
@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 70), n=st.integers(16, 200), k=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_amx_int8_weights_widen_exactly(m, n, k, bias, seed):
    """int8 weights on the tiles: each panel widened to bf16 (exact), the row scales applied
    to the fp32 sums: the dequantized product within one rounding; the SiLU pass the unfused
    one bit for bit; linear_int8 takes the tiles above the streams' rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    q, scale = quantize_rows_int8(torch.randn(n, k, generator=g) * 0.1)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = cpu_kernels.linear_int8_amx(x, q, scale, b)
    ref = x.float() @ dequantize_rows(q, scale).T + (b.float() if bias else 0)
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-4 * k)
    if m > cpu_kernels.INT8_ROWS_MAX:
        assert torch.equal(cpu_kernels.linear_int8(x, q, scale, b), y)
    if n % 2 == 0 and n >= 32:
        ops = CpuKernelOps(LinearDispatch(kernel_max_rows=0, large="torch"))
        assert torch.equal(cpu_kernels.glu_int8_amx(x, q, scale, b), ops.silu_mul(y))


@needs_amx
def test_amx_int8_weights_in_k_chunks():
    """int8 weights through the K-outer blocking: each chunk's columns widened as it comes."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(520, 4900, generator=g).bfloat16()
    q, scale = quantize_rows_int8(torch.randn(96, 4900, generator=g) * 0.1)
    y = cpu_kernels.linear_int8_amx(x, q, scale)
    ref = x.float() @ dequantize_rows(q, scale).T
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-4 * 4900)


@needs_amx
@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 300), inter=st.sampled_from([32, 64, 160, 4864]),
       hidden=st.integers(16, 96), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_amx_mlp_hands_packed_activations_to_the_down_pass(m, inter, hidden, bias, seed):
    """The fused MLP (gate/up + SiLU writing the down projection's packed tiles, the down
    pass reading them in place) is the two AMX calls bit for bit, K-outer blocking (I =
    4864) included; ops.mlp takes it only where the plan runs both on the tiles."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).bfloat16()
    wg = (torch.randn(2 * inter, hidden, generator=g) * 0.1).bfloat16()
    wd = (torch.randn(hidden, inter, generator=g) * 0.1).bfloat16()
    bg = torch.randn(2 * inter, generator=g).bfloat16() if bias else None
    bd = torch.randn(hidden, generator=g).bfloat16() if bias else None
    two = cpu_kernels.linear_amx(cpu_kernels.glu_amx(x, wg, bg), wd, bd)
    assert torch.equal(cpu_kernels.mlp_amx(x, wg, bg, wd, bd), two)
    gate_up, down = torch.nn.Linear(hidden, 2 * inter), torch.nn.Linear(inter, hidden)
    gate_up.weight.data, gate_up.bias = wg, (None if bg is None else torch.nn.Parameter(bg))
    down.weight.data, down.bias = wd, (None if bd is None else torch.nn.Parameter(bd))
    for plan in ((0, "amx"), (0, "torch")):
        ops = CpuKernelOps(LinearDispatch(*plan))
        with torch.no_grad():
            got = ops.mlp(x, gate_up, down)
        if plan[1] == "amx":
            assert torch.equal(got, two)
        torch.testing.assert_close(got.float(), two.float(), rtol=0.02, atol=0.02)


@needs_amx
def test_amx_mlp_refuses_shapes_it_cannot_pack():
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernels.mlp_amx(x, torch.randn(96, 32).bfloat16(), None,
                            torch.randn(32, 48).bfloat16(), None)


@needs_amx
def test_amx_linear_with_a_smaller_team_than_asked_for():
    """A team smaller than the threads asked for (OMP_THREAD_LIMIT here; nested regions do
    the same): each thread takes several of the slices whose spill areas were sized, so a
    K-outer call (4864 -> 896 at 512 rows) still gives the one-thread result. Sized by the
    threads asked for but split by the team, it overwrote another thread's data (51 686
    wrong outputs)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from phasewise.model.cpu import kernels as cpu_kernels\n"
        "lib = cpu_kernels.load()\n"
        "g = torch.Generator().manual_seed(1)\n"
        "m, n, k = 512, 896, 4864\n"
        "x = torch.randn(m, k, generator=g).bfloat16()\n"
        "w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()\n"
        "ys = []\n"
        "for th in (1, 4):\n"
        "    y = torch.empty(m, n, dtype=torch.bfloat16)\n"
        "    assert lib.pw_linear_amx(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), m, n, k,"
        " th) == 0\n"
        "    ys.append(y)\n"
        "print('mismatches', int((ys[0] != ys[1]).sum()))\n")
    env = {**os.environ, "OMP_THREAD_LIMIT": "3"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout
    assert "mismatches 0" in out, out


@needs_amx
def test_amx_linear_is_safe_from_several_threads_at_once():
    """Two threads (two engines in one process) calling the kernel together, each with its
    own shapes: each gets its own scratch, so each gets its own right answer."""
    import threading

    g = torch.Generator().manual_seed(11)
    jobs = [(torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16())
            for m, n, k in ((150, 96, 640), (40, 200, 4864))]
    errors = []

    def work(x, w):
        ref = reference(x, w, None)
        for _ in range(20):
            try:
                torch.testing.assert_close(cpu_kernels.linear_amx(x, w).float(), ref,
                                           rtol=2**-7, atol=1e-4 * x.shape[1])
            except AssertionError as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@needs_amx
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), inter=st.integers(16, 120), k=st.integers(1, 200),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_amx_gate_up_silu_is_the_unfused_path_bit_for_bit(m, inter, k, bias, seed):
    """glu_amx = silu_mul(linear(x, gate_up)): the same accumulation, the same roundings and
    the same exp as the AVX2 SiLU, so the same bits; and near an fp32 reference."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(2 * inter, k, generator=g) * 0.2).bfloat16()
    b = torch.randn(2 * inter, generator=g).bfloat16() if bias else None
    fused = cpu_kernels.glu_amx(x, w, b)
    ops = CpuKernelOps(LinearDispatch(kernel_max_rows=0, large="torch"))
    unfused = ops.silu_mul(cpu_kernels.linear_amx(x, w, b))
    assert fused.shape == (m, inter) and torch.equal(fused, unfused)
    ref = TorchOps().silu_mul(reference(x, w, b).bfloat16())
    torch.testing.assert_close(fused.float(), ref.float(), rtol=0.02, atol=0.02)


@needs_amx
def test_amx_refuses_what_it_cannot_compute():
    x = torch.randn(3, 64).bfloat16()
    # fewer than 16 outputs: torch computes them (the tiles need 16 rows of weights)
    w = torch.randn(9, 64).bfloat16()
    torch.testing.assert_close(cpu_kernels.linear_amx(x, w).float(), reference(x, w, None),
                               rtol=2**-7, atol=1e-2)
    with pytest.raises(ValueError, match="even number"):
        cpu_kernels.glu_amx(x, torch.randn(31, 64).bfloat16())


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 3 * cpu_kernels.INT8_ROWS_MAX), n=st.integers(1, 300),
       k=st.integers(1, 600), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_int8_kernel_matches_its_dequantized_fp32_reference(m, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-4
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = cpu_kernels.linear_int8(x, w, scale, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = reference(x, (w.float() * scale[:, None]), b)
    # fp32 accumulation (each int8 is exact in fp32), the scale once, one bf16 rounding
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=2e-5 * k)


@needs_kernels
def test_int8_kernel_refuses_what_it_cannot_compute():
    x = torch.randn(cpu_kernels.INT8_ROWS_MAX + 1, 16).bfloat16()
    w = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="against w"):
        cpu_kernels.linear_int8(x, w[:, :8], torch.ones(8))
    with pytest.raises(ValueError, match="against w"):
        cpu_kernels.linear_int8(x, w, torch.ones(7))
    with pytest.raises(TypeError, match="int8 w"):
        cpu_kernels.linear_int8(x[:1], w.float(), torch.ones(8))


@needs_kernels
def test_kernel_handles_leading_dims_and_strided_input():
    x = torch.randn(2, 3, 64).bfloat16()[:, :, :48]  # non-contiguous view
    w = torch.randn(24, 48).bfloat16()
    y = cpu_kernels.linear_bf16(x, w)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y.float(), reference(x.reshape(-1, 48), w, None).view(2, 3, 24),
                               rtol=2**-7, atol=5e-3)


@needs_kernels
@pytest.mark.parametrize("fn", ["gemm_bf16", "linear_bf16"])
def test_many_rows_cover_several_blocks(fn):
    """Sizes past every blocking factor: for the GEMM 96 rows, 256 of K, 256 weight rows per
    block; for the kernel's tiles, blocks of activation rows (512 KiB of fp32: 218 rows of
    600) and an odd row count."""
    x = torch.randn(501, 600).bfloat16()
    w = torch.randn(530, 600).bfloat16()
    b = torch.randn(530).bfloat16()
    torch.testing.assert_close(getattr(cpu_kernels, fn)(x, w, b).float(), reference(x, w, b),
                               rtol=2**-7, atol=0.03)


@pytest.mark.parametrize("kernel_max,large", [(0, "torch"), (0, "upcast"), (8, "upcast"),
                                              (4, "gemm"), (ALL_ROWS, "gemm")])
def test_every_dispatch_plan_computes_the_same_function(kernel_max, large):
    if (kernel_max or large == "gemm") and cpu_kernels.load() is None:
        pytest.skip("CPU kernels unavailable")
    d = LinearDispatch(kernel_max_rows=kernel_max, large=large)
    w = torch.randn(40, 32).bfloat16()
    b = torch.randn(40).bfloat16()
    for rows in (1, 5, 8, 9, 30):
        x = torch.randn(rows, 32).bfloat16()
        torch.testing.assert_close(d(x, w, b).float(), reference(x, w, b), rtol=2**-7, atol=5e-3)


def test_the_dot_product_tier_keeps_the_rows_it_lost_at_off_it():
    """A mid tier that starts past the streams' rows (it lost at the counts between) leaves
    those to the large method; fp32 large methods take no mid tier."""
    d = LinearDispatch(kernel_max_rows=1, large="torch", mid="avx512bf16", mid_min_rows=4,
                       mid_max_rows=32)
    assert [d.method(r) for r in (1, 2, 3, 4, 32, 33)] == [
        "kernel", "torch", "torch", "avx512bf16", "avx512bf16", "torch"]
    assert d.describe() == ("kernel for <= 1 rows, torch for 2-3 rows, avx512bf16 for 4-32 rows, "
                            "torch above")
    d0 = LinearDispatch(kernel_max_rows=0, large="torch", mid="avx512bf16", mid_max_rows=8)
    assert d0.method(1) == "avx512bf16" and d0.describe() == "avx512bf16 for 1-8 rows, torch above"
    assert d0.compute_dtype(8) == "bf16"
    with pytest.raises(ValueError, match="mid must be .avx512bf16."):
        LinearDispatch(kernel_max_rows=0, large="gemm", mid="avx512bf16", mid_max_rows=8)


def test_a_one_count_tier_below_the_streams_win_gives_them_its_count(monkeypatch):
    """Timings as the LM head gave them on the 2-core AVX512_BF16 EPYC: avx512bf16 a little faster
    than the streams at 1 row, a hair slower at 2, faster from 3; torch 3x slower throughout.
    The streams take 1-2 rows and the tier 3 on (not: avx512bf16 for 1 row and torch from 2 on)."""
    monkeypatch.setattr(cpu_kernels.KERNELS, "decode_layer_max_rows", 6)
    torch_fn = linear._large_fn("torch")
    per_row = {cpu_kernels.linear_bf16: {1: 0.72, 2: 0.79, 3: 0.9, 4: 1.0, 5: 1.1, 6: 1.2},
               cpu_kernels.linear_avx512bf16: {1: 0.67, 2: 0.80, 3: 0.82}}

    def seconds(fn, rows, ws=None):
        if fn is cpu_kernels.linear_avx512bf16:
            return per_row[fn].get(rows, 0.5 + 0.05 * rows)
        if fn is cpu_kernels.linear_bf16:
            return per_row[fn].get(rows, 0.6 + 0.3 * rows)
        assert fn.__class__ is torch_fn.__class__
        return 2.4 + 0.07 * rows

    timings = {m: {} for m in ("kernel", "avx512bf16", "torch")}
    kernel_max, lo, hi = LinearDispatch._calibrate_mid(seconds, timings, 1, "torch", 256, None)
    assert (kernel_max, lo, hi) == (2, 3, 128)
    d = LinearDispatch(kernel_max_rows=kernel_max, large="torch", mid="avx512bf16", mid_min_rows=lo,
                       mid_max_rows=hi)
    assert [d.method(r) for r in (1, 2, 3, 32, 129)] == [
        "kernel", "kernel", "avx512bf16", "avx512bf16", "torch"]


def test_upcast_reuses_its_scratch():
    up = Upcast()
    w_big, w_small = torch.randn(16, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    up(torch.randn(3, 8).bfloat16(), w_big, None)
    ptr = up._scratch.data_ptr()
    y = up(torch.randn(3, 8).bfloat16(), w_small, None)
    assert up._scratch.data_ptr() == ptr and y.shape == (3, 4)


def test_calibration_yields_a_valid_plan():
    d = LinearDispatch.calibrate(torch.randn(256, 128).bfloat16(), large_rows=32,
                                 kernel_rows=(4, 8))
    amx = ("amx",) if cpu_kernels.amx_available() else ()
    bf16dp = ("avx512bf16",) if cpu_kernels.avx512bf16_available() else ()
    assert d.large in ("torch", "upcast", "gemm", *amx, *bf16dp)
    # up to a timed row count (with AMX, each the fused decode layer streams), or every row
    # count if it never lost
    few = range(1, cpu_kernels.KERNELS.decode_layer_max_rows + 1) if d.large == "amx" else ()
    # (where the dot-product kernel runs, the streams' rows end at a count its tier timed)
    tier = linear.MID_ROWS if bf16dp else ()
    assert d.kernel_max_rows in (0, 1, *few, 4, 8, *tier, ALL_ROWS)
    assert all(r in d.timings["kernel"] for r in range(1, min(d.kernel_max_rows, 8) + 1)
               if r in (1, *few, 4, 8))
    assert (d.describe() == "kernel for all row counts") == (d.kernel_max_rows == ALL_ROWS)
    assert d.timings and d.timings["torch"][32] > 0
    # the AVX512_BF16 tier: only where that kernel runs, between the streams and `large`, and
    # only up to a count where it timed faster than the plan's method there
    if d.mid is not None:
        lo = max(d.mid_min_rows, d.kernel_max_rows + 1)
        assert bf16dp and d.mid == "avx512bf16" and d.kernel_max_rows < lo <= d.mid_max_rows < 32
        assert d.mid_max_rows in linear.MID_ROWS
        other = d.timings[d.large].get(d.mid_max_rows, d.timings["kernel"].get(d.mid_max_rows))
        assert d.timings["avx512bf16"][d.mid_max_rows] < other
        assert d.method(d.mid_max_rows) == "avx512bf16" and d.method(d.mid_max_rows + 1) == d.large
        assert f"avx512bf16 for {lo}" in d.describe()
    else:
        assert d.mid_max_rows == 0 and (d.large == "avx512bf16" or "avx512bf16" not in d.describe())
    with pytest.raises(ValueError, match="large must be one of torch, upcast, gemm"):
        LinearDispatch(kernel_max_rows=0, large="magic")



def test_a_projection_shape_can_have_its_own_prompt_method(monkeypatch):
    """prompt_by_shape: a weight of that shape at PROMPT_ROWS rows or more takes that method;
    fewer rows and other shapes keep the plan's; a method of another arithmetic is refused (the
    roofline rates every shape at the plan's); calibrate_prompt_shape records a valid one."""
    from phasewise.model.cpu import linear

    calls = []
    monkeypatch.setattr(linear, "torch_linear",
                        lambda x, w, b: calls.append(("torch", x.shape))
                        or torch.nn.functional.linear(x, w, b))
    d = LinearDispatch(kernel_max_rows=0, large="upcast", prompt_by_shape={(40, 64): "gemm"}
                       if cpu_kernels.load() is not None else {})
    assert d.compute_dtype(1) == d.compute_dtype(4096) == "fp32"
    d2 = LinearDispatch(kernel_max_rows=0, large="amx" if cpu_kernels.amx_available()
                        else "torch", prompt_by_shape={(40, 32): "torch"})
    assert "torch for 32 -> 40 at >= 256 rows" in d2.describe()
    w32, w48 = torch.randn(40, 32).bfloat16(), torch.randn(40, 48).bfloat16()
    w32b = torch.randn(24, 32).bfloat16()  # the same input width, another shape
    calls.clear()
    d2(torch.randn(linear.PROMPT_ROWS, 32).bfloat16(), w32)
    assert calls == [("torch", (linear.PROMPT_ROWS, 32))]
    calls.clear()
    d2(torch.randn(linear.PROMPT_ROWS - 1, 32).bfloat16(), w32)
    d2(torch.randn(linear.PROMPT_ROWS, 48).bfloat16(), w48)
    d2(torch.randn(linear.PROMPT_ROWS, 32).bfloat16(), w32b)
    assert calls == ([] if d2.large == "amx" else [("torch", (linear.PROMPT_ROWS - 1, 32)),
                                                    ("torch", (linear.PROMPT_ROWS, 48)),
                                                    ("torch", (linear.PROMPT_ROWS, 32))])
    with pytest.raises(ValueError, match="must compute as upcast does"):
        LinearDispatch(kernel_max_rows=0, large="upcast", prompt_by_shape={(40, 64): "torch"})
    d3 = LinearDispatch(kernel_max_rows=0, large="torch", timings={})
    d3.calibrate_prompt_shape([torch.randn(64, 96).bfloat16() for _ in range(2)], rows=64)
    assert set(d3.prompt_by_shape) <= {(64, 96)}
    assert set(d3.prompt_by_shape.values()) <= {"amx"}  # the only other bf16 method
    if cpu_kernels.amx_available():
        assert d3.timings["amx 96->64"][64] > 0 and d3.timings["torch 96->64"][64] > 0
    else:  # nothing timed where AMX is not among the candidates
        assert d3.timings == {} and d3.prompt_by_shape == {}


# -- the fused element-wise kernels against the torch reference ops ---------------------------

@pytest.fixture
def ops():
    if cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.KERNELS.reason}")
    return CpuKernelOps(LinearDispatch(kernel_max_rows=8, large="torch"))


BF16 = dict(rtol=2**-7, atol=2**-7)


@pytest.fixture
def two_threads():
    """Two threads, whatever the machine: the fused layer's decode attention then splits by
    KV head at one row and by queries at more, as on the 2-core CI machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("dim", [96, 100, 17])  # whole vectors; a tail of 4 (or 12 of 16)
def test_add_rms_norm_matches_torch(ops, with_delta, dim):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, dim, generator=g).bfloat16()
    delta = torch.randn(5, dim, generator=g).bfloat16() if with_delta else None
    w = (1 + 0.1 * torch.randn(dim, generator=g)).bfloat16()
    ref_out, ref_hidden = TorchOps().add_rms_norm(delta, hidden.clone(), w, 1e-6)
    out, new_hidden = ops.add_rms_norm(delta, hidden.clone(), w, 1e-6)
    assert torch.equal(new_hidden, ref_hidden)  # the bf16 add rounds identically
    torch.testing.assert_close(out.float(), ref_out.float(), **BF16)


@needs_kernels
@pytest.mark.parametrize("inter", [40, 43, 5])  # whole vectors of 8, a tail, only a tail
def test_silu_mul_matches_torch(ops, inter):
    gu = (torch.randn(3, 2 * inter) * 4).bfloat16()
    gu[0, :4] = torch.tensor([-100.0, 100.0, -88.5, 0.0])  # past exp's fp32 range, and zero
    torch.testing.assert_close(ops.silu_mul(gu).float(), TorchOps().silu_mul(gu).float(),
                               **BF16)


@pytest.mark.skipif(not cpu_kernels.avx512bf16_available(),
                    reason="AVX512_BF16 kernels unavailable: "
                    f"{cpu_kernels.KERNELS.avx512bf16_reason}")
@pytest.mark.parametrize("inter", [4864, 40, 43, 24, 21, 16, 5])
def test_silu_mul_on_16_lanes_keeps_the_8_lane_bits(inter):
    """pw_silu_mul_avx512bf16 (AVX-512, what ops.silu_mul takes there) and pw_silu_mul_bf16 (the
    fused decode layer's arithmetic): the same bits, over whole vectors of 16, a last 8 and
    the scalar tail, with values past exp's range, infinities and NaN."""
    lib = cpu_kernels.load()
    g = torch.Generator().manual_seed(inter)
    gu = (torch.randn(5, 2 * inter, generator=g) * 8).bfloat16()
    ends = torch.tensor([-100.0, 100.0, -88.5, 0.0, float("inf"), -float("inf"),
                         float("nan"), 1e30])
    gu[0, :min(8, inter)] = ends[:min(8, inter)].bfloat16()
    gu[1, inter:inter + min(8, inter)] = ends[:min(8, inter)].bfloat16()
    outs = []
    for fn in (lib.pw_silu_mul_avx512bf16, lib.pw_silu_mul_bf16):
        out = torch.empty(5, inter, dtype=torch.bfloat16)
        fn(gu.data_ptr(), out.data_ptr(), 5, inter, 2)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    torch.testing.assert_close(outs[0].float(), TorchOps().silu_mul(gu).float(),
                               rtol=2**-7, atol=1e-3, equal_nan=True)


def test_silu_mul_at_the_ends_of_fp32(ops):
    """Where e^-g overflows the gate's SiLU is -0 (times any finite u), whatever u's size;
    NaN and infinities come out as torch's do. Whole vectors of 8 and the scalar tail."""
    inf, nan = float("inf"), float("nan")
    gate = [-100.0, -200.0, -1e30, -inf, nan, 100.0, 88.0, -88.0, -100.0]
    up = [1.0, 1e30, 1.0, 1.0, 1.0, 2.0, 1.0, 1e38, 3.0]
    gu = torch.tensor([gate + up]).bfloat16()
    torch.testing.assert_close(ops.silu_mul(gu).float(), TorchOps().silu_mul(gu).float(),
                               rtol=2**-7, atol=0.0, equal_nan=True)


@needs_kernels
def test_rope_matches_torch_on_a_strided_view(ops):
    from phasewise.model.config import RopeConfig
    from phasewise.model.layers import RotaryEmbedding

    rope = RotaryEmbedding(16, RopeConfig(theta=10000.0), max_positions=64)
    pos = torch.tensor([0, 5, 63])
    qkv = torch.randn(3, 7 * 16).bfloat16()
    view = qkv[:, :5 * 16].view(3, 5, 16)  # q and k heads; v stays untouched
    ref = TorchOps().rope(view.clone(), TorchOps().rope_tables(rope.cos, rope.sin, pos,
                                                               torch.bfloat16))
    v_before = qkv[:, 5 * 16:].clone()
    out = ops.rope(view, ops.rope_tables(rope.cos, rope.sin, pos, torch.bfloat16))
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6)
    assert torch.equal(qkv[:, 5 * 16:], v_before)


def paged_caches(context: list[int], bs: int, n_kv: int, hd: int, seed: int):
    """Block tables (each context's own blocks, in a shuffled order) and random bf16 K/V
    caches holding them; the generator goes on to draw the queries."""
    tables, next_block = [], 0
    for c in context:
        n = c // bs + 1
        tables.append(list(range(next_block, next_block + n))[::-1])
        next_block += n
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(next_block, bs, n_kv, hd, generator=g).bfloat16()
    v_cache = torch.randn(next_block, bs, n_kv, hd, generator=g).bfloat16()
    return tables, k_cache, v_cache, g


@needs_kernels
@pytest.mark.parametrize("heads", [(4, 4), (14, 2), (6, 1), (24, 2), (40, 2)])  # groups 1-20
@pytest.mark.parametrize("hd,context", [(32, [0, 6, 13]),  # short contexts, head of 32
                                        # several 64-key chunks and a partial block of 8 keys;
                                        # heads with a tail past their 8-wide vectors, or two
                                        # 64-wide output blocks
                                        (36, [0, 69, 200]), (128, [130, 7, 64]), (64, [47, 16]),
                                        # six 16-dim vectors: the AVX512_BF16 kernel's P V
                                        # in a block of 4 and one of 2
                                        (96, [3, 40])])
@pytest.mark.parametrize("bs", [4, 16])  # AMX: keys copied into a tile, or loaded from a block
def test_decode_attention_matches_torch(ops, heads, hd, context, bs):
    from phasewise.model.attention import AttentionMetadata

    n_heads, n_kv = heads
    tables, k_cache, v_cache, g = paged_caches(context, bs, n_kv, hd, seed=2)
    meta = AttentionMetadata.build(chunk_lens=[1] * len(context), context_lens=context,
                                   block_tables=tables, block_size=bs,
                                   device=torch.device("cpu"))
    q_full = torch.randn(len(context), n_heads + n_kv, hd, generator=g).bfloat16() * 3
    q = q_full[:, :n_heads]  # strided, as in the model
    # The reference in fp32 from the same bf16 inputs (torch's bf16 path rounds scores and
    # probabilities to bf16 on the way; the AVX2 kernel keeps them in fp32 and rounds once;
    # the AMX kernel and the AVX512_BF16 one, as torch, multiply V by probabilities rounded
    # to bf16, each off by at most 2^-9 of itself: measured up to 0.0026 on the outputs
    # here, so 2^-8).
    ref = TorchOps().decode_attention(q.float(), k_cache.float(), v_cache.float(), meta,
                                      hd**-0.5)
    out = ops.decode_attention(q, k_cache, v_cache, meta, hd**-0.5)
    assert out.dtype == torch.bfloat16
    bf16_probs = ((cpu_kernels.amx_available() or cpu_kernels.avx512bf16_available())
                  and hd % 32 == 0)
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=2**-8 if bf16_probs else 1e-3)


@needs_kernels
@pytest.mark.parametrize("heads", [(14, 2), (8, 4), (6, 6)])
def test_decode_attention_of_one_request_split_by_kv_heads(ops, two_threads, heads):
    """With fewer requests than threads and a KV head for every thread, the threads take a KV
    head each (group_parts' 0 parts) instead of a share of every head's queries: the output
    matches torch's, and a request's heads come out with the same bits as beside others
    (where the tasks split by queries)."""
    from phasewise.model.attention import AttentionMetadata

    n_heads, n_kv = heads
    hd, bs, context = 64, 16, [150, 37, 90]
    tables, k_cache, v_cache, g = paged_caches(context, bs, n_kv, hd, seed=5)
    q = torch.randn(len(context), n_heads, hd, generator=g).bfloat16() * 3

    def run(rows):
        meta = AttentionMetadata.build(chunk_lens=[1] * len(rows),
                                       context_lens=[context[r] for r in rows],
                                       block_tables=[tables[r] for r in rows], block_size=bs,
                                       device=torch.device("cpu"))
        return meta, ops.decode_attention(q[rows].contiguous(), k_cache, v_cache, meta,
                                          hd**-0.5)

    meta, alone = run([0])  # one request, two threads: the split by KV heads
    _, batched = run([0, 1, 2])  # three requests: the split by queries
    ref = TorchOps().decode_attention(q[:1].float(), k_cache.float(), v_cache.float(), meta,
                                      hd**-0.5)
    bf16_probs = cpu_kernels.amx_available() or cpu_kernels.avx512bf16_available()
    torch.testing.assert_close(alone.float(), ref, rtol=2**-7, atol=2**-8 if bf16_probs else 1e-3)
    assert torch.equal(alone[0], batched[0])


@needs_kernels
@pytest.mark.parametrize("length", [8, 63, 64])  # whole vectors of 8 keys, or a scalar tail
@pytest.mark.parametrize("hd", [16, 32])  # the AVX2 kernel; AMX's or AVX512_BF16's where they run
def test_decode_attention_keeps_a_nan(ops, length, hd):
    """A NaN in a key or a query makes its heads' output NaN, as in torch (the kernel's
    vectorised exp and running max must not drop it)."""
    from phasewise.model.attention import AttentionMetadata

    bs = 4
    n_blocks = length // bs + 1
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(2 * n_blocks, bs, 1, hd, generator=g).bfloat16()
    v_cache = torch.randn(2 * n_blocks, bs, 1, hd, generator=g).bfloat16()
    k_cache[0, 3, 0, 5] = float("nan")  # request 0's 4th key
    meta = AttentionMetadata.build(chunk_lens=[1, 1], context_lens=[length - 1] * 2,
                                   block_tables=[list(range(n_blocks)),
                                                 list(range(n_blocks, 2 * n_blocks))],
                                   block_size=bs, device=torch.device("cpu"))
    q = torch.randn(2, 2, hd, generator=g).bfloat16()
    q[1, 1, 0] = float("nan")  # request 1's second head
    out = ops.decode_attention(q, k_cache, v_cache, meta, hd**-0.5).float()
    ref = TorchOps().decode_attention(q.float(), k_cache.float(), v_cache.float(), meta,
                                      hd**-0.5)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[0].isnan().all() and out[1, 1].isnan().all() and not out[1, 0].isnan().any()



@needs_avx512bf16
@pytest.mark.parametrize("G", range(1, 10))  # 9: past the keys-in-lanes kernel's 8
@pytest.mark.parametrize("hd,length,bs", [(32, 5, 4), (64, 190, 16), (128, 33, 7),
                                          (256, 16, 16), (96, 64, 3), (64, 1, 16)])
def test_avx512bf16_decode_attention_keys_in_lanes(G, hd, length, bs):
    """Up to 8 heads the AVX512_BF16 decode attention puts the keys in its lanes
    (pw_avx512bf16_attn_kl, a switch of the benchmark build; 0 sends every group to the
    heads-in-lanes kernel): the same scores, maxes and weights,
    so the same outputs up to the order of each head's weights' sum, on every step shape
    (one key, a partial group of 16, a partial pair, several steps), with the rescale of a
    growing max (large queries), and a NaN key making its heads' outputs NaN in both; and
    from a sliding window's first key (``start``, mid-block) on, the keys before it unread
    (NaN there changes nothing)."""
    import ctypes

    lib = bench_library().lib  # its switch (pw_avx512bf16_attn_kl) is a global there
    n_kv, kvh = 2, 1  # the second KV head: its rows sit between the first's
    tables, k_cache, v_cache, g = paged_caches([length - 1], bs, n_kv, hd, seed=G * hd)
    table = torch.tensor(tables[0], dtype=torch.int64)
    q = torch.randn(G, hd, generator=g).bfloat16() * 4
    q[0] *= 10  # one head's scores far apart: its max grows step by step

    def run(kl, k=k_cache, start=0):
        out = torch.empty(G, hd)
        with kernel_global("pw_avx512bf16_attn_kl", kl, lib):
            rc = lib.pw_attend_group_avx512bf16(
                ctypes.c_void_p(q.data_ptr()), G, ctypes.c_float(hd**-0.5),
                ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v_cache.data_ptr()),
                ctypes.c_void_p(table.data_ptr()), start, length, bs, n_kv, kvh, hd,
                ctypes.c_void_p(out.data_ptr()))
        assert rc == 0
        return out

    lanes, heads = run(1), run(0)
    torch.testing.assert_close(lanes, heads, rtol=1e-5, atol=0)
    # against fp32 attention of the same bf16 inputs (weights rounded to bf16, as both do)
    keys = torch.stack([k_cache[b, w, kvh] for b in tables[0] for w in range(bs)])[:length]
    vals = torch.stack([v_cache[b, w, kvh] for b in tables[0] for w in range(bs)])[:length]
    p = torch.softmax(q.float() @ keys.float().T * hd**-0.5, dim=-1)
    torch.testing.assert_close(lanes, p @ vals.float(), rtol=2**-7, atol=2**-8)
    if length > 3:
        nan_k = k_cache.clone()
        nan_k[tables[0][length // 2 // bs], length // 2 % bs, kvh, hd // 2] = float("nan")
        assert run(1, nan_k).isnan().all() and run(0, nan_k).isnan().all()
        start = length // 2 + 1  # a window's first key, past the NaN one
        p = torch.softmax(q.float() @ keys[start:].float().T * hd**-0.5, dim=-1)
        for kl in (1, 0):
            torch.testing.assert_close(run(kl, nan_k, start), p @ vals[start:].float(),
                                       rtol=2**-7, atol=2**-8)

ODD = {"hidden_size": 80, "intermediate_size": 1040, "num_attention_heads": 5,
       "num_key_value_heads": 1, "head_dim": 16}
PLANS = {"avx2": (8, "torch"), "amx": (0, "amx"),
         "avx2-tiles": (256, "gemm"),  # the AVX2 kernel up to 256 rows (a 2-core AVX2 EPYC's)
         # the AVX512_BF16 tier up to 32 rows
         "avx512bf16": (0, "torch", None, {}, "avx512bf16", 32)}


@needs_kernels
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("rows,quantization,plan", [
    *((r, q, p) for r in (1, 3, 6) for q, p in ((None, "avx2"), ("int8", "avx2"), (None, "amx"))),
    (17, None, "amx"), (32, None, "amx"),  # AMX: up to 32 rows, two token tiles
    (32, None, "avx2"),  # too many rows for the streams, and torch's: op by op
    (8, None, "avx2"),  # the AVX2 kernel's rows past the streams': fused, on its tiles
    *((r, None, "avx2-tiles") for r in (7, 13, 32)),  # the tiles up to 32 rows
    (33, None, "avx2-tiles"),  # more: op by op
    (8, "int8", "avx2-tiles"),  # int8 beyond the streams' rows: op by op
    (3, "int8", "amx"),  # AMX rows, int8 weights: fused, the int8 ones streamed
    (8, "int8", "amx"), (32, "int8", "amx"),  # more: fused, int8 panels widened on the tiles
    *((r, None, "avx512bf16") for r in (1, 3, 6, 8, 17, 32)),  # AVX512_BF16: up to 32 rows
    *((r, None, "panels") for r in (1, 2, 5, 13, 32)),  # AVX512_BF16 on panels: any rows
    # panels of an odd model (ODD): blocks left over past the 2-block groups, and
    # the down projection's K (1040) in two chunks
    *((r, None, "panels-odd") for r in (1, 5, 32)),
    # and I % 16 == 8: gate/up in panels (2I % 16 == 0) whose SiLU cannot ride the tiles'
    # epilogue (a gate block would hold up channels): the separate SiLU pass
    *((r, None, "panels-i8") for r in (1, 5)),
    (3, "int8", "avx512bf16"),  # fused, the int8 projections streamed
    (8, "int8", "avx512bf16")])  # int8 beyond the streams' rows: op by op
def test_fused_decode_layer_matches_op_by_op(tmp_path, two_threads, arch, rows, quantization,
                                            plan):
    """The one-call decode layer computes what the op-by-op kernel path computes (biases,
    q/k norms and GQA included, bf16 or int8 projections, the AVX2 streams or the AMX
    tiles), writing the same K/V into the cache; a step it cannot take runs op by op."""
    if plan == "amx" and not cpu_kernels.amx_available():
        pytest.skip(f"AMX kernels unavailable: {cpu_kernels.KERNELS.amx_reason}")
    odd_model = plan in ("panels-odd", "panels-i8")
    shape = {**ODD, "intermediate_size": 1032} if plan == "panels-i8" else ODD
    plan = "panels" if odd_model else plan
    if plan in ("avx512bf16", "panels") and not cpu_kernels.avx512bf16_available():
        pytest.skip(f"AVX512_BF16 kernels unavailable: {cpu_kernels.KERNELS.avx512bf16_reason}")
    dispatch = LinearDispatch(*PLANS["avx512bf16" if plan == "panels" else plan])
    from conftest import build_hf_checkpoint
    from phasewise.model.attention import AttentionMetadata
    from phasewise.model.config import ModelConfig
    from phasewise.model.loader import load_model

    build_hf_checkpoint(tmp_path, arch, dtype=torch.bfloat16, seed=5,
                        **(shape if odd_model else {}))
    cfg = ModelConfig.from_file(tmp_path)
    model = load_model(tmp_path, cfg, dtype=torch.bfloat16, device=torch.device("cpu"),
                       max_positions=128)
    if odd_model:
        assert (cfg.q_size + 2 * cfg.kv_size) // 16 % 2 and cfg.intermediate_size > 1024
    if quantization == "int8":
        from phasewise.model.cpu.quant import quantize_model_int8
        quantize_model_int8(model)
        assert model.layers[0].down_proj.weight.dtype == torch.int8
    g = torch.Generator().manual_seed(rows)
    bs, n_blocks = 4, 6 * rows + 4
    caches = [(torch.randn(n_blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=g).bfloat16(),
               torch.randn(n_blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=g).bfloat16())
              for _ in range(cfg.num_layers)]
    ctx = [5 + 3 * r % 17 for r in range(rows)]  # up to 21 tokens: 6 blocks of 4
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables = [perm[6 * r:6 * r + 6] for r in range(rows)]
    meta = AttentionMetadata.build(chunk_lens=[1] * rows, context_lens=ctx,
                                   block_tables=tables, block_size=bs,
                                   device=torch.device("cpu"))
    ids = torch.randint(3, cfg.vocab_size, (rows,), generator=g)
    pos = torch.tensor(ctx)
    class LayerByLayer(CpuKernelOps):  # the fused layer, called once per layer from Python
        def decode_stack(self, *args, **kwargs):
            return None

    if plan == "panels":  # every projection packed, in place, once; every ops reads them
        assert CpuKernelOps(dispatch).pack_panels(model) == ""  # AMX too (as a plan may say)
        assert isinstance(model.layers[0].qkv_proj, PanelLinear)
        # gate/up blocks: an even count takes the SiLU in the epilogue, an odd one not
        blocks = model.layers[0].gate_up_proj.weight.shape[0]
        assert blocks % 2 == (cfg.intermediate_size % 16 == 8)
    # the AVX2 tiles: bf16 weights, rows the plan runs on the kernel, up to 32
    avx2_tiles = (plan.startswith("avx2") and quantization is None
                  and rows <= min(dispatch.kernel_max_rows, 32))
    fused = (rows <= 6 or plan in ("amx", "panels")
             or (plan == "avx512bf16" and quantization is None)
             or avx2_tiles)
    outs = {}
    for name, ops in (("stack", CpuKernelOps(dispatch)), ("layers", LayerByLayer(dispatch)),
                      ("ops", op_by_op(CpuKernelOps(dispatch)))):
        ops.panels = plan == "panels"
        model.ops = ops
        kv = [(k.clone(), v.clone()) for k, v in caches]
        with torch.no_grad():
            outs[name] = (model(ids, pos, kv, meta), kv)
        if not fused:  # the C layer refuses such a step (an error): it must run op by op
            continue
        if name == "stack":  # the one-call stack was really taken
            assert ops._stack is not None and not ops._layer_args
        if name == "layers":  # and here the per-layer fused call (it caches its arguments)
            assert len(ops._layer_args) == cfg.num_layers
    for name in ("stack", "layers"):
        torch.testing.assert_close(outs[name][0].float(), outs["ops"][0].float(),
                                   rtol=0.02, atol=0.02)
        for (k1, v1), (k2, v2) in zip(outs[name][1], outs["ops"][1]):
            torch.testing.assert_close(k1.float(), k2.float(), rtol=0.02, atol=0.02)
            torch.testing.assert_close(v1.float(), v2.float(), rtol=0.02, atol=0.02)
    # One call or one per layer, the same kernel: the same bits; also with an odd number of
    # layers (the stack's output buffers alternate).
    assert torch.equal(outs["stack"][0], outs["layers"][0])
    if not fused or (plan == "amx" and (quantization is None or rows > 6)) or (
            plan in ("avx512bf16", "panels") and quantization is None) or (
            avx2_tiles and rows > 6):  # op by op, or the AMX products and GLU epilogue
        # (int8: the same widened panels and scales), or the same AVX512_BF16 tiles as
        # linear_avx512bf16 (or linear_pk), or the same AVX2 tiles as linear_bf16: exactly the
        # op-by-op results
        assert torch.equal(outs["stack"][0], outs["ops"][0])
    model.layers = torch.nn.ModuleList(list(model.layers)[:1])
    odd = {}
    for name, ops in (("stack", CpuKernelOps(dispatch)), ("layers", LayerByLayer(dispatch))):
        ops.panels = plan == "panels"
        model.ops = ops
        with torch.no_grad():
            odd[name] = model(ids, pos, [(k.clone(), v.clone()) for k, v in caches[:1]], meta)
    assert torch.equal(odd["stack"], odd["layers"])


@needs_avx512bf16
@pytest.mark.parametrize("rows", [1, 5])
def test_decode_logits_fold_the_head_into_the_stack_bit_for_bit(tmp_path, two_threads, rows):
    """A decode step's logits from one C call (the fused stack, the final norm and the LM head
    in panels: decode_logits) are compute_logits(forward(...))'s, bit for bit, and write the
    same K/V; where the head is not in panels the ops decline (None) and forward_logits
    takes the two calls."""
    from conftest import build_hf_checkpoint
    from phasewise.model.attention import AttentionMetadata
    from phasewise.model.config import ModelConfig
    from phasewise.model.loader import load_model

    build_hf_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype=torch.bfloat16, seed=4,
                        vocab_size=320, tie_word_embeddings=True)
    cfg = ModelConfig.from_file(tmp_path)
    model = load_model(tmp_path, cfg, dtype=torch.bfloat16, device=torch.device("cpu"),
                       max_positions=128)
    ops = CpuKernelOps(LinearDispatch(*PLANS["avx512bf16"]))
    model.ops = ops
    g = torch.Generator().manual_seed(rows)
    bs, n_blocks = 4, 6 * rows + 4
    caches = [(torch.randn(n_blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=g).bfloat16(),
               torch.randn(n_blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=g).bfloat16())
              for _ in range(cfg.num_layers)]
    ctx = [5 + 7 * r % 17 for r in range(rows)]
    perm = torch.randperm(n_blocks, generator=g).tolist()
    meta = AttentionMetadata.build(chunk_lens=[1] * rows, context_lens=ctx,
                                   block_tables=[perm[6 * r:6 * r + 6] for r in range(rows)],
                                   block_size=bs, device=torch.device("cpu"))
    ids = torch.randint(3, cfg.vocab_size, (rows,), generator=g)
    pos = torch.tensor(ctx)

    def run(fn):
        kv = [(k.clone(), v.clone()) for k, v in caches]
        with torch.no_grad():
            return fn(kv), kv

    rows_logits, _ = run(lambda kv: model.compute_logits(model(ids, pos, kv, meta)))
    assert ops.pack_panels(model) == ""
    assert isinstance(model.lm_head_module, PanelLinear)
    two, kv_two = run(lambda kv: model.compute_logits(model(ids, pos, kv, meta)))
    one, kv_one = run(lambda kv: model.forward_logits(ids, pos, kv, meta))
    assert one.dtype == torch.float32 and one.shape == (rows, cfg.vocab_size)
    assert torch.equal(one, two)
    for (k1, v1), (k2, v2) in zip(kv_one, kv_two):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    torch.testing.assert_close(one, rows_logits, rtol=0.05, atol=0.05)  # the rows' head

    def fold(layers, kv, head):
        with torch.no_grad():
            hidden = model.embed_tokens(ids)
            rope = ops.rope_tables(model.rope.cos, model.rope.sin, pos, hidden.dtype)
            before = hidden.clone()
            out = ops.decode_logits(layers, hidden, rope, kv, meta, model.norm.weight,
                                    cfg.rms_norm_eps, head)
            return out, torch.equal(hidden, before)

    # the one call itself (not forward_logits' fallback) gives those logits and K/V
    kv = [(k.clone(), v.clone()) for k, v in caches]
    folded, _ = fold(model.layers, kv, model.lm_head_module)
    assert folded is not None and folded.dtype == torch.float32 and torch.equal(folded, two)
    for (k1, v1), (k2, v2) in zip(kv, kv_two):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # a head in rows: declined before anything runs (hidden and K/V untouched)
    kv = [(k.clone(), v.clone()) for k, v in caches]
    rows_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).bfloat16()
    declined, untouched = fold(model.layers, kv, rows_head)
    assert declined is None and untouched
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv, caches))
    # one layer (the stack's output in its first buffer), and a step the stack does not
    # take (fused decode off): forward_logits' two calls, the same bits
    model.layers = torch.nn.ModuleList(list(model.layers)[:1])
    one1, _ = run(lambda kv: model.forward_logits(ids, pos, kv[:1], meta))
    two1, _ = run(lambda kv: model.compute_logits(model(ids, pos, kv[:1], meta)))
    folded1, _ = fold(model.layers, [(k.clone(), v.clone()) for k, v in caches[:1]],
                      model.lm_head_module)
    assert torch.equal(one1, two1) and torch.equal(folded1.float(), two1)
    model.ops = op_by_op(CpuKernelOps(LinearDispatch(*PLANS["avx512bf16"])))
    assert model.ops.decode_logits(model.layers, model.embed_tokens(ids), model.ops.rope_tables(
        model.rope.cos, model.rope.sin, pos, torch.bfloat16), [(k.clone(), v.clone()) for k, v
                                                           in caches[:1]], meta,
        model.norm.weight, cfg.rms_norm_eps, model.lm_head_module) is None
    off, _ = run(lambda kv: model.forward_logits(ids, pos, kv[:1], meta))
    torch.testing.assert_close(off, one1, rtol=0.02, atol=0.02)


# -- the library's state and the numbers C and Python share ----------------------------------

@needs_kernels
def test_c_and_python_agree_on_the_shared_layout_and_limits():
    lib = cpu_kernels.KERNELS.lib
    assert cpu_kernels.abi_mismatches(lambda what: lib.pw_abi(what.encode())) == []
    assert lib.pw_abi(b"sizeof DecodeLayer") == ctypes.sizeof(cpu_kernels.DecodeLayerArgs)
    assert lib.pw_abi(b"no such name") == -1
    # the limits the Python side uses are the C side's own
    assert cpu_kernels.KERNELS.decode_layer_max_rows == lib.pw_abi(b"row_stream_max") >= 1
    assert cpu_kernels.KERNELS.max_head_dim == lib.pw_abi(b"max_head_dim") >= 128
    assert cpu_kernels.INT8_ROWS_MAX == lib.pw_abi(b"int8_rows_max") >= 1
    # the fused layer's projection modes: the C enum's names and values are the IntEnum's
    assert {m.name: lib.pw_abi(f"PW_PROJ_{m.name}".encode()) for m in ProjMode} == {
        m.name: m.value for m in ProjMode}
    assert dict(cpu_kernels.DecodeLayerArgs._fields_)["proj_mode"] is ctypes.c_int


def test_a_layout_mismatch_is_named_field_by_field():
    true = {name: getattr(cpu_kernels.DecodeLayerArgs, name).offset
            for name, _ in cpu_kernels.DecodeLayerArgs._fields_}
    true["sizeof DecodeLayer"] = ctypes.sizeof(cpu_kernels.DecodeLayerArgs)
    true["int8_rows_max"] = cpu_kernels.INT8_ROWS_MAX
    true["expert_dp_rows"] = cpu_kernels.EXPERT_DP_ROWS
    true.update({f"PW_PROJ_{m.name}": m.value for m in ProjMode})
    assert cpu_kernels.abi_mismatches(true.__getitem__) == []
    shifted = {**true, "cos": true["cos"] + 8, "sizeof DecodeLayer": true["sizeof DecodeLayer"] + 8,
               "int8_rows_max": cpu_kernels.INT8_ROWS_MAX - 1,
               "expert_dp_rows": cpu_kernels.EXPERT_DP_ROWS + 1,
               "PW_PROJ_PANELS": ProjMode.AVX2_TILES.value}  # two modes' values swapped in C
    bad = cpu_kernels.abi_mismatches(shifted.__getitem__)
    assert len(bad) == 5 and any("DecodeLayer.cos" in b for b in bad)
    assert any("sizeof" in b for b in bad) and any("int8_rows_max" in b for b in bad)
    assert any(b.startswith("expert_dp_rows is") for b in bad)
    assert any(b == "PW_PROJ_PANELS is 4 in C, 3 here" for b in bad)


@needs_kernels
def test_a_library_built_from_a_disagreeing_source_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))
    src = cpu_kernels.SOURCE.read_text()
    assert "FIELD(cos)" in src
    wrong = tmp_path / cpu_kernels.SOURCE.name
    wrong.write_text(src.replace("FIELD(cos)", '{"cos", 0}'))
    kl = cpu_kernels.KernelLibrary(wrong, [], [])  # (the AVX2 files alone: the ABI is theirs)
    assert kl.load() is None and kl.lib is None
    assert "disagree" in kl.reason and "DecodeLayer.cos" in kl.reason
    assert kl.decode_layer_max_rows == 0  # nothing of a refused library is used


@needs_kernels
def test_an_amx_file_that_does_not_compile_leaves_the_avx2_kernels(tmp_path, monkeypatch):
    """A compiler that cannot build the AMX files (too old for AMX) still gets the AVX2
    library; the AMX kernels are off with the compiler's reason."""
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "linear_amx.c"
    broken.write_text("this is not C;\n")
    # (no AVX512_BF16 files, whose compiles would only slow the test: absent, so left out)
    kl = cpu_kernels.KernelLibrary(cpu_kernels.SOURCE, broken, tmp_path / "absent.c")
    assert kl.load() is not None and kl.decode_layer_max_rows >= 1
    assert not kl.amx and "linear_amx.c failed" in kl.amx_reason
    # the fused layer asks for AMX only through the weak symbols, absent here
    assert not hasattr(kl.lib, "pw_linear_amx") or kl.lib.pw_linear_amx is None


def test_the_library_is_tried_once_and_keeps_its_reason(monkeypatch):
    calls = []

    def no_avx2():
        calls.append(1)
        return False

    monkeypatch.setattr(cpu_kernels, "_cpu_has_avx2_fma", no_avx2)
    kl = cpu_kernels.KernelLibrary()
    assert kl.load() is None and kl.load() is None
    assert calls == [1] and kl.tried and kl.reason == "this CPU lacks AVX2/FMA"
    # the module's own instance is a separate object, untouched by this one
    assert cpu_kernels.KERNELS is not kl
    assert cpu_kernels.unavailable_reason == cpu_kernels.KERNELS.reason


@needs_kernels
@pytest.mark.parametrize("m,n,k", [(1, 67, 96), (2, 33, 64), (1, 5, 32), (2, 130, 896),
                                   (130, 20, 40), (200, 37, 64)])
def test_int8_fixed_point_rows_and_the_packed_gemm_match_the_reference(m, n, k):
    """1-2 rows with K a multiple of 32 take the 16-bit fixed-point path; more than 128 rows
    the packed GEMM; both within the kernel's stated tolerance of the fp32 reference."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, k, generator=g) * 4).bfloat16()
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-4
    y = cpu_kernels.linear_int8(x, w, scale)
    ref = reference(x, w.float() * scale[:, None], None)
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=2e-5 * k)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3])
def test_int8_kernel_keeps_a_nan_in_its_row(m):
    x = torch.randn(m, 64).bfloat16()
    x[0, 7] = float("nan")
    w = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    y = cpu_kernels.linear_int8(x, w, torch.full((16,), 0.01))
    assert y[0].isnan().all() and not y[1:].isnan().any()


def test_torch_gemm_sees_prompt_row_counts_in_buckets(monkeypatch):
    """torch_linear pads prompt-sized inputs to a multiple of TORCH_ROW_BUCKET rows and those
    between TORCH_EXACT_ROWS and them to a multiple of TORCH_SMALL_BUCKET (oneDNN keeps a
    primitive per row count: unbounded row counts grew a server's memory), and the rows it
    returns are the unpadded product's."""
    from phasewise.model.cpu import linear

    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(linear.F, "linear", lambda x, w, b=None: seen.append(x.shape[0])
                        or real(x, w, b))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 40, generator=g).bfloat16(), torch.randn(24, generator=g).bfloat16()
    bucket = linear.TORCH_ROW_BUCKET
    small = linear.TORCH_SMALL_BUCKET
    for rows in (1, linear.TORCH_EXACT_ROWS, linear.TORCH_EXACT_ROWS + 1, 3 * small,
                 linear.PROMPT_ROWS - 1, linear.PROMPT_ROWS + 1, 3 * bucket * 4, 517):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        seen.clear()
        y = linear.torch_linear(x, w, b)
        assert y.shape == (rows, 24) and y.is_contiguous()
        if rows <= linear.TORCH_EXACT_ROWS:
            want = rows
        elif rows < linear.PROMPT_ROWS:
            want = -(-rows // small) * small
        else:
            want = -(-rows // bucket) * bucket
        assert seen == [want]
        torch.testing.assert_close(y.float(), real(x.float(), w.float(), b.float()),
                                   rtol=2**-6, atol=2**-6)
    x3 = torch.randn(2, 300, 40, generator=g).bfloat16()  # leading dims kept
    assert linear.torch_linear(x3, w, None).shape == (2, 300, 24)


@needs_kernels
def test_a_step_the_amx_layer_cannot_take_whole_runs_op_by_op():
    """More rows than the streams take go to the fused layer only where every projection
    can run on AMX tiles: the same conditions the C layer checks (it refuses the rest)."""
    ops = CpuKernelOps(LinearDispatch(0, "amx"))
    most = cpu_kernels.KERNELS.decode_layer_max_rows

    def args(**kw):
        shape = dict(H=64, Q=64, KV=16, I=128)
        shape.update(kw)
        return cpu_kernels.DecodeLayerArgs(**shape)

    assert not ops._streams_only(most + 1, args(), args())
    assert not ops._streams_only(most, args(H=8))  # the streams take it: fused
    for bad in (dict(H=8), dict(Q=4, KV=2), dict(I=4)):
        assert ops._streams_only(most + 1, args(), args(**bad))
    int8 = args()
    int8.s_down = 1234  # an int8 projection's scale pointer: the tiles widen it
    assert not ops._streams_only(most + 1, int8)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_the_streams_prefetch_distance_changes_no_result(m):
    # how far ahead the few-row streams prefetch is a speed choice only: every distance
    # gives the same bits (a row's end prefetches past the weight, which must not fault)
    lib = cpu_kernels.load()
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(300, 1000, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, 1000, generator=gen).to(torch.bfloat16)
    before = lib.pw_stream_prefetch()
    try:
        outs = []
        for d in (0, 64, 256, 2048, cpu_kernels.STREAM_PREFETCH_MAX):
            lib.pw_set_stream_prefetch(d)
            assert lib.pw_stream_prefetch() == d
            outs.append(cpu_kernels.linear_bf16(x, w))
        lib.pw_set_stream_prefetch(100)  # rounded down to whole lines
        assert lib.pw_stream_prefetch() == 64
    finally:
        lib.pw_set_stream_prefetch(before)
    for y in outs[1:]:
        assert torch.equal(y, outs[0])
    ref = (x.float() @ w.float().T).to(torch.bfloat16)
    assert (outs[0].float() - ref.float()).abs().max() <= 0.05 * ref.float().abs().max()


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3])
def test_streams_started_apart_on_a_page_put_every_row_in_its_place(m):
    # 9,728 rows of 896: each thread's four blocks of rows lie a multiple of 4 KiB apart, so
    # the streams start at different rows of their blocks and wrap (stream_skew). Reversing
    # the weight's rows must reverse the output exactly (no row's dot product depends on
    # where its stream began), and both match the fp32 reference; bf16 and int8 alike.
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 896, generator=g).bfloat16()
    w = (torch.randn(9728, 896, generator=g) * 0.05).bfloat16()
    y = cpu_kernels.linear_bf16(x, w)
    assert torch.equal(cpu_kernels.linear_bf16(x, w.flip(0)), y.flip(-1))
    torch.testing.assert_close(y.float(), reference(x, w, None), rtol=2**-7, atol=1e-2)
    q = torch.randint(-127, 128, (9728, 896), generator=g, dtype=torch.int8)
    scale = torch.rand(9728, generator=g) * 0.02 + 1e-4
    y8 = cpu_kernels.linear_int8(x, q, scale)
    assert torch.equal(cpu_kernels.linear_int8(x, q.flip(0), scale.flip(0)), y8.flip(-1))
    torch.testing.assert_close(y8.float(), reference(x, q.float() * scale[:, None], None),
                               rtol=2**-7, atol=2e-5 * 896)


def test_the_stream_prefetch_distance_follows_the_cpu_and_the_plan():
    """The rule gives Intel its longer distance and every other vendor the short one; a
    library loads with the rule's distance, and a plan's distance (0 to 16384, whole cache
    lines) is set on it, anything else refused by name."""
    from phasewise.model.cpu.capabilities import read_capabilities
    from phasewise.model.cpu.plan import (
        STREAM_PREFETCH_INTEL,
        STREAM_PREFETCH_OTHER,
        stream_prefetch_rule,
    )

    intel = read_capabilities("vendor_id : GenuineIntel\nflags : avx2 fma\n", "x86_64", 2)
    amd = read_capabilities("vendor_id : AuthenticAMD\nflags : avx2 fma\n", "x86_64", 2)
    assert stream_prefetch_rule(intel) == (STREAM_PREFETCH_INTEL, "Intel")
    assert stream_prefetch_rule(amd) == (STREAM_PREFETCH_OTHER, "AuthenticAMD")
    lib = cpu_kernels.KERNELS  # one library per process: what it holds is put back below
    for bad in (100, -64, "lots", 99999, True):
        with pytest.raises(ValueError, match="multiple of 64") as e:
            lib.set_stream_prefetch(bad, "a plan")
        assert repr(bad) in str(e.value)
    if lib.load() is None:
        return
    before = (lib.stream_prefetch, lib.stream_prefetch_reason)
    assert lib.stream_prefetch == lib.lib.pw_stream_prefetch()
    try:
        lib.set_stream_prefetch(1024, "the stored plan")
        assert (lib.stream_prefetch, lib.stream_prefetch_reason) == (1024, "the stored plan")
        assert lib.lib.pw_stream_prefetch() == 1024
    finally:
        lib.set_stream_prefetch(*before)


@needs_amx
def test_calibration_times_the_fused_layers_rows_over_the_whole_decode_stream(monkeypatch):
    from phasewise.model.cpu import linear

    monkeypatch.setattr(linear, "_available_methods", lambda w: ["amx"])
    seen: dict[int, set] = {}
    real = cpu_kernels.linear_bf16

    def spy(x, w, b=None):
        seen.setdefault(x.shape[0], set()).add(tuple(w.shape))
        return real(x, w, b)

    monkeypatch.setattr(cpu_kernels, "linear_bf16", spy)
    gate_up = [torch.randn(64, 32).bfloat16() for _ in range(2)]
    stream = [torch.randn(48, 32).bfloat16(), torch.randn(32, 96).bfloat16(), *gate_up]
    d = LinearDispatch.calibrate(gate_up, large_rows=32, kernel_rows=(16,), stream=stream)
    assert d.large == "amx"
    # every row count the kernel was timed at up to the fused layer's most ran over every
    # shape of the stream; past them, over the gate/up weights alone
    for rows, shapes in seen.items():
        if rows <= cpu_kernels.KERNELS.decode_layer_max_rows:
            assert shapes == {(48, 32), (32, 96), (64, 32)}
        else:
            assert shapes == {(64, 32)}
    assert 1 in seen


@needs_kernels
def test_a_long_prompts_mlp_runs_in_chunks_of_rows(monkeypatch):
    """Past MLP_CHUNK_ROWS rows (not on AMX) the MLP runs chunk by chunk into one output: the
    values of the whole MLP (a last partial chunk, a [batch, tokens, hidden] input), with each
    chunk seen by the projections at most MLP_CHUNK_ROWS rows at a time."""
    from phasewise.model.cpu import ops as ops_module

    monkeypatch.setattr(cpu_kernels, "amx_available", lambda: False)
    g = torch.Generator().manual_seed(4)
    gate_up, down = torch.nn.Linear(64, 192).bfloat16(), torch.nn.Linear(96, 64).bfloat16()
    x = torch.randn(2, 550, 64, generator=g).bfloat16()
    seen = []
    ops = CpuKernelOps(LinearDispatch(kernel_max_rows=0, large="torch"))
    real_linear = ops.linear
    monkeypatch.setattr(ops, "linear", lambda a, w, b: seen.append(a.numel() // a.shape[-1])
                        or real_linear(a, w, b))
    with torch.no_grad():
        y = ops.mlp(x, gate_up, down)
        h = x.float() @ gate_up.weight.float().T + gate_up.bias.float()
        ref = (torch.nn.functional.silu(h[..., :96]) * h[..., 96:]) @ down.weight.float().T
        ref = ref + down.bias.float()
    assert y.shape == (2, 550, 64) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=0.02, atol=0.02)
    # three balanced chunks (367, 367, 366 rows), not 512 + 512 + 76
    assert max(seen) <= ops_module.MLP_CHUNK_ROWS and sum(seen) == 2 * 1100
    assert len(seen) == 2 * 3 and min(seen) == 366
