"""``phasewise router`` gives back its connection to the worker however a relay ends: a real
worker and router on 127.0.0.1, many requests of each kind (finished, streamed or not; the
client gone mid-stream or mid-wait; refused by the worker; n > 1), then the router's
sockets to the worker are counted from /proc: none half-closed (CLOSE-WAIT), a few kept
alive whatever the number of requests, and /health still 200."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections import Counter

import httpx
import pytest

from conftest import build_hf_checkpoint
from serving import start_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads the router's sockets from /proc")

ROUNDS = 10  # requests of each kind
# The poller's connection and the few a burst leaves idle in the pool (none of them for
# long): a bound that does not grow with the number of requests.
MOST_OPEN = 4
# /proc/net/tcp's state codes
STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
          "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK",
          "0A": "LISTEN", "0B": "CLOSING"}


def sockets_to(pid: int, port: int) -> Counter:
    """The states of process ``pid``'s TCP sockets whose remote port is ``port``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    states: Counter = Counter()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for row in f:
                cols = row.split()
                if int(cols[2].rsplit(":", 1)[1], 16) == port and cols[9] in inodes:
                    states[STATES.get(cols[3], cols[3])] += 1
    return states


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One worker (--role both) and a router in front of it. The worker takes bodies of at
    most 2 KiB, so a long prompt the router accepts is one the worker refuses (413)."""
    tmp = tmp_path_factory.mktemp("router-conn")
    model = tmp / "model"
    build_hf_checkpoint(model, "LlamaForCausalLM", seed=3, max_position_embeddings=512)
    worker = start_server(model, tmp / "worker.log", "--role", "both", "--log-interval", "0",
                          "--max-model-len", "256", "--max-request-size", "2KiB")
    router = None
    try:
        router = start_server(model, tmp / "router.log", "--decode", worker.url,
                              "--timeout-header", "2", command="router")
        yield worker, router
    finally:
        for p in (router, worker):
            if p is not None:
                p.stop()


def _finished(router, stream: bool, n: int = 1) -> None:
    body = {"prompt": "def fibonacci(n):", "max_tokens": 4, "n": n, "stream": stream}
    with httpx.Client(base_url=router.url, timeout=60) as c:
        if not stream:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == n
            return
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [x for x in r.iter_lines() if x]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines), lines


def _gone_mid_stream(router, n: int = 1) -> None:
    """Read the first tokens of a long stream, then drop the connection."""
    body = {"prompt": "class Stack:", "max_tokens": 200, "ignore_eos": True, "n": n,
            "stream": True}
    with httpx.Client(base_url=router.url, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # (leaving the block closes the connection before the stream's end)


def _gone_mid_wait(router) -> None:
    """A non-streamed request whose client stops waiting (whether or not it had finished
    by then, the router must end up with no socket of it)."""
    body = {"prompt": "import os", "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=router.url, timeout=httpx.Timeout(60, read=0.2)) as c:
        try:
            c.post("/v1/completions", json=body)
        except httpx.ReadTimeout:
            pass


def _refused_by_the_worker(router) -> None:
    """A request within the router's limits whose relay body (4 prompts of ~108 tokens,
    each crossing once: about 3 kB) is over the worker's 2 KiB."""
    text = "The quick brown fox jumps over the lazy dog. " * 4
    body = {"prompt": [f"{i} {text}" for i in range(4)], "max_tokens": 1}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "for 4 sequence(s)" in message and "is past what decode worker" in message


def test_the_router_gives_back_every_connection_to_its_worker(servers):
    worker, router = servers
    pid = router.proc.pid
    for _ in range(ROUNDS):
        _finished(router, stream=False)
        _finished(router, stream=True)
        _finished(router, stream=True, n=2)
        _refused_by_the_worker(router)
        _gone_mid_stream(router)
        _gone_mid_stream(router, n=2)
        _gone_mid_wait(router)
    # Every request above ended or was aborted on the worker.
    worker.wait_idle()
    # Settled when no socket is half-closed and only a few stay open (a relay's last close
    # runs just after its response; an idle one is dropped within the pool's keep-alive).
    deadline = time.monotonic() + 20
    while True:
        states = sockets_to(pid, worker.port)
        if (not states["CLOSE_WAIT"] and sum(states.values()) <= MOST_OPEN) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert states["CLOSE_WAIT"] == 0, states
    assert sum(states.values()) <= MOST_OPEN, states
    m = router.metrics()
    assert m[("phasewise:router_worker_in_flight",
              (("role", "decode"), ("url", worker.url)))] == 0
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200
    # ...and it still serves, on the connections it kept.
    _finished(router, stream=True)
    assert "Traceback" not in router.log()


def test_the_router_answers_408_to_a_connection_that_sends_no_request(servers):
    """The router runs the server's connection limits (``--timeout-header`` here 2 s): an
    idle connection is answered 408 and closed, and the router goes on serving."""
    _, router = servers
    with socket.create_connection(("127.0.0.1", router.port)) as s:
        s.settimeout(30)  # generous against the 2 s limit; nothing is timed
        got = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 408 "), got
    with httpx.Client(base_url=router.url, timeout=60) as c:
        assert c.get("/health").status_code == 200


def test_discover_follows_the_names_addresses_as_workers_come_and_go(servers):
    """``--discover``: the router's decode workers are what its name resolves to, looked up
    again and again: an address that appears joins once it serves this checkpoint, one that
    does not answer (or serves another) does not, one that disappears takes no new request
    and is forgotten, and a failed lookup changes nothing. (The lookups are stubbed: the
    real worker is the only address.)"""
    import asyncio

    from phasewise.disagg.router import Router

    worker, _ = servers
    dead = f"http://127.0.0.1:{_closed_port()}"
    router = Router(["http://workers.example:1234"], model_dir=worker_model(worker),
                    discover=True, wait_s=30)
    answers = iter([{worker.url, dead}, None, {dead}, {worker.url}])
    router._resolve_now = lambda: [worker.url, dead]  # at start: one answers, one does not

    async def resolve():
        return next(answers)

    router._resolve = resolve
    router.connect()
    assert [w.url for w in router.decode] == [worker.url]

    async def run():
        router.start(asyncio.get_running_loop())
        try:
            await router._rediscover()  # the dead address still does not join
            assert [w.url for w in router.decode] == [worker.url]
            await router._rediscover()  # the lookup failed: nothing changes
            assert [w.url for w in router.decode] == [worker.url]
            await router._rediscover()  # the worker left the name: forgotten (idle)
            assert router.decode == [] and router._candidates() == []
            await router._rediscover()  # and it comes back
            assert [w.url for w in router.decode] == [worker.url]
            assert [w.url for w, _ in router._candidates()] == [worker.url]
        finally:
            await asyncio.to_thread(router.shutdown)

    asyncio.run(run())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_model(worker):
    """The checkpoint folder the worker serves (its command line's --model)."""
    args = worker.proc.args
    return args[args.index("--model") + 1]
