"""A router in front of a good worker and a broken one (a foreign peer, a bug): what the
broken one answers must not fail the requests the good one can serve, nor the router.

The broken worker is an HTTP server in this process: it forwards ``/internal/v1/info`` from
the good worker (so the router takes it for the same checkpoint) and answers the rest as the
test's ``MODE`` says."""

from __future__ import annotations

import http.server
import json
import threading

import httpx
import pytest

from conftest import build_hf_checkpoint
from serving import start_server

MODE: dict[str, str] = {"load": "ok", "generate": "500", "info": "same", "instance": ""}
THAW = threading.Event()  # set: a "frozen" worker answers again
SEEN = {"dropped": 0, "relayed": 0, "frozen": 0}
STUCK = ("the engine has been in one step for 130 s (the limit, --step-timeout, is 120 s); it "
         "takes no new requests until that step ends")


def _handler(good_url: str):
    class Broken(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - http.server's name
            path = self.path.split("?")[0]
            if MODE["load"] == "frozen" and path == "/internal/v1/load":
                THAW.wait(60)  # a stopped process: the router's poll times out
            if path == "/internal/v1/info":
                info = httpx.get(good_url + path, timeout=30).json()
                info["instance"] = MODE["instance"] or "b0"
                if MODE["info"] == "other-model":
                    info["config_sha256"] = "0" * 64
                elif MODE["info"] == "other-limits":
                    info["info"]["max_model_len"] //= 2
                self._send(200, json.dumps(info).encode())
            elif path == "/internal/v1/load":
                snap = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0,
                        "num_free_blocks": 10, "num_blocks": 10, "num_preemptions": 0,
                        "prefix_queries": 0, "prefix_hits": 0}
                if MODE["load"] == "strings":
                    snap.update(num_running="x", num_waiting="y")
                elif MODE["load"] == "busy":
                    snap.update(num_running=5, kv_usage=0.5)
                reply = {"role": "both", "alive": True, "draining": False, "open_groups": 0,
                         "snapshot": snap, **({"instance": MODE["instance"]}
                                              if MODE["instance"] else {})}
                if MODE["load"] == "stuck":
                    reply.update(alive=False, down_reason=STUCK)
                elif MODE["load"] == "stuck-unreadable":
                    reply.update(alive=False, down_reason="\x1b[2Jstuck\x00")
                self._send(200, json.dumps(reply).encode())
            else:
                self._send(200, b'{"status": "ok"}')

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if MODE["generate"] == "frozen":
                SEEN["frozen"] += 1
                THAW.wait(60)
                self._send(503, b'{"error": {"message": "thawed", "code": "x"}}')
            elif MODE["generate"] in ("drop-once", "drop-then-held") and \
                    not SEEN["dropped"] % 2:
                # what a worker whose keep-alive timer ran out does to a request that
                # arrives as it closes: the connection ends, nothing answered
                SEEN["dropped"] += 1
                self.close_connection = True
            elif MODE["generate"] == "drop-then-held":
                # the first try was taken before its connection broke, and is still held
                SEEN["dropped"] += 1
                self._send(400, json.dumps({"error": {
                    "message": "request id 'x' is already in use", "type": "invalid_request",
                    "param": "request_id"}}).encode())
            elif MODE["generate"] == "drop-once":
                SEEN["dropped"] += 1
                SEEN["relayed"] += 1
                r = httpx.post(good_url + self.path, content=body, timeout=60,
                               headers={"Content-Type": "application/json"})
                self._send(r.status_code, r.content, r.headers["content-type"])
            elif MODE["generate"] == "500":
                self._send(500, b"<html>internal server error</html>", "text/html")
            else:
                self._send(307, b"", "text/plain")

    return Broken


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-worker")
    model = tmp / "model"
    build_hf_checkpoint(model, "LlamaForCausalLM", seed=4, max_position_embeddings=256)
    good = start_server(model, tmp / "good.log", "--role", "both", "--log-interval", "0")
    broken = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(good.url))
    thread = threading.Thread(target=broken.serve_forever, daemon=True)
    thread.start()
    router = None
    try:
        bad_url = f"http://127.0.0.1:{broken.server_address[1]}"
        router = start_server(model, tmp / "router.log", "--decode", good.url, bad_url,
                              "--routing", "round-robin", "--stream-deadline", "3",
                              command="router")
        yield good, router
    finally:
        THAW.set()
        if router is not None:
            router.stop()
        broken.shutdown()
        broken.server_close()
        good.stop()


