"""Mixture-of-experts models served (``SparseMoE``): Mixtral, Qwen2-MoE (a shared expert and
its gate) and Qwen3-MoE (renormalised top-k) give HF transformers' greedy output on tiny
random-weight checkpoints, in mixed batches of prompt chunks and decodes; configs that would
route otherwise are refused by the field at fault."""

from __future__ import annotations

import pytest

from conftest import build_hf_checkpoint, hf_greedy, streamed_greedy_tokens
from phasewise.config import EngineConfig
from phasewise.engine.engine import LLMEngine
from phasewise.model.config import ModelConfig
from test_parity import GREEDY, N_NEW, random_prompts, run_staggered

MOE = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    out = {}
    for i, arch in enumerate(MOE):
        path = tmp_path_factory.mktemp(arch)
        over = {"norm_topk_prob": True} if arch == "Qwen3MoeForCausalLM" else {}
        out[arch] = (path, build_hf_checkpoint(path, arch, seed=20 + i, **over))
    return out


@pytest.mark.parametrize("arch", MOE)
def test_greedy_matches_hf_in_mixed_batches(moe_checkpoints, arch):
    path, hf = moe_checkpoints[arch]
    prompts = random_prompts(hf.config.vocab_size, [1, 9, 23, 61, 4], seed=3)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=16))
    got = run_staggered(engine, prompts, GREEDY)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.step_stats)
    for i, p in enumerate(prompts):
        assert got[i] == hf_greedy(hf, p, N_NEW), f"prompt {i} (len {len(p)}) diverged"


def test_the_config_says_which_layers_are_sparse_and_how_they_route(moe_checkpoints):
    cfg = ModelConfig.from_file(moe_checkpoints["Qwen2MoeForCausalLM"][0])
    m = cfg.moe
    assert (m.num_experts, m.experts_per_token, m.intermediate_size) == (4, 2, 48)
    assert m.shared_intermediate_size == 80 and not m.norm_topk_prob
    assert m.layers == (0, 1)
    mixtral = ModelConfig.from_file(moe_checkpoints["MixtralForCausalLM"][0]).moe
    assert mixtral.norm_topk_prob and mixtral.shared_intermediate_size == 0


@pytest.mark.parametrize("field,value,match", [
    ("num_experts_per_tok", 5, "exceeds the 4 experts"),
    ("num_experts_per_tok", 0, "num_experts_per_tok must be an integer >= 1"),
    ("scoring_func", "sigmoid", "scoring_func 'sigmoid' routes otherwise"),
    ("topk_method", "group_limited_greedy", "topk_method"),
    ("norm_topk_prob", "yes", "norm_topk_prob must be true or false"),
    ("mlp_only_layers", "0", "mlp_only_layers must be a list"),
])
def test_a_routing_phasewise_does_not_implement_is_refused_by_name(moe_checkpoints, field,
                                                                    value, match):
    import json

    path = moe_checkpoints["Qwen3MoeForCausalLM"][0]
    d = {**json.loads((path / "config.json").read_text()), field: value}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(d)


def test_each_step_reports_the_experts_its_tokens_read(moe_checkpoints):
    """A decode of one sequence reads at most its top-k experts a layer; a prompt of many
    tokens reads nearly all of them; a dense model reports none."""
    path, hf = moe_checkpoints["MixtralForCausalLM"]
    engine = LLMEngine(EngineConfig(model=str(path)))
    engine.add_request(random_prompts(hf.config.vocab_size, [60], seed=4)[0],
                       GREEDY, request_id="one")
    while engine.has_unfinished_requests():
        engine.step()
    prompt, *decodes = engine.step_stats
    assert prompt.num_prefill_tokens == 60 and prompt.experts_read > 2
    assert decodes and all(1 <= s.experts_read <= 2 for s in decodes)
    from phasewise.server.metrics import PrometheusMetrics
    from phasewise.engine.backend import EngineSnapshot
    m = PrometheusMetrics("m")
    snap = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0)
    for s in engine.step_stats:
        m.on_step(s, [], [], snap)
    from prometheus_client import generate_latest
    text = generate_latest(m.registry).decode()
    assert f'phasewise:step_experts_read_count{{model_name="m"}} {len(engine.step_stats)}.0' \
        in text


