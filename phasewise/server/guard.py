"""Pure-ASGI layers in front of the routes (so streaming and disconnects pass through
untouched): the access log, and the guard (API key, draining, body size, JSON body type).

Which routes ``--api-key`` protects: every route that takes input or runs the model —
``/v1/*``, ``/tokenize`` and ``/detokenize`` (tokenizing costs CPU time and reveals the
vocabulary). Left open, by choice: ``/health`` and ``/health/engine`` (load balancers and
Kubernetes probes send no key), ``/metrics`` (Prometheus scrapers; it holds counts and
latencies, no request content), ``/version`` and ``/openapi.json`` (they describe the
software, not the deployment).
``/dashboard`` is behind the key too; a browser, which cannot send the header, logs in at
``/dashboard/login`` and gets a session cookie (``HttpOnly``, ``SameSite=Strict``, path
``/dashboard``) that is good for ``/dashboard*`` only, for ``SESSION_S``, or until
``POST /dashboard/logout`` (``Sessions``). The logout is open: all it can do is end the
session whose token it is sent, and clear the cookie.

Guessing the key (``FailureLimiter``): a wrong key, as an ``Authorization`` header on a
protected route (``Bearer`` or not) or posted to ``/dashboard/login``, counts against the
client's address; after ``max_failures`` (5) of them that address is answered 429 with
``Retry-After`` (1 s, doubling with each further wrong key, at most 5 min) without its key
being compared, until the wait is over; a right key starts its count over. A request that
carries no ``Authorization`` header guesses nothing: it is still 401, is not counted, and is
not held back. A session cookie that does not verify is not counted either: it is a 256-bit
MAC that guessing cannot find, and a stale one (expired, logged out, from before a restart)
is what an honest browser sends. The address is the TCP peer's (an IPv6 one by its /64):
behind a reverse proxy every client shares the proxy's, so one guesser there holds back all.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from phasewise.engine.relay import INTERNAL_HEADER
from phasewise.server.errors import ApiError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/health/engine", "/metrics", "/version", "/openapi.json",
                        "/dashboard/login", "/dashboard/logout"})
DASHBOARD = "/dashboard"
DASHBOARD_COOKIE = "phasewise_dashboard"
SESSION_S = 12 * 3600  # a dashboard login lasts this long
GUARD_STATE = "guard"  # scope["state"][GUARD_STATE]: the Guard, for the login and logout routes
SESSION_STATE = "dashboard_session"  # scope["state"][SESSION_STATE]: True when by cookie


def client_address(scope: Scope) -> str:
    """The address failures are counted against: the peer's IP, an IPv6 one by its /64 (one
    host commonly holds a whole /64, so counting single addresses would let it rotate)."""
    client = scope.get("client")
    host = client[0] if client else ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host or "-"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Failures:
    __slots__ = ("count", "locked_until", "forget_at")

    def __init__(self) -> None:
        self.count = 0
        self.locked_until = 0.0
        self.forget_at = 0.0


class FailureLimiter:
    """Wrong keys per address, and the wait they earn.

    An address's ``max_failures``-th wrong key in a row locks it for ``backoff_s``, each
    further one (tried once the wait is over) for twice the last, up to ``max_backoff_s``.
    Its count is forgotten on a right key, or ``window_s`` after its last wrong key or the
    end of its last lock, whichever is later. An address that keeps guessing so gets, with
    the defaults, about 14 guesses in its first 10 minutes and one per 5 minutes after; one
    that waits out the window each time, 5 per 10 minutes. At most ``max_addresses`` are
    remembered: past
    that the one whose last wrong key is oldest is forgotten first. Every call is O(1)
    amortized and never waits: the caller answers 429 at once, which is the backoff.
    """

    def __init__(self, *, max_failures: int = 5, window_s: float = 600.0,
                 backoff_s: float = 1.0, max_backoff_s: float = 300.0,
                 max_addresses: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {max_failures}")
        if max_addresses < 1:
            raise ValueError(f"max_addresses must be >= 1, got {max_addresses}")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s} and "
                             f"{max_backoff_s}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.max_failures = max_failures
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_addresses = max_addresses
        self.clock = clock
        # Ordered by the time of each address's last wrong key, oldest first.
        self._entries: OrderedDict[str, _Failures] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def wait_s(self, address: str) -> float:
        """Seconds ``address`` must still wait before its key is looked at (0: none)."""
        if not self._entries:  # the common case: nobody has guessed wrong lately
            return 0.0
        entry = self._entries.get(address)
        if entry is None:
            return 0.0
        return max(0.0, entry.locked_until - self.clock())

    def failed(self, address: str) -> float:
        """Count a wrong key from ``address``; returns the lock it now has (0: none)."""
        now = self.clock()
        entries = self._entries
        while entries:  # forget the oldest while they are due (bounded by the cap anyway)
            first = next(iter(entries.values()))
            if first.forget_at > now:
                break
            entries.popitem(last=False)
        entry = entries.pop(address, None)
        if entry is None or entry.forget_at <= now:
            entry = _Failures()
        entry.count += 1
        lock = 0.0
        if entry.count >= self.max_failures:
            doublings = min(entry.count - self.max_failures, 63)
            lock = min(self.max_backoff_s, self.backoff_s * 2.0 ** doublings)
            entry.locked_until = now + lock
        entry.forget_at = max(now, entry.locked_until) + self.window_s
        entries[address] = entry
        while len(entries) > self.max_addresses:
            entries.popitem(last=False)
        return lock

    def succeeded(self, address: str) -> None:
        """A right key from ``address``: its count starts over."""
        if self._entries:
            self._entries.pop(address, None)


def retry_after(wait_s: float) -> str:
    """A ``Retry-After`` value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))


