"""The dashboard's feed (what the engine's thread records) and its HTTP side: the page, the
event stream, the playground's traces, the API key and its session, draining, and the P/D
view through the router. The page itself, in a real browser: test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import build_hf_checkpoint
from phasewise.engine.backend import EngineSnapshot, FinishedRequest
from phasewise.engine.outputs import RequestOutput, StepStats
from phasewise.engine.request import RequestMetrics
from phasewise.server.dashboard import _static
from phasewise.server.dashboard.feed import (LATENCY_EDGES, MAX_STEPS_PER_FRAME,
                                             PLAYGROUND_PREFIX, Cursor, DashboardFeed, bucket)
from phasewise.server.errors import ApiError
from phasewise.server.guard import DASHBOARD_COOKIE
from phasewise.server.dashboard.hub import PAGE_QUEUE, Hub, Page
from serving import free_port, start_server

SNAP = EngineSnapshot(1, 0, 0.1, 90, 100, 0, 0, 0)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def step(index: int, start: float, duration: float, prefill=(), decode=(), **kw) -> StepStats:
    return StepStats(index=index, start_time=start, duration_s=duration,
                     num_prefill_tokens=sum(n for _, n in prefill),
                     num_decode_tokens=len(decode), num_requests=len(prefill) + len(decode),
                     num_running=len(decode), num_waiting=0, kv_usage=0.1, num_preempted=0,
                     prefill_chunks=tuple(prefill), decode_ids=tuple(decode), **kw)


def output(rid: str, metrics: RequestMetrics, text: str, prompt_len: int = 4) -> RequestOutput:
    return RequestOutput(rid, None, list(range(prompt_len)), "", [], text, [7], False, None,
                         None, None, metrics)


class Run:
    """Drives a feed as the engine would: requests arrive, prefill, decode."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.feed = DashboardFeed(model_name="m", clock=self.clock)
        self.index = 0
        self.metrics: dict[str, RequestMetrics] = {}

    def arrive(self, rid: str) -> None:
        self.metrics[rid] = RequestMetrics(arrival_time=self.clock.t)

    def step(self, duration: float, prefill=(), decode=(), first=(), **kw) -> StepStats:
        """``first``: requests whose last prompt chunk rides here (they get a token)."""
        self.index += 1
        start = self.clock.t
        self.clock.t += duration
        s = step(self.index, start, duration, prefill, decode, **kw)
        outs = []
        for rid in [*first, *decode]:
            m = self.metrics[rid]
            if m.first_scheduled_time is None:
                m.first_scheduled_time = start
            if m.first_token_time is None:
                m.first_token_time = self.clock.t
            m.token_times.append(self.clock.t)
            outs.append(output(rid, m, f"<{rid}{len(m.token_times)}>"))
        self.feed.on_step(s, outs, [], SNAP)
        return s


def streaming_pair() -> Run:
    """A run with two streams, "a" and "b", past their prompts and 8 decode steps of 5 ms
    (a baseline for the stall view)."""
    run = Run()
    for rid in ("a", "b"):
        run.arrive(rid)
    run.step(0.004, prefill=[("a", 4), ("b", 4)], first=["a", "b"])
    for _ in range(8):
        run.step(0.005, decode=["a", "b"])
    return run


def test_a_long_prompt_chunk_among_decodes_is_a_stall_that_names_it():
    run = streaming_pair()
    run.step(0.006, prefill=[("small", 8)], decode=["a", "b"])  # barely slower: no stall
    run.arrive("big")
    run.step(0.040, prefill=[("big", 256), ("small", 8)], decode=["a", "b"])
    f = run.feed.frame(Cursor())
    (stall,) = f["stalls"]
    assert [i["id"] for i in stall["intruders"]] == ["big", "small"]  # the largest first
    assert stall["intruders"][0]["tokens"] == 256
    assert stall["victims"] == ["a", "b"] and stall["num_victims"] == 2
    assert stall["baseline_s"] == pytest.approx(0.005)
    assert stall["step"] == run.index
    # a prompt-only step (prefill-first) holds back the streams that did not run at all
    run.step(0.050, prefill=[("big", 256)])
    (stall,) = run.feed.frame(Cursor(stalls=1))["stalls"]
    assert stall["intruders"][0]["id"] == "big" and sorted(stall["victims"]) == ["a", "b"]


