"""The OpenAI-compatible server, as a real process on 127.0.0.1, driven by the ``openai``
client and by raw HTTP. Greedy outputs are checked against the offline engine."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from conftest import build_hf_checkpoint
from phasewise import LLM, SamplingParams
from serving import start_server

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os, sys\n"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=7, max_position_embeddings=4096)
    return path


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("logs") / "server.log",
                     "--served-model-name", "tiny-llama", "--log-interval", "0.2",
                     "--max-request-size", "64KiB")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(offline, prompt, max_tokens, **kw):
    return offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   **kw))[0]


def sse_events(response: httpx.Response) -> list:
    """Parsed ``data:`` payloads of an SSE response; ``[DONE]`` stays a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- outputs match the offline engine --------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_matches_offline_engine(client, offline, prompt):
    want = greedy(offline, prompt, 24)
    got = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24,
                                    temperature=0)
    assert got.id.startswith("cmpl-")
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length"
                                            else "stop")
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens

    stream = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] in ("stop", "length")


def test_stream_sends_every_token_in_its_own_chunk(server, offline):
    want = greedy(offline, PROMPTS[0], 20, ignore_eos=True)
    with server.client() as c, c.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 21  # one chunk per sampled token, then usage
    assert all(len(ch["choices"][0]["logprobs"]["tokens"]) == 1 for ch in chunks[:20])
    assert "".join(ch["choices"][0]["text"] for ch in chunks[:20]) == want.text
    assert [ch["choices"][0]["finish_reason"] for ch in chunks[:20]] == [None] * 19 + ["length"]
    # Usage on every chunk counts the tokens so far; then the final usage-only chunk.
    assert [ch["usage"]["completion_tokens"] for ch in chunks[:20]] == list(range(1, 21))
    assert chunks[20]["choices"] == [] and chunks[20]["usage"]["completion_tokens"] == 20
    # phasewise's extension on the final usage chunk: the engine's own split of the request.
    (timing,) = chunks[20]["timings"]
    assert timing["index"] == 0 and timing["preemptions"] == 0
    assert timing["queue_s"] >= 0 and timing["prefill_s"] > 0 and timing["decode_s"] > 0


