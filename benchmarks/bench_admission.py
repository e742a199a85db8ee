"""Admission by SLO under load: one ``phasewise serve`` without SLO targets (``plain``) and
one with ``--slo-ttft-ms``/``--slo-tpot-ms`` (``admission``), sent the same requests at
rising request rates, past saturation.

First, against the plain server alone: a lone request's TTFT and TPOT (requests sent one at
a time) and its capacity (a closed loop at a fixed concurrency: completed requests per
second). The targets are then TTFT = 4x the lone TTFT p50 (at least 200 ms) and TPOT = 3x
the lone TPOT p50, unless ``--ttft-ms``/``--tpot-ms`` give them; the admission server starts
with them, and its warm-up (the same lone requests) says whether it refused a lone request.
The sweep's rates are multiples of the capacity (``--rates``). At each rate the same
requests (Poisson arrivals, the same seed) go to both servers, one after the other (the
order alternates from rate to rate), each run starting once both servers are idle
(``num_requests_running`` and ``num_requests_waiting`` 0).

Per rate and server: goodput (requests per second, over the run, that completed and met
both targets), the share of all requests that met them, the requests refused (HTTP 429,
by the server's ``phasewise:requests_refused_total{reason}``), the share of the admitted
(not refused) requests that met them, TTFT p50/p99; then admission's figures as ratios to
the plain server's from the same run. The target: >= 95% of admitted requests meet the
SLO while goodput does not fall.

    python -m benchmarks.bench_admission [--model DIR] [--quick] [--rates 0.5 1 2 4]
                                         [--ttft-ms MS] [--tpot-ms MS] [--capacity RPS]

Both servers run at once (the idle one takes no measurable CPU); each is stopped by its
process group. Results: ``benchmarks/results/admission/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import (BUNDLED_MODEL, PW, Procs, free_port, log, machine_info,
                                machine_line, wait_http)
from phasewise.bench.client import ClientConfig, run_workload
from phasewise.perf.summary import RequestResult, meets_slo, percentile, summarize
from phasewise.perf.workload import RequestSpec

HERE = Path(__file__).resolve().parent
NOISE = ("figures measured on a shared machine: other tenants move them by 5-30% from run to "
         "run; compare the ratios of the two servers within this run, not absolute figures "
         "across runs")


def workload(rng: random.Random, n: int, rate: float | None, lens: tuple[int, int],
             out_len: int, vocab: int) -> tuple[list[RequestSpec], list[list[int]]]:
    """``n`` random prompts of lengths uniform in ``lens``; Poisson arrivals at ``rate``
    per second (None: all at once, for a closed loop)."""
    specs, prompts, t = [], [], 0.0
    for i in range(n):
        if rate:
            t += rng.expovariate(rate)
        length = rng.randint(*lens)
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(length)])
        specs.append(RequestSpec(i, t, length, out_len))
    return specs, prompts


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def refused_counts(m: dict[tuple[str, tuple], float]) -> dict[str, float]:
    return {dict(labels).get("reason", ""): v for (name, labels), v in m.items()
            if name == "phasewise:requests_refused_total"}


def wait_idle(urls: list[str], timeout: float = 300) -> None:
    """Until every server's engine has nothing running and nothing waiting."""
    deadline = time.monotonic() + timeout
    while True:
        busy = []
        for url in urls:
            m = scrape(url)
            if (m.get(("phasewise:num_requests_running", ()), 0)
                    or m.get(("phasewise:num_requests_waiting", ()), 0)):
                busy.append(url)
        if not busy:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"still busy after {timeout:.0f}s: {', '.join(busy)}")
        time.sleep(0.1)


def is_refusal(r: RequestResult) -> bool:
    """The client's error of a 429 (``HTTP 429: refused at admission: ...``)."""
    return not r.success and r.error.startswith("HTTP 429")


# A refusal's message names the target and the engine's prediction for it.
PREDICTED = re.compile(r"its (time to first token|time per output token) would be (\d+) ms")


def refusal_predictions(results: list[RequestResult]) -> dict[str, list[float]]:
    """The engine's predictions (ms) that refused requests, by target: {"ttft": [...], ...}."""
    out: dict[str, list[float]] = {"ttft": [], "tpot": []}
    for r in results:
        hit = PREDICTED.search(r.error) if is_refusal(r) else None
        if hit:
            out["ttft" if hit[1].startswith("time to") else "tpot"].append(float(hit[2]))
    return out


