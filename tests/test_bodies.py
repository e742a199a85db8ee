"""Request bodies larger than ``bodies.INLINE_BYTES`` are validated in a child process and come
back in pieces (finding 7 of the hostile client: one 8 MiB body of 280,000 empty chat messages
held the event loop for 1.37 s). The model that comes back is the one validation on the loop
gives, an invalid body the same error, and the loop serves other work meanwhile."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.exceptions import RequestValidationError

from phasewise.server import bodies
from phasewise.server.bodies import BodyParser
from phasewise.server.errors import validation_error


@pytest.fixture(scope="module")
def parser():
    p = BodyParser()
    yield p
    p.close()


def _parse(parser: BodyParser, name: str, raw: bytes):
    async def go():
        try:
            return await parser.parse(name, raw)
        except RequestValidationError as e:
            return validation_error(e).body()
    return asyncio.run(go())


def _inline(name: str, raw: bytes):
    try:
        return bodies.validate(name, raw)
    except RequestValidationError as e:
        return validation_error(e).body()


LARGE = [
    ("ChatCompletionRequest", {"messages": [
        {"role": "user" if i % 2 else "assistant", "content": f"message {i} " * 3,
         **({"name": "n"} if i % 7 == 0 else {})} for i in range(3000)],
        "max_tokens": 5, "tools": [{"type": "function", "function": {
            "name": f"f{i}", "parameters": {"type": "object"}}} for i in range(20)]}),
    # items of different shapes pickled together in runs
    ("ChatCompletionRequest", {"messages": [
        [{"role": "user", "content": [{"type": "text", "text": f"part {i}", "x": {"k": [i]}}]},
         {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "function": {
             "name": "f", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": f"c{i}", "content": "ok", "extra": {"a": None}},
         {"role": "system", "content": "s", "name": f"n{i}"}][i % 4] for i in range(1200)]}),
    ("CompletionRequest", {"prompt": [[(i * j) % 500 for i in range(900)] for j in range(40)],
                           "n": 2, "stop": ["a", "b"], "max_tokens": 3}),
    ("CompletionRequest", {"prompt": "x = 1\n" * 20_000, "guided_json": {
        "type": "object", "properties": {"a": {"type": "string"}}}}),
    ("TokenizeRequest", {"messages": [{"role": "user", "content": "hi " * 10}] * 2000}),
    ("DetokenizeRequest", {"tokens": list(range(30_000))}),
    ("ResponsesRequest", {"input": [{"role": "user", "content": "hello " * 5}] * 2500,
                          "metadata": {"k": "v"}}),
]


@pytest.mark.parametrize("name, body", LARGE, ids=[f"{n}-{i}" for i, (n, _) in
                                                    enumerate(LARGE)])
def test_a_large_body_comes_back_as_validation_on_the_loop_gives_it(parser, name, body):
    raw = json.dumps(body).encode()
    assert len(raw) > bodies.INLINE_BYTES
    before = parser.offloaded
    got = _parse(parser, name, raw)
    assert parser.offloaded == before + 1
    want = bodies.validate(name, raw)
    assert type(got) is type(want)
    assert got.model_dump() == want.model_dump()
    assert getattr(got, "__pydantic_private__", None) == getattr(want, "__pydantic_private__",
                                                                 None)


def test_small_items_travel_in_runs_and_a_large_one_alone():
    """A run's load is short (the loop's turn comes between two) and few (a load per item
    costs the GIL microseconds each, a million times for a million ids)."""
    import pickle

    model = bodies.validate("DetokenizeRequest",
                            json.dumps({"tokens": list(range(100_000))}).encode())
    layout, frames = bodies._pieces(model)
    assert layout["lists"] == [["tokens", len(frames) - 1]]
    assert len(frames) - 1 <= 100  # runs of thousands, not 100,000 items
    assert all(len(f) < 2 * bodies.PIECE_BYTES for f in frames[1:])
    assert bodies._assemble([json.dumps(layout).encode(), *frames]).tokens == list(range(100_000))

    big = "y" * (3 * bodies.PIECE_BYTES)
    messages = [{"role": "user", "content": f"m{i}"} for i in range(2000)]
    messages[1000]["content"] = big
    model = bodies.validate("ChatCompletionRequest", json.dumps({"messages": messages}).encode())
    layout, frames = bodies._pieces(model)
    runs = [pickle.loads(f) for f in frames[1:]]
    assert [[m.content for m in run] for run in runs if len(run) == 1] == [[big]]
    assert [m.content for run in runs for m in run] == [m["content"] for m in messages]


@pytest.mark.parametrize("name, body", [
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": ""}] * 3000
                               + [{"role": "bogus", "content": "x"}]}),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "\ud800" + "x" * 20_000}]}),
    ("CompletionRequest", {"prompt": [[1, 2, 3]] * 5000 + [[1, "two"]]}),
    ("CompletionRequest", {"prompt": "x" * 20_000, "n": 17}),
    ("CompletionRequest", {"prompt": "x" * 20_000, "stream_options": {"include_usage": True}}),
    ("TokenizeRequest", {"prompt": "x" * 20_000, "messages": []}),
])
def test_a_large_invalid_body_gets_the_same_400(parser, name, body):
    raw = json.dumps(body).encode()
    assert len(raw) > bodies.INLINE_BYTES
    got = _parse(parser, name, raw)
    assert isinstance(got, dict) and got == _inline(name, raw), got
    assert got["error"]["message"]


def test_bad_json_and_an_empty_body_are_400s_as_before(parser):
    assert "not valid JSON" in _parse(parser, "CompletionRequest", b'{"prompt": ')["error"][
        "message"]
    assert "not valid JSON" in _parse(parser, "CompletionRequest",
                                      b'{"prompt": "' + b"x" * 20_000 + b'"')["error"]["message"]
    assert "empty" in _parse(parser, "CompletionRequest", b"")["error"]["message"]
    deep = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert "not valid JSON" in _parse(parser, "CompletionRequest", deep)["error"]["message"]
    # a number of more digits than Python converts (was a 500, and killed the child)
    for pad in (b"", b" " * 20_000):  # on the loop, and in the child
        huge = b'{"prompt": "hi", "foo": ' + b"9" * 4301 + pad + b"}"
        got = _parse(parser, "CompletionRequest", huge)
        assert "a number with more than 4300 digits" in got["error"]["message"], got
    ok = _parse(parser, "CompletionRequest", b'{"prompt": "hi"' + b" " * 20_000 + b"}")
    assert ok.prompt == "hi"  # the child still answers


def test_the_event_loop_serves_other_work_while_a_large_body_validates(parser):
    """Ordering, not timing: a task that needs a few turns of the loop finishes before the
    validation of 150,000 messages does (validated on the loop, it could not start until
    then)."""
    raw = json.dumps({"messages": [{"role": "user", "content": ""}] * 150_000}).encode()
    events: list[str] = []

    async def other():
        for _ in range(5):
            await asyncio.sleep(0)
        events.append("other work done")

    async def big():
        await parser.parse("ChatCompletionRequest", raw)
        events.append("large body validated")

    async def main():
        await asyncio.gather(big(), other())

    asyncio.run(main())
    assert events == ["other work done", "large body validated"]


def test_a_large_body_the_model_could_never_serve_is_refused_in_the_child():
    """With the served model's limits the child refuses, with the route's own errors, what
    the route would refuse only after walking or templating it (the server's process never
    builds it); what fits comes back."""
    from phasewise.server.admission import Limits
    from phasewise.server.errors import ApiError

    parser = BodyParser(Limits(max_model_len=1024, max_prompt_chars=20_000, max_waiting=64))

    def refused(name, body):
        raw = json.dumps(body).encode()
        assert len(raw) > bodies.INLINE_BYTES
        with pytest.raises(ApiError) as e:
            asyncio.run(parser.parse(name, raw))
        return e.value

    try:
        err = refused("ChatCompletionRequest",
                      {"messages": [{"role": "user", "content": ""}] * 5000})
        assert (err.status, err.param, err.code) == (400, "messages",
                                                     "context_length_exceeded")
        assert "5000 messages" in err.message
        err = refused("CompletionRequest", {"prompt": [7] * 9000})
        assert (err.param, err.code) == ("prompt", "context_length_exceeded")
        err = refused("CompletionRequest", {"prompt": ["x" * 30_000]})
        assert (err.param, err.code) == ("prompt", "context_length_exceeded")
        err = refused("CompletionRequest", {"prompt": [[7] * 20] * 500, "n": 2})
        assert err.code == "invalid_combination"
        err = refused("ResponsesRequest", {"input": [{"role": "user", "content": "x"}] * 2000})
        assert (err.param, err.code) == ("input", "context_length_exceeded")
        fits = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 900}).encode()
        assert len(asyncio.run(parser.parse("ChatCompletionRequest", fits)).messages) == 900
    finally:
        parser.close()


def test_a_lone_surrogate_is_named_with_its_position():
    got = _inline("CompletionRequest", b'{"prompt": "ab\\udc00c", "max_tokens": 1}')
    assert "a lone surrogate at position 2" in got["error"]["message"], got
