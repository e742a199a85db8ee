"""``phasewise router``: the OpenAI-compatible API in front of decode (or ``both``) workers,
served by the same server code as ``phasewise serve``, through the ``ServingBackend`` seam.

The router tokenizes, templates and validates each request as a server does, then relays the
token ids and sampling parameters to the decode worker its ``--routing`` policy ranks first
(by default the one that holds most of the prompt's blocks in its prefix cache, weighed
against its load: ``phasewise.disagg.prefix_index``) through ``/internal/v1/generate`` (see
``phasewise.server.internal``), and rebuilds the worker's output stream as its own. Whether
a prompt is prefilled remotely is the decode worker's call (its threshold, its own prefix
cache, the prefill workers' queues). The router watches every worker
(``/internal/v1/load`` each ``poll_interval``): load and what its prefix cache stored and
evicted since the last poll for routing, liveness for ``/health`` and ``/metrics``.

Faults: a decode worker that cannot be reached when a request arrives is skipped (the next
one is tried; none left is a 503 that names each worker and why), as is one that stops
answering polls for ``stream_deadline`` while the request waits for it. A worker whose
polls show a new process id (a restart; for one that reports none, one that comes back) is
checked as at start-up (``Fleet.recheck``) before it is routed to again. A stream is migrated
instead of lost: when its worker goes away (the connection breaks or ends early), stops (its
grace period ran out), answers no poll for ``stream_deadline`` or starts to drain (its
``handover`` notice, acted on only where another worker can take the stream), the router
sends each unfinished request to the next worker its policy ranks, with the prompt and the
tokens streamed so far as ``resume``: that worker recomputes their K/V (one prefill; its
prefix cache may hold the prompt) and goes on from that token position, its seeded draws
included (``LLMEngine.add_request``), so the client's stream carries on unbroken. At most
``max_migrations`` moves a request; with none left, or no worker to take it, the response
ends with an error that names the worker, why it went and why no other could go on. A
failure that is the request's own (its grammar, an engine error, an unusable line) is not
retried. A prefill worker is not touched: what it computed is ordinary evictable cache.

Every call carries ``--api-key`` as a bearer token, as any client's would.

Connections: every relay gives its connection back, however it ends (finished, aborted by
the client, refused by the worker, the worker gone). An asyncio cancel that lands while
httpx/httpcore close a response (their clean-up is shielded from anyio's cancellation, not
from ``Task.cancel``) leaves the pool's slot taken for good: a socket the router never
closes, in CLOSE-WAIT once the worker's keep-alive ends it. So a relay reads its body
without letting httpx close it at the end, is cancelled at most once (``_stop``), and its
response is closed by a task of its own that nothing cancels (``_close_later``); a response
that arrives to a waiter that gave up is closed the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import secrets
import time
import urllib.parse
from collections import deque
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from phasewise.disagg.fleet import (Fleet, RouterConfigError, Worker, instance_of, refusal,
                                    seed_address, why_failed)
from phasewise.disagg.prefix_index import (DEFAULT_LOAD_WEIGHT, DEFAULT_MAX_MIGRATIONS,
                                           DEFAULT_POLICY, DEFAULT_PREFIX_WEIGHT,
                                           MAX_MIGRATIONS_LIMIT, POLICIES, Choice, ParsedReport,
                                           WorkerBlocks, block_hashes, parse_report, rank)
from phasewise.engine.backend import (BackendInfo, EngineError, EngineObserver,
                                      EngineOverloaded, EngineSnapshot, EngineStopped,
                                      EngineUnavailable, FinishedRequest, GrammarFailed,
                                      PromptSpec, RequestGroup, SLORefused)
from phasewise.engine.relay import (INTERNAL_HEADER, OutputAssembler, RelayError,
                                    params_to_wire)
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.validation import ValidationError, check_sequences, is_count
from phasewise.model.tokenizer import Tokenizer

log = logging.getLogger("phasewise.router")
# httpx logs every request at INFO: the polls alone would be two lines a second per worker.
logging.getLogger("httpx").setLevel(logging.WARNING)

_EMPTY = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0)


@dataclasses.dataclass
class _Relay:
    """One worker's stream of (part of) a group: ``index`` maps the relay's own numbering of
    its specs to the group's requests (a migration resends only those not finished)."""

    worker: Worker
    resp: httpx.Response
    chunks: AsyncIterator[bytes]
    index: list[int]
    released: bool = False
    partial: list[bytes] = dataclasses.field(default_factory=list)  # an unfinished line
    backlog: deque[bytes] = dataclasses.field(default_factory=deque)  # lines not yet handled
    # time.monotonic() of its last bytes: a stream still flowing is not its worker's silence
    last_heard: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class _Stream:
    """A group's way through the workers: what to resend on a migration and where it is."""

    request_id: str
    specs: Sequence[PromptSpec]
    hashes: list[bytes]  # the first prompt's blocks (routing)
    relay: _Relay
    moves: int = 0
    # set before the router cancels the relay task itself: go on elsewhere, for this reason
    move: tuple[str, str] | None = None
    ended: bool = False  # the client left, or the router shuts down: never migrate
    aborted: set[int] = dataclasses.field(default_factory=set)  # requests the client ended
    moving: bool = False  # a move is under way (its task waits on another worker)
    stay: bool = False  # a drain's move found no taker: read the old worker to the end
    # what /internal/v1/abort must show a worker to abort this group's requests there (no
    # one else, who may learn their ids, can)
    abort_key: str = ""
    # The group's requests its client has fallen behind on (RequestGroup parks them): the
    # worker is told to park them there too (/internal/v1/park), one post at a time so that
    # a park and its release cannot pass each other.
    parked: set[int] = dataclasses.field(default_factory=set)
    parked_sent: set[int] = dataclasses.field(default_factory=set)
    parking: bool = False  # a sender runs


class _Migrate(Exception):
    """The worker cannot finish the relay (``reason``: a metric label); move it."""

    def __init__(self, reason: str, why: str, stopped: bool = False,
                 keep: bool = False) -> None:
        super().__init__(why)
        # keep: the old relay still streams (a drain) and is kept until the new one is open
        self.reason, self.why, self.stopped, self.keep = reason, why, stopped, keep


# A connection that broke under a request, before any reply (not one that could not be opened)
_BROKEN = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class _Silent(Exception):
    """The worker a request waits on has been down (its polls unanswered or refused) for the
    stream deadline."""


MIGRATION_REASONS = ("worker_lost", "worker_stopped", "worker_silent", "drain")


def _relay_ids(request_id: str, n: int) -> list[str]:
    """The ids a worker gives the ``n`` specs of a relay (as ``AsyncEngine.add`` names a
    group's requests)."""
    return [request_id] if n == 1 else [f"{request_id}-{k}" for k in range(n)]


