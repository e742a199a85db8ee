"""Batch invariance of greedy decoding in float32 (see the README's Numerics section)."""

from __future__ import annotations

import random

from phasewise import LLM, SamplingParams


def test_fp32_greedy_output_is_the_same_alone_and_in_a_batch_of_16(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=64,
              enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(7)
    target = [rng.randrange(3, vocab) for _ in range(21)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(16)]
    assert len({tuple(p) for p in others + [target]}) == 17  # all different
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    alone = llm.generate(target, params)[0].token_ids
    batched = llm.generate(others[:8] + [target] + others[8:], params)
    assert batched[8].token_ids == alone
    # the batch really mixed: some steps held several requests, prompt chunks beside decodes
    steps = llm.step_stats
    assert max(s.num_requests for s in steps) == 17
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps)
    # and every other prompt, too, matches its own run alone
    for prompt, out in zip(others[:8] + [target] + others[8:], batched):
        assert llm.generate(prompt, params)[0].token_ids == out.token_ids
    assert len(alone) == 24