def test_a_stall_names_the_intruders_whole_prompt_before_it_has_output_anything():
    """A chunk of a long prompt has no output yet (its prompt ends steps later): its prompt's
    length comes with the step, so the stall names the chunk and the prompt it is part of."""
    run = streaming_pair()
    run.arrive("big")
    run.step(0.040, prefill=[("big", 254)], decode=["a", "b"], prefill_prompt_tokens=(900,))
    (stall,) = run.feed.frame(Cursor())["stalls"]
    assert stall["intruders"] == [{"id": "big", "tokens": 254, "prompt_tokens": 900}]


def test_a_stall_is_blamed_on_a_chunk_only_where_its_predicted_cost_explains_it():
    """Priced steps (the engine's cost model: predicted_s, and predicted_decode_s for the
    decodes alone). Under a CPU hog a step with a small chunk runs slow: its chunk's marginal
    cost explains little of the excess, so no intruder is named; pure decode steps slowed
    the same way are no stall at all; a 1k-token chunk among decodes is named, with it."""
    run = Run()
    for rid in ("a", "b"):
        run.arrive(rid)

    def priced(duration: float, prefill=(), decode=(), predicted=0.004, decode_s=0.004):
        run.index += 1
        start = run.clock.t
        run.clock.t += duration
        s = step(run.index, start, duration, prefill, decode, predicted_s=predicted,
                 predicted_decode_s=decode_s)
        run.feed.on_step(s, [], [], SNAP)

    for _ in range(8):
        priced(0.005, decode=["a", "b"])  # decode runs at 1.25x its prediction
    for _ in range(4):  # small chunks cost what they are predicted to (times that 1.25)
        priced(0.00525, prefill=[("s", 8)], decode=["a", "b"], predicted=0.0042)
    priced(0.080, decode=["a", "b"])  # the hog, pure decode: not a stall
    priced(0.080, prefill=[("small", 8)], decode=["a", "b"], predicted=0.0042)  # the hog
    f = run.feed.frame(Cursor())
    (slow,) = f["stalls"]
    assert slow["intruders"] == [] and slow["explained"] is False and slow["priced"]
    assert slow["chunks"] == [{"id": "small", "tokens": 8}]
    assert slow["expected_chunk_s"] == pytest.approx(0.0002 * 1.25)
    run.arrive("big")
    priced(0.060, prefill=[("big", 1024)], decode=["a", "b"], predicted=0.046)
    (stall,) = run.feed.frame(Cursor(stalls=1))["stalls"]
    assert stall["explained"] is True and stall["chunks"] == []
    assert [(i["id"], i["tokens"]) for i in stall["intruders"]] == [("big", 1024)]


