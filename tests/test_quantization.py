"""Weight-only int8 (``--quantization int8``): the quantizer's error bound, and what it does to
the model's next-token distribution on held-out code, on the bundled model (bf16)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise import LLM, SamplingParams
from phasewise.config import BUNDLED_MODEL, EngineConfig
from phasewise.model.cpu.quant import Int8Embedding, dequantize_rows, quantize_rows_int8
from phasewise.model.linear_types import Int8Linear

# Held-out in the sense that matters here: written for this test, not the training corpus.
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def push(self, x):\n",
           "import os\nfor name in os.listdir(", "    return sorted(items, key=",
           "with open(path) as f:\n    for line in", "def parse_args(argv):\n    parser = ",
           "if __name__ == '__main__':\n", "    except KeyError as e:\n        raise"]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       spread=st.floats(1e-3, 1e3))
def test_each_weight_comes_back_within_half_a_step_of_its_row(n, k, seed, spread):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * spread).bfloat16()
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (n,)
    err = (dequantize_rows(q, scale) - w.float()).abs()
    assert (err <= scale[:, None] * 0.5 * (1 + 1e-5) + 1e-30).all()
    # each row's largest weight is exactly representable: the scale is its size / 127
    assert torch.allclose(q.abs().amax(dim=1).float(), torch.full((n,), 127.0))


def test_only_known_schemes_are_accepted():
    with pytest.raises(ValueError, match="quantization must be int8 or None"):
        EngineConfig(model=str(BUNDLED_MODEL), quantization="int4")


def first_token_logprobs(llm: LLM, n: int = 8) -> list[dict[int, float]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, logprobs=n))
    return [o.logprobs[0] for o in outs]


@pytest.fixture(scope="module")
def engines():
    return {"bf16": LLM(str(BUNDLED_MODEL)),
            "int8": LLM(str(BUNDLED_MODEL), quantization="int8"),
            "int8-torch": LLM(str(BUNDLED_MODEL), quantization="int8", kernels="torch")}


def test_int8_weights_are_int8_from_loading_and_run_in_the_fused_decode_layer(engines):
    model = engines["int8"].engine.model
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name)
            assert isinstance(lin, Int8Linear)
            assert lin.weight.dtype == torch.int8 and lin.weight_scale.dtype == torch.float32
            assert lin.weight_scale.shape == (lin.weight.shape[0],)
        assert layer.input_layernorm.weight.dtype == torch.bfloat16  # norms stay as they were
    # the LM head is int8 too; the bundled model ties it to the embedding, which dequantizes
    assert model.cfg.tie_word_embeddings and model.lm_head_weight.dtype == torch.int8
    assert isinstance(model.lm_head_module, Int8Embedding)
    ids = torch.tensor([5, 17])
    bf16 = engines["bf16"].engine.model.embed_tokens(ids)
    got = model.embed_tokens(ids)
    assert got.dtype == torch.bfloat16
    assert (got.float() - bf16.float()).abs().max() <= model.embed_tokens.weight_scale.max()
    # the C decode layer takes the int8 projections, with their scales
    args = model.ops._static_args(model.layers[0])
    assert args is not None and args.s_down == model.layers[0].down_proj.weight_scale.data_ptr()
    assert args.w_down == model.layers[0].down_proj.weight.data_ptr()
    # and only the int8 copies are kept: the weights take about half the bf16 bytes
    def weight_bytes(m):
        return sum(p.numel() * p.element_size() for p in m.parameters())
    ratio = weight_bytes(model) / weight_bytes(engines["bf16"].engine.model)
    assert 0.45 < ratio < 0.6, ratio


def test_an_untied_lm_head_is_quantized_and_its_embedding_kept(tmp_path):
    from conftest import build_hf_checkpoint

    build_hf_checkpoint(tmp_path, "LlamaForCausalLM", dtype=torch.bfloat16, seed=3,
                        tie_word_embeddings=False)
    ref = LLM(str(tmp_path))
    llm = LLM(str(tmp_path), quantization="int8")
    m = llm.engine.model
    assert not m.cfg.tie_word_embeddings
    assert m.lm_head.weight.dtype == torch.int8 and m.embed_tokens.weight.dtype == torch.bfloat16
    assert isinstance(m.lm_head, Int8Linear) and not isinstance(m.embed_tokens, Int8Linear)
    assert torch.equal(m.embed_tokens.weight, ref.engine.model.embed_tokens.weight)
    q, s = quantize_rows_int8(ref.engine.model.lm_head.weight)
    assert torch.equal(m.lm_head.weight, q) and torch.equal(m.lm_head.weight_scale, s)
    p = SamplingParams(temperature=0, max_tokens=6)
    assert len(llm.generate(["hello"], p)[0].token_ids) == 6


def test_int8_keeps_the_next_token_distribution_close_to_bf16(engines):
    """The stated tolerance: on these prompts, the bf16 model's top-8 next tokens get
    log-probabilities within 0.15 nats on average (0.5 at worst) under int8, and the greedy
    next token is the same for at least 7 of the 8 prompts."""
    ref, got = first_token_logprobs(engines["bf16"]), first_token_logprobs(engines["int8"])
    diffs, same_top = [], 0
    for r, g in zip(ref, got):
        shared = [t for t in r if t in g]
        assert len(shared) >= 5
        diffs += [abs(r[t] - g[t]) for t in shared]
        same_top += max(r, key=r.get) == max(g, key=g.get)
    mean = sum(diffs) / len(diffs)
    assert mean < 0.15 and max(diffs) < 0.5, (mean, max(diffs))
    assert same_top >= 7
    assert all(math.isfinite(d) for d in diffs)


def test_int8_steps_are_rated_at_the_arithmetic_they_run_in(engines):
    """The roofline's peak for an int8 step: fp32 for the streams (up to 6 rows) and, on a
    CPU with AMX, bf16 above them (the panels widened to bf16 for the tiles)."""
    from phasewise.model.cpu import kernels as cpu_kernels
    from phasewise.perf.attribution import engine_compute_dtype

    rate = engine_compute_dtype(engines["int8"].engine)
    assert rate(1) == "fp32"
    assert rate(cpu_kernels.INT8_ROWS_MAX + 1) == ("bf16" if cpu_kernels.amx_available()
                                                  else "fp32")
    assert engine_compute_dtype(engines["int8-torch"].engine)(512) == "fp32"
    # the [kernels] line names the int8 kernels' split (the arithmetic rated above), not a
    # bf16 plan that no int8 weight follows
    backend = engines["int8"].engine.cpu_backend
    if backend is None:  # no kernel library here: no [kernels] line
        return
    line = backend.describe()
    assert line.startswith(f"int8 weights: the int8 streams for <= {cpu_kernels.INT8_ROWS_MAX} "
                           "rows")
    assert ("AMX tiles above" in line) == cpu_kernels.amx_available()
    assert ("fp32 arithmetic" in line) != cpu_kernels.amx_available()
    assert "avx512bf16" not in line and "torch" not in line


def test_the_int8_kernel_computes_what_the_dequantized_torch_path_does(engines):
    a, b = first_token_logprobs(engines["int8"]), first_token_logprobs(engines["int8-torch"])
    diffs = []
    for r, g in zip(a, b):
        shared = [t for t in r if t in g]
        assert len(shared) >= 6
        diffs += [abs(r[t] - g[t]) for t in shared]
    # the same int8 weights, accumulated in fp32 by both: only where bf16 rounding falls
    # differs (torch's path rounds the dequantized weights and each product to bf16). The
    # 4.2 M-parameter bundled model held 0.05 at worst; the 15 M one measured 0.063 before its
    # repetition phase and 0.189 after (one prompt's top-8 tail, where the kernel lay 0.156
    # from bf16 and torch's path 0.064; both well inside the 0.5 allowed between int8 and
    # bf16), with a mean of a few hundredths: the mean is held tight, the worst loosely
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.3, (sum(diffs) / len(diffs),
                                                                 max(diffs))
