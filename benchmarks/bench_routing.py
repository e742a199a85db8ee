"""Routing policies behind ``phasewise router``: two ``--role both`` replicas, one core each,
under each ``--routing`` policy in turn (fresh replicas for each, so no policy inherits
another's cache), on two workloads:

* ``shared``: multi-turn chats over a few long system prompts. Each conversation's turns
  arrive in order, each prompt the system prompt, the turns so far and a new message: most
  of every prompt is a prefix some replica computed before (a prefix-heavy workload);
* ``independent``: prompts that share nothing (where routing by cache cannot help).

Per policy and workload: the fleet's prefix hit rate (the servers' own ``cached_tokens``
over the prompt tokens), TTFT p50/p99, TPOT p50, goodput under a TTFT + TPOT SLO, and the
router's expected hit rate, all from one run of each; then each policy's figures as ratios
to least-load's, measured in the same run.

``--kill``: a fault phase after those runs. For each policy, fresh replicas again and the
``shared`` workload again; once half its requests have been sent, the router's next stream
to replica 0 is awaited (up to ``KILL_WAIT_S``), and about one first token's time later (the
policy's unkilled TTFT p50) replica 0 is killed (SIGKILL, by its PID).
The router migrates its streams to replica 1. Per policy: failed streams (target 0),
requests completed, the router's ``phasewise:router_migrations_total`` by reason and
``phasewise:router_migrations_failed_total`` (scraped before the router stops), the streams
its access log marks ``moved=``, TTFT p50/p99, and the migration's spike: the largest gap
between two tokens of any stream in the killed run against the largest of the same policy's
unkilled ``shared`` run, both from this run.

    python -m benchmarks.bench_routing [--model DIR] [--quick] [--policies ...] [--kill]

Needs two cores (each replica is pinned to one). Every process is stopped by its process
group (the killed replica is reaped the same way). Results: ``routing.json`` (``--quick``:
``routing-quick.json``) in ``--results-dir``, with the logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import (BUNDLED_MODEL, PW, Procs, free_port, log, machine_info,
                                machine_line, wait_http)
from phasewise.bench.client import ClientConfig, run_workload
from phasewise.perf.summary import RequestResult, summarize
from phasewise.perf.workload import RequestSpec

HERE = Path(__file__).resolve().parent
POLICIES = ("prefix", "least-load", "round-robin")
SLO = {"ttft": 1000.0, "tpot": 100.0}  # ms: what the goodput column counts
# Seconds the fault phase waits, past the workload's half, for a new stream on replica 0: a
# kill that finds none running tests routing around a dead worker, not migration.
KILL_WAIT_S = 10.0


def shared_workload(rng: random.Random, systems: int, chats: int, turns: int, rate: float,
                    system_len: int, turn_len: int, vocab: int
                    ) -> tuple[list[RequestSpec], list[list[int]]]:
    """Chats over ``systems`` system prompts: turn t of a chat is its system prompt, its
    earlier turns and a new message; a chat's turns arrive in order, the chats interleaved
    (Poisson at ``rate`` over all turns)."""
    def text(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    sys_prompts = [text(system_len) for _ in range(systems)]
    pending = []
    for c in range(chats):
        history = list(sys_prompts[c % systems])
        convo = []
        for _ in range(turns):
            history = history + text(turn_len)
            convo.append(list(history))
            history = history + text(turn_len // 2)  # the reply, as the next turn sends it
        pending.append(convo)
    order = [c for c in range(chats) for _ in range(turns)]
    rng.shuffle(order)  # which chat speaks next; each chat's turns stay in order
    nxt = [0] * chats
    specs, prompts, t = [], [], 0.0
    for c in order:
        t += rng.expovariate(rate)
        p = pending[c][nxt[c]]
        nxt[c] += 1
        specs.append(RequestSpec(len(specs), t, len(p), 16))
        prompts.append(p)
    return specs, prompts


def independent_workload(rng: random.Random, n: int, rate: float, length: int, vocab: int
                         ) -> tuple[list[RequestSpec], list[list[int]]]:
    specs, prompts, t = [], [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        p = [rng.randrange(100, vocab - 100) for _ in range(length)]
        specs.append(RequestSpec(i, t, length, 16))
        prompts.append(p)
    return specs, prompts


def router_metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.startswith("phasewise:router_prompt_blocks"):
                out[s.labels["kind"]] = s.value
    return out


def migration_metrics(url: str) -> dict[str, Any]:
    """The router's migrations so far: {"by_reason": {reason: n}, "failed": n}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"by_reason": {}, "failed": None}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "phasewise:router_migrations_total":
                out["by_reason"][s.labels.get("reason", "")] = s.value
            elif s.name == "phasewise:router_migrations_failed_total":
                out["failed"] = s.value
    return out


