"""What one connection or one client may hold of a server, before any route runs.

uvicorn on its own waits forever for a request's headers and body, and takes any number of
connections: a client that opens connections and sends nothing, or a byte every few seconds
(slowloris), holds sockets and file descriptors until the server can accept no one else.
``guarded_protocol`` is uvicorn's h11 protocol with four limits (``ConnectionLimits``):

* ``timeout_header_s``: a request's headers must be complete this long after the connection
  opened or the previous response on it ended; otherwise the connection is answered 408 and
  closed. Bytes that trickle in do not restart the clock.
* ``timeout_body_s``: its body must be complete this long after its headers; otherwise the
  connection closes (the route sees the client go).
* ``timeout_write_s``: a response whose client takes none of it (the socket's send buffer
  full and not shrinking) for this long has its connection closed; while its writing is
  held up, the connection counts for its address as one without a request in progress.
  Without it, a client that sends requests for large answers (``/metrics``, ``/tokenize``)
  and never reads them holds each connection for good. (A slow reader makes progress and
  is never cut; many slow downloads behind one proxy address count against its limit.)
* ``max_connections``: connections open at once; one more is answered 503 and closed.
* ``max_connections_per_address``: connections one address holds *without a request in
  progress* (opening, sending a request's headers or body, or idle between requests). One
  more closes the address's oldest connection that is waiting for its first request's
  headers (silent: closed; still sending them: answered 408 first), or, where none is, is
  itself answered 503 and closed; an idle one over the count is closed when its response
  ends. So connections that send nothing cannot keep a client with a request to send from
  the address's slots (a router's polls come from the same address as anyone else's on its
  host). Connections whose request has arrived whole do not count: the engine's own
  waiting limit bounds those, and a router, which reaches its workers from one address, may
  hold hundreds of streams. A body still arriving counts (else one address could hold every
  connection the server takes by sending headers and no body; a router refused for that
  tries another worker), and a connection answered before its body is in (a 401, a 413) is
  closed, its client given ``timeout_body_s`` to stop sending first (what it sends is
  dropped unread; it counts for its address until closed).

``CLIENT`` tells code deeper in the request (the grammar checks' per-client share) which
address it serves; ``ClientContext`` sets it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import math
import socket
import struct
import sys
import termios
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

# The address of the client whose request the current task serves (None: not known).
CLIENT: ContextVar[str | None] = ContextVar("phasewise_client", default=None)


class ClientContext:
    """ASGI layer: ``CLIENT`` is the request's client address while the app serves it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        client = scope.get("client")
        token = CLIENT.set(client[0] if client else None)
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT.reset(token)