def test_steps_carry_their_forward_pass_and_host_time_and_a_stall_says_when_host_time_is_it():
    """Step rows carry the forward pass's time and the host's (None where unmeasured). A
    stall its chunks do not explain says whether the time it spent outside its forward pass,
    beyond the decode steps' usual host time, is most of its excess."""
    run = Run()
    for rid in ("a", "b"):
        run.arrive(rid)

    def timed(duration: float, forward: float | None, prefill=(), decode=()):
        run.index += 1
        start = run.clock.t
        run.clock.t += duration
        run.feed.on_step(step(run.index, start, duration, prefill, decode, predicted_s=0.004,
                              predicted_decode_s=0.004, forward_s=forward), [], [], SNAP)

    for _ in range(8):
        timed(0.005, 0.004, decode=["a", "b"])  # 1 ms a step outside the forward pass
    timed(0.005, None, decode=["a", "b"])  # unmeasured: no host figure
    hello = run.feed.hello()
    rows = [dict(zip(hello["step_fields"], s)) for s in hello["steps"]]
    assert rows[0]["forward_s"] == 0.004 and rows[0]["host_s"] == pytest.approx(0.001)
    assert rows[-1]["forward_s"] is None and rows[-1]["host_s"] is None
    json.dumps(hello)
    # a small chunk, 80 ms: 74 ms of it outside the forward pass, the host's usual is 1 ms
    timed(0.080, 0.006, prefill=[("small", 8)], decode=["a", "b"])
    # the same, but the forward pass took the time: the host is not the excess
    timed(0.080, 0.075, prefill=[("small", 8)], decode=["a", "b"])
    timed(0.080, None, prefill=[("small", 8)], decode=["a", "b"])  # unmeasured
    host, kernels, unknown = run.feed.frame(Cursor())["stalls"]
    assert not host["explained"] and not kernels["explained"] and not unknown["explained"]
    assert host["forward_s"] == 0.006 and host["host_s"] == pytest.approx(0.074)
    assert host["baseline_host_s"] == pytest.approx(0.001)
    assert host["host_share"] == pytest.approx(0.073 / 0.075, abs=1e-3)
    assert host["host_share"] >= 0.5 > kernels["host_share"]
    assert kernels["host_share"] == pytest.approx(0.004 / 0.075, abs=1e-3)
    assert unknown["host_share"] is None and unknown["host_s"] is None
    # a playground trace's steps carry the split too
    a = PLAYGROUND_PREFIX + "p"
    run.arrive(a)
    run.index += 1
    run.feed.on_step(step(run.index, run.clock.t, 0.003, [(a, 4)], (), forward_s=0.002), [],
                     [], SNAP)
    detail = run.feed.trace(a)["step_detail"][0]
    assert detail["forward_s"] == 0.002 and detail["host_s"] == pytest.approx(0.001)


def test_no_stall_without_a_decode_baseline_or_without_victims():
    run = Run()
    run.arrive("a")
    run.step(0.5, prefill=[("a", 512)], first=["a"])  # nothing decodes yet
    for _ in range(6):
        run.step(0.005, decode=["a"])
    run.feed.on_step(None, [], [FinishedRequest("a", 4, 7, "stop", run.metrics["a"])], SNAP)
    run.step(0.5, prefill=[("z", 512)])  # nobody is streaming
    assert run.feed.frame(Cursor())["stalls"] == []


@given(st.floats(min_value=0.0, max_value=1e4, allow_nan=False))
def test_latency_bins_hold_their_values(x):
    i = bucket(LATENCY_EDGES, x)
    assert 0 <= i <= len(LATENCY_EDGES)
    if i > 0:
        assert LATENCY_EDGES[i - 1] <= x
    if i < len(LATENCY_EDGES):
        assert x < LATENCY_EDGES[i]


def test_histograms_count_each_requests_ttft_once_and_each_gap():
    run = Run()
    run.arrive("a")
    run.clock.t += 0.030  # queued 30 ms
    run.step(0.023, prefill=[("a", 4)], first=["a"])  # TTFT 53 ms
    for _ in range(3):
        run.step(0.013, decode=["a"])  # three 13 ms gaps, off a bin edge
    f = run.feed.frame(Cursor())
    assert sum(f["ttft"]) == 1 and f["ttft"][bucket(LATENCY_EDGES, 0.053)] == 1
    assert sum(f["itl"]) == 3 and f["itl"][bucket(LATENCY_EDGES, 0.013)] == 3


def test_frames_are_bounded_and_never_repeat_a_step():
    run = Run()
    run.arrive("a")
    run.step(0.001, prefill=[("a", 4)], first=["a"])
    for _ in range(1500):
        run.step(0.001, decode=["a"])
    cur = Cursor()
    f = run.feed.frame(cur)
    assert len(f["steps"]) == MAX_STEPS_PER_FRAME
    assert f["skipped"] == 1501 - MAX_STEPS_PER_FRAME
    assert f["steps"][-1][0] == run.index  # the newest are sent
    assert run.feed.frame(cur)["steps"] == []
    run.step(0.001, decode=["a"])
    assert [s[0] for s in run.feed.frame(cur)["steps"]] == [run.index]
    json.dumps(f)  # ready for the wire as is