def send(url: str, specs: list[RequestSpec], prompts: list[list[int]],
         concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    cfg = ClientConfig(base_url=url, max_concurrency=concurrency)
    return asyncio.run(run_workload(cfg, specs, prompts))


def arm_figures(results: list[RequestResult], duration: float, slo: dict[str, float],
                refused_metric: dict[str, float]) -> dict[str, Any]:
    """One server's run at one rate, in the figures the report prints."""
    n = len(results)
    s = summarize(results, duration, slo)
    refused = sum(is_refusal(r) for r in results)
    good = sum(meets_slo(r, slo) for r in results)
    admitted = n - refused
    other = [r.error for r in results if not r.success and not is_refusal(r)]
    tpots = [r.tpot for r in results if r.tpot is not None]
    done = [r for r in results if r.success and r.ttft is not None]
    return {"requests": n, "completed": s["completed"], "refused": refused,
            "refused_by_server": refused_metric, "other_failed": len(other),
            "refusal_examples": [r.error for r in results if is_refusal(r)][:3],
            "refused_predicted_ms": refusal_predictions(results),
            # which target the completed requests missed (one may miss both)
            "missed_ttft": sum(r.ttft * 1e3 > slo["ttft"] for r in done),
            "missed_tpot": sum((r.tpot or 0.0) * 1e3 > slo["tpot"] for r in done),
            "other_errors": sorted(set(other))[:5], "met_slo": good,
            "goodput": good / duration if duration > 0 else 0.0, "duration_s": duration,
            "share_all": good / n if n else math.nan,
            "share_admitted": good / admitted if admitted else math.nan,
            "ttft_p50": s["median_ttft_ms"], "ttft_p99": s["p99_ttft_ms"],
            "tpot_p50": s["median_tpot_ms"], "tpot_p99": percentile(tpots, 99) * 1e3,
            "throughput": s["request_throughput"]}


def run_arm(url: str, both: list[str], specs: list[RequestSpec], prompts: list[list[int]],
            slo: dict[str, float]) -> dict[str, Any]:
    wait_idle(both)
    before = refused_counts(scrape(url))
    results, duration = send(url, specs, prompts)
    after = refused_counts(scrape(url))
    delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}
    return arm_figures(results, duration, slo, delta)


def start_server(a: argparse.Namespace, procs: Procs, name: str, extra: list[str]
                 ) -> tuple[Any, str]:
    """A ``phasewise serve`` started through ``procs`` (stopped by its process group), once
    its /health answers; its process and URL."""
    port = free_port()
    cmd = [*PW, "serve", "--model", str(a.model), "--host", "127.0.0.1", "--port", str(port),
           "--log-interval", "0", "--no-access-log", *extra]
    path = a.results_dir / "logs" / f"{name}.log"
    p = procs.start(name, cmd, path, cpus=a.cpus)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", [p], 600, f"{name} server", path)
    return p, url


def ratio(x: float, y: float) -> float:
    """x / y; inf where only y is 0, nan where both are (or either is nan)."""
    if math.isnan(x) or math.isnan(y):
        return math.nan
    if y == 0:
        return math.inf if x > 0 else math.nan
    return x / y