def test_a_dense_model_reports_no_experts(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    engine.add_request([5, 6, 7], GREEDY)
    engine.step()
    assert engine.step_stats[-1].experts_read is None


@pytest.mark.parametrize("arch", MOE)
def test_the_parameter_counts_are_the_checkpoints(moe_checkpoints, arch):
    """The engine's count and the roofline's (which leaves out biases and q/k norms, as it
    does for dense models) against the checkpoint's own tensors."""
    from phasewise.perf.models import ModelShape

    path, hf = moe_checkpoints[arch]
    assert ModelConfig.from_file(path).num_params == sum(p.numel() for p in hf.parameters())
    shape = ModelShape.from_path(path)
    small = {n: p.numel() for n, p in hf.named_parameters()
             if n.endswith("bias") or "q_norm" in n or "k_norm" in n}
    assert shape.total_params == sum(p.numel() for p in hf.parameters()) - sum(small.values())


def test_served_a_tiny_moe_streams_and_reports_its_experts(moe_checkpoints):
    """Through the OpenAI server: a streamed completion equals HF's greedy continuation, and
    /metrics holds the experts each step read."""
    import asyncio

    import httpx

    from phasewise.engine.async_engine import AsyncEngine
    from phasewise.server.app import OpenAIServer, ServerConfig
    from phasewise.server.metrics import PrometheusMetrics

    path, hf = moe_checkpoints["Qwen2MoeForCausalLM"]
    metrics = PrometheusMetrics("moe")
    engine = AsyncEngine.from_config(EngineConfig(model=str(path)), observers=[metrics])
    server = OpenAIServer(engine, ServerConfig(served_model_name="moe"), metrics)
    prompt = random_prompts(hf.config.vocab_size, [12], seed=5)[0]

    async def run():
        engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s",
                                     timeout=60) as c:
            ids = await streamed_greedy_tokens(c, prompt, 8)
            # each streamed token, as the server names it, is HF's greedy choice
            assert ids == [server.routes._token_text(t) for t in hf_greedy(hf, prompt, 8)]
            m = (await c.get("/metrics")).text
            assert "phasewise:step_experts_read_count" in m
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_greedy_matches_hf_with_prefix_hits_and_across_preemption(moe_checkpoints):
    from phasewise import LLM

    path, hf = moe_checkpoints["Qwen3MoeForCausalLM"]
    shared = random_prompts(hf.config.vocab_size, [40], seed=5)[0]
    prompts = random_prompts(hf.config.vocab_size, [3, 11], seed=6, shared_prefix=shared)
    llm = LLM(str(path), block_size=8)
    outs = [llm.generate(p, GREEDY)[0] for p in prompts]
    assert outs[1].metrics.num_cached_tokens >= 32
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)
    path, hf = moe_checkpoints["MixtralForCausalLM"]
    prompts = random_prompts(hf.config.vocab_size, [20, 25, 30, 12], seed=3)
    llm = LLM(str(path), block_size=4, num_kv_blocks=16, max_model_len=63)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)


@pytest.mark.parametrize("arch", MOE)
def test_make_tiny_writes_a_checkpoint_that_loads_and_chats(tmp_path, arch):
    """``phasewise make-tiny --arch`` for each MoE architecture: its tensors are the ones the
    loader asks for, and the chat template answers through the server."""
    import asyncio

    import httpx

    from phasewise.engine.async_engine import AsyncEngine
    from phasewise.model.tiny import make_tiny_checkpoint
    from phasewise.server.app import OpenAIServer, ServerConfig

    path = make_tiny_checkpoint(tmp_path / "m", architecture=arch)
    assert ModelConfig.from_file(path).moe is not None
    engine = AsyncEngine.from_config(EngineConfig(model=str(path)))
    server = OpenAIServer(engine, ServerConfig(served_model_name="m"))

    async def run():
        engine.start(asyncio.get_running_loop())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app),
                                     base_url="http://s", timeout=60) as c:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_generate_says_how_many_experts_each_phase_read(moe_checkpoints, llama_dir):
    from phasewise import LLM
    from phasewise.generate import experts_line

    path, hf = moe_checkpoints["MixtralForCausalLM"]
    llm = LLM(str(path))
    llm.generate([random_prompts(hf.config.vocab_size, [40], seed=7)[0]], GREEDY)
    steps = list(llm.engine.step_stats)
    line = experts_line(llm.engine, [s for s in steps if s.num_prefill_tokens], steps)
    assert line.startswith("[experts]  prefill read ") and "of 4 experts a layer" in line
    assert "decode 2.0 (its 2 a token)" in line
    dense = LLM(str(llama_dir))
    dense.generate([[5, 6, 7]], GREEDY)
    steps = list(dense.engine.step_stats)
    assert experts_line(dense.engine, steps[:1], steps) is None


