"""Guessing the API key, and the dashboard's session: wrong keys (bearer or the login form)
from one address earn it a growing wait (429 with Retry-After) while other addresses and
right keys get through; the table of addresses is bounded; a session cookie is signed,
expires, and ends on logout. In process, on the ASGI app, with an injected clock."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import httpx
import pytest
from fastapi import FastAPI

from phasewise.server.dashboard import add_dashboard_routes
from phasewise.server.dashboard.feed import DashboardFeed
from phasewise.server.dashboard.hub import Hub
from phasewise.server.guard import (DASHBOARD_COOKIE, SESSION_S, FailureLimiter, Guard,
                                    Sessions)

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}
BAD = {"Authorization": "Bearer nope"}
FORM = {"content-type": "application/x-www-form-urlencoded"}


class Clock:
    def __init__(self) -> None:
        self.t = 5000.0

    def __call__(self) -> float:
        return self.t


def guarded(clock: Clock, **kw) -> Guard:
    """A guarded app with the dashboard's routes and one protected API route (no model)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    add_dashboard_routes(app, Hub(DashboardFeed(model_name="m")), None, api_key=KEY)
    return Guard(app, api_key=KEY, max_request_bytes=1 << 20, is_draining=lambda: False,
                 limiter=kw.get("limiter", FailureLimiter(clock=clock)),
                 sessions=kw.get("sessions", Sessions(clock=clock)))


def client(app, host: str = "10.0.0.1") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(host, 40000)),
                             base_url="http://testserver", follow_redirects=False)


async def login(c: httpx.AsyncClient, key: str = KEY) -> httpx.Response:
    return await c.post("/dashboard/login", content=f"key={key}", headers=FORM)


def cookie_of(r: httpx.Response) -> str:
    assert r.status_code == 303, r.text
    return r.cookies[DASHBOARD_COOKIE]


def with_cookie(token: str) -> dict[str, str]:
    return {"cookie": f"{DASHBOARD_COOKIE}={token}"}


def test_wrong_keys_from_one_address_wait_longer_each_time_others_get_through():
    clock = Clock()
    app = guarded(clock)

    async def main():
        async with client(app, "10.0.0.1") as a, client(app, "10.0.0.2") as b:
            for _ in range(5):
                assert (await a.get("/v1/models", headers=BAD)).status_code == 401
            waits = []
            for _ in range(14):
                r = await a.get("/v1/models", headers=BAD)
                assert r.status_code == 429 and r.json()["error"]["code"] == \
                    "too_many_wrong_keys", r.text
                waits.append(int(r.headers["retry-after"]))
                # while it waits, nothing from it is compared: the right key waits too,
                # and further wrong ones neither count nor lengthen the wait
                for headers in (GOOD, BAD, BAD):
                    again = await a.get("/v1/models", headers=headers)
                    assert again.status_code == 429
                    assert again.headers["retry-after"] == r.headers["retry-after"]
                # no key at all guesses nothing: still a plain 401 (or the login page)
                assert (await a.get("/v1/models")).status_code == 401
                assert (await a.get("/dashboard")).status_code == 303
                # another address, and the right key there, are not held back
                assert (await b.get("/v1/models", headers=GOOD)).status_code == 200
                clock.t += waits[-1]  # the wait is over: one more wrong key, a longer wait
                assert (await a.get("/v1/models", headers=BAD)).status_code == 401
            assert waits[:9] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
            assert waits[9:] == [300] * 5  # capped
            clock.t += 300
            # a right key starts the count over: five more wrong ones before a wait
            assert (await a.get("/v1/models", headers=GOOD)).status_code == 200
            for _ in range(5):
                assert (await a.get("/v1/models", headers=BAD)).status_code == 401
            r = await a.get("/v1/models", headers=BAD)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            # b's one wrong key is its own
            assert (await b.get("/v1/models", headers=BAD)).status_code == 401
            assert (await b.get("/v1/models", headers=GOOD)).status_code == 200

    asyncio.run(main())


