"""The router's migration decisions, exact, with fake workers (``httpx.MockTransport``): a
drain notice moves a stream only where a move is allowed and another worker takes it, and
otherwise the draining worker finishes it; the resent request carries what was streamed;
a stream the router gives up on before it began ends with an error, never a hang."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from phasewise.disagg.router import Router
from phasewise.engine.backend import PromptSpec
from phasewise.engine.relay import encode_notice
from phasewise.engine.sampling_params import SamplingParams


def _line(i, ids, text, fin=None):
    d = {"i": i, "text": text, "ids": ids, "lp": None}
    if fin:
        d.update(fin=fin, stop=None, err=None, timing=None)
    return (json.dumps(d) + "\n").encode()


async def _draining():
    """Worker A: one token, the drain notice, then (if still read) the last token."""
    yield _line(0, [5], "a")
    await asyncio.sleep(0.02)
    yield encode_notice("handover")
    await asyncio.sleep(0.05)
    yield _line(0, [6], "b", fin="length")


async def _taker():
    yield _line(0, [7], "c", fin="length")


def _router(model, b_answer, max_migrations=2):
    sent: list[dict] = []

    def handle(req: httpx.Request) -> httpx.Response:
        if not req.url.path.endswith("/generate"):
            return httpx.Response(404)
        sent.append({"host": req.url.host, **json.loads(req.content)})
        if req.url.host == "a":
            return httpx.Response(200, content=_draining())
        return b_answer()

    return _two_workers(model, max_migrations=max_migrations), handle, sent


def _a_then_b(a_stream):
    """A transport handler: worker A answers with ``a_stream()``, worker B as ``_taker``."""
    def handle(req: httpx.Request) -> httpx.Response:
        if not req.url.path.endswith("/generate"):
            return httpx.Response(404)
        return httpx.Response(200, content=a_stream() if req.url.host == "a" else _taker())

    return handle


def _two_workers(model, **kw) -> Router:
    """A router of workers A and B (``kw``: the Router's own), not yet started."""
    r = Router(["http://a:1", "http://b:1"], model_dir=model, **kw)

    class Info:
        max_waiting = 256
        vocab_size = 512  # the ids the fake workers send are below it
        max_model_len = 256

    r.info = Info()
    return r


def _begin(r, handle, first="http://a:1"):
    """Start ``r`` on the running loop with no polls, its workers answered by ``handle``
    and up, ``first`` the first pick."""
    r.start(asyncio.get_running_loop())
    r._poller.cancel()
    r._client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    for w in r.decode:
        w.up, w.reason = True, None
    r.decode.sort(key=lambda w: w.url != first)  # ties go in turn: make A the first pick
    r._turn = iter(range(0, 10 ** 6, 2))


async def _serve(r, handle, first="http://a:1"):
    _begin(r, handle, first)
    group = await r.add([PromptSpec([1, 2, 3], SamplingParams(max_tokens=2))], "req1")
    out = []

    async def read():
        async for _, o in group:
            out.append(o)
    await asyncio.wait_for(read(), 10)
    return group, out


@pytest.mark.parametrize("case", ["no_moves_allowed", "nobody_takes_it"])
def test_a_drain_notice_that_cannot_move_the_stream_leaves_it_to_finish(llama_dir, case):
    busy = lambda: httpx.Response(503, json={"error": {"message": "busy",  # noqa: E731
                                                       "code": "overloaded"}})
    r, handle, sent = _router(llama_dir, busy, max_migrations=0 if case == "no_moves_allowed"
                              else 2)

    async def run():
        group, out = await _serve(r, handle)
        assert "".join(o.delta_text for o in out) == "ab"
        assert out[-1].token_ids == [5, 6] and out[-1].finish_reason == "length"
        assert "moved=" not in group.routing
        assert r.migrations["drain"] == 0 and r.migrations_failed == 0
        # no move allowed: nothing was sent to B; B refused: it was asked, with the resume
        assert [s["host"] for s in sent] == (["a"] if case == "no_moves_allowed"
                                            else ["a", "b"])
        await asyncio.sleep(0.05)  # the relays' closes
        assert [w.in_flight for w in r.decode] == [0, 0]
        await r._client.aclose()

    asyncio.run(run())


def test_a_drain_notice_moves_the_stream_with_what_it_streamed(llama_dir):
    r, handle, sent = _router(llama_dir, lambda: httpx.Response(200, content=_taker()))

    async def run():
        group, out = await _serve(r, handle)
        assert "".join(o.delta_text for o in out) == "ac"
        assert out[-1].token_ids == [5, 7]
        assert group.routing.endswith("moved=http://b:1(drain)")
        (moved,) = [s for s in sent if s["host"] == "b"]
        assert moved["moved"] is True and moved["specs"][0]["resume"] == [5]
        assert moved["specs"][0]["token_ids"] == [1, 2, 3]
        assert r.migrations["drain"] == 1
        await asyncio.sleep(0.05)
        assert [w.in_flight for w in r.decode] == [0, 0]
        await r._client.aclose()

    asyncio.run(run())


def test_a_stream_given_up_before_it_began_ends_with_an_error(llama_dir):
    r, handle, _ = _router(llama_dir, lambda: httpx.Response(200, content=_taker()))

    async def run():
        _begin(r, handle)
        group = await r.add([PromptSpec([1, 2, 3], SamplingParams(max_tokens=2))], "req1")
        # its worker falls silent past the deadline before the relay task has run at all
        url = group.routing.split()[0]
        (w,) = [x for x in r.decode if x.url == url]
        w.up, w.down_since = False, time.monotonic() - 1000
        for _, stream in r._relays.values():  # (and so has the relay: nothing came yet)
            stream.relay.last_heard -= 1000
        r._end_streams_of_silent_workers()
        with pytest.raises(Exception, match="stopped answering"):
            async for _ in group:
                pass
        await r._client.aclose()

    asyncio.run(asyncio.wait_for(run(), 10))


@pytest.mark.parametrize("code", ["too_many_connections", "overloaded"])
def test_a_worker_refusing_for_load_is_passed_over_not_marked_draining(llama_dir, code):
    """A worker's 503 for its connection limit (many bodies from the router's one address
    arriving at once) or its queue says busy, not leaving: the request goes to the next
    worker, and the first stays in use."""
    sent: list[str] = []

    def handle(req: httpx.Request) -> httpx.Response:
        if not req.url.path.endswith("/generate"):
            return httpx.Response(404)
        sent.append(req.url.host)
        if req.url.host == "a":
            return httpx.Response(503, json={"error": {"message": "busy", "code": code}})
        return httpx.Response(200, content=_taker())

    r = _two_workers(llama_dir)

    async def run():
        _, out = await _serve(r, handle)
        assert "".join(o.delta_text for o in out) == "c" and sent == ["a", "b"]
        assert [w.draining for w in r.decode] == [False, False]
        await r._client.aclose()

    asyncio.run(run())


def test_a_silent_workers_stream_moves_without_waiting_for_a_poll(llama_dir):
    """The router watches for silent workers apart from its polls (a poll of a frozen worker
    waits out its timeout): a stream whose worker answers no poll, and which has itself
    carried nothing, for the deadline moves to another worker with what it streamed,
    though no poll ran meanwhile. One still flowing is left where it is."""
    async def frozen():
        yield _line(0, [5], "a")
        await asyncio.Event().wait()  # the worker stopped mid-stream

    handle = _a_then_b(frozen)
    r = _two_workers(llama_dir, stream_deadline=0.5)

    async def run():
        _begin(r, handle)  # no polls: only the watch below
        group = await r.add([PromptSpec([1, 2, 3], SamplingParams(max_tokens=2))], "req1")
        out = []

        async def read():
            async for _, o in group:
                out.append(o)
                if o.delta_text == "a":  # A streamed its token, then froze: silent for long
                    a = r.decode[0]
                    a.down("frozen", since=time.monotonic() - 1000)

        watch = asyncio.ensure_future(r._watch_silent())
        await asyncio.wait_for(read(), 10)
        watch.cancel()
        assert "".join(o.delta_text for o in out) == "ac"
        assert r.migrations["worker_silent"] == 1
        await r._client.aclose()

    asyncio.run(run())


def test_a_stream_still_flowing_is_not_moved_for_its_workers_missed_polls(llama_dir):
    """A worker whose polls time out under load while its stream keeps coming is slow, not
    frozen: its stream stays."""
    async def flowing():
        for i in range(12):  # longer than the deadline, a token every tenth of it
            yield _line(0, [5], "a", fin="length" if i == 11 else None)
            await asyncio.sleep(0.05)

    handle = _a_then_b(flowing)
    r = _two_workers(llama_dir, stream_deadline=0.5)

    async def run():
        _begin(r, handle)
        group = await r.add([PromptSpec([1, 2, 3], SamplingParams(max_tokens=12))], "req1")
        r.decode[0].down("a poll timed out", since=time.monotonic() - 1000)
        watch = asyncio.ensure_future(r._watch_silent())
        out = [o async for _, o in group]
        watch.cancel()
        assert "".join(o.delta_text for o in out) == "a" * 12
        assert r.migrations["worker_silent"] == 0
        await r._client.aclose()

    asyncio.run(asyncio.wait_for(run(), 20))