def test_the_dashboard_feed_carries_the_experts_each_step_read(moe_checkpoints):
    from phasewise.engine.backend import EngineSnapshot
    from phasewise.server.dashboard.feed import DashboardFeed

    path, hf = moe_checkpoints["Qwen3MoeForCausalLM"]
    engine = LLMEngine(EngineConfig(model=str(path)))
    engine.add_request(random_prompts(hf.config.vocab_size, [30], seed=8)[0], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    feed = DashboardFeed(model_name="m")
    snap = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0)
    for s in engine.step_stats:
        feed.on_step(s, [], [], snap)
    hello = feed.hello()
    col = hello["step_fields"].index("experts_read")
    rows = hello["steps"]
    assert [r[col] for r in rows] == [round(s.experts_read, 7) for s in engine.step_stats]
    assert rows[-1][col] == 2.0  # a decode of one sequence: its 2 a token


def _bf16_model(path, arch: str, seed: int, max_positions: int):
    """A tiny bf16 checkpoint of ``arch`` loaded for the CPU kernels (skips without them)."""
    import torch

    from phasewise.model.cpu import kernels
    from phasewise.model.loader import load_model

    if kernels.load() is None:
        pytest.skip(f"CPU kernels unavailable: {kernels.KERNELS.reason}")
    build_hf_checkpoint(path, arch, dtype=torch.bfloat16, seed=seed)
    cfg = ModelConfig.from_file(path)
    return cfg, load_model(path, cfg, dtype=torch.bfloat16, device=torch.device("cpu"),
                           max_positions=max_positions)


@pytest.mark.parametrize("arch", MOE)
def test_the_fused_decode_stack_routes_and_runs_experts_bit_for_bit(tmp_path, arch):
    """On the CPU kernels a decode step of up to 6 rows runs every layer, its router and its
    experts included, in one C call: the same bits as the op-by-op path, and the same
    experts read (Qwen2-MoE: its shared expert and gate in the call too). More rows than
    the streams take run op by op."""
    import torch

    from phasewise.model.attention import AttentionMetadata
    from phasewise.model.cpu import kernels
    from phasewise.model.cpu.linear import LinearDispatch
    from phasewise.model.cpu.ops import CpuKernelOps
    from phasewise.model.linear_types import PanelLinear

    cfg, model = _bf16_model(tmp_path, arch, seed=5, max_positions=128)
    class Stack(CpuKernelOps):  # whether the one-call stack ran the step
        took = False

        def decode_stack(self, *args, **kwargs):
            got = super().decode_stack(*args, **kwargs)
            self.took = got is not None
            return got

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    took: dict[bool, bool] = {}
    try:
        # then with the attention's projections in panels, where the CPU has AVX512_BF16
        panels = kernels.avx512bf16_available()
        for rows, packed in ((1, False), (3, False), (6, False), (7, False),
                             *(((1, True), (5, True)) if panels else ())):
            if packed and not isinstance(model.layers[0].qkv_proj, PanelLinear):
                assert CpuKernelOps(LinearDispatch(8, "torch")).pack_panels(model) == ""
            g = torch.Generator().manual_seed(rows)
            bs, nb = 4, 6 * rows + 4
            caches = [tuple(torch.randn(nb, bs, cfg.num_kv_heads, cfg.head_dim,
                                        generator=g).bfloat16() for _ in "kv")
                      for _ in range(cfg.num_layers)]
            ctx = [5 + 3 * r % 17 for r in range(rows)]
            perm = torch.randperm(nb, generator=g).tolist()
            meta = AttentionMetadata.build(
                chunk_lens=[1] * rows, context_lens=ctx,
                block_tables=[perm[6 * r:6 * r + 6] for r in range(rows)], block_size=bs,
                device=torch.device("cpu"))
            ids = torch.randint(3, cfg.vocab_size, (rows,), generator=g)
            out, read = {}, {}
            for fused in (True, False):
                ops = Stack(LinearDispatch(kernel_max_rows=8, large="torch"))
                ops.fused_decode, ops.panels = fused, packed
                model.ops = ops
                with torch.no_grad():
                    out[fused] = model(ids, torch.tensor(ctx),
                                       [(k.clone(), v.clone()) for k, v in caches], meta)
                read[fused] = [layer.moe.last_experts for layer in model.layers]
                took[fused] = ops.took
            assert took[True] == (rows <= 6), rows
            assert not took[False]
            assert torch.equal(out[True], out[False]) and read[True] == read[False], rows
    finally:
        torch.set_num_threads(threads)