async def worker_gauges(client: httpx.AsyncClient, router_url: str, worker_url: str
                        ) -> dict[str, float]:
    """The router's view of one worker: requests routed to it so far (``routed``) and
    streams it relays from it now (``in_flight``). Read line by line, not parsed whole: the
    kill waits on it, so it must be quicker than a stream."""
    out = {"routed": 0.0, "in_flight": 0.0}
    text = (await client.get(router_url + "/metrics", timeout=5)).text
    label = f'url="{worker_url}"'
    for line in text.splitlines():
        if label not in line:
            continue
        if line.startswith("phasewise:router_requests_routed_total{"):
            out["routed"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("phasewise:router_worker_in_flight{"):
            out["in_flight"] = float(line.rsplit(" ", 1)[1])
    return out


def start_fleet(a: argparse.Namespace, procs: Procs, policy: str, tag: str,
                access_log: bool = False) -> tuple[list[subprocess.Popen], list[str], str]:
    """Two fresh ``--role both`` replicas (one core each) and a router over them, once all
    answer /health: the processes (replicas first, the router last), the replicas' URLs and
    the router's."""
    logs = a.results_dir / "logs"
    workers: list[str] = []
    started: list[subprocess.Popen] = []
    try:
        for core in (0, 1):
            port = free_port()
            cmd = [*PW, "serve", "--model", str(a.model), "--host", "127.0.0.1", "--port",
                   str(port), "--role", "both", "--log-interval", "0", "--no-access-log"]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            p = procs.start(f"replica-{core}", cmd, logs / f"{tag}-replica-{core}.log",
                            env=env, cpus=str(core))
            started.append(p)
            workers.append(f"http://127.0.0.1:{port}")
        for w in workers:
            wait_http(w + "/health", started, 600, f"replica {w}", None)
        rport = free_port()
        r = procs.start("router", [*PW, "router", "--model", str(a.model), "--decode", *workers,
                                   "--host", "127.0.0.1", "--port", str(rport), "--routing",
                                   policy, *([] if access_log else ["--no-access-log"])],
                        logs / f"{tag}-router.log")
        started.append(r)
        url = f"http://127.0.0.1:{rport}"
        wait_http(url + "/health", started, 600, f"router ({tag})", None)
    except BaseException:
        for p in reversed(started):
            procs.stop(p)
        raise
    return started, workers, url


def max_gap_ms(results: list[RequestResult]) -> float:
    """The largest gap between two token-carrying chunks of any stream, in ms."""
    return max((g for r in results for g in r.itls), default=0.0) * 1e3


def run_policy(a: argparse.Namespace, procs: Procs, policy: str,
               workloads: dict[str, tuple[list[RequestSpec], list[list[int]]]]
               ) -> dict[str, dict[str, Any]]:
    started, _, url = start_fleet(a, procs, policy, policy)
    try:
        out = {}
        for name, (specs, prompts) in workloads.items():
            before = router_metrics(url)
            cfg = ClientConfig(base_url=url)
            results, duration = asyncio.run(run_workload(cfg, specs, prompts))
            after = router_metrics(url)
            s = summarize(results, duration, SLO)
            ok = [x for x in results if x.success]
            cached = sum(x.cached_tokens or 0 for x in ok)
            prompt = sum(x.prompt_len for x in ok)
            routed = after.get("routed", 0) - before.get("routed", 0)
            expected = after.get("expected_hit", 0) - before.get("expected_hit", 0)
            out[name] = {"hit": cached / prompt if prompt else 0.0,
                         "expected_hit": expected / routed if routed else 0.0,
                         "ttft_p50": s["median_ttft_ms"], "ttft_p99": s["p99_ttft_ms"],
                         "tpot_p50": s["median_tpot_ms"], "goodput": s["request_goodput"],
                         "failed": s["failed"], "max_gap_ms": max_gap_ms(results)}
            log(f"  {policy} {name}: hit {out[name]['hit']:.1%}, TTFT p50 "
                f"{out[name]['ttft_p50']:.0f} ms, goodput {out[name]['goodput']:.2f} req/s")
        return out
    finally:
        for p in reversed(started):
            procs.stop(p)


async def kill_midway(victim: subprocess.Popen, router_url: str, victim_url: str, at_s: float,
                      delay_s: float, t0: float) -> dict[str, Any]:
    """SIGKILL ``victim`` by its PID mid-stream: from ``at_s`` seconds after ``t0``, wait for
    the router to send it a new request (up to ``KILL_WAIT_S``), then ``delay_s`` more (about
    a first token's time, so the stream has begun), then kill. A stream already running at
    ``at_s`` may end before any poll could see it, so only a new one is waited for."""
    polls: list[float] = []
    async with httpx.AsyncClient() as client:
        await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
        first = await worker_gauges(client, router_url, victim_url)
        deadline = time.monotonic() + KILL_WAIT_S
        now = first
        while now["routed"] <= first["routed"] and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
            t = time.monotonic()
            now = await worker_gauges(client, router_url, victim_url)
            polls.append(time.monotonic() - t)
    new = now["routed"] > first["routed"]
    if new:
        await asyncio.sleep(delay_s)
    os.kill(victim.pid, signal.SIGKILL)
    return {"at_s": time.monotonic() - t0, "new_stream_seen": new,
            "in_flight_seen": now["in_flight"], "delay_ms": delay_s * 1e3 if new else 0.0,
            "poll_ms_p50": statistics.median(polls) * 1e3 if polls else None,
            "pid": victim.pid}


def run_kill(a: argparse.Namespace, procs: Procs, policy: str,
             workload: tuple[list[RequestSpec], list[list[int]]], delay_s: float
             ) -> dict[str, Any]:
    """The ``shared`` workload on fresh replicas, replica 0 killed half-way (module doc),
    ``delay_s`` after the router sends it a stream."""
    specs, prompts = workload
    tag = f"{policy}-kill"
    started, workers, url = start_fleet(a, procs, policy, tag, access_log=True)
    victim = started[0]
    try:
        half = specs[len(specs) // 2 - 1].arrival  # the moment half the requests are sent

        async def both() -> tuple[list[RequestResult], float, dict[str, Any]]:
            t0 = time.monotonic()
            (results, duration), kill = await asyncio.gather(
                run_workload(ClientConfig(base_url=url), specs, prompts),
                kill_midway(victim, url, workers[0], half, delay_s, t0))
            return results, duration, kill

        results, duration, kill = asyncio.run(both())
        kill["returncode"] = victim.wait(30)
        moves = migration_metrics(url)
    finally:
        for p in reversed(started):
            procs.stop(p)  # the killed replica: reaped, and its group cleared
    s = summarize(results, duration, SLO)
    router_log = (a.results_dir / "logs" / f"{tag}-router.log").read_text(errors="replace")
    out = {"requests": len(results), "completed": s["completed"], "failed": s["failed"],
           "errors": sorted({r.error for r in results if r.error})[:5],
           "migrations": moves["by_reason"], "migrations_failed": moves["failed"],
           "moved_in_access_log": router_log.count(" moved="),
           "max_gap_ms": max_gap_ms(results), "ttft_p50": s["median_ttft_ms"],
           "ttft_p99": s["p99_ttft_ms"], "tpot_p50": s["median_tpot_ms"], "kill": kill}
    log(f"  {policy} killed: {out['failed']} failed, {sum(out['migrations'].values()):g} "
        f"migrated, largest gap {out['max_gap_ms']:.0f} ms (replica 0 killed at "
        f"t={kill['at_s']:.1f}s, {kill_words(kill)})")
    return out


def kill_words(kill: dict[str, Any]) -> str:
    if not kill["new_stream_seen"]:
        return f"no new stream routed to it within {KILL_WAIT_S:g}s"
    poll = "" if kill["poll_ms_p50"] is None else f", seen by a {kill['poll_ms_p50']:.0f} ms poll"
    return (f"{kill['delay_ms']:.0f} ms after the router sent it a stream{poll}; "
            f"{kill['in_flight_seen']:g} in flight then")


def print_kill(rows: dict[str, dict[str, dict[str, Any]]],
               kills: dict[str, dict[str, Any]]) -> None:
    print("\nfault: shared workload again on fresh replicas, replica 0 SIGKILLed once half "
          "the requests were sent")
    print(f"{'policy':<13}{'failed':>7}{'done':>6}{'migrated (by reason)':>34}{'mig fail':>9}"
          f"{'moved=':>7}{'max gap':>10}{'unkilled':>10}{'spike':>8}{'TTFT p50':>10}"
          f"{'TTFT p99':>10}")
    for policy, k in kills.items():
        by = " ".join(f"{r}:{n:g}" for r, n in k["migrations"].items() if n) or "none"
        base = rows[policy]["shared"]["max_gap_ms"]
        spike = f"x{k['max_gap_ms'] / base:.1f}" if base else "n/a"
        failed = "-" if k["migrations_failed"] is None else f"{k['migrations_failed']:g}"
        print(f"{policy:<13}{k['failed']:>7}{k['completed']:>6}{by:>34}{failed:>9}"
              f"{k['moved_in_access_log']:>7}{k['max_gap_ms']:>8.0f}ms{base:>8.0f}ms"
              f"{spike:>8}{k['ttft_p50']:>8.0f}ms{k['ttft_p99']:>8.0f}ms")
    for policy, k in kills.items():
        kill = k["kill"]
        print(f"  {policy}: replica 0 (pid {kill['pid']}) killed at t={kill['at_s']:.1f}s, "
              f"{kill_words(kill)}; exit status {kill['returncode']}"
              + (f"; errors: {'; '.join(k['errors'])[:300]}" if k["errors"] else ""))
        if not sum(k["migrations"].values()):
            print(f"  {policy}: nothing was migrated: the kill found no stream of replica 0 "
                  "unfinished (its streams ended first)")
    base = kills.get("least-load")
    if base:
        for policy, k in kills.items():
            if policy != "least-load":
                print(f"  {policy} / least-load (killed runs): TTFT p50 "
                      f"x{k['ttft_p50'] / base['ttft_p50']:.2f}, TTFT p99 "
                      f"x{k['ttft_p99'] / base['ttft_p99']:.2f}")
    print("spike: the killed run's largest gap between two tokens of a stream over the "
          "unkilled shared run's, same policy, this run")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    ap.add_argument("--quick", action="store_true", help="a few requests: a smoke test")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--kill", action="store_true",
                    help="then, per policy, the shared workload again with replica 0 killed "
                    "half-way (migration)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--results-dir", type=Path, default=HERE / "results" / "routing")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 30)
    m = machine_info()
    print(machine_line(m))
    print(f"seed {seed}")
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    if a.quick:
        shared = shared_workload(rng, 2, 4, 3, 4.0, 128, 32, vocab)
        indep = independent_workload(rng, 8, 4.0, 200, vocab)
    else:
        shared = shared_workload(rng, 4, 24, 5, 3.0, 512, 64, vocab)
        indep = independent_workload(rng, 80, 3.0, 600, vocab)
    workloads = {"shared": shared, "independent": indep}
    for name, (specs, prompts) in workloads.items():
        lens = [len(p) for p in prompts]
        print(f"{name}: {len(specs)} requests, prompts {min(lens)}-{max(lens)} tokens "
              f"(median {statistics.median(lens):.0f}), 16 out, over "
              f"{specs[-1].arrival:.0f} s")
    procs = Procs()
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    kills: dict[str, dict[str, Any]] = {}
    try:
        for policy in a.policies:
            log(f"policy {policy}: fresh replicas")
            rows[policy] = run_policy(a, procs, policy, workloads)
        for policy in a.policies if a.kill else ():
            log(f"policy {policy}: fresh replicas, replica 0 killed half-way")
            # about one first token's wait: the victim's new stream has begun by then
            delay = min(rows[policy]["shared"]["ttft_p50"], 1000.0) / 1e3
            kills[policy] = run_kill(a, procs, policy, shared, delay)
    finally:
        procs.stop_all()
    print(f"\nSLO for goodput: TTFT <= {SLO['ttft']:g} ms and TPOT <= {SLO['tpot']:g} ms")
    head = (f"{'workload':<12}{'policy':<13}{'fleet hit':>10}{'expected':>10}{'TTFT p50':>10}"
            f"{'TTFT p99':>10}{'TPOT p50':>10}{'goodput':>9}{'failed':>8}")
    print(head)
    for name in workloads:
        for policy, res in rows.items():
            r = res[name]
            print(f"{name:<12}{policy:<13}{r['hit']:>10.1%}{r['expected_hit']:>10.1%}"
                  f"{r['ttft_p50']:>8.0f}ms{r['ttft_p99']:>8.0f}ms{r['tpot_p50']:>8.1f}ms"
                  f"{r['goodput']:>9.2f}{r['failed']:>8}")
        base = rows.get("least-load", {}).get(name)
        if base:
            for policy, res in rows.items():
                if policy == "least-load":
                    continue
                r = res[name]
                print(f"  {policy} / least-load: TTFT p50 x{r['ttft_p50'] / base['ttft_p50']:.2f}"
                      f", TTFT p99 x{r['ttft_p99'] / base['ttft_p99']:.2f}, goodput "
                      f"x{r['goodput'] / base['goodput'] if base['goodput'] else float('nan'):.2f}")
    if kills:
        print_kill(rows, kills)
    a.results_dir.mkdir(parents=True, exist_ok=True)
    out = a.results_dir / ("routing-quick.json" if a.quick else "routing.json")
    out.write_text(json.dumps({"machine": m, "seed": seed, "model": str(a.model), "slo_ms": SLO,
                               "policies": rows, "kill": kills}, indent=1, allow_nan=True))
    print(f"\nresults written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
