"""The KV transport over pyzmq: the decode worker's KV port (:class:`KVServer`, a ROUTER) and the
prefill worker's connection to it (:class:`KVClient`, a DEALER).

Threads and sockets. A zmq socket belongs to one thread, so each endpoint runs one I/O thread
that owns its network socket; calls from other threads (``send``, ``send_kv``...) reach it
through an inproc pipe. Every endpoint has its own zmq context, closes its sockets with
linger 0 and joins its thread in ``close()`` (also a context manager).

Security. The port speaks CurveZMQ: its key pair and the one every prefill worker uses are
derived from the shared secret (:func:`~phasewise.disagg.wire.curve_secret_key`), and a ZAP
handler on the server's I/O thread accepts only the client key derived from it (with
``ZMQ_ZAP_ENFORCE_DOMAIN``, so a missing handler refuses rather than admits). A peer without
the secret, or of protocol version 3 or older (no CURVE), fails zmq's security handshake:
zmq takes no message part from it at all, so nothing it sends is buffered beyond the
handshake command being read, and the application never sees it. Each such failure
(mechanism mismatch, a wrong server key, a client key the ZAP handler refuses, a malformed
command, a connection closed mid-handshake) is reported by a zmq socket monitor and counted
as ``unauthenticated.curve``, with one warning line a minute at most. A connection that is
not ZMTP at all, or declares a frame over the limit, is cut by zmq before the handshake
starts and is not counted (it cost nothing). After the handshake every message part is
encrypted and authenticated by zmq (CurveZMQ: XSalsa20-Poly1305, forward-secret session
keys), so what crosses the K/V network can be neither read nor altered nor injected by
anyone without the secret. It costs CPU: the sender encrypts and the receiver decrypts every
K/V byte once, each on its endpoint's zmq I/O thread (so one connection's rate is bounded
by one core's; its cost against plain zmq is in benchmarks/RESULTS.md, "P/D
disaggregation"). zmq handles each message part on its own, so the part size
(:data:`~phasewise.disagg.wire.KV_PART_BYTES`) is a trade between that rate and what a
stranger's connection can make the port hold (below).

What a stranger can make the process hold. libzmq reads a frame into memory of the size its
header declares (up to ``ZMQ_MAXMSGSIZE``, checked against that header; a bigger one drops
the connection unread) before anything else happens to it, even during the security
handshake, and that limit is per socket, not per handshake state. So the port's zmq limit,
:data:`PORT_FRAME_LIMIT`, is one message part: :data:`~phasewise.disagg.wire.KV_PART_BYTES`
(64 KiB) plus CURVE's framing (a K/V frame's payload travels in parts of that size; control
messages are no bigger). A connection that has not completed the security handshake holds
at most one such frame plus libzmq's own state for a connection (about 14 KiB more,
measured: its read buffer, the handshake's), about 80 KB in all, and for at most
:data:`SECURITY_HANDSHAKE_S` seconds: zmq's handshake interval, after which zmq drops it (a
real handshake takes milliseconds; its slowest step is the ZAP answer from this module's
I/O thread). zmq caps neither how many connections a port accepts nor how many are in their
handshake, and the port cannot do it without racing zmq: ``ZMQ_MAX_SOCKETS`` counts zmq
sockets, not connections; the socket monitor names an accepted connection's descriptor but
not which connection a handshake event is about, and shutting a descriptor down behind
zmq's back could hit one the process has reused meanwhile. So the bound is (connections) x
(about 80 KB), each for at most that interval: a stranger who keeps 1,000 connections open
by reopening them makes the port hold about 80 MB, and what bounds their number is the
process's descriptor limit and who can reach the port. zmq buffers a multipart message
whole, whatever its number of parts, only after the security handshake, for a peer that
holds the secret.

Memory handed back. libzmq frees what a refused connection held, but glibc keeps freed heap
pages in the process (and once its mmap threshold has risen, as a large process's big frees
make it, even a frame's buffer comes from the heap), so a flood's peak would stay resident
for good. So, once refused connections could have held :data:`HEAP_TRIM_AFTER_BYTES` in all,
the server's I/O thread calls glibc's ``malloc_trim(0)``, a second after the first of them
(libzmq has freed their buffers by then) and at most once every
:data:`HEAP_TRIM_INTERVAL` seconds (it walks every arena: tens of milliseconds in a large
process, with the GIL released); each such call is counted as ``heap_trims``. Without
glibc nothing is done.

Server side, per connection, for a peer past the security handshake: until this module's
handshake (see :mod:`phasewise.disagg.wire`) succeeds, a message is judged by its shape before
a byte of it is read: anything but one part of at most
:data:`~phasewise.disagg.wire.PREAUTH_MAX_BYTES` is dropped unread (``unauthenticated.oversized``
or ``.unexpected``), a part that is not a well-formed ``Open``/``Hello`` (bad UTF-8 or JSON,
nested deeper than :data:`~phasewise.disagg.wire.MAX_NESTING`) is dropped as
``unauthenticated.malformed``, any other message as ``unauthenticated.unexpected``; each also
counts in ``unauthenticated``. Such drops log one warning line a minute at most, with counts
and never the peer's bytes. So no frame of a peer that has not completed the handshake
reaches the :class:`~phasewise.disagg.wire.FrameGate`. The challenge names nothing of the
layout; only a peer whose hello carries a valid MAC is told which layout field differs.
``max_frame_bytes`` (64 MiB by default, announced in the ``Accept``; a prefill worker splits
a bigger chunk into frames of whole blocks) bounds one K/V frame's payload: a bigger one is
dropped (``frame_errors.size``) before its parts are joined.

After authentication control messages are parsed on the I/O thread, bounded rather than moved:
``json.loads`` holds the GIL, so parsing on another thread would stall the engine just the
same, and everything a prefill worker sends the decode side is small, so the server parses at
most :data:`~phasewise.disagg.wire.MAX_CONTROL_BYTES` of a message or frame header
(``messages.malformed`` / ``frame_errors.malformed`` beyond it). After it:

- a KV frame is checked (:func:`~phasewise.disagg.wire.decode_kv_frame`) then judged by the
  server's ``gate``; for an ``ok`` frame the ``on_frame(peer, header, payload)`` callback runs
  on the I/O thread under the gate's lock (copy the payload into the pool there; the payload
  view is only valid during the call). Every frame, admitted or not, also becomes a
  :class:`FrameEvent` on ``events``; its ``payload`` is set (for ``ok`` frames) only when there
  is no ``on_frame``.
- a control message becomes a :class:`MessageEvent` whose ``outcome`` is the gate's verdict
  (``ok``/``stale``/``foreign``) for request-scoped messages and ``ok`` otherwise; a ``Done``
  for the current attempt records its frame count in the gate.
- liveness: any message refreshes the peer; one silent for ``heartbeat_deadline`` seconds is
  ``lost`` (a :class:`PeerEvent`; it becomes ``alive`` again if it speaks). A hello whose
  ``name`` was bound to another identity *replaces* that peer: the old identity's attempts are
  forgotten (their later frames are ``foreign``) and the event lists them. The server answers
  each heartbeat, so a client knows how long the server has been silent
  (``KVClient.silent_for``): a server that died, or restarted and no longer knows the
  session, answers nothing.
"""