def ratio_text(r: float) -> str:
    if math.isnan(r):
        return "n/a"
    return "inf (plain 0)" if math.isinf(r) else f"x{r:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    ap.add_argument("--quick", action="store_true",
                    help="few requests, two rates: a smoke test of a minute or two")
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help="request rates as multiples of the measured capacity "
                    "(default 0.5 1 2 4; --quick 0.5 2)")
    ap.add_argument("--capacity", type=float, default=None,
                    help="requests per second the rates multiply (default: measured)")
    ap.add_argument("--ttft-ms", type=float, default=None,
                    help="TTFT target (default: 4x the lone TTFT p50, at least 200 ms)")
    ap.add_argument("--tpot-ms", type=float, default=None,
                    help="TPOT target (default: 3x the lone TPOT p50)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per rate and server (default 200; --quick 40)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(64, 384), metavar=("LO", "HI"),
                    help="prompt lengths, uniform in [LO, HI] tokens")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8,
                    help="the closed loop's concurrency that measures the capacity")
    ap.add_argument("--cpus", default=None, help="pin both servers to these CPUs (taskset)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--results-dir", type=Path, default=HERE / "results" / "admission")
    a = ap.parse_args(argv)
    multiples = a.rates or ([0.5, 2.0] if a.quick else [0.5, 1.0, 2.0, 4.0])
    n_req = a.requests or (40 if a.quick else 200)
    n_lone, n_cap = (4, 24) if a.quick else (8, 64)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    m = machine_info()
    print(machine_line(m))
    print(f"seed {seed}; {NOISE}")
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    lens = (min(a.prompt_len), max(a.prompt_len))
    rng = random.Random(seed)
    lone = workload(rng, n_lone, None, lens, a.output_len, vocab)
    closed = workload(rng, n_cap, None, lens, a.output_len, vocab)
    warm = workload(rng, 2, None, lens, a.output_len, vocab)
    procs = Procs()
    doc: dict[str, Any] = {"machine": m, "seed": seed, "model": str(a.model), "note": NOISE,
                           "prompt_len": lens, "output_len": a.output_len, "rates": []}
    try:
        _, plain = start_server(a, procs, "plain", [])
        send(plain, *warm, concurrency=1)  # the first steps pay one-off costs
        res, _ = send(plain, *lone, concurrency=1)
        ok = [r for r in res if r.success]
        if len(ok) < len(res):
            raise RuntimeError(f"lone requests failed: {[r.error for r in res if r.error]}")
        lone_ttft = statistics.median(r.ttft for r in ok) * 1e3
        lone_tpot = statistics.median(r.tpot for r in ok if r.tpot is not None) * 1e3
        log(f"lone request: TTFT p50 {lone_ttft:.1f} ms, TPOT p50 {lone_tpot:.2f} ms")
        if a.capacity:
            capacity = a.capacity
        else:
            wait_idle([plain])
            res, dur = send(plain, *closed, concurrency=a.concurrency)
            capacity = summarize(res, dur)["request_throughput"]
            log(f"capacity: {capacity:.2f} req/s (closed loop, concurrency {a.concurrency})")
        slo = {"ttft": a.ttft_ms or max(4 * lone_ttft, 200.0),
               "tpot": a.tpot_ms or 3 * lone_tpot}
        doc.update(lone={"ttft_p50_ms": lone_ttft, "tpot_p50_ms": lone_tpot,
                         "requests": n_lone},
                   capacity={"req_s": capacity, "measured": not a.capacity,
                             "concurrency": a.concurrency, "requests": n_cap},
                   slo_ms=slo)
        _, adm = start_server(a, procs, "admission",
                                  ["--slo-ttft-ms", f"{slo['ttft']:.3f}",
                                   "--slo-tpot-ms", f"{slo['tpot']:.3f}"])
        send(adm, *warm, concurrency=1)
        res, _ = send(adm, *lone, concurrency=1)
        lone_refused = sum(is_refusal(r) for r in res)
        doc["admission_lone_refused"] = lone_refused
        if lone_refused:
            log(f"the admission server refused {lone_refused} of {n_lone} lone requests: "
                + "; ".join(r.error for r in res if is_refusal(r))[:400])
        for i, mult in enumerate(multiples):
            rate = mult * capacity
            specs, prompts = workload(random.Random(f"{seed}-{i}"), n_req, rate, lens,
                                      a.output_len, vocab)
            order = ["plain", "admission"] if i % 2 == 0 else ["admission", "plain"]
            row: dict[str, Any] = {"multiple": mult, "rate": rate, "order": order,
                                   "span_s": specs[-1].arrival}
            for arm in order:
                url = plain if arm == "plain" else adm
                log(f"rate {rate:.2f} req/s (x{mult:g} capacity): {arm}")
                row[arm] = run_arm(url, [plain, adm], specs, prompts, slo)
                f = row[arm]
                log(f"  {arm}: goodput {f['goodput']:.2f} req/s, {f['met_slo']}/{n_req} met "
                    f"the SLO, {f['refused']} refused, {f['other_failed']} other failures")
            p, q = row["plain"], row["admission"]
            row["ratios"] = {k: ratio(q[k], p[k]) for k in
                             ("goodput", "share_all", "share_admitted", "ttft_p99")}
            doc["rates"].append(row)
    finally:
        procs.stop_all()
    report(doc, n_req)
    a.results_dir.mkdir(parents=True, exist_ok=True)
    out = a.results_dir / ("admission-quick.json" if a.quick else "admission.json")
    out.write_text(json.dumps(doc, indent=1, allow_nan=True, default=str))
    print(f"\nresults written to {out}")
    return 0


