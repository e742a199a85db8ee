"""What real clients (the openai SDK, agent loops) and a hostile tester found wrong in the
API's answers (issue 46), each pinned against a real ``phasewise serve``: lone surrogates
inside free-form objects (tool parameters, schemas, metadata, template kwargs) are 400s that
name their path, never 500s; the relay's flags are booleans; a forced tool call cut by
``max_tokens`` is still a tool call; ``cached_tokens`` is filled; the Responses API's times
are integers; ``/v1/embeddings`` says it is not served. In-process: a stream whose 200 began
ends with its error event and end marker whatever fails."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import build_hf_checkpoint
from serving import start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}
LONE = '"\\ud800"'  # JSON text of a string holding one lone surrogate
USER = '"messages": [{"role": "user", "content": "x"}]'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("correct")
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=11, max_position_embeddings=1024)
    s = start_server(path, tmp_path_factory.mktemp("logs") / "server.log",
                     "--served-model-name", "tiny", "--log-interval", "0")
    yield s
    s.stop()


def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _post(server, path, raw: str, **kw):
    return httpx.post(server.url + path, content=raw.encode("utf-8"), timeout=60,
                      headers={"content-type": "application/json"}, **kw)


# -- lone surrogates inside free-form objects -----------------------------------------------
def _tools(params: str) -> str:
    return ('{%s, "tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]'
            % (USER, params))


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/chat/completions", _tools('{"type": "object", "properties": {%s: {}}}' % LONE)
     + "}", "tools.0.function.parameters.properties.\\ud800"),
    ("/v1/chat/completions", _tools('{"type": "object", "properties": {"a": {"enum": '
                                    '["ok", %s]}}}' % LONE) + ', "stream": true}',
     "tools.0.function.parameters.properties.a.enum.1"),
    ("/v1/chat/completions", '{%s, "chat_template_kwargs": {"k": [1, {"x": %s}]}}'
     % (USER, LONE), "chat_template_kwargs.k.1.x"),
    ("/v1/chat/completions", '{%s, "response_format": {"type": "json_schema", "json_schema": '
     '{"name": "n", "schema": {"type": "object", "properties": {%s: {}}}}}}' % (USER, LONE),
     "response_format.json_schema.schema.properties.\\ud800"),
    ("/v1/responses", '{"input": "x", "metadata": {%s: "v"}}' % LONE, "metadata.\\ud800"),
    ("/v1/responses", '{"input": "x", "metadata": {%s: "v"}, "stream": true}' % LONE,
     "metadata.\\ud800"),
    ("/v1/responses", '{"input": "x", "text": {"format": {"type": "json_schema", "name": "n", '
     '"schema": {"type": "object", "properties": {%s: {"type": "string"}}}}}}' % LONE,
     "text.format.schema.properties.\\ud800"),
])
def test_a_lone_surrogate_in_a_free_form_object_is_a_400_naming_its_path(server, path, raw,
                                                                         param):
    r = _post(server, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"], err
    assert "Traceback" not in server.log()


# -- the relay's flags ----------------------------------------------------------------------
@pytest.mark.parametrize("name,value", [("ignore_eos", "no"), ("skip_special_tokens", "yes"),
                                        ("include_stop_str_in_output", 1)])
def test_the_relay_takes_only_booleans_as_flags_and_names_the_flag(server, name, value):
    r = httpx.post(server.url + "/internal/v1/generate", timeout=60, json={
        "request_id": "cmpl-flag", "specs": [
            {"token_ids": [5, 6, 7], "params": {"max_tokens": 2, name: value}}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"specs.0.params.{name}"


# -- a forced tool call cut by max_tokens --------------------------------------------------
def test_a_named_tool_call_cut_by_max_tokens_is_a_call_with_truncated_arguments(server):
    c = client(server)
    args = dict(model="tiny", messages=[{"role": "user", "content": "weather in Oslo?"}],
                tools=[WEATHER, TIME], max_tokens=6, seed=1,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = c.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut short, as OpenAI returns it
    # streamed: the same call, as deltas
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(stream=True, **args):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            assert not ch.delta.content
            for tc in ch.delta.tool_calls or []:
                got = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                got["name"] = got["name"] or (tc.function.name if tc.function else None)
                got["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert finish == "length"
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


@pytest.mark.parametrize("choice", ["auto", "required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_a_streamed_chat_with_tools_carries_every_tokens_logprobs(server, choice):
    """With tools, text may be held back (a call may be starting), but each token's logprobs
    still reach the client once, in order: the same entries as the whole reply's."""
    c = client(server)
    args = dict(model="tiny", messages=[{"role": "user", "content": "weather in Oslo?"}],
                tools=[WEATHER], tool_choice=choice, max_tokens=12, temperature=0,
                logprobs=True, top_logprobs=2)
    whole = c.chat.completions.create(**args).choices[0].logprobs.content
    streamed = [e for chunk in c.chat.completions.create(stream=True, **args)
                for ch in chunk.choices for e in (ch.logprobs.content if ch.logprobs else [])]
    assert len(whole) == 12
    # (the second run may read the first one's cached prompt: a last-bit difference)
    assert [(e.token, len(e.top_logprobs)) for e in streamed] == [
        (e.token, len(e.top_logprobs)) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)