def test_chat_matches_offline_engine(client, offline):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "Print the squares of 1 to 5."}]
    rendered = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    want = greedy(offline, ids, 16)
    got = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=16,
                                         temperature=0)
    assert got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == len(want.token_ids)

    stream = client.chat.completions.create(model="tiny-llama", messages=messages,
                                            max_completion_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_token_id_prompts_batches_and_n(server, offline):
    ids = offline.tokenizer.encode(PROMPTS[1])
    want_ids = greedy(offline, ids, 8, ignore_eos=True)
    want_a = greedy(offline, PROMPTS[0], 8, ignore_eos=True)
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want_ids.text
        # Two prompts x n=2: choices are ordered prompt-major, all greedy.
        r = c.post("/v1/completions", json={"prompt": [PROMPTS[0], PROMPTS[1]], "n": 2,
                                            "max_tokens": 8, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert [ch["text"] for ch in body["choices"]] == [want_a.text] * 2 + [want_ids.text] * 2
    assert body["usage"]["prompt_tokens"] == len(want_a.prompt_token_ids) + len(ids)
    assert body["usage"]["completion_tokens"] == 32


def test_completions_default_to_16_tokens(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default


def test_seeded_sampling_matches_offline_engine(client, offline):
    got = client.completions.create(model="tiny-llama", prompt=PROMPTS[2], max_tokens=12,
                                    temperature=0.9, top_p=0.9, seed=1234, n=2,
                                    extra_body={"ignore_eos": True, "top_k": 50})
    for j, choice in enumerate(got.choices):
        want = offline.generate(PROMPTS[2], SamplingParams(
            temperature=0.9, top_p=0.9, top_k=50, seed=1234 + j, max_tokens=12,
            ignore_eos=True))[0]
        assert choice.text == want.text


def test_stop_strings_and_stop_finish_reason(client, offline):
    full = greedy(offline, PROMPTS[0], 30, ignore_eos=True)
    stop = full.text[10:13]
    assert stop and full.text.find(stop) >= 0
    got = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=30,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].text == full.text[:full.text.find(stop)]
    assert got.choices[0].finish_reason == "stop"
    # vLLM's stop_reason says which stop ended it: the string here, a token's id, or none
    assert got.choices[0].model_extra["stop_reason"] == stop
    streamed = list(client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
        temperature=0, stream=True, stop=["\n", " "], extra_body={"ignore_eos": True}))
    last = [c.choices[0] for c in streamed if c.choices and c.choices[0].finish_reason]
    assert len(last) == 1 and last[0].model_extra["stop_reason"] in ("\n", " ", None)
    assert not any("stop_reason" in (c.choices[0].model_extra or {}) for c in streamed
                   if c.choices and not c.choices[0].finish_reason)  # only the last has it
    capped = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=2,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert capped.choices[0].finish_reason == "length"
    assert capped.choices[0].model_extra["stop_reason"] is None


def test_logprobs_match_offline_engine(client, offline):
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                       ignore_eos=True))[0]
    got = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=6,
                                    temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, entry, value, top in zip(want.token_ids, want.logprobs, lp.token_logprobs,
                                      lp.top_logprobs):
        assert value == pytest.approx(entry[tok], abs=1e-4)
        # Keyed by token text, so tokens that decode alike (partial UTF-8) share a key.
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-4)
        assert all(any(abs(v - w) < 1e-4 for w in entry.values()) for v in top.values())
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(model="tiny-llama", max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_models_health_tokenize_detokenize(server, offline):
    with server.client() as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]
        assert models["data"][0]["max_model_len"] == 4096
        assert c.get("/health").status_code == 200
        tok = c.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
        assert tok["tokens"] == offline.tokenizer.encode(PROMPTS[0])
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 4096
        msgs = [{"role": "user", "content": "hello"}]
        chat_tok = c.post("/tokenize", json={"messages": msgs}).json()["tokens"]
        assert chat_tok == offline.tokenizer.encode(
            offline.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
        text = c.post("/detokenize", json={"tokens": tok["tokens"][1:]}).json()["prompt"]
        assert text == PROMPTS[0]


# -- bad input -------------------------------------------------------------------------------
LONG = "x " * 5000  # > 4096 tokens

BAD_REQUESTS = [
    # (path, body (str = raw), status, param)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/tokenize", {}, 400, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_request_gets_a_4xx_naming_the_field(server, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert param.split(".")[0] in err["message"]


def test_oversized_body_unknown_route_and_method(server):
    big = json.dumps({"prompt": "y" * 70_000})
    r = httpx.post(server.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]

    def chunked():
        for _ in range(10):
            yield b"z" * 10_000

    r = httpx.post(server.url + "/v1/completions", content=chunked(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/completions").json()["error"]["code"] \
        == "method_not_allowed"


# -- robustness: disconnects, barrage, metrics ------------------------------------------------
def _counter(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.wait_idle()
    with server.client() as c, c.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True,
            "stream": True}) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break  # leaving the block closes the connection mid-stream
    after = server.wait_idle()
    assert after[("phasewise:kv_cache_usage_perc", ())] == 0.0
    assert after[("phasewise:kv_cache_free_blocks", ())] == after[("phasewise:kv_cache_blocks",
                                                                   ())]
    name = "phasewise:request_success_total"
    assert _counter(after, name, finished_reason="abort") == \
        _counter(before, name, finished_reason="abort") + 1
    generated = (after[("phasewise:generation_tokens_total", ())]
                 - before[("phasewise:generation_tokens_total", ())])
    assert 3 <= generated < 4000


def test_barrage_of_bad_requests_and_disconnects_leaves_server_intact(server, offline):
    want = greedy(offline, PROMPTS[1], 16)
    with server.client() as c:
        first = c.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 16,
                                                "temperature": 0}).json()
    assert first["choices"][0]["text"] == want.text

    def bad_requests():
        with server.client() as c:
            for path, body, status, _ in BAD_REQUESTS * 2:
                content = body if isinstance(body, str) else json.dumps(body)
                assert c.post(path, content=content).status_code == status

    def hang_up_streams(k):
        for i in range(k):
            with server.client() as c, c.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"tell me {i}"}], "n": 2,
                    "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
                for j, _ in enumerate(r.iter_lines()):
                    if j == 4:
                        break

    def give_up_waiting(k):
        for _ in range(k):
            with pytest.raises(httpx.ReadTimeout), server.client(timeout=0.3) as c:
                c.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 4000,
                                                "ignore_eos": True})

    threads = [threading.Thread(target=f, args=a) for f, a in
               [(bad_requests, ()), (hang_up_streams, (4,)), (give_up_waiting, (3,))]]
    errors = []
    for t in threads:
        t.run = (lambda run: lambda: _record(errors, run))(t.run)
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    idle = server.wait_idle()
    assert idle[("phasewise:kv_cache_usage_perc", ())] == 0.0
    assert idle[("phasewise:kv_cache_free_blocks", ())] == idle[("phasewise:kv_cache_blocks",
                                                                 ())]
    with server.client() as c:
        again = c.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 16,
                                                "temperature": 0}).json()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert "Traceback" not in server.log()