def report(doc: dict[str, Any], n_req: int) -> None:
    slo, lone, cap = doc["slo_ms"], doc["lone"], doc["capacity"]
    print(f"\nlone request (plain server): TTFT p50 {lone['ttft_p50_ms']:.1f} ms, TPOT p50 "
          f"{lone['tpot_p50_ms']:.2f} ms; capacity {cap['req_s']:.2f} req/s "
          + (f"(closed loop at concurrency {cap['concurrency']})" if cap["measured"]
             else "(given)"))
    print(f"SLO: TTFT <= {slo['ttft']:.0f} ms and TPOT <= {slo['tpot']:.1f} ms (the admission "
          f"server's targets and what goodput counts); the admission server refused "
          f"{doc['admission_lone_refused']} lone request(s) in its warm-up")
    print(f"{n_req} requests per rate and server, prompts {doc['prompt_len'][0]}-"
          f"{doc['prompt_len'][1]} tokens, {doc['output_len']} out")
    head = (f"{'rate':>12}{'server':>11}{'goodput':>9}{'met/all':>9}{'refused':>9}"
            f"{'met/admit':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'other':>7}")
    print(head)
    for row in doc["rates"]:
        for arm in ("plain", "admission"):
            f = row[arm]
            rate = f"{row['rate']:.1f}/s x{row['multiple']:g}" if arm == "plain" else ""
            print(f"{rate:>12}{arm:>11}{f['goodput']:>9.2f}{f['share_all']:>9.1%}"
                  f"{f['refused']:>9}{f['share_admitted']:>11.1%}{f['ttft_p50']:>8.0f}ms"
                  f"{f['ttft_p99']:>8.0f}ms{f['tpot_p50']:>8.1f}ms{f['other_failed']:>7}")
        q, r = row["admission"], row["ratios"]
        by = ", ".join(f"{k} {v:g}" for k, v in sorted(q["refused_by_server"].items())) or "none"
        check = "" if sum(q["refused_by_server"].values()) == q["refused"] else (
            " (MISMATCH with the client's 429 count)")
        target = "met" if q["share_admitted"] >= 0.95 and r["goodput"] >= 1.0 else "missed"
        print(f"{'':>12}admission / plain: goodput {ratio_text(r['goodput'])}, met/all "
              f"{ratio_text(r['share_all'])}, TTFT p99 {ratio_text(r['ttft_p99'])}; refused by "
              f"the server's counter: {by}{check}; target (>= 95% of admitted met, goodput "
              f"not lower): {target}")
        if not q["refused"]:
            print(f"{'':>12}(no refusals: both servers ran alike, so this rate's ratios are "
                  "the run's noise)")
        for arm in ("plain", "admission"):
            f = row[arm]
            print(f"{'':>12}{arm}: of {f['completed']} completed, {f['missed_ttft']} over the "
                  f"TTFT target, {f['missed_tpot']} over the TPOT target")
            if f["other_errors"]:
                print(f"{'':>12}{arm} other errors: {'; '.join(f['other_errors'])[:300]}")
        pred = q["refused_predicted_ms"]
        said = [f"{len(v)} on {k.upper()}, predicted {min(v):.0f}-{max(v):.0f} ms (median "
                f"{statistics.median(v):.0f})" for k, v in pred.items() if v]
        if said:
            print(f"{'':>12}refusals: {'; '.join(said)}; the admitted got TPOT p50 "
                  f"{q['tpot_p50']:.1f} ms, p99 {q['tpot_p99']:.1f} ms")
    print(f"note: {NOISE}")


if __name__ == "__main__":
    sys.exit(main())
