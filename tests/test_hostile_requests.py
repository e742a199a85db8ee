"""What a hostile client found could take ``phasewise serve`` down or hold it, each pinned on a
real server process: grammars that crashed the process (a schema's $ref chain, a Lark rule
chain) or held every step (a regex's nested repetitions) or its memory, and connections that
never finish their request (slowloris). Each answer is a 400 or a closed connection, and the
server lives and serves the next request."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from conftest import build_hf_checkpoint
from serving import start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile")
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=5)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("logs") / "server.log",
                     "--log-interval", "0", "--timeout-header", "1", "--timeout-body", "1",
                     "--timeout-write", "1",
                     "--max-connections-per-address", "6")
    yield s
    s.stop()


def _alive(server) -> None:
    assert server.proc.poll() is None, server.log()
    with server.client() as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _ref_chain(levels: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["a"]} for i in range(levels)}
    defs[f"d{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _rule_chain(rules: int) -> str:
    return "\n".join(["start: r0"] + [f'r{i}: "t{i}" r{i + 1}?' for i in range(rules)]
                     + [f'r{rules}: "end"'])


@pytest.mark.parametrize("path, body, param", [
    # finding 1: the process died with SIGSEGV (a 94 KB body)
    ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": _ref_chain(1000)}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_grammar": _rule_chain(2800)},
     "guided_grammar"),
    # finding 2: accepted, then every engine step took seconds
    ("/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 30,
                         "guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    # the same regex inside a schema's pattern and a Lark terminal
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_json": {
        "type": "string", "pattern": "(a{1000}){1000}"}}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4,
                         "guided_grammar": "start: A\nA: /(a{1000}){1000}/"}, "guided_grammar"),
    # within the old bounds, compiled, then the parser's first row was over its limit (a 500)
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_json": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}},
     "guided_json"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_grammar":
                         "start: " + " | ".join(f'"w{i}"' for i in range(2100))},
     "guided_grammar"),
])
def test_a_grammar_bomb_is_a_400_and_the_server_lives(server, path, body, param):
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_grammar", err
    _alive(server)


def test_refused_grammars_leave_the_memory_as_it_was(server):
    """Finding 4: ten such regexes took ~340 MB each and kept it."""
    _alive(server)
    before = _rss_mb(server.proc.pid)
    with server.client() as c:
        for n in range(1000, 990, -1):
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                "guided_regex": f"(a{{1000}}){{{n}}}"})
            assert r.status_code == 400, r.text
        # and grammars that pass: each kept compiled, within the cache's byte budget
        for n in range(1, 21):
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                "guided_regex": f"[a-z]{{{n}}}"})
            assert r.status_code == 200, r.text
    assert _rss_mb(server.proc.pid) - before < 150
    _alive(server)


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(30)  # generous: the server's limits here are 1 s
    got = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except (ConnectionResetError, socket.timeout):
            return got
        if not chunk:
            return got
        got += chunk


def test_connections_that_send_no_request_are_evicted_past_the_cap_then_closed(server):
    """Finding 8: 1,000 idle or half-sent connections stayed open; now one address holds
    at most --max-connections-per-address of them, each gets --timeout-header, and a newer
    one closes the oldest (so squatters cannot keep a client with a request out)."""
    socks = [socket.create_connection(("127.0.0.1", server.port))]
    socks[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers, never ended
    with server.client() as c:  # a round trip after it: its bytes were read first
        assert c.get("/health").status_code == 200  # (c's connection, idle, counts too)
        socks += [socket.create_connection(("127.0.0.1", server.port)) for _ in range(9)]
        answers = [_read_until_closed(s) for s in socks]
    for s in socks:
        s.close()
    # of six slots c's kept-alive connection holds one: the oldest socket (its headers
    # begun) answered 408 to make room, the next four closed silently to make room, the
    # last five answered 408 at --timeout-header
    bodies = [json.loads(a.split(b"\r\n\r\n", 1)[1])["error"] if a else None
              for a in answers]
    assert answers[0].startswith(b"HTTP/1.1 408 ") and "to make room" in bodies[0]["message"]
    silent = [a for a in answers if not a]
    timed_out = [b for b in bodies if b is not None and "did not arrive" in b["message"]]
    assert len(silent) == 4 and len(timed_out) == 5, answers
    assert all(b["code"] == "request_timeout" for b in bodies if b is not None)
    with server.client() as c:  # a client with a request gets in past squatters
        squat = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
        assert c.get("/health").status_code == 200
        for s in squat:
            s.close()
    _alive(server)


def test_connections_that_send_headers_and_hold_the_body_count_for_their_address(server):
    """One address opened 2,100 connections that each sent a request's headers and one byte
    of its body: they stopped counting for their address once the headers were in, took
    every connection the server allows, and everyone else got 503. A body still arriving
    counts."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: 1000\r\n\r\n{")
    socks = []
    try:
        with server.client() as c:  # (its connection, idle between requests, counts too)
            for _ in range(10):
                socks.append(socket.create_connection(("127.0.0.1", server.port)))
                socks[-1].sendall(head)
                # a round trip: the head was read. c's idle connection may have been closed
                # by the 1 s header timeout (a loaded machine): sent on as it closed, the
                # request meets a reset, and goes again on a new one, which may be refused
                # while the bodies hold the address: an answer all the same
                try:
                    r = c.get("/health")
                except (httpx.ReadError, httpx.RemoteProtocolError):
                    r = c.get("/health")
                assert r.status_code == 200 or r.json()["error"]["code"] == \
                    "too_many_connections", r.text
        answers = [_read_until_closed(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    refused = [a for a in answers if b" 503 " in a.split(b"\r\n")[0]]
    assert len(refused) >= 4 and b"too_many_connections" in refused[0], answers
    _alive(server)


def test_websocket_upgrades_leave_no_count_behind(server):
    """uvicorn hands an upgraded connection to its websocket protocol, which the limits do not
    follow: each upgrade left its address one slot down for good (with ``websockets``
    installed). No route takes a websocket, so none is upgraded."""
    for _ in range(8):  # more than the fixture's 6 per address
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                      b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                      b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
            s.settimeout(30)
            assert s.recv(4096).startswith(b"HTTP/1.1 "), "no answer"
    _alive(server)


def test_a_client_that_never_reads_its_answers_is_closed(server):
    """Pipelined requests for /metrics on a socket whose client never reads: once the
    server's send buffer is full, it waits --timeout-write (1 s here) and closes the
    connection, dropping the answers it still held."""
    import time

    with server.client() as c:
        one = len(c.get("/metrics").content)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.connect(("127.0.0.1", server.port))
        n = max(50, (8 << 20) // max(one, 1))  # more than any socket buffers hold
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * n)
        time.sleep(3)  # not read meanwhile: past the server's --timeout-write
        got = _read_until_closed(s)
    assert len(got) < n * one, (len(got), n * one)  # closed with answers unsent
    _alive(server)


def test_a_body_that_never_ends_closes_its_connection(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
        _read_until_closed(s)  # returns once the server closed it
    _alive(server)
    assert "Traceback" not in server.log()


def test_a_request_sent_in_good_time_after_an_idle_gap_is_served(server):
    """A keep-alive connection that waits less than the limit, then sends, is served."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code \
            == 200
        assert c.post("/v1/completions", json={"prompt": "b", "max_tokens": 2}).status_code \
            == 200



class _Transport:
    """What the protocol does to its connection, recorded."""

    def __init__(self):
        self.written, self.eof, self.closed = b"", False, False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.9", 5000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default)

    def write(self, data):
        self.written += data

    def can_write_eof(self):
        return True

    def write_eof(self):
        self.eof = True

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = self.closed = True

    unsent = 0  # bytes the kernel has not taken (get_write_buffer_size)

    def get_write_buffer_size(self):
        return self.unsent

    def is_closing(self):
        return self.closed

    def set_protocol(self, p):
        pass

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


def test_a_refused_connection_is_answered_then_half_closed_not_reset():
    """Closing a socket with the client's bytes unread makes the kernel reset it, and the
    reset can overtake the 503 (the hostile pass saw 618 of 1,000 refusals arrive as resets):
    a refused connection's write side is shut after the answer, what still arrives is
    dropped unread, and the socket closes a little later."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from phasewise.server.limits import ConnectionLimits, guarded_protocol

    async def main():
        config = uvicorn.Config(lambda *a: None, lifespan="off")
        config.load()
        cls = guarded_protocol(ConnectionLimits(max_connections_per_address=1))
        state = ServerState()
        first, second = cls(config, state, {}), cls(config, state, {})
        t1, t2 = _Transport(), _Transport()
        first.connection_made(t1)
        # a body under way: not closed to make room (an idle one would be)
        first.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Length: 10\r\n\r\n{")
        second.connection_made(t2)  # one too many for this address
        second.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        assert t2.written.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in t2.written
        assert t2.eof and not t2.closed  # half-closed; the request it sent was not served
        assert second.cycle is None
        assert not t1.written and not t1.closed
        for p in (first, second):
            for timer in ("_header_timer", "_body_timer"):
                p._cancel(timer)

    asyncio.run(main())


def test_a_newer_connection_closes_the_oldest_idle_one_of_its_address():
    """Connections of one address that send nothing (a squatter's, or idle keep-alive ones)
    cannot fill its slots against a client with a request: the oldest that waits for a
    request's headers is answered 408 and closed, and the newcomer is served. One whose
    body is arriving is never closed so."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from phasewise.server.limits import ConnectionLimits, guarded_protocol

    async def main():
        config = uvicorn.Config(lambda *a: None, lifespan="off")
        config.load()
        cls = guarded_protocol(ConnectionLimits(max_connections_per_address=2))
        state = ServerState()
        conns = [(cls(config, state, {}), _Transport()) for _ in range(5)]
        (a, ta), (b, tb), (c, tc), (d, td), (e, te) = conns
        body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{"
        a.connection_made(ta)
        b.connection_made(tb)
        b.data_received(body)  # its body under way: never closed to make room
        c.connection_made(tc)  # a is the oldest waiting for headers: it makes room
        assert ta.closed and not ta.written  # idle: closed as an idle keep-alive one is
        assert not tb.written and not tb.closed and not tc.written
        assert cls.refusals["evicted"] == 1
        c.data_received(b"GET /health HTTP/1.1\r\n")  # part of its headers
        d.connection_made(td)  # c makes room: its headers begun, so it is answered first
        assert tc.written.startswith(b"HTTP/1.1 408 ") and b"to make room" in tc.written
        assert tc.eof and not td.written and cls.refusals["evicted"] == 2
        d.data_received(body)
        e.connection_made(te)  # b and d both receiving bodies: no room, e is refused
        assert te.written.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in te.written
        assert not tb.closed and not td.closed
        for p, _ in conns:
            for timer in ("_header_timer", "_body_timer"):
                p._cancel(timer)

    asyncio.run(main())


def test_a_request_answered_before_its_body_is_in_is_closed_not_kept():
    """A 401 (or a 413) sent before the body arrived: the connection is half-closed at once
    and the rest of the body dropped, not awaited for the body timeout while it holds a
    slot of its address."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from phasewise.server.limits import ConnectionLimits, guarded_protocol

    async def early_401(scope, receive, send):
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})

    async def main():
        config = uvicorn.Config(early_401, lifespan="off")
        config.load()
        cls = guarded_protocol(ConnectionLimits(max_connections_per_address=1))
        state = ServerState()
        p, t = cls(config, state, {}), _Transport()
        p.connection_made(t)
        p.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 1000\r\n\r\n{")
        for _ in range(20):
            await asyncio.sleep(0)
            if t.eof:
                break
        assert t.written.startswith(b"HTTP/1.1 401 "), t.written
        assert t.eof  # half-closed: nothing more is read from it
        assert p.timeout_keep_alive_task is None  # uvicorn's 5 s idle close would cut the
        # client's upload before the linger (timeout_body_s) it is promised
        p.data_received(b"x" * 999)  # the rest of the body, dropped
        second, t2 = cls(config, state, {}), _Transport()
        second.connection_made(t2)  # the first still counts until it is gone
        assert t2.written.startswith(b"HTTP/1.1 503 ")
        p.connection_lost(None)
        third, t3 = cls(config, state, {}), _Transport()
        third.connection_made(t3)
        assert not t3.written
        for q in (p, second, third):
            for timer in ("_header_timer", "_body_timer"):
                q._cancel(timer)
            if q.timeout_keep_alive_task is not None:
                q.timeout_keep_alive_task.cancel()

    asyncio.run(main())


def test_a_response_its_client_does_not_read_counts_for_its_address_then_closes():
    """A client that asked for large answers (``/metrics``, ``/tokenize``) and never read them
    held each connection for good, outside its address's count: one address took every
    connection of the server. A response whose writing is paused (the client's socket full)
    counts for its address, and is closed after ``timeout_write_s`` without progress; one
    that the client drains again is a request in progress once more."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from phasewise.server.limits import ConnectionLimits, guarded_protocol

    async def slow_answer(scope, receive, send):
        await asyncio.Event().wait()  # the answer is being written (as far as this test goes)

    async def main():
        config = uvicorn.Config(slow_answer, lifespan="off")
        config.load()
        cls = guarded_protocol(ConnectionLimits(max_connections_per_address=1,
                                                timeout_write_s=3600))
        state = ServerState()

        def connect():
            p, t = cls(config, state, {}), _Transport()
            p.connection_made(t)
            return p, t

        a, ta = connect()
        a.data_received(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # in progress
        b, tb = connect()  # a's request does not count: b is the address's one idle
        assert not tb.written
        b.connection_lost(None)
        a.pause_writing()  # the client stopped reading
        c, tc = connect()
        assert tc.written.startswith(b"HTTP/1.1 503 ")
        a.resume_writing()  # it read again: a request in progress, not counted
        d, td = connect()
        assert not td.written
        d.connection_lost(None)
        ta.unsent = 1 << 20
        a.pause_writing()

        def deadline():  # the write timer's firing, now
            assert a._write_timer is not None
            a._cancel("_write_timer")
            a._write_timeout()

        for _ in range(3):  # the client takes a little in each period: slow, not gone
            ta.unsent -= 1000
            deadline()
            assert not getattr(ta, "aborted", False)
        deadline()  # nothing taken in a whole period: closed
        assert getattr(ta, "aborted", False)
        a.connection_lost(None)
        e, te = connect()  # and its slot is back
        assert not te.written
        for q in (a, b, c, d, e):
            for timer in ("_header_timer", "_body_timer", "_write_timer"):
                q._cancel(timer)

    asyncio.run(main())


def test_a_slow_readers_progress_counts_the_kernels_send_queue():
    """A whole reply is one write: the kernel's send queue takes megabytes of it and is
    refilled from the transport's buffer only in large steps, so that buffer can stand still
    for longer than --timeout-write while a slow client reads (a client at 320 KB/s was cut
    at 3.6 MB of 8). The progress the write timer looks for counts the kernel's queue too."""
    import asyncio
    import sys

    import uvicorn
    from uvicorn.server import ServerState

    from phasewise.server.limits import ConnectionLimits, guarded_protocol

    if sys.platform != "linux":
        pytest.skip("the kernel's send queue is read on Linux")
    config = uvicorn.Config(lambda *a: None, lifespan="off")
    config.load()
    cls = guarded_protocol(ConnectionLimits(timeout_write_s=3600))
    ours, client = socket.socketpair()
    ours.setblocking(False)
    sent = 0
    try:
        while True:
            sent += ours.send(b"y" * 65536)
    except BlockingIOError:
        pass

    class Sock(_Transport):
        def get_extra_info(self, name, default=None):
            return ours if name == "socket" else super().get_extra_info(name, default)

    async def main():
        p, t = cls(config, ServerState(), {}), Sock()
        p.connection_made(t)
        t.unsent = 1 << 20  # the transport's own buffer, unchanged throughout
        p.pause_writing()
        before = p._pending()
        assert before > t.unsent  # the kernel's queue is counted
        client.recv(65536)  # the client takes some: the transport's buffer has not moved
        assert p._pending() < before
        p._cancel("_write_timer")
        p._write_timeout()  # the timer's firing: progress, so re-armed, not closed
        assert not getattr(t, "aborted", False) and p._write_timer is not None
        p._cancel("_write_timer")
        p._write_timeout()  # nothing taken since: closed
        assert getattr(t, "aborted", False)
        for timer in ("_header_timer", "_body_timer", "_write_timer"):
            p._cancel(timer)

    asyncio.run(main())
    ours.close()
    client.close()


@pytest.mark.parametrize("send_buffer", [0, 64 << 10])
def test_a_connections_kernel_buffer_is_bounded_so_an_unread_stream_parks_soon(send_buffer):
    """A loopback socket's send buffer autotunes to 4 MiB: eight unread streams of 16
    samples with logprobs filled theirs only 11-13 s in (through pd), holding every seat
    till then. Each connection's buffer is set to --send-buffer (Linux keeps twice the
    value); 0 leaves the system's own."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from phasewise.server.limits import ConnectionLimits, guarded_protocol

    config = uvicorn.Config(lambda *a: None, lifespan="off")
    config.load()
    cls = guarded_protocol(ConnectionLimits(send_buffer=send_buffer))
    ours, client = socket.socketpair()
    system = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)

    class Sock(_Transport):
        def get_extra_info(self, name, default=None):
            return ours if name == "socket" else super().get_extra_info(name, default)

    async def main():
        p = cls(config, ServerState(), {})
        p.connection_made(Sock())
        for timer in ("_header_timer", "_body_timer", "_write_timer"):
            p._cancel(timer)

    try:
        asyncio.run(main())
        got = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert got == system if send_buffer == 0 else send_buffer <= got <= 2 * send_buffer
    finally:
        ours.close()
        client.close()
    with pytest.raises(ValueError, match="--send-buffer must be 0 .* or 4KiB-64MiB"):
        ConnectionLimits(send_buffer=100)


def test_accept_errors_out_of_descriptors_fold_into_one_line_a_while(caplog):
    """asyncio logs a traceback for each connection it fails to accept when descriptors run
    out: a K/V port flood wrote 8,854 of them in 2 s. One line per ACCEPT_ERROR_EVERY_S,
    with how many it folds; any other loop error goes to the default handler."""
    import asyncio
    import logging

    from phasewise.server.limits import ACCEPT_ERROR_EVERY_S, accept_error_handler

    now = [100.0]
    handler = accept_error_handler(logging.getLogger("test.accept"), clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    other = []
    loop.default_exception_handler = other.append
    ctx = {"message": "socket.accept() out of system resource",
           "exception": OSError(24, "Too many open files")}
    with caplog.at_level(logging.ERROR, logger="test.accept"):
        for _ in range(500):
            handler(loop, ctx)
        now[0] += ACCEPT_ERROR_EVERY_S
        handler(loop, ctx)
        handler(loop, {"message": "something else"})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "Too many open files" in lines[0]
    assert "499 more such errors since the last line" in lines[1]
    assert other == [{"message": "something else"}]
    loop.close()