def _wire_specs(specs: Sequence[PromptSpec], pending: Sequence[int],
                assembler: OutputAssembler | None = None) -> list[dict[str, Any]]:
    """The relay specs of a group's ``pending`` requests: each prompt once (n samples of
    one prompt share its token list: the others name it ``same_as``), its parameters (the
    first spec's whole, the others' as what differs from them: ``params_from``), and
    where ``assembler`` says the request streamed already (a migration) no prompt logprobs
    the client has and the tokens streamed so far as ``resume``."""
    first_of: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    base: dict[str, Any] | None = None  # the first spec's parameters
    for k, i in enumerate(pending):
        s = specs[i]
        j = first_of.setdefault(id(s.token_ids), k)
        params = params_to_wire(s.params)
        if assembler is not None and assembler.prompt_logprobs[i] is not None:
            params["prompt_logprobs"] = None
        spec: dict[str, Any] = {**({"token_ids": s.token_ids} if j == k else {"same_as": j})}
        if base is None:
            base = params
        if params is base or base.keys() != params.keys():
            spec["params"] = params
        else:
            # the group's samples differ in their seeds at most: the rest (a schema of
            # hundreds of KB among them) crosses once, not once per sample
            spec["params_from"] = 0
            spec["params"] = {key: v for key, v in params.items() if base[key] != v}
        spec["prompt"] = s.prompt
        if assembler is not None and assembler.ids[i]:
            spec["resume"] = list(assembler.ids[i])
        out.append(spec)
    return out


# A worker's /internal/v1/load reply: its snapshot and, at most, every block hash its pool
# holds (tens of bytes each); a longer one is not a worker's.
MAX_LOAD_BYTES = 64 << 20
# The most blocks the router's index keeps of one worker, whatever pool it reports.
MAX_INDEX_BLOCKS = 1 << 20


# EngineSnapshot's cumulative counters (the rest are the moment's gauges)
CUMULATIVE = ("num_preemptions", "prefix_queries", "prefix_hits", "spec_verifies",
              "spec_proposed", "spec_accepted", "spec_emitted")


async def _head(resp: httpx.Response, most: int) -> bytes:
    """At most ``most`` bytes of a streamed response's body (a refusal's JSON)."""
    got = bytearray()
    async for chunk in resp.aiter_bytes():
        got += chunk
        if len(got) >= most:
            break
    return bytes(got[:most])


def _index_capacity(snapshot: EngineSnapshot) -> int:
    """It can hold no more blocks than its pool has: the index keeps no more."""
    return max(1, min(snapshot.num_blocks, MAX_INDEX_BLOCKS))


@dataclasses.dataclass(frozen=True)
class _Load:
    """A worker's /internal/v1/load reply, read."""

    snapshot: EngineSnapshot
    open_groups: int
    draining: bool
    down: str | None  # why its engine cannot serve now (None: it can)
    kv: ParsedReport | None  # its K/V report, for its index
    instance: str | None  # its process's id (fleet.instance_of)


def _read_load(body: bytes, blocks: Any) -> _Load:
    """A worker's /internal/v1/load reply, every field checked (ValueError names the first
    that is not what a worker sends); its K/V report decoded for ``blocks`` (its index)."""
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("the reply is not an object")
    snapshot = EngineSnapshot.from_wire(data.get("snapshot"))
    groups = data.get("open_groups")
    if not is_count(groups):
        raise ValueError("its open_groups is not an integer in [0, 2^62]")
    draining, alive = data.get("draining"), data.get("alive")
    if not isinstance(draining, bool) or not isinstance(alive, bool):
        raise ValueError("its draining and alive are not both true or false")
    down = None
    if not alive:  # (its reason, where it gives a readable one, goes into /health and the log)
        why = data.get("down_reason")
        down = ("its engine is down: " + " ".join(why.split())[:300]
                if isinstance(why, str) and why.isprintable() and why.strip()
                else "its engine is not running")
    kv = data.get("kv_events")
    parsed = None
    if blocks is not None and kv is not None:
        parsed = parse_report(kv, _index_capacity(snapshot))
    return _Load(snapshot, groups, draining, down, parsed, instance_of(data))


async def _encode(body: dict[str, Any]) -> str:
    """A relay body's JSON; a long one's built off the event loop (no request's size may
    hold up another's stream)."""
    size = sum(len(s.get("token_ids", ())) + len(s.get("resume", ())) for s in body["specs"])
    return await asyncio.to_thread(json.dumps, body) if size > 2048 else json.dumps(body)


def _client_param(param: str | None) -> str | None:
    """``specs.0.params.max_tokens`` -> ``max_tokens``; ``specs.0.token_ids`` -> ``prompt``."""
    if not param or not param.startswith("specs."):
        return param
    rest = param.split(".", 2)[2] if param.count(".") >= 2 else ""
    if rest.startswith("params."):
        return rest[len("params."):]
    return "prompt" if rest == "token_ids" else rest or None


def _stop(task: asyncio.Task) -> None:
    """Cancel a task that reads from a worker, once: a second cancel would land in the
    clean-up the first one began."""
    if not task.done() and not task.cancelling():
        task.cancel()


def _line_cap(info: BackendInfo) -> int:
    """The longest relay line a worker of this model sends: an output's delta, and on a
    request's first line its prompt logprobs (up to ~1 KiB a prompt position)."""
    return (16 << 20) + info.max_model_len * 1024


def _split(pending: list[bytes], chunk: bytes) -> list[bytes]:
    """The whole lines ``chunk`` completes (``pending``: the unfinished line's pieces)."""
    lines = []
    start = 0
    while (end := chunk.find(b"\n", start)) >= 0:
        pending.append(chunk[start:end])
        lines.append(b"".join(pending))
        pending.clear()
        start = end + 1
    if start < len(chunk):
        pending.append(chunk[start:])
    return lines


def _error_of(resp_body: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) of a worker's error body."""
    try:
        err = json.loads(resp_body)["error"]
        return str(err.get("message")), err.get("param"), err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return resp_body[:300].decode(errors="replace"), None, None