def test_a_required_tool_call_cut_by_max_tokens_is_a_call(server):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  tools=[WEATHER], tool_choice="required", max_tokens=8,
                                  seed=2)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    assert [t.function.name for t in choice.message.tool_calls] == ["get_weather"]


def test_truncated_required_calls_keep_every_call_whose_name_is_known():
    from phasewise.server.tools import truncated_calls

    names = ["get_time", "get_weather"]
    whole = '{"arguments":{"zone":"utc"},"name":"get_time"}'
    assert truncated_calls(f'[{whole},{{"arguments":{{"city":"Os', names) == [
        {"name": "get_time", "arguments": '{"zone":"utc"}'}]  # the second: no name yet
    assert truncated_calls('[{"arguments":{"city":"a,}b","unit":"c"},"name":"get_w', names) \
        == [{"name": "get_weather", "arguments": '{"city":"a,}b","unit":"c"}'}]
    assert truncated_calls('[{"name": "get_time", "arguments": {"zo', names) == [
        {"name": "get_time", "arguments": '{"zo'}]
    assert truncated_calls('[{"arguments":{"zone":"utc"},"name":"get_', names) == []
    assert truncated_calls('[{"arguments":{"zo', ["get_time"]) == [
        {"name": "get_time", "arguments": '{"zo'}]  # the only tool
    assert truncated_calls("[", names) == [] and truncated_calls("", names) == []


# -- cached tokens --------------------------------------------------------------------------
LONG = "The quick brown fox jumps over the lazy dog. " * 12  # several 16-token blocks


def test_cached_tokens_are_filled_on_a_prefix_hit_streamed(server):
    c = client(server)
    for path in ("chat", "completions"):
        usages = []
        for _ in range(2):
            if path == "chat":
                stream = c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=2,
                    stream=True, stream_options={"include_usage": True})
            else:
                stream = c.completions.create(model="tiny", prompt=LONG, max_tokens=2,
                                              stream=True,
                                              stream_options={"include_usage": True})
            usages += [ch.usage for ch in stream if ch.usage is not None]
        first, again = usages
        assert again.prompt_tokens_details.cached_tokens >= 16, (path, again)
        assert again.prompt_tokens_details.cached_tokens <= again.prompt_tokens
        assert first.prompt_tokens_details.cached_tokens < again.prompt_tokens


def test_cached_tokens_are_filled_on_a_prefix_hit_whole(server):
    c = client(server)
    c.completions.create(model="tiny", prompt=LONG + "!", max_tokens=1)
    again = c.completions.create(model="tiny", prompt=LONG + "!", max_tokens=1).usage
    assert again.prompt_tokens_details.cached_tokens >= 16


