"""Fairness between client requests: another client's time to first token while one request
of many sequences runs.

One ``phasewise serve`` (the bundled model unless ``--model``). A short greedy streaming
request (the *newcomer*) is timed alone, then again ``--after`` seconds into a *hog*: one
request of ``--prompts`` prompts x ``n`` samples (256 sequences by default: twice the default
128 seats) of ``--max-tokens`` tokens each, all within the server's limits. Each is repeated
``--rounds`` times. Printed per round: the newcomer's TTFT alone and beside the hog, their
ratio, and the hog's own wall time; then the medians.

Under first-come-first-served seats the newcomer waited for a whole generation of the hog's
sequences to end; with the seats shared between requests (``phasewise.engine.scheduler``:
the fewest seats first, and a request past half of them gives one up) it waits a step or
two. The hog's own time is the cost side of that: one of its sequences recomputes its prompt
and tokens after giving up its seat.

With ``--unread K`` the hog is instead K streamed requests (``--n`` samples each, 20
logprobs a token) whose client never reads a byte: the newcomer's TTFT is timed beside them,
then its largest gap between tokens while they close their connections at once. A request
whose reader stopped reading is parked (``RequestGroup``): its seats go to the newcomer.

With ``--scoring K`` the hog is instead K concurrent scoring requests, each a streamed
1,022-token prompt of token ids with ``echo``, 20 logprobs, 20 prompt logprobs and ``n``
samples of one token (~32 MB of reply at n=16, within every limit): the newcomer streams
``--max-tokens`` tokens alone, then beside them, and its largest gap between tokens and its
wall time are compared. Building such replies holds the GIL, which the engine's thread needs
between its kernels (``phasewise.server.sse``).

``--pd`` serves through ``phasewise pd`` (a router, a prefill and a decode worker) instead:
the router relays the streams, and tells the decode worker to park a request whose client
stopped reading (``/internal/v1/park``).

``--server-checkout DIR`` runs the server from another checkout (a ``git worktree`` of an
older commit), so that a before/after pair runs in one invocation on one machine state.

    python -m benchmarks.bench_fairness [--model DIR] [--rounds 3] [--prompts 16] [--n 16]
                                        [--max-tokens 200] [--after 2] [--unread K]
                                        [--scoring K] [--pd] [--server-checkout DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks.harness import (free_port, log, machine_info, machine_line, start_server,
                                stream_gaps)

HERE = Path(__file__).resolve().parent
NOISE = ("figures measured on a shared machine: other tenants move them by 5-30% from run to "
         "run; compare the ratios within this run, not absolute figures across runs")


def _ms(seconds: float) -> str:
    """A figure in ms, or why there is none (a stream that gave fewer than two tokens)."""
    return "none measured" if math.isnan(seconds) else f"{seconds * 1e3:.0f} ms"


def _median(values: list[float]) -> float:
    measured = [v for v in values if not math.isnan(v)]
    return statistics.median(measured) if measured else float("nan")


def newcomer_ttft(url: str) -> float:
    """Seconds from sending a short greedy streaming request to its first token."""
    body = {"prompt": "import os", "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                return time.monotonic() - t0
    raise RuntimeError("the newcomer's stream ended without a token")


def one_round(url: str, a: argparse.Namespace) -> dict[str, float]:
    alone = newcomer_ttft(url)
    hog_body = {"prompt": [f"def a{i}():" for i in range(a.prompts)], "n": a.n,
                "max_tokens": a.max_tokens, "ignore_eos": True}
    hog: dict[str, float] = {}

    def run_hog() -> None:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=hog_body, timeout=3600)
        r.raise_for_status()
        hog["wall_s"] = time.monotonic() - t0

    th = threading.Thread(target=run_hog)
    th.start()
    time.sleep(a.after)
    beside = newcomer_ttft(url)
    th.join()
    return {"alone_s": alone, "beside_hog_s": beside, "ratio": beside / alone,
            "hog_wall_s": hog["wall_s"]}


def unread_round(url: str, a: argparse.Namespace) -> dict[str, float]:
    """K streams nobody reads: the newcomer's TTFT beside them, then its largest gap between
    tokens while they all close."""
    alone = newcomer_ttft(url)
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for i in range(a.unread):
        body = json.dumps({"prompt": f"def a{i}():", "n": a.n, "max_tokens": a.max_tokens,
                           "logprobs": 20, "ignore_eos": True, "stream": True}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # full at once
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        socks.append(s)
    try:
        time.sleep(a.after)
        beside = newcomer_ttft(url)
        gaps: list[float] = []

        body = {"prompt": "import os", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}
        th = threading.Thread(target=stream_gaps, args=(url, body, gaps),
                              kwargs={"line_prefix": "data: {", "timeout": 600})
        th.start()
        time.sleep(0.5)
    finally:
        for s in socks:  # a reset, as a client that gives up
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
    th.join()
    return {"alone_s": alone, "beside_hog_s": beside, "ratio": beside / alone,
            "max_gap_at_close_s": max(gaps) if gaps else float("nan")}


def scoring_round(url: str, a: argparse.Namespace) -> dict[str, float]:
    """The newcomer's stream alone, then beside K scoring requests: its largest gap between
    tokens and its wall time, each way."""
    body = {"prompt": "def f(x):", "max_tokens": a.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def newcomer() -> tuple[float, float]:
        gaps: list[float] = []
        t0 = time.monotonic()
        stream_gaps(url, body, gaps, line_prefix="data: {", timeout=600)
        return (max(gaps) if gaps else float("nan")), time.monotonic() - t0

    gap_alone, wall_alone = newcomer()
    sizes: list[int] = []

    def score(k: int) -> None:
        req = {"prompt": list(range(5 + k, 1027 + k)), "max_tokens": 1, "echo": True,
               "logprobs": 20, "prompt_logprobs": 20, "n": a.n, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=req, timeout=600) as r:
            r.raise_for_status()
            sizes.append(sum(len(c) for c in r.iter_bytes()))

    scorers = [threading.Thread(target=score, args=(k,)) for k in range(a.scoring)]
    result: dict[str, float] = {}

    def run_newcomer() -> None:
        result["gap"], result["wall"] = newcomer()

    th = threading.Thread(target=run_newcomer)
    th.start()
    time.sleep(0.3)  # the newcomer streams; then the scorers arrive at once
    for s in scorers:
        s.start()
    for s in scorers:
        s.join()
    th.join()
    return {"gap_alone_s": gap_alone, "wall_alone_s": wall_alone,
            "gap_beside_s": result["gap"], "wall_beside_s": result["wall"],
            "reply_mb": statistics.mean(sizes) / 1e6 if sizes else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the bundled one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16, help="the hog's prompts")
    p.add_argument("--n", type=int, default=16, help="the hog's samples per prompt (1-16)")
    p.add_argument("--max-tokens", type=int, default=200, help="each hog sequence's tokens")
    p.add_argument("--after", type=float, default=2.0,
                   help="seconds into the hog at which the newcomer is sent")
    p.add_argument("--unread", type=int, default=0, metavar="K",
                   help="the hog: K streams of --n samples nobody reads (see above)")
    p.add_argument("--scoring", type=int, default=0, metavar="K",
                   help="the hog: K concurrent scoring requests of --n samples (see above); "
                   "the newcomer streams --max-tokens tokens")
    p.add_argument("--pd", action="store_true",
                   help="serve through phasewise pd (router, prefill and decode worker)")
    p.add_argument("--server-checkout", default=None, metavar="DIR",
                   help="run the server from this checkout (before/after in one run)")
    a = p.parse_args()
    m = machine_info()
    print(machine_line(m))
    print(NOISE)
    out_dir = HERE / "results" / "fairness"
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.pd:
        args = ("--decode-port", str(free_port()), "--prefill-port", str(free_port()),
                "--kv-port", str(free_port()), "--log-level", "warning")
    else:
        args = ("--log-level", "warning", "--no-access-log")
    server = start_server(Path(a.model) if a.model else None, out_dir / "serve.log", *args,
                          cwd=a.server_checkout, command="pd" if a.pd else "serve",
                          timeout=300 if a.pd else 120)
    print("served by phasewise " + ("pd: a router, a prefill and a decode worker" if a.pd
                                    else "serve"))
    if a.server_checkout:
        print(f"server from {a.server_checkout}")
    rows = []
    try:
        newcomer_ttft(server.url)  # warm-up: one-time costs out of the first round
        for k in range(a.rounds):
            if a.scoring:
                log(f"round {k + 1}/{a.rounds}: {a.scoring} scoring requests of n={a.n}")
                row = scoring_round(server.url, a)
                rows.append(row)
                print(f"round {k + 1}: newcomer's {a.max_tokens} tokens alone: largest gap "
                      f"{_ms(row['gap_alone_s'])}, {row['wall_alone_s']:.2f} s; beside "
                      f"{a.scoring} scoring requests ({row['reply_mb']:.1f} MB of reply "
                      f"each): largest gap {_ms(row['gap_beside_s'])}, "
                      f"{row['wall_beside_s']:.2f} s", flush=True)
                continue
            if a.unread:
                log(f"round {k + 1}/{a.rounds}: {a.unread} unread streams of n={a.n} x "
                    f"{a.max_tokens} tokens")
                row = unread_round(server.url, a)
                rows.append(row)
                print(f"round {k + 1}: newcomer TTFT alone {row['alone_s'] * 1e3:.0f} ms, "
                      f"beside {a.unread} unread streams {row['beside_hog_s'] * 1e3:.0f} ms "
                      f"(x{row['ratio']:.1f}); largest gap while they closed "
                      f"{_ms(row['max_gap_at_close_s'])}", flush=True)
                continue
            log(f"round {k + 1}/{a.rounds}: a hog of {a.prompts} x n={a.n} x "
                f"{a.max_tokens} tokens")
            row = one_round(server.url, a)
            rows.append(row)
            print(f"round {k + 1}: newcomer TTFT alone {row['alone_s'] * 1e3:.0f} ms, beside "
                  f"the hog {row['beside_hog_s'] * 1e3:.0f} ms (x{row['ratio']:.1f}); the "
                  f"hog's {a.prompts * a.n} sequences took {row['hog_wall_s']:.1f} s",
                  flush=True)
    finally:
        server.stop()
    med = {k: _median([r[k] for r in rows]) for k in rows[0]}
    if a.scoring:
        print(f"median over {len(rows)} rounds: the newcomer's largest gap alone "
              f"{_ms(med['gap_alone_s'])}, beside {a.scoring} scoring requests "
              f"{_ms(med['gap_beside_s'])}; its stream {med['wall_alone_s']:.2f} s alone, "
              f"{med['wall_beside_s']:.2f} s beside them "
              f"(x{med['wall_beside_s'] / med['wall_alone_s']:.2f})")
        (out_dir / "fairness.json").write_text(json.dumps(
            {"machine": m, "args": vars(a), "rounds": rows, "median": med}, indent=1))
        return 0
    last = (f"largest gap at close {_ms(med['max_gap_at_close_s'])}" if a.unread
            else f"hog {med['hog_wall_s']:.1f} s")
    print(f"median over {len(rows)} rounds: newcomer TTFT alone {med['alone_s'] * 1e3:.0f} ms, "
          f"beside the hog {med['beside_hog_s'] * 1e3:.0f} ms (x{med['ratio']:.1f}); {last}")
    (out_dir / "fairness.json").write_text(json.dumps(
        {"machine": m, "args": vars(a), "rounds": rows, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