from __future__ import annotations

import ctypes
import hmac
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from phasewise.disagg.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    KV_PART_BYTES,
    MAX_CONTROL_BYTES,
    PREAUTH_MAX_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Accept,
    Buffer,
    Bye,
    Challenge,
    ChallengeBook,
    check_secret,
    curve_secret_key,
    Done,
    Error,
    FirstToken,
    FrameError,
    FrameGate,
    HandshakeError,
    Heartbeat,
    Hello,
    KVFrameHeader,
    KVLayout,
    MessageError,
    Open,
    PrefillRequest,
    Refuse,
    decode_kv_frame,
    decode_message,
    encode_kv_frame,
    encode_message,
    make_accept,
    make_hello,
    verify_accept,
    verify_hello,
)

log = logging.getLogger(__name__)

PeerState = Literal["alive", "lost", "replaced", "closed"]

PREAUTH_DROP_REASONS = ("oversized", "malformed", "unexpected")
"""Why a message from a peer that has not completed the handshake was dropped (counted as
``unauthenticated.<reason>``)."""

PREAUTH_LOG_INTERVAL = 60.0
"""Seconds between two warning lines about such drops, about connections refused by the
security handshake, or about refusals for a wrong key or nonce (the counters count every
one)."""

ZAP_DOMAIN = b"phasewise-kv"

_CURVE_FRAMING = 64
"""Bytes CURVE adds to a message part on the wire (33: the MESSAGE command name, a nonce, a
flags byte and the MAC), rounded up: zmq checks ``ZMQ_MAXMSGSIZE`` against the encrypted
part."""

PORT_FRAME_LIMIT = max(KV_PART_BYTES, MAX_CONTROL_BYTES) + _CURVE_FRAMING
"""The K/V port's ``ZMQ_MAXMSGSIZE``: the largest frame zmq reads from anyone, a security
handshake command included, so what one stranger's connection can make the port hold."""

SECURITY_HANDSHAKE_S = 5.0
"""zmq's handshake interval on both ends (``ZMQ_HANDSHAKE_IVL``): a connection that has not
completed the security handshake by then is dropped. A real one takes milliseconds (the
ZAP answer comes from the server's I/O thread, which never waits on the engine); a
stranger's holds up to :data:`PORT_FRAME_LIMIT` for this long. The client gives up as soon
as the server would, so zmq reconnects rather than waits on a handshake that cannot
succeed."""

HEAP_TRIM_INTERVAL = 5.0
"""Seconds at least between two hand-backs of freed heap after refused connections."""

HEAP_TRIM_AFTER_BYTES = 4 << 20
"""Hand freed heap back once refused connections could have held this much in all (each
:data:`PORT_FRAME_LIMIT`): fewer cannot have left enough to be worth walking the heap."""

_TRIM_SETTLE_S = 1.0
"""Seconds from a refusal to the hand-back that covers it: zmq reports a failed handshake
just before it frees that connection's buffers, on its own thread."""

_SECURITY_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
"""Monitor events for a connection that did not get through zmq's security handshake."""


def _security_failure(event: int, value: int) -> str:
    """A monitor event about a failed security handshake, in words (for either side)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the server refused the client's key (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "one side does not speak CURVE"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "the client's handshake does not decrypt with the server's key"
        return f"ZMTP protocol error {value:#x}"
    return "the connection was closed during it"


def _heap_trimmer() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)`` (hands the free pages of every arena back to the system),
    or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # TypeError on Windows: no such library handle
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def _rss_mb() -> float | None:
    """This process's resident memory in MB (Linux), for a log line."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _curve_keys(secret: bytes) -> dict[str, tuple[bytes, bytes]]:
    """Side -> (public, secret) Z85 key pair, derived from the shared secret."""
    out = {}
    for side in ("server", "client"):
        sk = z85.encode(curve_secret_key(secret, side))  # type: ignore[arg-type]
        out[side] = (zmq.curve_public(sk), sk)
    return out


# --------------------------------------------------------------------------------------------
# events