def test_a_playground_trace_has_every_output_and_the_steps_it_rode_on():
    run = Run()
    a = PLAYGROUND_PREFIX + "a"
    run.arrive(a)
    run.arrive("b")
    run.step(0.003, prefill=[(a, 16)])  # a's first chunk: no token yet
    run.step(0.004, prefill=[(a, 8), ("b", 4)], first=[a, "b"])
    for _ in range(5):
        run.step(0.002, decode=[a, "b"])
    run.feed.on_step(None, [], [FinishedRequest(a, 24, 6, "length", run.metrics[a])],
                     SNAP)
    tr = run.feed.trace(a)
    assert tr["finished"] and tr["finish_reason"] == "length"
    assert [(p, n) for _, n, p in tr["steps"]] == [("prefill", 16), ("prefill", 8)] + \
        [("decode", 1)] * 5
    assert tr["num_tokens"] == 6 and len(tr["outputs"]) == 6
    m = run.metrics[a]
    assert tr["outputs"][0][0] == pytest.approx(m.first_token_time - m.arrival_time)
    assert tr["outputs"][-1][0] == pytest.approx(m.token_times[-1] - m.arrival_time)
    assert "".join(o[2] for o in tr["outputs"]) == "".join(f"<{a}{i}>" for i in range(1, 7))
    detail = tr["step_detail"][1]
    assert detail["prefill"] == 12 and detail["requests"] == 2  # that step's whole mix
    assert run.feed.trace("nobody") is None
    # another client's request is followed (for the stall view), never traced: no viewer
    # reads what it generated
    assert run.feed.trace("b") is None


def test_requests_whose_end_is_never_reported_do_not_pile_up(monkeypatch):
    import phasewise.server.dashboard.feed as feed_mod

    monkeypatch.setattr(feed_mod, "MAX_TRACES", 3)
    run = Run()
    for i in range(10):  # none of them ever finishes (a router that lost them, say)
        rid = PLAYGROUND_PREFIX + str(i)
        run.arrive(rid)
        run.step(0.002, prefill=[(rid, 4)], first=[rid])
    assert len(run.feed._active) == 3
    assert run.feed.trace(PLAYGROUND_PREFIX + "9") is not None  # the newest are kept
    assert sum(run.feed.frame(Cursor())["ttft"]) == 10  # and every TTFT still counts


def test_transfers_are_recorded_with_their_rate():
    feed = DashboardFeed(model_name="m")

    class T:
        sent_at, first_frame_at, done_at = 10.0, 10.5, 11.0
        nbytes, frames, peer = 2_000_000_000, 4, "prefill@host"

    feed.on_transfer(T)
    (t,) = feed.frame(Cursor())["transfers"]
    assert t[2] == "prefill@host" and t[3] == 2_000_000_000
    assert t[7] == pytest.approx(4.0)  # 2 GB in 0.5 s


def test_a_page_that_falls_behind_is_dropped_not_waited_for():
    async def main():
        page = Page()
        for i in range(PAGE_QUEUE + 5):
            page.offer(f"data: {i}\n\n")
        assert page.dropped
        items = []
        while not page.queue.empty():
            items.append(page.queue.get_nowait())
        assert items[-1] is None and "reset" in items[-2]

        hub = Hub(DashboardFeed(model_name="m"), interval_s=0.01)
        page, first = hub.join()
        assert first.startswith("event: hello")
        got = await asyncio.wait_for(page.queue.get(), 5)
        assert json.loads(got[len("data: "):])["kind"] == "frame"
        hub.close()  # draining: every page's stream ends
        while await asyncio.wait_for(page.queue.get(), 5) is not None:
            pass
        assert not hub.pages
    asyncio.run(main())


