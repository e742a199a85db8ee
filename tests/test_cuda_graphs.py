"""Decode steps through CUDA graphs' padded static buffers (``phasewise.engine.cuda_graphs``),
and ``load_format="dummy"``.

Capture needs a GPU, but the padding does not: ``decode_graphs="padded"`` runs the very
buffers, scratch block and in-graph mask a captured graph replays, eagerly. Its greedy tokens
must equal the eager path's, for batches that pad, contexts that cross a table-width bucket,
and speculative verify rows. ``benchmarks/bench_cuda.py`` runs the captured graphs on a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import padded

from phasewise import LLM, SamplingParams
from phasewise.config import EngineConfig
from phasewise.engine.cuda_graphs import (
    BATCH_BUCKETS,
    MAX_GRAPH_KEYS,
    MIN_TABLE_BLOCKS,
    DecodeGraphs,
    batch_bucket,
    table_bucket,
)


def test_buckets_hold_their_rows_and_blocks():
    for n in range(1, BATCH_BUCKETS[-1] + 1):
        b = batch_bucket(n)
        assert b is not None and b >= n
        assert b == min(x for x in BATCH_BUCKETS if x >= n)
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    for blocks in range(1, 300):
        w = table_bucket(blocks)
        assert w >= max(blocks, MIN_TABLE_BLOCKS)
        assert w == MIN_TABLE_BLOCKS or w < 2 * blocks  # the next power of two, no wider


def prompts(llm: LLM, lengths: list[int]) -> list[list[int]]:
    text = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 40
    ids = [t for t in llm.tokenizer.encode(text) if t != 0]  # no padded row's token 0
    return [ids[i:i + n] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_padded_decode_steps_give_the_eager_tokens(llama_dir, kernels):
    # 3 and 5 requests pad to buckets 4 and 8; the longest runs from 240 to 280 tokens, past
    # 256 = MIN_TABLE_BLOCKS blocks of 16, so its steps change table width mid-run. A short
    # prompt comes first and takes the pool's first block, where a padded row that wrote
    # outside the scratch block would land.
    lengths = [3, 240, 7, 33, 100]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", kernels=kernels, max_model_len=512, block_size=16)
    eager = LLM(str(llama_dir), **kw)
    graphs = padded(LLM(str(llama_dir), **kw))
    for batch in (lengths[:3], lengths):
        ps = prompts(eager, batch)
        want = [o.token_ids for o in eager.generate(ps, params)]
        before = graphs.engine.runner.graphs.replays
        got = [o.token_ids for o in graphs.generate(ps, params)]
        assert got == want
        assert graphs.engine.runner.graphs.replays - before >= 30  # decode steps took it


def test_padded_verify_rows_keep_greedy_output(llama_dir):
    # Speculative verifies are decode rows too (1 + drafts per request): through the padded
    # buffers, greedy output must stay what plain decoding gives.
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    kw = dict(dtype="float32", kernels="torch", max_model_len=512)
    plain = LLM(str(llama_dir), **kw)
    ps = prompts(plain, [60, 90])
    want = [o.token_ids for o in plain.generate(ps, params)]
    spec = padded(LLM(str(llama_dir), speculative="ngram", **kw))
    got = [o.token_ids for o in spec.generate(ps, params)]
    assert got == want
    assert spec.engine.spec_stats.proposed > 0
    assert spec.engine.runner.graphs.replays > 0


def test_steps_past_the_buckets_run_eagerly(llama_dir):
    llm = padded(LLM(str(llama_dir), dtype="float32", kernels="torch", max_model_len=512))
    graphs = llm.engine.runner.graphs
    assert graphs.bucket(BATCH_BUCKETS[-1] + 1, 1) is None  # too many rows
    assert graphs.bucket(1, graphs.max_width + 1) is None  # past max_model_len's blocks
    b, w = graphs.bucket(3, 17)
    assert (b, w) == (4, 32)
    # Too many padded keys, where the decode attention copies each row's padded context:
    # 48 rows of 512-block tables. A kernel that walks the tables (the Triton one) says so,
    # and keeps the graph.
    wide = DecodeGraphs(llm.engine.model, llm.engine.runner.kv_caches, block_size=16,
                        max_blocks=512, scratch_block=0, device=torch.device("cpu"),
                        capture=False)
    assert 48 * 512 * 16 > MAX_GRAPH_KEYS >= 32 * 512 * 16
    assert wide.bucket(32, 512) == (32, 512)
    assert wide.bucket(40, 512) is None
    llm.engine.model.ops.decode_attention_gathers = False
    assert wide.bucket(40, 512) == (48, 512)


def dummy_folder(tmp_path, llama_dir, **over):
    """A folder with the checkpoint's config.json and tokenizer, and no weights."""
    out = tmp_path / "dummy"
    out.mkdir(exist_ok=True)
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg.update(over)
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (llama_dir / name).exists():
            (out / name).write_text((llama_dir / name).read_text())
    return out


def test_dummy_weights_need_no_weight_files_and_follow_the_seed(tmp_path, llama_dir):
    folder = dummy_folder(tmp_path, llama_dir)
    with pytest.raises(FileNotFoundError, match="safetensors.*--load-format dummy"):
        LLM(str(folder), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for seed in (0, 0, 1):
        llm = LLM(str(folder), dtype="float32", load_format="dummy", seed=seed)
        model = llm.engine.model
        w = model.layers[0].qkv_proj.weight
        assert torch.isfinite(w).all() and 0.01 < w.std().item() < 0.03
        assert (model.norm.weight - 1).abs().max().item() < 1.0
        out = llm.generate([5, 6, 7, 8], params)[0].token_ids
        runs.setdefault(seed, []).append((out, w.clone()))
    (out0, w0), (out0b, w0b) = runs[0]
    assert out0 == out0b and torch.equal(w0, w0b)
    assert not torch.equal(runs[1][0][1], w0)


def test_dummy_weights_take_the_int8_path(tmp_path, llama_dir):
    folder = dummy_folder(tmp_path, llama_dir)
    llm = LLM(str(folder), dtype="bfloat16", load_format="dummy", quantization="int8")
    assert llm.engine.model.layers[0].gate_up_proj.weight.dtype == torch.int8
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4,
                                                 ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_load_format_and_enforce_eager_are_checked():
    with pytest.raises(ValueError, match="load_format must be one of safetensors, dummy"):
        EngineConfig(model="x", load_format="pt")
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        EngineConfig(model="x", enforce_eager="yes")


def test_eager_cpu_engines_build_no_graphs(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32")
    assert llm.engine.runner.graphs is None
    assert llm.engine.runner.kv_cache.shape[2] == llm.engine.kv.num_blocks
