"""``phasewise router`` and ``phasewise pd`` as real processes on 127.0.0.1, serving a tiny
mixture-of-experts checkpoint (Qwen2-MoE): the official openai client streams through the
router; the launcher's three processes stop with it; a decode
worker killed mid-stream, with no other to move its stream to, ends that response with an
error naming it, and leaves nothing
held on the prefill worker; a prefill worker restarted with a new identity replaces the old
one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import build_hf_checkpoint
from phasewise import LLM, SamplingParams
from phasewise.engine.relay import INTERNAL_HEADER
from serving import free_port, start_server

PROMPT = "def fibonacci(n):"
KEY = "router-test-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # a mixture of experts whose sliding window (16) is shorter than the long prompts here:
    # P/D moves the K/V decoding reads, whatever the MLP and the attention's reach
    path = tmp_path_factory.mktemp("pd") / "model"
    build_hf_checkpoint(path, "MixtralForCausalLM", seed=3, max_position_embeddings=512,
                        sliding_window=16)
    return path


@pytest.fixture(scope="module")
def want(model):
    def run(prompt: str, n: int) -> str:
        return LLM(str(model)).generate(prompt, SamplingParams(
            temperature=0, max_tokens=n, ignore_eos=True))[0].text
    return run


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_pd_starts_three_processes_the_openai_client_streams_through_the_router(
        model, want, tmp_path):
    port, dport, pport, kvport = (free_port() for _ in range(4))
    pd = start_server(model, tmp_path / "pd.log", "--decode-port", str(dport),
                      "--prefill-port", str(pport), "--kv-port", str(kvport),
                      "--max-model-len", "256", api_key=KEY, command="pd", port=port,
                      timeout=240)
    children = []
    try:
        # The launcher's /health is the router's, and it is up only once all three are.
        children = _children(pd.proc.pid)
        assert len(children) == 3 and all(_alive(c) for c in children)
        health = httpx.get(pd.url + "/health", timeout=10).json()
        assert [(w["role"], w["up"]) for w in health["workers"]] == [("decode", True),
                                                                      ("prefill", True)]
        # --api-key: the router refuses a client without it, and sends it to the workers
        # (which refuse the router's relay without it: a reply at all shows it was sent).
        assert httpx.post(pd.url + "/v1/completions", json={"prompt": "x"},
                          timeout=10).status_code == 401
        assert httpx.get(f"http://127.0.0.1:{dport}/internal/v1/info",
                         timeout=10).status_code == 401
        # The workers' /internal/* take pd's own internal key, not the clients' one; and
        # wrong API keys sent to a worker from the router's address lock that address out
        # of the worker's /v1, never the router out of its relays and polls.
        r = httpx.get(f"http://127.0.0.1:{dport}/internal/v1/info", headers=pd.headers,
                      timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_key"
        for _ in range(8):
            httpx.get(f"http://127.0.0.1:{dport}/v1/models", timeout=10,
                      headers={"Authorization": "Bearer wrong"})
        assert httpx.get(f"http://127.0.0.1:{dport}/v1/models", headers=pd.headers,
                         timeout=10).status_code == 429
        args = [open(f"/proc/{c}/cmdline", "rb").read().split(b"\0") for c in children]
        (path,) = {a[a.index(b"--internal-key-file") + 1] for a in args}  # one, all three
        fleet = {INTERNAL_HEADER: open(path, "rb").read().decode().strip()}
        assert httpx.get(f"http://127.0.0.1:{dport}/internal/v1/load", headers=fleet,
                         timeout=10).status_code == 200  # the router's polls still pass
        client = openai.OpenAI(base_url=pd.url + "/v1", api_key=KEY, max_retries=0)
        stream = client.completions.create(
            model=model.name, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want(PROMPT, 20)
        usage = chunks[-1].model_extra
        (timing,) = usage["timings"]
        # The TTFT split, measured on the decode worker and passed through the router.
        assert timing["kv_bytes"] > 0 and timing["kv_frames"] >= 1
        for key in ("queue_s", "remote_prefill_s", "kv_transfer_s", "first_step_s",
                    "router_ttft_s"):
            assert timing[key] >= 0, key
        assert timing["remote_prefill_s"] + timing["kv_transfer_s"] <= timing["prefill_s"]
        # Prompt logprobs (echo): the decode worker computes the prompt itself, and they
        # come through the relay.
        offline = LLM(str(model))
        ids = offline.tokenizer.encode(PROMPT * 4, add_special_tokens=False)
        scored = httpx.post(pd.url + "/v1/completions", headers=pd.headers, timeout=60, json={
            "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1}).json()
        lps = scored["choices"][0]["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1 and lps[0] is None
        ref = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        for pos in range(1, len(ids)):
            assert abs(lps[pos] - ref.prompt_logprobs[pos][ids[pos]]) < 0.02, pos
        # Structured output: the prefill worker samples the first token under the grammar,
        # the decode worker's matcher goes on from it.
        guided = httpx.post(pd.url + "/v1/completions", headers=pd.headers, timeout=60, json={
            "prompt": PROMPT * 4, "max_tokens": 20, "guided_regex": "[a-c]{4}-[0-9]{2}"}).json()
        assert re.fullmatch("[a-c]{4}-[0-9]{2}", guided["choices"][0]["text"]), guided
        # max_tokens 0 (scoring only) through the router, a long prompt: no token comes back
        zero = httpx.post(pd.url + "/v1/completions", headers=pd.headers, timeout=60, json={
            "prompt": PROMPT * 4, "max_tokens": 0, "echo": True}).json()
        assert zero["usage"]["completion_tokens"] == 0, zero
        assert zero["choices"][0]["text"].startswith(PROMPT)
        # Chat works through the same relay.
        chat = client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            temperature=0)
        assert chat.choices[0].finish_reason in ("stop", "length")
        # The router's own /metrics: its view of each worker, and the TTFT its clients saw.
        m = pd.metrics()
        assert m[("phasewise:router_worker_up",
                  (("role", "decode"), ("url", f"http://127.0.0.1:{dport}")))] == 1
        assert m[("phasewise:time_to_first_token_seconds_count", ())] == 4  # 4 requests
    finally:
        code = pd.stop(signal.SIGTERM, timeout=90)
    # Stopping the launcher stopped all three.
    assert code == 0
    deadline = time.monotonic() + 30
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children and not any(_alive(c) for c in children)
    assert "Traceback" not in pd.log()


def _workers(model, tmp_path, *, name: str = "p"):
    secret = tmp_path / "kv.secret"
    secret.write_bytes(os.urandom(24).hex().encode())
    kv = f"tcp://127.0.0.1:{free_port()}"
    decode = start_server(model, tmp_path / "decode.log", "--role", "decode", "--kv-bind", kv,
                          "--kv-secret-file", str(secret), "--log-interval", "0")
    prefill = start_server(model, tmp_path / f"prefill-{name}.log", "--role", "prefill",
                           "--kv-connect", kv, "--kv-secret-file", str(secret),
                           "--log-interval", "0")
    return decode, prefill, kv, secret


def test_a_killed_decode_worker_is_a_clear_error_and_leaves_the_prefill_worker_empty(
        model, want, tmp_path):
    decode, prefill, _, _ = _workers(model, tmp_path)
    router = None
    try:
        router = start_server(model, tmp_path / "router.log", "--decode", decode.url,
                              "--prefill", prefill.url, command="router")
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        # A long stream: kill its decode worker once the first tokens came through.
        stream = client.completions.create(model=model.name, prompt=PROMPT, max_tokens=400,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        got = ""
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                got += chunk.choices[0].text
                if len(got) > 5 and decode.proc.poll() is None:
                    decode.stop(signal.SIGKILL)
        assert decode.url in str(err.value) and "went away" in str(err.value)
        # (the router tried to move it: the only decode worker was the one gone)
        assert "no other decode worker could take it over" in str(err.value)
        assert want(PROMPT, 400).startswith(got)
        # The router says so: /health names the worker, a new request is a 503 naming it.
        deadline = time.monotonic() + 20
        while httpx.get(router.url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        health = httpx.get(router.url + "/health", timeout=5).json()
        assert decode.url in health["error"]["message"]
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=model.name, prompt=PROMPT, max_tokens=4)
        assert refused.value.status_code == 503 and decode.url in str(refused.value)
        # Nothing is held on the prefill worker: no request, no block in use.
        m = prefill.wait_idle()
        assert m[("phasewise:kv_cache_usage_perc", ())] == 0
        assert m[("phasewise:step_tokens_total", (("phase", "prefill"),))] > 0
        assert "Traceback" not in router.log() and "Traceback" not in prefill.log()
    finally:
        for p in (router, prefill, decode):
            if p is not None:
                p.stop()


def test_a_restarted_prefill_worker_replaces_its_old_identity(model, want, tmp_path):
    decode, prefill, kv, secret = _workers(model, tmp_path)
    second = None
    try:
        client = openai.OpenAI(base_url=decode.url + "/v1", api_key="x", max_retries=0)

        def ask(prompt: str) -> str:
            return client.completions.create(model=model.name, prompt=prompt, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True}
                                             ).choices[0].text

        def done() -> float:
            return decode.metrics()[("phasewise:remote_prefills_total",
                                     (("outcome", "done"),))]

        assert ask(PROMPT) == want(PROMPT, 8) and done() == 1
        prefill.stop(signal.SIGKILL)
        # The same worker name (prefill@host) comes back with a new identity.
        second = start_server(model, tmp_path / "prefill-2.log", "--role", "prefill",
                              "--kv-connect", kv, "--kv-secret-file", str(secret),
                              "--log-interval", "0")
        other = "class Stack:"
        assert ask(other) == want(other, 8)
        m = decode.wait_idle()
        # Served by the new identity: a remote prefill that decoded on, none failed (the old
        # identity was replaced at the new one's handshake, not waited on).
        assert done() == 2
        assert m[("phasewise:remote_prefills_total", (("outcome", "failed"),))] == 0
        assert m[("phasewise:kv_peers_alive", ())] == 1
        assert "replaced by" in decode.log()
    finally:
        for p in (second, prefill, decode):
            if p is not None:
                p.stop()


def test_router_refuses_workers_of_another_checkpoint(model, tmp_path):
    other = tmp_path / "other"
    build_hf_checkpoint(other, "LlamaForCausalLM", seed=4, max_position_embeddings=256)
    worker = start_server(other, tmp_path / "w.log", "--log-interval", "0")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "phasewise.cli", "router", "--model", str(model),
             "--decode", worker.url, "--port", str(free_port()), "--wait", "20"],
            capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        assert "different checkpoint" in out.stderr and worker.url in out.stderr
        assert "config_sha256" in out.stderr and "Traceback" not in out.stderr
    finally:
        worker.stop()


def test_router_refuses_decode_workers_with_different_limits(model, tmp_path):
    a = start_server(model, tmp_path / "a.log", "--log-interval", "0", "--max-model-len", "256")
    b = None
    try:
        b = start_server(model, tmp_path / "b.log", "--log-interval", "0",
                         "--max-model-len", "128")
        out = subprocess.run(
            [sys.executable, "-m", "phasewise.cli", "router", "--model", str(model),
             "--decode", a.url, b.url, "--port", str(free_port()), "--wait", "20"],
            capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert "max_model_len" in out.stderr and b.url in out.stderr
        assert "Traceback" not in out.stderr
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()
