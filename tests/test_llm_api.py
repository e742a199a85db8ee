"""The offline API, per-request timestamps, per-step stats and admission errors."""

from __future__ import annotations

import pytest

from phasewise import LLM, EngineConfig, SamplingParams
from phasewise.cli import main
from phasewise.config import parse_memory


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_num_batched_tokens=32)


def test_generate_returns_outputs_in_input_order(llm):
    prompts = ["def a():", "x", "import sys\nprint(sys.argv)"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [3, 9, 5]
    assert [o.prompt for o in outs] == prompts
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    assert outs[1].prompt_token_ids == llm.tokenizer.encode("x")


def test_stream_deltas_add_up_to_the_final_output(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    final = llm.generate("for i in range(10):", params)[0]
    pieces = list(llm.stream("for i in range(10):", params))
    assert len(pieces) == 12
    assert "".join(p.delta_text for p in pieces) == final.text
    assert [t for p in pieces for t in p.delta_token_ids] == final.token_ids
    assert pieces[-1].finished and not any(p.finished for p in pieces[:-1])


def test_closing_a_stream_aborts_and_frees_blocks(llm):
    engine = llm.engine
    stream = llm.stream("while True:", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    next(stream)
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    stream.close()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_request_timestamps_are_ordered(llm):
    out = llm.generate("def g(y):", SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 6 and m.token_times == sorted(m.token_times)
    assert m.token_times[0] == m.first_token_time
    assert m.ttft >= 0 and m.queue_time >= 0 and len(m.itls) == 5


def test_step_stats_record_the_token_mix(llm):
    before = len(llm.step_stats)
    prompt = list(range(3, 83))  # 80 tokens, budget 32 -> chunks of 32, 32, 16
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps = llm.step_stats[before:]
    assert [s.num_prefill_tokens for s in steps] == [32, 32, 16, 0, 0, 0]
    assert [s.num_decode_tokens for s in steps] == [0, 0, 0, 1, 1, 1]
    assert all(s.duration_s > 0 and s.num_requests == 1 for s in steps)
    assert [s.index for s in steps] == sorted(s.index for s in steps)


def test_prompt_too_long_is_rejected_and_engine_keeps_serving(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=64)
    with pytest.raises(ValueError, match="65 tokens, more than max_model_len"):
        llm.generate(list(range(3, 68)))
    ok = llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(ok.token_ids) == 3


def test_rejected_prompt_in_a_batch_queues_nothing(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=64)
    with pytest.raises(ValueError):
        llm.generate(["fine", list(range(3, 100))])
    assert not llm.engine.has_unfinished_requests()


def test_bad_prompt_tokens_and_ids_are_refused(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"integers in \[0, {vocab}\); got {vocab}"):
        llm.generate([[1, vocab]])
    with pytest.raises(ValueError, match="string or a list of token ids"):
        llm.engine.add_request(3.5)
    rid = llm.engine.add_request("a", SamplingParams(max_tokens=1), request_id="dup")
    with pytest.raises(ValueError, match="'dup' is already in use"):
        llm.engine.add_request("b", request_id="dup")
    llm.engine.abort_request(rid)
    # what a caller passes by mistake is named, not a TypeError from deep inside
    with pytest.raises(ValueError, match="lone surrogate at position 2"):
        llm.generate("ab\ud800")
    with pytest.raises(TypeError, match="prompts must be a string, a list of token ids"):
        llm.generate(None)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams.*got dict"):
        llm.generate(["a"], {"max_tokens": 2})
    with pytest.raises(TypeError, match="must be a SamplingParams or None, got dict"):
        llm.engine.add_request("a", {"max_tokens": 2})
    assert not llm.engine.has_unfinished_requests()


def test_chat_template_renders_messages(llm):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_kv_pool_follows_memory_budget(llama_dir):
    small = LLM(str(llama_dir), kv_cache_memory="64KiB")
    per_block = 2 * 2 * 32 * 4 * 16  # layers * (k, v) * kv_size * fp32 bytes * block_size
    assert small.engine.kv.num_blocks == 65536 // per_block
    assert small.engine.max_model_len == small.engine.kv.num_blocks * 16 - 1
    with pytest.raises(ValueError, match="too few for max_model_len 512"):
        LLM(str(llama_dir), kv_cache_memory="64KiB", max_model_len=512)


@pytest.mark.parametrize("value,expected", [("4GiB", 4 << 30), ("512MiB", 512 << 20),
                                            ("2GB", 2 * 10**9), (1000, 1000), ("1.5k", 1500)])
def test_parse_memory(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize("kwargs,message", [
    ({"kv_cache_memory": "lots"}, "memory size must be bytes or a number with a unit"),
    ({"policy": "fifo"}, "policy must be one of chunked, prefill-first"),
    ({"block_size": 0}, "block_size must be an integer >= 1"),
    ({"device": "tpu"}, "device must be one of auto, cpu, cuda"),
])
def test_engine_config_errors_name_field_and_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="x", **kwargs)


def test_cli_make_tiny_then_generate(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "m"), "--vocab-size", "300"]) == 0
    assert (tmp_path / "m" / "tokenizer.json").exists()
    assert main(["generate", "--model", str(tmp_path / "m"), "def fib(n):",
                 "--max-tokens", "5", "--temperature", "0", "--no-roofline"]) == 0
    err = capsys.readouterr().err
    assert "[prefill]" in err and "[decode]   4 tokens," in err and "[roofline]" not in err
    assert main(["generate", "--model", str(tmp_path / "none"), "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_step_budget_defaults_to_256_tokens_on_cpu_and_can_be_set(llama_dir):
    default = LLM(str(llama_dir), device="cpu")
    assert default.engine.max_num_batched_tokens == 256
    assert default.engine.scheduler.config.max_num_batched_tokens == 256
    # A 500-token prompt is prefilled in chunks of at most 256 tokens.
    ids = [5 + i % 200 for i in range(500)]
    default.generate(ids, SamplingParams(max_tokens=1))
    prefill = [s.num_prefill_tokens for s in default.step_stats if s.num_prefill_tokens]
    assert prefill == [256, 244]
    assert LLM(str(llama_dir), max_num_batched_tokens=1000).engine.max_num_batched_tokens == 1000
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model=str(llama_dir), max_num_batched_tokens=0)


def test_one_sequence_pool_holds_a_full_length_request(llama_dir):
    # The pool is sized for every sequence at full length plus a block: with one sequence
    # and a context that is a whole number of blocks, the context is kept, not refused or
    # lowered by one.
    llm = LLM(str(llama_dir), max_num_seqs=1, max_model_len=64, block_size=16)
    assert llm.engine.max_model_len == 64
    assert llm.engine.kv.num_blocks * 16 >= 64 + 1
    out = llm.generate([5] * 60, SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_release_freed_heap_hands_retained_pages_back(tmp_path):
    """The engine trims the C heap after its start-up calibration. In a child process (its
    malloc thresholds are changed on purpose): a large block freed while a block above it
    holds the heap stays resident, until release_freed_heap hands its pages back."""
    import subprocess
    import sys

    script = """
import ctypes, sys
from phasewise.model.cpu.backend import release_freed_heap
libc = ctypes.CDLL(None)
if not hasattr(libc, "mallopt"):
    print("no-glibc"); sys.exit(0)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
# M_MMAP_THRESHOLD (at most 32 MiB before glibc 2.35) and M_TRIM_THRESHOLD: a 24 MiB block
# from the heap, which free() keeps
if not (libc.mallopt(-3, 32 << 20) and libc.mallopt(-1, 1 << 30)):
    print("no-glibc"); sys.exit(0)
def anon():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) // 1024
big = libc.malloc(24 << 20)
above = libc.malloc(1 << 20)
ctypes.memset(big, 1, 24 << 20)
before = anon()
libc.free(big)
kept = anon()
ok = release_freed_heap()
print(before, kept, anon(), ok)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    if out == ["no-glibc"]:
        pytest.skip("the C library has no mallopt/malloc_trim (not glibc), or refused them")
    before, kept, after, ok = int(out[0]), int(out[1]), int(out[2]), out[3]
    assert ok == "True"
    assert kept > before - 6  # free() alone kept the 24 MiB resident
    assert after < kept - 18  # the trim gave (nearly all of) it back


def test_engine_releases_the_heap_after_its_cpu_set_up(llama_dir, monkeypatch):
    """The CPU kernels' set-up (the plan, the packing) ends with release_freed_heap, once."""
    import phasewise.model.cpu.backend as backend_module
    from phasewise.model.cpu import kernels as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.KERNELS.reason}")
    calls = []
    monkeypatch.setattr(backend_module, "release_freed_heap", lambda: calls.append(1) or True)
    LLM(str(llama_dir), dtype="bfloat16")
    assert calls == [1]


def test_warm_up_runs_one_short_request_and_leaves_nothing_behind(llm):
    last = llm.step_stats[-1].index if llm.step_stats else -1
    llm.warm_up()
    assert llm.step_stats[-1].index > last  # it ran steps (the history is bounded: by index)
    assert llm.step_stats[-1].num_prefill_tokens + llm.step_stats[-1].num_decode_tokens > 0
    assert not llm.engine.has_unfinished_requests()


def test_a_stop_token_id_past_the_vocabulary_is_refused_offline_as_by_the_server():
    from phasewise.engine.validation import ValidationError

    llm = LLM()
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValidationError, match=rf"stop_token_ids must hold token ids: integers in "
                                              rf"\[0, {vocab}\); got {vocab}"):
        llm.generate(["x"], SamplingParams(max_tokens=2, stop_token_ids=[1, vocab]))
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1]))
    assert out.error is None


def test_an_output_cut_mid_character_shows_its_bytes_as_a_full_decode_does():
    """Two tokens of a four-byte character, then max_tokens: the text was "", the bytes lost;
    it is what decoding the output's ids gives (a replacement character)."""
    from phasewise.engine.structured import spec_json

    llm = LLM()
    for n in (2, 5):
        (out,) = llm.generate(["x"], SamplingParams(
            max_tokens=n, structured_output=spec_json("regex", "\U0001F600\U0001F600")))
        full = llm.engine.tokenizer.decode(out.token_ids)
        assert out.finish_reason == "length" and out.text == full and "\ufffd" in full, n