@dataclass(frozen=True)
class FrameEvent:
    """A KV frame arrived from ``peer``. ``outcome``: a gate outcome (``ok``, ``stale``,
    ``foreign``, ``duplicate``, ``out_of_range``, ``mismatch``), a frame error kind
    (``malformed``, ``size``, ``checksum``) or ``apply_failed`` (``on_frame`` raised)."""

    peer: str
    header: KVFrameHeader | None
    outcome: str
    payload: memoryview | None = None
    detail: str = ""


@dataclass(frozen=True)
class MessageEvent:
    """A control message from ``peer``; act on it only when ``outcome == "ok"``."""

    peer: str
    message: Any
    outcome: str


@dataclass(frozen=True)
class PeerEvent:
    """``peer`` is now ``state`` (``accepted``, ``lost``, ``alive``, ``replaced``, ``closed``).
    For ``replaced``, ``forgotten`` lists the request ids whose attempts were dropped and
    ``replaced_by`` the new identity."""

    peer: str
    state: str
    name: str
    forgotten: tuple[str, ...] = ()
    replaced_by: str = ""


Event = FrameEvent | MessageEvent | PeerEvent


@dataclass(frozen=True)
class PeerInfo:
    identity: str
    name: str
    role: str
    state: str
    queue: int = 0  # the peer's last reported queue (heartbeats)


# --------------------------------------------------------------------------------------------
# plumbing


