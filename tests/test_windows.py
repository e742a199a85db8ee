"""Sliding-window attention served: Mistral (every layer windowed) and Qwen2 (the layers from
``max_window_layers`` on) give HF transformers' greedy output on tiny random-weight checkpoints
whose window is shorter than the prompts, in mixed batches of prompt chunks and decodes; each
attention path (torch's, the CPU kernels', the fused decode layer's, Triton's) reads only the
window; the blocks behind every layer's window go back to the pool, so a request longer than
the pool runs; prefix hits longer than the window, preemption, speculative decoding and the
P/D hand-off (which ships only the blocks decoding reads) stay exact."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_hf_checkpoint, hf_greedy, streamed_greedy_tokens
from phasewise import LLM
from phasewise.config import EngineConfig
from phasewise.engine.engine import LLMEngine
from phasewise.model.attention import AttentionMetadata, decode_attention_torch
from phasewise.model.cpu import kernels as cpu_kernels
from test_parity import GREEDY, N_NEW, random_prompts, run_staggered

WINDOW = 12


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """{name: (folder, HF model)}: Mistral windowed on both layers; Qwen2 on its second only
    (``max_window_layers`` 1), whose first layer reads the whole context."""
    out = {}
    for i, (name, arch, over) in enumerate([
            ("mistral", "MistralForCausalLM", {}),
            ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": True,
                                           "max_window_layers": 1})]):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, build_hf_checkpoint(path, arch, seed=30 + i,
                                               sliding_window=WINDOW, **over))
    return out


def naive_window(q, k_cache, v_cache, tables, lens, window, scale):
    """Decode attention in fp32, one row at a time: the keys ``len - window .. len - 1`` of
    its table, gathered one by one (nothing shared with the paths under test)."""
    bs, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // n_kv
    out = torch.empty(q.shape)
    for r, (table, n) in enumerate(zip(tables, lens)):
        pos = range(max(0, n - window) if window else 0, n)
        k = torch.stack([k_cache[table[p // bs], p % bs] for p in pos]).float()
        v = torch.stack([v_cache[table[p // bs], p % bs] for p in pos]).float()
        for h in range(q.shape[1]):
            w = torch.softmax(k[:, h // group] @ q[r, h].float() * scale, dim=0)
            out[r, h] = w @ v[:, h // group]
    return out


def holed_case(lens, window, bs=4, n_heads=4, n_kv=2, hd=32, dtype=torch.float32, seed=0):
    """Rows of ``lens`` keys whose blocks wholly behind their window are holes, which name a
    block of NaNs here (the engine names block 0, which also pads the tables, so it must stay
    finite): a path that read a hole would turn its row's output NaN."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // bs) for n in lens) + 2  # block 0 (padding) and the holes' last
    k_cache = torch.randn(blocks, bs, n_kv, hd, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, n_kv, hd, generator=g).to(dtype)
    hole = blocks - 1
    k_cache[hole] = v_cache[hole] = float("nan")
    ids = iter(torch.randperm(blocks - 2, generator=g).add(1).tolist())
    tables = []
    for n in lens:
        dead = max(0, n - window) // bs
        tables.append([hole if b < dead else next(ids) for b in range(-(-n // bs))])
    meta = AttentionMetadata.build(chunk_lens=[1] * len(lens), context_lens=[n - 1 for n in lens],
                                   block_tables=tables, block_size=bs,
                                   device=torch.device("cpu"))
    q = (torch.randn(len(lens), n_heads, hd, generator=g) * 3).to(dtype)
    return q, k_cache, v_cache, meta, tables


LENS = [1, 5, 12, 13, 16, 17, 40, 61]  # within, at and past a window of 12; block edges


@pytest.mark.parametrize("window", [1, 5, 12, 16])
def test_torch_decode_attention_reads_only_the_window(window):
    q, k, v, meta, tables = holed_case(LENS, window)
    got = decode_attention_torch(q, k, v, meta, 32**-0.5, window)
    want = naive_window(q, k, v, tables, LENS, window, 32**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the whole context differs wherever the window binds
    whole = naive_window(q, k.nan_to_num(), v.nan_to_num(), tables, LENS, None, 32**-0.5)
    binds = torch.tensor([n > window for n in LENS])
    assert not torch.allclose(whole[binds], want[binds], atol=1e-3)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize("window", [1, 5, 12, 33])
@pytest.mark.parametrize("n_heads,n_kv,hd", [(4, 2, 32), (14, 2, 64), (8, 8, 16)])
def test_cpu_kernel_decode_attention_reads_only_the_window(window, n_heads, n_kv, hd):
    """The C kernel (AVX2's, or AVX512_BF16's where the CPU has it; AMX's takes only whole
    contexts, so a row whose window binds leaves it) from the window's first key on."""
    from phasewise.model.cpu.linear import LinearDispatch
    from phasewise.model.cpu.ops import CpuKernelOps

    ops = CpuKernelOps(LinearDispatch(kernel_max_rows=8, large="torch"))
    q, k, v, meta, tables = holed_case(LENS, window, n_heads=n_heads, n_kv=n_kv, hd=hd,
                                       dtype=torch.bfloat16, seed=window)
    got = ops.decode_attention(q, k, v, meta, hd**-0.5, window)
    want = naive_window(q, k, v, tables, LENS, window, hd**-0.5)
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7)


def test_triton_decode_attention_reads_only_the_window():
    """Triton's kernel (through its interpreter), one program a row and split across many:
    the blocks from the one holding the window's first key on, the keys before it masked."""
    from phasewise.model import triton_ops

    for programs in (0, 10 ** 6):
        ops = triton_ops.TritonOps(decode_programs=programs)
        q, k, v, meta, tables = holed_case(LENS, 5, hd=16)
        got = ops.decode_attention(q, k, v, meta, 16**-0.5, 5)
        torch.testing.assert_close(got, naive_window(q, k, v, tables, LENS, 5, 16**-0.5),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels unavailable")
def test_the_fused_decode_layers_read_only_the_window(windowed):
    """The whole decode stack in one C call (each layer's window in its arguments) computes
    what torch's op-by-op path computes with the window, and not what it computes without."""
    from phasewise.model.config import ModelConfig
    from phasewise.model.cpu.linear import LinearDispatch
    from phasewise.model.cpu.ops import CpuKernelOps
    from phasewise.model.loader import load_model
    from phasewise.model.ops import TorchOps

    path = windowed["mistral"][0]
    cfg = ModelConfig.from_file(path)
    model = load_model(path, cfg, dtype=torch.bfloat16, device=torch.device("cpu"),
                       max_positions=128)
    assert [layer.window for layer in model.layers] == [WINDOW, WINDOW]
    lens = [3, 13, 30]
    _, k, v, meta, _ = holed_case(lens, WINDOW, n_heads=4, n_kv=2, hd=16,
                                  dtype=torch.bfloat16, seed=7)
    caches = [(k.clone(), v.clone()) for _ in model.layers]
    for kc, vc in caches:  # the holes' block finite here, so only the window decides
        kc[-1], vc[-1] = 0.1, -0.1
    ids = torch.tensor([5, 6, 7])
    pos = torch.tensor([n - 1 for n in lens])

    def run(ops, windows=(WINDOW, WINDOW)):
        for layer, w in zip(model.layers, windows):
            layer.window = w
        model.ops = ops
        with torch.no_grad():
            return model(ids, pos, [(a.clone(), b.clone()) for a, b in caches], meta).float()

    fused_ops = CpuKernelOps(LinearDispatch(kernel_max_rows=8, large="torch"))
    fused = run(fused_ops)
    assert fused_ops._stack is not None  # the one-call stack ran
    ref = run(TorchOps())
    torch.testing.assert_close(fused, ref, rtol=0.03, atol=0.03)
    whole = run(TorchOps(), (None, None))
    assert (whole[1:] - ref[1:]).abs().max() > 0.1  # rows past the window: it matters


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_greedy_matches_hf_in_mixed_batches(windowed, name):
    path, hf = windowed[name]
    prompts = random_prompts(hf.config.vocab_size, [1, 9, 23, 61, 4, 30], seed=3)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=16, block_size=4))
    got = run_staggered(engine, prompts, GREEDY)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.step_stats)
    for i, p in enumerate(prompts):
        assert got[i] == hf_greedy(hf, p, N_NEW), f"prompt {i} (len {len(p)}) diverged"
    # every layer windowed: blocks go back; one layer reading everything: none may
    assert engine.kv.window == (WINDOW if name == "mistral" else None)
    assert engine.kv.usage == 0


def test_a_request_holds_only_its_windows_blocks_and_outgrows_the_pool(windowed):
    """Ten blocks of 4 hold 40 tokens; a 61-token prompt and 32 outputs run in them, its
    table's head given back as it goes, and its output is HF's. A model with a layer that
    reads the whole context refuses the same prompt in the same pool."""
    path, hf = windowed["mistral"]
    prompt = random_prompts(hf.config.vocab_size, [61], seed=8)[0]
    engine = LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=10,
                                    max_num_batched_tokens=8, max_model_len=200))
    assert engine.max_model_len == 200  # more than the pool: each sequence needs its window
    rid = engine.add_request(prompt, GREEDY)
    held, spans, out = [], [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        if not out or not out.finished:
            held.append(engine.kv.held_blocks(rid))
            spans.append(len(engine.kv.block_table(rid)))
    assert out.token_ids == hf_greedy(hf, prompt, N_NEW)
    # a window of 12 and a chunk of 8 span at most 5 blocks of 4, of a table of 23
    assert max(held) <= 5 and max(spans) == -(-(61 + N_NEW - 1) // 4)
    assert engine.kv.usage == 0
    with pytest.raises(ValueError, match="its 12-token sliding window needs 4 blocks at once"):
        LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=3,
                               max_model_len=200))
    qwen2 = windowed["qwen2"][0]
    with pytest.raises(ValueError, match="too few for max_model_len 200"):
        LLMEngine(EngineConfig(model=str(qwen2), block_size=4, num_kv_blocks=10,
                               max_model_len=200))


