"""``/dashboard``: the two phases, live in a browser (served by ``phasewise serve`` and by the
router).

* ``GET /dashboard``: the page (HTML, its script and the vendored uPlot, no build step and
  nothing from a CDN: ``static/``);
* ``GET /dashboard/events``: server-sent events: a ``hello`` (model, role, this machine's
  peaks, histogram edges, recent history), then a frame every 0.2 s (``feed``, ``hub``);
  behind a router also ``worker`` events, each worker's own frames;
* ``GET /dashboard/api/requests/{id}``: one playground request's trace (the steps it rode
  on, each output's time and text); other clients' requests have none (``feed``);
* ``POST /dashboard/api/completions``: the playground's completions (``/v1/completions``'s
  handler, reachable with the dashboard's session; ids ``cmpl-playground-...``);
* ``GET /dashboard/api/status``: whether the server is draining, how many pages watch (of
  how many allowed) and, behind a router, each worker's relay;
* ``GET|POST /dashboard/login``: with ``--api-key``, a browser logs in with the key and gets
  a session cookie good for ``/dashboard*`` only, for ``guard.SESSION_S`` (12 h;
  ``guard.Sessions``); a wrong key counts against the address like a wrong bearer key
  (``guard.FailureLimiter``);
* ``POST /dashboard/logout``: ends the cookie's session on the server and clears the cookie
  (a form post is sent on to the login page, a request that accepts JSON gets JSON).
"""

from __future__ import annotations

import asyncio
import hmac
import mimetypes
import urllib.parse
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from phasewise.server.dashboard.feed import PLAYGROUND_PREFIX, DashboardFeed, peaks_of
from phasewise.server.dashboard.hub import Hub
from phasewise.server.errors import ApiError
from phasewise.server.guard import (DASHBOARD_COOKIE, GUARD_STATE, SESSION_STATE, Guard,
                                    client_address, cookies_named, retry_after)
from phasewise.server.sse import SSEResponse

__all__ = ["DashboardFeed", "Hub", "add_dashboard_routes", "peaks_of"]

