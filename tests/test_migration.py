"""Migration behind ``phasewise router``, real processes on 127.0.0.1: a worker SIGKILLed
mid-stream, sent SIGTERM (a rolling update) or SIGSTOPped (silent, its connections open) has
its streams resumed on the other worker,
and the client sees one stream that equals an unbroken run (greedy and seeded), with usage and
logprobs that agree; both workers hold nothing afterwards."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
import time

import httpx
import pytest

from conftest import build_hf_checkpoint
from serving import free_port, start_server

PROMPT = "def fibonacci(n):"
TOKENS = 240


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("migrate") / "model"
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=5, max_position_embeddings=512)
    return path


def _worker(model, log, port, *extra):
    return start_server(model, log, "--log-interval", "0", "--max-model-len", "512", *extra,
                        port=port)


def _stream(url: str, body: dict, on_chunk=None) -> dict:
    """A streamed completion, read to its end: text and logprob entries per choice, the
    usage, and any error event."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text: dict[int, str] = {}
    lps: dict[int, list] = {}
    usage = error = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            if event.get("usage"):
                usage = event["usage"]
            for c in event.get("choices", []):
                text[c["index"]] = text.get(c["index"], "") + c["text"]
                if c.get("logprobs"):
                    lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
            if on_chunk is not None:
                on_chunk(text)
    return {"text": text, "logprobs": lps, "usage": usage, "error": error}


def _streaming_worker(workers):
    """The worker that runs a request now (its /metrics)."""
    for w in workers:
        if w.proc.poll() is None and w.metrics()[("phasewise:num_requests_running", ())]:
            return w
    return None