def test_prefill_first_chunks_a_prompt_the_pool_holds_only_a_window_of(windowed):
    """prefill-first runs whole prompts, but a 61-token prompt never fits ten blocks of 4 at
    once although its window does: it runs in chunks instead of waiting forever (and holding
    back the prompt queued behind it), and both outputs are HF's."""
    path, hf = windowed["mistral"]
    long, short = random_prompts(hf.config.vocab_size, [61, 9], seed=12)
    engine = LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=10,
                                    max_model_len=200, policy="prefill-first"))
    ids = [engine.add_request(p, GREEDY) for p in (long, short)]
    out = {}
    for _ in range(500):  # far more steps than two requests of 16 tokens need
        if not engine.has_unfinished_requests():
            break
        out.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert out == {ids[0]: hf_greedy(hf, long, N_NEW), ids[1]: hf_greedy(hf, short, N_NEW)}
    assert engine.kv.usage == 0


def test_a_prefix_hit_longer_than_the_window_is_exact(windowed):
    """A prompt whose first 44 tokens are cached: the hit counts all of them, the request
    takes only the blocks its window reads, and its output is HF's."""
    path, hf = windowed["mistral"]
    shared = random_prompts(hf.config.vocab_size, [44], seed=5)[0]
    a, b = random_prompts(hf.config.vocab_size, [3, 9], seed=6, shared_prefix=shared)
    engine = LLMEngine(EngineConfig(model=str(path), block_size=4))
    engine.add_request(a, GREEDY, request_id="a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(b, GREEDY, request_id="b")
    outs = []
    first = True
    while engine.has_unfinished_requests():
        outs += engine.step()
        if first:  # after its first step: its window's blocks and the chunk's, no more
            assert engine.kv.held_blocks("b") <= -(-WINDOW // 4) + 1 + -(-9 // 4)
            first = False
    out = [o for o in outs if o.finished][0]
    assert out.metrics.num_cached_tokens == 44 > WINDOW
    assert out.token_ids == hf_greedy(hf, b, N_NEW)


def test_preemption_and_speculative_decoding_stay_exact(windowed):
    path, hf = windowed["mistral"]
    prompts = random_prompts(hf.config.vocab_size, [20, 25, 30, 12], seed=3)
    llm = LLM(str(path), block_size=4, num_kv_blocks=12, max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)
    # drafts from the prompt's n-grams: a repetitive prompt accepts some
    rep = prompts[0][:6] * 6
    spec = LLM(str(path), block_size=4, speculative="ngram", num_speculative_tokens=3)
    out = spec.generate(rep, GREEDY)[0]
    assert spec.engine.spec_stats.proposed > 0
    assert out.token_ids == hf_greedy(hf, rep, N_NEW)


def test_pd_ships_only_the_blocks_decoding_reads(windowed):
    """The decode engine reserves, and the prefill engine sends, only the blocks from the one
    holding the first key of the first decode's window: greedy output as co-located; and
    where the hand-off fails half way, the decode engine starts the prompt over (it holds no
    block behind the window) and still gives the same output."""
    from test_disagg_kv import GREEDY as FIRST_20
    from test_disagg_kv import colocated, disaggregated, engine, prefill_remote, run

    path = windowed["mistral"][0]
    prompt = [(7 * i + 3) % 250 + 1 for i in range(41)]
    kw = {"block_size": 4, "max_num_batched_tokens": 16}
    got, chunks, p, d = disaggregated(path, prompt, prefill_kw=kw, decode_kw=kw)
    assert got == colocated(path, prompt, **kw)
    behind = (41 - WINDOW + 1) // 4 * 4  # 28: blocks 0-6 are behind the window of token 41
    assert min(c[1] for c in chunks) == behind and max(c[2] for c in chunks) == 41
    assert d.kv.usage == 0 and p.kv.usage == 0
    # the decode engine holds the window's blocks it received, which a window's hit needs
    assert d.add_remote_request(prompt, FIRST_20, request_id="again") == 40
    d.abort_request("again")

    pf, dc = engine(path, **kw), engine(path, **kw)
    chunks, _ = prefill_remote(pf, dc, prompt, FIRST_20, "r", deliver=lambda i, cs: i == 0)
    assert len(chunks) > 1
    assert dc.kv.first_held_block("r") == behind // 4
    dc.fail_remote_prefill("r")
    assert dc.kv.block_table("r") == []  # back in the queue, to start over
    assert run(dc)["r"] == colocated(path, prompt, **kw)


def test_served_a_tiny_windowed_model_streams_hf_greedy(windowed):
    import asyncio

    import httpx

    from phasewise.engine.async_engine import AsyncEngine
    from phasewise.server.app import OpenAIServer, ServerConfig

    path, hf = windowed["mistral"]
    engine = AsyncEngine.from_config(EngineConfig(model=str(path), block_size=4))
    server = OpenAIServer(engine, ServerConfig(served_model_name="win"))
    prompt = random_prompts(hf.config.vocab_size, [40], seed=9)[0]

    async def run():
        engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s",
                                     timeout=60) as c:
            ids = await streamed_greedy_tokens(c, prompt, 20)
            assert ids == [server.routes._token_text(t) for t in hf_greedy(hf, prompt, 20)]
            chat = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi " * 30}], "max_tokens": 4})
            assert chat.status_code == 200
            assert chat.json()["usage"]["prompt_tokens"] > WINDOW
            # a router learns the window, so it expects the hits this worker will find
            info = (await c.get("/internal/v1/info")).json()
            assert (info["kv_window"], info["kv_block_size"]) == (WINDOW, 4)
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


@pytest.mark.parametrize("over,want", [
    ({"sliding_window": 8}, (8, 8)),  # Mistral: every layer
    ({"sliding_window": None}, (None, None)),
])
def test_the_config_says_which_layers_are_windowed(tmp_path, over, want):
    from phasewise.model.config import ModelConfig, layer_windows

    build_hf_checkpoint(tmp_path, "MistralForCausalLM", **over)
    assert ModelConfig.from_file(tmp_path).layer_windows == want
    base = {"sliding_window": 16, "num_hidden_layers": 4}
    qwen = {**base, "use_sliding_window": True, "max_window_layers": 1}
    assert layer_windows("Qwen2ForCausalLM", qwen, 4) == (None, 16, 16, 16)
    assert layer_windows("Qwen2MoeForCausalLM", {**qwen, "max_window_layers": 3}, 4) == (
        16, None, 16, None)  # transformers' default for Qwen2-MoE: every other layer below
    assert layer_windows("Qwen3MoeForCausalLM", qwen, 4) == (16,) * 4
    assert layer_windows("Qwen2ForCausalLM", {**qwen, "use_sliding_window": False}, 4) == (
        None,) * 4
    assert layer_windows("LlamaForCausalLM", base, 4) == (None,) * 4
    types = {**qwen, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert layer_windows("Qwen3ForCausalLM", types, 4) == (16, None, 16, None)
    with pytest.raises(ValueError, match="layer_types must list"):
        layer_windows("Qwen3ForCausalLM", {**types, "layer_types": ["local"] * 4}, 4)


@pytest.mark.parametrize("arch,over,field", [
    ("MistralForCausalLM", {"sliding_window": "12"}, "sliding_window"),
    ("MistralForCausalLM", {"sliding_window": 12.5}, "sliding_window"),
    ("MistralForCausalLM", {"sliding_window": True}, "sliding_window"),
    ("MixtralForCausalLM", {"sliding_window": 0}, "sliding_window"),
    ("MixtralForCausalLM", {"sliding_window": -1}, "sliding_window"),
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": "yes"},
     "use_sliding_window"),
    ("Qwen2ForCausalLM", {"sliding_window": "abc", "use_sliding_window": True},
     "sliding_window"),
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": True,
                          "layer_types": None, "max_window_layers": "x"}, "max_window_layers"),
    ("Qwen3ForCausalLM", {"sliding_window": 8, "use_sliding_window": True,
                          "layer_types": "sliding_attention"}, "layer_types"),
])
def test_a_malformed_window_is_refused_at_load_not_served_as_full_attention(
        tmp_path, arch, over, field):
    """A window field phasewise cannot read would otherwise mean no window: the checkpoint
    served as full attention, a different model. It is refused by the field and value."""
    from phasewise.model.config import ModelConfig

    build_hf_checkpoint(tmp_path, arch, sliding_window=8)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **over}))
    with pytest.raises(ValueError, match=f"config.json: {field} must") as e:
        ModelConfig.from_file(tmp_path)
    assert repr(over[field]) in str(e.value)


