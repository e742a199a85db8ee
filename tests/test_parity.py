"""Tier 3: parity with HF transformers on tiny random-weight checkpoints.

Greedy outputs must be identical (fp32) for every architecture, also when prompts are chunked,
mixed with decodes in one step, served from the prefix cache, or preempted and recomputed.
Logits must agree within a stated tolerance per dtype.
"""

from __future__ import annotations


import random

import pytest
import torch

from conftest import ARCHS, build_hf_checkpoint, hf_greedy
from phasewise import LLM, SamplingParams
from phasewise.engine.engine import LLMEngine
from phasewise.config import EngineConfig
from phasewise.model.attention import AttentionMetadata
from phasewise.model.cpu import kernels as cpu_kernels
from phasewise.model.linear_types import PanelLinear
from phasewise.model.config import ModelConfig
from phasewise.model.cpu.linear import LinearDispatch
from phasewise.model.cpu.ops import CpuKernelOps
from phasewise.model.loader import load_model

N_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


def random_prompts(vocab: int, lengths: list[int], seed: int = 0,
                   shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    pre = shared_prefix or []
    return [pre + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                  every: int = 3) -> dict[int, list[int]]:
    """Add one prompt every ``every`` steps, so prompt chunks share steps with decodes."""
    ids: dict[str, int] = {}
    done: dict[int, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % every == 0:
            i, p = pending.pop(0)
            ids[engine.add_request(p, params)] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        steps += 1
    return done


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_in_mixed_batches(hf_checkpoints, arch):
    path, hf = hf_checkpoints[arch]
    prompts = random_prompts(hf.config.vocab_size, [1, 9, 23, 61, 4])
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=16))
    got = run_staggered(engine, prompts, GREEDY)
    mixed_steps = [s for s in engine.step_stats if s.num_prefill_tokens and s.num_decode_tokens]
    assert mixed_steps, "the schedule never mixed prompt chunks with decodes"
    for i, p in enumerate(prompts):
        assert got[i] == hf_greedy(hf, p, N_NEW), f"prompt {i} (len {len(p)}) diverged"


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
@pytest.mark.parametrize("budget", [3, 8])
def test_greedy_matches_hf_with_tiny_chunks(hf_checkpoints, arch, budget):
    path, hf = hf_checkpoints[arch]
    prompts = random_prompts(hf.config.vocab_size, [17, 30], seed=budget)
    llm = LLM(str(path), max_num_batched_tokens=budget)
    outs = llm.generate(prompts, GREEDY)
    assert max(s.num_prefill_tokens for s in llm.step_stats) <= budget
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_matches_hf_with_prefix_cache_hits(hf_checkpoints, arch):
    path, hf = hf_checkpoints[arch]
    shared = random_prompts(hf.config.vocab_size, [40], seed=5)[0]
    prompts = random_prompts(hf.config.vocab_size, [3, 11, 0], seed=6, shared_prefix=shared)
    llm = LLM(str(path), block_size=8)
    first = llm.generate(prompts[0], GREEDY)[0]
    rest = llm.generate(prompts[1:], GREEDY)
    stats = llm.engine.kv.stats
    assert stats.prefix_hits >= 2 * 40 - 16  # the later prompts reuse the shared blocks
    assert all(o.metrics.num_cached_tokens >= 32 for o in rest)
    for p, o in zip(prompts, [first, *rest]):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_hf_across_preemption(hf_checkpoints, prefix_caching):
    path, hf = hf_checkpoints["LlamaForCausalLM"]
    prompts = random_prompts(hf.config.vocab_size, [20, 25, 30, 12], seed=3)
    # 16 blocks of 4 tokens = 64 slots; the four requests need ~190 together.
    llm = LLM(str(path), block_size=4, num_kv_blocks=16, max_model_len=63,
              enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert sum(s.num_preempted for s in llm.step_stats) > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)
    assert llm.engine.kv.num_free_blocks == 16


def test_prefill_first_policy_matches_hf(hf_checkpoints):
    path, hf = hf_checkpoints["Qwen2ForCausalLM"]
    prompts = random_prompts(hf.config.vocab_size, [5, 33, 14], seed=9)
    engine = LLMEngine(EngineConfig(model=str(path), policy="prefill-first", max_model_len=256))
    got = run_staggered(engine, prompts, GREEDY, every=2)
    assert not [s for s in engine.step_stats if s.num_prefill_tokens and s.num_decode_tokens]
    for i, p in enumerate(prompts):
        assert got[i] == hf_greedy(hf, p, N_NEW)


# -- logits ---------------------------------------------------------------------------------

# Max and mean |logit difference| allowed against HF, per dtype. fp32 may differ only by
# summation order (measured: 0). bf16 keeps 8 bits of mantissa and the two implementations
# round at different points (fused projections, kernels), so a few bf16 ulps at the logit
# scale (|logit| ~5, ulp 0.03) are expected: measured max 0.094, mean 0.013.
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.2}
LOGIT_MEAN_ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.03}


