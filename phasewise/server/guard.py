"""Pure-ASGI layers in front of the routes (so streaming and disconnects pass through
untouched): the access log, and the guard (API key, draining, body size, JSON body type).

Which routes ``--api-key`` protects: every route that takes input or runs the model —
``/v1/*``, ``/tokenize`` and ``/detokenize`` (tokenizing costs CPU time and reveals the
vocabulary). Left open, by choice: ``/health`` (load balancers and Kubernetes probes send no
key), ``/metrics`` (Prometheus scrapers; it holds counts and latencies, no request content),
``/version`` and ``/openapi.json`` (they describe the software, not the deployment).
``/dashboard`` is behind the key too; a browser, which cannot send the header, logs in at
``/dashboard/login`` and gets a session cookie (derived from the key, ``HttpOnly``,
``SameSite=Strict``) that is good for ``/dashboard*`` only.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from phasewise.server.errors import ApiError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json",
                        "/dashboard/login"})
DASHBOARD = "/dashboard"
DASHBOARD_COOKIE = "phasewise_dashboard"


def dashboard_token(api_key: str) -> str:
    """What the dashboard's cookie holds: derived from the key, never the key itself."""
    return hmac.new(api_key.encode(), b"phasewise dashboard session", "sha256").hexdigest()


def _cookies(headers: dict[str, str], name: str) -> list[str]:
    """Every value of cookie ``name`` (another app on the host may set one of the same
    name at a wider path: the browser then sends both)."""
    out = []
    for part in headers.get("cookie", "").split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            out.append(v)
    return out
# Logged only when they fail: probes, scrapes and a router's polls.
QUIET_PATHS = frozenset({"/health", "/metrics", "/internal/v1/load", "/internal/v1/info"})

access_log = logging.getLogger("phasewise.access")


@dataclass
class AccessRecord:
    """What a route tells the access log about its request (scope["state"]["access"])."""

    request_id: str = "-"
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None


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
        self.log.info("%s %s %s %s %d prompt=%s output=%s ttft=%s duration=%.1fms",
                      rec.request_id, who, scope.get("method", "-"), path, code,
                      n(rec.prompt_tokens), n(rec.output_tokens), ttft, duration * 1e3)


class Guard:
    """API key on the protected routes, refusal of POSTs while draining, JSON as the body
    type of every POST, and the body size limit."""

    def __init__(self, app: Any, *, api_key: str | None, max_request_bytes: int,
                 is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.is_draining = is_draining

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
        if key is not None and path not in OPEN_PATHS:
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            ok = hmac.compare_digest(given.encode(), key.encode())
            if not ok and dashboard:  # a browser's session, from /dashboard/login
                token = dashboard_token(key).encode()
                by_cookie = ok = any(hmac.compare_digest(v.encode(), token)
                                     for v in _cookies(headers, DASHBOARD_COOKIE)[:8])
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
