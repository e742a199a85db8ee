"""Does watching the dashboard slow the engine? Decode TPOT with and without a client attached.

One ``phasewise serve`` (the bundled model unless ``--model``), then rounds of the same batch of
streamed requests (``--batch`` at once, ``--max-tokens`` each, greedy, ``ignore_eos``), each
round under every condition in a fresh random order:

* ``none``: no page is connected (the feed's observer still records every step: it always
  does, so its own cost is in every condition; the line "observer" below prices it alone);
* ``sse``: one client reads ``/dashboard/events`` as it comes, in its own process (what the
  server pays for a viewer anywhere: building, encoding and sending the frames);
* ``browser``: a headless chromium renders the page on this same machine (``--browser``;
  also the browser's own CPU time, taken from the same cores as the engine's).

A request's TPOT is the server's own ``decode_s / (tokens - 1)`` from the stream's usage
chunk; a condition's figure is the median over its rounds' requests, and the median of each
round's ratio against ``none`` in that same round (the VM's speed drifts between rounds; a
paired ratio cancels it). The issue's bar is under 2% for a client attached.

The observer line times ``DashboardFeed.on_step`` alone on a synthetic step of the batch
size, against the median decode step the server measured.

    python -m benchmarks.bench_dashboard [--rounds 12] [--batch 4] [--max-tokens 96]
        [--browser] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
from benchmarks.harness import PW, Procs, free_port, machine_info, machine_line, wait_http

LOGS = HERE / "results" / "dashboard"


def start(procs: Procs, model: str | None, port: int) -> None:
    """``phasewise serve`` on ``port`` (its log: benchmarks/results/dashboard/serve.log)."""
    cmd = [*PW, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-interval", "0",
           "--no-access-log", *(["--model", model] if model else [])]
    p = procs.start("serve", cmd, LOGS / "serve.log")
    wait_http(f"http://127.0.0.1:{port}/health", [p], 300, "phasewise serve", LOGS / "serve.log")


def one(url: str, max_tokens: int, i: int, out: list[float]) -> None:
    body = {"prompt": f"def task_{i}(x):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"timings"' in line:
                (t,) = json.loads(line[6:])["timings"]
                out.append(t["decode_s"] / (max_tokens - 1))


def batch(url: str, n: int, max_tokens: int) -> list[float]:
    out: list[float] = []
    threads = [threading.Thread(target=one, args=(url, max_tokens, i, out)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(out) != n:
        raise SystemExit(f"only {len(out)} of {n} requests finished")
    return out


_WATCH = """
import sys, httpx
with httpx.stream("GET", sys.argv[1] + "/dashboard/events", timeout=30) as r:
    first = True
    for chunk in r.iter_raw():
        if first:
            print("attached", flush=True)
            first = False
"""


class SSEWatcher:
    """A process that reads /dashboard/events as fast as the server sends it (a page on
    another machine: what the server pays is building and sending the frames; a browser's
    parsing and drawing is the browser machine's work, measured by ``--browser``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> SSEWatcher:
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCH, self.url],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # its first frame: attached
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)


class BrowserWatcher:
    """A headless chromium rendering /dashboard on this machine."""

    def __init__(self, url: str) -> None:
        from playwright.sync_api import sync_playwright

        chromium = shutil.which("chromium") or "/usr/bin/chromium"
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=chromium,
                                                args=["--no-sandbox"])
        self.url = url
        self.page = None

    def __enter__(self) -> BrowserWatcher:
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1600})
        self.page.goto(self.url + "/dashboard")
        self.page.wait_for_function("document.getElementById('conn').textContent === 'live'")
        return self

    def __exit__(self, *exc: object) -> None:
        self.page.close()

    def close(self) -> None:
        self.browser.close()
        self._pw.stop()


