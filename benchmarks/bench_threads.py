"""Decode speed at each thread count, on the machine as it is and beside busy processes.

Every phasewise CPU kernel splits its work between the threads and waits for the last of
them at its end. When another process takes one of the cores, the thread that loses it holds
up the others at every kernel, so running fewer threads than cores can be faster. This script
measures that, for ``--threads`` (``EngineConfig.num_threads``) to be advised on evidence.

For each condition, "quiet" (the machine as it is) and "busy" (``--hogs`` busy Python loops,
default 1, each pinned to a core: ``harness.cpu_hogs``), and each thread count from the cores
this process may use down to 1, a fresh process loads the model (the bundled one unless
``--model``) with that ``num_threads``, decodes a few tokens to warm up, then ``--rounds``
times decodes ``--tokens`` greedy tokens of a short prompt alone (batch 1). Printed: each
run's median TPOT (the engine's own, ``RequestMetrics.tpot``), and per condition the ratio of
the all-cores TPOT to each count's: above 1, that count decoded faster.

    .venv/bin/python -m benchmarks.bench_threads [--model DIR] [--rounds 5] [--tokens 64]
                                                 [--hogs 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import REPO, cpu_hogs, log, print_machine
from phasewise.config import usable_cores

NOISE = ("figures measured on a shared machine: other tenants move them by 5-30% from run to "
         "run; compare the ratios within this run, not absolute figures across runs")


def child(model: str | None, threads: int, rounds: int, tokens: int) -> None:
    """One engine at ``threads`` threads: prints the TPOT (s) of each round as JSON."""
    from phasewise import LLM, SamplingParams

    llm = LLM(model, num_threads=threads) if model else LLM(num_threads=threads)
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(["def warm_up():"], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))
    tpots = [llm.generate(["import os\n\ndef main():"], greedy)[0].metrics.tpot
             for _ in range(rounds)]
    print(json.dumps({"threads": threads, "tpot_s": tpots}), flush=True)


def run_child(a: argparse.Namespace, threads: int) -> list[float]:
    cmd = [sys.executable, "-m", "benchmarks.bench_threads", "--child", str(threads),
           "--rounds", str(a.rounds), "--tokens", str(a.tokens)]
    if a.model:
        cmd += ["--model", a.model]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"the {threads}-thread run failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["tpot_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled)")
    ap.add_argument("--rounds", type=int, default=5, help="timed generations per run")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each generation decodes")
    ap.add_argument("--hogs", type=int, default=1, help="busy loops in the busy condition")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        child(a.model, a.child, a.rounds, a.tokens)
        return
    print_machine()
    print(NOISE, file=sys.stderr)
    cores = usable_cores()
    counts = list(range(cores, 0, -1))
    results: dict[str, dict[int, float]] = {}
    for condition in ("quiet", "busy"):
        results[condition] = {}
        if condition == "busy":
            hogs = cpu_hogs(a.hogs)
            hogs.__enter__()
        try:
            for t in counts:
                log(f"{condition}: {t} thread{'s' * (t != 1)}")
                tpots = run_child(a, t)
                med = statistics.median(tpots)
                results[condition][t] = med
                spread = f"{min(tpots) * 1e3:.2f}-{max(tpots) * 1e3:.2f}"
                print(f"{condition:5} threads {t}: TPOT median {med * 1e3:7.2f} ms "
                      f"[{spread} over {len(tpots)} rounds]", flush=True)
        finally:
            if condition == "busy":
                hogs.__exit__(None, None, None)
    print()
    for condition, by in results.items():
        ratios = ", ".join(f"{t} thread{'s' * (t != 1)} x{by[cores] / by[t]:.2f}"
                           for t in counts if t != cores)
        what = (f"beside {a.hogs} busy loop{'s' * (a.hogs != 1)}" if condition == "busy"
                else "the machine as it is")
        print(f"{condition} ({what}): all {cores} threads' TPOT / each count's: "
              f"{ratios or '(one core: nothing to compare)'}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