_STATIC = resources.files("phasewise.server.dashboard") / "static"
_MAX_STATIC = 1 << 20
_LOGIN = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>phasewise dashboard: log in</title><style>
body{{font:15px system-ui,sans-serif;background:#10141a;color:#dde3ea;display:flex;
justify-content:center;margin-top:12vh}}form{{background:#1a212b;padding:24px 28px;
border-radius:8px;min-width:320px}}input{{width:100%;padding:8px;margin:10px 0;
box-sizing:border-box;background:#0c1015;color:#dde3ea;border:1px solid #39424f}}
button{{padding:8px 16px}}.err{{color:#ff7b72}}</style></head><body>
<form method="post" action="/dashboard/login"><h2>phasewise dashboard</h2>
<p>This server runs with <code>--api-key</code>: enter it to watch the dashboard.</p>
{error}<input type="password" name="key" autofocus placeholder="API key" id="key">
<button type="submit" id="login">Log in</button></form></body></html>"""


def _login_page(status: int, error: str = "", headers: dict[str, str] | None = None) -> Response:
    body = f'<p class="err" id="error">{error}</p>' if error else ""
    return HTMLResponse(_LOGIN.format(error=body), status_code=status, headers=headers)


def _guard(request: Request) -> Guard:
    """The Guard in front of this app (it puts itself in the scope of /dashboard*): it holds
    the failure counts and the sessions."""
    guard = request.scope.get("state", {}).get(GUARD_STATE)
    if guard is None:
        raise ApiError(500, "the dashboard's login needs the guard in front of the app",
                       type="server_error")
    return guard


def _static(name: str) -> Response:
    """A file of ``static/`` (only plain names under it: no traversal)."""
    parts = name.split("/")
    missing = ApiError(404, f"no such dashboard file: {name[:100]}")
    if not name or len(name) > 200 or any(p in ("", ".", "..") or p.startswith(".")
                                          for p in parts):
        raise missing
    node = _STATIC
    for p in parts:
        node = node / p
    try:
        if not node.is_file():
            raise missing
        data = node.read_bytes()[:_MAX_STATIC]
    except OSError:  # a name the file system refuses (too long, say): not ours either
        raise missing from None
    kind = mimetypes.guess_type(parts[-1])[0] or "application/octet-stream"
    if kind.startswith("text/") or kind == "application/javascript":
        kind += "; charset=utf-8"
    return Response(data, media_type=kind, headers={"Cache-Control": "no-cache"})


def add_dashboard_routes(app: FastAPI, hub: Hub, routes: Any, *, api_key: str | None,
                         trace_lookup: Any = None) -> None:
    """The dashboard's routes on ``app``. ``trace_lookup(id)`` (async, optional) finds a
    request's trace where the feed has none (the router asks its workers)."""

    @app.api_route("/dashboard", methods=["GET", "HEAD"], include_in_schema=False)
    async def page() -> Response:
        return _static("index.html")

    @app.get("/dashboard/", include_in_schema=False)
    async def page_slash() -> Response:
        return RedirectResponse("/dashboard", status_code=307)

    @app.api_route("/dashboard/static/{name:path}", methods=["GET", "HEAD"],
                   include_in_schema=False)
    async def static(name: str) -> Response:
        return _static(name)

    @app.get("/dashboard/login", include_in_schema=False)
    async def login_form() -> Response:
        if api_key is None:
            return RedirectResponse("/dashboard", status_code=303)
        return HTMLResponse(_LOGIN.format(error=""))

    @app.post("/dashboard/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        if api_key is None:
            return RedirectResponse("/dashboard", status_code=303)
        guard = _guard(request)
        address = client_address(request.scope)
        raw = await request.body()
        # Looked up after the body's await, with none between it and the comparison below:
        # posts sent together cannot all pass the check before the first failure counts.
        wait = guard.limiter.wait_s(address)
        if wait > 0:  # not compared: while it waits, an address learns nothing
            return _login_page(429, "Too many wrong keys from this address: try again in "
                               f"{retry_after(wait)} s.",
                               headers={"Retry-After": retry_after(wait)})
        if len(raw) > 4096:
            return _login_page(400, "That form is larger than 4 KiB: send only the key.")
        given = urllib.parse.parse_qs(raw.decode("utf-8", "replace")).get("key", [""])[0]
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            guard.limiter.failed(address)
            return _login_page(401, "That is not this server's API key.")
        guard.limiter.succeeded(address)
        resp = RedirectResponse("/dashboard", status_code=303)
        resp.set_cookie(DASHBOARD_COOKIE, guard.sessions.issue(), path="/dashboard",
                        httponly=True, samesite="strict", max_age=int(guard.sessions.ttl_s))
        return resp

    @app.post("/dashboard/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        """Open to all (the guard lets it through): it only ends the session whose token it
        is sent, which needs the token; a stale or forged cookie is cleared all the same."""
        if api_key is not None:
            sessions = _guard(request).sessions
            for token in cookies_named({"cookie": request.headers.get("cookie", "")},
                                       DASHBOARD_COOKIE)[:8]:
                sessions.revoke(token)
        if "application/json" in request.headers.get("accept", ""):
            resp: Response = JSONResponse({"logged_out": True})
        else:
            resp = RedirectResponse("/dashboard/login", status_code=303)
        resp.delete_cookie(DASHBOARD_COOKIE, path="/dashboard", httponly=True,
                           samesite="strict")
        return resp

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> Response:
        if hub.closed:
            raise ApiError(503, "the server is shutting down", type="server_error",
                           code="shutting_down")
        # (an IPv6 host by its /64, as failures are counted: it commonly holds all of it)
        client = client_address(request.scope)
        if hub.full or hub.pages_of(client) >= hub.max_pages_per_client:
            many = (f"{hub.max_pages} dashboard pages are open already" if hub.full else
                    f"{hub.max_pages_per_client} dashboard pages are open from {client}")
            raise ApiError(503, f"{many}; close one and retry", type="server_error",
                           code="too_many_pages", headers={"Retry-After": "5"})
        page, first = hub.join(client)
        return PageStream(hub.stream(page, first), lambda: hub.leave(page))

    @app.get("/dashboard/api/requests/{request_id}", include_in_schema=False)
    async def trace(request_id: str) -> Response:
        if len(request_id) > 200:
            raise ApiError(400, "request id longer than 200 characters", param="request_id")
        found = hub.feed.trace(request_id)
        if trace_lookup is not None:
            found = await trace_lookup(request_id, found)
        if found is None:
            raise ApiError(404, f"no trace of request {request_id!r}: traces are kept for "
                           "the playground's requests (ids cmpl-playground-...) from their "
                           "first step until 256 more have finished", code="not_found")
        return JSONResponse(found)

    @app.post("/dashboard/api/completions", include_in_schema=False, response_model=None)
    async def completions(request: Request) -> Response:
        return await routes.completions(await routes.body("CompletionRequest", request),
                                        request, id_prefix=PLAYGROUND_PREFIX)

    @app.get("/dashboard/api/status", include_in_schema=False)
    async def status(request: Request) -> dict[str, Any]:
        """What a page asks when its stream was refused or broke: is it the key, a full
        house, or the server going away? ``session``: the page holds a login (so it offers
        a logout)."""
        return {**hub.status(),
                "session": bool(request.scope.get("state", {}).get(SESSION_STATE))}


class PageStream(SSEResponse):
    """A page's event stream, ended when a write has waited ``send_timeout`` seconds: a
    client that stops reading (or a half-open connection) gives its slot back."""

    send_timeout = 10.0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def timed(message: dict[str, Any]) -> None:
            await asyncio.wait_for(send(message), self.send_timeout)

        await super().__call__(scope, receive, timed)


mimetypes.add_type("application/javascript", ".js")
mimetypes.add_type("text/css", ".css")