def test_an_exact_tie_between_experts_goes_to_the_lower_one():
    """bf16 router logits tie often; torch.topk leaves ties to its implementation, so the
    routing takes the lower expert (the fused C layer does too)."""
    import torch

    from conftest import hf_config
    from phasewise.model.ops import TorchOps
    from phasewise.model.transformer import SparseMoE

    d = {**hf_config("MixtralForCausalLM", 300).to_dict(),
         "architectures": ["MixtralForCausalLM"]}
    cfg = ModelConfig.from_dict(d)
    assert (cfg.moe.num_experts, cfg.moe.experts_per_token) == (4, 2)
    moe = SparseMoE(cfg)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, 0] = torch.tensor([3.0, 2.0, 1.0, 2.0])  # 1 and 3 tie for second
        moe.gate_up.normal_()
        moe.down.normal_()
    x = torch.zeros(1, cfg.hidden_size)
    x[0, 0] = 1.0
    experts = moe.gate_up.view(4, -1, cfg.hidden_size)
    picked = []

    class Spy(TorchOps):
        def moe_linear(self, x, w):
            picked.extend(e for e in range(4) if w.data_ptr() == experts[e].data_ptr())
            return super().moe_linear(x, w)

    moe(x, Spy())
    assert picked == [0, 1]