class _Pipe:
    """An inproc PUSH -> PULL pair: any thread pushes (under a lock), the I/O thread pulls."""

    def __init__(self, ctx: zmq.Context, tag: str):
        addr = f"inproc://phasewise-kv-{tag}-{uuid.uuid4().hex}"
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(addr)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(addr)
        self._lock = threading.Lock()
        self._closed = False

    def push(self, parts: list[Any]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("endpoint is closed")
            self._push.send_multipart(parts, copy=False)

    def close_push(self) -> None:
        with self._lock:
            self._closed = True
            self._push.close(linger=0)


def _bind_address(bind: str) -> str:
    """zmq spells "any free port" ``*``; accept the usual ``:0`` too."""
    return bind[:-2] + ":*" if bind.endswith(":0") else bind


def _new_identity() -> str:
    return uuid.uuid4().hex


def _claimed_version(data: bytes) -> int | None:
    """The ``version`` a small JSON object names, if any: how a client tells a server of
    another protocol version from a broken one when its challenge does not decode."""
    if len(data) > PREAUTH_MAX_BYTES:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    v = obj.get("version") if isinstance(obj, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# --------------------------------------------------------------------------------------------
# the client's frame hook


class FrameHook(Protocol):
    """What may stand between a :class:`KVClient` and its socket (tests inject deterministic
    faults through one: ``tests/faults.py``). Called on the sending thread for every K/V
    frame, and on the I/O thread before each heartbeat."""

    def outgoing(self, seq: int, parts: list[Any]) -> list[list[Any]]:
        """The multipart messages to send now, in order, for frame ``seq``."""
        ...

    def flush(self) -> list[list[Any]]:
        """Messages still held back, sent before an attempt's ``Done``."""
        ...

    @property
    def heartbeats_muted(self) -> bool:
        """True while the client's heartbeats are to stay unsent."""
        ...


# --------------------------------------------------------------------------------------------
# server


@dataclass
class _Session:
    rid: bytes
    identity: str
    name: str
    role: str
    state: str
    last_seen: float
    queue: int = 0


class _Endpoint:
    """What both ends share: one I/O thread that owns the socket, stopped through the pipe;
    ``close()`` (also on leaving a ``with`` block) stops it and ends the zmq context."""

    _closed: bool
    _pipe: _Pipe
    _thread: threading.Thread
    _ctx: zmq.Context

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._pipe.push([b"stop"])
        except RuntimeError:
            pass
        self._thread.join(timeout=10)
        self._pipe.close_push()
        if self._thread.is_alive():  # pragma: no cover - only if a callback hangs
            log.error("%s I/O thread did not stop; leaving its zmq context open",
                      type(self).__name__)
            return
        self._ctx.term()

    def __enter__(self) -> _Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVServer(_Endpoint):
    """The decode worker's KV port.

    ``KVServer(bind="tcp://127.0.0.1:0", *, secret, layout, identity=None, on_frame=None,
    heartbeat_deadline=5.0, max_frame_bytes=None)``; ``.endpoint`` is the bound address with
    its real port. ``max_frame_bytes`` is the largest K/V frame payload the port takes
    (default :data:`~phasewise.disagg.wire.DEFAULT_MAX_FRAME_BYTES`, never less than one block
    of every layer); a bigger frame is dropped before its parts are joined. ``gate`` is
    the :class:`FrameGate` every frame passes; ``events`` a queue of :class:`FrameEvent` /
    :class:`MessageEvent` / :class:`PeerEvent` (drain it, or ``next_event()``). ``counters()``
    is a flat dict for /metrics.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", *, secret: bytes, layout: KVLayout,
                 identity: str | None = None,
                 on_frame: Callable[[str, KVFrameHeader, memoryview], None] | None = None,
                 heartbeat_deadline: float = 5.0, max_frame_bytes: int | None = None,
                 handshake_ttl: float = 30.0):
        if heartbeat_deadline <= 0:
            raise ValueError(f"heartbeat_deadline: must be > 0, got {heartbeat_deadline}")
        check_secret(secret)
        self.identity = identity or _new_identity()
        self.layout = layout
        # A frame holds whole blocks of every layer it names, so one block of every layer is
        # the smallest limit a sender can always meet.
        self.max_frame_bytes = max(
            DEFAULT_MAX_FRAME_BYTES if max_frame_bytes is None else max_frame_bytes,
            layout.block_layer_bytes() * layout.num_layers)
        self.gate = FrameGate(layout)
        self.events: queue.Queue[Event] = queue.Queue()
        self._secret = secret
        self._on_frame = on_frame
        self._deadline = heartbeat_deadline
        self._book = ChallengeBook(self.identity, ttl=handshake_ttl)
        self._lock = threading.Lock()
        self._sessions: dict[bytes, _Session] = {}
        self._by_identity: dict[str, _Session] = {}
        self._by_name: dict[str, str] = {}
        self._counts: dict[str, int] = {}
        self._quiet_until: dict[str, float] = {}  # topic -> no warning before (monotonic)
        # refused connections whose freed buffers no hand-back has covered yet, the first's
        # time, and when the next hand-back may run (the I/O thread's own)
        self._trim = _heap_trimmer()
        self._untrimmed = 0
        self._untrimmed_since = 0.0
        self._next_trim = 0.0
        keys = _curve_keys(secret)
        self._client_key = z85.decode(keys["client"][0])
        self._ctx = zmq.Context()
        try:
            # zmq asks the ZAP handler of the socket's own context: bound before the port
            # listens, so no connection is ever judged without it (and the port enforces it).
            self._zap = self._ctx.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind("inproc://zeromq.zap.01")
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.CURVE_SERVER, 1)
            self._router.setsockopt(zmq.CURVE_PUBLICKEY, keys["server"][0])
            self._router.setsockopt(zmq.CURVE_SECRETKEY, keys["server"][1])
            self._router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            self._router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            # libzmq checks each frame's declared size against this before buffering it, for
            # every peer alike and during the security handshake too, and drops a connection
            # whose handshake is not done in time (both set before bind: a listener keeps the
            # values it was bound with). One message part, not a K/V frame.
            self._router.setsockopt(zmq.MAXMSGSIZE, PORT_FRAME_LIMIT)
            self._router.setsockopt(zmq.HANDSHAKE_IVL, int(SECURITY_HANDSHAKE_S * 1000))
            self._monitor = self._router.get_monitor_socket(_SECURITY_FAILED)
            try:
                self._router.bind(_bind_address(bind))
            except zmq.ZMQError as e:
                raise ValueError(f"cannot listen on K/V address {bind!r}: {e.strerror} (give "
                                 "tcp://HOST:PORT, with a port nothing else uses)") from e
            self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pipe = _Pipe(self._ctx, "server")
        except Exception:
            self._ctx.destroy(linger=0)
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"phasewise-kv-server-{self.identity[:8]}")
        self._thread.start()

    # ---- public API (any thread)

    def send(self, peer: str, message: Any) -> None:
        """Queue a control message to the live peer with identity ``peer``."""
        with self._lock:
            s = self._by_identity.get(peer)
            if s is None or s.state not in ("alive", "lost"):
                state = "unknown" if s is None else s.state
                raise KeyError(f"no live KV peer {peer!r} (state: {state})")
            rid = s.rid
        self._pipe.push([b"send", rid, encode_message(message)])

    def request_prefill(self, peer: str, request: PrefillRequest) -> None:
        """Register the attempt with the gate (bound to ``peer``), then send it."""
        with self._lock:
            if peer not in self._by_identity:
                raise KeyError(f"no KV peer {peer!r}")
        self.gate.expect(request.request_id, request.epoch, request.num_blocks,
                         first_block=request.first_block, peer=peer)
        try:
            self.send(peer, request)
        except Exception:
            self.gate.forget(request.request_id)
            raise

    def abort(self, peer: str, request_id: str, epoch: int) -> None:
        """Forget the attempt (later frames are ``foreign``) and tell the peer, if it is live."""
        self.gate.forget(request_id)
        try:
            self.send(peer, Abort(request_id=request_id, epoch=epoch))
        except KeyError:
            pass

    def next_event(self, timeout: float | None = None) -> Event | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def peers(self) -> dict[str, PeerInfo]:
        with self._lock:
            return {i: PeerInfo(s.identity, s.name, s.role, s.state, s.queue)
                    for i, s in self._by_identity.items()}

    def peer_state(self, peer: str) -> str | None:
        with self._lock:
            s = self._by_identity.get(peer)
            return None if s is None else s.state

    def counters(self) -> dict[str, int]:
        """``frames.<gate outcome>``, ``frames.apply_failed``, ``frame_errors.<kind>``,
        ``refused.<field>``, ``unauthenticated`` (every message dropped before a handshake)
        and ``unauthenticated.<reason>`` (``oversized``, ``malformed``, ``unexpected``),
        ``unauthenticated.curve`` (connections that failed zmq's security handshake: they
        sent no message, so they are not in ``unauthenticated``), ``messages.<outcome>``,
        ``peers.<state>``, ``heartbeats``, ``send_failed``, ``heap_trims`` (freed heap handed
        back after refused connections)."""
        with self._lock:
            out = dict(self._counts)
        out.update({f"frames.{k}": v for k, v in self.gate.counters().items()})
        return out


    # ---- the I/O thread

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def _emit(self, event: Event) -> None:
        self.events.put(event)

    def _send_now(self, rid: bytes, parts: list[Any]) -> None:
        try:
            self._router.send_multipart([rid, *parts], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY) or its queue full
            self._count("send_failed")
            log.debug("KV send to %r failed: %s", rid, e)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pipe.pull, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        tick_ms = max(5, min(100, int(self._deadline * 1000 / 5)))
        try:
            while True:
                ready = dict(poller.poll(tick_ms))
                if self._zap in ready:
                    self._on_zap()
                if self._monitor in ready:
                    self._on_monitor()
                while self._pipe.pull in ready:
                    try:
                        cmd = self._pipe.pull.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if cmd[0] == b"stop":
                        return
                    self._send_now(cmd[1], cmd[2:])
                if self._router in ready:
                    for _ in range(256):
                        try:
                            msg = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            self._on_message(msg)
                        except Exception:  # never let one message kill the port
                            self._count("internal_errors")
                            log.exception("KV server failed handling a message")
                        # no reference outlives the handling: a dropped message's memory
                        # goes back now, not when the next message arrives
                        del msg
                self._check_liveness()
                self._give_back_heap()
        finally:
            # the port first: with the ZAP handler gone, an enforced domain refuses anyone,
            # but nothing should depend on that
            self._router.disable_monitor()
            self._router.close(linger=0)
            self._monitor.close(linger=0)
            self._zap.close(linger=0)
            self._pipe.pull.close(linger=0)

    def _on_zap(self) -> None:
        """Answer the ZAP requests zmq has queued: 200 for the client key derived from the
        secret, 400 for any other (zmq then fails that handshake, which the monitor counts).
        A REP socket must answer what it received, so every request gets a reply."""
        while True:
            try:
                req = self._zap.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            # [version, request id, domain, address, routing id, mechanism, credentials...]
            ok = (len(req) == 7 and req[0] == b"1.0" and req[2] == ZAP_DOMAIN
                  and req[5] == b"CURVE" and hmac.compare_digest(req[6], self._client_key))
            request_id = req[1] if len(req) > 1 else b""
            if not ok:
                address = req[3].decode("ascii", "replace")[:64] if len(req) > 3 else "?"
                log.debug("K/V port %s: refused a CURVE key from %s", self.endpoint, address)
            self._zap.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                      b"OK" if ok else b"unknown key", b"", b""])

    def _on_monitor(self) -> None:
        """Count each connection that failed the security handshake; warn once a minute at
        most (a stranger decides how often this runs)."""
        while True:
            try:
                raw = self._monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ev = parse_monitor_message(raw)
            except Exception:  # noqa: BLE001 - zmq's own messages; never fatal
                continue
            event, value = int(ev["event"]), int(ev["value"])
            if not event & _SECURITY_FAILED:
                continue
            if not self._untrimmed:
                self._untrimmed_since = time.monotonic()
            self._untrimmed += 1
            why = _security_failure(event, value)
            with self._lock:
                n = self._counts["unauthenticated.curve"] = (
                    self._counts.get("unauthenticated.curve", 0) + 1)
            log.debug("K/V port %s: a connection failed the security handshake: %s",
                      self.endpoint, why)
            if self._quiet("curve"):
                log.warning("K/V port %s refused connections at the security (CURVE) "
                            "handshake: %d so far, the last because %s (a peer without "
                            "this secret, or of another phasewise version; at most one "
                            "such line per %.0fs)", self.endpoint, n, why,
                            PREAUTH_LOG_INTERVAL)

    def _give_back_heap(self) -> None:
        """Hand the heap freed by refused connections back to the system (see the module's
        "Memory handed back"): a flood still going is covered every HEAP_TRIM_INTERVAL, the
        end of one within about a second."""
        if self._trim is None or self._untrimmed * PORT_FRAME_LIMIT < HEAP_TRIM_AFTER_BYTES:
            return
        now = time.monotonic()
        if now < self._next_trim or now - self._untrimmed_since < _TRIM_SETTLE_S:
            return
        refused, self._untrimmed = self._untrimmed, 0
        self._next_trim = now + HEAP_TRIM_INTERVAL
        before = _rss_mb()
        self._trim()
        self._count("heap_trims")
        after = _rss_mb()
        if before is not None and after is not None:
            log.debug("K/V port %s: after %d refused connections, handed %.0f MB of freed "
                      "heap back (resident %.0f -> %.0f MB)", self.endpoint, refused,
                      before - after, before, after)

    def _on_message(self, msg: list[zmq.Frame]) -> None:
        rid = msg[0].bytes
        with self._lock:
            s = self._sessions.get(rid)
        if s is None:
            self._handshake(rid, msg[1:])
            return
        parts = [f.buffer for f in msg[1:]]
        self._touch(s)
        if len(parts) >= 2:
            self._on_frame_parts(s, parts)
        elif len(parts) == 1:
            self._on_control(s, parts[0])
        else:
            self._count("frame_errors.malformed")
            self._emit(FrameEvent(s.identity, None, "malformed",
                                  detail=f"{len(parts)} parts"))

    def _quiet(self, topic: str) -> bool:
        """True at most once per PREAUTH_LOG_INTERVAL for ``topic``: whether to warn now."""
        now = time.monotonic()
        with self._lock:
            if now < self._quiet_until.get(topic, 0.0):
                return False
            self._quiet_until[topic] = now + PREAUTH_LOG_INTERVAL
            return True

    def _drop_unauthenticated(self, rid: bytes, reason: str) -> None:
        """Count a message from a peer without a session; warn at most once a minute (a
        stranger decides how often this runs), with counts and nothing of its bytes."""
        with self._lock:
            for key in ("unauthenticated", f"unauthenticated.{reason}"):
                self._counts[key] = self._counts.get(key, 0) + 1
            so_far = ", ".join(f"{r} {self._counts.get(f'unauthenticated.{r}', 0)}"
                               for r in PREAUTH_DROP_REASONS)
        log.debug("dropped a %s message from K/V connection %s before its handshake", reason,
                  rid.hex())
        if self._quiet("dropped"):
            log.warning("K/V port %s dropped messages from peers that have not completed the "
                        "handshake (so far: %s; at most one such line per %.0fs)",
                        self.endpoint, so_far, PREAUTH_LOG_INTERVAL)

    def _handshake(self, rid: bytes, frames: list[zmq.Frame]) -> None:
        # Judged by its shape first (zmq knows each part's size): nothing over a handshake
        # message's size is copied or parsed.
        if sum(len(f) for f in frames) > PREAUTH_MAX_BYTES:
            self._drop_unauthenticated(rid, "oversized")
            return
        if len(frames) != 1:
            self._drop_unauthenticated(rid, "unexpected")
            return
        try:
            msg = decode_message(frames[0].buffer, max_bytes=PREAUTH_MAX_BYTES)
        except MessageError:
            self._drop_unauthenticated(rid, "malformed")
            return
        if isinstance(msg, Open):
            ch = self._book.issue(rid)
            self._send_now(rid, [encode_message(ch)])
            return
        if not isinstance(msg, Hello):
            self._drop_unauthenticated(rid, "unexpected")
            return
        challenge = self._book.take(rid)
        try:
            if challenge is None:
                raise HandshakeError("no outstanding challenge for this connection (a replayed "
                                     "or unsolicited hello)", "nonce")
            verify_hello(msg, challenge, secret=self._secret, layout=self.layout)
            self._accept(rid, msg, challenge)
        except HandshakeError as e:
            self._count(f"refused.{e.field}")
            # auth and nonce refusals need no key, so a stranger sets their pace: rate-limited;
            # the others (version, role, layout) come from a peer that holds the key
            loud = e.field not in ("auth", "nonce") or self._quiet("refused")
            log.log(logging.WARNING if loud else logging.DEBUG,
                    "refused KV peer (claimed identity %.64r, name %.64r, role %.16r): %s: %s",
                    msg.identity, msg.name, msg.role, e.field, e.reason)
            self._send_now(rid, [encode_message(Refuse(field=e.field, reason=e.reason))])

    def _accept(self, rid: bytes, hello: Hello, challenge: Challenge) -> None:
        replaced: tuple[str, tuple[str, ...]] | None = None
        with self._lock:
            old_ident = self._by_name.get(hello.name)
            if old_ident is not None and old_ident != hello.identity:
                old = self._by_identity[old_ident]
                old.state = "replaced"
                replaced = (old_ident, tuple(self.gate.forget_peer(old_ident)))
            same = self._by_identity.get(hello.identity)
            if same is not None:  # the same incarnation reconnected: drop the old connection
                self._sessions.pop(same.rid, None)
            s = _Session(rid, hello.identity, hello.name, hello.role, "alive", time.monotonic())
            self._sessions[rid] = s
            self._by_identity[hello.identity] = s
            self._by_name[hello.name] = hello.identity
        self._count("peers.accepted")
        self._send_now(rid, [encode_message(make_accept(hello, challenge, secret=self._secret,
                                                        max_frame_bytes=self.max_frame_bytes))])
        if replaced is not None:
            self._count("peers.replaced")
            log.warning("KV peer %r (name %r) replaced by %r; forgot attempts %s",
                        replaced[0], hello.name, hello.identity, list(replaced[1]))
            self._emit(PeerEvent(replaced[0], "replaced", hello.name, replaced[1],
                                 replaced_by=hello.identity))
        log.info("accepted KV peer %r (name %r, role %r)", hello.identity, hello.name,
                 hello.role)
        self._emit(PeerEvent(hello.identity, "accepted", hello.name))

    def _touch(self, s: _Session) -> None:
        back = False
        with self._lock:
            s.last_seen = time.monotonic()
            if s.state == "lost":
                s.state, back = "alive", True
        if back:
            self._count("peers.alive")
            log.info("KV peer %r is back", s.identity)
            self._emit(PeerEvent(s.identity, "alive", s.name))

    def _check_liveness(self) -> None:
        now = time.monotonic()
        lost: list[_Session] = []
        with self._lock:
            for s in self._by_identity.values():
                if s.state == "alive" and now - s.last_seen > self._deadline:
                    s.state = "lost"
                    lost.append(s)
        for s in lost:
            self._count("peers.lost")
            log.warning("KV peer %r (name %r) lost: no message for %.1fs", s.identity, s.name,
                        self._deadline)
            self._emit(PeerEvent(s.identity, "lost", s.name))

    def _on_frame_parts(self, s: _Session, parts: list[memoryview]) -> None:
        try:
            header, payload = decode_kv_frame(parts, max_payload_bytes=self.max_frame_bytes)
        except FrameError as e:
            self._count(f"frame_errors.{e.kind}")
            self._emit(FrameEvent(s.identity, e.header, e.kind, detail=e.detail))
            return
        on_frame = self._on_frame
        apply = None if on_frame is None else (lambda h: on_frame(s.identity, h, payload))
        try:
            outcome = self.gate.admit(header, s.identity, apply)
        except Exception as e:
            self._count("frames.apply_failed")
            log.exception("on_frame failed for %s seq %d", header.request_id, header.seq)
            self._emit(FrameEvent(s.identity, header, "apply_failed", detail=repr(e)))
            return
        keep = payload if outcome == "ok" and on_frame is None else None
        self._emit(FrameEvent(s.identity, header, outcome, keep))

    def _on_control(self, s: _Session, data: memoryview) -> None:
        try:
            msg = decode_message(data, max_bytes=MAX_CONTROL_BYTES)
        except MessageError as e:
            self._count("messages.malformed")
            log.debug("malformed message from %r: %s", s.identity, e)
            return
        if isinstance(msg, Heartbeat):
            self._count("heartbeats")
            with self._lock:
                s.queue = msg.queue
            # Answered, so the client can tell this server is gone (or restarted: a new one
            # does not know its session and answers nothing).
            self._send_now(s.rid, [encode_message(Heartbeat(identity=self.identity,
                                                            seq=msg.seq))])
            return
        if isinstance(msg, Bye):
            with self._lock:
                s.state = "closed"
            self._count("peers.closed")
            self._emit(PeerEvent(s.identity, "closed", s.name))
            return
        if isinstance(msg, (Done, FirstToken, Error)):
            outcome = self.gate.classify(msg.request_id, msg.epoch, s.identity)
            if outcome == "ok" and isinstance(msg, Done):
                self.gate.note_done(msg.request_id, msg.epoch, msg.num_frames, s.identity)
        else:
            outcome = "unexpected"  # handshake kinds, or decode-side kinds sent our way
        self._count(f"messages.{outcome}")
        self._emit(MessageEvent(s.identity, msg, outcome))


# --------------------------------------------------------------------------------------------
# client


class KVClient(_Endpoint):
    """The prefill worker's connection to a decode worker's KV port.

    ``KVClient(connect, *, secret, layout, role="prefill", identity=None, name=None,
    heartbeat_interval=1.0, handshake_timeout=10.0, frame_hook=None)``. Both handshakes run in
    the constructor (zmq's CURVE one, then this module's), which raises
    :class:`HandshakeError` (naming the field) if the CURVE handshake fails (``security``: a
    different secret, or a server of another protocol version), if refused, if the server
    cannot prove it holds the key (``auth``), if no answer comes (``timeout``), if the server
    speaks another protocol version (``version``), or if this side's hello is over
    :data:`~phasewise.disagg.wire.PREAUTH_MAX_BYTES` (``size``: a server would drop it unread).
    ``frame_hook`` (a :class:`FrameHook`) sees every outgoing K/V frame and each heartbeat.
    ``identity`` is this incarnation (a fresh uuid by default); ``name`` is the stable worker
    name (default: the identity) by which a restart replaces its predecessor.
    ``max_frame_bytes`` is the largest K/V frame payload the server takes (from its accept);
    ``send_kv`` refuses a bigger one.
    """

    def __init__(self, connect: str, *, secret: bytes, layout: KVLayout, role: str = "prefill",
                 identity: str | None = None, name: str | None = None,
                 heartbeat_interval: float = 1.0, handshake_timeout: float = 10.0,
                 frame_hook: FrameHook | None = None, close_linger: float = 1.0,
                 protocol_version: int = PROTOCOL_VERSION,
                 load: Callable[[], int] | None = None):
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval: must be > 0, got {heartbeat_interval}")
        self.identity = identity or _new_identity()
        self.name = name or self.identity
        self.role = role
        self.layout = layout
        self.frame_hook = frame_hook
        self.server_identity = ""
        self.max_frame_bytes = 0  # set by the handshake
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._interval = heartbeat_interval
        self._last_heard = time.monotonic()
        self._load = load  # this worker's queue, sent with each heartbeat
        self._close_linger = close_linger
        self._seqs: dict[tuple[str, int], int] = {}
        self._seq_lock = threading.Lock()
        self._closed = False
        check_secret(secret)
        keys = _curve_keys(secret)
        self._ctx = zmq.Context()
        try:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.CURVE_SERVERKEY, keys["server"][0])
            self._dealer.setsockopt(zmq.CURVE_PUBLICKEY, keys["client"][0])
            self._dealer.setsockopt(zmq.CURVE_SECRETKEY, keys["client"][1])
            self._dealer.setsockopt(zmq.HANDSHAKE_IVL, int(SECURITY_HANDSHAKE_S * 1000))
            monitor = self._dealer.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | _SECURITY_FAILED)
            try:
                self._dealer.connect(connect)
                self._secure(connect, monitor, handshake_timeout, protocol_version)
            finally:
                self._dealer.disable_monitor()
                monitor.close(linger=0)
            self._handshake(secret, handshake_timeout, protocol_version)
            self._pipe = _Pipe(self._ctx, "client")
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"phasewise-kv-client-{self.identity[:8]}")
        self._thread.start()

    def _secure(self, connect: str, monitor: zmq.Socket, timeout: float, version: int) -> None:
        """Wait for zmq's CURVE handshake with the server. zmq cannot tell a wrong secret (the
        keys derive from it) from a server that speaks no CURVE (protocol version 3 and
        older) or other keys (a later version that derived them differently), so the error
        names those usual causes. Nothing heard at all (nothing listening) is a
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not monitor.poll(max(1, int(left * 1000))):
                raise HandshakeError(f"no answer from the K/V port at {connect} within "
                                     f"{timeout}s", "timeout")
            ev = parse_monitor_message(monitor.recv_multipart())
            event, value = int(ev["event"]), int(ev["value"])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event & _SECURITY_FAILED:
                raise HandshakeError(
                    f"the security (CURVE) handshake with the K/V port at {connect} failed: "
                    f"{_security_failure(event, value)}. The usual causes: the two sides "
                    "were given different secrets (--kv-secret-file), or the other side runs "
                    "an older or newer phasewise (this one speaks K/V protocol version "
                    f"{version}; version 3 and older have no CURVE)", "security")

    def _reply(self, timeout: float, waiting_for: str, version: int) -> Any:
        if not self._dealer.poll(int(timeout * 1000)):
            raise HandshakeError(f"no {waiting_for} from the server within {timeout}s",
                                 "timeout")
        data = self._dealer.recv()
        try:
            msg = decode_message(data, max_bytes=MAX_CONTROL_BYTES)
        except MessageError as e:
            theirs = _claimed_version(data)
            if theirs is not None and theirs != version:  # e.g. a challenge of another shape
                raise HandshakeError(f"server speaks protocol version {theirs}, this worker "
                                     f"{version}", "version") from None
            raise HandshakeError(f"bad {waiting_for}: {e}", "protocol") from None
        if isinstance(msg, Refuse):
            raise HandshakeError(msg.reason, msg.field)
        return msg

    def _handshake(self, secret: bytes, timeout: float, version: int) -> None:
        self._dealer.send(encode_message(Open(identity=self.identity)))
        ch = self._reply(timeout, "challenge", version)
        if not isinstance(ch, Challenge):
            raise HandshakeError(f"expected a challenge, got {ch.KIND!r}", "protocol")
        hello = make_hello(ch, secret=secret, identity=self.identity, name=self.name,
                           role=self.role, layout=self.layout, version=version)
        data = encode_message(hello)
        if len(data) > PREAUTH_MAX_BYTES:
            raise HandshakeError(f"this worker's hello is {len(data)} bytes; a K/V port reads "
                                 f"at most {PREAUTH_MAX_BYTES} before the handshake (shorten "
                                 "its name, identity or model id)", "size")
        self._dealer.send(data)
        acc = self._reply(timeout, "accept", version)
        if not isinstance(acc, Accept):
            raise HandshakeError(f"expected accept, got {acc.KIND!r}", "protocol")
        verify_accept(acc, hello, ch, secret=secret)
        self.server_identity = ch.server_identity
        self.max_frame_bytes = acc.max_frame_bytes
        self._last_heard = time.monotonic()

    # ---- public API (any thread)

    def send(self, message: Any) -> None:
        """Queue a control message (``FirstToken``, ``Error``, ``Done``...) to the server.
        Raises ValueError over :data:`~phasewise.disagg.wire.MAX_CONTROL_BYTES` (the server
        would drop it)."""
        data = encode_message(message)
        if len(data) > MAX_CONTROL_BYTES:
            raise ValueError(f"{type(message).__name__} of {len(data)} bytes exceeds the "
                             f"{MAX_CONTROL_BYTES} a K/V port parses")
        self._pipe.push([b"send", data])

    def send_kv(self, request_id: str, epoch: int, *, first_block: int, num_blocks: int,
                first_token: int, num_tokens: int, layer_start: int, layer_end: int,
                payload: Buffer) -> int:
        """Queue one KV frame; returns its seq (0, 1, ... per attempt). The payload must stay
        unchanged until sent (it is not copied). Raises ValueError over ``max_frame_bytes``
        (the server would drop the connection): split such a chunk by blocks."""
        nbytes = memoryview(payload).nbytes
        if nbytes > self.max_frame_bytes:
            raise ValueError(f"a K/V frame of {nbytes} bytes exceeds the server's "
                             f"max_frame_bytes {self.max_frame_bytes}")
        with self._seq_lock:
            seq = self._seqs.get((request_id, epoch), 0)
            self._seqs[(request_id, epoch)] = seq + 1
        parts = encode_kv_frame(
            request_id=request_id, epoch=epoch, seq=seq, first_block=first_block,
            num_blocks=num_blocks, first_token=first_token, num_tokens=num_tokens,
            layer_start=layer_start, layer_end=layer_end, dtype=self.layout.dtype,
            payload=payload)
        hook = self.frame_hook
        for out in (hook.outgoing(seq, parts) if hook is not None else [parts]):
            self._pipe.push([b"send", *out])
        return seq

    def send_done(self, request_id: str, epoch: int) -> int:
        """Send any frames the frame hook still holds, then ``Done`` with the attempt's frame
        count (returned)."""
        with self._seq_lock:
            n = self._seqs.pop((request_id, epoch), 0)
        for out in (self.frame_hook.flush() if self.frame_hook is not None else []):
            self._pipe.push([b"send", *out])
        self.send(Done(request_id=request_id, epoch=epoch, num_frames=n))
        return n

    @property
    def silent_for(self) -> float:
        """Seconds since the server last answered (it answers every heartbeat)."""
        return time.monotonic() - self._last_heard

    def recv(self, timeout: float | None = None) -> Any | None:
        """The next message from the server (``PrefillRequest``, ``Abort``), or None."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None


    # ---- the I/O thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._pipe.pull, zmq.POLLIN)
        beat = 0
        next_beat = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    hook = self.frame_hook
                    if hook is None or not hook.heartbeats_muted:
                        queue_len = 0
                        if self._load is not None:
                            try:
                                queue_len = max(0, int(self._load()))
                            except Exception:  # noqa: BLE001 - a heartbeat must still go
                                log.debug("load callback failed", exc_info=True)
                        self._dealer.send(encode_message(Heartbeat(
                            identity=self.identity, seq=beat, queue=queue_len)))
                        beat += 1
                    next_beat = now + self._interval
                wait_ms = max(1, int((next_beat - now) * 1000))
                ready = dict(poller.poll(wait_ms))
                while self._pipe.pull in ready:
                    try:
                        cmd = self._pipe.pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if cmd[0].bytes == b"stop":
                        self._dealer.send(encode_message(Bye(identity=self.identity)),
                                          flags=zmq.NOBLOCK)
                        # give queued frames and the bye a bounded chance to leave
                        self._dealer.setsockopt(zmq.LINGER, int(self._close_linger * 1000))
                        return
                    self._dealer.send_multipart(cmd[1:], copy=False)
                if self._dealer in ready:
                    while True:
                        try:
                            data = self._dealer.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            msg = decode_message(data)
                        except MessageError as e:
                            log.warning("malformed message from KV server: %s", e)
                            continue
                        self._last_heard = time.monotonic()
                        if not isinstance(msg, Heartbeat):
                            self._inbox.put(msg)
        except zmq.ZMQError as e:  # pragma: no cover - socket failure
            log.error("KV client I/O thread stopped: %s", e)
        finally:
            self._dealer.close()
            self._pipe.pull.close(linger=0)