def _record(errors, fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(repr(e))


def test_metrics_count_exactly_the_tokens_served(server, client):
    before = server.wait_idle()
    usages = []
    for i, prompt in enumerate(PROMPTS):
        r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=5 + i,
                                      temperature=0, extra_body={"ignore_eos": True})
        usages.append(r.usage)
    stream = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "count"}], max_tokens=7,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    usages.append(list(stream)[-1].usage)
    after = server.wait_idle()

    def delta(name, **labels):
        return _counter(after, name, **labels) - _counter(before, name, **labels)

    assert delta("phasewise:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("phasewise:generation_tokens_total") == sum(u.completion_tokens
                                                             for u in usages) == 5 + 6 + 7 + 7
    assert delta("phasewise:request_success_total", finished_reason="length") == 4
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_time_per_output_token_seconds"):
        assert delta(f"phasewise:{h}_count") == 4, h
        assert delta(f"phasewise:{h}_sum") > 0, h
    assert delta("phasewise:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert delta("phasewise:request_generation_tokens_sum") == 25
    # One inter-token gap per token after the first of each request.
    assert delta("phasewise:inter_token_latency_seconds_count") == 25 - 4
    steps = sum(delta("phasewise:engine_steps_total", kind=k)
                for k in ("prefill", "decode", "mixed"))
    assert steps == delta("phasewise:iteration_tokens_count") > 0
    assert delta("phasewise:step_tokens_total", phase="decode") == 25 - 4
    assert delta("phasewise:step_tokens_total", phase="prefill") == \
        delta("phasewise:prefix_cache_queries_total") - delta("phasewise:prefix_cache_hits_total")
    assert 0 <= delta("phasewise:prefix_cache_hits_total") <= \
        delta("phasewise:prefix_cache_queries_total")
    assert delta("phasewise:iteration_tokens_sum") == \
        delta("phasewise:step_tokens_total", phase="decode") + \
        delta("phasewise:step_tokens_total", phase="prefill")


def test_bench_client_against_phasewise_reads_its_metrics(server, tmp_path):
    from phasewise.cli import main

    server.wait_idle()
    out = tmp_path / "bench.json"
    rc = main(["bench", "--base-url", server.url, "--num-prompts", "3", "--input-len", "9",
               "--output-len", "4", "--request-rate", "inf", "--result-file", str(out),
               "--disable-tqdm"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 3 and r["input_lens"] == [9] * 3 and r["output_lens"] == [4] * 3
    sm = r["server_metrics"]  # /metrics before and after: exactly this run's tokens
    assert sm["prompt_tokens"] == 27 and sm["generation_tokens"] == 12
    assert sm["step_tokens"]["decode"] == 3 * 3
    assert sm["mean_request_prefill_time_ms"] > 0
    assert all(t is not None and t["prefill_s"] > 0 for t in r["server_timings"])


def test_bench_reports_prefix_hits_and_warns_when_a_cold_run_was_cached(server, tmp_path,
                                                                       capsys):
    """A repeated --seed sends the same prompts: the second run is served from the prefix
    cache, reports it and warns. Without --seed each run draws its own and is not; neither
    is the second rate of a sweep."""
    from phasewise.cli import main

    def bench(name: str, *extra: str) -> tuple[dict, str]:
        out = tmp_path / f"{name}.json"
        rc = main(["bench", "--base-url", server.url, "--num-prompts", "3", "--input-len",
                   "48", "--output-len", "2", "--request-rate", "inf", "--result-file",
                   str(out), "--disable-tqdm", *extra])
        assert rc == 0
        cap = capsys.readouterr()
        return json.loads(out.read_text()), cap.out + cap.err

    server.wait_idle()
    first, _ = bench("a", "--seed", "11")
    again, text = bench("b", "--seed", "11")
    assert first["seed"] == again["seed"] == 11
    assert again["cached_of_prompt_tokens"] == 3 * 48
    assert again["cached_prompt_tokens"] >= 3 * 32  # whole blocks of each prompt
    assert again["requests_with_cache_hits"] == 3
    assert "Prefix cache hits (server):" in text and "warning: the server's prefix cache" in text
    fresh, text = bench("c")
    other, text2 = bench("d")
    assert fresh["seed"] != other["seed"] and f"--seed {other['seed']}" in text2
    for r, t in ((fresh, text), (other, text2)):
        # (one window may start where one of the server's earlier requests did, by chance)
        assert r["requests_with_cache_hits"] <= 1, r
        assert "warning: the server's prefix cache" not in t
    rc = main(["bench", "--base-url", server.url, "--num-prompts", "3", "--input-len", "48",
               "--output-len", "2", "--request-rate", "1000", "inf", "--seed", "12",
               "--result-dir", str(tmp_path / "sweep"), "--save-result", "--disable-tqdm"])
    assert rc == 0
    second = json.loads((tmp_path / "sweep" / "phasewise-bench-rateinf.json").read_text())
    assert second["requests_with_cache_hits"] <= 1, second


def test_periodic_log_line_reports_throughput(server, client):
    client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=20,
                              temperature=0, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 30
    while "generation" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [ln for ln in server.log().splitlines() if "phasewise.stats" in ln]
    assert lines, server.log()[-2000:]
    last = lines[-1]
    for part in ("prompt", "tok/s", "generation", "running", "waiting", "KV usage",
                 "prefix hit rate"):
        assert part in last


# -- overload, API key, drain: a server with one sequence slot and one waiting slot ----------
@pytest.fixture(scope="module")
def narrow(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("logs") / "narrow.log",
                     "--max-num-seqs", "1", "--max-waiting-requests", "1",
                     "--shutdown-grace", "60", api_key="sekrit")
    yield s
    s.stop()


def test_api_key_is_required_on_v1_routes(narrow):
    body = {"prompt": "x", "max_tokens": 2}
    r = httpx.post(narrow.url + "/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(narrow.url + "/v1/completions", json=body,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(narrow.url + "/v1/models").status_code == 401
    assert httpx.get(narrow.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(narrow.url + "/health/engine").status_code == 200
    r = httpx.post(narrow.url + "/v1/completions", json=body, headers=narrow.headers)
    assert r.status_code == 200
    # More sequences than may ever wait at once: a 400 (retrying could never help), not 503.
    r = httpx.post(narrow.url + "/v1/completions", json=dict(body, n=2), headers=narrow.headers)
    assert r.status_code == 400 and "sequences" in r.json()["error"]["message"]


def test_full_waiting_queue_gets_503_and_admitted_requests_finish(narrow, offline):
    want = greedy(offline, PROMPTS[1], 10)
    with narrow.client() as c1, narrow.client() as c2, narrow.client() as c3:
        long_req = c1.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True, "stream": True})
        first = long_req.__enter__()  # holds the only sequence slot
        assert first.status_code == 200
        lines = first.iter_lines()
        next(lines)
        queued = c2.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0, "stream": True})
        second = queued.__enter__()  # headers come back once it is queued in the engine
        assert second.status_code == 200
        r = c3.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
        long_req.__exit__(None, None, None)  # hang up: frees the slot
        events = sse_events(second)
        queued.__exit__(None, None, None)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text


def test_sigterm_drains_running_streams_then_exits(narrow):
    with narrow.client() as c, c.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[2], "max_tokens": 600, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        narrow.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "draining" not in narrow.log() and time.monotonic() < deadline:
            time.sleep(0.02)
        # While draining, a new request is refused: no listener, a connection closed before
        # any response (accepted just before the listener closed), or 503 on a live socket.
        try:
            refused = httpx.post(narrow.url + "/v1/completions", headers=narrow.headers,
                                 json={"prompt": "x", "max_tokens": 2}, timeout=5).status_code
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            refused = "connection refused or closed"
        rest = list(lines)
    assert refused in (503, "connection refused or closed")
    payloads = [ln[6:] for ln in rest if ln.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
    narrow.proc.wait(60)
    assert narrow.proc.returncode in (0, -signal.SIGTERM)
    with pytest.raises(httpx.ConnectError):
        httpx.get(narrow.url + "/health", timeout=5)