class Sessions:
    """The dashboard's sessions: a token ``<issued>.<id>.<mac>`` (issue time in seconds of
    ``clock``, a random id, and an HMAC-SHA256 of both under a key drawn at random when the
    process starts). It is good from its issue until ``ttl_s`` later, unless revoked.

    The key is the process's own: a restart ends every session, and a token tells nothing
    of the API key. Revoked ids are kept until their tokens would have expired anyway, at
    most ``max_revoked`` of them; were more revoked within one ``ttl_s``, the key is drawn
    afresh instead, which ends every session (a revoked token is never let back in).
    """

    def __init__(self, *, ttl_s: float = SESSION_S, max_revoked: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_revoked < 1:
            raise ValueError(f"max_revoked must be >= 1, got {max_revoked}")
        self.ttl_s = ttl_s
        self.max_revoked = max_revoked
        self.clock = clock
        self._key = secrets.token_bytes(32)
        self._revoked: dict[str, float] = {}  # id -> when its token expires anyway

    @property
    def num_revoked(self) -> int:
        return len(self._revoked)

    def _mac(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), "sha256").hexdigest()

    def issue(self) -> str:
        body = f"{math.floor(self.clock())}.{secrets.token_hex(16)}"
        return f"{body}.{self._mac(body)}"

    def _check(self, token: str) -> tuple[str, float] | None:
        """(id, expiry) of a token that is good now, else None."""
        if len(token) > 256:
            return None
        body, _, mac = token.rpartition(".")
        if not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return None
        issued, _, sid = body.partition(".")
        # The MAC holds: this process wrote the token, so the issue time is an integer.
        expires = int(issued) + self.ttl_s
        if not int(issued) <= self.clock() < expires or sid in self._revoked:
            return None
        return sid, expires

    def valid(self, token: str) -> bool:
        return self._check(token) is not None

    def revoke(self, token: str) -> bool:
        """End the session of ``token``; False when it was not a good one."""
        found = self._check(token)
        if found is None:
            return False
        sid, expires = found
        if len(self._revoked) >= self.max_revoked:
            now = self.clock()
            self._revoked = {k: t for k, t in self._revoked.items() if t > now}
            if len(self._revoked) >= self.max_revoked:
                self._key = secrets.token_bytes(32)  # every token fails its MAC from now
                self._revoked.clear()
                return True
        self._revoked[sid] = expires
        return True