def test_a_window_a_checkpoint_turns_off_is_not_read():
    """Qwen2's sliding_window is ignored while use_sliding_window is false, as transformers
    ignores it; whatever it holds then changes nothing."""
    from phasewise.model.config import layer_windows

    off = {"use_sliding_window": False, "sliding_window": "anything"}
    assert layer_windows("Qwen2ForCausalLM", off, 2) == (None, None)


def test_each_step_and_generate_say_where_kv_reads_stopped_growing(windowed, llama_dir):
    """A decode's K/V reads, counted per step (``StepStats.kv_read``: the window on a
    windowed layer, the whole context on the others), on the dashboard's feed, and in
    ``generate``'s ``[window]`` line; none for a model without a window."""
    from phasewise.engine.backend import EngineSnapshot
    from phasewise.generate import window_line
    from phasewise.server.dashboard.feed import DashboardFeed

    for name, read_at_60 in (("mistral", WINDOW), ("qwen2", (60 + WINDOW) / 2)):
        path, hf = windowed[name]
        llm = LLM(str(path), block_size=4)
        llm.generate(random_prompts(hf.config.vocab_size, [40], seed=2), GREEDY)
        steps = list(llm.engine.step_stats)
        decodes = [s for s in steps if s.num_decode_tokens and not s.num_prefill_tokens]
        at_60 = [s for s in decodes if s.kv_context == 60]
        assert at_60 and at_60[0].kv_read == read_at_60
        inside = [s for s in decodes if s.kv_context <= WINDOW]
        assert all(s.kv_read == s.kv_context for s in inside)
        line = window_line(llm.engine, steps)
        assert line.startswith(f"[window]   {WINDOW}-token sliding window")
        assert f"the K/V of {WINDOW} of its {40 + N_NEW - 1} positions" in line
        assert ("went back to the pool" in line) == (name == "mistral")
        assert ("the others' grow with the context" in line) == (name == "qwen2")
        feed = DashboardFeed(model_name="m")
        snap = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0)
        for s in steps:
            feed.on_step(s, [], [], snap)
        hello = feed.hello()
        cols = [hello["step_fields"].index(f) for f in ("kv_context", "kv_read")]
        assert [[r[c] for c in cols] for r in hello["steps"]] == [
            [s.kv_context, None if s.kv_read is None else round(s.kv_read, 7)] for s in steps]
    dense = LLM(str(llama_dir))
    dense.generate([[5, 6, 7]], GREEDY)
    steps = list(dense.engine.step_stats)
    assert all(s.kv_read is None for s in steps) and window_line(dense.engine, steps) is None


