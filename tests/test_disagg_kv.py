"""The K/V hand-off between a prefill engine and a decode engine, in one process: the decode
engine reserves blocks for the uncached tail, the prefill engine pushes each chunk's blocks
(as bytes, as they will cross the wire), then the first sampled token; decoding goes on
there. Greedy output must be identical to one co-located engine's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import ARCHS, collect
from phasewise import EngineConfig, SamplingParams
from phasewise.engine.engine import LLMEngine
from phasewise.engine.kv_bytes import dtype_name, kv_from_bytes, kv_to_bytes
from phasewise.engine.request import RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(41)]  # 41 tokens: 3 blocks of 16, one partial


def engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **kw))


def run(eng: LLMEngine) -> dict[str, list[int]]:
    """Step until idle; the final token ids of every request that finished."""
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def colocated(path, prompt, params=GREEDY, **kw) -> list[int]:
    eng = engine(path, **kw)
    eng.add_request(prompt, params, request_id="r")
    return run(eng)["r"]


def prefill_remote(prefill: LLMEngine, decode: LLMEngine, prompt, params, rid,
                   deliver=None) -> tuple[list, object]:
    """Reserve on ``decode``, compute on ``prefill``; returns (the chunks sent, the prefill
    worker's final output). ``deliver(i, chunk)`` may drop or reorder; default: all."""
    hit = decode.add_remote_request(prompt, params, request_id=rid)
    assert hit is not None
    chunks = []
    prefill.kv_sink = lambda r, first, end, data: chunks.append(
        (r, first, end, dtype_name(data.dtype), tuple(data.shape), kv_to_bytes(data)))
    first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    prefill.add_request(prompt, first, request_id=rid, export_kv_from=hit)
    final = run(prefill)
    for i, (r, start, _, dtype, shape, payload) in enumerate(chunks):
        if deliver is None or deliver(i, chunks):
            decode.load_remote_kv(r, start, kv_from_bytes(payload, dtype, shape))
    return chunks, final[rid]


def disaggregated(path, prompt, params=GREEDY, prefill_kw=None, decode_kw=None):
    p, d = engine(path, **(prefill_kw or {})), engine(path, **(decode_kw or {}))
    chunks, first = prefill_remote(p, d, prompt, params, "r")
    out = d.finish_remote_prefill("r", first[0])
    assert out.token_ids == [first[0]]
    return run(d)["r"], chunks, p, d


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_identical_to_colocated_serving(hf_checkpoints, arch):
    path = hf_checkpoints[arch][0]
    got, chunks, p, d = disaggregated(path, PROMPT)
    assert got == colocated(path, PROMPT)
    assert len(chunks) == 1 and chunks[0][1:3] == (0, len(PROMPT))  # one step, whole prompt
    assert d.kv.usage == 0 and p.kv.usage == 0  # both pools empty afterwards


def test_a_chunk_that_ends_inside_a_block_sends_that_block_once_it_is_full(llama_dir):
    kw = {"max_num_batched_tokens": 10}  # chunks end at 10, 20, 30, 40, 41
    got, chunks, _, _ = disaggregated(llama_dir, PROMPT, prefill_kw=kw)
    assert [(c[1], c[2]) for c in chunks] == [(0, 16), (16, 32), (32, 41)]
    assert got == colocated(llama_dir, PROMPT, **kw)


def test_seeded_sampling_and_stop_strings_match_colocated_serving(llama_dir):
    seeded = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=30, ignore_eos=True)
    got, _, _, _ = disaggregated(llama_dir, PROMPT, seeded)
    assert got == colocated(llama_dir, PROMPT, seeded)
    text = engine(llama_dir).tokenizer.decode(colocated(llama_dir, PROMPT))
    stop = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[text[6:9]])
    got, _, _, _ = disaggregated(llama_dir, PROMPT, stop)
    want = colocated(llama_dir, PROMPT, stop)
    assert got == want and len(want) < 20  # the stop string ended both early


def test_bf16_and_chunked_prefill_on_the_prefill_worker(tmp_path):
    from conftest import build_hf_checkpoint

    build_hf_checkpoint(tmp_path, "LlamaForCausalLM", dtype=torch.bfloat16, seed=11)
    kw = {"max_num_batched_tokens": 16}  # three prompt chunks; the co-located run alike
    got, chunks, _, _ = disaggregated(tmp_path, PROMPT, prefill_kw=kw)
    assert got == colocated(tmp_path, PROMPT, **kw)
    # Each chunk's full blocks, each block once; the last holds the prompt's end.
    assert [(c[1], c[2]) for c in chunks] == [(0, 16), (16, 32), (32, 41)]
    assert all(c[3] == "bfloat16" for c in chunks)