def _until_router_sees_all_up(router, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(w["up"] for w in httpx.get(router.url + "/health", timeout=5)
                  .json()["workers"]):
        assert time.monotonic() < deadline, "the router never saw every worker up"
        time.sleep(0.1)


def _metric(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0)


def test_a_stream_whose_worker_dies_or_drains_is_resumed_on_the_other(model, tmp_path):
    ports = [free_port(), free_port()]
    with ThreadPoolExecutor(2) as pool:  # both load at once
        starts = [pool.submit(_worker, model, tmp_path / f"w{i}.log", p, "--shutdown-grace",
                              "60") for i, p in enumerate(ports)]
    workers = [f.result() for f in starts if f.exception() is None]
    if len(workers) < len(starts):  # one did not start: stop the other, by its PID
        for w in workers:
            w.stop()
        raise next(f.exception() for f in starts if f.exception() is not None)
    router = None
    try:
        router = start_server(model, tmp_path / "router.log", "--decode",
                              *(w.url for w in workers), "--stream-deadline", "0.5",
                              command="router")
        greedy = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "logprobs": 1,
                  "ignore_eos": True}
        seeded = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 1.0, "top_p": 0.95,
                  "seed": 4321, "n": 2, "logprobs": 1, "ignore_eos": True}
        # the unbroken runs first (both workers serve the same weights)
        want = {k: _stream(router.url, b) for k, b in (("greedy", greedy), ("seeded", seeded))}
        for w in want.values():
            assert w["error"] is None
        # Admission by SLO across workers: each worker, having timed its own steps, predicts
        # a first token later than 1 ms; the router tries both, then refuses with a 429.
        for w in workers:
            for prompt in ("import os\n", "class A:\n"):
                assert httpx.post(w.url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 8}, timeout=60).status_code == 200
        r = httpx.post(router.url + "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 4, "slo_ttft_ms": 1}, timeout=60)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "slo_ttft" and int(r.headers["retry-after"]) >= 1
        assert "every decode worker refused it" in r.json()["error"]["message"]

        # a SIGKILL (greedy); a SIGSTOP: a worker that answers nothing more, whose
        # connections stay open (greedy); a SIGTERM: a rolling update (seeded, two samples)
        reasons = {"sigkill": "worker_lost", "sigstop": "worker_silent", "sigterm": "drain"}

        def one_round(kind, body, how):
            """Stream ``body``, stop its worker part-way, check the stream; bring the fleet
            back. Returns whether the router moved the stream: "moved", or "late" (the stop
            landed after the worker had sent its last token) or "missed" (the stream ended
            before the test found its worker), which a busy machine can cause."""
            hit: list = []

            def strike(text, hit=hit, how=how):
                # once some of the stream came through: stop the worker that streams it
                if hit or sum(map(len, text.values())) < 5:
                    return
                w = _streaming_worker(workers)
                if w is not None:
                    hit.append(w)
                    w.proc.send_signal({"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM,
                                        "sigstop": signal.SIGSTOP}[how])

            moves = _metric(router.metrics(), "phasewise:router_migrations_total",
                            reason=reasons[how])
            got = _stream(router.url, body, strike)
            assert got["error"] is None, got["error"]
            assert got["text"] == want[kind]["text"], kind
            # every token has its logprob, and usage counts them all
            usage, ref = got["usage"], want[kind]["usage"]
            assert usage["completion_tokens"] == ref["completion_tokens"] == \
                TOKENS * len(got["text"])
            assert usage["prompt_tokens"] == ref["prompt_tokens"]
            for i, lp in got["logprobs"].items():
                assert len(lp) == TOKENS
                assert lp == pytest.approx(want[kind]["logprobs"][i], abs=0.05)
            moved = "moved" if _metric(router.metrics(), "phasewise:router_migrations_total",
                                       reason=reasons[how]) > moves else "late"
            if not hit:
                return "missed"
            # the stopped worker is gone (SIGTERM: it drained by handing over, well within
            # its 60 s grace period); the killed one comes back on its port for the next round
            (gone,) = hit
            if how == "sigstop":  # it wakes to find the router gone, and aborts the request
                gone.proc.send_signal(signal.SIGCONT)
                _until_router_sees_all_up(router)
                return moved
            code = gone.proc.wait(timeout=45)
            if how == "sigterm":  # (uvicorn re-raises the signal once it has shut down)
                assert code in (0, -signal.SIGTERM)
                assert "Finished server process" in gone.log()
            else:
                assert code == -signal.SIGKILL
            assert "Traceback" not in gone.log()
            if how == "sigterm":
                workers.remove(gone)
                return moved
            i = workers.index(gone)
            workers[i] = _worker(model, tmp_path / f"w{i}-again.log", ports[i],
                                 "--shutdown-grace", "60")
            _until_router_sees_all_up(router)
            return moved

        for kind, body, how in (("greedy", greedy, "sigkill"), ("greedy", greedy, "sigstop"),
                                ("seeded", seeded, "sigterm")):
            # a round whose stop missed the stream or landed too late is tried again (but a
            # late SIGTERM has taken its worker away)
            outcomes = []
            while len(outcomes) < 4 and "moved" not in outcomes and not (
                    how == "sigterm" and "late" in outcomes):
                outcomes.append(one_round(kind, body, how))
            assert outcomes[-1] == "moved", f"{how}: {outcomes}"
        m = router.metrics()
        assert _metric(m, "phasewise:requests_refused_total", reason="slo_ttft") == 1
        for reason in ("worker_lost", "drain", "worker_silent"):
            assert _metric(m, "phasewise:router_migrations_total", reason=reason) == 1
        assert _metric(m, "phasewise:router_migrations_failed_total") == 0
        # nothing is left running or holding K/V anywhere (on the worker still up)
        assert len(workers) == 1
        for w in workers:
            idle = w.wait_idle()
            assert idle[("phasewise:kv_cache_usage_perc", ())] == 0
        assert "Traceback" not in router.log()
        moved = [line for line in router.log().splitlines() if " moved=" in line]
        assert len(moved) == 3
        assert "(worker_lost)" in moved[0] and "(worker_silent)" in moved[1]
        assert "(drain)" in moved[2]
    finally:
        for p in (router, *workers):
            if p is not None:
                p.stop()
