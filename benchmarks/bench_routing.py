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

    python -m benchmarks.bench_routing [--model DIR] [--quick] [--policies ...]

Needs two cores (each replica is pinned to one). Every process is stopped by its process
group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import (BUNDLED_MODEL, PW, Procs, free_port, log, machine_info,
                                machine_line, wait_http)
from phasewise.bench.client import ClientConfig, run_workload
from phasewise.perf.summary import summarize
from phasewise.perf.workload import RequestSpec

HERE = Path(__file__).resolve().parent
POLICIES = ("prefix", "least-load", "round-robin")
SLO = {"ttft": 1000.0, "tpot": 100.0}  # ms: what the goodput column counts


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


def run_policy(a: argparse.Namespace, procs: Procs, policy: str,
               workloads: dict[str, tuple[list[RequestSpec], list[list[int]]]]
               ) -> dict[str, dict[str, Any]]:
    logs = a.results_dir / "logs"
    workers, started = [], []
    try:
        for core in (0, 1):
            port = free_port()
            cmd = [*PW, "serve", "--model", str(a.model), "--host", "127.0.0.1", "--port",
                   str(port), "--role", "both", "--log-interval", "0", "--no-access-log"]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            p = procs.start(f"replica-{core}", cmd, logs / f"{policy}-replica-{core}.log",
                            env=env, cpus=str(core))
            started.append(p)
            workers.append(f"http://127.0.0.1:{port}")
        for w in workers:
            wait_http(w + "/health", started, 600, f"replica {w}", None)
        rport = free_port()
        r = procs.start("router", [*PW, "router", "--model", str(a.model), "--decode", *workers,
                                   "--host", "127.0.0.1", "--port", str(rport), "--routing",
                                   policy, "--no-access-log"], logs / f"{policy}-router.log")
        started.append(r)
        url = f"http://127.0.0.1:{rport}"
        wait_http(url + "/health", started, 600, f"router ({policy})", None)
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
                         "failed": s["failed"]}
            log(f"  {policy} {name}: hit {out[name]['hit']:.1%}, TTFT p50 "
                f"{out[name]['ttft_p50']:.0f} ms, goodput {out[name]['goodput']:.2f} req/s")
        return out
    finally:
        for p in reversed(started):
            procs.stop(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    ap.add_argument("--quick", action="store_true", help="a few requests: a smoke test")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
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
    try:
        for policy in a.policies:
            log(f"policy {policy}: fresh replicas")
            rows[policy] = run_policy(a, procs, policy, workloads)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