def _completions(router, n: int) -> list[httpx.Response]:
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return [httpx.post(router.url + "/v1/completions", json=body, timeout=60)
            for _ in range(n)]


@pytest.mark.parametrize("generate", ["500", "307"])
def test_a_worker_that_fails_admissions_sends_them_to_the_other(fleet, generate):
    """Under round-robin half the requests went to a worker answering 500 (or a redirect)
    and failed, its HTML in the error, while a healthy worker stood by."""
    good, router = fleet
    MODE.update(load="ok", generate=generate)
    want = _completions(good, 1)[0].json()["choices"][0]["text"]
    for r in _completions(router, 4):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want


def test_a_load_reply_of_the_wrong_types_marks_only_its_worker_down(fleet):
    """num_running "x" from one worker made every request through the router a 500 and
    /metrics a 500."""
    good, router = fleet
    MODE.update(load="strings", generate="500")
    for _ in range(100):  # its next poll (every second) reads it
        health = httpx.get(router.url + "/health", timeout=30)
        if "num_running" in health.text:
            break
        threading.Event().wait(0.1)
    assert "the snapshot's num_running is 'x'" in health.text, health.text
    for r in _completions(router, 3):
        assert r.status_code == 200, r.text
    assert httpx.get(router.url + "/metrics", timeout=30).status_code == 200


def _gauge(router, name: str) -> float:
    for line in httpx.get(router.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"phasewise:{name}{{") or line.startswith(f"phasewise:{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} on /metrics")


def test_the_routers_gauges_follow_its_workers_polls_while_it_is_idle(fleet):
    """The router set its gauges only when a stream's output came through: 6 s after every
    request had finished it still said 6 running. Each poll round updates them."""
    good, router = fleet
    MODE.update(load="busy", generate="500")
    for _ in range(100):  # the next poll (every second) reads the 5 running
        if _gauge(router, "num_requests_running") == 5:
            break
        threading.Event().wait(0.1)
    assert _gauge(router, "num_requests_running") == 5
    MODE.update(load="ok")
    for _ in range(100):
        if _gauge(router, "num_requests_running") == 0:
            break
        threading.Event().wait(0.1)
    assert _gauge(router, "num_requests_running") == 0



def _health_until(router, text: str) -> str:
    for _ in range(100):  # its next poll (every second) reads it
        health = httpx.get(router.url + "/health", timeout=30).text
        if text in health:
            break
        threading.Event().wait(0.1)
    return health


def test_a_worker_whose_engine_is_stuck_is_down_with_its_reason(fleet):
    """A worker whose engine has been in one step past its --step-timeout says so in its
    load reply: the router takes it as down, names why on /health, and sends the requests
    to the other worker. A reason it cannot show safely is not repeated."""
    good, router = fleet
    MODE.update(load="stuck", generate="500")
    health = _health_until(router, "in one step for")
    assert "its engine is down: " + STUCK in health, health
    for r in _completions(router, 3):
        assert r.status_code == 200, r.text
    MODE.update(load="stuck-unreadable")
    health = _health_until(router, "its engine is not running")
    assert "its engine is not running" in health and "stuck" not in health, health
    MODE.update(load="ok")  # the step ended: the worker is up again
    for _ in range(100):
        workers = httpx.get(router.url + "/health", timeout=30).json()["workers"]
        if all(w["up"] for w in workers):
            break
        threading.Event().wait(0.1)
    assert [w["up"] for w in workers] == [True, True], workers


def _worker_state(router, until) -> list[dict]:
    for _ in range(100):  # its next poll (every second) reads it
        workers = httpx.get(router.url + "/health", timeout=30).json()["workers"]
        if until(workers):
            break
        threading.Event().wait(0.1)
    return workers