def test_a_page_that_stops_reading_gives_its_slot_back():
    from phasewise.server.dashboard import PageStream

    async def main():
        hub = Hub(DashboardFeed(model_name="m"), interval_s=0.001, max_pages=2,
                  max_pages_per_client=2)
        page, _ = hub.join("10.0.0.1")
        assert hub.pages_of("10.0.0.1") == 1
        for _ in range(200):  # the broadcaster's frames pile up unread
            await asyncio.sleep(0.002)
            if page.dropped:
                break
        assert page.dropped and not hub.full and hub.pages_of("10.0.0.1") == 0

        # a write that never completes (a client that stopped reading) ends the stream
        closed = []

        async def forever():
            while True:
                yield "data: x\n\n"

        resp = PageStream(forever(), lambda: closed.append(True))
        resp.send_timeout = 0.05
        blocked = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body":
                blocked.set()
                await asyncio.Future()  # never

        async def receive():
            await asyncio.Future()

        await asyncio.wait_for(resp({"type": "http"}, receive, send), 10)
        assert blocked.is_set() and closed == [True]
    asyncio.run(main())


# -- over HTTP -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dash")
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=5, max_position_embeddings=1024)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("logs") / "dash.log",
                     "--log-interval", "0")
    yield s
    s.stop()


def events(client: httpx.Client, path: str = "/dashboard/events", **kw):
    """Yields (event name, parsed data) from a live SSE stream."""
    with client.stream("GET", path, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                yield name, json.loads(line[5:])
                name = None


def stream_completion(url: str, body: dict, path: str = "/dashboard/api/completions",
                      **kw) -> tuple[str, str, dict]:
    """(id, text, the usage chunk's timings[0]) of a streamed completion."""
    text, rid, timing = "", None, None
    with httpx.stream("POST", url + path, timeout=120, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}, **kw) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            text += "".join(c["text"] for c in chunk["choices"])
            if chunk.get("timings"):
                (timing,) = chunk["timings"]
    return rid, text, timing


