"""The roofline analyser: hand-checked quantities, the seed example, properties, the JSON
schema, and that it runs without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.cli import build_parser, main
from phasewise.perf.analysis import SCHEMA_KEYS, analyse
from phasewise.perf.hardware import ACCELERATORS, LINKS, lookup_accelerator, lookup_link
from phasewise.perf.models import CATALOG, GenericModel, ModelShape, lookup_model
from phasewise.engine.step_cost import Chunk
from phasewise.perf.roofline import Roofline

H100 = ACCELERATORS["h100-sxm"]


def test_seed_example_7b_on_h100_at_batch_1():
    a = analyse(GenericModel(7e9), H100, "bf16", batch=1)
    d = a["decode"]
    assert d["weight_bytes"] == 14e9
    assert d["t_memory_s"] == pytest.approx(14e9 / 3.35e12)  # 4.18 ms
    assert round(d["t_memory_s"] * 1e3, 2) == 4.18
    assert d["flops"] == 14e9
    assert d["t_compute_s"] == pytest.approx(14.2e-6, abs=0.06e-6)  # 14 GFLOP / 989 TFLOP/s
    assert round(d["ratio"]) == 295 and d["bound"] == "memory"


def test_seed_command_prints_the_three_numbers(capsys):
    assert main(["roofline", "--params", "7e9", "--dtype", "bf16", "--gpu", "h100-sxm",
                 "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "4.18 ms" in out and "14.15 µs" in out and "memory-bound (295x)" in out


def test_parameter_counts_and_kv_bytes_match_the_published_models():
    assert lookup_model("Llama-2-7b-hf").total_params == 6_738_415_616
    assert lookup_model("Llama-3.1-8B").total_params == 8_030_261_248
    assert lookup_model("Mixtral-8x7B-v0.1").total_params == 46_702_792_704
    # Llama-2-7B (MHA, 32 KV heads): 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB.
    assert lookup_model("Llama-2-7b-hf").kv_bytes_per_token(2) == 512 * 1024
    # Llama-3-8B (GQA, 8 KV heads): 128 KiB.
    assert lookup_model("Llama-3.1-8B").kv_bytes_per_token(2) == 128 * 1024


def test_qwen_biases_are_the_only_parameters_left_out():
    # Qwen2.5-0.5B has 494,032,768 parameters, of which q/k/v biases are
    # 24 x (896 + 128 + 128) = 27,648.
    assert lookup_model("Qwen2.5-0.5B").total_params == 494_032_768 - 24 * (896 + 128 + 128)


def _toy() -> ModelShape:
    return ModelShape("toy", hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=4, intermediate_size=16, vocab_size=10)


def test_flops_and_bytes_by_hand():
    m = _toy()
    # attn/layer: q,o 8*8 each; k,v 8*4 each = 192; mlp 3*8*16 = 384; 2 layers = 1152.
    assert m.active_linear_params == 1152
    acc = ACCELERATORS["h100-sxm"]
    r = Roofline(m, acc, "bf16")
    p = r.prefill(3, prefix_len=2)
    # linear 2*1152*3 + attention 4*2*2*4*(3*2 + 3*4/2) + lm head 2*10*8.
    assert p.flops == 2 * 1152 * 3 + 64 * (6 + 6) + 160
    kvpt = 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, 1 KV head, dim 4, 2 bytes
    assert p.kv_read_bytes == 2 * kvpt and p.kv_write_bytes == 3 * kvpt
    d = r.decode(2, [5, 7])
    assert d.flops == 2 * (2 * 1152 + 160) + 64 * 12
    assert d.kv_read_bytes == (4 + 6) * kvpt and d.kv_write_bytes == 2 * kvpt
    # every weight but the untied embedding's 10 rows of 8, of which its 2 tokens' are read
    assert d.weight_bytes == (m.total_params - 10 * 8 + 2 * 8) * 2
    assert r.weight_bytes == m.total_params * 2  # (what it stores)


_COST_FIELDS = ("tokens", "flops", "bytes", "weight_bytes", "kv_read_bytes", "kv_write_bytes",
                "act_bytes")


@settings(max_examples=60, deadline=None)
@given(model=st.sampled_from(sorted(CATALOG) + ["toy"]), s=st.integers(1, 4000),
       p=st.integers(0, 4000), b=st.integers(1, 16),
       contexts=st.lists(st.integers(1, 30000), min_size=1, max_size=32))
def test_a_pure_mixed_step_costs_what_prefill_and_decode_say(model, s, p, b, contexts):
    r = Roofline(_toy() if model == "toy" else CATALOG[model], H100)
    pre, mixed = r.prefill(s, p, batch=b), r.mixed([Chunk(s, p)] * b)
    assert mixed.kind == "prefill"
    for f in _COST_FIELDS:
        assert getattr(mixed, f) == pytest.approx(getattr(pre, f), rel=1e-12), f
    dec, mixed = r.decode(len(contexts), contexts), r.mixed(decodes=contexts)
    assert mixed.kind == "decode"
    for f in _COST_FIELDS:
        assert getattr(mixed, f) == pytest.approx(getattr(dec, f), rel=1e-12), f


def test_a_mixed_step_reads_the_weights_once():
    r = Roofline(lookup_model("Llama-3.1-8B"), H100)
    pre, dec = r.prefill(512, 128), r.decode(8, 2048)
    mixed = r.mixed([Chunk(512, 128)], [2048] * 8)
    assert mixed.kind == "mixed" and mixed.tokens == 520
    assert mixed.flops == pytest.approx(pre.flops + dec.flops, rel=1e-12)
    # (the weights but the embedding rows, which each token looks up)
    assert mixed.bytes == pytest.approx(pre.bytes + dec.bytes - r.step_weight_bytes(0),
                                        rel=1e-12)
    assert mixed.time < pre.time + dec.time


def test_mixed_step_by_hand():
    m = _toy()
    r = Roofline(m, H100, "bf16")
    kvpt = 2 * 2 * 1 * 4 * 2
    # a 3-token chunk after 2 cached that stops short of its prompt's end (no LM head),
    # a 1-token chunk after 4 that samples, and a decode at context 6
    c = r.mixed([Chunk(3, 2, samples=False), Chunk(1, 4)], [6])
    assert c.tokens == 5
    assert c.flops == 2 * 1152 * 5 + 64 * ((3 * 2 + 6) + 5 + 6) + 2 * 160
    assert c.kv_read_bytes == (2 + 4 + 5) * kvpt and c.kv_write_bytes == 5 * kvpt
    assert c.weight_bytes == (m.total_params - 10 * 8 + 5 * 8) * 2
    with pytest.raises(ValueError):
        r.mixed()
    with pytest.raises(ValueError):
        r.mixed([Chunk(0, 3)])


@given(s=st.integers(1, 300), p=st.integers(0, 300))
def test_causal_attention_is_counted_once_per_query_key_pair(s, p):
    r = Roofline(_toy(), H100)
    brute = sum(p + i for i in range(1, s + 1))  # query at position P+i sees P+i keys
    base = r.prefill(s, p).flops - 2 * 1152 * s - 160
    assert base == 64 * brute


def test_critical_batch_balances_compute_and_memory():
    r = Roofline(GenericModel(7e9), H100)
    assert r.critical_batch(0) == pytest.approx(H100.peak_flops_for("bf16") / 3.35e12)
    r = Roofline(lookup_model("Llama-3.1-8B"), H100)
    b = r.critical_batch(128)
    step = r.decode(round(b), 128)
    assert step.t_compute == pytest.approx(step.t_memory, rel=0.01)
    t_never = r.never_compute_bound_context()
    assert 100 < t_never < 1000
    assert r.critical_batch(int(t_never) - 20) is not None
    assert r.critical_batch(int(t_never) + 20) is None


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(sorted(CATALOG)), acc=st.sampled_from(sorted(ACCELERATORS)),
       t=st.integers(1, 30000), b=st.integers(1, 256), s=st.integers(2, 8000))
def test_monotone_properties(model, acc, t, b, s):
    r = Roofline(CATALOG[model], ACCELERATORS[acc])
    assert r.decode(b, t + 100).time >= r.decode(b, t).time  # time grows with context
    assert r.decode(b + 1, t).intensity > r.decode(b, t).intensity  # and intensity with batch
    assert r.prefill(s).intensity > r.decode(1, s).intensity  # prefill beats decode


def test_a_cpu_kv_capacity_names_the_pool_serve_sizes():
    """On a CPU the memory the weights leave is not the pool: serve sizes it at 1 GiB unless
    --kv-cache-memory, and the analysis says how many requests that holds."""
    from phasewise.engine.kv_sizing import DEFAULT_CPU_KV_MEMORY
    from phasewise.perf.analysis import analyse, format_text
    from phasewise.perf.hardware import Accelerator

    shape = lookup_model("qwen2.5-0.5b")
    cpu = Accelerator("cpu-local", "test CPU", {"bf16": 4e11}, 24e9, 30e9, None, "test")
    a = analyse(shape, cpu, prompt_len=512, output_len=128)
    mc = a["max_concurrent_requests"]
    kvpt = Roofline(shape, cpu).kv_bytes_per_token
    assert mc["serve_cpu_pool_requests"] == int(DEFAULT_CPU_KV_MEMORY // (640 * kvpt))
    assert mc["serve_cpu_pool_requests"] < mc["requests"]
    assert (f"phasewise serve on a CPU sizes its pool at 1 GiB unless --kv-cache-memory says "
            f"otherwise: {mc['serve_cpu_pool_requests']} such requests") in format_text(a)
    gpu = analyse(shape, H100, prompt_len=512, output_len=128)
    assert gpu["max_concurrent_requests"]["serve_cpu_pool_requests"] is None
    assert "sizes its pool" not in format_text(gpu)


def test_kv_capacity_transfer_and_moe_notes():
    r = Roofline(lookup_model("Llama-3.1-8B"), H100)
    kvpt = 128 * 1024
    want = int((80e9 - r.weight_bytes) * 0.9 // (4096 * kvpt))
    assert r.max_concurrent_requests(4096, 0.1) == want
    # the engine's rule: simulate's pool (as serve sizes it) holds as many, to block rounding
    from phasewise.engine.kv_sizing import CUDA_FREE_FRACTION
    from phasewise.perf.commands import cost_model, engine_spec

    assert CUDA_FREE_FRACTION == pytest.approx(1 - 0.1)
    args = build_parser().parse_args(["simulate", "--model", "llama-3.1-8b", "--gpu",
                                      "h100-sxm", "--max-model-len", "4096"])
    eng = engine_spec(cost_model("llama-3.1-8b", "h100-sxm", None), args, "llama-3.1-8b")
    assert eng.num_kv_blocks // (4096 // eng.block_size) == want
    t = r.kv_transfer(2048, lookup_link("100gbe"))
    assert t["bytes"] == 2048 * kvpt
    assert t["transfer_s"] == pytest.approx(20e-6 + 2048 * kvpt / 12.5e9)
    assert t["transfer_over_prefill"] == pytest.approx(t["transfer_s"] / r.prefill(2048).time)
    a = analyse(lookup_model("Qwen3-30B-A3B"), H100)
    assert a["model"]["active_params"] < a["model"]["total_params"] / 5
    assert any("MoE" in n and "active" in n for n in a["notes"])
    a = analyse(lookup_model("Qwen3-8B"), H100, mfu=0.5, mbu=0.8)
    assert a["efficiency"]["peak_flops"] == 0.5 * H100.peak_flops_for("bf16")
    assert any("50% of peak" in n for n in a["notes"])


def test_deepseek_v3_latent_attention_dense_layers_and_shared_expert():
    """DeepSeek-V3's arithmetic, by hand from its config.json: multi-head latent attention
    (q through a 1536 bottleneck; a 512-wide K/V latent and a 64-wide rotary key per token and
    layer, up-projected to 128 heads of 128 + 64 and values of 128), 3 dense layers of 18432,
    58 sparse ones of 256 experts of 2048 (8 a token, a router) and one shared expert: 671 B
    parameters, 37.5 B active, 576 K/V elements per token and layer; the config parses to
    the catalog's shape."""
    m = lookup_model("DeepSeek-V3")
    h = 7168
    attn = (h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * (128 + 128)
            + 128 * 128 * h)
    assert m.attn_params_per_layer == attn
    expert, dense = 3 * h * 2048, 3 * h * 18432
    assert m.sparse_layers == 58 and m.dense_layers == 3
    assert m.mlp_params == 58 * (256 * expert + h * 256 + expert + h) + 3 * dense
    assert 670e9 < m.total_params < 672e9 and 37e9 < m.active_params < 38e9
    assert m.kv_bytes_per_token(2) == 61 * 576 * 2
    # a query's FLOPs per key: against the latent and rotary key, then the latent, per head
    assert m.attn_flops_per_position == 2 * 61 * 128 * (2 * 512 + 64)
    # at batch 1 a step reads the attention, the dense layers and 8 + 1 experts a layer
    assert m.params_read(1) == pytest.approx(m.total_params - 58 * 248 * expert
                                             - (129280 - 1) * h)  # one embedding row
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": h,
           "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "vocab_size": 129280,
           "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
           "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
           "max_position_embeddings": 163840, "tie_word_embeddings": False}
    parsed = ModelShape.from_hf_config(cfg, name="DeepSeek-V3",
                                       source="deepseek-ai/DeepSeek-V3 config.json")
    assert parsed == m
    # Qwen-MoE's mlp_only_layers are dense layers too, of its intermediate_size
    # 1.34 TB of weights on a 141 GB card: said, and the sweep goes on past the capacity
    a = analyse(m, lookup_accelerator("h200"))
    assert any("takes at least 10 such cards" in n for n in a["notes"])  # 1.34 TB / 141 GB
    assert a["batch_sweep"][-1]["batch"] == 1024
    qwen = ModelShape.from_hf_config({**cfg, "n_routed_experts": 0, "num_experts": 8,
                                      "first_k_dense_replace": 0, "mlp_only_layers": [0, 5],
                                      "kv_lora_rank": 0, "head_dim": 64})
    assert (qwen.dense_layers, qwen.dense_intermediate_size, qwen.mla) == (2, 18432, False)


