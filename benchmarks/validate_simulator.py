"""Hold ``phasewise simulate`` against the real engine on this machine.

1. Calibrate: ``phasewise calibrate`` on the model (2 threads, as the server runs), and a
   one-thread profile pinned to one core for the P/D workers (each runs on one core).
2. Per step: a grid of steps calibration never timed (other batches, contexts, chunks and
   mixes) run on the real engine, each against its predicted time.
3. Workloads calibration never saw (rates, lengths, intruders, burstiness, policies,
   budgets, and P/D): each through the real server under ``phasewise bench``, and through
   the simulator with the same requests (same seed). p50/p90 TTFT and TPOT and throughput,
   predicted against measured, with the error of each: once from the profile as calibrated,
   once from the served profile (``phasewise.bench.probe``: the live server, idle, probed
   right before each workload: its steps' drift since calibration and the cost of serving
   beyond the engine's steps). The targets are judged on the served one.

    python -m benchmarks.validate_simulator [--model DIR] [--quick] [--results-dir DIR]

``--quick`` runs a tiny random checkpoint through a small grid and two short workloads (a
smoke test of this script, minutes; its figures mean nothing). Every process it starts is
stopped by its process group. Needs the reference checkpoint
(``python -m benchmarks.make_reference_checkpoint``) unless ``--model`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
from benchmarks.harness import (PW, REFERENCE_MODEL, Procs, free_port, log,  # noqa: E402
                                machine_info, machine_line, make_link, probe_link, wait_http,
                                wait_peer)

from phasewise.bench.options import add_args as add_bench_args  # noqa: E402
from phasewise.bench.probe import probe  # noqa: E402
from phasewise.bench.run import main as bench_main  # noqa: E402
from phasewise.perf.workload import LengthDist, build_workload  # noqa: E402
from phasewise.perf.calibrate import (GridPoint, check_points, grid_engine,  # noqa: E402
                                       load_profile)
from phasewise.perf.models import ModelShape  # noqa: E402
from phasewise.perf.served import Served, ServedCostModel  # noqa: E402
from phasewise.perf.simulate import (Deployment, EngineSpec, kv_blocks_for,  # noqa: E402
                                      simulate)

REFERENCE = REFERENCE_MODEL
WAKE_ROUNDS = 4  # the idle-server probe's rounds, once per server
KV_MEMORY = 1 << 30  # the server's default pool on CPU
MAX_LEN = 4096


@dataclass
class Case:
    name: str
    input_len: str
    output_len: str
    num_prompts: int
    rate: float
    budget: int = 256
    policy: str = "chunked"
    burstiness: float = 1.0
    intruder_fraction: float = 0.0
    intruder_len: str = "1536"
    pd: bool = False
    # Each case its own seed: the bench cuts prompts from one corpus at offsets drawn from the
    # seed, so cases sharing a seed (and a server) would share prompt prefixes, and the
    # server's prefix cache would serve the later ones (the simulator's prompts share none).
    seed: int = 11

    @property
    def server(self) -> tuple[int, str, bool]:
        return self.budget, self.policy, self.pd

    def describe(self) -> str:
        intr = f" +{self.intruder_fraction:.0%} x {self.intruder_len}" \
            if self.intruder_fraction else ""
        burst = f", gamma {self.burstiness:g}" if self.burstiness != 1.0 else ""
        where = "P/D 1P:1D, 1 core each" if self.pd else f"{self.policy} b{self.budget}"
        return (f"{self.input_len}{intr} in / {self.output_len} out, {self.rate:g} req/s"
                f"{burst}, {self.num_prompts} req, {where}")


# Loads of 40-60% of this machine's capacity for each workload (a 256-token prompt takes ~2 s
# to prefill on 2 AVX2 cores): near saturation the real server's own run-to-run spread is
# larger than the targets (two runs of 256/64 at 0.25 req/s, ~95% busy, gave a median TPOT of
# 239 and 424 ms).
CASES = [
    Case("chat", "256", "64", 20, 0.12, seed=11),
    Case("short", "64", "32", 40, 0.5, seed=211),
    Case("long", "1024", "48", 7, 0.04, seed=311),
    Case("intruders", "128", "32", 30, 0.18, intruder_fraction=0.1, intruder_len="1024",
         seed=411),
    Case("prefill-first", "256", "64", 20, 0.12, policy="prefill-first", seed=511),
    Case("bursty-mixed", "uniform:32-768", "uniform:16-128", 15, 0.09, budget=512,
         burstiness=0.5, seed=611),
    Case("pd", "384", "64", 12, 0.08, pd=True, seed=711),
    # Two shapes none of the above has: long outputs (decode-heavy batches), and long
    # prompts cut by a small budget into many chunks.
    Case("long-out", "64", "uniform:128-256", 10, 0.06, seed=811),
    Case("small-budget", "uniform:256-768", "32", 14, 0.1, budget=128, seed=911),
]
QUICK_CASES = [Case("chat", "48", "16", 12, 4.0),
               Case("pd", "64", "16", 8, 2.0, pd=True, seed=12)]

HELD_OUT = [GridPoint(5, 300), GridPoint(10, 700), GridPoint(20, 1500), GridPoint(28, 3000),
            GridPoint(32, 2500), GridPoint(0, 0, 48, 0), GridPoint(0, 0, 96, 700),
            GridPoint(0, 0, 200, 1500), GridPoint(0, 0, 320, 200), GridPoint(0, 0, 400, 3000),
            GridPoint(3, 300, 48, 300), GridPoint(12, 1500, 200, 1500),
            GridPoint(24, 3000, 96, 3000), GridPoint(8, 800, 320, 800),
            GridPoint(20, 200, 160, 200)]
QUICK_HELD_OUT = [GridPoint(3, 100), GridPoint(0, 0, 40, 60), GridPoint(2, 90, 24, 90)]


# -- calibration and the per-step check ---------------------------------------------------
def longest_of(a: argparse.Namespace, points: list[GridPoint]) -> int:
    """A context that holds every one of ``points`` (within the model's)."""
    return min(max(max(p.decode_context, p.chunk_context + p.chunk) for p in points) + 8,
               a.model_len)


def calibrate(a: argparse.Namespace, procs: Procs, out: Path, threads: int,
              cpus: str | None, max_context: int) -> Path:
    if out.exists() and a.reuse_profiles:
        log(f"reusing {out}")
        return out
    cmd = [*PW, "calibrate", "--model", str(a.model), "--out", str(out), "--max-context",
           str(max_context)]
    if a.quick:
        cmd.append("--quick")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log(f"calibrating with {threads} thread(s){' on CPU ' + cpus if cpus else ''} -> {out}")
    t0 = time.monotonic()
    p = procs.start(f"calibrate-{threads}t", cmd, a.results_dir / "logs" /
                    f"calibrate-{threads}t.log", env=env, cpus=cpus)
    rc = p.wait()
    procs.stop(p)
    if rc != 0:
        raise RuntimeError(f"calibrate exited with {rc}; see {a.results_dir}/logs")
    log(f"  calibrated in {time.monotonic() - t0:.0f}s")
    return out


def held_out_steps(a: argparse.Namespace, profile: Path) -> list[dict[str, Any]]:
    """The held-out grid on the real engine (in this process, 2 threads), against the
    profile's predictions."""
    import random

    from phasewise.perf.calibrate import measure_point

    points = QUICK_HELD_OUT if a.quick else HELD_OUT
    engine = grid_engine(a.model, points, longest_of(a, points), 512 + 32)
    rng = random.Random(1)
    for _ in range(2):
        measure_point(engine, points[0], rng)
    measured = []
    for p in points:
        times = [measure_point(engine, p, rng) for _ in range(3)]
        measured.append((p, statistics.median(times)))
        log(f"  held-out {p.label():<34} {measured[-1][1] * 1e3:8.1f} ms")
    del engine
    gc.collect()
    cm = load_profile(profile, ModelShape.from_path(a.model))
    return check_points(cm, measured)


def interleaved_steps(a: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Calibration's grid and the held-out steps timed in the same rounds (each round in a
    fresh random order), the model fitted on the grid alone: the per-step check with the
    machine's drift between a calibration and a later check taken out (on a shared VM the
    same step's time drifts by 10-30% over tens of minutes)."""
    import random

    from phasewise.perf.attribution import engine_compute_dtype
    from phasewise.perf.calibrate import grid, measure_point, time_points
    from phasewise.perf.costmodel import fit
    from phasewise.perf.measure import ensure_local

    held = QUICK_HELD_OUT if a.quick else HELD_OUT
    budget = 128 + 32 if a.quick else 512 + 32
    max_len = min(a.model_len, MAX_LEN + budget)
    cal = grid(max_len, budget, a.quick)
    points = cal + [p for p in held if p not in cal]
    engine = grid_engine(a.model, points, max_len, budget)
    cdt = engine_compute_dtype(engine)
    accel = ensure_local("cpu", tuple(sorted({cdt(r) for r in (1, 16, 256, budget)})))
    rng = random.Random(2)
    for _ in range(2):
        measure_point(engine, held[0], rng)
    times = time_points(engine, points, 3, rng, log)
    del engine
    gc.collect()
    med = {p: statistics.median(t) for p, t in times.items()}
    cm = fit(ModelShape.from_path(a.model), accel, "bf16", [(p.mix(), med[p]) for p in cal],
             cdt)
    return check_points(cm, [(p, med[p]) for p in held]), cm.fit_report


# -- serving -----------------------------------------------------------------------------------
class Servers:
    def __init__(self, a: argparse.Namespace, procs: Procs) -> None:
        self.a, self.procs = a, procs
        self.logs = a.results_dir / "logs"
        self.secret = Path(tempfile.mkdtemp()) / "kv-secret"
        self.secret.write_bytes(os.urandom(32))
        self.secret.chmod(0o600)

    def serve_cmd(self, port: int, budget: int, policy: str, role: list[str]) -> list[str]:
        return [*PW, "serve", "--model", str(self.a.model), "--host", "127.0.0.1", "--port",
                str(port), "--max-model-len", str(min(MAX_LEN, self.a.model_len)),
                "--max-num-batched-tokens", str(budget), "--policy", policy,
                "--log-interval", "0", "--no-access-log", "--shutdown-grace", "2", *role]

    @contextlib.contextmanager
    def colocated(self, budget: int, policy: str):
        port = free_port()
        path = self.logs / f"serve-{policy}-b{budget}.log"
        p = self.procs.start("server", self.serve_cmd(port, budget, policy, []), path)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health", [p], 600, f"server ({policy}, b{budget})", path)
            yield url, [url]
        finally:
            self.procs.stop(p)

    @contextlib.contextmanager
    def pd(self, budget: int):
        env1 = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        kv = f"tcp://127.0.0.1:{free_port()}"
        dport, pport = free_port(), free_port()
        secret = ["--kv-secret-file", str(self.secret)]
        dlog, plog = self.logs / "pd-decode.log", self.logs / "pd-prefill.log"
        d = self.procs.start("decode", self.serve_cmd(dport, budget, "chunked", [
            "--role", "decode", "--kv-bind", kv, *secret]), dlog, env=env1, cpus="1")
        procs = [d]
        try:
            durl = f"http://127.0.0.1:{dport}"
            wait_http(durl + "/health", [d], 600, "decode worker", dlog)
            p = self.procs.start("prefill", self.serve_cmd(pport, budget, "chunked", [
                "--role", "prefill", "--kv-connect", kv, *secret]), plog, env=env1, cpus="0")
            procs.append(p)
            wait_http(f"http://127.0.0.1:{pport}/health", [d, p], 600, "prefill worker", plog)
            wait_peer(durl, [d, p], 120)
            yield durl, [durl, f"http://127.0.0.1:{pport}"]
        finally:
            for p in reversed(procs):
                self.procs.stop(p)


def warm_up(a: argparse.Namespace, url: str) -> None:
    """First requests pay for allocations and kernel builds: outside every figure."""
    tok = str(Path(a.model) / "tokenizer.json")
    warm_args = ["--base-url", url, "--num-prompts", "2", "--input-len", "32",
                 "--output-len", "4", "--tokenizer", tok, "--disable-tqdm", "--seed", "999"]
    with open(os.devnull, "w") as f, contextlib.redirect_stdout(f):
        bench_main(_bench_ns(warm_args))


def bench(a: argparse.Namespace, url: str, case: Case) -> dict[str, Any]:
    out = a.results_dir / "runs" / f"{case.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = str(Path(a.model) / "tokenizer.json")
    argv = ["--base-url", url, "--num-prompts", str(case.num_prompts), "--request-rate",
            str(case.rate), "--burstiness", str(case.burstiness), "--input-len",
            case.input_len, "--output-len", case.output_len, "--seed", str(case.seed),
            "--tokenizer", tok, "--label", case.name, "--result-file", str(out),
            "--disable-tqdm"]
    if case.intruder_fraction:
        argv += ["--intruder-fraction", str(case.intruder_fraction), "--intruder-len",
                 case.intruder_len]
    log(f"{case.name}: {case.describe()} -> the real server")
    t0 = time.monotonic()
    with open(a.results_dir / "runs" / f"{case.name}.txt", "w") as f, \
            contextlib.redirect_stdout(f):
        bench_main(_bench_ns(argv))
    r = json.loads(out.read_text())
    log(f"  {r['completed']} ok, {r['failed']} failed in {time.monotonic() - t0:.0f}s")
    return r


def _bench_ns(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    add_bench_args(p)
    return p.parse_args(argv)


def wake_probe(a: argparse.Namespace, profile: Path, url: str, metrics: list[str]
               ) -> dict[str, Any]:
    """What a request to an idle server pays, probed once per server with more rounds
    than the per-workload probe takes: it varies with what the machine's other tenants do
    while it idles, so two samples of it swing by 2x."""
    shape = ModelShape.from_path(a.model)
    rounds = 1 if a.quick else WAKE_ROUNDS
    served, _ = probe(url, load_profile(profile, shape), shape.vocab_size, metrics_urls=metrics,
                      repeats=rounds, seed=1, **_probe_sizes(a))
    short, long = served.wake_idle_s
    log(f"  wake-up ({rounds} rounds): +{(served.wake_s or 0) * 1e3:.1f} ms after {short:g} s "
        f"idle, +{(served.wake_long_s or 0) * 1e3:.1f} ms after {long:g} s")
    return {k: getattr(served, k) for k in ("wake_s", "wake_long_s", "wake_idle_s")}


def _probe_sizes(a: argparse.Namespace) -> dict[str, Any]:
    return ({"batch": 4, "prompt_len": 64, "output_len": 16, "prefill_len": 128}
            if a.quick else {})


def served_probe(a: argparse.Namespace, case: Case, profile: Path, url: str,
                 metrics: list[str], link: Any, wake: dict[str, Any]) -> Served:
    """The live server, idle, probed (``phasewise.bench.probe``): its steps as served now
    against the profile, with the server's ``wake`` figures (``wake_probe``). Under P/D the
    probe's TTFT beyond its prefill steps holds the K/V's bytes on the link, which the
    simulation counts itself: taken out of ``request_s``."""
    shape = ModelShape.from_path(a.model)
    cm = load_profile(profile, shape)
    served, _ = probe(url, cm, shape.vocab_size, metrics_urls=metrics, seed=case.seed,
                      idle_s=None, **_probe_sizes(a))
    served = dataclasses.replace(served, **wake)
    if case.pd and link is not None:
        plen = _probe_sizes(a).get("prefill_len", 512)
        wire = plen * cm.kv_bytes_per_token / link.bandwidth + link.latency_s
        served = dataclasses.replace(
            served, request_s=max(0.0, served.request_s - wire),
            request_busy_s=None if served.request_busy_s is None
            else max(0.0, served.request_busy_s - wire))
    return served


def simulated(a: argparse.Namespace, case: Case, profile: Path, link: Any,
              served: Served | None = None) -> dict[str, Any]:
    cm: Any = load_profile(profile, ModelShape.from_path(a.model))
    blocks = kv_blocks_for(cm, KV_MEMORY, 16)
    if served is not None:
        cm = ServedCostModel(cm, served)
    eng = EngineSpec(num_kv_blocks=blocks, max_num_batched_tokens=case.budget,
                     max_model_len=min(MAX_LEN, a.model_len), policy=case.policy)
    # P/D as calibrated: phasewise's own hand-off over loopback costs 12-35 ms beyond its
    # bytes' 1-11 ms (bench_disagg.py): ~15 ms fixed. As served, the probe measured it (in
    # request_s).
    handoff = 0.0 if served is not None else 0.015
    dep = Deployment("pd", link=link, handoff_s=handoff) if case.pd else Deployment()
    specs = build_workload(case.num_prompts, LengthDist.parse(case.input_len),
                           LengthDist.parse(case.output_len), request_rate=case.rate,
                           burstiness=case.burstiness, intruder_fraction=case.intruder_fraction,
                           intruder_len=LengthDist.parse(case.intruder_len), seed=case.seed)
    return simulate(cm, eng, dep, specs)


# -- where the TTFT error sits ---------------------------------------------------------------
IDLE_LONG = 5.0  # s: a request sent this long after the server's last request ended


def after_idle(result: dict[str, Any]) -> list[bool]:
    """Per request: sent to a server that had nothing in flight for ``IDLE_LONG`` or more
    (from the measured run's own send and end times)."""
    starts, lat = result["start_times"], result["latencies"]
    out = []
    for i, t in enumerate(starts):
        ends = [starts[j] + lat[j] for j in range(len(starts)) if j != i]
        busy = any(starts[j] <= t < starts[j] + lat[j] for j in range(len(starts)) if j != i)
        before = [e for e in ends if e <= t]
        out.append(not busy and (not before or t - max(before) >= IDLE_LONG))
    return out


def ttft_by_idle(a: argparse.Namespace, row: dict[str, Any], case: Case, profile: Path,
                 link: Any) -> str:
    """Measured against simulated TTFT (as served), median per request, for requests sent
    after ``IDLE_LONG`` idle and for the rest: where the error sits."""
    measured = json.loads((a.results_dir / "runs" / f"{case.name}.json").read_text())
    sim = simulated(a, case, profile, link, Served(**row["served"]))
    idle = after_idle(measured)
    parts = []
    for label, want in ((f"after >= {IDLE_LONG:g} s idle", True), ("the rest", False)):
        pairs = [(m, p) for m, p, i in zip(measured["ttfts"], sim["ttfts"], idle)
                 if i == want and m is not None and p is not None]
        if pairs:
            mm = statistics.median(m for m, _ in pairs)
            pp = statistics.median(p for _, p in pairs)
            parts.append(f"{label}: {mm * 1e3:.0f} / {pp * 1e3:.0f} ms ({err(pp, mm):+.0%}, "
                         f"{len(pairs)} req)")
    return "; ".join(parts)


# -- the tables ----------------------------------------------------------------------------------
METRICS = (("p50 TTFT", "median_ttft_ms", 0.15), ("p90 TTFT", "p90_ttft_ms", 0.25),
           ("p50 TPOT", "median_tpot_ms", 0.15), ("p90 TPOT", "p90_tpot_ms", 0.25),
           ("out tok/s", "output_throughput", None))


def err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


def workload_table(rows: list[dict[str, Any]], which: str = "predicted") -> str:
    head = f"{'workload':<14}" + "".join(f"{m[0] + ' meas/pred (err)':>30}" for m in METRICS)
    lines = [head]
    for row in rows:
        if which not in row:
            continue
        cells = []
        for label, key, target in METRICS:
            mv, pv = row["measured"][key], row[which][key]
            e = err(pv, mv)
            mark = "" if target is None else (" ok" if abs(e) <= target else " MISS")
            cells.append(f"{mv:>9.0f} / {pv:>7.0f} ({e:+6.1%}){mark:>5}"
                         if "TTFT" in label else f"{mv:>9.1f} / {pv:>7.1f} ({e:+6.1%}){mark:>5}")
        lines.append(f"{row['case']:<14}" + "".join(f"{c:>30}" for c in cells))
    return "\n".join(lines)


def _modes(m: dict[str, Any] | None) -> str:
    if not m:
        return "one mode"
    return (f"{1 - m['high_share']:.0%} near {m['low_ms']:.1f} ms, {m['high_share']:.0%} near "
            f"{m['high_ms']:.1f} ms")


def step_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'step':<36}{'kind':<9}{'measured':>10}{'predicted':>11}{'error':>9}"]
    for r in rows:
        lines.append(f"{r['point']:<36}{r['kind']:<9}{r['measured_s'] * 1e3:>8.1f}ms"
                     f"{r['predicted_s'] * 1e3:>9.1f}ms{r['error']:>+9.1%}"
                     + ("" if abs(r["error"]) <= 0.10 else "  MISS"))
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(abs(r["error"]))
    for kind, errs in by_kind.items():
        lines.append(f"  {kind}: {sum(e <= 0.10 for e in errs)}/{len(errs)} within 10%, "
                     f"median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results" / "simulator")
    ap.add_argument("--reuse-profiles", action="store_true",
                    help="use the profiles a previous run left in the results folder")
    ap.add_argument("--only", nargs="+", default=None, help="run these workloads only")
    ap.add_argument("--skip-steps", action="store_true",
                    help="no per-step check (the workloads only)")
    ap.add_argument("--steps-only", action="store_true",
                    help="only the per-step check, with the grid and the held-out steps timed "
                    "in the same rounds (no servers)")
    a = ap.parse_args(argv)
    a.results_dir.mkdir(parents=True, exist_ok=True)
    if a.model is None:
        if a.quick:
            from phasewise.model.tiny import make_tiny_checkpoint

            a.model = Path(make_tiny_checkpoint(a.results_dir / "tiny-model", num_layers=2,
                                                dtype="bfloat16"))
        else:
            a.model = REFERENCE
    if not (a.model / "config.json").exists():
        raise SystemExit(f"no checkpoint at {a.model}: run python -m "
                         "benchmarks.make_reference_checkpoint, or give --model")
    shape = ModelShape.from_path(a.model)
    a.model_len = shape.max_position_embeddings or MAX_LEN
    m = machine_info()
    print(machine_line(m))
    cases = QUICK_CASES if a.quick else CASES
    if a.only:
        cases = [c for c in cases if c.name in a.only]
    procs = Procs()
    report: dict[str, Any] = {"machine": m, "model": str(a.model), "cases": [],
                              "steps": []}
    if a.steps_only:
        rows, fr = interleaved_steps(a)
        print(f"\n== per step, interleaved with calibration (fit over {fr['points']} grid "
              f"steps: median error {fr['median_abs_rel_err']:.1%}) ==")
        print(step_table(rows))
        (a.results_dir / "steps-interleaved.json").write_text(json.dumps(
            {"machine": m, "steps": rows, "fit": fr}, indent=1))
        return 0
    try:
        p2 = calibrate(a, procs, a.results_dir / "profile-2t.json", 2, None, MAX_LEN)
        p1 = None
        if any(c.pd for c in cases):
            ctx = 1024 if not a.quick else 256
            p1 = calibrate(a, procs, a.results_dir / "profile-1t.json", 1, "0", ctx)
        if not (a.only or a.skip_steps):
            log("per-step check on steps calibration never timed")
            report["steps"] = held_out_steps(a, p2)
            print("\n== per step: predicted against measured (2 threads) ==")
            print(step_table(report["steps"]))
        servers = Servers(a, procs)
        link = None
        if any(c.pd for c in cases):
            probe_ = probe_link(procs, "127.0.0.1", a.results_dir / "logs" / "probe.log")
            link = make_link("loopback", "loopback (measured)", probe_, probe_["rtt_s"] / 2)
            report["link"] = {"bandwidth_Bps": link.bandwidth, "latency_s": link.latency_s}
        for key in dict.fromkeys(c.server for c in cases):
            budget, policy, pd = key
            group = [c for c in cases if c.server == key]
            ctx = servers.pd(budget) if pd else servers.colocated(budget, policy)
            with ctx as (url, metrics):
                warm_up(a, url)
                wake = wake_probe(a, p1 if pd else p2, url, metrics)
                for case in group:
                    profile = p1 if case.pd else p2
                    served = served_probe(a, case, profile, url, metrics, link, wake)
                    log(f"  {served.describe()}")
                    measured = bench(a, url, case)
                    pred = simulated(a, case, profile, link)
                    now = simulated(a, case, profile, link, served)
                    row = {"case": case.name, "describe": case.describe(),
                           "profile": str(profile),
                           "at": time.strftime("%H:%M"), "served": served.to_dict(),
                           "measured": {k: measured[k] for _, k, _ in METRICS},
                           "predicted": {k: pred[k] for _, k, _ in METRICS},
                           "predicted_served": {k: now[k] for _, k, _ in METRICS},
                           "modes": {"measured": measured.get("tpot_modes"),
                                     "predicted_served": now.get("tpot_modes")},
                           "failed": measured["failed"]}
                    report["cases"].append(row)
                    log("  " + "  ".join(f"{lbl} {row['measured'][k]:.1f}/"
                                         f"{row['predicted_served'][k]:.1f}"
                                         for lbl, k, _ in METRICS))
    finally:
        procs.stop_all()
        path = a.results_dir / "validation.json"
        if a.only and path.exists():  # keep the cases this run did not repeat
            old = json.loads(path.read_text())
            mine = {c["case"] for c in report["cases"]}
            report["cases"] = [c for c in old.get("cases", []) if c["case"] not in mine] \
                + report["cases"]
            report["steps"] = report["steps"] or old.get("steps", [])
        path.write_text(json.dumps(report, indent=1))
    print("\n== workloads: measured (phasewise bench on the real server) / predicted "
          "(phasewise simulate), error; targets: p50 within 15%, p90 within 25% ==")
    for row in report["cases"]:
        print(f"  {row['case']:<14}{row['describe']}")
    print(workload_table(report["cases"]))
    print("\n== the same, simulated with the served profile each case probed right before it "
          "ran (its steps' drift from calibration: prefill x / decode x) ==")
    for r in report["cases"]:
        if "served" in r:
            sv = {**r["served"], "source": ""}
            print(f"  {r['case']:<14}{Served(**sv).describe().removeprefix('served: ')}")
    print(workload_table(report["cases"], "predicted_served"))
    hits = sum(1 for r in report["cases"] if "predicted_served" in r
               for _, k, t in METRICS if t is not None
               and abs(err(r["predicted_served"][k], r["measured"][k])) <= t)
    cells = 4 * sum(1 for r in report["cases"] if "predicted_served" in r)
    print(f"targets met: {hits} of {cells} cells")
    by_name = {c.name: c for c in cases}
    for r in report["cases"]:
        if "served" in r and r["case"] in by_name and "profile" in r:
            print(f"  TTFT measured / simulated, {r['case']}: "
                  + ttft_by_idle(a, r, by_name[r["case"]], Path(r["profile"]), link))
    for r in report["cases"]:
        m = r.get("modes") or {}
        if m.get("measured") or m.get("predicted_served"):
            print(f"  TPOT modes, {r['case']}: measured {_modes(m.get('measured'))}; "
                  f"simulated {_modes(m.get('predicted_served'))}")
    print(f"\nfull results: {a.results_dir / 'validation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