# -- the Responses API's times ------------------------------------------------------------
def test_responses_times_are_integers(server):
    r = httpx.post(server.url + "/v1/responses", timeout=60,
                   json={"input": "x", "max_output_tokens": 2, "stop": ["\u2603"]}).json()
    assert type(r["created_at"]) is int
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60, json={
            "input": "x", "max_output_tokens": 2, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert all(type(e["response"]["created_at"]) is int for e in events if "response" in e)


# -- echo ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["def f(x):", "x = '\U0001f600\u4e16\u754c\u00e9'\nf(x)"])
def test_echoed_offsets_point_at_each_tokens_text(server, stream, prompt):
    """echo + logprobs on a text prompt: every text_offset indexes the returned text, so a
    token's text is found there (the BOS the tokenizer added has none: it takes none, and
    the offsets never run backwards). The bytes of one character (byte tokens, each U+FFFD
    alone) all stand at that character: counted one character each, an emoji's 4 put the
    quote after it at 17 where it is at 9."""
    body = {"prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 0,
            "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(ln[6:])["choices"][0] for ln in r.iter_lines()
                      if ln.startswith("data: ") and ln != "data: [DONE]"]
        text = "".join(c["text"] for c in chunks)
        tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    else:
        choice = httpx.post(server.url + "/v1/completions", json=body,
                            timeout=60).json()["choices"][0]
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
        offsets = choice["logprobs"]["text_offset"]
    assert text.startswith(prompt) and len(tokens) == len(offsets) > 4
    assert offsets == sorted(offsets)
    found = [text[o:o + len(t)] == t or "\ufffd" in t for t, o in zip(tokens, offsets)]
    assert all(found[1:]) and (found[0] or tokens[0].startswith("<|")), list(zip(tokens, offsets))
    quotes = [o for t, o in zip(tokens, offsets) if t == "'"]
    if "'" in prompt and "\ufffd" in "".join(tokens[:12]):  # its characters as bytes
        assert quotes[:2] == [4, 9] == [prompt.index("'"), prompt.index("'", 5)]


# -- errors that name the field and what it allows ----------------------------------------
def test_the_default_max_tokens_never_refuses_a_prompt(server):
    """Completions' default of 16 tokens is capped at what the prompt leaves; a max_tokens
    the client sent is held to."""
    body = {"prompt": [5] * 1020, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 16}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": "x", "stop_token_ids": [99_999_999]}, "stop_token_ids",
     "stop_token_ids must hold token ids: integers in [0, "),
    ({"messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt", "send it as the request's "
     "add_generation_prompt field"),
    ({"messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"bos_token": "<s>"}}, "chat_template_kwargs.bos_token",
     "reserved: messages, add_generation_prompt, tools, bos_token, eos_token"),
])
def test_a_value_the_server_cannot_use_is_named_with_what_it_allows(server, body, param,
                                                                     words):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, json={**body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_grammar_the_requests_own_min_tokens_blocks_says_so(server):
    """guided_choice ["a"] with "a" as a stop token and min_tokens 1: the only token the
    grammar allows is one min_tokens holds back; the 400 says that, in the request's
    terms, not the parser's."""
    a = httpx.post(server.url + "/tokenize", json={"prompt": "a", "add_special_tokens": False},
                   timeout=30).json()["tokens"]
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 4, "guided_choice": ["a"], "stop_token_ids": a[:1],
        "min_tokens": 1})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "the grammar refused output token 0" in msg and "min_tokens forbids" in msg, msg
    assert "<non-verbose/>" not in msg


def test_a_grammar_that_never_reaches_text_is_explained(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 4, "guided_grammar": "start: start"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_grammar" and "a rule may never reach text" in err["message"]
    assert "<non-verbose/>" not in err["message"]


# -- free-form fields bounded by the context -----------------------------------------------
@pytest.mark.parametrize("big", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "description": "w " * 200_000}}}], "tool_choice": "none"},
    {"chat_template_kwargs": {"x": [{"a": [1]}] * 100_000}},
])
def test_tools_or_template_kwargs_longer_than_any_prompt_are_refused_by_name(server, big):
    """A tool definition or template arguments whose JSON no prompt of this context could
    hold (whatever tool_choice says) are refused before they are built or rendered (large:
    in the body's child process), by their field; the same under the inline size."""
    (param,) = [k for k in big if k != "tool_choice"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **big})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "characters of JSON" in err["message"], err