def observer_cost(batch_size: int, n: int = 20000) -> float:
    """Seconds per ``on_step`` of a decode step of ``batch_size`` requests."""
    from phasewise.engine.backend import EngineSnapshot
    from phasewise.engine.outputs import RequestOutput, StepStats
    from phasewise.engine.request import RequestMetrics
    from phasewise.server.dashboard.feed import DashboardFeed

    feed = DashboardFeed(model_name="m")
    ids = [f"cmpl-{i:032x}" for i in range(batch_size)]
    metrics = {rid: RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0,
                                   first_token_time=0.01, token_times=[0.01]) for rid in ids}
    snap = EngineSnapshot(batch_size, 0, 0.1, 100, 200, 0, 0, 0)
    t0 = time.perf_counter()
    for k in range(n):
        for rid in ids:
            metrics[rid].token_times.append(0.01 + 0.001 * k)
            if len(metrics[rid].token_times) > 64:
                del metrics[rid].token_times[:32]
        step = StepStats(k, 0.0, 0.001, 0, batch_size, batch_size, batch_size, 0, 0.1, 0,
                         predicted_flops=1e6, predicted_bytes=1e6, predicted_s=1e-4,
                         predicted_decode_s=1e-4, decode_ids=tuple(ids), compute_dtype="fp32",
                         forward_s=0.0008)
        outs = [RequestOutput(rid, None, [1, 2], "", [], "x", [5], False, None, None, None,
                              metrics[rid]) for rid in ids]
        feed.on_step(step, outs, [], snap)
    return (time.perf_counter() - t0) / n


def frame_cost(url: str, n: int = 200) -> tuple[float, int]:
    """Seconds to build and encode one frame of the live server's feed as it is now (its
    hello holds the last 400 steps: priced per 40 steps, about a frame's worth under this
    load), and the frame's bytes, measured here on a copy of its data."""
    import json as _json

    with httpx.stream("GET", url + "/dashboard/events", timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                hello = _json.loads(line[5:])
                break
    frame = dict(hello, steps=hello["steps"][-40:])
    t0 = time.perf_counter()
    for _ in range(n):
        text = _json.dumps(frame, separators=(",", ":"))
    return (time.perf_counter() - t0) / n, len(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--browser", action="store_true",
                    help="also a chromium page rendering the dashboard on this machine")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.max_tokens < 2 or args.batch < 1 or args.rounds < 1:
        raise SystemExit("--max-tokens must be >= 2, --batch and --rounds >= 1")
    m = machine_info()
    print(machine_line(m))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = Procs()
    browser = None
    try:
        start(procs, args.model, port)
        conditions = ["none", "sse"]
        if args.browser:
            browser = BrowserWatcher(url)
            conditions.append("browser")
        batch(url, args.batch, 8)  # warm up
        rng = random.Random(args.seed)
        tpot: dict[str, list[float]] = {c: [] for c in conditions}
        ratios: dict[str, list[float]] = {c: [] for c in conditions}
        for r in range(args.rounds):
            order = conditions[:]
            rng.shuffle(order)
            for c in order:
                if c == "none":
                    got = batch(url, args.batch, args.max_tokens)
                elif c == "sse":
                    with SSEWatcher(url):
                        got = batch(url, args.batch, args.max_tokens)
                else:
                    with browser:
                        got = batch(url, args.batch, args.max_tokens)
                tpot[c] += got
            for c in conditions:  # paired within the round: the VM's drift cancels
                ratios[c].append(statistics.median(tpot[c][-args.batch:])
                                 / statistics.median(tpot["none"][-args.batch:]))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{c} {1e3 * statistics.median(tpot[c][-args.batch:]):.2f} ms"
                for c in conditions), flush=True)
        base = statistics.median(tpot["none"])
        print(f"\ndecode TPOT, batch {args.batch}, {args.max_tokens} tokens per request, "
              f"{args.rounds} rounds (median over {args.rounds * args.batch} requests):")
        for c in conditions:
            med = statistics.median(tpot[c])
            print(f"  {c:8s} {1e3 * med:7.2f} ms   x{med / base:.3f} of none; median of the "
                  f"rounds' paired ratios x{statistics.median(ratios[c]):.3f}")
        fc, nbytes = frame_cost(url)
        print(f"a frame of 40 steps: {nbytes} bytes, encoded in {1e6 * fc:.0f} us; at five a "
              f"second that is {100 * 5 * fc:.2f}% of one core, shared by every page")
        cost = observer_cost(args.batch)
        print(f"observer: DashboardFeed.on_step takes {1e6 * cost:.1f} us for a decode step of "
              f"{args.batch} requests, {100 * cost / base:.2f}% of the median TPOT "
              f"(it runs in every condition above)")
    finally:
        if browser is not None:
            browser.close()
        procs.stop_all()


if __name__ == "__main__":
    main()