class Router(Fleet):
    """A ``ServingBackend`` over remote workers (see the module). ``connect()`` (blocking,
    before the server is built) waits for the workers and checks they serve ``model_dir``'s
    checkpoint."""

    def __init__(self, decode: Sequence[str], prefill: Sequence[str] = (), *,
                 model_dir: str | Path, api_key: str | None = None,
                 poll_interval: float = 0.5, wait_s: float = 300.0,
                 request_timeout: float = 10.0, stream_deadline: float = 15.0,
                 admit_timeout: float = 120.0, routing: str = DEFAULT_POLICY,
                 prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
                 load_weight: float = DEFAULT_LOAD_WEIGHT, block_size: int = 16,
                 max_migrations: int = DEFAULT_MAX_MIGRATIONS, discover: bool = False,
                 discover_interval: float = 5.0, internal_key: str | None = None) -> None:
        if not decode:
            raise RouterConfigError("the router needs at least one --decode URL")
        urls = [u.rstrip("/") for u in (*decode, *prefill)]
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise RouterConfigError(f"worker URL {u!r} must start with http:// or https://")
        if len(set(urls)) != len(urls):
            raise RouterConfigError(f"a worker URL is listed twice: {urls}")
        if poll_interval <= 0:
            raise RouterConfigError(f"poll_interval must be > 0, got {poll_interval}")
        if not 0.5 <= stream_deadline <= 3600:
            raise RouterConfigError(f"--stream-deadline must be in [0.5, 3600] seconds, got "
                                    f"{stream_deadline}")
        if routing not in POLICIES:
            raise RouterConfigError(f"--routing must be one of {', '.join(POLICIES)}; got "
                                    f"{routing!r}")
        for name, v in (("--prefix-weight", prefix_weight), ("--load-weight", load_weight)):
            if not 0 <= v <= 1000:
                raise RouterConfigError(f"{name} must be in [0, 1000], got {v}")
        if not 1 <= block_size <= 1024:
            raise RouterConfigError(f"block_size must be in [1, 1024], got {block_size}")
        if isinstance(max_migrations, bool) or not isinstance(max_migrations, int) or \
                not 0 <= max_migrations <= MAX_MIGRATIONS_LIMIT:
            raise RouterConfigError(f"--max-migrations must be an integer in [0, "
                                    f"{MAX_MIGRATIONS_LIMIT}], got {max_migrations!r}")
        # --discover: each --decode URL's host is a DNS name whose addresses are the workers
        # (a Kubernetes headless Service's ready pods), resolved again every
        # discover_interval: workers join as they appear, and leave, once nothing streams
        # from them, as they disappear.
        self.discover = discover
        if not 1.0 <= discover_interval <= 3600:
            raise RouterConfigError(f"--discover-interval must be in [1, 3600] seconds, got "
                                    f"{discover_interval}")
        self.discover_interval = discover_interval
        self._seeds = [seed_address(u) for u in urls[:len(decode)]] if discover else []
        self._last_seen: dict[tuple[str, str, int], set[str]] = {}  # per seed, its addresses
        self.decode = [] if discover else [Worker(u, "decode") for u in urls[:len(decode)]]
        self.prefill = [Worker(u, "prefill") for u in urls[len(decode):]]
        self._identity: dict[str, Any] = {}  # what every worker must serve (connect)
        self.model_dir = Path(model_dir)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if internal_key is not None:  # the workers' /internal/* take it (server.guard)
            self.headers[INTERNAL_HEADER] = internal_key
        self.poll_interval = poll_interval
        self.wait_s = wait_s
        self.request_timeout = request_timeout
        # A worker that has answered no poll for this long has its open streams ended with
        # an error (a host that died without closing its connections sends nothing more).
        self.stream_deadline = stream_deadline
        self.admit_timeout = admit_timeout  # for the worker to take (or refuse) a request
        # how often one request may be moved to another worker (each move re-prefills it)
        self.max_migrations = max_migrations
        self.migrations = dict.fromkeys(MIGRATION_REASONS, 0)  # moves, by reason
        self.migrations_failed = 0  # streams that needed a move and could not get one
        self._background: set[asyncio.Task] = set()
        self.tokenizer = Tokenizer(self.model_dir)
        self.tokenizer.max_token_chars  # noqa: B018  (read once here, not on a request)
        self.info: BackendInfo = None  # type: ignore[assignment]  # set by connect()
        self._defaults: dict[str, Any] = {}
        self._observers: list[EngineObserver] = []
        # cumulative counters over the decode workers' lifetimes, and each one's last
        # snapshot counted (_count)
        self._totals = dict.fromkeys(CUMULATIVE, 0)
        self._counted: dict[str, EngineSnapshot] = {}
        self._groups: dict[str, tuple[RequestGroup, asyncio.Task, _Stream]] = {}
        # Every relay task until it ends (a closed group's may still read its end of
        # stream): what shutdown and a silent worker's deadline stop.
        self._relays: dict[asyncio.Task, tuple[RequestGroup, _Stream]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._poller: asyncio.Task | None = None
        self._accepting = True
        self._turn = itertools.count()
        # Which decode worker holds which prompt blocks (phasewise.disagg.prefix_index): the
        # workers hash blocks of block_size tokens (serve's --block-size; the same on all).
        self.routing, self.prefix_weight, self.load_weight = routing, prefix_weight, load_weight
        self.block_size = block_size
        self.kv_window: int | None = None  # the workers' shared sliding window (their info)
        self.index = {w.url: WorkerBlocks() for w in self.decode}
        self.routed: dict[tuple[str, str], int] = {}  # (worker url, policy) -> requests
        self.routed_blocks = [0, 0]  # prompt blocks routed, of them expected cached
        self._trace_lookups: set[asyncio.Future] = set()  # the dashboard's, in flight
        self._first_info: dict[str, Any] = {}  # the first decode worker's info (connect)

    # -- ServingBackend --------------------------------------------------------------------
    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        return SamplingParams(**{**self._defaults, **overrides})

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_event_loop()
        # An idle connection is dropped here before the worker's keep-alive (uvicorn's: 5 s)
        # ends it from its side: a relay never starts on a socket the worker is closing,
        # and none waits half-closed in the pool (one the worker closes early anyway is
        # dropped at the next request, a poll within poll_interval).
        self._client = httpx.AsyncClient(
            headers=self.headers,
            timeout=httpx.Timeout(self.request_timeout, read=None),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=64,
                                keepalive_expiry=2.0))
        self._poller = self._loop.create_task(self._poll())

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def is_alive(self) -> bool:
        return (self._poller is not None and not self._poller.done()
                and any(w.up for w in self.decode))

    @property
    def down_reason(self) -> str:
        if self._poller is None or self._poller.done():
            return "the router's worker watcher is not running"
        return "no decode worker is reachable: " + "; ".join(
            f"{w.url} ({w.reason})" for w in self.decode)

    def health_detail(self) -> dict[str, Any]:
        return {"workers": [{"url": w.url, "role": w.role, "up": w.up,
                             "draining": w.draining, "reason": w.reason}
                            for w in self.workers]}

    def _count(self, url: str, snap: EngineSnapshot) -> None:
        """Add what a decode worker's cumulative counters grew by since its last poll to
        the router's own totals (a counter that went down: the worker restarted, and all
        of it is new): a sum over the workers up at each moment would fall while one misses
        a poll, and count its whole lifetime again when it is back."""
        last = self._counted.get(url)
        for name in CUMULATIVE:
            now = getattr(snap, name)
            before = getattr(last, name) if last is not None else 0
            self._totals[name] += now - before if now >= before else now
        self._counted[url] = snap

    @property
    def snapshot(self) -> EngineSnapshot:
        """The decode workers' snapshots, summed over those up (``kv_usage``: their mean);
        the cumulative counters are the router's own totals (``_count``)."""
        snaps = [w.snapshot for w in self.decode if w.up and w.snapshot is not None]
        if not snaps:
            return dataclasses.replace(_EMPTY, **self._totals)
        total = {f.name: sum(getattr(s, f.name) for s in snaps)
                 for f in dataclasses.fields(EngineSnapshot)}
        total["kv_usage"] = total["kv_usage"] / len(snaps)
        total.update(self._totals)
        return EngineSnapshot(**total)

    @property
    def num_open_groups(self) -> int:
        return len({id(g) for g, _, _ in self._groups.values()})

    async def add(self, specs: Sequence[PromptSpec], request_id: str,
                  arrival_time: float | None = None) -> RequestGroup:
        if not self._accepting:
            raise EngineStopped("the server is shutting down and takes no new requests")
        assert self._client is not None, "start() the router first"
        n = len(specs)
        check_sequences(n, 1, self.info.max_waiting)
        ids = _relay_ids(request_id, n)
        if any(rid in self._groups for rid in ids):
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # handover: the worker may write a drain notice into the stream (this router moves it)
        abort_key = secrets.token_hex(16)  # aborts on the worker only what this group asks
        body: dict[str, Any] = {"request_id": request_id, "handover": True,
                                "abort_key": abort_key, "specs": _wire_specs(specs, range(n))}
        slo = specs[0].slo if specs else None
        if slo is not None:  # each worker judges it against its own queue
            for name, value in (("slo_ttft_ms", slo.ttft_s), ("slo_tpot_ms", slo.tpot_s)):
                if value is not None:
                    body[name] = value * 1e3
        content = await _encode(body)
        # The first prompt's blocks decide (the n samples of one prompt share them).
        first = specs[0].token_ids if specs else []
        hashes = (await asyncio.to_thread(block_hashes, first, self.block_size)
                  if len(first) > 4096 else block_hashes(first, self.block_size))
        relay, choice = await self._open(content, hashes, list(range(n)))  # in_flight from here
        try:
            group = RequestGroup(ids, self.abort, self._closed, park=self.park)
            group.remote_hits = [None] * n
            group.routing = (f"{relay.worker.url} {choice.policy} expected_hit="
                             f"{choice.expected_hit}/{choice.blocks}blocks")
            assembler = OutputAssembler(ids, [s.token_ids for s in specs],
                                        [s.prompt for s in specs], arrival,
                                        vocab_size=self.info.vocab_size,
                                        max_token_chars=self.tokenizer.max_token_chars)
            assembler.admitted()
            stream = _Stream(request_id, list(specs), hashes, relay, abort_key=abort_key)
            task = asyncio.ensure_future(self._run(group, assembler, stream))
        except BaseException:
            self._release(relay)
            raise
        self._relays[task] = (group, stream)
        def done(t: asyncio.Task) -> None:
            # A task cancelled before it began never ran _run: its relay goes here, and a
            # client still waiting learns why (the router cancelled it: a silent worker).
            self._relays.pop(t, None)
            self._release(stream.relay)
            if t.cancelled() and not stream.ended and not group.finished:
                group._put(EngineError(
                    f"the decode worker {stream.relay.worker.url} stopped answering before "
                    "this response began; the response is incomplete"))

        task.add_done_callback(done)
        for rid in ids:
            self._groups[rid] = (group, task, stream)
        return group

    async def _open(self, content: str, hashes: list[bytes], index: list[int],
                    avoid: Sequence[Worker] = ()) -> tuple[_Relay, Choice]:
        """Start the relay on the best decode worker (``--routing``) that takes it (none of
        ``avoid``: a migration's, those it left). ``index``: the group's request each spec
        of ``content`` is."""
        assert self._client is not None
        tried: list[str] = []
        overloaded = False
        slo: list[tuple[int, str, str]] = []  # workers that refused it by its SLO
        for w, held in self._candidates(hashes, avoid):
            w.in_flight += 1  # before the wait, so concurrent requests spread out
            try:
                # identity: the body is read as raw NDJSON bytes (see add).
                req = self._client.build_request(
                    "POST", w.url + "/internal/v1/generate", content=content,
                    headers={"Content-Type": "application/json",
                             "Accept-Encoding": "identity"})
                resp = await self._send(req, w)
            except (httpx.HTTPError, TimeoutError, _Silent) as e:
                w.in_flight -= 1
                if isinstance(e, TimeoutError):
                    tried.append(f"{w.url} (took no request in {self.admit_timeout:g} s)")
                    continue
                if isinstance(e, _Silent):
                    tried.append(f"{w.url} ({e})")
                    continue
                w.down(why_failed(e))
                tried.append(f"{w.url} ({w.reason})")
                continue
            except BaseException:
                w.in_flight -= 1
                raise
            if resp.status_code == 200:
                choice = Choice(self.routing, len(hashes), held)
                blocks = self.index.get(w.url)  # (none if --discover dropped it meanwhile)
                if blocks is not None:
                    blocks.enter(hashes)  # it will hold them once it prefills
                if not avoid:  # (a migration is counted as one, not as a new request)
                    key = (w.url, self.routing)
                    self.routed[key] = self.routed.get(key, 0) + 1
                    self.routed_blocks[0] += len(hashes)
                    self.routed_blocks[1] += held
                # The body's chunks as they come; unlike aiter_raw/aiter_lines this does
                # not close the response at its end, inside the relay's task (see the
                # module).
                chunks: AsyncIterator[bytes] = aiter(resp.stream)  # type: ignore[arg-type]
                return _Relay(w, resp, chunks, index), choice
            w.in_flight -= 1
            # Read and closed by a task of its own, which ends even if this waiter is
            # cancelled (the client left).
            raw = await asyncio.shield(self._spawn(self._read_error(resp)))
            if isinstance(raw, httpx.HTTPError):
                w.down(why_failed(raw))
                tried.append(f"{w.url} ({w.reason})")
                continue
            message, param, code = _error_of(raw)
            if resp.status_code == 400 and "is already in use" in message:
                # (a retried send whose first try the worker took before the connection
                # broke, and has not aborted yet: not the client's error; another may go on)
                tried.append(f"{w.url} (still held this request from a broken connection)")
                continue
            if resp.status_code == 400:
                # The relay's field names, as the client named them.
                param = _client_param(param)
                raise ValidationError(message, param)
            if resp.status_code == 503 and code in ("overloaded", "too_many_connections"):
                # busy, not going away: another worker may take it; this one stays in use
                overloaded = True
                tried.append(f"{w.url} ({code})")
                continue
            if resp.status_code == 429 and code in ("slo_ttft", "slo_tpot"):
                retry = resp.headers.get("retry-after", "1")
                slo.append((int(retry) if retry.isascii() and retry.isdecimal() else 1, code,
                            message))
                tried.append(f"{w.url} ({code})")
                continue
            if resp.status_code == 503:
                w.draining = True
                tried.append(f"{w.url} ({message})")
                continue
            if resp.status_code == 401:
                raise EngineError(f"decode worker {w.url} refused the router's API key: give "
                                  "the router the workers' --api-key")
            if resp.status_code == 413:
                raise ValidationError(
                    f"the request, relayed as {len(content)} bytes for {len(index)} "
                    f"sequence(s) (its prompts, their parameters once, the tokens a moved "
                    f"stream resumes from), is past what decode worker {w.url} takes "
                    f"({message}): shorten the prompts or lower n, or raise the workers' "
                    "--max-request-size")
            # Anything else (a 500, a redirect, a proxy's page): that worker cannot take
            # requests now, another may; it stays down until a poll finds it well.
            w.down(f"answered {resp.status_code} to a request: {message[:200]}")
            tried.append(f"{w.url} ({w.reason})")
        if slo and len(slo) == len(tried):
            # every worker predicts a miss: the one that would soonest have room speaks
            retry, code, message = min(slo)
            raise SLORefused(f"{message} (every decode worker refused it by its target: "
                             f"{'; '.join(tried)})", code, retry)
        if overloaded:
            raise EngineOverloaded("every decode worker is busy (its waiting limit or its "
                                   "connection limit): " + "; ".join(tried))
        if not tried:
            tried = [f"{w.url} ({w.reason or 'draining'})" for w in self.decode]
        raise EngineUnavailable("no decode worker can take this request now: "
                                + "; ".join(tried))

    async def _send(self, req: httpx.Request, w: Worker) -> httpx.Response:
        """``send(req, stream=True)`` to worker ``w``, given up after ``admit_timeout``
        (``TimeoutError``), once ``w`` has answered no poll for ``stream_deadline`` seconds
        (``_Silent``: a frozen worker's streams move then, and a request waiting on it must
        not wait longer than they do), or when this waiter is cancelled; a response that
        comes after that is closed, not dropped with its connection.

        A connection that breaks before any reply is tried once more on a fresh one: a kept-
        alive connection the worker closed as the request went out (its keep-alive timer
        ran out while it was frozen, say) is no sign that it cannot take the request."""
        assert self._client is not None
        send = asyncio.ensure_future(self._client.send(req, stream=True))
        until = time.monotonic() + self.admit_timeout
        retried = False
        try:
            while True:
                left = until - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait({send}, timeout=min(left, 0.25))
                if done and not retried and isinstance(send.exception(), _BROKEN):
                    log.debug("decode worker %s: %s; sending again", w.url,
                              why_failed(send.exception()))
                    retried = True
                    send = asyncio.ensure_future(self._client.send(req, stream=True))
                    continue
                if done:
                    return send.result()
                silent = None if w.up or w.down_since is None else \
                    time.monotonic() - w.down_since
                if silent is not None and silent >= self.stream_deadline:
                    raise _Silent(f"down ({w.reason}) for {silent:.0f} s while this request "
                                  "waited to be taken")
        except BaseException:
            if not send.done() or send.cancelled() or send.exception() is None:
                self._abandon(send)
            raise

    def _abandon(self, send: asyncio.Task) -> None:
        def close(_: asyncio.Future) -> None:
            if not send.cancelled() and send.exception() is None:
                self._close_later(send.result())

        _stop(send)
        send.add_done_callback(close)

    @staticmethod
    async def _read_error(resp: httpx.Response) -> bytes | httpx.HTTPError:
        try:
            return await resp.aread()
        except httpx.HTTPError as e:
            return e
        finally:
            await resp.aclose()

    def _candidates(self, hashes: Sequence[bytes] = (), avoid: Sequence[Worker] = ()
                    ) -> list[tuple[Worker, int]]:
        """Decode workers that are up, best first by ``--routing``
        (``phasewise.disagg.prefix_index.rank``), each with the prompt blocks it holds."""
        turn = next(self._turn)
        live = [w for w in self.decode if w.up and not w.draining and not w.retired
                and not any(w is a for a in avoid)]
        held = [self.index[w.url].held(hashes, self.block_size, self.kv_window)
                for w in live]
        best = rank(self.routing, [w.load for w in live], held, len(hashes), turn,
                    self.prefix_weight, self.load_weight)
        return [(live[i], held[i]) for i in best]

    async def _run(self, group: RequestGroup, assembler: OutputAssembler,
                   stream: _Stream) -> None:
        """The group's relay task: its worker's lines into the group, and where that worker
        cannot finish them, what is unfinished moved to another (see the module). A drain's
        move keeps the old relay until the new one is open: where no worker takes the stream
        after all, it reads on from the old one (which finishes it within its grace)."""
        last: dict[str, Any] = {}  # each request's latest output, until it finishes
        try:
            while True:
                relay = stream.relay
                move: _Migrate | None = None
                try:
                    await self._pump(group, assembler, stream, last)
                except _Migrate as m:
                    move = m
                except asyncio.CancelledError:
                    # The router's own cancel (a silent worker's deadline) moves the stream;
                    # any other (the client left, shutdown) ends it.
                    if stream.move is None or stream.ended:
                        self._release(relay)
                        raise
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()
                    move = _Migrate(*stream.move)
                    stream.move = None
                except BaseException:
                    self._release(relay)
                    raise
                if move is None:
                    self._release(relay)
                    return
                if not move.keep:
                    self._release(relay)
                stream.moving = True
                try:
                    moved = await self._migrate(group, assembler, stream, move)
                finally:
                    stream.moving = False
                if move.keep:
                    if moved:
                        self._release(relay)  # its worker sees the router go, and aborts
                    else:
                        stream.stay = True  # the worker finishes it: no more moves asked
                    continue
                if not moved:
                    return
        except Exception as e:  # a bug here must still end the client's stream
            log.exception("relaying %s failed", stream.request_id)
            if not group.finished:
                group._put(EngineError(f"the router failed relaying this response: "
                                       f"{why_failed(e)}"))
        finally:
            # What did not finish ended here (the client left, no worker could go on, a bad
            # line): the observers hear of it as an abort, as an engine's would.
            if last:
                self._notify([], [FinishedRequest.of(o, "abort") for o in last.values()])

    async def _pump(self, group: RequestGroup, assembler: OutputAssembler, stream: _Stream,
                    last: dict[str, Any]) -> None:
        """Worker lines -> the group's outputs (and the observers: the router's metrics).
        Raises ``_Migrate`` where the worker cannot finish the relay; lines read and not yet
        handled wait on the relay (``backlog``), so a drain's move that fails reads on from
        where it stopped. Its only awaits are the body's reads: a cancel (``_stop``) ends a
        read, which httpcore cleans up; closing the response is ``_release``'s (see the
        module)."""
        relay = stream.relay
        worker = relay.worker
        cap = _line_cap(self.info)
        try:
            while True:
                while relay.backlog:
                    raw = relay.backlog.popleft()
                    if len(raw) > cap:
                        raise RelayError(f"a line of {len(raw) >> 20} MiB, longer than any "
                                         f"output of this model ({cap >> 20} MiB)")
                    line = raw.decode()
                    if not line:
                        continue
                    if line.startswith('{"notice"'):
                        # the worker drains: move if another worker can take the stream and
                        # a move is left, else read on (the worker finishes it in its grace)
                        if (not stream.stay and stream.moves < self.max_migrations
                                and any(w.up and not w.draining and not w.retired
                                        and w is not worker for w in self.decode)):
                            raise _Migrate("drain", "is draining (shutting down)", keep=True)
                        continue
                    if line.startswith('{"error"'):
                        err = json.loads(line)["error"]
                        if not isinstance(err, dict):
                            raise RelayError(f"malformed error line: {line[:200]}")
                        kind = err.get("kind")
                        if kind == "stopped":
                            raise _Migrate("worker_stopped",
                                           f"stopped ({err.get('message')})", stopped=True)
                        cls = GrammarFailed if kind == "grammar" else EngineError
                        group._put(cls(f"decode worker {worker.url}: {err.get('message')}"))
                        return
                    out = assembler.feed(line, relay.index)
                    group._put(out)
                    ended = []
                    last[out.request_id] = out
                    if out.finished:
                        del last[out.request_id]
                        ended = [FinishedRequest.of(out, default="stop")]
                    self._notify([out], ended)
                chunk = await anext(relay.chunks, None)
                if chunk is None:
                    break
                relay.last_heard = time.monotonic()
                relay.backlog.extend(_split(relay.partial, chunk))
                if len(relay.partial) > 1 and sum(map(len, relay.partial)) > cap:
                    raise RelayError(f"a line past {cap >> 20} MiB that does not end, longer "
                                     "than any output of this model")
            if relay.partial:
                raise RelayError(f"the stream ended inside a line: {relay.partial[0][:200]!r}")
            if not all(assembler.finished[i] or i in stream.aborted for i in relay.index):
                raise _Migrate("worker_lost", "ended the stream before every request "
                               "finished")
        except (asyncio.CancelledError, _Migrate):
            raise
        except httpx.HTTPError as e:
            worker.down(why_failed(e))
            raise _Migrate("worker_lost", f"went away while streaming this response "
                           f"({why_failed(e)})") from None
        except (RelayError, ValueError, KeyError, TypeError, AttributeError) as e:
            group._put(EngineError(f"decode worker {worker.url} sent an unusable line: "
                                   f"{why_failed(e)}"))
        except EngineError as e:
            group._put(e)

    async def _migrate(self, group: RequestGroup, assembler: OutputAssembler,
                       stream: _Stream, move: _Migrate) -> bool:
        """Resume the group's unfinished requests on another worker (``True``), or (for a
        move that keeps its old relay, quietly) end the response with an error that says
        why none could go on (``False``)."""
        gone = stream.relay.worker
        pending = [i for i in range(len(stream.specs))
                   if not assembler.finished[i] and i not in stream.aborted]
        if not pending:
            return False
        what = f"the decode worker {gone.url} {move.why}"
        if stream.moves >= self.max_migrations:
            if not move.keep:
                self._fail(group, move, f"{what}; this response was moved {stream.moves} "
                           f"time(s) already (--max-migrations {self.max_migrations}); the "
                           "response is incomplete")
            return False
        # (moved: admitted once already, it is not judged by a worker's SLO targets again)
        content = await _encode({"request_id": stream.request_id, "moved": True,
                                 "handover": True, "abort_key": stream.abort_key,
                                 "specs": _wire_specs(stream.specs, pending, assembler)})
        try:
            relay, _ = await self._open(content, stream.hashes, pending, [gone])
        except Exception as e:  # noqa: BLE001 - every refusal ends the stream with its reason
            if move.keep:
                log.info("request %s stays on draining %s: no other worker took it (%s)",
                         stream.request_id, gone.url, why_failed(e))
            else:
                self._fail(group, move, f"{what}, and no other decode worker could take it "
                           f"over ({why_failed(e)}); the response is incomplete")
            return False
        stream.relay = relay
        self._repark(stream)
        stream.moves += 1
        self.migrations[move.reason] += 1
        group.routing = f"{group.routing} moved={relay.worker.url}({move.reason})"
        log.info("request %s moved from %s to %s (%s): %d request(s), %d token(s) "
                 "streamed so far", stream.request_id, gone.url, relay.worker.url,
                 move.reason, len(pending), sum(len(assembler.ids[i]) for i in pending))
        # the client ended some of them while the move was under way: end them there too
        late = [k for k, i in enumerate(relay.index) if i in stream.aborted]
        if late and self._loop is not None and self._client is not None:
            names = _relay_ids(stream.request_id, len(relay.index))
            self._spawn(self._abort_remote(relay.worker, [names[k] for k in late]))
        return True

    def _fail(self, group: RequestGroup, move: _Migrate, message: str) -> None:
        self.migrations_failed += 1
        group._put(EngineStopped(message) if move.stopped else EngineError(message))

    def _release(self, relay: _Relay) -> None:
        """A relay ended (even one whose task was cancelled before it began): its count, its
        connection (back to the pool if the stream ended, else closed: the worker sees the
        client go and aborts what still runs). Once per relay."""
        if relay.released:
            return
        relay.released = True
        relay.worker.in_flight -= 1
        self._close_later(relay.resp, relay.chunks)

    def _spawn(self, coro: Any) -> asyncio.Task:
        """A task the router keeps (until it ends) and never cancels."""
        assert self._loop is not None
        t = self._loop.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    def _close_later(self, resp: httpx.Response,
                     chunks: AsyncIterator[bytes] | None = None) -> None:
        """Close ``resp`` (and the iterator over its body) in a task nothing cancels."""
        if self._loop is None or self._loop.is_closed():
            return

        async def close() -> None:
            try:
                # (an async generator: a relay that returned early left it suspended on the
                # stream)
                if chunks is not None:
                    await chunks.aclose()  # type: ignore[attr-defined]
                await resp.aclose()
            except (httpx.HTTPError, OSError) as e:
                log.debug("closing a relay to %s: %s", resp.url, why_failed(e))

        self._spawn(close())

    def _notify(self, outputs: list[Any], finished: list[FinishedRequest]) -> None:
        snap = self.snapshot
        for obs in self._observers:
            try:
                obs.on_step(None, outputs, finished, snap)
            except Exception:  # noqa: BLE001 - metrics must never end a stream
                log.exception("observer failed")

    def abort(self, request_ids: Sequence[str]) -> None:
        """End these requests: a whole group closes its relay (the worker aborts it when the
        connection goes); part of one is aborted on the worker by id."""
        by_group: dict[int, tuple[RequestGroup, asyncio.Task, _Stream, list[str]]] = {}
        for rid in request_ids:
            entry = self._groups.get(rid)
            if entry is not None:
                g, t, s = entry
                by_group.setdefault(id(g), (g, t, s, []))[3].append(rid)
        for group, task, stream, rids in by_group.values():
            if group.finished:
                continue  # its stream is at its end: the relay reads it and gives it back
            if set(rids) >= group._open:
                stream.ended = True
                _stop(task)
                continue
            mine = {group.request_ids.index(rid) for rid in rids}
            stream.aborted |= mine  # never resumed elsewhere
            relay = stream.relay
            names = _relay_ids(stream.request_id, len(relay.index))  # the relay's numbering
            theirs = [names[k] for k, i in enumerate(relay.index) if i in mine]
            if theirs and self._loop is not None and self._client is not None:
                self._spawn(self._abort_remote(relay.worker, theirs, stream.abort_key))

    def park(self, request_ids: Sequence[str], parked: bool) -> None:
        """The client fell behind on (or caught up with) these requests: the router's own
        group merges their outputs, so the worker would never see it; tell it, so that it
        parks them (runs none of their tokens, gives their seats up first) or runs them on."""
        for rid in request_ids:
            entry = self._groups.get(rid)
            if entry is None:
                continue
            group, _, stream = entry
            i = group.request_ids.index(rid)
            (stream.parked.add if parked else stream.parked.discard)(i)
            self._post_parks(stream)

    def _repark(self, stream: _Stream) -> None:
        """The stream moved to another worker: nothing is parked there yet, so its parked
        requests are posted again (its client still reads none of them)."""
        stream.parked_sent = set()
        if stream.parked:
            self._post_parks(stream)

    def _post_parks(self, stream: _Stream) -> None:
        """Start the stream's one sender of park posts, unless it runs already."""
        if not stream.parking and self._loop is not None and self._client is not None:
            stream.parking = True
            self._spawn(self._send_parks(stream))

    async def _send_parks(self, stream: _Stream) -> None:
        """Post the stream's parked set to its worker until what was sent is what is wanted
        (a request finished or moved meanwhile is ignored there)."""
        assert self._client is not None
        try:
            while stream.parked != stream.parked_sent and not stream.ended:
                want = set(stream.parked)
                relay = stream.relay
                names = _relay_ids(stream.request_id, len(relay.index))
                for parked in (True, False):
                    changed = (want - stream.parked_sent) if parked else (
                        stream.parked_sent - want)
                    theirs = [names[k] for k, i in enumerate(relay.index) if i in changed]
                    if theirs:
                        try:
                            await self._client.post(
                                relay.worker.url + "/internal/v1/park",
                                json={"request_ids": theirs, "abort_key": stream.abort_key,
                                      "parked": parked})
                        except httpx.HTTPError as e:
                            log.warning("could not tell %s to park %s: %s", relay.worker.url,
                                        theirs, why_failed(e))
                if stream.relay is relay:  # (moved meanwhile: _repark emptied it; go again)
                    stream.parked_sent = want
        finally:
            stream.parking = False

    async def _abort_remote(self, worker: Worker, rids: list[str], key: str) -> None:
        assert self._client is not None
        try:
            await self._client.post(worker.url + "/internal/v1/abort",
                                    json={"request_ids": rids, "abort_key": key})
        except httpx.HTTPError as e:
            log.warning("could not abort %s on %s: %s", rids, worker.url, why_failed(e))

    def _closed(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            entry = self._groups.pop(rid, None)
            # A finished group's relay reads the worker's end of stream (it follows the last
            # output), so its connection goes back to the pool, not closed.
            if entry is not None and not entry[0].finished:
                entry[2].ended = True
                _stop(entry[1])

    def abort_all(self, reason: str) -> None:
        for group, task, stream in {id(g): (g, t, s)
                                    for g, t, s in self._groups.values()}.values():
            stream.ended = True
            group._put(EngineStopped(reason))
            _stop(task)

    async def find_trace(self, request_id: str, found: dict[str, Any] | None
                         ) -> dict[str, Any] | None:
        """For the dashboard's playground: the router's own trace of a request (``found``:
        its outputs on the router's clock) with the steps it rode on, from the decode worker
        that ran it (each is asked in turn)."""
        if self._client is None or len(self._trace_lookups) >= 8:  # (bounded: best effort)
            return found
        client = self._client
        path = f"/dashboard/api/requests/{urllib.parse.quote(request_id, safe='')}"

        async def ask(w: Worker) -> dict[str, Any] | None:
            try:
                r = await client.get(w.url + path, timeout=2.0)
                data = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
            return data if isinstance(data, dict) else None

        up = [w for w in self.decode if w.up]
        # Not cancelled with its caller: a cancel inside httpx's close of a reply would keep
        # its connection (see the module). Each ask ends within its timeout.
        task = asyncio.ensure_future(asyncio.gather(*(ask(w) for w in up)))
        self._trace_lookups.add(task)
        task.add_done_callback(self._trace_lookups.discard)
        answers = await asyncio.shield(task)
        for w, data in zip(up, answers):
            if data is None:
                continue
            if found is None:
                return {**data, "worker": w.url}
            return {**found, "steps": data.get("steps", []),
                    "step_detail": data.get("step_detail", []), "worker": w.url,
                    "worker_outputs": data.get("outputs", [])}
        return found

    # -- watching the workers --------------------------------------------------------------
    async def _poll(self) -> None:
        assert self._client is not None
        watch = asyncio.ensure_future(self._watch_silent())
        try:
            await self._poll_rounds()
        finally:
            watch.cancel()

    async def _watch_silent(self) -> None:
        """Apart from the polls (one may wait its timeout): a silent worker's streams move
        within a fraction of a second of its deadline."""
        while True:
            try:
                self._end_streams_of_silent_workers()
            except Exception:  # noqa: BLE001 - the watch must outlive a bug, and say so
                log.exception("watching for silent workers failed")
            await asyncio.sleep(min(0.25, self.stream_deadline / 4))

    async def _poll_rounds(self) -> None:
        assert self._client is not None
        next_look = time.monotonic() + self.discover_interval
        while True:
            if self.discover and time.monotonic() >= next_look:
                next_look = time.monotonic() + self.discover_interval
                try:
                    await self._rediscover()
                except Exception:  # noqa: BLE001 - discovery must never stop the polls
                    log.exception("--discover failed")
            await asyncio.gather(*(self._poll_one(w) for w in self.workers))
            # the workers' fresh snapshots to the gauges (/metrics), which would otherwise
            # keep the last streamed output's view while the router is idle
            self._notify([], [])
            await asyncio.sleep(self.poll_interval)

    def _end_streams_of_silent_workers(self) -> None:
        now = time.monotonic()
        for w in self.decode:
            if w.up or w.down_since is None or now - w.down_since < self.stream_deadline:
                continue
            for task, (_, stream) in list(self._relays.items()):
                relay = stream.relay
                # (a stream being moved waits on another worker, which a cancel must not
                # cut)
                if (relay.worker is not w or stream.moving or task.done()
                        or task.cancelling() or stream.ended
                        or now - relay.last_heard < self.stream_deadline):
                    continue
                stream.move = ("worker_silent", f"stopped answering ({w.reason}) for "
                               f"{now - w.down_since:.0f} s while streaming this response")
                _stop(task)

    async def _poll_one(self, w: Worker) -> None:
        assert self._client is not None
        blocks = self.index.get(w.url)
        params = {} if blocks is None else {"kv_epoch": blocks.epoch or "-", **(
            {"kv_since": str(blocks.next)} if blocks.next is not None else {})}
        sent = time.monotonic()
        try:
            async with self._client.stream("GET", w.url + "/internal/v1/load", params=params,
                                           timeout=min(2.0, self.request_timeout)) as r:
                if r.status_code != 200:
                    why = refusal(r.status_code, await _head(r, 4096))
                    if r.status_code in (401, 429) and w.reason != why:
                        log.warning("%s worker %s: %s", w.role, w.url, why)
                    w.down(f"/internal/v1/load: {why}")
                    return
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_LOAD_BYTES:
                        w.down(f"its /internal/v1/load reply passed "
                               f"{MAX_LOAD_BYTES >> 20} MiB")
                        return
            # (a report of everything a large pool holds is megabytes: read off the loop)
            load = (_read_load(bytes(body), blocks) if len(body) < 1 << 16
                    else await asyncio.to_thread(_read_load, bytes(body), blocks))
            if (load.instance is not None and load.instance != w.instance) or (
                    load.instance is None and not w.up):
                # restarted (or back, where it reports no process id): checked as at
                # start-up before anything is routed there (another checkpoint would
                # answer in another model's words)
                why = await self.recheck(w)
                if why is not None:
                    if w.reason != why:
                        log.warning("%s worker %s is not routed to: %s", w.role, w.url, why)
                    w.down(why)
                    return
            w.snapshot, w.open_groups, w.draining = load.snapshot, load.open_groups, load.draining
            if w.role == "decode":
                self._count(w.url, load.snapshot)
            if blocks is not None:
                blocks.capacity = _index_capacity(load.snapshot)
                if load.kv is not None:
                    blocks.apply(load.kv)
            if load.down is not None:
                w.down(load.down)
                return
            if not w.up:
                log.info("%s worker %s is up", w.role, w.url)
            w.up, w.reason, w.down_since = True, None, None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            w.down(why_failed(e), since=sent)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Blocking (off the loop): stop watching and close every relay."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def close() -> None:
            if self._poller is not None:
                self._poller.cancel()
            tasks = list(self._relays)
            for t in tasks:
                self._relays[t][1].ended = True
                _stop(t)
            await asyncio.gather(*tasks, *(p for p in [self._poller] if p),
                                 return_exceptions=True)
            # the relays' closes (and pending aborts) before the pool goes
            if self._background:
                await asyncio.wait(set(self._background), timeout=min(timeout / 2, 5.0))
            if self._client is not None:
                await self._client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout)
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.debug("router shutdown", exc_info=True)