def our_logits(path, dtype: torch.dtype, ids: list[int], linear=None) -> torch.Tensor:
    cfg = ModelConfig.from_file(path)
    model = load_model(path, cfg, dtype=dtype, device=torch.device("cpu"), max_positions=256)
    if linear is not None:
        model.ops = CpuKernelOps(linear)
    n, bs = len(ids), 16
    nb = -(-n // bs)
    kv = [(torch.zeros(nb, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype),
           torch.zeros(nb, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype))
          for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build(chunk_lens=[n], context_lens=[0],
                                   block_tables=[list(range(nb))], block_size=bs,
                                   device=torch.device("cpu"))
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(n), kv, meta)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_close_to_hf(tmp_path, arch, dtype):
    hf = build_hf_checkpoint(tmp_path, arch, dtype=dtype, seed=11)
    ids = random_prompts(hf.config.vocab_size, [48], seed=2)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = our_logits(tmp_path, dtype, ids)
    diff = (ours - ref).abs()
    assert diff.max().item() <= LOGIT_ATOL[dtype], f"max |diff| {diff.max():.3g}"
    assert diff.mean().item() <= LOGIT_MEAN_ATOL[dtype], f"mean |diff| {diff.mean():.3g}"
    # And the comparison is not vacuous: logits are spread well beyond the tolerance.
    assert ref.std().item() > 5 * LOGIT_ATOL[dtype]


@pytest.mark.parametrize("plan", [(64, "upcast"), (0, "upcast"), (1, "torch"), (0, "gemm"),
                                  (0, "amx")],
                         ids=["kernel", "upcast", "kernel-b1", "gemm", "amx"])
def test_bf16_linear_plans_stay_within_tolerance(tmp_path, plan):
    """The CPU kernel ops, with every way of computing bf16 linears, keep HF parity."""
    if (plan[0] or plan[1] == "gemm") and cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason}")
    if plan[1] == "amx" and not cpu_kernels.amx_available():
        pytest.skip(f"AMX kernels unavailable: {cpu_kernels.KERNELS.amx_reason}")
    hf = build_hf_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype=torch.bfloat16, seed=13)
    ids = random_prompts(hf.config.vocab_size, [40], seed=8)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = our_logits(tmp_path, torch.bfloat16, ids, LinearDispatch(*plan))
    diff = (ours - ref).abs()
    assert diff.max().item() <= LOGIT_ATOL[torch.bfloat16]
    assert diff.mean().item() <= LOGIT_MEAN_ATOL[torch.bfloat16]


def test_logprobs_along_a_mixed_batch_match_hf(hf_checkpoints):
    """Raw logprobs reported per sampled position equal HF's log-softmax at that position."""
    path, hf = hf_checkpoints["Qwen3ForCausalLM"]
    prompts = random_prompts(hf.config.vocab_size, [6, 19], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    engine = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=8))
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    for rid, prompt in zip(ids, prompts):
        out = final[rid]
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert len(entry) == 5 or (len(entry) == 6 and tok not in row.topk(5).indices)
            for t, lp in entry.items():
                assert abs(lp - row[t].item()) < 1e-4
            assert set(row.topk(5).indices.tolist()) <= set(entry)


@pytest.mark.parametrize("over", [{}, {"vocab_size": 320, "tie_word_embeddings": True}])
def test_bf16_engine_with_cpu_kernels_tracks_hf(tmp_path, over):
    """A bf16 engine on the kernel ops (decode attention, fused norms, calibrated linears),
    through chunked prefill and decode, reports logprobs within the bf16 tolerance of HF;
    also with a tied table the LM head's panels take (a vocabulary % 16: lookups from the
    panels)."""
    hf = build_hf_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype=torch.bfloat16, seed=21,
                             **over)
    prompts = random_prompts(hf.config.vocab_size, [5, 30, 12], seed=12)
    llm = LLM(str(tmp_path), max_num_batched_tokens=16, device="cpu")  # the CPU kernels
    if cpu_kernels.load() is not None:
        assert isinstance(llm.engine.model.ops, CpuKernelOps)
    # the projections in panels: the kernel plan's rule where AVX512_BF16 runs without AMX
    if cpu_kernels.avx512bf16_available() and not cpu_kernels.amx_available():
        assert llm.engine.panels_reason == "" and llm.engine.model.ops.panels
        assert isinstance(llm.engine.model.layers[0].down_proj, PanelLinear)
        assert isinstance(llm.engine.model.lm_head_module, PanelLinear) == bool(over)
        # generate's [kernels] line and bench_engine's report say where the head runs
        plan = llm.engine.cpu_backend.describe()
        assert ("the LM head packed into panels" in plan) == bool(over)
        assert ("the LM head: " in plan) == (not over)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        for j, entry in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + j]
            for t, lp in entry.items():
                assert abs(lp - row[t].item()) <= LOGIT_ATOL[torch.bfloat16]
