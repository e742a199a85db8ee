"""``phasewise serve --role decode`` and ``--role prefill`` as two real processes on
127.0.0.1: the official openai client streams from the decode worker, whose prompts the
prefill worker computes over the authenticated K/V port."""

from __future__ import annotations

import signal

import openai

from conftest import build_hf_checkpoint
from phasewise import LLM, SamplingParams
from serving import free_port, start_server

PROMPT = "def fibonacci(n):"


def test_a_prefill_and_a_decode_worker_serve_the_openai_client(tmp_path):
    model = tmp_path / "model"
    build_hf_checkpoint(model, "LlamaForCausalLM", seed=2, max_position_embeddings=512)
    secret = tmp_path / "kv.secret"
    secret.write_bytes(b"a-shared-secret-for-the-kv-port\n")
    kv = f"tcp://127.0.0.1:{free_port()}"
    decode = start_server(model, tmp_path / "decode.log", "--role", "decode", "--kv-bind", kv,
                          "--kv-secret-file", str(secret), "--served-model-name", "m",
                          "--log-interval", "0")
    prefill = None
    try:
        prefill = start_server(model, tmp_path / "prefill.log", "--role", "prefill",
                               "--kv-connect", kv, "--kv-secret-file", str(secret),
                               "--log-interval", "0")
        want = LLM(str(model)).generate(PROMPT, SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True))[0].text
        before = prefill.metrics()
        client = openai.OpenAI(base_url=decode.url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=24,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == want
        after = prefill.wait_idle()
        key = ("phasewise:step_tokens_total", (("phase", "prefill"),))
        # The prompt was computed on the prefill worker, not on the decode worker.
        n_prompt = len(LLM(str(model)).tokenizer.encode(PROMPT))
        assert after[key] - before.get(key, 0) == n_prompt
        assert decode.wait_idle()[key] == 0
        assert "K/V port" in decode.log() and "connected to the decode" in prefill.log()

        # SIGKILL the prefill worker: the next request, sent to it before its silence is
        # noticed, is failed when its heartbeats stop, and the decode worker computes it.
        prefill.stop(signal.SIGKILL)
        got = client.completions.create(model="m", prompt=PROMPT, max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
        after_kill = decode.wait_idle()
        assert after_kill[key] == n_prompt  # computed here this time
        assert after_kill[("phasewise:kv_cache_usage_perc", ())] == 0
        assert "computing it here" in decode.log()
        outcomes = {o: after_kill.get(("phasewise:remote_prefills_total", (("outcome", o),)))
                    for o in ("done", "failed")}
        assert outcomes == {"done": 1, "failed": 1}
        assert after_kill[("phasewise:remote_prefill_failures_total",
                           (("kind", "peer_lost"),))] == 1
        assert after_kill[("phasewise:kv_frames_total", (("outcome", "ok"),))] >= 1
        assert after_kill[("phasewise:remote_prefills_in_flight", ())] == 0
        # The one remote prefill that decoded on: its K/V bytes are the prompt's blocks.
        assert after_kill[("phasewise:remote_prefill_seconds_count", ())] == 1
        assert after_kill[("phasewise:kv_transfer_frames_sum", ())] >= 1
        layers, kv_heads, head_dim, block = 2, 2, 16, 16  # the tiny checkpoint, fp32
        blocks = -(-n_prompt // block)
        assert after_kill[("phasewise:kv_transfer_bytes_sum", ())] == \
            blocks * layers * 2 * block * kv_heads * head_dim * 4
    finally:
        if prefill is not None:
            prefill.stop()
        decode.stop()
    assert "Traceback" not in decode.log()
