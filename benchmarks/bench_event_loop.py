"""How much one hostile-sized request stalls everyone else on a running ``phasewise serve``.

For each case, a victim stream runs (a long greedy completion) while the case's requests are
sent beside it, and a probe calls ``/health`` every 20 ms. Printed per case: the victim's
longest inter-token gap and the probe's slowest answer, each against the same figures measured
with no hostile request (the baseline, in the same run). Issue 11 saw a 4.87 s gap (against a
3 ms median) for a 7 MB prompt before tokenizing moved off the event loop.

    .venv/bin/python -m benchmarks.bench_event_loop [--model DIR]

Servers bind 127.0.0.1 on a free port and are stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.harness import machine_info, machine_line, start_server, stream_gaps


def victim(url: str, gaps: list[float], started: threading.Event) -> None:
    body = {"prompt": "def fibonacci(n):", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stream_gaps(url, body, gaps, started)


def probe(url: str, stop: threading.Event, lat: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            c.get("/health")
            lat.append(time.monotonic() - t0)
            time.sleep(0.02)


def run_case(url: str, send) -> tuple[float, float, float]:
    """(victim's longest gap, its median gap, the probe's slowest answer), in seconds."""
    gaps: list[float] = []
    lat: list[float] = []
    started, stop = threading.Event(), threading.Event()
    v = threading.Thread(target=victim, args=(url, gaps, started))
    p = threading.Thread(target=probe, args=(url, stop, lat))
    v.start()
    started.wait(60)
    p.start()
    if send is not None:
        send(url)
    v.join()
    stop.set()
    p.join()
    return max(gaps), statistics.median(gaps), max(lat)


def encode(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()  # compact: under 8 MiB


def post(url: str, path: str, content: bytes) -> None:
    r = httpx.post(url + path, content=content, timeout=300,
                   headers={"content-type": "application/json"})
    print(f"    {path} ({len(content) / 1e6:.1f} MB) -> {r.status_code}", file=sys.stderr)


def sender(make):
    """A case's sending, with its bodies encoded now: encoding a 5 MB body holds this
    process's GIL for a quarter of a second, and the victim's reader is a thread of this
    process, so encoding during the case would be measured as the server's stall."""
    together, requests = make()
    encoded = [(path, encode(body)) for path, body in requests]
    if not together:
        return lambda u: [post(u, path, content) for path, content in encoded]
    return lambda u: run_together(*[
        (lambda path=path, content=content: post(u, path, content)) for path, content in encoded])


def one(path: str, body: object):
    return lambda: (False, [(path, body)])


# name -> a function giving (sent at once?, [(path, body), ...])
CASES = {
    "7 MB prompt to /v1/completions": one("/v1/completions", {"prompt": "x = 1\n" * 1_000_000}),
    "7 MB chat message": one("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x = 1\n" * 1_000_000}]}),
    "3 x 2.3 MB /tokenize": lambda: (False, [("/tokenize", {"prompt": "y = 2\n" * 400_000})] * 3),
    "1M token ids to /detokenize": one("/detokenize", {"tokens": [5] * 1_000_000}),
    "n=16 x 8 prompts, 60 tokens, logprobs 20": one("/v1/completions", {
        "prompt": [[5, 6]] * 8, "n": 16, "max_tokens": 60, "ignore_eos": True,
        "temperature": 1, "logprobs": 20}),
    # issue 46's hostile client
    "7.7 MiB: 280,000 empty chat messages": one("/v1/chat/completions", {
        "messages": [{"role": "user", "content": ""}] * 280_000, "max_tokens": 4}),
    "4 x 7.7 MiB of empty chat messages at once": lambda: (True, [("/v1/chat/completions", {
        "messages": [{"role": "user", "content": ""}] * 280_000, "max_tokens": 4})] * 4),
    "8 MB of token ids to /v1/completions": one("/v1/completions", {
        "prompt": [7] * 4_000_000, "max_tokens": 1}),
    "guided_regex (a{1000}){1000}, n=16": one("/v1/completions", {
        "prompt": "x", "n": 16, "max_tokens": 30, "guided_regex": "(a{1000}){1000}"}),
    "guided_regex (a{100}){100}, n=16": one("/v1/completions", {
        "prompt": "x", "n": 16, "max_tokens": 30, "guided_regex": "(a{100}){100}"}),
    # a second hostile pass: free-form fields and big whole replies
    "6 MB chat_template_kwargs": one("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template_kwargs": {"x": [{"a": [1]}] * 500_000}}),
    "6 MB of tool parameters, tool_choice none": one("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "x": [{"a": [1]}] * 500_000}}}]}),
    "whole reply: echo + 20 logprobs, n=16 (~20 MB)": one("/v1/completions", {
        "prompt": "def f(x):\n" + "    return x\n" * 200, "n": 16, "max_tokens": 1,
        "echo": True, "logprobs": 20, "prompt_logprobs": 20}),
}


def run_together(*sends) -> None:
    threads = [threading.Thread(target=s) for s in sends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bundled)")
    ap.add_argument("--cases", nargs="*", default=None,
                    help="run only the cases whose names contain one of these strings")
    a = ap.parse_args()
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = start_server(Path(a.model) if a.model else None, log, "--log-interval", "0",
                          "--no-access-log")
    try:
        print(machine_line(machine_info()))
        print(f"model: {a.model or 'bundled stdlib-coder'}")
        base_gap, base_med, base_lat = run_case(server.url, None)
        print(f"{'case':44} {'longest gap':>12} {'x baseline':>10} {'slowest /health':>16} "
              f"{'x baseline':>10}")
        print(f"{'baseline (no hostile request)':44} {base_gap * 1e3:10.1f}ms {1.0:10.1f} "
              f"{base_lat * 1e3:14.1f}ms {1.0:10.1f}   (median gap {base_med * 1e3:.1f} ms)")
        for name, make in CASES.items():
            if a.cases and not any(c in name for c in a.cases):
                continue
            gap, _, lat = run_case(server.url, sender(make))
            print(f"{name:44} {gap * 1e3:10.1f}ms {gap / base_gap:10.1f} "
                  f"{lat * 1e3:14.1f}ms {lat / base_lat:10.1f}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