def test_the_page_its_script_and_the_vendored_chart_library_are_served(server):
    with server.client() as c:
        page = c.get("/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        srcs = re.findall(r'(?:src|href)="(/dashboard/static/[^"]+)"', page.text)
        assert len(srcs) >= 4
        for src in srcs:  # everything the page loads is served here: no CDN
            assert c.get(src).status_code == 200, src
        assert "http://" not in page.text.replace("http://www.w3.org", "")
        lic = c.get("/dashboard/static/vendor/uplot/LICENSE").text
        assert "MIT License" in lic
        for bad in ("..%2F..%2Fguard.py", "%2e%2e/feed.py", ".hidden", "vendor/%2E%2E/x"):
            assert c.get(f"/dashboard/static/{bad}").status_code == 404, bad
    for bad in ("../feed.py", "vendor/../../hub.py", "", "vendor//x", ".", "a/.b", "a" * 300,
                "vendor/" + "b" * 250 + "/x"):
        with pytest.raises(ApiError) as e:  # (httpx would normalise these before sending)
            _static(bad)
        assert e.value.status == 404
    assert _static("vendor/uplot/LICENSE").status_code == 200


def test_the_event_stream_says_hello_then_frames_with_the_steps_of_a_request(server, model_dir):
    with server.client() as c:
        it = events(c)
        name, hello = next(it)
        assert name == "hello" and hello["model"] == model_dir.name
        assert hello["interval_s"] <= 0.25  # at least four updates a second
        assert hello["info"]["budget"] > 0 and len(hello["edges"]) == len(LATENCY_EDGES)
        done = threading.Event()
        result = {}

        def run():
            result["r"] = stream_completion(server.url, {"prompt": "def f(x):",
                                                         "max_tokens": 12, "ignore_eos": True})
            done.set()
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        prefill = decode = 0
        ttft_seen = False
        deadline = time.monotonic() + 120
        for name, frame in it:
            assert time.monotonic() < deadline, (prefill, decode, done.is_set())
            assert name is None and frame["kind"] == "frame"
            for s in frame["steps"]:
                fields = dict(zip(hello["step_fields"], s))
                prefill += fields["prefill"]
                decode += fields["decode"]
                assert fields["duration_s"] > 0 and fields["bytes"] > 0 and fields["flops"] > 0
            ttft_seen = sum(frame["ttft"]) >= 1
            if done.is_set() and decode >= 11 and ttft_seen:
                break
        worker.join(30)
        rid, text, timing = result["r"]
        assert prefill >= 4 and decode >= 11  # the prompt, then 11 decode steps


def test_a_trace_agrees_with_the_apis_timings(server):
    rid, text, timing = stream_completion(server.url, {"prompt": "import os\n",
                                                       "max_tokens": 10, "ignore_eos": True})
    with server.client() as c:
        tr = c.get(f"/dashboard/api/requests/{rid}").json()
        assert c.get("/dashboard/api/requests/cmpl-unknown").status_code == 404
        assert c.get("/dashboard/api/requests/" + "x" * 300).status_code == 400
    assert tr["finished"] and tr["num_tokens"] == 10
    assert "".join(o[2] for o in tr["outputs"]) == text
    ttft = tr["outputs"][0][0]
    assert ttft == pytest.approx(timing["queue_s"] + timing["prefill_s"], abs=1e-6)
    assert tr["outputs"][-1][0] - ttft == pytest.approx(timing["decode_s"], abs=1e-6)
    phases = [p for _, _, p in tr["steps"]]
    assert phases.count("decode") == 9 and phases[0] == "prefill"
    assert all("duration_s" in d for d in tr["step_detail"])
    assert rid.startswith(PLAYGROUND_PREFIX)
    # a client's own /v1 request is nobody else's to read
    other, _, _ = stream_completion(server.url, {"prompt": "x", "max_tokens": 3},
                                    path="/v1/completions")
    assert httpx.get(f"{server.url}/dashboard/api/requests/{other}").status_code == 404


@pytest.fixture(scope="module")
def keyed(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("logs") / "keyed.log",
                     "--log-interval", "0", "--shutdown-grace", "30", api_key="dash-key")
    yield s
    s.stop()


def test_with_an_api_key_the_dashboard_needs_it_or_a_session(keyed):
    url = keyed.url
    with httpx.Client(base_url=url, timeout=30) as anon:
        r = anon.get("/dashboard")
        assert r.status_code == 303 and r.headers["location"] == "/dashboard/login"
        for path in ("/dashboard/events", "/dashboard/static/dashboard.js",
                     "/dashboard/api/requests/x"):
            r = anon.get(path)
            assert r.status_code == 401 and "dashboard/login" in r.json()["error"]["message"]
        assert anon.get("/dashboard/login").status_code == 200
        wrong = anon.post("/dashboard/login", content="key=nope",
                          headers={"content-type": "application/x-www-form-urlencoded"})
        assert wrong.status_code == 401 and DASHBOARD_COOKIE not in anon.cookies
        ok = anon.post("/dashboard/login", content="key=dash-key",
                       headers={"content-type": "application/x-www-form-urlencoded"})
        assert ok.status_code == 303
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert "dash-key" not in cookie  # derived from the key, not the key
        assert DASHBOARD_COOKIE in anon.cookies and "Max-Age=" in cookie
        # the session opens the dashboard, and nothing else
        assert anon.get("/dashboard").status_code == 200
        assert anon.get("/dashboard/static/dashboard.js").status_code == 200
        assert anon.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        # a session's POST must be JSON: a cross-site form cannot send that
        r = anon.post("/dashboard/api/completions", content='{"prompt": "x"}',
                      headers={"content-type": "text/plain"})
        assert r.status_code == 415
        r = anon.post("/dashboard/api/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        r = anon.post("/dashboard/api/completions", content='{"prompt": "x", "max_tokens": 1}',
                      headers={"content-type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200  # media types are case-insensitive
        # another app's cookie of the same name beside ours does not log us out
        token = anon.cookies[DASHBOARD_COOKIE]
        r = httpx.get(url + "/dashboard/api/status", headers={
            "cookie": f"{DASHBOARD_COOKIE}=other; {DASHBOARD_COOKIE}={token}"})
        assert r.status_code == 200 and r.json()["max_pages"] >= 1
        assert anon.post("/dashboard/login", content="key=" + "k" * 5000, headers={
            "content-type": "application/x-www-form-urlencoded"}).status_code == 400
        it = events(anon)
        assert next(it)[0] == "hello"
    with keyed.client() as c:  # the bearer header works too
        assert c.get("/dashboard").status_code == 200


def test_draining_ends_the_dashboards_streams_so_shutdown_is_not_held_up(keyed):
    seen = []

    def watch():
        with keyed.client(timeout=60) as c:
            for name, _ in events(c):
                seen.append(name)
        seen.append("ended")

    t = threading.Thread(target=watch)
    t.start()
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen and seen[0] == "hello"
    # it exits by itself (stop() would SIGKILL it, -9, after 25 s), well inside its 30 s
    # grace: the page's open stream does not hold shutdown up
    assert keyed.stop(signal.SIGTERM, timeout=25) in (0, -signal.SIGTERM)
    t.join(10)
    assert seen[-1] == "ended"


# -- P/D: the router's dashboard relays every worker's ----------------------------------
def test_the_routers_dashboard_shows_each_worker_and_the_kv_transfers(model_dir, tmp_path):
    port, dport, pport, kvport = (free_port() for _ in range(4))
    pd = start_server(model_dir, tmp_path / "pd.log", "--decode-port", str(dport),
                      "--prefill-port", str(pport), "--kv-port", str(kvport),
                      "--max-model-len", "512", api_key="pd-key", command="pd", port=port,
                      timeout=240)
    try:
        with pd.client() as c:
            it = events(c)
            name, hello = next(it)
            assert name == "hello" and hello["role"] == "router"
            assert sorted(w["role"] for w in hello["workers"]) == ["decode", "prefill"]
            decode_url = f"http://127.0.0.1:{dport}"
            prefill_url = f"http://127.0.0.1:{pport}"
            result = {}
            prompt = "def fibonacci(n):\n" * 8
            threading.Thread(target=lambda: result.update(r=stream_completion(
                pd.url, {"prompt": prompt, "max_tokens": 6, "ignore_eos": True},
                headers=pd.headers))).start()
            saw = {"hello": set(), "prefill_steps": 0, "transfers": [], "router_ttft": 0,
                   "decode_ttft": 0}
            deadline = time.monotonic() + 120
            for name, ev in it:
                assert time.monotonic() < deadline, saw
                if name == "worker" and "frame" in ev:
                    frame = ev["frame"]
                    if frame["kind"] == "hello":
                        saw["hello"].add((ev["src"], frame["role"]))
                    if ev["src"] == prefill_url:
                        saw["prefill_steps"] += sum(s[3] for s in frame["steps"])
                    if ev["src"] == decode_url:
                        saw["transfers"] += frame["transfers"]
                        # the first token came from the prefill worker: counted here too
                        saw["decode_ttft"] = sum(frame["ttft"])
                elif name is None:
                    saw["router_ttft"] = sum(ev["ttft"])
                # (each worker's relay connects on its own: wait for both to be heard)
                if saw["transfers"] and saw["router_ttft"] and saw["decode_ttft"] and \
                        saw["prefill_steps"] and "r" in result:
                    break
        assert saw["hello"] >= {(decode_url, "decode"), (prefill_url, "prefill")}
        assert saw["prefill_steps"] > 0
        (t,) = saw["transfers"]
        assert t[3] > 0 and t[2]  # bytes, and the prefill worker that sent them
        rid, text, timing = result["r"]
        assert t[3] == timing["kv_bytes"]
        # the playground's trace through the router: its outputs, the worker's steps
        tr = httpx.get(f"{pd.url}/dashboard/api/requests/{rid}", headers=pd.headers,
                       timeout=30).json()
        assert tr["worker"] == decode_url and tr["num_tokens"] == 6
        assert [p for _, _, p in tr["steps"]].count("decode") == 5
    finally:
        pd.stop()


def test_the_frame_carries_the_parked_requests_count():
    """The running / waiting tile names requests held because their clients stopped reading
    (``EngineSnapshot.num_parked``)."""
    from dataclasses import replace

    feed = DashboardFeed(model_name="m", clock=Clock())
    feed.on_step(None, [], [], replace(SNAP, num_parked=3))
    assert feed.frame(Cursor())["snapshot"]["parked"] == 3