class RouterCollector:
    """The router's view of its workers on ``/metrics``, read at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily("phasewise:router_worker_up", "1 if the worker answered its "
                               "last poll and its engine runs.", labels=["url", "role"])
        flight = GaugeMetricFamily("phasewise:router_worker_in_flight", "Requests this "
                                   "router streams from the worker now.",
                                   labels=["url", "role"])
        queue = GaugeMetricFamily("phasewise:router_worker_queue", "Requests running and "
                                  "waiting on the worker (its last poll).",
                                  labels=["url", "role"])
        routed = CounterMetricFamily("phasewise:router_requests_routed", "Requests sent to "
                                     "each decode worker, by routing policy.",
                                     labels=["url", "policy"])
        for (url, policy), n in self.router.routed.items():
            routed.add_metric([url, policy], n)
        blocks = CounterMetricFamily("phasewise:router_prompt_blocks", "Full prompt blocks "
                                     "routed, and of them those the chosen worker was "
                                     "expected to hold cached (the router's index).",
                                     labels=["kind"])
        blocks.add_metric(["routed"], self.router.routed_blocks[0])
        blocks.add_metric(["expected_hit"], self.router.routed_blocks[1])
        indexed = GaugeMetricFamily("phasewise:router_worker_indexed_blocks", "Prompt blocks "
                                    "the router's index says the worker holds.",
                                    labels=["url"])
        for url, wb in self.router.index.items():
            indexed.add_metric([url], len(wb.blocks))
        moved = CounterMetricFamily("phasewise:router_migrations", "Streams moved to another "
                                    "decode worker mid-response, by why their worker could "
                                    "not finish them: worker_lost (the connection broke or "
                                    "ended early), worker_stopped (its engine stopped), "
                                    "worker_silent (no poll answered for the stream "
                                    "deadline), drain (it began to shut down).",
                                    labels=["reason"])
        for reason, n in self.router.migrations.items():
            moved.add_metric([reason], n)
        failed = CounterMetricFamily("phasewise:router_migrations_failed", "Responses that "
                                     "needed a move and ended with an error instead (no "
                                     "worker could take them, or --max-migrations reached).")
        failed.add_metric([], self.router.migrations_failed)
        yield from (routed, blocks, indexed, moved, failed)
        for w in self.router.workers:
            up.add_metric([w.url, w.role], 1.0 if w.up else 0.0)
            flight.add_metric([w.url, w.role], w.in_flight)
            snap = w.snapshot
            queue.add_metric([w.url, w.role], 0 if snap is None
                             else snap.num_running + snap.num_waiting)
        yield from (up, flight, queue)
