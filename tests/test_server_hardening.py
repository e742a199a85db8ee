"""The holes a hostile client found in the server, each pinned by a test: unbounded numbers
that failed an engine step for everyone, lone surrogates, CPU work on the event loop, double
counted admission, SIGTERM cutting streams silently, and the OpenAPI document disagreeing
with the server. Real server processes on 127.0.0.1 where the behaviour crosses a socket;
the ASGI app in-process where a test must look inside (which thread tokenized)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import build_hf_checkpoint, cache_with_kernels
from phasewise import EngineConfig, LLM, SamplingParams
from phasewise.engine.async_engine import AsyncEngine, EngineOverloaded, PromptSpec
from phasewise.server.app import OpenAIServer, ServerConfig
from phasewise.server.protocol import ChatCompletionRequest, CompletionRequest
from serving import start_server

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hardened")
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=3, max_position_embeddings=4096)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("logs") / "server.log",
                     "--served-model-name", "tiny", "--log-interval", "0")
    yield s
    s.stop()


def _post(server, path, body, **kw):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


class Stream:
    """A streamed completion read on its own thread, so a test can act while it runs."""

    def __init__(self, server, body):
        self.events: list = []
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()

    def _run(self, server, body):
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()

    def join(self):
        self.thread.join(120)
        assert self.error is None, self.error
        return self.events


def _boundary_values(model):
    """Each numeric field of a request model at its documented minimum and maximum, read
    from the model's own JSON schema (so a field added later is covered too)."""
    out = []
    for name, prop in model.model_json_schema()["properties"].items():
        for alt in prop.get("anyOf", [prop]):
            if alt.get("type") in ("integer", "number"):
                for key in ("minimum", "maximum", "exclusiveMinimum"):
                    if key in alt:
                        v = alt[key]
                        if key == "exclusiveMinimum":
                            v = v + (1 if alt["type"] == "integer" else 1e-9)
                        out.append((name, v))
    return out


def test_every_numeric_field_is_bounded_in_the_schema():
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema()["properties"]
        for name, prop in schema.items():
            for alt in prop.get("anyOf", [prop]):
                if alt.get("type") in ("integer", "number"):
                    assert ("minimum" in alt or "exclusiveMinimum" in alt) and \
                        "maximum" in alt, f"{model.__name__}.{name} is unbounded: {alt}"
                if alt.get("type") == "array" and alt.get("items", {}).get("type") == "integer":
                    assert "maximum" in alt["items"], f"{model.__name__}.{name} items"


def test_hostile_values_never_fail_anyone_elses_stream(server, model_dir):
    want = LLM(str(model_dir)).generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=300, ignore_eos=True))[0]
    stream = Stream(server, {"prompt": PROMPT, "max_tokens": 300, "temperature": 0,
                             "ignore_eos": True, "stream": True})
    assert stream.started.wait(60)
    # The defect's own request: a top_k past int64 reached the sampler and failed the step.
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "x"}]})):
        r = _post(server, path, dict(extra, max_tokens=1, top_k=9223372036854775808))
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
        r = _post(server, path, dict(extra, max_tokens=1, seed=2**64))
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    # Every numeric field at each end of its documented range: served, or a 400 that names
    # a field (some edges break cross-field rules, e.g. min_tokens > max_tokens).
    for model, path, base in (
            (CompletionRequest, "/v1/completions", {"prompt": "x", "max_tokens": 2}),
            (ChatCompletionRequest, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})):
        for name, value in _boundary_values(model):
            body = dict(base, **{name: value})
            if name == "best_of":
                body["n"] = value
            r = _post(server, path, body)
            if name.startswith("slo_") and r.status_code == 429:  # a target it cannot meet
                assert r.json()["error"]["code"] == name[:8], r.text
                continue
            assert r.status_code in (200, 400), (name, value, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["param"], (name, value, r.text)
    # Tiny temperatures are greedy rather than inf/NaN logits.
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5,
                                          "temperature": 1e-300})
    assert r.status_code == 200
    events = stream.join()
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text
    assert "Traceback" not in server.log() and "engine step failed" not in server.log()