def test_make_tiny_writes_a_windowed_checkpoint_hf_reads_alike(tmp_path):
    """``make-tiny --sliding-window``: every layer windowed, as transformers reads the config
    too (a Qwen2-MoE, whose default would window every other layer below max_window_layers);
    greedy output past the window is HF's."""
    import transformers

    from phasewise.cli import main
    from phasewise.model.config import ModelConfig

    assert main(["make-tiny", str(tmp_path), "--arch", "Qwen2MoeForCausalLM",
                 "--sliding-window", "8"]) == 0
    assert ModelConfig.from_file(tmp_path).layer_windows == (8, 8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    prompt = random_prompts(hf.config.vocab_size, [20], seed=1)[0]
    out = LLM(str(tmp_path), dtype="float32").generate(prompt, GREEDY)[0]
    assert out.token_ids == hf_greedy(hf, prompt, N_NEW)
    assert main(["make-tiny", str(tmp_path / "x"), "--sliding-window", "8"]) == 2  # Llama


def test_a_prefix_hit_needs_only_the_blocks_its_window_reads():
    """Under a window, a cached prefix whose first blocks were evicted (or never held: a
    decode worker receives only the window's) is still a hit where the blocks its next
    query reads are cached; without a window the chain from block 0 is needed. A router's
    index of the worker's blocks expects the same hit from the same hashes."""
    from phasewise.cache.manager import KVCacheManager
    from phasewise.disagg.prefix_index import WorkerBlocks, block_hashes
    from phasewise.engine.request import Request

    def request(rid):
        return Request(request_id=rid, prompt_token_ids=list(range(10, 50)),  # 10 blocks of 4
                       params=GREEDY, eos_token_ids=(), arrival_time=0.0)

    for window, want in ((8, 36), (None, 0)):
        kv = KVCacheManager(10, 4, window=window)
        a = request("a")
        assert kv.allocate_slots(a, 40)
        a.num_computed_tokens = 40
        kv.cache_blocks(a)
        head = [kv.pool.blocks[i] for i in kv.block_table("a")]
        kv.free(a)
        kv.pool.touch(head[2:])  # the rest used again, so the prompt's blocks 0 and 1 are
        kv.pool.free(head[2:])   # the freed longest ago: the next allocation evicts them
        kv.pool.allocate(2)
        assert head[0].block_hash is None and head[2].block_hash is not None
        hit = kv.get_computed_blocks(request("b"))
        assert hit.num_tokens == want
        index = WorkerBlocks()  # as the worker's reports leave it: the hashes it holds
        index.report(kv.pool.events.since(None, None))
        hashes = block_hashes(request("c").prompt_token_ids, 4)
        assert index.held(hashes, 4, window) * 4 == want
        if window:  # the blocks a query at 36 reads (from 29 on: blocks 7 and 8), held
            lo = kv.dead_blocks(want)
            assert lo == 7 and hit.blocks[:lo] == [None] * lo
            assert hit.blocks[lo:] == head[lo:9]
