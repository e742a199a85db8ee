"""The KV pool's size and the context length it allows (``phasewise.engine.kv_sizing``), as pure
arithmetic: no weights, no torch."""

from __future__ import annotations

import pytest

from phasewise.config import EngineConfig
from phasewise.engine.kv_sizing import DEFAULT_CPU_KV_MEMORY, KVPlan
from phasewise.model.config import ModelConfig
from phasewise.model.tiny import tiny_config

# 2 layers x 2 KV heads x head dim 16, K and V, fp32: 512 bytes a token, 8 KiB a 16-token block
MC = ModelConfig.from_dict(tiny_config(vocab_size=64, max_position_embeddings=1024))
BLOCK = MC.kv_bytes_per_token(4) * 16


def test_the_cpu_default_is_a_gibibyte_capped_by_what_the_sequences_could_use():
    plan = KVPlan.plan(EngineConfig(model="m", max_num_seqs=2), MC, BLOCK, "cpu")
    assert plan.most_blocks == 2 * (1024 // 16) + 1
    assert plan.num_blocks == plan.most_blocks < DEFAULT_CPU_KV_MEMORY // BLOCK
    assert plan.max_model_len == 1024


def test_a_budget_lowers_a_default_context_and_refuses_a_given_one():
    small = EngineConfig(model="m", kv_cache_memory=BLOCK * 10)
    plan = KVPlan.plan(small, MC, BLOCK, "cpu")
    assert (plan.num_blocks, plan.max_model_len) == (10, 10 * 16 - 1)
    with pytest.raises(ValueError, match="too few for max_model_len 512"):
        KVPlan.plan(EngineConfig(model="m", num_kv_blocks=10, max_model_len=512), MC, BLOCK,
                    "cpu")
    with pytest.raises(ValueError, match=f"holds no block of {BLOCK} bytes"):
        KVPlan.plan(EngineConfig(model="m", kv_cache_memory=BLOCK - 1), MC, BLOCK, "cpu")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        KVPlan.plan(EngineConfig(model="m", max_model_len=2048), MC, BLOCK, "cpu")


def test_a_block_longer_than_the_context_or_the_limit_is_refused():
    from phasewise.config import MAX_BLOCK_SIZE

    with pytest.raises(ValueError, match="block_size 64 exceeds the context length 32"):
        KVPlan.plan(EngineConfig(model="m", block_size=64, max_model_len=32), MC, BLOCK, "cpu")
    plan = KVPlan.plan(EngineConfig(model="m", block_size=32, max_model_len=32), MC, BLOCK, "cpu")
    assert plan.max_model_len == 32
    with pytest.raises(ValueError, match=f"block_size must be in 1..{MAX_BLOCK_SIZE}"):
        EngineConfig(model="m", block_size=MAX_BLOCK_SIZE + 1)
    # the default block under a shorter context: a little waste, not refused
    assert KVPlan.plan(EngineConfig(model="m", max_model_len=8), MC, BLOCK,
                       "cpu").max_model_len == 8


def test_cuda_without_a_budget_waits_for_the_memory_the_weights_leave():
    cfg = EngineConfig(model="m")
    plan = KVPlan.plan(cfg, MC, BLOCK, "cuda")
    assert plan.num_blocks is None and plan.max_model_len == 1024
    after = plan.on_free(BLOCK * 20, cfg, MC)  # 90% of it: 18 blocks
    assert (after.num_blocks, after.max_model_len) == (18, 18 * 16 - 1)
    assert after.on_free(BLOCK * 1000, cfg, MC) == after  # sized once
    sized = KVPlan.plan(EngineConfig(model="m", num_kv_blocks=7), MC, BLOCK, "cuda")
    assert sized.on_free(BLOCK * 1000, cfg, MC) == sized


def test_a_block_is_priced_alike_by_the_runner_and_by_the_simulator():
    """One function (``block_bytes``) prices a block for the engine (``ModelRunner``, from a
    torch dtype) and for the simulator (from a ``ModelShape``, torch-free)."""
    import torch

    from phasewise.engine.kv_sizing import block_bytes
    from phasewise.engine.model_runner import ModelRunner
    from phasewise.perf.models import ModelShape

    shape = ModelShape.from_hf_config(tiny_config(vocab_size=64, max_position_embeddings=1024))
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)):
        for bs in (1, 16, 32):
            engine = ModelRunner.bytes_per_block(MC, bs, dtype)
            assert engine == block_bytes(MC, bs, size) == block_bytes(shape, bs, size)
            assert engine == 2 * 2 * 2 * 16 * size * bs  # K and V, 2 layers, 2 KV heads, dim 16


def test_sizing_imports_no_torch():
    import subprocess
    import sys

    script = ("import sys; sys.modules['torch'] = None\n"
              "import phasewise.engine.kv_sizing, phasewise.perf.commands\n"
              "print('ok')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_pool_sized_past_the_free_host_memory_is_refused_naming_its_option():
    from phasewise.engine.kv_sizing import check_host_memory, host_memory_available

    big = EngineConfig(model="m", num_kv_blocks=10**8)  # 763 GiB of K/V
    plan = KVPlan.plan(big, MC, BLOCK, "cpu")
    with pytest.raises(ValueError, match=r"num_kv_blocks 100000000 .* at most 1000 blocks"):
        check_host_memory(plan, big, available=BLOCK * 1000)
    check_host_memory(plan, big, available=BLOCK * 10**8)  # fits exactly: no error
    mem = EngineConfig(model="m", kv_cache_memory="1TiB", max_num_seqs=10**6)
    with pytest.raises(ValueError, match=r"kv_cache_memory 1TiB"):
        check_host_memory(KVPlan.plan(mem, MC, BLOCK, "cpu"), mem, available=2**30)
    # the default is left to the engine (it never asks past DEFAULT_CPU_KV_MEMORY)
    default = EngineConfig(model="m")
    check_host_memory(KVPlan.plan(default, MC, BLOCK, "cpu"), default, available=1)
    assert host_memory_available() is None or host_memory_available() > 0