LONE = '"\\ud800"'  # JSON text of a string holding one lone surrogate


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"prompt": %s, "max_tokens": 1}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": ["ok", %s], "max_tokens": 1}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": %s}' % LONE, "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}' % LONE,
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
     '[{"type": "text", "text": %s}]}]}' % LONE, "messages.0.content.0.text"),
    ("/tokenize", '{"prompt": %s}' % LONE, "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}' % LONE,
     "messages.0.content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, raw, param):
    r = _post(server, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert "surrogate" in err["message"]
    assert "Traceback" not in server.log()


def test_api_key_guards_every_route_that_takes_input(model_dir, tmp_path):
    s = start_server(model_dir, tmp_path / "keyed.log", "--log-interval", "0",
                     api_key="k3y")
    try:
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                           ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(s.url + path, json=body).status_code == 401, path
            assert httpx.post(s.url + path, json=body, headers=s.headers).status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 401
        for path in ("/health", "/metrics", "/version", "/openapi.json"):  # open by choice
            assert httpx.get(s.url + path).status_code == 200, path
        # two Authorization headers (a wrong one, then the key): which counts is ambiguous
        two = httpx.get(s.url + "/v1/models", headers=[("Authorization", "Bearer no"),
                                                       ("Authorization", "Bearer k3y")])
        assert two.status_code == 400 and "more than one Authorization" in two.text
    finally:
        s.stop()


# -- in-process: where the CPU work runs ----------------------------------------------------
def test_tokenizing_and_templating_run_off_the_event_loop(model_dir):
    engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir)))
    server = OpenAIServer(engine, ServerConfig(served_model_name="tiny"))
    tok = engine.tokenizer
    threads: list[str] = []

    def recording(fn):
        def wrapped(*a, **kw):
            threads.append(threading.current_thread().name)
            return fn(*a, **kw)
        return wrapped

    tok.encode = recording(tok.encode)
    tok.apply_chat_template = recording(tok.apply_chat_template)
    max_chars = server.routes.max_prompt_chars

    async def run():
        loop = asyncio.get_running_loop()
        engine.start(loop)
        loop_thread = threading.current_thread().name
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await c.post("/tokenize", json={"prompt": PROMPT})
            assert r.status_code == 200
            n_calls = len(threads)
            # Far longer than the context could hold: refused before any tokenizing.
            r = await c.post("/v1/completions", json={"prompt": "y" * (max_chars + 1)})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert "characters" in r.json()["error"]["message"]
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "y" * (max_chars + 1)}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            assert len(threads) == n_calls
        await asyncio.to_thread(engine.shutdown)
        return loop_thread

    loop_thread = asyncio.run(run())
    assert threads and loop_thread not in threads, threads
    assert all(t.startswith("phasewise-tok") for t in threads), threads


async def _resume(coro, fut):
    """Drive a coroutine that was started by hand (``coro.send``) to its end on the loop."""
    while True:
        await asyncio.wait({fut})
        try:
            fut = coro.send(None)
        except StopIteration as stop:
            return stop.value


def test_the_waiting_limit_counts_each_request_exactly_once(model_dir):
    """K requests wait behind one that holds the only sequence slot; the engine has taken
    them, but the event loop has not yet heard so. An admission check made at that moment
    must count each of them once: with a limit of K + 1, one more is admitted. (The check
    used to add the queue length the engine published to the count of requests still
    awaiting the engine's answer, so the same K were counted twice and it was refused.)"""
    k = 6
    engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir), max_num_seqs=1),
                                     max_waiting=k + 1)
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=1)

    async def run():
        engine.start()
        holder = await engine.add([PromptSpec([1, 2, 3], long)], "holder")
        async for _ in holder:  # its first token: it runs, and holds the slot
            break
        waiting = [asyncio.ensure_future(engine.add([PromptSpec([4, i + 1], short)], f"w{i}"))
                   for i in range(k)]
        await asyncio.sleep(0)  # each has sent its command and awaits the verdict
        deadline = time.monotonic() + 60
        while engine.snapshot.num_waiting < k:  # blocks the loop on purpose: no verdict
            assert time.monotonic() < deadline  # reaches the waiting requests meanwhile
            time.sleep(0.001)
        coro = engine.add([PromptSpec([7, 8], short)], "one-more")
        fut = coro.send(None)  # the admission check runs now, before any verdict arrives
        extra = await _resume(coro, fut)
        groups = [await t for t in waiting]
        with pytest.raises(EngineOverloaded, match=f"limit {k + 1}"):
            await engine.add([PromptSpec([9], short)], "too-many")
        for g in [holder, extra, *groups]:
            g.close()
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


# -- SIGTERM: streams past the grace period end with an error event, not a cut ---------------
def test_sigterm_ends_streams_past_the_grace_period_with_an_error_event(model_dir, tmp_path):
    s = start_server(model_dir, tmp_path / "grace.log", "--shutdown-grace", "1",
                     "--log-interval", "0")
    try:
        stream = Stream(s, {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
                            "stream": True})
        assert stream.started.wait(60)
        s.proc.send_signal(signal.SIGTERM)
        events = stream.join()
        s.proc.wait(60)
    finally:
        s.stop()
    assert s.proc.returncode in (0, -signal.SIGTERM)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "shutting_down" and "grace period" in err["message"]
    log = s.log()
    assert "Traceback" not in log and "CancelledError" not in log
    assert sum("grace period ran out" in line for line in log.splitlines()) == 1