@pytest.mark.parametrize("info, why", [
    ("other-model", "serves a different checkpoint: its config_sha256 is 000"),
    ("other-limits", "differ in max_model_len: start them with the same flags")])
def test_a_worker_that_restarts_as_something_else_is_not_routed_to(fleet, info, why):
    """A worker restarted on its URL with another checkpoint got requests and answered
    them in the other model's words (14 of 32 greedy choices), and one with a shorter
    context made every other long prompt a 400: the router checked workers only at
    start-up. A new process id in a poll's reply now has it checked again; it stays out
    of rotation, with the reason on /health, until it passes."""
    good, router = fleet
    MODE.update(load="ok", generate="500", info=info, instance="b1")
    workers = _worker_state(router, lambda ws: not ws[1]["up"])
    assert not workers[1]["up"] and why in workers[1]["reason"], workers
    for r in _completions(router, 4):  # round-robin: half would have gone there
        assert r.status_code == 200, r.text
    MODE.update(info="same", instance="b2")  # restarted again, as it was
    workers = _worker_state(router, lambda ws: ws[1]["up"])
    assert [w["up"] for w in workers] == [True, True], workers


def test_a_request_waiting_on_a_worker_that_froze_goes_to_the_next(fleet):
    """Requests sent to a worker as it froze (SIGSTOP) waited for the whole freeze, up to
    --admit-timeout (120 s), while the streams already there moved after the stream
    deadline. A request still waiting to be taken now moves with them."""
    good, router = fleet
    want = _completions(good, 1)[0].json()["choices"][0]["text"]
    THAW.clear()
    SEEN["frozen"] = 0
    MODE.update(load="frozen", generate="frozen", info="same", instance="")
    try:
        results: list = [None] * 4

        def one(i):
            results[i] = _completions(router, 1)[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert SEEN["frozen"] >= 1  # round-robin sent some there
        for r in results:
            assert r is not None and r.status_code == 200, r
            assert r.json()["choices"][0]["text"] == want
    finally:
        THAW.set()
        MODE.update(load="ok", generate="500")
    _worker_state(router, lambda ws: ws[1]["up"])


def test_a_connection_the_worker_closes_under_a_request_is_tried_again(fleet):
    """A worker whose keep-alive timer ran out while it was frozen closed the router's
    connection as a request went out on it: the router marked it down, and with no other
    worker the request got 503. It is sent once more, on a fresh connection."""
    good, router = fleet
    want = _completions(good, 1)[0].json()["choices"][0]["text"]
    SEEN.update(dropped=0, relayed=0)
    MODE.update(load="ok", generate="drop-once", info="same", instance="")
    try:
        for r in _completions(router, 4):  # round-robin: two go there
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        assert SEEN["relayed"] >= 1 and SEEN["dropped"] == 2 * SEEN["relayed"]
    finally:
        MODE.update(generate="500")


def test_a_retry_the_worker_still_holds_goes_to_the_next_worker(fleet):
    """The retried send can find its first try still held by the worker (taken before the
    connection broke): its 'already in use' is no client error, and another worker goes
    on with the request."""
    good, router = fleet
    want = _completions(good, 1)[0].json()["choices"][0]["text"]
    SEEN.update(dropped=0, relayed=0)
    MODE.update(load="ok", generate="drop-then-held", info="same", instance="")
    try:
        for r in _completions(router, 4):  # round-robin: two go there first
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        assert SEEN["dropped"] >= 2
    finally:
        MODE.update(generate="500")


def test_a_router_has_no_engine_of_its_own_to_probe(fleet):
    """/health/engine asks whether a restart of this process would help its engine: a
    router runs none, and says so (its liveness is /version, its /health its workers')."""
    good, router = fleet
    r = httpx.get(router.url + "/health/engine", timeout=30)
    assert r.status_code == 404 and "no engine runs in this process" in r.text
    assert httpx.get(good.url + "/health/engine", timeout=30).json() == {"status": "ok"}