def test_served_predictions_follow_the_routing_skew_measured():
    """The per-step cost model prices a step's expert bytes at the skew its last steps
    measured: steps that read fewer experts than uniform routing would make it fit fewer
    equally likely experts, and a batch's predicted bytes fall accordingly; `roofline
    --experts-read` fits the same."""
    from phasewise.engine.step_cost import Chunk
    from phasewise.perf.attribution import ROUTING_REFIT, StepCostModel
    from phasewise.perf.models import expected_experts, lookup_model, with_routing

    shape = lookup_model("Qwen3-30B-A3B")
    cm = StepCostModel(shape, "bf16", None)
    uniform = cm.predict([Chunk(16, 0)], []).bytes
    for t in (2, 4, 8, 16, 32, 64) * (ROUTING_REFIT // 6 + 1):
        cm.observe_routing(t, expected_experts(40.0, 8, t))  # as if 40 of 128 were used
    assert cm.shape.routed_experts == pytest.approx(40.0, rel=1e-3)
    skewed = cm.predict([Chunk(16, 0)], []).bytes
    e16 = expected_experts(40.0, 8, 16)
    assert uniform - skewed == pytest.approx(
        (shape.experts_touched(16) - e16) * shape.sparse_layers * shape.expert_params * 2,
        rel=1e-6)
    cm.observe_routing(1, 8.0)  # one token: no information about the skew
    assert with_routing(shape, "16:%f,64:%f" % (e16, expected_experts(40.0, 8, 64))
                        ).routed_experts == pytest.approx(40.0, rel=1e-3)
    with pytest.raises(ValueError, match="not T:X"):
        with_routing(shape, "16:500")


def test_int8_prices_an_moe_at_the_bytes_it_stores(moe_checkpoints):
    """``--quantization int8`` quantizes the attention and the LM head but keeps the experts,
    router and shared expert at the checkpoint's dtype: the per-step roofline counts the
    decoder layers' matrices at the bytes the engine holds them in, not the whole model at
    one byte a weight."""
    from phasewise import LLM
    from phasewise.perf.attribution import StepCostModel

    path, _ = moe_checkpoints["Qwen2MoeForCausalLM"]
    llm = LLM(str(path), quantization="int8", dtype="bfloat16")
    held = sum(t.numel() * t.element_size() for n, t in llm.engine.model.named_parameters()
               if n.startswith("layers.") and t.dim() == 2)  # no norms, biases or scales
    cost = StepCostModel.for_engine(llm.engine)
    roof, _ = cost.roofline(cost.compute_dtype(1))
    assert roof.dtype == "int8" and roof.moe_dtype == "bf16"
    s = cost.shape
    outside = s.total_params - s.num_layers * s.attn_params_per_layer - s.mlp_params
    assert s.sparse_mlp_params > 0 and outside > 0
    assert roof.weight_bytes - outside == pytest.approx(held, rel=1e-9)
    # a decode step reads its routed experts at two bytes a weight, leaving the rest unread
    # (and of an untied input embedding, its token's row)
    one = roof.decode(1, 0)
    idle = s.idle_expert_params(s.experts_touched(1))
    rows = 0 if s.tie_word_embeddings else (s.vocab_size - 1) * s.hidden_size * roof.wbytes
    assert 0 < idle and one.weight_bytes == pytest.approx(roof.weight_bytes - 2 * idle - rows)


@pytest.mark.parametrize("arch", MOE)
def test_a_sparse_layer_of_many_rows_runs_in_one_c_call_bit_for_bit(tmp_path, arch):
    """Past the fused stack's 6 rows (a decode batch of 7-32, a short prompt chunk), a sparse
    layer's MLP still runs in one C call (``CpuKernelOps.moe_mlp``): the same bits and the
    same experts read as ``SparseMoE``'s own loop over its experts on the same kernels, each
    expert's rows in runs of 6 (Qwen2-MoE: its shared expert too), or on AVX512_BF16 from 4
    rows all at once. Beyond 32 rows (256 on AVX512_BF16) the loop runs."""
    import torch

    from cpu_helpers import op_by_op
    from phasewise.model.cpu import kernels
    from phasewise.model.cpu.linear import LinearDispatch
    from phasewise.model.cpu.ops import MOE_FUSED_ROWS, MOE_FUSED_ROWS_DP, CpuKernelOps

    cfg, model = _bf16_model(tmp_path, arch, seed=6, max_positions=64)
    moe = model.layers[0].moe

    class Fused(CpuKernelOps):
        took: list[tuple[int, bool]] = []

        def moe_mlp(self, moe, x):
            out = super().moe_mlp(moe, x)
            self.took.append((x.shape[0], out is not None))
            return out

    fused = Fused(LinearDispatch(kernel_max_rows=8, large="torch"))
    # the loop over the experts, on the same kernels: the C call off
    loop = op_by_op(CpuKernelOps(LinearDispatch(kernel_max_rows=8, large="torch")))
    dp = kernels.avx512bf16_available()
    most = MOE_FUSED_ROWS_DP if dp else MOE_FUSED_ROWS
    g = torch.Generator().manual_seed(3)
    sizes = (1, 5, 7, 8, 13, MOE_FUSED_ROWS, MOE_FUSED_ROWS + 1, most)
    for rows in (*dict.fromkeys(sizes), most + 1):
        x = (torch.randn(rows, cfg.hidden_size, generator=g) * 2).bfloat16()
        with torch.no_grad():
            got = moe(x, fused)
            took = fused.took[-1]
            read = moe.last_experts
            want = moe(x, loop)
            assert read == moe.last_experts, rows
        assert torch.equal(got, want), rows
        assert took == (rows, rows <= most)


def test_a_row_routes_alike_on_every_cpu_kernel_path(tmp_path):
    """The fused call and SparseMoE's own loop share one routing (``pw_moe_route``): a
    scalar softmax and torch's vectorised one differ in the last bit, and a renormalised
    weight on a bf16 rounding midpoint carried that into a row's output (small inputs put
    routing probabilities near such midpoints). Every row count the call takes, at two
    threads, small and unit inputs: the same bits. A NaN logit still picks valid experts."""
    import torch

    from cpu_helpers import op_by_op
    from phasewise.model.cpu.linear import LinearDispatch
    from phasewise.model.cpu.ops import MOE_FUSED_ROWS, CpuKernelOps

    cfg, model = _bf16_model(tmp_path, "MixtralForCausalLM", seed=11, max_positions=64)
    moe = model.layers[0].moe
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fused = CpuKernelOps(LinearDispatch(kernel_max_rows=8, large="torch"))
        loop = op_by_op(CpuKernelOps(LinearDispatch(kernel_max_rows=8, large="torch")))
        g = torch.Generator().manual_seed(2)
        for scale in (0.01, 1.0):
            for rows in range(1, MOE_FUSED_ROWS + 1):
                x = (torch.randn(rows, cfg.hidden_size, generator=g) * scale).bfloat16()
                with torch.no_grad():
                    got, read = moe(x, fused), moe.last_experts
                    want = moe(x, loop)
                assert torch.equal(got, want) and read == moe.last_experts, (scale, rows)
    finally:
        torch.set_num_threads(threads)
    logits = torch.tensor([[0.5, float("nan"), 1.0, 0.25]]).bfloat16()
    weights, chosen = fused.moe_route(logits, 2, True)
    assert chosen.shape == (1, 2) and set(chosen[0].tolist()) <= set(range(4))
    assert len(set(chosen[0].tolist())) == 2
    weights, chosen = fused.moe_route(torch.empty(0, 4).bfloat16(), 2, True)  # no rows
    assert weights.shape == chosen.shape == (0, 2)