def test_a_prompt_too_long_because_of_its_tools_names_the_tools(server):
    tool = {"type": "function", "function": {"name": "f", "description": "word " * 1500,
                                              "parameters": {"type": "object"}}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [tool]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools", err
    assert "messages and tools" in err["message"], err


def test_responses_metadata_is_bounded_as_openai_bounds_it(server):
    for meta, loc, words in (({f"k{i}": "v" for i in range(17)}, "metadata", "16 items"),
                             ({"k": "v" * 513}, "metadata.k", "at most 512 characters"),
                             ({"k" * 65: "v"}, "metadata", "at most 64 characters")):
        r = httpx.post(server.url + "/v1/responses", timeout=30,
                       json={"input": "x", "max_output_tokens": 1, "metadata": meta})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(loc), r.text
        assert words in r.json()["error"]["message"], r.text
    ok = httpx.post(server.url + "/v1/responses", timeout=30, json={
        "input": "x", "max_output_tokens": 1, "metadata": {"k": "v" * 512}})
    assert ok.status_code == 200 and ok.json()["metadata"] == {"k": "v" * 512}


# -- embeddings ---------------------------------------------------------------------------
def test_embeddings_say_they_are_not_served(server):
    import openai

    with pytest.raises(openai.APIStatusError) as info:
        client(server).embeddings.create(model="tiny", input="x")
    err = info.value
    assert err.status_code == 404 and err.code == "unsupported_endpoint"
    assert "text generation" in err.message and "embeddings" in err.message
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    op = doc["paths"]["/v1/embeddings"]["post"]
    assert "unsupported_endpoint" in op["responses"]["404"]["description"]


def test_the_server_logged_no_error(server):
    assert "Traceback" not in server.log()


# -- in-process: a stream that fails after its 200 ---------------------------------------
class _Failing:
    """A request group that yields one output, then fails with ``error`` (or yields a chunk
    whose text does not encode, with ``error`` None)."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.closed = False
        self.sent = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        from phasewise.engine.outputs import RequestOutput
        from phasewise.engine.request import RequestMetrics

        self.sent += 1
        if self.sent == 2 and self.error is not None:
            raise self.error
        if self.sent > 2:
            raise StopAsyncIteration
        text = "ok" if self.sent == 1 else "\ud800"
        return 0, RequestOutput("r", None, [1], text, [5], text, [5], False, None, None, None,
                                RequestMetrics(0.0))

    def close(self) -> None:
        self.closed = True


def _body(response) -> str:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.get("/s")(lambda: response)
    with TestClient(app) as tc:
        return tc.get("/s").content.decode("utf-8")


@pytest.mark.parametrize("error", [RuntimeError("a bug"), None])
def test_a_chunk_stream_that_fails_after_its_200_ends_with_an_error_then_done(error):
    from phasewise.server.openai_format import ChatChoices
    from phasewise.server.sse import stream_group

    group = _Failing(error)
    choices = ChatChoices(str, 1, None)
    body = _body(stream_group(group=group, rid="r", obj="chat.completion.chunk", model="m",
                              prompt_lens=[1], prompt_tokens=1, include_usage=False,
                              continuous_usage=False, render=choices.delta))
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert group.closed


@pytest.mark.parametrize("error", [ValueError("a bug"), None])
def test_a_responses_stream_that_fails_after_its_200_ends_with_its_error_events(error):
    from phasewise.server.responses import ResponseBuilder, ResponsesRequest
    from phasewise.server.sse import SSEResponse

    group = _Failing(error)
    builder = ResponseBuilder(ResponsesRequest(input="x", stream=True), "m")
    body = _body(SSEResponse(builder.events(group, 1, lambda out: None), group.close,
                             builder.failed))
    kinds = [line[7:] for line in body.splitlines() if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    assert data[-2]["code"] == "internal_error" and data[-2]["message"]
    assert data[-1]["response"]["status"] == "failed" and data[-1]["response"]["error"]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert group.closed


def _byte_tokens(pieces):
    """``(token_text, decode)`` for text_offsets over a vocabulary of ``pieces`` (a token id
    -> its bytes, or str), decoded as a lossy UTF-8 decoder does."""
    def decode(ids):
        return b"".join(p if isinstance(p, bytes) else p.encode()
                        for p in map(pieces.get, ids)).decode(errors="replace")

    return (lambda t: decode([t])), decode


def _streamed_offsets(text, decode, ids):
    """text_offsets one token a call, as a stream's chunks give them: (offsets, pos, pend)."""
    from phasewise.server.openai_format import text_offsets

    pos, pend, offsets = 0, [], []
    for t in ids:
        (off,), pos, pend = text_offsets(text, decode, [t], pos, pend)
        offsets.append(off)
    return offsets, pos, pend


def test_text_offsets_put_a_characters_bytes_at_its_start_and_a_stray_byte_in_place():
    """Byte tokens (each U+FFFD alone): the four of an emoji stand at its start and the
    next token one character on; a byte that is no character's stays a U+FFFD of its own;
    a character split across stream chunks continues where the last chunk left it."""
    from phasewise.server.openai_format import text_offsets

    text, decode = _byte_tokens({1: "a", 2: b"\xf0", 3: b"\x9f", 4: b"\x98", 5: b"\x80",
                                 6: b"\x80"})

    assert text_offsets(text, decode, [1, 2, 3, 4, 5, 1], 0) == ([0, 1, 1, 1, 1, 2], 3, [])
    # a stray continuation byte, then a letter: "\ufffda"
    assert text_offsets(text, decode, [1, 6, 1], 0) == ([0, 1, 2], 3, [])
    # the emoji's bytes over two chunks of a stream
    first = text_offsets(text, decode, [1, 2, 3], 0)
    assert first == ([0, 1, 1], 1, [2, 3])
    assert text_offsets(text, decode, [4, 5, 1], first[1], first[2]) == ([1, 1, 2], 3, [])


def test_a_stray_byte_before_a_character_leaves_its_bytes_together():
    """A stray byte just before an emoji's four: the cap of 4 bytes a character counted
    from the stray one, and every later offset was one too far."""
    from phasewise.server.openai_format import text_offsets

    text, decode = _byte_tokens({1: b"a", 2: b"\xf0", 3: b"\x9f", 4: b"\x98", 5: b"\x80",
                                 6: b"\x80", 7: b"\xc3"})
    for stray in (6, 7):  # a continuation byte, a lone lead byte
        assert text_offsets(text, decode, [stray, 2, 3, 4, 5, 1], 0) == \
            ([0, 1, 1, 1, 1, 2], 3, []), stray
        # one token a chunk, as a stream gives them
        got, pos, pend = _streamed_offsets(text, decode, [1, stray, 2, 3, 4, 5, 1])
        assert got == [0, 1, 2, 2, 2, 2, 3] and pos == 4 and not pend


def test_a_token_the_text_leaves_out_takes_no_room_and_offsets_never_look_back():
    """A sampled <|im_end|> that skip_special_tokens leaves out of the text moved every
    later offset 10 characters on; and a stray lead byte's offsets differed between a
    stream and a whole reply, which had revised them once later tokens came."""
    from phasewise.server.openai_format import text_offsets

    text, decode = _byte_tokens({1: b"ab", 2: b"\xf0", 3: b"\x9f", 4: b"\x98", 5: b"\x80",
                                 7: b"\xc3", 9: b"<|im_end|>"})

    assert text_offsets(text, decode, [1, 9, 1], 0, hidden=frozenset({9})) == \
        ([0, 2, 2], 4, [])
    for ids in ([7, 2, 3, 4, 5, 1], [2, 3, 7, 1], [7, 7, 1], [1, 7, 2, 3, 4, 5, 9, 1]):
        whole = text_offsets(text, decode, ids, 0)
        assert _streamed_offsets(text, decode, ids) == whole, ids
        assert whole[0] == sorted(whole[0]) and whole[1] == len(decode(ids)), ids


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9]), max_size=14))
def test_text_offsets_agree_streamed_and_whole_and_add_up_for_any_bytes(ids):
    from phasewise.server.openai_format import text_offsets

    text, decode = _byte_tokens({1: b"ab", 2: b"\xf0", 3: b"\x9f", 4: b"\x98", 5: b"\x80",
                                 6: b"\xe4", 7: b"\xc3", 8: b"\xa9", 9: "é".encode()})
    whole = text_offsets(text, decode, ids, 0)
    assert _streamed_offsets(text, decode, ids) == whole
    assert whole[0] == sorted(whole[0])
    assert whole[1] + len(decode(whole[2])) == len(decode(ids))


def test_a_stored_response_is_a_404_that_says_none_is_stored(server):
    """GET /v1/responses/{id} was the generic 'Not Found: GET ...'."""
    for method in ("GET", "DELETE"):
        r = httpx.request(method, server.url + "/v1/responses/resp_abc", timeout=30)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "not_found" and "stores no responses" in err["message"]
        assert "'resp_abc'" in err["message"]


def test_reasoning_options_asking_for_nothing_are_taken(server):
    """reasoning: null was taken and reasoning: {"effort": null} refused."""
    body = {"input": "hi", "max_output_tokens": 2}
    for reasoning in (None, {}, {"effort": None}, {"effort": None, "summary": None}):
        r = httpx.post(server.url + "/v1/responses", timeout=60,
                       json={**body, "reasoning": reasoning})
        assert r.status_code == 200, (reasoning, r.text)
    r = httpx.post(server.url + "/v1/responses", timeout=60,
                   json={**body, "reasoning": {"effort": "high"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning", r.text
    assert "do not reason" in r.json()["error"]["message"]
