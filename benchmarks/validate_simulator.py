"""Hold ``phasewise simulate`` against the real engine on this machine.

1. Calibrate: ``phasewise calibrate`` on the model (2 threads, as the server runs), and a
   one-thread profile pinned to one core for the P/D workers (each runs on one core).
2. Per step: a grid of steps calibration never timed (other batches, contexts, chunks and
   mixes) run on the real engine, each against its predicted time.
3. Workloads calibration never saw (rates, lengths, intruders, burstiness, policies,
   budgets, and P/D): each through the real server under ``phasewise bench``, and through
   the simulator with the same requests (same seed). p50/p90 TTFT and TPOT and throughput,
   predicted against measured, with the error of each.

    python -m benchmarks.validate_simulator [--model DIR] [--quick] [--results-dir DIR]

``--quick`` runs a tiny random checkpoint through a small grid and two short workloads (a
smoke test of this script, minutes; its figures mean nothing). Every process it starts is
stopped by its process group. Needs the reference checkpoint
(``python -m benchmarks.make_reference_checkpoint``) unless ``--model`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
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
from phasewise.bench.run import main as bench_main  # noqa: E402
from phasewise.perf.workload import LengthDist, build_workload  # noqa: E402
from phasewise.perf.calibrate import (GridPoint, check_points, grid_engine,  # noqa: E402
                                       load_profile)
from phasewise.perf.models import ModelShape  # noqa: E402
from phasewise.perf.simulate import (Deployment, EngineSpec, kv_blocks_for,  # noqa: E402
                                      simulate)

REFERENCE = REFERENCE_MODEL
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


# Steps re-timed right before each workload (in this process, with the server idle): their
# measured time over the profile's prediction is how much faster or slower the machine runs
# now than when it was calibrated. A shared VM drifts by 10-30% over tens of minutes; each row
# shows the prediction as calibrated and the same simulation at today's speed.
ANCHORS = [GridPoint(1, 128), GridPoint(4, 512), GridPoint(16, 1024), GridPoint(0, 0, 128, 0),
           GridPoint(0, 0, 256, 512), GridPoint(4, 128, 64, 128)]
QUICK_ANCHORS = [GridPoint(1, 64), GridPoint(0, 0, 32, 0)]


class Anchors:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.engine: Any = None

    def drift(self, profile: Path, threads: int) -> float:
        """Median over the anchor steps of measured / predicted, on ``threads`` threads (one
        thread: on CPU 0, as the P/D prefill worker)."""
        import random

        import torch

        from phasewise.perf.calibrate import measure_point

        points = QUICK_ANCHORS if self.a.quick else ANCHORS
        if self.engine is None:
            self.engine = grid_engine(self.a.model, points, longest_of(self.a, points),
                                      512 + 32)
        cm = load_profile(profile, ModelShape.from_path(self.a.model))
        old_threads, old_cpus = torch.get_num_threads(), os.sched_getaffinity(0)
        torch.set_num_threads(threads)
        if threads == 1:
            os.sched_setaffinity(0, {0})
        try:
            rng = random.Random(3)
            measure_point(self.engine, points[0], rng)
            ratios = []
            for p in points:
                t = statistics.median(measure_point(self.engine, p, rng) for _ in range(3))
                m = p.mix()
                ratios.append(t / cm.step_time(m.chunks, m.decodes))
        finally:
            torch.set_num_threads(old_threads)
            os.sched_setaffinity(0, old_cpus)
        return statistics.median(ratios)


class Scaled:
    """A cost model whose every step takes ``factor`` times as long."""

    def __init__(self, cm: Any, factor: float) -> None:
        self.cm, self.factor = cm, factor
        self.kv_bytes_per_token = cm.kv_bytes_per_token
        self.source = f"{cm.source}, x{factor:.3f}"

    def step_time(self, chunks: Any = (), decodes: Any = ()) -> float:
        return self.factor * self.cm.step_time(chunks, decodes)


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
            yield url
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
            yield durl
        finally:
            for p in reversed(procs):
                self.procs.stop(p)


def bench(a: argparse.Namespace, url: str, case: Case, warm: bool) -> dict[str, Any]:
    out = a.results_dir / "runs" / f"{case.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = str(Path(a.model) / "tokenizer.json")
    if warm:  # first requests pay for allocations and kernel builds: outside the figures
        warm_args = ["--base-url", url, "--num-prompts", "2", "--input-len", "32",
                     "--output-len", "4", "--tokenizer", tok, "--disable-tqdm",
                     "--seed", "999"]
        with open(os.devnull, "w") as f, contextlib.redirect_stdout(f):
            bench_main(_bench_ns(warm_args))
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


def simulated(a: argparse.Namespace, case: Case, profile: Path, link: Any,
              drift: float = 1.0) -> dict[str, Any]:
    cm: Any = load_profile(profile, ModelShape.from_path(a.model))
    if drift != 1.0:
        cm = Scaled(cm, drift)
    blocks = kv_blocks_for(cm, KV_MEMORY, 16)
    eng = EngineSpec(num_kv_blocks=blocks, max_num_batched_tokens=case.budget,
                     max_model_len=min(MAX_LEN, a.model_len), policy=case.policy)
    # P/D: phasewise's own hand-off over loopback costs 12-35 ms beyond its bytes' 1-11 ms
    # (bench_disagg.py, README): ~15 ms fixed.
    dep = Deployment("pd", link=link, handoff_s=0.015) if case.pd else Deployment()
    specs = build_workload(case.num_prompts, LengthDist.parse(case.input_len),
                           LengthDist.parse(case.output_len), request_rate=case.rate,
                           burstiness=case.burstiness, intruder_fraction=case.intruder_fraction,
                           intruder_len=LengthDist.parse(case.intruder_len), seed=case.seed)
    return simulate(cm, eng, dep, specs)


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
        anchors = Anchors(a)
        link = None
        if any(c.pd for c in cases):
            probe = probe_link(procs, "127.0.0.1", a.results_dir / "logs" / "probe.log")
            link = make_link("loopback", "loopback (measured)", probe, probe["rtt_s"] / 2)
            report["link"] = {"bandwidth_Bps": link.bandwidth, "latency_s": link.latency_s}
        for key in dict.fromkeys(c.server for c in cases):
            budget, policy, pd = key
            group = [c for c in cases if c.server == key]
            ctx = servers.pd(budget) if pd else servers.colocated(budget, policy)
            with ctx as url:
                for i, case in enumerate(group):
                    profile = p1 if case.pd else p2
                    drift = anchors.drift(profile, 1 if case.pd else 2)
                    log(f"  machine now: anchor steps take x{drift:.3f} their calibrated time")
                    measured = bench(a, url, case, warm=i == 0)
                    pred = simulated(a, case, profile, link)
                    now = simulated(a, case, profile, link, drift)
                    row = {"case": case.name, "describe": case.describe(),
                           "at": time.strftime("%H:%M"), "drift": drift,
                           "measured": {k: measured[k] for _, k, _ in METRICS},
                           "predicted": {k: pred[k] for _, k, _ in METRICS},
                           "predicted_at_drift": {k: now[k] for _, k, _ in METRICS},
                           "failed": measured["failed"]}
                    report["cases"].append(row)
                    log("  " + "  ".join(f"{lbl} {row['measured'][k]:.1f}/"
                                         f"{row['predicted'][k]:.1f}" for lbl, k, _ in METRICS))
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
    print("\n== the same, simulated at the machine's speed when each ran (x drift: "
          + ", ".join(f"{r['case']} {r['drift']:.3f}" for r in report["cases"] if "drift" in r)
          + ") ==")
    print(workload_table(report["cases"], "predicted_at_drift"))
    print(f"\nfull results: {a.results_dir / 'validation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