def test_a_fleets_internal_key_is_never_locked_out_and_the_api_key_is_no_way_in():
    """A client sharing the router's address sent wrong API keys to a worker: the worker
    locked that address out, answered the router's polls and relays 429, and every request
    through the router failed. With an internal key the /internal/* routes take only it,
    and no wrong key of either kind locks them."""
    from phasewise.engine.relay import INTERNAL_HEADER

    clock = Clock()
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    @app.get("/internal/v1/load")
    async def load() -> dict:
        return {"alive": True}

    add_dashboard_routes(app, Hub(DashboardFeed(model_name="m")), None, api_key=KEY)
    internal = "i" * 64
    guard = Guard(app, api_key=KEY, max_request_bytes=1 << 20, is_draining=lambda: False,
                  limiter=FailureLimiter(clock=clock), internal_key=internal)
    fleet = {INTERNAL_HEADER: internal}

    async def main():
        async with client(guard, "127.0.0.1") as c:
            for _ in range(8):  # the address is locked for /v1
                await c.get("/v1/models", headers=BAD)
            assert (await c.get("/v1/models", headers=GOOD)).status_code == 429
            assert (await c.get("/internal/v1/load", headers=fleet)).status_code == 200
            # the clients' key opens no internal route, nor does a wrong internal key, and
            # neither counts as a guess of the API key
            for headers in (GOOD, {INTERNAL_HEADER: "x" * 64}, {}):
                r = await c.get("/internal/v1/load", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == \
                    "invalid_internal_key"
            assert (await c.get("/internal/v1/load", headers=fleet)).status_code == 200
            # the router relays its workers' dashboards with the fleet's key too
            assert (await c.get("/dashboard/api/status", headers=fleet)).status_code == 200
            assert (await c.get("/dashboard/api/status", headers=GOOD)).status_code == 429
            assert (await c.get("/v1/models", headers=fleet)).status_code == 401  # not /v1
            r = await c.post("/dashboard/api/completions", json={"prompt": "x"},
                             headers=fleet)
            assert r.status_code == 401  # to read only: the playground needs the API key
            r = await c.get("/internal/v1/load", headers=[(INTERNAL_HEADER, internal)] * 2)
            assert r.status_code == 401  # two of them: which counts would be a guess
        async with client(guard, "10.0.0.7") as other:
            assert (await other.get("/v1/models", headers=GOOD)).status_code == 200

    asyncio.run(main())


def test_an_internal_key_file_is_long_printable_and_named_in_its_errors(tmp_path):
    from phasewise.launch.serve import read_internal_key

    assert read_internal_key(None) is None
    good = tmp_path / "k"
    good.write_text("ab" * 32 + "\n")
    assert read_internal_key(str(good)) == "ab" * 32
    good.write_text("short")
    with pytest.raises(ValueError, match="--internal-key-file .* holds 5 characters; the key "
                                         "needs at least 32"):
        read_internal_key(str(good))
    for bad in ("a b" * 20, "é" * 40):
        good.write_text(bad)
        with pytest.raises(ValueError, match="no printable ASCII or is a space"):
            read_internal_key(str(good))
    with pytest.raises(ValueError, match="--internal-key-file .*missing"):
        read_internal_key(str(tmp_path / "missing"))


def test_wrong_login_posts_count_with_wrong_bearer_keys():
    clock = Clock()
    app = guarded(clock)

    async def main():
        async with client(app, "10.0.0.1") as a, client(app, "10.0.0.2") as b:
            for _ in range(3):
                assert (await login(a, "guess")).status_code == 401
            for _ in range(2):  # one count per address, whichever way the key came
                assert (await a.get("/v1/models", headers=BAD)).status_code == 401
            r = await login(a, KEY)  # the right key, but the address must wait first
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "try again" in r.text and DASHBOARD_COOKIE not in r.cookies
            assert (await a.get("/v1/models", headers=GOOD)).status_code == 429
            assert (await a.get("/dashboard/login")).status_code == 200  # the form itself
            assert cookie_of(await login(b, KEY))  # another address logs in
            clock.t += 1
            assert (await login(a, "guess")).status_code == 401
            r = await login(a, "guess")
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            clock.t += 2
            token = cookie_of(await login(a, KEY))
            assert (await a.get("/dashboard/api/status", headers=with_cookie(token))
                    ).status_code == 200

    asyncio.run(main())


def test_the_table_of_failing_addresses_is_bounded_and_forgets():
    clock = Clock()
    limiter = FailureLimiter(max_addresses=50, window_s=600, clock=clock)
    app = guarded(clock, limiter=limiter)

    async def main():
        for i in range(200):
            async with client(app, f"10.1.{i // 250}.{i % 250}") as c:
                assert (await c.get("/v1/models", headers=BAD)).status_code == 401
            assert len(limiter) <= 50
        assert len(limiter) == 50
        clock.t += 601  # a quiet window later every count is forgotten
        async with client(app, "10.9.9.9") as c:
            assert (await c.get("/v1/models", headers=BAD)).status_code == 401
        assert len(limiter) == 1
        # one IPv6 host holds a /64: its addresses share one count
        for i in range(5):
            async with client(app, f"2001:db8:1:2::{i + 1:x}") as c:
                assert (await c.get("/v1/models", headers=BAD)).status_code == 401
        async with client(app, "2001:db8:1:2::ffff") as c:
            assert (await c.get("/v1/models", headers=BAD)).status_code == 429
        async with client(app, "2001:db8:1:3::1") as c:  # the next /64 is someone else
            assert (await c.get("/v1/models", headers=GOOD)).status_code == 200

    asyncio.run(main())


def test_a_session_lasts_its_time_and_no_longer():
    clock = Clock()
    app = guarded(clock)

    async def main():
        async with client(app) as c:
            r = await login(c)
            set_cookie = r.headers["set-cookie"]
            assert f"Max-Age={SESSION_S}" in set_cookie and "HttpOnly" in set_cookie
            assert "samesite=strict" in set_cookie.lower() and "Path=/dashboard" in set_cookie
            token = cookie_of(r)
            assert KEY not in token
            r = await c.get("/dashboard/api/status", headers=with_cookie(token))
            assert r.status_code == 200 and r.json()["session"] is True
            assert (await c.get("/dashboard/api/status", headers=GOOD)).json()["session"] \
                is False  # a bearer key is no session: the page offers no logout
            clock.t += SESSION_S - 1
            assert (await c.get("/dashboard", headers=with_cookie(token))).status_code == 200
            clock.t += 1
            r = await c.get("/dashboard", headers=with_cookie(token))
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
            assert (await c.get("/dashboard/api/status", headers=with_cookie(token))
                    ).status_code == 401
            # refused cookies are no guesses: the address may still log in at once
            for _ in range(20):
                await c.get("/dashboard/api/status", headers=with_cookie(token))
            assert cookie_of(await login(c)) != token

    asyncio.run(main())


def test_logout_ends_the_session_on_the_server_and_clears_the_cookie():
    clock = Clock()
    sessions = Sessions(clock=clock, max_revoked=3)
    app = guarded(clock, sessions=sessions)

    async def main():
        async with client(app) as c:
            mine, other = cookie_of(await login(c)), cookie_of(await login(c))
            r = await c.post("/dashboard/logout", headers=with_cookie(mine))  # the page's form
            assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
            cleared = r.headers["set-cookie"]
            assert cleared.startswith(f'{DASHBOARD_COOKIE}=""') or \
                cleared.startswith(f"{DASHBOARD_COOKIE}=;")
            assert "Max-Age=0" in cleared and "Path=/dashboard" in cleared
            assert (await c.get("/dashboard/api/status", headers=with_cookie(mine))
                    ).status_code == 401
            assert (await c.get("/dashboard", headers=with_cookie(mine))).status_code == 303
            # only that session ended
            assert (await c.get("/dashboard/api/status", headers=with_cookie(other))
                    ).status_code == 200
            r = await c.post("/dashboard/logout", headers={
                **with_cookie(other), "accept": "application/json"})
            assert r.status_code == 200 and r.json() == {"logged_out": True}
            assert (await c.get("/dashboard/api/status", headers=with_cookie(other))
                    ).status_code == 401
            # a logout without a session (or with a stale one) clears the cookie all the same
            assert (await c.post("/dashboard/logout")).status_code == 303
            # the revoked ids are bounded: past max_revoked every session ends (none of
            # them comes back)
            tokens = [cookie_of(await login(c)) for _ in range(3)]
            assert sessions.num_revoked == 2
            for t in tokens[:2]:
                await c.post("/dashboard/logout", headers=with_cookie(t))
            assert sessions.num_revoked <= 3
            for t in [mine, other, *tokens]:
                assert (await c.get("/dashboard/api/status", headers=with_cookie(t))
                        ).status_code == 401
            fresh = cookie_of(await login(c))
            assert (await c.get("/dashboard/api/status", headers=with_cookie(fresh))
                    ).status_code == 200
            # revoked ids are dropped once their tokens have expired anyway
            clock.t += SESSION_S
            for _ in range(5):
                t = cookie_of(await login(c))
                await c.post("/dashboard/logout", headers=with_cookie(t))
                assert sessions.num_revoked <= 3

    asyncio.run(main())


def test_forged_session_cookies_are_refused():
    clock = Clock()
    app = guarded(clock)

    async def main():
        async with client(app) as c:
            token = cookie_of(await login(c))
            issued, sid, mac = token.split(".")
            elsewhere = Sessions(clock=clock).issue()  # another process's (its own secret)
            forged = [
                # a fixed MAC of the key: good forever, for anyone who ever held the key
                hmac.new(KEY.encode(), b"phasewise dashboard session", "sha256").hexdigest(),
                f"{int(issued) + SESSION_S}.{sid}.{mac}",  # a later issue time, same MAC
                f"{issued}.{'0' * 32}.{mac}",  # another id, same MAC
                f"{issued}.{sid}.{mac[:-1]}{'0' if mac[-1] != '0' else '1'}",
                f"{issued}.{sid}.{hashlib.sha256(f'{issued}.{sid}'.encode()).hexdigest()}",
                elsewhere, "", ".", "..", "x" * 5000, KEY,
            ]
            for f in forged:
                r = await c.get("/dashboard/api/status", headers=with_cookie(f))
                assert r.status_code == 401, f
                r = await c.get("/dashboard", headers=with_cookie(f))
                assert r.status_code == 303, f
            r = await c.get("/dashboard/api/status", headers=with_cookie(token))
            assert r.status_code == 200

    asyncio.run(main())


# -- the server as served: the defaults, behind the access log -----------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import build_hf_checkpoint

    path = tmp_path_factory.mktemp("auth") / "m"
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=5, max_position_embeddings=128)
    return path