def test_moe_decode_reads_the_experts_its_tokens_route_to():
    """Mixtral 8x7B: at batch 1 a decode step reads 2 of each layer's 8 experts, about 13 B
    of its 47 B parameters (attention, embeddings and the LM head included): 26 of 93 GB in
    bf16; as the batch grows the expected experts a layer reads approach all 8, and the bytes
    the full model's."""
    m = lookup_model("Mixtral-8x7B-v0.1")
    r = Roofline(m, H100)
    expert = 3 * 4096 * 14336
    assert m.expert_params == expert
    assert m.experts_touched(1) == pytest.approx(2.0)
    assert m.experts_touched(2) == pytest.approx(8 * (1 - 0.75 ** 2))  # 3.5
    one = r.decode(1, 0)
    # (of its untied input embedding, the one token's row)
    assert one.weight_bytes == pytest.approx(
        (m.total_params - 32 * 6 * expert - (32000 - 1) * 4096) * 2)
    assert 12.5e9 < m.params_read(1) < 13.5e9 and 46e9 < m.total_params < 47e9
    assert one.weight_bytes == pytest.approx(2 * m.params_read(1))
    touched = [m.experts_touched(b) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert touched == sorted(touched) and touched[-1] == pytest.approx(8, abs=1e-6)
    # all but the embedding rows no token looks up (32000 of 4096, untied)
    rows = (32000 - 64) * 4096 * 2
    assert r.decode(64, 0).weight_bytes == pytest.approx(r.weight_bytes - rows, rel=1e-6)
    # a prompt of hundreds of tokens reads every expert; a dense model reads all at any batch
    assert r.prefill(512).weight_bytes == pytest.approx(
        r.weight_bytes - (32000 - 512) * 4096 * 2, rel=1e-9)
    dense = Roofline(lookup_model("Mistral-7B-v0.1"), H100)
    assert dense.decode(1, 0).weight_bytes == dense.weight_bytes - (32000 - 1) * 4096 * 2
    # the batch at which decode turns compute-bound: where its own arithmetic meets the
    # bytes that batch reads (more than the full-model formula would give: small batches
    # read less); the step there is balanced, above it compute-bound
    b = r.critical_batch(0)
    full = (r.step_weight_bytes(b) / r.bandwidth) / (r.decode(1, 0).flops / r.peak_flops
                                             - (one.bytes - one.weight_bytes) / r.bandwidth)
    assert b == pytest.approx(full, rel=0.01)  # by then every expert is read anyway
    assert r.decode(int(b) + 1, 0).bound == "compute" and r.decode(int(b) - 1, 0).bound == \
        "memory"
    # the mixed step counts the experts its tokens (chunks and decodes) touch
    from phasewise.engine.step_cost import Chunk
    assert r.mixed([], [1]).weight_bytes == pytest.approx(one.weight_bytes)
    assert r.mixed([Chunk(3, 0)], [10]).weight_bytes == pytest.approx(r.decode(4, 0)
                                                                      .weight_bytes)
    a = analyse(m, lookup_accelerator("h200"))  # (93 GB of weights: not on an 80 GB card)
    rows = {p["batch"]: p for p in a["batch_sweep"]}
    assert rows[1]["experts_touched"] == pytest.approx(2.0)
    assert rows[1]["weight_bytes"] < rows[4]["weight_bytes"] < rows[64]["weight_bytes"]


def test_a_sliding_window_caps_kv_reads_attention_and_capacity():
    """Mistral-7B-v0.1 attends to the last 4096 positions in every layer: a decode step past
    that reads 4096 positions' K/V per sequence, however long its context, and a request
    holds no more K/V than that; Gemma-2 windows every other layer, so its reads grow at
    half the rate past the window."""
    from phasewise.engine.step_cost import Chunk
    from phasewise.perf.models import ModelShape

    m = lookup_model("Mistral-7B-v0.1")
    r = Roofline(m, H100)
    kvpt = r.kv_bytes_per_token
    assert m.windowed and m.sliding_window == 4096 and m.window_layers == 32
    assert r.decode(1, 2048).kv_read_bytes == pytest.approx(2047 * kvpt)
    assert r.decode(1, 16384).kv_read_bytes == pytest.approx(4096 * kvpt)
    assert r.decode(1, 16384).flops == pytest.approx(r.decode(1, 4097).flops)
    full = Roofline(ModelShape(**{**m.__dict__, "sliding_window": None, "window_layers": 0}),
                    H100)
    assert full.decode(1, 16384).kv_read_bytes == pytest.approx(16383 * kvpt)
    assert r.max_concurrent_requests(16384) == int(
        (80e9 - r.weight_bytes) * 0.9 // (4096 * kvpt))
    # a prompt longer than the window: each query attends to at most 4096 positions
    assert r.prefill(8192).flops < full.prefill(8192).flops
    assert r.prefill(4096).flops == pytest.approx(full.prefill(4096).flops)
    # the fused step counts the same spans as the pure ones
    assert r.mixed([], [16384]).bytes == pytest.approx(r.decode(1, 16384).bytes)
    assert r.mixed([Chunk(8192, 0)]).flops == pytest.approx(r.prefill(8192).flops)
    g = lookup_model("gemma-2-9b")
    assert g.window_layers == 21 and g.attended(8000) == pytest.approx((21 * 8000 + 21 * 4096)
                                                                       / 42)
    # past the window a windowed decode's reads stop: where it never turns compute-bound
    # is where its own figures say so
    c = r.never_compute_bound_context()
    one = r.decode(1, int(c))
    assert one.flops / r.peak_flops <= (one.bytes - one.weight_bytes) / r.bandwidth


@pytest.mark.parametrize("cfg,want", [
    ({"sliding_window": 4096, "max_position_embeddings": 32768}, (4096, 4)),
    ({"sliding_window": 4096, "max_position_embeddings": 4096}, (None, 0)),
    ({"sliding_window": 4096, "use_sliding_window": False}, (None, 0)),
    ({"sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 1}, (1024, 3)),
    ({"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"] * 2},
     (512, 2)),
    ({"sliding_window": None}, (None, 0)),
])
def test_the_window_is_read_from_the_config_as_transformers_applies_it(cfg, want):
    from phasewise.perf.models import ModelShape

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
            "intermediate_size": 128, "vocab_size": 100}
    m = ModelShape.from_hf_config({**base, **cfg})
    assert (m.sliding_window, m.window_layers) == want


def test_json_schema_and_plot(tmp_path, capsys):
    plot = tmp_path / "r.png"
    args = ["roofline", "--model", "Qwen2.5-7B", "--gpu", "a100-80gb", "--batch", "16",
            "--link", "ib-ndr", "--json"]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(plot)]
    except ImportError:
        plot = None
    assert main(args) == 0
    a = json.loads(capsys.readouterr().out)
    assert set(SCHEMA_KEYS) <= set(a)
    for step in ("prefill", "decode"):
        assert {"flops", "bytes", "intensity", "ridge", "bound", "time_s", "ratio",
                "t_compute_s", "t_memory_s"} <= set(a[step])
        assert a[step]["bound"] in ("compute", "memory")
    assert [p["batch"] for p in a["batch_sweep"]][:3] == [1, 2, 4]
    assert a["kv_transfer"]["link"]["key"] == "ib-ndr"
    assert a["accelerator"]["source"]
    if plot is not None:
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_every_catalog_entry_has_a_source():
    assert all(a.source for a in ACCELERATORS.values())
    assert all(link.source for link in LINKS.values())
    assert all(m.source for m in CATALOG.values())


def test_config_json_path_and_errors(tmp_path, capsys):
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 3, "intermediate_size": 128, "vocab_size": 100,
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = lookup_model(str(tmp_path))
    assert (m.head_dim, m.num_kv_heads, m.tie_word_embeddings) == (16, 2, True)
    with pytest.raises(ValueError, match="unknown model"):
        lookup_model("gpt-5")
    with pytest.raises(ValueError, match="unknown accelerator"):
        lookup_accelerator("h900")
    with pytest.raises(ValueError, match="no fp8"):
        Roofline(GenericModel(1e9), ACCELERATORS["a100-80gb"], "fp8")
    with pytest.raises(SystemExit) as e:
        main(["roofline", "--params", "7e9", "--dtype", "fp4"])
    assert e.value.code == 2 and "argument --dtype: dtype must be one of fp32" in \
        capsys.readouterr().err
    assert main(["roofline"]) == 2


def test_analyser_imports_no_torch():
    code = ("import sys; from phasewise.cli import main; "
            "main(['roofline', '--model', 'Llama-3.1-8B', '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["name"] == "Llama-3.1-8B"


def test_measure_writes_cpu_local_and_the_analyser_reads_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    assert main(["measure", "--quick"]) == 0
    data = json.loads((tmp_path / "machine.json").read_text())
    cpu = data["cpu-local"]
    assert cpu["mem_bandwidth"] > 1e8 and cpu["peak_flops"]["fp32"] > 1e8
    acc = lookup_accelerator("cpu-local")
    assert acc.peak_flops_for("bf16") == cpu["peak_flops"]["bf16"]
    capsys.readouterr()
    assert main(["roofline", "--model", "Qwen2.5-0.5B", "--gpu", "cpu-local"]) == 0
    assert "measured" in capsys.readouterr().out


@pytest.mark.parametrize("entry", [
    {"name": "x", "peak_flops": [1, 2], "mem_bytes": 1, "mem_bandwidth": 1},
    {"name": "x", "peak_flops": {"bf16": "fast"}, "mem_bytes": 1, "mem_bandwidth": 1},
    {"name": "x", "peak_flops": {"bf16": 1e9}, "mem_bytes": 1, "mem_bandwidth": 0},
    {"name": "x", "peak_flops": {"bf16": 1e9}, "mem_bytes": 1, "mem_bandwidth": 1,
     "measured": [1]},
])
def test_a_damaged_machine_entry_is_named_and_listing_survives_it(tmp_path, monkeypatch,
                                                                    capsys, entry):
    """A hand-edited or truncated machine.json: --gpu cpu-local names the file and says to
    measure again; --list (text and JSON) still lists the catalog."""
    from phasewise.perf.measure import _complete

    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    (tmp_path / "machine.json").write_text(json.dumps({"cpu-local": entry}))
    assert main(["roofline", "--model", "llama-3.1-8b", "--gpu", "cpu-local"]) != 0
    err = capsys.readouterr().err
    assert "machine.json: its 'cpu-local' entry is damaged" in err and "measure" in err
    assert main(["roofline", "--list"]) == 0 and "h100-sxm" in capsys.readouterr().out
    assert main(["roofline", "--list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accelerators"]
    assert not _complete(entry)  # so the engine's quick measurement redoes it


# -- phasewise generate's closing lines (phasewise.perf.explain) ---------------------------
def _explain_setup():
    from phasewise.perf.hardware import Accelerator

    shape = ModelShape("small", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=64, intermediate_size=768, vocab_size=4096,
                       tie_word_embeddings=True)
    acc = Accelerator("cpu-local", "test CPU", {"fp32": 100e9}, 8e9, 10e9, None, "test")
    return shape, acc, Roofline(shape, acc, "bf16", compute_dtype="fp32")


def test_prefill_turns_compute_bound_at_the_crossover_prompt_length():
    from phasewise.perf.explain import compute_bound_prompt_len, prefill_cost

    shape, acc, roof = _explain_setup()
    n = compute_bound_prompt_len(roof, 512)
    assert n is not None and 2 <= n <= 64
    assert roof.prefill(n).bound == "compute" and roof.prefill(n - 1).bound == "memory"
    # chunked: two steps read the weights twice, so the same prompt's intensity drops
    whole, chunked = prefill_cost(roof, [2 * n], 1.0), prefill_cost(roof, [n, n], 1.0)
    assert chunked.steps == 2 and chunked.tokens == whole.tokens == 2 * n
    assert chunked.bytes > whole.bytes and chunked.intensity < whole.intensity
    assert compute_bound_prompt_len(Roofline(shape, acc, "fp32"), 1) is None


def test_explain_names_each_phase_bound_and_its_distance_from_the_roof():
    from phasewise.perf.explain import decode_cost, explain_generation
    from phasewise.perf.hardware import Accelerator

    shape, acc, roof = _explain_setup()
    dec = decode_cost(roof, 7, 3, 0.0)
    assert dec.flops == pytest.approx(sum(roof.decode(1, c).flops for c in (8, 9, 10)))
    assert dec.bound == "memory"
    # speculative decoding: a step of 3 rows (8, 9, 10) that emitted 2, then 2 rows (10, 11)
    spec = decode_cost(roof, 7, 2, 0.0, verifies=[(3, 2), (2, 1)])
    assert spec.steps == 2 and spec.tokens == 5
    assert spec.flops == pytest.approx(roof.mixed(decodes=[8, 9, 10]).flops
                                       + roof.mixed(decodes=[10, 11]).flops)
    assert spec.bytes < 1.01 * dec.bytes * 2 / 3  # two weight reads instead of three
    lines = explain_generation(shape, acc, "bf16", "fp32", "fp32", [7], 0.05, 3, 0.1, 512,
                               verifies=[(3, 2), (2, 1)])
    assert "2 steps of 2.5 rows, 3 tokens: 1.50 tokens per weight read" in "\n".join(lines)
    # short prompt, slow steps: memory-bound both; the excess is not explained by the work
    # the roofline counts, and nothing is recited about why
    lines = explain_generation(shape, acc, "bf16", "fp32", "fp32", [5], 0.05, 10, 0.1, 512)
    text = "\n".join(lines)
    assert "ridge 10.0 FLOP/byte" in text
    assert "prefill was memory-bound and decode was memory-bound" in text
    assert "tokens or more would make prefill compute-bound" in text
    assert "decode would need a batch of ~" in text
    assert "load during the run is unknown" in text and "not explained by this step" in text
    assert "fixed costs" not in text
    # the same steps beside other load: blamed on it (several threads, each waiting for any
    # that lost its core, can run that much slower); on a quiet machine: not
    from phasewise.perf.contention import Contention

    busy = "\n".join(explain_generation(shape, acc, "bf16", "fp32", "fp32", [5], 0.05, 10,
                                        0.1, 512, contention=Contention(1.5, 0.55, 0.0),
                                        threads=16))
    assert "other processes used 55% of this machine's CPU time over 1.5 s" in busy
    assert "contention, not this work" in busy and "not explained" not in busy
    quiet = "\n".join(explain_generation(shape, acc, "bf16", "fp32", "fp32", [5], 0.05, 10,
                                         0.1, 512, contention=Contention(1.5, 0.03, 0.0)))
    assert "with the CPUs to itself (other processes used 3%" in quiet
    assert "not explained by this step" in quiet and "contention" not in quiet
    # long prompt, fast steps: prefill compute-bound; faster than the DRAM roof is explained
    lines = explain_generation(shape, acc, "bf16", "fp32", "fp32", [400], 1e-4, 10, 1e-5, 512)
    text = "\n".join(lines)
    assert "prefill was compute-bound and decode was memory-bound" in text
    assert "stay in the CPU caches" in text and "fixed costs" not in text
    # a step limit below the crossover: no chunk can turn prefill compute-bound
    lines = explain_generation(shape, acc, "bf16", "fp32", "fp32", [4, 4], 0.05, 0, 0.0, 4)
    text = "\n".join(lines)
    assert "no prompt chunk up to the 4-token step limit" in text
    assert "[roofline] decode" not in text
    # different arithmetic per phase: both peaks shown, each phase rated against its own
    acc2 = Accelerator("cpu-local", "t", {"fp32": 100e9, "bf16": 400e9}, 8e9, 10e9, None, "t")
    lines = explain_generation(shape, acc2, "bf16", "bf16", "fp32", [20], 0.05, 3, 0.1, 256)
    assert "bf16 matmul 400.0 GFLOP/s, fp32 matmul 100.0 GFLOP/s" in lines[0]
    assert "ridge 40.0 / 10.0 FLOP/byte" in lines[0]


def test_explain_splits_a_slow_phase_into_its_forward_pass_and_the_hosts_time():
    """With the forward passes timed, a phase far above its roofline says how its time split
    and names the larger part of its excess; other load, where measured high, is still what
    is blamed; a phase whose forward passes were not timed is left unexplained."""
    from phasewise.perf.contention import Contention
    from phasewise.perf.explain import decode_cost, explain_generation

    shape, acc, roof = _explain_setup()
    bound = decode_cost(roof, 5, 10, 0.0).t_bound / 10  # a decode step's roofline time
    assert 0.0005 < bound < 0.001  # what the figures below are chosen around
    quiet = Contention(1.5, 0.03, 0.0)

    def bound_lines(decode_s, decode_forward_s, contention=quiet, prefill_forward_s=None,
                    threads=4):
        lines = explain_generation(shape, acc, "bf16", "fp32", "fp32", [5], 0.05, 10,
                                   decode_s, 512, contention=contention,
                                   prefill_forward_s=prefill_forward_s,
                                   decode_forward_s=decode_forward_s, threads=threads)
        return {ln.split()[1]: ln for ln in lines if ln.startswith("[bound]    ")
                and "above the roofline time" in ln}

    # 10 ms a step, of which 0.8 ms in the forward pass: the host is the excess
    dec = bound_lines(0.1, 0.008)["decode"]
    assert ("decode ran 12x above the roofline time: of 10.0 ms a step, 0.80 ms in the "
            "forward pass (0.9x its roofline time) and 9.20 ms outside it (scheduling, "
            "sampling, outputs)") in dec
    assert "with the CPUs to itself (other processes used 3%" in dec
    assert dec.endswith("the excess is host work outside the forward pass")
    # 9 ms of the 10 in the forward pass, 10.7x its roofline time: the kernels are named
    dec = bound_lines(0.1, 0.09)["decode"]
    assert "9.00 ms in the forward pass (10.7x its roofline time) and 1.00 ms outside" in dec
    assert dec.endswith("the excess is in the forward pass: its kernels and per-layer calls "
                        "ran below this machine's peaks")
    assert "host work" not in dec
    # both far: the host's larger part first, the kernels' too
    dec = bound_lines(0.1, 0.03)["decode"]
    assert "most of the excess is host work" in dec and "also ran below" in dec
    # neither part alone: 3.5 ms a step, the forward pass under 3x its roofline time and
    # more over it than the host's 1 ms
    dec = bound_lines(0.035, 0.025)["decode"]
    assert "(3.0x its roofline time)" in dec
    assert dec.endswith("the excess is split between the forward pass and host work outside it")
    # other load measured high: the split is still given, the excess is blamed on the load
    dec = bound_lines(0.1, 0.008, Contention(1.5, 0.55, 0.0))["decode"]
    assert "0.80 ms in the forward pass" in dec and "contention, not this work" in dec
    assert "host work" not in dec and "below this machine's peaks" not in dec
    # ... but one thread, which waits for no other, only as far as that load can explain:
    # beside 55% of other work it runs at most ~2x slower (4x with the margin), so 12x has
    # another cause, named
    dec = bound_lines(0.1, 0.008, Contention(1.5, 0.55, 0.0), threads=1)["decode"]
    assert ("other processes used 55% of this machine's CPU time over 1.5 s, which can "
            "explain up to ~4x, not 12x: beyond it, the excess is host work outside the "
            "forward pass") in dec
    assert "contention, not this work" not in dec
    pre = bound_lines(0.1, 0.008, Contention(1.5, 0.55, 0.0), threads=1)["prefill"]
    assert "which can explain up to ~4x, not 58x: the rest is not explained" in pre
    # each slow phase on its line: the prefill's forward passes were not timed, so its
    # excess is left unexplained, while the decode's is split
    both = bound_lines(0.1, 0.008)
    assert "not explained by this step's work" in both["prefill"]
    assert "not timed apart" in both["prefill"] and "forward pass (" not in both["prefill"]
    assert "not explained" not in both["decode"]
    pre = bound_lines(0.1, 0.008, prefill_forward_s=0.045)["prefill"]
    assert "of 50.0 ms, 45.0 ms in the forward pass" in pre and "a step" not in pre
    # unknown load: the split and what it shows are still given
    dec = bound_lines(0.1, 0.09, None)["decode"]
    assert "load during the run unknown" in dec and "the excess is in the forward pass" in dec
    # contended with several threads: fewer is offered, one fewer than it ran; with one
    # thread, or on a quiet machine, nothing is offered
    busy = Contention(1.5, 0.55, 0.0)

    def with_threads(threads, contention):
        lines = explain_generation(shape, acc, "bf16", "fp32", "fp32", [5], 0.05, 10, 0.1,
                                   512, contention=contention, decode_forward_s=0.008,
                                   threads=threads)
        return next(ln for ln in lines if ln.startswith("[bound]    decode ran"))

    assert "--threads 3 may run faster while the machine is busy" in with_threads(4, busy)
    assert "--threads" not in with_threads(1, busy)
    assert "--threads" not in with_threads(4, quiet)


def test_ensure_local_measures_only_what_is_missing(tmp_path, monkeypatch):
    from phasewise.perf import measure as measure_mod

    calls = []

    def fake_measure_device(device, progress, quick=False, dtypes=(), read_bandwidth=True):
        calls.append((device, quick, tuple(dtypes), read_bandwidth))
        return {"name": "quick", "peak_flops": {d: 5e9 for d in dtypes}, "mem_bytes": 1e9,
                "mem_bandwidth": 2e9 if read_bandwidth else None,
                "measured": {"quick": quick}}

    monkeypatch.setattr(measure_mod, "measure_device", fake_measure_device)
    path = tmp_path / "machine.json"
    path.write_text(json.dumps({"cpu-local": {"name": "full", "peak_flops": {"bf16": 1e9},
                                              "mem_bytes": 1e9, "mem_bandwidth": 9e9}}))
    acc = measure_mod.ensure_local("cpu", ("bf16",), path)
    assert acc.name == "full" and calls == []  # had it: nothing measured
    acc = measure_mod.ensure_local("cpu", ("fp32", "bf16"), path)  # lacks fp32 only
    assert calls == [("cpu", True, ("fp32",), False)]  # the bandwidth is already known
    data = json.loads(path.read_text())["cpu-local"]
    assert data["peak_flops"] == {"bf16": 1e9, "fp32": 5e9}
    assert data["mem_bandwidth"] == 9e9 and data["name"] == "full"  # the full run's figures
    assert acc.peak_flops_for("fp32") == 5e9
    path.write_text("{not json")  # unreadable: measured afresh and written over
    acc = measure_mod.ensure_local("cuda:1", ("bf16",), path)
    assert calls[-1] == ("cuda:1", True, ("bf16",), True) and acc.key == "gpu-local"
    assert json.loads(path.read_text())["gpu-local"]["peak_flops"] == {"bf16": 5e9}
    path.write_text(json.dumps({"cpu-local": {"name": "damaged"}}))  # an incomplete entry
    acc = measure_mod.ensure_local("cpu", ("fp32",), path)
    assert calls[-1][3] is True and acc.mem_bandwidth == 2e9
    blocker = tmp_path / "blocker"  # a file where the cache folder should be: unwritable
    blocker.write_text("x")
    acc = measure_mod.ensure_local("cpu", ("fp32",), blocker / "sub" / "machine.json")
    assert acc.peak_flops_for("fp32") == 5e9  # an unwritable cache only costs the saving


def test_peaks_are_kept_per_thread_count(tmp_path, monkeypatch):
    """A CPU's figures measured at one thread count are not another's: an engine run at
    another count reads (and on first need measures) ``cpu-local@Nt``, and leaves the
    ``cpu-local`` entry, which ``roofline --gpu cpu-local`` reads, as it was."""
    import torch

    from phasewise.perf import measure as measure_mod
    from phasewise.perf.attribution import stored_peaks
    from phasewise.perf.hardware import load_local, local_slot, lookup_accelerator

    assert local_slot("cpu-local", 1, {}) == "cpu-local"  # free: the first count takes it
    two = {"cpu-local": {"measured": {"threads": 2}}}
    assert local_slot("cpu-local", 2, two) == "cpu-local"
    assert local_slot("cpu-local", 1, two) == "cpu-local@1t"
    assert local_slot("cpu-local", None, two) == "cpu-local"  # no count asked for
    assert local_slot("gpu-local", 1, {"gpu-local": {"measured": {"threads": 2}}}) == \
        "gpu-local"
    assert local_slot("cpu-local", 1, {"cpu-local": {"measured": {}}}) == "cpu-local"

    calls = []

    def fake_measure_device(device, progress, quick=False, dtypes=(), read_bandwidth=True):
        calls.append(torch.get_num_threads())
        return {"name": f"{torch.get_num_threads()} threads",
                "peak_flops": {d: 1e9 * torch.get_num_threads() for d in dtypes},
                "mem_bytes": 1e9, "mem_bandwidth": 3e9,
                "measured": {"quick": quick, "threads": torch.get_num_threads()}}

    monkeypatch.setattr(measure_mod, "measure_device", fake_measure_device)
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    path = tmp_path / "machine.json"
    full = {"name": "full, 2 threads", "peak_flops": {"bf16": 2e9}, "mem_bytes": 1e9,
            "mem_bandwidth": 9e9, "measured": {"threads": 2}}
    path.write_text(json.dumps({"cpu-local": full}))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert stored_peaks("cpu", path) is None  # none at 1 thread yet: never measures
        acc = measure_mod.ensure_local("cpu", ("bf16",), path)
        assert calls == [1] and acc.key == "cpu-local" and acc.name == "1 threads"
        data = json.loads(path.read_text())
        assert data["cpu-local"] == full and data["cpu-local@1t"]["peak_flops"] == {"bf16": 1e9}
        assert stored_peaks("cpu", path).peak_flops_for("bf16") == 1e9
        assert load_local("cpu-local", path, 1).name == "1 threads"
        assert measure_mod.ensure_local("cpu", ("bf16",), path).name == "1 threads"
        assert calls == [1]  # stored: not measured again
    finally:
        torch.set_num_threads(before)
    assert load_local("cpu-local", path, 2).name == "full, 2 threads"
    assert lookup_accelerator("cpu-local").name == "full, 2 threads"
    assert lookup_accelerator("cpu-local@1t").name == "1 threads"
    with pytest.raises(ValueError, match="no 'cpu-local@3t' entry.*--threads 3"):
        load_local("cpu-local", path, 3)


def test_weight_only_int8_halves_the_weights_and_keeps_16_bit_kv_and_activations():
    shape, acc, bf16 = _explain_setup()
    int8 = Roofline(shape, acc, "int8", compute_dtype="fp32")
    assert int8.kv_dtype == "bf16" and int8.weight_bytes == bf16.weight_bytes / 2
    a, b = bf16.decode(4, 300), int8.decode(4, 300)
    assert b.kv_read_bytes == a.kv_read_bytes and b.act_bytes == a.act_bytes
    assert b.flops == a.flops and b.weight_bytes == a.weight_bytes / 2
    int8_kv = Roofline(shape, acc, "int8", kv_dtype="int8", compute_dtype="fp32")
    assert int8_kv.kv_bytes_per_token == bf16.kv_bytes_per_token / 2
    assert Roofline(shape, acc, "fp8", compute_dtype="fp32").kv_dtype == "fp8"  # not weight-only


def test_contention_reads_other_processes_share_and_steal_from_proc(tmp_path):
    """/proc/stat's busy ticks less this process's and steal's are other processes' work;
    a window too short to hold enough ticks gives no verdict."""
    from phasewise.perf.contention import Contention, CpuSample

    def proc(user, idle, steal, own_u, own_s):
        (tmp_path / "self").mkdir(exist_ok=True)
        # user nice system idle iowait irq softirq steal
        (tmp_path / "stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 {steal} 0 0\ncpu0 1\n")
        rest = " ".join(["S"] + ["0"] * 10 + [str(own_u), str(own_s), "0", "0"] + ["0"] * 30)
        (tmp_path / "self" / "stat").write_text(f"123 (a (odd) name) {rest}\n")
        return CpuSample.now(tmp_path)

    a = proc(1000, 5000, 10, 100, 20)
    b = proc(1000 + 120, 5000 + 60, 10 + 20, 100 + 40, 20 + 10)  # 200 ticks in all
    assert (b.total - a.total, b.own - a.own) == (200, 50)
    b = CpuSample(a.wall + 1.0, b.busy, b.total, b.steal, b.own)
    c = Contention.between(a, b)
    assert c.others == pytest.approx((140 - 20 - 50) / 200) and c.steal == pytest.approx(0.1)
    assert c.shared  # 35% others
    assert Contention.between(a, CpuSample(a.wall + 0.05, b.busy, b.total, b.steal, b.own)) \
        is None
    assert CpuSample.now(tmp_path / "missing") is None


def test_a_figure_whose_best_runs_disagree_or_that_ran_beside_other_load_is_unstable():
    from phasewise.perf.contention import Contention
    from phasewise.perf.measure import STABLE_BAND, best_two_gap, unstable_reasons

    assert best_two_gap([1.0]) is None and best_two_gap([2.0, 1.0, 1.05]) == pytest.approx(
        0.05 / 1.05)
    quiet = Contention(2.0, 0.02, 0.0)
    times = {"bf16": [3.0, 1.0, 2.4], "fp32": [1.0, 1.02, 1.5]}  # bf16: best two 58% apart
    out = unstable_reasons(times, quiet)
    assert set(out) == {"bf16"} and "two best runs are 58% apart" in out["bf16"]
    assert 0.58 > STABLE_BAND
    busy = unstable_reasons({"fp32": [1.0, 1.02]}, Contention(2.0, 0.6, 0.0))
    assert "other processes used 60%" in busy["fp32"]
    assert unstable_reasons({"fp32": [1.0, 1.02]}, None) == {}


def test_an_unstable_stored_figure_is_measured_again_and_never_preferred(tmp_path, monkeypatch,
                                                                         capsys):
    """generate's first quick measurement ran beside other load: its figure is stored as
    unstable, printed so, measured again at the next use, and replaced by a stable one; a
    second unstable one never replaces a higher one, and a stable one is left alone."""
    from phasewise.perf import measure as pm

    calls = []
    results = iter([
        ({"fp32": 150e9}, 20e9, {"fp32": "its two best runs are 59% apart"}, 0.0),
        ({"fp32": 120e9}, 20e9, {"fp32": "measured while other processes used 80%"}, 0.8),
        ({"fp32": 420e9}, 20e9, {}, 0.0),
    ])

    def fake(device, progress, quick=False, dtypes=(), read_bandwidth=True):
        calls.append((dtypes, read_bandwidth))
        peaks, bw, unstable, others = next(results)
        return {"name": "cpu (measured)", "peak_flops": {d: peaks[d] for d in dtypes},
                "mem_bytes": 1e9, "mem_bandwidth": bw if read_bandwidth else None,
                "source": "test", "measured": {"quick": quick, "unstable": unstable,
                                               "spread": {"fp32": [60e9, peaks["fp32"]]},
                                               "runs": {"fp32": 3},
                                               "conditions": {"others": others}}}

    monkeypatch.setattr(pm, "measure_device", fake)
    path = tmp_path / "machine.json"
    acc = pm.ensure_local("cpu", ("fp32",), path)
    assert acc.peak_flops["fp32"] == 150e9 and "fp32" in acc.measured["unstable"]
    assert "UNSTABLE: its two best runs" in pm.format_entry("cpu-local",
                                                            json.loads(path.read_text())
                                                            ["cpu-local"])
    capsys.readouterr()
    acc = pm.ensure_local("cpu", ("fp32",), path)  # again unstable, and lower: kept 150
    assert acc.peak_flops["fp32"] == 150e9 and "other processes" in acc.measured["unstable"][
        "fp32"]
    # and it says so: the figure this run measured is not the one it goes on with
    assert "kept the stored fp32 matmul 150.0 GFLOP/s, higher than this run's 120.0" in \
        capsys.readouterr().err
    # The kept figure keeps the conditions it was measured in, not the newest run's: its
    # noise is its own spread (150/60), not the 80% load of a run whose figure was dropped.
    from phasewise.perf.explain import noise_factor

    assert acc.measured["conditions"]["others"] == 0.8
    assert acc.measured["figure_conditions"]["fp32"]["others"] == 0.0
    assert noise_factor(acc, "fp32") == pytest.approx(2.5)
    acc = pm.ensure_local("cpu", ("fp32",), path)  # stable: replaces it
    assert acc.peak_flops["fp32"] == 420e9 and acc.measured["unstable"] == {}
    # and the entry's source says the figure was measured again, and when, once
    assert acc.source.startswith("test; fp32 matmul measured again quickly on ")
    assert acc.source.count("measured again") == 1
    assert calls == [(("fp32",), True), (("fp32",), False), (("fp32",), False)]
    acc = pm.ensure_local("cpu", ("fp32",), path)  # stable now: nothing is measured
    assert len(calls) == 3 and acc.peak_flops["fp32"] == 420e9


def test_a_verdict_within_the_noise_of_unstable_peaks_says_either_bound():
    from phasewise.perf.explain import explain_generation
    from phasewise.perf.hardware import Accelerator

    shape, acc, _ = _explain_setup()
    stable = "\n".join(explain_generation(shape, acc, "bf16", "fp32", "fp32", [5], 0.05, 10,
                                          0.1, 512))
    assert "either bound" not in stable
    noisy = Accelerator(acc.key, acc.name, acc.peak_flops, acc.mem_bytes, acc.mem_bandwidth,
                        None, acc.source, measured={
                            "unstable": {"fp32": "its two best runs are 59% apart"},
                            "spread": {"fp32": [v / 1e6 for v in (1, 1)]},
                            "conditions": {"others": 0.0}})
    noisy.measured["spread"]["fp32"] = [acc.peak_flops["fp32"] / 1e4, acc.peak_flops["fp32"]]
    text = "\n".join(explain_generation(shape, noisy, "bf16", "fp32", "fp32", [5], 0.05, 10,
                                        0.1, 512))
    assert "within the noise of this machine's unstable peaks" in text
    assert "either bound" in text
    # the hedge is a clause of its own: "either bound and decode was ..." read as one
    assert "either bound and" not in text and "either bound; decode was" in text
    # The crossovers come from the same ridge: hedged alike, and only there.
    assert "from unstable peaks: the ridge these come from could be off" in text
    assert "from unstable peaks" not in stable


@pytest.mark.parametrize("over,match", [
    ({"hidden_size": -4096}, "hidden_size must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be positive"),
    ({"num_attention_heads": 0}, "num_attention_heads and num_hidden_layers must be positive"),
    ({"intermediate_size": -1}, "intermediate_size must be a positive integer"),
    ({"vocab_size": None}, "missing 'vocab_size'"),
    ({"hidden_size": 4096.5}, "hidden_size must be an integer, got 4096.5"),
    ({"hidden_size": "4096"}, "hidden_size must be an integer"),
    ({"num_key_value_heads": 64}, "num_key_value_heads \\(64\\) exceeds"),
])
def test_a_config_of_impossible_sizes_is_refused_by_the_field(over, match):
    """A hand-written config.json with a size of 0 or less (or not a whole number) would be
    priced as a model of negative bytes and times: it is refused, naming the field."""
    cfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
           "intermediate_size": 11008, "vocab_size": 32000, **over}
    with pytest.raises(ValueError, match=match):
        ModelShape.from_hf_config(cfg)
    with pytest.raises(ValueError, match="a JSON object"):
        ModelShape.from_hf_config([1, 2])  # type: ignore[arg-type]


def test_a_decode_batch_near_the_context_limit_says_it_grows_without_bound():
    """Close to the context past which decode never turns compute-bound, the batch it would
    need grows without bound: the line says so rather than leave a bare large figure."""
    from phasewise.perf.explain import explain_generation

    shape, acc, roof = _explain_setup()
    limit = roof.never_compute_bound_context()

    def bound_line(prompt_len):
        lines = explain_generation(shape, acc, "bf16", "fp32", "fp32", [prompt_len], 0.05, 10,
                                   0.1, 512)
        return next(ln for ln in lines if ln.startswith("[bound]    on this machine"))

    far = bound_line(10)  # a context of 20, far below the limit
    assert "decode would need a batch of ~11 sequences" in far and "nears the" not in far
    near = bound_line(390)  # a context of 400
    assert f"at a context of 400 tokens, which nears the {limit:.0f} past which decode never " \
           "turns compute-bound at any batch" in near


def test_roofline_and_simulate_say_when_cpu_local_figures_are_unstable(tmp_path, monkeypatch,
                                                                        capsys):
    """A prediction from a cpu-local figure stored as unstable says which, why and how far
    off it could be; from stable figures it says nothing of the kind."""
    import json as _json

    from phasewise.cli import main

    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))

    def store(unstable):
        entry = {"name": "cpu (measured)", "peak_flops": {"fp32": 100e9, "bf16": 400e9},
                 "mem_bytes": 16e9, "mem_bandwidth": 20e9, "source": "test",
                 "measured": {"quick": False, "unstable": unstable,
                              "spread": {"bf16": [200e9, 400e9], "fp32": [90e9, 100e9],
                                         "mem_bandwidth": [19e9, 20e9]},
                              "conditions": {"others": 0.0}}}
        (tmp_path / "machine.json").write_text(_json.dumps({"cpu-local": entry}))

    store({"bf16": "its two best runs are 50% apart"})
    assert main(["roofline", "--model", "Qwen2.5-0.5B", "--gpu", "cpu-local"]) == 0
    out = capsys.readouterr().out
    assert "cpu-local's figures were measured UNSTABLE (bf16 matmul: its two best runs" in out
    assert "off by up to x2.00" in out
    assert main(["roofline", "--model", "Qwen2.5-0.5B", "--gpu", "cpu-local",
                 "--compute-dtype", "fp32"]) == 0  # the figure it uses is stable
    assert "UNSTABLE" not in capsys.readouterr().out
    assert main(["simulate", "--model", "Qwen2.5-0.5B", "--gpu", "cpu-local",
                 "--num-prompts", "4"]) == 0
    out = capsys.readouterr().out
    assert "UNSTABLE (bf16 matmul" in out
    assert "caveat: these figures come from peaks measured UNSTABLE" in out
    store({})
    assert main(["roofline", "--model", "Qwen2.5-0.5B", "--gpu", "cpu-local"]) == 0
    assert "UNSTABLE" not in capsys.readouterr().out


def test_a_missing_dtype_figure_names_how_to_measure_it_on_this_machine():
    """generate's quick measurement stores the dtype it ran in: a roofline in another one on
    cpu-local said only which it lacked, not that 'phasewise measure' fills it in."""
    from phasewise.perf.hardware import accelerator_from_entry

    local = accelerator_from_entry("cpu-local", {"name": "cpu", "peak_flops": {"bf16": 1e11},
                                                 "mem_bytes": 1e9, "mem_bandwidth": 2e10})
    with pytest.raises(ValueError, match="no fp32 figure; it has bf16; 'phasewise measure'"):
        local.peak_flops_for("fp32")
    with pytest.raises(ValueError) as e:  # nor a dtype measure never measures
        local.peak_flops_for("int8")
    assert "phasewise measure" not in str(e.value)
    with pytest.raises(ValueError) as e:  # a catalog card: nothing here can measure it
        ACCELERATORS["h100-sxm"].peak_flops_for("int4")
    assert "phasewise measure" not in str(e.value)
