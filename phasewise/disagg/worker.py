"""The two sides of a remote prefill, each around an ``AsyncEngine``: the decode side opens the
K/V port and asks a connected prefill worker for a request's prompt; the prefill side computes
it and pushes each chunk's blocks, then the first token.

Decode reserves, prefill pushes (``docs/pd.md``, "Why it is built this way"):

1. ``DecodeSide.add`` admits the group with ``PromptSpec.remote``: the engine matches its own
   prefix cache and reserves blocks for the rest of each prompt. A prompt is prefilled
   locally, chunked, when its uncached part is under ``threshold`` tokens, when no prefill
   worker is connected, when every one has ``queue_limit`` prompts or more (its heartbeats
   say how many it holds; this side counts what it sent), or when the decode engine found
   no room to reserve; ``local_prefills`` counts each reason.
2. For each reserved request it sends ``PrefillRequest`` (the blocks to push) to the live
   prefill worker with the shortest queue, as attempt ``epoch``.
3. ``PrefillSide`` runs the prompt with ``max_tokens=1`` and ``export_kv_from``; its engine's
   ``kv_sink`` sends each chunk's blocks as a K/V frame the moment the forward pass wrote
   them; then ``Done`` (the frame count) and ``FirstToken``.
4. The decode side's ``FrameGate`` admits a frame only for the current attempt of a known
   request; the blocks go to the engine thread as ``LoadRemoteKV`` (bytes), which drops them
   if the request is gone. ``FirstToken`` becomes ``FinishRemotePrefill``: with every block in,
   the request decodes on; otherwise (a frame lost) the engine computes the prompt itself.
5. Any fault (an ``Error``, the peer lost or replaced, no first token within
   ``request_timeout``) fails the attempt: the decode engine keeps the leading blocks that
   arrived and computes the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phasewise.disagg.transport import FrameHook, KVClient, KVServer, MessageEvent, PeerEvent
from phasewise.disagg.wire import Abort, Error, FirstToken, KVLayout, PrefillRequest
from phasewise.engine.async_engine import AsyncEngine
from phasewise.engine.backend import PromptSpec, RequestGroup
from phasewise.engine.kv_bytes import dtype_name, kv_to_bytes
from phasewise.engine.relay import params_from_wire, params_to_wire
from phasewise.engine.request import RemoteTiming
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.structured import compile_aside

log = logging.getLogger("phasewise.disagg")
# A stuck prefill worker's reported queue: more than any decode worker's --prefill-queue-limit
STUCK_QUEUE = 1 << 30

# Why a prompt sent to the decode role was prefilled there: shorter than the threshold;
# its uncached part shorter than the threshold; no prefill worker connected; every one at the
# queue limit; no room in the decode engine to reserve its blocks; a request a router moved
# here with the outputs it had streamed elsewhere (they are recomputed with the prompt).
LOCAL_REASONS = ("short_prompt", "cached", "no_prefill_worker", "prefill_busy", "no_room",
                 "resumed")
# Why a remote prefill was failed (and computed here): the prefill worker said so; it was
# lost (silent), replaced (restarted) or closed; no first token within the deadline; the
# request could not be sent, or its peer went away as it was.
FAILURE_KINDS = ("error", "peer_lost", "peer_replaced", "peer_closed", "timeout",
                 "send_failed", "peer_gone")


@dataclasses.dataclass
class Transfer:
    """One remote prefill seen from the decode side (``time.monotonic`` seconds)."""

    sent_at: float  # PrefillRequest sent
    first_frame_at: float | None = None  # first K/V frame landed
    done_at: float | None = None  # first token back
    nbytes: int = 0  # K/V bytes landed
    frames: int = 0
    peer: str = ""  # the prefill worker's name (its identity when it gave none)


@dataclasses.dataclass(frozen=True)
class Tallies:
    local_prefills: dict[str, int]  # by LOCAL_REASONS
    failures: dict[str, int]  # by FAILURE_KINDS
    missing_frames: int


class _Delegate:
    """A ``ServingBackend`` that is its ``AsyncEngine`` except where a side adds to it."""

    backend: AsyncEngine

    @property
    def info(self) -> Any:
        return self.backend.info

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def snapshot(self) -> Any:
        return self.backend.snapshot

    @property
    def is_alive(self) -> bool:
        return self.backend.is_alive

    @property
    def down_reason(self) -> str:
        return self.backend.down_reason

    def engine_health(self) -> str | None:
        return self.backend.engine_health()

    @property
    def num_open_groups(self) -> int:
        return self.backend.num_open_groups

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        return self.backend.default_sampling_params(**overrides)

    async def add(self, specs: Sequence[PromptSpec], request_id: str,
                  arrival_time: float | None = None) -> RequestGroup:
        """Serve a group here, prefill and decode (a side may add to this)."""
        return await self.backend.add(specs, request_id, arrival_time)

    def abort(self, request_ids: Sequence[str]) -> None:
        self.backend.abort(request_ids)

    def park(self, request_ids: Sequence[str], parked: bool) -> None:
        self.backend.park(request_ids, parked)

    def abort_all(self, reason: str) -> None:
        self.backend.abort_all(reason)

    def add_observer(self, observer: Any) -> None:
        self.backend.add_observer(observer)

    def stop_accepting(self) -> None:
        self.backend.stop_accepting()


def layout_of(engine: Any) -> KVLayout:
    """What a peer must share with this ``LLMEngine`` for its K/V to be usable here: the
    checkpoint (its config.json's hash), dtype and cache geometry."""
    cfg_bytes = (Path(engine.config.model) / "config.json").read_bytes()
    mc = engine.model_config
    return KVLayout(model_id=f"{mc.architecture}/{hashlib.sha256(cfg_bytes).hexdigest()[:16]}",
                    dtype=dtype_name(engine.dtype), num_layers=mc.num_layers,
                    num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                    block_size=engine.config.block_size)


class DecodeSide(_Delegate):
    """The decode role's K/V port and its remote-prefill bookkeeping (see the module); a
    ``ServingBackend``, so the HTTP server fronts it as it fronts an ``AsyncEngine``."""

    def __init__(self, backend: AsyncEngine, *, secret: bytes, bind: str = "tcp://127.0.0.1:0",
                 threshold: int = 0, queue_limit: int = 8,
                 heartbeat_deadline: float = 2.0, request_timeout: float = 300.0,
                 max_frame_bytes: int | None = None) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be >= 1, got {queue_limit}")
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        # Per request: a remote prefill whose first token has not come back this long after
        # it was sent is computed here (its peer may be alive but have lost it).
        self.request_timeout = request_timeout
        self.backend = backend
        self.layout = layout_of(backend.engine)
        self.threshold = threshold
        self.queue_limit = queue_limit
        self.missing_frames = 0  # frames a prefill worker's Done counted that never landed
        # Failed hand-offs by kind (FAILURE_KINDS).
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_KINDS, 0)
        # Prompts prefilled here instead, by reason (see the module).
        self.local_prefills = dict.fromkeys(LOCAL_REASONS, 0)
        # max_frame_bytes: the largest K/V frame the port takes (None: the transport's
        # default); prefill workers split their chunks to fit
        self.server = KVServer(bind, secret=secret, layout=self.layout, on_frame=self._land,
                               heartbeat_deadline=heartbeat_deadline,
                               max_frame_bytes=max_frame_bytes)
        self._attempts: dict[str, tuple[str, int]] = {}  # request id -> (peer, epoch)
        self._transfers: dict[str, Transfer] = {}  # request id -> its remote prefill so far
        # Called (on this side's event thread) with each remote prefill that decoded on.
        self.on_transfer: Any = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._events, name="phasewise-decode-kv",
                                        daemon=True)
        self._thread.start()
        backend.add_abort_listener(self._aborted)

    def _aborted(self, request_ids: Sequence[str]) -> None:
        """A client went away: its prefill worker stops, and no frame of it lands."""
        for rid in request_ids:
            with self._lock:
                attempt = self._attempts.pop(rid, None)
                self._transfers.pop(rid, None)
            if attempt is not None:
                self.server.gate.forget(rid)
                self._tell_abort(attempt[0], rid, attempt[1])

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def _tell_abort(self, peer: str, rid: str, epoch: int) -> None:
        try:
            self.server.abort(peer, rid, epoch)
        except Exception as e:  # noqa: BLE001 - a peer that is gone computes nothing more
            log.debug("abort of %s not sent to %s: %s", rid, peer, e)

    def _live_peers(self) -> list[str]:
        return [p for p in self.server.peers()
                if self.server.peer_state(p) in ("accepted", "alive")]

    def _queue_of(self, peer: str, reported: int) -> int:
        """A prefill worker's queue: what its last heartbeat said, or what this side sent
        it and has not heard back from, whichever is more (a heartbeat is up to a second
        old)."""
        with self._lock:
            sent = sum(1 for p, _ in self._attempts.values() if p == peer)
        return max(reported, sent)

    def _prefill_peer(self) -> tuple[str | None, str | None]:
        """The live prefill worker with the shortest queue, or (None, why not)."""
        peers = [(self._queue_of(i, p.queue), i) for i, p in self.server.peers().items()
                 if p.state in ("accepted", "alive")]
        if not peers:
            return None, "no_prefill_worker"
        depth, peer = min(peers)
        if depth >= self.queue_limit:
            return None, "prefill_busy"
        return peer, None

    def _local(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.local_prefills[reason] += n

    @property
    def num_live_peers(self) -> int:
        return len(self._live_peers())

    def tallies(self) -> Tallies:
        """This side's counters, read together (for /metrics)."""
        with self._lock:
            return Tallies(dict(self.local_prefills), dict(self.failures),
                           self.missing_frames)

    @property
    def num_attempts(self) -> int:
        with self._lock:
            return len(self._attempts)

    async def add(self, specs: Sequence[PromptSpec], request_id: str,
                  arrival_time: float | None = None) -> RequestGroup:
        """Admit a group; prompts long enough go to a prefill worker when one is connected
        and not too busy (see the module)."""
        peer, why_not = self._prefill_peer()
        # A request that wants its prompt logprobs needs the prompt's logits, one with
        # max_tokens 0 wants no token (a prefill worker always samples one), and a resumed
        # one goes on from outputs a prefill worker does not take: computed here.
        long_enough = [len(s.token_ids) >= max(1, self.threshold)
                       and s.params.prompt_logprobs is None and s.params.max_tokens != 0
                       and not s.resume for s in specs]
        remote = [dataclasses.replace(s, remote=peer is not None and long)
                  for s, long in zip(specs, long_enough)]
        group = await self.backend.add(remote, request_id, arrival_time)
        bs = self.layout.block_size
        for rid, spec, hit, long in zip(group.request_ids, remote, group.remote_hits,
                                        long_enough):
            if not long:
                self._local("resumed" if spec.resume else "short_prompt")
                continue
            if peer is None:
                self._local(why_not or "no_prefill_worker")
                continue
            if hit is None:
                self._local("no_room")
                continue
            if len(spec.token_ids) - hit < max(1, self.threshold):
                self._local("cached")  # mostly cached here: prefill the rest locally
                self.backend.fail_remote_prefill(rid)
                continue
            info = self.server.peers().get(peer)
            with self._lock:
                self._attempts[rid] = (peer, 1)
                self._transfers[rid] = Transfer(time.monotonic(),
                                                peer=(info.name if info else "") or peer)
            try:  # the peer may have gone (closed, replaced) while the group was admitted
                self.server.request_prefill(peer, PrefillRequest(
                    rid, 1, tuple(spec.token_ids), params_to_wire(spec.params),
                    -(-len(spec.token_ids) // bs), first_block=hit // bs))
            except Exception as e:  # noqa: BLE001 - whatever it was, compute it here
                self._fail(rid, f"the prefill request could not be sent ({e})",
                           kind="send_failed")
            else:
                if self.server.peer_state(peer) not in ("accepted", "alive"):
                    self._fail(rid, f"prefill worker {peer} is {self.server.peer_state(peer)}",
                               tell_peer=True, kind="peer_gone")
        return group

    def _land(self, peer: str, header: Any, payload: memoryview) -> None:
        """An admitted frame (on the transport's thread): to the engine thread, as bytes. The
        view is only valid during the call, so it is copied, unless it spans a whole ``bytes``
        (a payload the transport joined from its parts): immutable, so that is passed on."""
        whole = payload.obj
        data = (whole if type(whole) is bytes and len(whole) == payload.nbytes
                else bytes(payload))
        self.backend.load_remote_kv(header.request_id, header.first_token, header.dtype,
                                    self.layout.frame_shape(header), data)
        with self._lock:
            t = self._transfers.get(header.request_id)
            if t is not None:
                if t.first_frame_at is None:
                    t.first_frame_at = time.monotonic()
                t.nbytes += len(payload)
                t.frames += 1

    def _fail(self, rid: str, why: str, tell_peer: bool = False,
              kind: str = "error") -> None:
        with self._lock:
            attempt = self._attempts.pop(rid, None)
            self._transfers.pop(rid, None)
            if attempt is not None:
                self.failures[kind] = self.failures.get(kind, 0) + 1
        if attempt is not None:
            log.warning("remote prefill of %s failed (%s): computing it here", rid, why)
            self.server.gate.forget(rid)
            if tell_peer:  # it may still be computing: stop it
                self._tell_abort(attempt[0], rid, attempt[1])
            self.backend.fail_remote_prefill(rid)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [rid for rid, t in self._transfers.items()
                    if now - t.sent_at > self.request_timeout]
        for rid in late:
            self._fail(rid, f"no first token within {self.request_timeout:g} s",
                       tell_peer=True, kind="timeout")

    def _events(self) -> None:
        while not self._closed.is_set():
            event = self.server.next_event(0.1)
            self._expire()
            if event is None:
                continue
            try:
                self._on_event(event)
            except Exception as e:  # a peer's odd message must not stop this thread
                log.warning("K/V event from %s not handled (%s: %s)",
                            getattr(event, "peer", "?"), type(e).__name__, e)
                rid = getattr(getattr(event, "message", None), "request_id", None)
                if rid is not None:  # whatever happened to its attempt, compute it here
                    with self._lock:
                        self._attempts.pop(rid, None)
                        self._transfers.pop(rid, None)
                    self.server.gate.forget(rid)
                    self.backend.fail_remote_prefill(rid)

    def _on_event(self, event: Any) -> None:
        if isinstance(event, MessageEvent) and event.outcome == "ok":
            msg = event.message
            if isinstance(msg, FirstToken):
                with self._lock:
                    attempt = self._attempts.pop(msg.request_id, None)
                    transfer = self._transfers.pop(msg.request_id, None)
                if attempt is not None and attempt[1] == msg.epoch:
                    missing = self.server.gate.missing_seqs(msg.request_id)
                    if missing:  # sent (the Done counts them) but never admitted
                        log.warning("remote prefill of %s: frames %s never landed",
                                    msg.request_id, missing)
                        with self._lock:
                            self.missing_frames += len(missing)
                    self.server.gate.forget(msg.request_id)
                    logprobs = (None if msg.logprobs is None
                                else {int(k): v for k, v in msg.logprobs.items()})
                    timing = None
                    if transfer is not None:
                        transfer.done_at = time.monotonic()
                        timing = RemoteTiming(transfer.sent_at, transfer.first_frame_at,
                                              transfer.done_at, transfer.nbytes,
                                              transfer.frames)
                    self.backend.finish_remote_prefill(msg.request_id, msg.token_id,
                                                       logprobs, timing)
                    if transfer is not None and self.on_transfer is not None:
                        self.on_transfer(transfer)
            elif isinstance(msg, Error):
                self._fail(msg.request_id, f"the prefill worker said: {msg.reason}",
                           kind="error")
        elif isinstance(event, PeerEvent) and event.state in ("lost", "replaced",
                                                                "closed"):
            with self._lock:
                gone = [r for r, (p, _) in self._attempts.items() if p == event.peer]
            for rid in gone:
                self._fail(rid, f"prefill worker {event.name or event.peer} {event.state}",
                           kind=f"peer_{event.state}")

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.backend.start(loop)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self.server.close()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.close()
        self.backend.shutdown(timeout)


class _Link:
    """One decode worker's K/V port, as the prefill side holds it."""

    def __init__(self, endpoint: str, client: KVClient) -> None:
        self.endpoint = endpoint
        self.client = client


class PrefillSide(_Delegate):
    """The prefill role: connects to one or more decode workers' K/V ports, computes the
    prompts they send and pushes their K/V back to the one that asked. ``start(loop)`` runs
    it on that event loop (a server's); ``start()`` on a loop of its own, on a thread. A
    ``ServingBackend`` too, so a server fronts it (``/health``, ``/metrics``)."""

    def __init__(self, backend: AsyncEngine, connect: str | Sequence[str], *, secret: bytes,
                 name: str = "prefill", frame_hook: FrameHook | None = None,
                 heartbeat_interval: float = 0.5, server_deadline: float = 5.0) -> None:
        endpoints = [connect] if isinstance(connect, str) else list(connect)
        if not endpoints or len(set(endpoints)) != len(endpoints):
            raise ValueError(f"connect: one or more distinct K/V ports, got {endpoints}")
        self.backend = backend
        self.layout = layout_of(backend.engine)
        self._client_args = dict(secret=secret, layout=self.layout, role="prefill", name=name,
                                 frame_hook=frame_hook, heartbeat_interval=heartbeat_interval,
                                 load=self._queue_len)
        # A decode worker silent this long (it died, or restarted and forgot this session)
        # is connected to again, under the same name, with a new identity.
        self.server_deadline = server_deadline
        self.links: list[_Link] = []
        try:
            for e in endpoints:
                self.links.append(_Link(e, KVClient(e, **self._client_args)))
        except BaseException:
            for link in self.links:
                link.client.close()
            raise
        backend.engine.kv_sink = self._ship
        self.reconnects = 0
        # request id -> (the link it came on, its epoch)
        self._epochs: dict[str, tuple[_Link, int]] = {}
        self._serving: dict[str, asyncio.Task] = {}  # request id -> its _serve task
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task | None = None

    @property
    def client(self) -> KVClient:
        """The first decode worker's connection."""
        return self.links[0].client

    @property
    def endpoint(self) -> str:
        return ", ".join(link.endpoint for link in self.links)

    @property
    def is_alive(self) -> bool:
        """The engine runs and some decode worker answers."""
        return self.backend.is_alive and any(
            link.client.silent_for <= self.server_deadline for link in self.links)

    def engine_health(self) -> str | None:
        """Its own engine's (``/health/engine``): not its decode workers' links, which a
        restart of this worker would not bring back."""
        return self.backend.engine_health()

    @property
    def down_reason(self) -> str:
        if not self.backend.is_alive:
            return self.backend.down_reason
        return "no answer from the decode workers' K/V ports (reconnecting): " + "; ".join(
            f"{link.endpoint} silent for {link.client.silent_for:.0f} s"
            for link in self.links)

    async def _reconnect(self, link: _Link) -> None:
        """A decode worker went silent: hand-shake again (in a thread) until it answers."""
        log.warning("the decode worker's K/V port %s has been silent for %.0f s; "
                    "connecting again", link.endpoint, link.client.silent_for)
        from phasewise.disagg.wire import HandshakeError

        while not self._stop.is_set():
            try:
                new = await asyncio.to_thread(KVClient, link.endpoint, handshake_timeout=2.0,
                                              **self._client_args)
            except HandshakeError as e:
                if e.field != "timeout":
                    log.error("the decode worker's K/V port %s refused this worker: %s",
                              link.endpoint, e)
                await asyncio.sleep(1.0)
                continue
            if self._stop.is_set():  # closed while connecting
                await asyncio.to_thread(new.close)
                return
            old, link.client = link.client, new
            self.reconnects += 1
            # What the silent decode worker asked for is nobody's now: stop computing it.
            for rid, (owner, _) in list(self._epochs.items()):
                task = self._serving.get(rid)
                if owner is link and task is not None:
                    task.cancel()
            await asyncio.to_thread(old.close)
            log.info("connected to the decode worker's K/V port %s again", link.endpoint)
            return

    def _queue_len(self) -> int:
        """The prompts this worker holds (its heartbeats carry it to the decode side); while
        its engine is stuck in one step (``AsyncEngine.stuck``), ``STUCK_QUEUE``: past any
        decode worker's queue limit, so that they prefill the prompts themselves instead of
        waiting on it (its heartbeats come from another thread, and go on)."""
        if getattr(self.backend, "stuck", False):
            return STUCK_QUEUE
        snap = self.backend.snapshot
        return snap.num_running + snap.num_waiting

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is not None:
            self.backend.start(loop)
            self._task = loop.create_task(self._receive())
            return
        self._thread = threading.Thread(target=self._run, name="phasewise-prefill-kv",
                                        daemon=True)
        self._thread.start()
        self._started.wait(30)

    def _ship(self, rid: str, first: int, end: int, data: Any) -> None:
        """On the engine thread, right after a forward pass filled these blocks
        (``data``: ``[layers, 2, blocks, block_size, kv_heads, head_dim]``, ``first`` on a
        block boundary). A chunk over the server's ``max_frame_bytes`` goes as several frames
        of whole blocks (the server's limit is never under one block)."""
        held = self._epochs.get(rid)
        if held is None:
            return
        link, epoch = held
        bs = self.layout.block_size
        client = link.client
        num_blocks = data.shape[2]
        block_bytes = data.numel() // num_blocks * data.element_size()
        step = max(1, client.max_frame_bytes // block_bytes)
        try:
            for b in range(0, num_blocks, step):
                n = min(step, num_blocks - b)
                start = first + b * bs
                part = data if n == num_blocks else data[:, :, b:b + n]
                client.send_kv(rid, epoch, first_block=start // bs, num_blocks=n,
                               first_token=start, num_tokens=min(end, start + n * bs) - start,
                               layer_start=0, layer_end=data.shape[0],
                               payload=kv_to_bytes(part))
        except (RuntimeError, ValueError) as e:  # its connection closed under it (a
            # reconnect, a stop), or a frame the server would refuse: this request's K/V is
            # lost (the decode side computes it), never the engine step it rode on
            log.info("K/V of %s not sent: %s", rid, e)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self.backend.start(asyncio.get_running_loop())
        self._started.set()
        try:
            await self._receive()
        finally:
            await asyncio.to_thread(self.backend.shutdown)

    async def _receive(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            await asyncio.gather(*(self._receive_from(link, tasks) for link in self.links))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _receive_from(self, link: _Link, tasks: set[asyncio.Task]) -> None:
        while not self._stop.is_set():
            if link.client.silent_for > self.server_deadline:
                await self._reconnect(link)
                continue
            msg = await asyncio.to_thread(link.client.recv, 0.1)
            if isinstance(msg, PrefillRequest):
                if msg.request_id in self._serving:  # another decode worker's, same id
                    link.client.send(Error(msg.request_id, msg.epoch, "ValueError",
                                           "request id already being prefilled here"))
                    continue
                task = asyncio.ensure_future(self._serve(msg, link))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                self._serving[msg.request_id] = task
                task.add_done_callback(
                    lambda _, rid=msg.request_id: self._serving.pop(rid, None))
            elif isinstance(msg, Abort) and self._epochs.get(msg.request_id) == (link,
                                                                                 msg.epoch):
                serving = self._serving.get(msg.request_id)
                if serving is not None:  # its finally closes the group: an abort here
                    serving.cancel()

    async def _serve(self, req: PrefillRequest, link: _Link) -> None:
        rid, epoch = req.request_id, req.epoch
        try:
            p = params_from_wire(req.params)
            first = dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
            self._epochs[rid] = (link, epoch)
            if p.structured_output is not None:  # not on the engine thread (it holds all)
                await compile_aside(self.backend.grammars, p.structured_output)
            group = await self.backend.add([PromptSpec(
                list(req.token_ids), first,
                export_kv_from=req.first_block * self.layout.block_size)], rid)
            final = None
            try:
                async for _, out in group:
                    if out.finished:
                        final = out
            finally:
                group.close()
            if final is None or not final.token_ids:
                raise RuntimeError("the prefill produced no token")
            link.client.send_done(rid, epoch)
            lp = final.logprobs[0] if final.logprobs else None
            link.client.send(FirstToken(rid, epoch, final.token_ids[0],
                                        None if lp is None else {str(k): v
                                                                 for k, v in lp.items()}))
        except Exception as e:  # noqa: BLE001 - reported to the decode side, which recomputes
            log.warning("prefill of %s failed: %s", rid, e)
            link.client.send(Error(rid, epoch, type(e).__name__, str(e)[:500]))
        finally:
            self._epochs.pop(rid, None)

    def close(self) -> None:
        """Stop taking prompts and close the connections (a thread of its own also stops its
        engine)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for link in self.links:
            link.client.close()

    def shutdown(self, timeout: float = 10.0) -> None:  # the server's, off its loop
        self._stop.set()
        for link in self.links:
            link.client.close()
        self.backend.shutdown(timeout)