def test_the_servers_defaults_limit_guesses_and_sign_sessions(model_dir):
    from phasewise.engine.async_engine import AsyncEngine
    from phasewise.config import EngineConfig
    from phasewise.server.app import OpenAIServer, ServerConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(model_dir)))
    server = OpenAIServer(engine, ServerConfig(served_model_name="m", api_key=KEY),
                          dashboard=Hub(DashboardFeed(model_name="m")))

    async def main():
        async with client(server.app, "10.0.0.1") as a, client(server.app, "10.0.0.2") as b:
            for _ in range(5):
                assert (await a.post("/tokenize", json={"prompt": "x"}, headers=BAD)
                        ).status_code == 401
            r = await a.post("/tokenize", json={"prompt": "x"}, headers=BAD)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert (await login(a)).status_code == 429
            assert (await b.get("/v1/models", headers=GOOD)).status_code == 200
            token = cookie_of(await login(b))
            r = await b.get("/dashboard/api/status", headers=with_cookie(token))
            assert r.status_code == 200 and r.json()["session"] is True
            await b.post("/dashboard/logout", headers=with_cookie(token))
            assert (await b.get("/dashboard/api/status", headers=with_cookie(token))
                    ).status_code == 401

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_workers_refusal_of_the_router_says_which_key_to_give():
    """A router with the wrong internal key was told to give 'the workers' --api-key and
    --internal-key-file', and at run time only '/internal/v1/load answered 401'."""
    import json

    from phasewise.disagg.fleet import refusal

    def body(code):
        return json.dumps({"error": {"code": code, "message": "x"}}).encode()

    assert "same --internal-key-file" in refusal(401, body("invalid_internal_key"))
    assert "the workers' --api-key" in refusal(401, body("invalid_api_key"))
    assert "an --internal-key-file, which no lockout holds" in \
        refusal(429, body("too_many_wrong_keys"))
    assert refusal(503, b"<html>") == "it answered 503"