SEND_BUFFER = 256 << 10
MIN_SEND_BUFFER, MAX_SEND_BUFFER = 4 << 10, 64 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    timeout_header_s: float = 15.0
    timeout_body_s: float = 60.0
    max_connections: int = 2048
    max_connections_per_address: int = 64
    timeout_write_s: float = 60.0
    # Bytes of a response the kernel may hold for a client that reads none of them
    # (SO_SNDBUF; Linux reserves twice that). A request is parked (RequestGroup) only once
    # they are full, and autotuned a loopback socket grows to 4 MiB, which a stream of 16
    # samples with logprobs fills only after many seconds, all of them holding its seats.
    # Bounded, a connection carries at most about twice this per round trip. 0: the
    # system's own.
    send_buffer: int = SEND_BUFFER

    def __post_init__(self) -> None:
        for name in ("timeout_header_s", "timeout_body_s", "timeout_write_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ValueError(f"--{name[:-2].replace('_', '-')} must be in (0, 3600] "
                                 f"seconds, got {value}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_connections_per_address < 1:
            raise ValueError("--max-connections-per-address must be >= 1, got "
                             f"{self.max_connections_per_address}")
        if self.send_buffer != 0 and not MIN_SEND_BUFFER <= self.send_buffer <= MAX_SEND_BUFFER:
            raise ValueError(f"--send-buffer must be 0 (the system's own) or "
                             f"{MIN_SEND_BUFFER >> 10}KiB-{MAX_SEND_BUFFER >> 20}MiB, got "
                             f"{self.send_buffer} bytes")

    def clamped(self, open_files: int | None) -> ConnectionLimits:
        """These limits with ``max_connections`` below the process's file limit (less a
        margin for the model, logs and a router's own connections to its workers)."""
        if open_files is None or open_files <= 0:
            return self
        room = max(16, (open_files - 64) // 2)
        if self.max_connections <= room:
            return self
        return dataclasses.replace(self, max_connections=room,
                                   max_connections_per_address=min(
                                       self.max_connections_per_address, room))


_LINGER_S = 2.0
# ioctl: bytes in a socket's kernel send queue (Linux's SIOCOUTQ, which is TIOCOUTQ)
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None


# asyncio's accept loop, out of file descriptors, logs a traceback for every pending
# connection it tries (thousands a second under a flood); one line this often says it all
ACCEPT_ERROR_EVERY_S = 10.0
_ACCEPT_ERROR = "socket.accept() out of system resource"


def accept_error_handler(log: Any, clock: Any = time.monotonic) -> Any:
    """An event-loop exception handler: asyncio's "out of system resource" accept errors
    become one line at most every ``ACCEPT_ERROR_EVERY_S`` (with how many were folded into
    it); every other error goes to the loop's default handler."""
    last = [-math.inf]
    folded = [0]

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_ERROR:
            loop.default_exception_handler(context)
            return
        now = clock()
        if now - last[0] < ACCEPT_ERROR_EVERY_S:
            folded[0] += 1
            return
        try:
            import resource

            limit = f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
        except (ImportError, ValueError, OSError):
            limit = "unknown"
        log.error("cannot accept connections: %s (open-file limit, ulimit -n: %s); new ones "
                  "wait in the listen backlog until descriptors free up%s",
                  context.get("exception"), limit,
                  f"; {folded[0]} more such errors since the last line" if folded[0] else "")
        last[0], folded[0] = now, 0

    return handler


def _refusal(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"
                                 if status < 500 else "server_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def guarded_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol class under ``limits`` (one class, one count, per server)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # address -> its connections without a request in progress, oldest first
    waiting: dict[str, dict[Any, None]] = {}
    told_cap = [False]  # a send buffer the kernel capped is said once
    counts = {"refused": 0, "header_timeouts": 0, "body_timeouts": 0, "write_timeouts": 0,
              "evicted": 0}

    class GuardedH11Protocol(H11Protocol):
        refusals = counts

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if limits.send_buffer and sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer)
                    got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                except OSError:  # a socket that takes no such option: the system's own
                    got = None
                # Linux keeps twice the value asked, at most twice net.core.wmem_max
                if got is not None and sys.platform == "linux" and \
                        got < 2 * limits.send_buffer and not told_cap[0]:
                    told_cap[0] = True
                    logging.getLogger("phasewise.server").info(
                        "--send-buffer %d: the kernel holds %d bytes a connection "
                        "(net.core.wmem_max caps it)", limits.send_buffer, got)
            self._addr = self.client[0] if self.client else ""
            self._counted = False
            self._refused = False
            self._header_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            self._write_timer: asyncio.TimerHandle | None = None
            self._stalled = False  # writing paused: the client does not read
            self._served = False  # a response has been sent on it (then it is kept alive)
            self._unsent = 0  # bytes waiting to be sent when the write timer was set
            if len(self.connections) > limits.max_connections:
                self._refuse(503, "Service Unavailable", "the server holds "
                             f"{limits.max_connections} connections, its limit; try again",
                             "too_many_connections")
                return
            mine = waiting.get(self._addr, {})
            if len(mine) >= limits.max_connections_per_address:
                # The oldest that has not yet sent its first request's headers (silent,
                # or still sending them) makes room: connections that send nothing cannot
                # hold the address's every slot against a client that has a request to
                # send (a router polling its workers from the same address as a squatter).
                # A kept-alive one, which has served a request, is not closed so: its
                # client may be sending the next request as it closes.
                oldest = next((p for p in mine if p._evictable()), None)
                if oldest is None:
                    self._refuse(503, "Service Unavailable", "this address holds "
                                 f"{limits.max_connections_per_address} connections without a "
                                 "request in progress, the limit; reuse or close them",
                                 "too_many_connections")
                    return
                oldest._evict()
            self._count(True)
            self._arm_header_timer()

        def _evictable(self) -> bool:
            """Counted, and waiting for its first request's headers (not a body, nor a
            client to read a response, nor a kept-alive connection's next request)."""
            return (self._counted and self._header_timer is not None and not self._refused
                    and not self._served)

        def _evict(self) -> None:
            """Closed to make room: with no byte of a request in, without a word (as a
            connection may be closed before its first request); with part of its headers,
            answered 408 first."""
            counts["evicted"] += 1
            self._cancel("_header_timer")
            self._count(False)
            if not self.conn.trailing_data[0]:
                self._refused = True
                self.transport.close()
                return
            self._refuse(408, "Request Timeout", "closed to make room for a newer connection "
                         "from this address: this one had no request under way, and the "
                         f"address holds {limits.max_connections_per_address} such "
                         "connections, the limit", "request_timeout")

        def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
            """Answer, then close (``_close_after_answer``)."""
            if status != 408:
                counts["refused"] += 1
            if self.transport.is_closing():
                self._refused = True
                return
            self.transport.write(_refusal(status, reason, message, code))
            self._close_after_answer(_LINGER_S)

        def _close_after_answer(self, linger_s: float) -> None:
            """Close a connection whose answer is written. Closing with the client's bytes
            unread would make the kernel send a reset, which can overtake the answer: so
            the write side is shut and what still arrives is read and dropped, for at most
            ``linger_s``."""
            self._refused = True
            transport = self.transport
            if transport.is_closing():
                return
            if transport.can_write_eof():
                transport.write_eof()
                self.loop.call_later(linger_s, transport.close)
            else:
                transport.close()

        def _count(self, on: bool) -> None:
            if on == self._counted:
                return
            self._counted = on
            mine = waiting.setdefault(self._addr, {})
            if on:
                mine[self] = None  # the newest
            else:
                mine.pop(self, None)
                if not mine:
                    del waiting[self._addr]

        def _cancel(self, name: str) -> None:
            timer = getattr(self, name)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

        def _arm_header_timer(self) -> None:
            self._cancel("_header_timer")
            self._header_timer = self.loop.call_later(limits.timeout_header_s,
                                                      self._header_timeout)

        def _header_timeout(self) -> None:
            self._header_timer = None
            counts["header_timeouts"] += 1
            self._refuse(408, "Request Timeout", "the request's headers did not arrive "
                         f"within {limits.timeout_header_s:g} s", "request_timeout")

        def _body_timeout(self) -> None:
            self._body_timer = None
            counts["body_timeouts"] += 1
            if not self.transport.is_closing():
                self.transport.close()  # the route, if it waits for the body, sees it go

        def data_received(self, data: bytes) -> None:
            if self._refused:  # answered already: read and dropped until the close
                return
            super().data_received(data)
            self._follow()

        def _follow(self) -> None:
            """After h11 parsed what arrived: start or stop the clocks."""
            state = self.conn.their_state
            if self._header_timer is not None and state is not h11.IDLE:
                self._cancel("_header_timer")
                if state is h11.SEND_BODY:  # still counted until its body is in
                    self._body_timer = self.loop.call_later(limits.timeout_body_s,
                                                            self._body_timeout)
                else:  # the request is whole: in progress from here
                    self._in_progress()
            if self._body_timer is not None and state is not h11.SEND_BODY:
                self._cancel("_body_timer")
                self._in_progress()

        def _in_progress(self) -> None:
            """A request is running on this connection: it stops counting for its address,
            unless its client is not reading what it is sent."""
            if not self._stalled:
                self._count(False)

        def pause_writing(self) -> None:
            super().pause_writing()
            self._stalled = True
            self._count(True)
            self._arm_write_timer()

        def resume_writing(self) -> None:
            super().resume_writing()
            self._cancel("_write_timer")
            if self._stalled:
                self._stalled = False
                if (self._header_timer is None and self._body_timer is None
                        and not self._refused):
                    self._count(False)  # back to a request in progress

        def _pending(self) -> int:
            """Bytes of this connection's answers the client has not taken: the transport's
            buffer and, on Linux, the kernel's send queue, which holds megabytes and is
            refilled from the buffer only in large steps (so the buffer alone can stand
            still for seconds while a slow client reads)."""
            n = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            if sock is not None and _OUTQ is not None:
                try:
                    n += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0" * 4))[0]
                except (OSError, ValueError):
                    pass
            return n

        def _arm_write_timer(self) -> None:
            """The client must take some of what is pending within ``timeout_write_s``."""
            self._cancel("_write_timer")
            self._unsent = self._pending()
            self._write_timer = self.loop.call_later(limits.timeout_write_s,
                                                     self._write_timeout)

        def _write_timeout(self) -> None:
            """No resume in ``timeout_write_s``: closed, unless the client took some of what
            waits (a whole reply is one write: a client reading it slowly never lets the
            buffer fall to the resume mark, yet it is reading)."""
            self._write_timer = None
            if self._pending() < self._unsent:
                self._arm_write_timer()
                return
            counts["write_timeouts"] += 1
            self.transport.abort()  # what it holds unsent is dropped

        def on_response_complete(self) -> None:
            self._served = True
            if self._body_timer is not None:
                # answered before its body was in: closed, and counted until then
                # (connection_lost); a client still uploading gets as long as its body had
                # to arrive before the socket closes under it
                self._cancel("_body_timer")
                super().on_response_complete()
                self._unset_keepalive_if_required()  # (its idle timer would close it first)
                self._close_after_answer(limits.timeout_body_s)
                return
            if not self.transport.is_closing():
                others = len(waiting.get(self._addr, ())) - (1 if self._counted else 0)
                if others >= limits.max_connections_per_address:
                    self.transport.close()  # one idle connection too many: not kept
                else:
                    self._count(True)
                    self._arm_header_timer()
            super().on_response_complete()
            self._follow()  # a pipelined request may have been parsed just now

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel("_header_timer")
            self._cancel("_body_timer")
            self._cancel("_write_timer")
            self._count(False)
            super().connection_lost(exc)

    return GuardedH11Protocol
