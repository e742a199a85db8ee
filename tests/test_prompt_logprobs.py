"""Prompt logprobs (``SamplingParams.prompt_logprobs``) and ``max_tokens=0``: every prompt
position's log-probability matches HF transformers' (fp32), whatever the chunking, with the
prefix cache on (such requests compute their whole prompt), through preemption, and batched
with other requests."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCHS
from phasewise import LLM, SamplingParams
from phasewise.engine.validation import ValidationError

TOL = 1e-4  # fp32, the same math in another order


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: the distribution over each prompt token after the first."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def prompts_of(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def check_entries(entries, ref: torch.Tensor, ids: list[int], top_n: int) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for pos, entry in enumerate(entries[1:], start=1):
        row = ref[pos - 1]
        tok = ids[pos]
        assert abs(entry[tok] - float(row[tok])) < TOL, pos
        top = torch.topk(row, top_n)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < TOL, (pos, t)
        assert len(entry) in (top_n, top_n + 1)  # the top N, and the token if not among them


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_hf_across_chunks(hf_checkpoints, arch):
    path, hf = hf_checkpoints[arch]
    # a 16-token budget cuts the 70- and 45-token prompts into chunks that share steps
    llm = LLM(str(path), max_num_batched_tokens=16, dtype="float32")
    prompts = prompts_of(hf.config.vocab_size, [70, 45, 3], seed=3)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    outs = llm.generate(prompts, params)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in llm.step_stats)
    for ids, out in zip(prompts, outs):
        check_entries(out.prompt_logprobs, hf_prompt_logprobs(hf, ids), ids, 3)
        assert len(out.token_ids) == 2


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(hf_checkpoints):
    path, hf = hf_checkpoints["LlamaForCausalLM"]
    llm = LLM(str(path), dtype="float32", block_size=4)
    ids = prompts_of(hf.config.vocab_size, [40], seed=5)[0]
    warm = llm.generate([ids], SamplingParams(max_tokens=1))[0]
    assert warm.prompt_logprobs is None  # not asked for
    again = llm.generate([ids], SamplingParams(max_tokens=1))[0]
    assert again.metrics.num_cached_tokens >= 36  # the cache holds the prompt
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.metrics.num_cached_tokens == 0  # ... but this one computed it all
    check_entries(out.prompt_logprobs, hf_prompt_logprobs(hf, ids), ids, 0)


def test_prompt_logprobs_survive_preemption(hf_checkpoints):
    path, hf = hf_checkpoints["LlamaForCausalLM"]
    # 14 blocks of 4 tokens for three prompts of 20-24 tokens that generate 16 more each
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=14, max_model_len=48,
              max_num_batched_tokens=8)
    prompts = prompts_of(hf.config.vocab_size, [24, 22, 20], seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True,
                                                prompt_logprobs=1))
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for ids, out in zip(prompts, outs):
        check_entries(out.prompt_logprobs, hf_prompt_logprobs(hf, ids), ids, 1)


def test_max_tokens_zero_only_prefills(hf_checkpoints):
    path, hf = hf_checkpoints["Qwen2ForCausalLM"]
    llm = LLM(str(path), dtype="float32")
    ids = prompts_of(hf.config.vocab_size, [30], seed=1)[0]
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.finished and out.finish_reason == "length"
    assert out.token_ids == [] and out.text == ""
    check_entries(out.prompt_logprobs, hf_prompt_logprobs(hf, ids), ids, 2)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_the_option_is_checked():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValidationError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValidationError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