def cookies_named(headers: dict[str, str], name: str) -> list[str]:
    """Every value of cookie ``name`` (another app on the host may set one of the same
    name at a wider path: the browser then sends both)."""
    out = []
    for part in headers.get("cookie", "").split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            out.append(v)
    return out


# Logged only when they fail: probes, scrapes and a router's polls.
# The routes a router and its workers use between themselves (phasewise.server.internal);
# where the fleet has an internal key, relay.INTERNAL_HEADER carries it to them.
INTERNAL_PREFIX = "/internal/"
QUIET_PATHS = frozenset({"/health", "/health/engine", "/metrics", "/internal/v1/load",
                         "/internal/v1/info"})

access_log = logging.getLogger("phasewise.access")


@dataclass
class AccessRecord:
    """What a route tells the access log about its request (scope["state"]["access"])."""

    request_id: str = "-"
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    # a router's choice of worker, and why (read when the line is written: a migration
    # adds to it while the response streams)
    route: Callable[[], str | None] | None = None


def access_record(scope: Scope) -> AccessRecord:
    """The request's record (a fresh one when the access log is off)."""
    state = scope.setdefault("state", {})
    rec = state.get("access")
    if rec is None:
        rec = state["access"] = AccessRecord()
    return rec


class AccessLog:
    """One line per request once its response has ended (for a stream: after its last
    event): request id, route, status, prompt and output tokens, TTFT and duration."""

    def __init__(self, app: Any, logger: logging.Logger = access_log,
                 enabled: bool = True) -> None:
        self.app = app
        self.log = logger
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        rec = access_record(scope)
        status = [0]

        async def send_and_see(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            path = scope.get("path", "")
            code = status[0] or 499  # no response started: the client left first
            if self.enabled and (path not in QUIET_PATHS or code != 200):
                self._line(scope, path, code, rec, time.monotonic() - start)

    def _line(self, scope: Scope, path: str, code: int, rec: AccessRecord,
              duration: float) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"

        def n(x: int | None) -> str:
            return "-" if x is None else str(x)

        ttft = "-" if rec.ttft_s is None else f"{rec.ttft_s * 1e3:.1f}ms"
        route = rec.route() if rec.route is not None else None
        self.log.info("%s %s %s %s %d prompt=%s output=%s ttft=%s duration=%.1fms%s",
                      rec.request_id, who, scope.get("method", "-"), path, code,
                      n(rec.prompt_tokens), n(rec.output_tokens), ttft, duration * 1e3,
                      "" if route is None else f" worker={route}")


class Guard:
    """API key on the protected routes (with the limit on wrong ones and the dashboard's
    sessions), refusal of POSTs while draining, JSON as the body type of every POST, and
    the body size limit.

    ``limiter`` and ``sessions`` default to ``FailureLimiter()`` and ``Sessions()``; the
    dashboard's login and logout routes reach them through ``scope["state"]["guard"]``."""

    def __init__(self, app: Any, *, api_key: str | None, max_request_bytes: int,
                 is_draining: Callable[[], bool], limiter: FailureLimiter | None = None,
                 sessions: Sessions | None = None, internal_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.internal_key = internal_key
        self.max_request_bytes = max_request_bytes
        self.is_draining = is_draining
        self.limiter = limiter if limiter is not None else FailureLimiter()
        self.sessions = sessions if sessions is not None else Sessions()

    async def _refuse(self, send: Send, err: ApiError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        key = self.api_key
        dashboard = path == DASHBOARD or path.startswith(DASHBOARD + "/")
        by_cookie = False
        if dashboard:
            scope.setdefault("state", {})[GUARD_STATE] = self
        fleet = False  # the request carries the fleet's internal key
        if self.internal_key is not None:
            given = [v for k, v in scope.get("headers", [])
                     if k.lower() == INTERNAL_HEADER.encode()]
            fleet = len(given) == 1 and hmac.compare_digest(given[0],
                                                             self.internal_key.encode())
        if self.internal_key is not None and path.startswith(INTERNAL_PREFIX):
            # A fleet's own routes take its internal key, not the clients' API key: a long
            # random secret no guessing reaches, so no address is ever locked out of them
            # (else a client sharing the router's address could, with wrong API keys to a
            # worker, lock the router out of every worker), and a client's key is no way in.
            if not fleet:
                await self._refuse(send, ApiError(
                    401, f"{INTERNAL_PREFIX}* routes need this fleet's internal key in one "
                    f"'{INTERNAL_HEADER}' header (--internal-key-file)",
                    code="invalid_internal_key"))
                return
        elif key is not None and path not in OPEN_PATHS and not (
                fleet and dashboard and scope.get("method") in ("GET", "HEAD")):
            # (the router relays its workers' dashboards and traces with the fleet's key;
            # to read them only: the playground's completions need the API key)
            auth = headers.get("authorization")
            if sum(k.lower() == b"authorization" for k, _ in scope.get("headers", [])) > 1:
                # which one counts would be this server's guess (a proxy in front may read
                # the other): refused, as no client sends two
                await self._refuse(send, ApiError(
                    400, "the request has more than one Authorization header; send one",
                    code="invalid_api_key"))
                return
            ok = False
            if auth is not None:  # a key is presented: a guess until it proves right
                address = client_address(scope)
                wait = self.limiter.wait_s(address)
                if wait > 0:  # not compared: while it waits, an address learns nothing
                    await self._refuse(send, ApiError(
                        429, f"too many wrong API keys from {address}: retry in "
                        f"{retry_after(wait)} s", code="too_many_wrong_keys",
                        headers={"Retry-After": retry_after(wait)}))
                    return
                given = auth[7:] if auth.lower().startswith("bearer ") else ""
                ok = hmac.compare_digest(given.encode(), key.encode())
                if ok:
                    self.limiter.succeeded(address)
                else:
                    self.limiter.failed(address)
            if not ok and dashboard:  # a browser's session, from /dashboard/login
                by_cookie = ok = any(self.sessions.valid(v)
                                     for v in cookies_named(headers, DASHBOARD_COOKIE)[:8])
                if by_cookie:
                    scope["state"][SESSION_STATE] = True
            if not ok:
                if dashboard and scope.get("method") in ("GET", "HEAD") and \
                        path in (DASHBOARD, DASHBOARD + "/"):
                    await send({"type": "http.response.start", "status": 303,
                                "headers": [(b"location", b"/dashboard/login"),
                                            (b"content-length", b"0")]})
                    await send({"type": "http.response.body", "body": b""})
                    return
                await self._refuse(send, ApiError(
                    401, "missing or invalid API key: send 'Authorization: Bearer <key>'"
                    + (" (or log in at /dashboard/login)" if dashboard else ""),
                    code="invalid_api_key"))
                return
        if by_cookie and scope.get("method") == "POST" and \
                headers.get("content-type", "").split(";")[0].strip().lower() != \
                "application/json":
            # A session cookie rides along on any same-site form post; a JSON body needs a
            # script of this origin (a cross-site one would need CORS, which is not served).
            await self._refuse(send, ApiError(
                415, "a dashboard session's POST must be application/json",
                code="unsupported_media_type"))
            return
        if self.is_draining() and scope.get("method") == "POST":
            await self._refuse(send, ApiError(
                503, "the server is shutting down and takes no new requests",
                type="server_error", code="shutting_down"))
            return
        if scope.get("method") == "POST" and path != DASHBOARD + "/login" and \
                headers.get("content-type", "").split(";")[0] in (
                "", "application/x-www-form-urlencoded", "text/plain"):
            # Every POST body of this API is JSON; take curl's default form type (and none at
            # all) as JSON rather than refusing a well-formed body over a header.
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", [])
                                if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        limit = self.max_request_bytes
        too_large = ApiError(413, f"request body exceeds the limit of {limit} bytes",
                             code="request_too_large")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                await self._refuse(send, too_large)
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read the body here, up to the limit, then replay it.
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > limit:
                await self._refuse(send, too_large)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