# -- the OpenAPI document and the server agree -----------------------------------------------
def test_openapi_document_matches_the_server(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            if method == "post" and path != "/v1/embeddings":  # (not served: no body read)
                assert "400" in op["responses"], (method, path)
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == \
        ["text/plain"]
    assert "text/plain" in httpx.get(server.url + "/metrics").headers["content-type"]
    r = httpx.request("PUT", server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    # response_format is honoured on completions too, as on chat (not silently ignored): an
    # unknown type is refused, json_object constrains the output.
    r = _post(server, "/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type"
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "response_format":
                                          {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{")
    # JSON Schema's integer includes 3.0; the documented prompt string is non-empty.
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3.0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
    prompt_schema = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert {"type": "string", "minLength": 1} in [
        {k: v for k, v in alt.items() if k in ("type", "minLength")}
        for alt in prompt_schema["anyOf"]]


@pytest.fixture(scope="module")
def short_server(tmp_path_factory):
    """A 256-token context: fuzzed chat requests without max_tokens stay short."""
    path = tmp_path_factory.mktemp("short")
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=4, max_position_embeddings=256)
    s = start_server(path, tmp_path_factory.mktemp("logs") / "short.log", "--log-interval",
                     "0")
    yield s
    s.stop()


def test_schema_fuzzing_finds_no_server_error_and_no_mismatch(short_server):
    """schemathesis generates bounded requests from /openapi.json for every operation and
    checks each response: no 5xx, status and content type documented, body matching the
    documented schema; schema-invalid input refused, and schema-valid input accepted unless it
    breaks a rule across fields, whose error code says so (phasewise.server.protocol's
    RULES_ACROSS_FIELDS: prompt + max_tokens over the context, min_tokens > max_tokens, ...)."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance, negative_data_rejection, response_schema_conformance,
        status_code_conformance)

    from phasewise.server.protocol import RULES_ACROSS_FIELDS

    @schemathesis.check
    def valid_input_accepted(ctx, response, case):
        if response.status_code == 400:
            code = response.json()["error"]["code"]
            assert code in RULES_ACROSS_FIELDS, f"schema-valid request refused: {response.text}"

    server = short_server
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    conformance = [not_a_server_error, status_code_conformance, content_type_conformance,
                   response_schema_conformance]
    modes = {GenerationMode.POSITIVE: conformance + [valid_input_accepted],
             GenerationMode.NEGATIVE: conformance + [negative_data_rejection]}
    examples = int(os.environ.get("PHASEWISE_FUZZ_EXAMPLES", "15"))
    labels = []
    for result in schema.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        for mode, checks in modes.items():
            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                case.validate_response(case.call(timeout=30), checks=checks)

            try:
                fuzz()  # a failure raises, with the request that shows it
            except Unsatisfiable:  # an operation without a body has no invalid form (a
                # path parameter is any text)
                assert mode is GenerationMode.NEGATIVE and (
                    operation.method in ("get", "head", "delete")
                    or operation.path == "/v1/embeddings")
    assert "POST /v1/completions" in labels and "POST /v1/chat/completions" in labels
    assert "Traceback" not in server.log()


# -- the first five minutes -----------------------------------------------------------------
def test_each_request_gets_one_access_log_line(server):
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                          "ignore_eos": True})
    rid = r.json()["id"]
    deadline = time.monotonic() + 10
    while rid not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [ln for ln in server.log().splitlines() if rid in ln]
    assert len(lines) == 1, lines
    line = lines[0]
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert "phasewise.access" in line and "POST /v1/completions 200" in line
    assert f"prompt={prompt_tokens}" in line and "output=3" in line
    assert "ttft=" in line and "ttft=-" not in line and "duration=" in line
    bad = _post(server, "/v1/completions", {"prompt": "x", "top_p": 7})
    assert bad.status_code == 400
    deadline = time.monotonic() + 10
    while "POST /v1/completions 400" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "POST /v1/completions 400" in server.log()


def test_serve_on_a_port_in_use_fails_before_loading_and_names_the_flag(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "phasewise.cli", "serve", "--model", str(model_dir),
             "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"port {port}" in proc.stderr and "--port" in proc.stderr
    assert "loading" not in proc.stderr and "Traceback" not in proc.stderr


def test_metrics_hold_each_step_against_its_roofline(model_dir, tmp_path):
    """With this machine's figures stored (here: made up, written by the test), every engine
    step is exported with its predicted time beside its measured one, and the achieved
    bandwidth and FLOP/s that the predicted bytes and FLOPs imply."""
    cache = cache_with_kernels(tmp_path / "cache")
    (cache / "machine.json").write_text(json.dumps({"cpu-local": {
        "name": "test machine", "peak_flops": {"fp32": 2.0e11, "bf16": 1.0e11},
        "mem_bytes": 8e9, "mem_bandwidth": 1.0e10}}))
    s = start_server(model_dir, tmp_path / "roof.log", "--log-interval", "0",
                     env={"PHASEWISE_CACHE_DIR": str(cache)})
    try:
        before = s.wait_idle()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        after = s.wait_idle()
    finally:
        s.stop()

    def delta(name):
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    steps = sum(after.get(("phasewise:engine_steps_total", (("kind", k),)), 0.0)
                - before.get(("phasewise:engine_steps_total", (("kind", k),)), 0.0)
                for k in ("prefill", "decode", "mixed"))
    assert steps >= 5  # one prefill and four decodes at least
    for h in ("step_time_over_roofline", "step_predicted_seconds",
              "step_achieved_bandwidth_bytes_per_second", "step_achieved_flops_per_second"):
        assert delta(f"phasewise:{h}_count") == steps, h
        assert delta(f"phasewise:{h}_sum") > 0, h
    assert "this machine's stored figures (test machine)" in s.log()
    assert "predicted time beside its measured one" in s.log()


def test_review_findings_stay_fixed(server):
    """Found by trying the hardened server as a hostile client: streamed logprob offsets,
    a top_p that rounds to 0 in fp32, the field a too-large request names, HEAD probes."""
    body = {"prompt": "def f", "max_tokens": 12, "logprobs": 0, "temperature": 0,
            "ignore_eos": True, "stop": ["zzzzzzzz"]}  # the stop string holds text back
    whole = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True),
                      timeout=60) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
    offsets = [o for e in events if e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["text_offset"]
    assert len(set(offsets)) == len(offsets)  # strictly growing: every token has text here

    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "top_p": 1e-300,
                                          "temperature": 1, "logprobs": 1, "seed": 1})
    assert r.status_code == 200
    lp = r.json()["choices"][0]["logprobs"]
    # Only the most likely token survives: each sampled token is its position's argmax.
    for tok, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert tok == max(top.values())

    r = _post(server, "/v1/completions", {"prompt": ["a"] * 17, "n": 16, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert r.json()["error"]["code"] == "invalid_combination"
    assert httpx.head(server.url + "/health").status_code == 200


def test_nan_and_infinity_are_refused_as_not_finite_not_as_past_a_bound():
    """"temperature": NaN was answered "less than or equal to 100 (got NaN)"."""
    import pydantic

    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(pydantic.ValidationError) as e:
            CompletionRequest(prompt="x", temperature=value)
        (err,) = e.value.errors()
        assert err["type"] == "finite_number" and err["loc"] == ("temperature",)


def test_a_lagging_readers_merged_output_renders_off_the_event_loop():
    """A reader that stops reading gets its outputs merged; one merge of many tokens with
    logprobs took 1.5 s to render on the event loop, every other stream waiting. A step's
    usual chunk renders on the loop; a chunk of OFF_LOOP_ENTRIES or more does not."""
    from phasewise.engine.outputs import RequestOutput
    from phasewise.engine.request import RequestMetrics
    from phasewise.server import sse

    def output(tokens: int, finished: bool) -> RequestOutput:
        ids = [5] * tokens
        lps = [{5: -0.1, **{t: -2.0 for t in range(6, 25)}}] * tokens  # 20 logprobs each
        return RequestOutput("r-0", None, [1, 2], "x" * tokens, ids, "x" * tokens, ids,
                             finished, "length" if finished else None, None, lps,
                             RequestMetrics(0.0))

    small, merged = output(1, False), output(200, True)
    assert sse.render_cost(small) < sse.OFF_LOOP_ENTRIES <= sse.render_cost(merged)

    class Group:
        def __init__(self):
            self.items = [(0, small), (0, merged)]

        def __aiter__(self):
            return self

        async def __anext__(self):
            if not self.items:
                raise StopAsyncIteration
            return self.items.pop(0)

        def close(self):
            pass

    rendered: list[tuple[int, str]] = []

    def render(idx, out):
        rendered.append((len(out.delta_token_ids), threading.current_thread().name))
        return [({"index": idx, "text": out.delta_text}, False)]

    async def run():
        loop_thread = threading.current_thread().name
        response = sse.stream_group(group=Group(), rid="r", obj="text_completion", model="m",
                                    prompt_lens=[2], prompt_tokens=2, include_usage=False,
                                    continuous_usage=False, render=render)
        lines = [line async for line in response.body_iterator]
        return loop_thread, lines

    loop_thread, lines = asyncio.run(run())
    assert [n for n, _ in rendered] == [1, 200] and lines[-1].strip() == b"data: [DONE]"
    assert rendered[0][1] == loop_thread and rendered[1][1] != loop_thread