def test_prefix_hits_on_either_side_send_only_what_the_decode_worker_lacks(llama_dir):
    shared = PROMPT[:32]  # two full blocks
    other = shared + [9, 8, 7, 6, 5, 4, 3, 2, 1]
    p, d = engine(llama_dir), engine(llama_dir)
    # The decode worker served the shared prefix itself once; the prefill worker did too.
    d.add_request(PROMPT, GREEDY, request_id="warm-d")
    p.add_request(shared + [11, 12], GREEDY, request_id="warm-p")
    run(d), run(p)
    chunks, first = prefill_remote(p, d, other, GREEDY, "r")
    assert [c[1] for c in chunks] == [32]  # the decode worker's hit is not sent again
    d.finish_remote_prefill("r", first[0])
    assert run(d)["r"] == colocated(llama_dir, other)
    # A decode worker without the prefix gets every block, cached on the prefill side too.
    d2 = engine(llama_dir)
    chunks, first = prefill_remote(p, d2, other, GREEDY, "r2")
    assert [(c[1], c[2]) for c in chunks] == [(0, len(other))]
    d2.finish_remote_prefill("r2", first[0])
    assert run(d2)["r2"] == colocated(llama_dir, other)


def test_preemption_on_the_decode_worker_and_several_requests(llama_dir):
    prompts = [PROMPT, PROMPT[5:], PROMPT[::-1]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # 10 blocks of 16: three requests of ~40 + 40 tokens cannot all stay resident.
    p, d = engine(llama_dir), engine(llama_dir, num_kv_blocks=10, max_model_len=96)
    for i, prompt in enumerate(prompts):
        _, first = prefill_remote(p, d, prompt, params, f"r{i}")
        d.finish_remote_prefill(f"r{i}", first[0])
    got = run(d)
    assert d.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == colocated(llama_dir, prompt, params), i
    assert d.kv.usage == 0


def test_a_failed_remote_prefill_keeps_what_arrived_and_computes_the_rest(llama_dir):
    kw = {"max_num_batched_tokens": 16}
    p, d = engine(llama_dir, **kw), engine(llama_dir, **kw)
    # Only the first chunk arrives (say the prefill worker died after sending it).
    prefill_remote(p, d, PROMPT, GREEDY, "r", deliver=lambda i, chunks: i == 0)
    assert not d.remote_kv_complete("r")
    with pytest.raises(ValueError, match="cannot decode"):
        d.finish_remote_prefill("r", 5)
    assert d.fail_remote_prefill("r") == 16  # the first block's tokens are kept
    assert d.requests["r"].status is RequestStatus.RUNNING
    assert run(d)["r"] == colocated(llama_dir, PROMPT, **kw)
    assert d.kv.usage == 0


def test_bad_kv_is_refused_and_an_abort_frees_the_reserved_blocks(llama_dir):
    d = engine(llama_dir)
    assert d.add_remote_request(PROMPT, GREEDY, request_id="r") == 0
    assert d.kv.usage > 0 and not d.has_unfinished_requests()  # reserved, nothing to run
    block = d.runner.read_blocks([0])
    with pytest.raises(ValueError, match="multiple of the block size"):
        d.load_remote_kv("r", 3, block)
    with pytest.raises(ValueError, match="outside the prompt's blocks"):
        d.load_remote_kv("r", 48, block)  # the prompt has blocks 0..2
    with pytest.raises(ValueError, match="shape"):
        d.load_remote_kv("r", 0, block[:, :, :, :8])
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        d.load_remote_kv("nobody", 0, block)
    with pytest.raises(ValueError, match="needs"):
        kv_from_bytes(b"\0" * 10, "float32", (1, 2, 1, 16, 2, 16))
    with pytest.raises(ValueError, match="not an id"):
        d.finish_remote_prefill("r", 10**6)  # a token outside the vocabulary never lands
    assert d.abort_request("r") is not None
    assert d.kv.usage == 0 and not d.scheduler.remote


def test_two_async_engines_hand_off_through_typed_commands(llama_dir):
    """The same hand-off between two engine threads, every step a command that could cross
    a process boundary: the decode engine reserves (PromptSpec.remote), the prefill engine's
    kv_sink sends LoadRemoteKV as bytes, FinishRemotePrefill hands over the first token. A
    request whose K/V never comes is computed on the decode side when the prefill fails."""
    import asyncio

    from phasewise.engine.async_engine import AsyncEngine, PromptSpec

    want = colocated(llama_dir, PROMPT)
    decode = AsyncEngine(engine(llama_dir))

    def ship(rid, first, end, data):  # on the prefill engine's thread
        decode.load_remote_kv(rid, first, dtype_name(data.dtype), tuple(data.shape),
                              kv_to_bytes(data))

    prefill = AsyncEngine(engine(llama_dir, max_num_batched_tokens=16), kv_sink=ship)

    async def main():
        decode.start()
        prefill.start()
        try:
            group = await decode.add([PromptSpec(PROMPT, GREEDY, remote=True)], "r")
            assert group.remote_hits == [0]
            assert decode.snapshot.num_waiting_remote == 1
            first = replace(GREEDY, max_tokens=1)
            pre = await prefill.add([PromptSpec(PROMPT, first, export_kv_from=0)], "r")
            token = (await collect(pre))[0].token_ids[0]
            decode.finish_remote_prefill("r", token)
            assert (await collect(group))[0].token_ids == want

            lost = await decode.add([PromptSpec(PROMPT, GREEDY, remote=True)], "lost")
            decode.fail_remote_prefill("lost")  # say its prefill worker died: no K/V came
            assert (await collect(lost))[0].token_ids == want
            assert decode.engine.kv.usage == 0 and prefill.engine.kv.usage == 0
        finally:
            await asyncio.to_thread(decode.shutdown)
            await asyncio.to_thread(prefill.shutdown)

    asyncio.run(main())
