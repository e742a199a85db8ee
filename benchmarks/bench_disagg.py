"""Prefill/decode disaggregation against one co-located engine: same client, workloads,
machine and run (docs/pd.md says when P/D pays; benchmarks/RESULTS.md holds past runs).

Arms, each started in turn on 127.0.0.1 and driven by the ``phasewise bench`` client
(``phasewise.bench.run``, the code behind ``phasewise bench``) with the same workloads:

* ``A``: one co-located engine, ``phasewise serve --role both``, on cores 0,1 with 2 torch
  threads, chunked prefill (the default policy) at ``--budget`` tokens per step;
* ``B-t<N>``: one prefill worker (``taskset -c 0``, 1 thread) and one decode worker
  (``taskset -c 1``, 1 thread, ``--disagg-threshold N``), plus ``phasewise router`` in front
  (not pinned, like the client). One arm per ``--thresholds`` value; ``never`` is a threshold
  of 10**9, larger than any prompt, with the prefill worker still connected: the same
  processes and cores as the other B arms, only nothing is sent to the prefill worker (so
  it measures what the split costs when it is not used);
* ``B-veth-t<N>`` (``--veth``, root + iproute2): as ``B-t<N>``, but the prefill worker runs in
  a network namespace of its own, joined to the root namespace by a veth pair, so its K/V
  crosses that link; with ``tc qdisc ... netem delay D rate R`` on the prefill end (the K/V
  direction) where netem exists, else a ``tbf`` rate limit where that exists, else bare.

Workloads (``phasewise.perf.workload``; prompts are token ids of exact length, outputs
``ignore_eos``, Poisson arrivals): ``chat`` (200 in), ``long`` (1000 in), ``mix`` (200-token
chats with 10% 2000-token intruders), each at a small sweep of request rates. Every
(workload, rate) point has its own seed, the same in every arm, so no point's prompts share a
prefix with another's and every arm sees the same requests at the same times.

Per arm x workload x rate it prints goodput under a TTFT and a TPOT SLO together, p99 ITL and
the longest stall, each arm's goodput and p99 ITL as a multiple of arm A's from this run, the
mean TTFT split from the server's own ``timings`` (queue / local prefill / remote prefill /
K/V window / first step / router / the rest: HTTP and the client), and the K/V hand-off
against the roofline's ``kv_transfer`` (``phasewise.perf``) for the same bytes, over a link
whose latency and bandwidth this script measures with pyzmq (the K/V port's transport) over
loopback and over the veth link. The hand-off is the decode worker's span (request sent ->
first token back) less the prefill worker's own queue + prefill time for the same requests;
a pyzmq message of the same bytes, sent alone over the same link, is shown beside it (see
``kv_figures`` for why no single timing field is the transfer). ``--out FILE`` writes it all
as JSON; the raw ``phasewise bench`` result files, server logs and an HTML report per
workload (``phasewise bench report``) go to ``--results-dir``.

    python -m benchmarks.bench_disagg [--quick] [--out disagg.json] [--thresholds 0 256 1000
        never] [--workloads chat long mix] [--veth] [--router auto|on|off] [--no-colocated]

``--quick`` is a smoke run (about 3 minutes): the bundled stdlib-coder (context 256), short
lengths, few requests, thresholds 0 64 150 never. Without it the model is the reference
checkpoint (docs/benchmarks.md; python -m benchmarks.make_reference_checkpoint makes it); the
prompt lengths are 200, 1000 and 2000 tokens, but the default counts, output lengths and
rates are small, sized to finish in about half an hour on a 2-core AVX2 machine, where a
1000-token prefill took ~7 s on both cores and ~14 s on one (and a decode step ~60-150 ms
on one core): few requests per point, so p99 is close to the maximum; raise --*-n and
--*-out where time allows. The SLOs are per workload (--chat-slo, --long-slo, --mix-slo).

``--router auto`` (default) uses ``phasewise router`` when that command exists and otherwise
points the client at the decode worker directly (said in the "via" column and the JSON).
Every process this script starts runs in its own process group and is stopped by it (SIGTERM
to the group, then SIGKILL), also on Ctrl-C, SIGTERM or an error; namespaces it made are
deleted. Ports are free ports on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from phasewise.bench.options import add_args as add_bench_args
from phasewise.bench.prompts import corpus_text, tokens_from_file
from phasewise.bench.run import main as bench_main
from phasewise.bench.run import scrape_phasewise_metrics

from benchmarks.harness import (BUNDLED_MODEL, HERE, PW, REFERENCE_MODEL, REPO, Procs,
                                checkpoint_or_reference, free_port, log, machine_info,
                                machine_line, make_link, probe_link, wait_http, wait_peer)

QUICK_MODEL = BUNDLED_MODEL
NEVER = 10**9  # a --disagg-threshold larger than any prompt


# -- the phasewise CLI -------------------------------------------------------------------------

def cli_help(*command: str) -> tuple[int, str]:
    try:
        r = subprocess.run([*PW, *command, "--help"], capture_output=True, text=True,
                           timeout=120)
    except subprocess.TimeoutExpired:
        return 1, "timed out"
    return r.returncode, r.stdout + r.stderr


def find_flag(help_text: str, candidates: tuple[str, ...]) -> str | None:
    for c in candidates:
        if re.search(re.escape(c) + r"(?![\w-])", help_text):
            return c
    return None


@dataclass
class KVModel:
    """The roofline's K/V figures for the served model (``Roofline.kv_transfer``)."""

    roofline: Any
    kv_bytes_per_token: float
    dtype: str

    @classmethod
    def for_model(cls, model: Path) -> KVModel | None:
        from phasewise.perf.hardware import ACCELERATORS, lookup_accelerator
        from phasewise.perf.models import ModelShape
        from phasewise.perf.roofline import Roofline

        try:
            shape = ModelShape.from_path(model)
        except (OSError, ValueError, KeyError) as e:
            log(f"no roofline for {model}: {e}")
            return None
        cfg = json.loads((model / "config.json").read_text())
        dt = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dt, "bf16")
        try:  # only the K/V bytes and the link are used: the accelerator does not matter
            accel = lookup_accelerator("cpu-local")
        except (ValueError, KeyError, TypeError, OSError):
            accel = next(iter(ACCELERATORS.values()))
        r = Roofline(shape, accel, dtype, compute_dtype="fp32"
                     if "fp32" in accel.peak_flops else None)
        return cls(r, float(r.kv_bytes_per_token or 0.0), dtype)

    def predict(self, nbytes: float, link: Any) -> float:
        """``kv_transfer``'s own formula (the link's latency + bytes / bandwidth), for
        ``nbytes`` as they were measured (whole blocks, less any cached prefix)."""
        return link.latency_s + nbytes / link.bandwidth

    def nominal(self, prompt_len: int, link: Any) -> dict[str, float] | None:
        return self.roofline.kv_transfer(prompt_len, link)


# -- the veth link ----------------------------------------------------------------------------

@dataclass
class Veth:
    ns: str
    root_dev: str
    ns_dev: str
    root_ip: str
    ns_ip: str
    shaping: str = "none"
    delay_s: float = 0.0
    rate_Bps: float | None = None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _parse_time(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)\s*(us|ms|s)?", text.strip())
    if not m:
        raise ValueError(f"a delay is like 2ms or 500us; got {text!r}")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[m.group(2)]


def _parse_rate(text: str) -> float:
    """tc's rate units (bit based: kbit, mbit, gbit; byte based: kbps, mbps, gbps) -> B/s."""
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)(bit|bps)", text.strip().lower())
    if not m:
        raise ValueError(f"a rate is like 1gbit, 200mbit or 100mbps; got {text!r}")
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return float(m.group(1)) * scale / (8.0 if m.group(3) == "bit" else 1.0)


@contextlib.contextmanager
def veth_link(delay: str, rate: str):
    """A network namespace for the prefill worker, joined to this (root) namespace by a veth
    pair; traffic shaping on the namespace's end, i.e. on the K/V direction. Deleted on exit
    (deleting the namespace removes both ends of the pair)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise SystemExit("--veth needs root and iproute2 (ip)")
    tag = uuid.uuid4().hex[:6]
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    octet = next(n for n in range(200, 250) if f"10.251.{n}." not in used)
    v = Veth(f"pwbd-{tag}", f"vbd{tag}", f"vbp{tag}", f"10.251.{octet}.1",
             f"10.251.{octet}.2")
    made = False
    try:
        _ip("netns", "add", v.ns)
        made = True
        _ip("-n", v.ns, "link", "set", "lo", "up")
        _ip("link", "add", v.root_dev, "type", "veth", "peer", "name", v.ns_dev, "netns", v.ns)
        _ip("addr", "add", f"{v.root_ip}/30", "dev", v.root_dev)
        _ip("link", "set", v.root_dev, "up")
        _ip("-n", v.ns, "addr", "add", f"{v.ns_ip}/30", "dev", v.ns_dev)
        _ip("-n", v.ns, "link", "set", v.ns_dev, "up")
    except subprocess.CalledProcessError as e:
        if made:
            subprocess.run(["ip", "netns", "del", v.ns], capture_output=True)
        raise SystemExit(f"--veth: cannot make the namespace and veth pair: "
                         f"{(e.stderr or '').strip()}")
    try:
        if shutil.which("tc") and (delay or rate):
            tc = ["ip", "netns", "exec", v.ns, "tc", "qdisc", "add", "dev", v.ns_dev, "root"]
            netem = ["netem", *(["delay", delay] if delay else []),
                     *(["rate", rate] if rate else [])]
            r = subprocess.run([*tc, *netem], capture_output=True, text=True)
            if r.returncode == 0:
                v.shaping = "netem " + " ".join(netem[1:])
                v.delay_s = _parse_time(delay) if delay else 0.0
                v.rate_Bps = _parse_rate(rate) if rate else None
            else:
                why = r.stderr.strip()
                log(f"tc netem unavailable here ({why}); trying a tbf rate limit instead")
                r2 = subprocess.run([*tc, "tbf", "rate", rate, "burst", "256kb", "latency",
                                     "400ms"], capture_output=True, text=True) if rate else r
                if rate and r2.returncode == 0:
                    v.shaping = f"tbf rate {rate} (netem unavailable: {why}; no added delay)"
                    v.rate_Bps = _parse_rate(rate)
                else:
                    v.shaping = f"none (netem unavailable: {why})"
        elif delay or rate:
            v.shaping = "none (no tc)"
        yield v
    finally:
        subprocess.run(["ip", "netns", "del", v.ns], capture_output=True)


# -- arms -------------------------------------------------------------------------------------

@dataclass
class Arm:
    name: str
    kind: str  # "colocated" or "disagg"
    threshold: int | None = None
    veth: bool = False


@dataclass
class Deployment:
    arm: Arm
    url: str  # where the client sends
    via: str
    scrape: dict[str, str] = field(default_factory=dict)  # role -> a phasewise server's URL
    procs: list[subprocess.Popen] = field(default_factory=list)
    cpus: dict[str, list[int]] = field(default_factory=dict)  # role -> CPUs it may run on

    def read_affinity(self, procs: Procs) -> None:
        """Each process's CPU set as the kernel has it (the pinning, verified)."""
        for p in self.procs:
            with contextlib.suppress(OSError):
                self.cpus[procs.names[p.pid].split()[-1]] = sorted(os.sched_getaffinity(p.pid))


class Launcher:
    def __init__(self, a: argparse.Namespace, procs: Procs, secret_file: Path,
                 threads_flag: str | None, router: bool, veth: Veth | None) -> None:
        self.a, self.procs, self.secret_file = a, procs, secret_file
        self.threads_flag, self.router, self.veth = threads_flag, router, veth
        self.logs = a.results_dir / "logs"

    def serve_cmd(self, host: str, port: int, threads: int, budget: int,
                  role_args: list[str]) -> tuple[list[str], dict[str, str]]:
        a = self.a
        cmd = [*PW, "serve", "--model", str(a.model), "--host", host, "--port", str(port),
               "--max-model-len", str(a.max_model_len), "--max-num-batched-tokens",
               str(budget), "--policy", "chunked", "--log-interval", "10",
               "--no-access-log", "--shutdown-grace", "2", *role_args]
        if self.threads_flag:
            cmd += [self.threads_flag, str(threads)]
        # The env pins torch's (and the kernels', which ask torch) thread count either way.
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        return cmd, env

    def start(self, arm: Arm) -> Deployment:
        dep = self._colocated(arm) if arm.kind == "colocated" else self._disagg(arm)
        dep.read_affinity(self.procs)
        log(f"{arm.name}: client -> {dep.via}; CPUs "
            + ", ".join(f"{role} {','.join(map(str, c))}" for role, c in dep.cpus.items()))
        return dep

    def _colocated(self, arm: Arm) -> Deployment:
        a = self.a
        port = free_port()
        log_path = self.logs / f"{arm.name}.log"
        cmd, env = self.serve_cmd("127.0.0.1", port, a.threads_a, a.budget, ["--role", "both"])
        p = self.procs.start(f"{arm.name} engine", cmd, log_path, env=env, cpus=a.cpus_a)
        url = f"http://127.0.0.1:{port}"
        dep = Deployment(arm, url, "engine", {"engine": url}, [p])
        wait_http(url + "/health", [p], a.ready_timeout, f"{arm.name} engine", log_path)
        if a.a_via_router and self.router:
            rport = free_port()
            rlog = self.logs / f"{arm.name}-router.log"
            r = self.procs.start(f"{arm.name} router", [
                *PW, "router", "--model", str(a.model), "--decode", url, "--host",
                "127.0.0.1", "--port", str(rport)], rlog)
            dep.procs.append(r)
            dep.url, dep.via = f"http://127.0.0.1:{rport}", "router"
            wait_http(dep.url + "/health", [p, r], a.ready_timeout, f"{arm.name} router", rlog)
        return dep

    def _disagg(self, arm: Arm) -> Deployment:
        a, v = self.a, (self.veth if arm.veth else None)
        kv_host = v.root_ip if v else "127.0.0.1"
        kv = f"tcp://{kv_host}:{free_port()}"
        dport, pport = free_port(), free_port()
        dlog = self.logs / f"{arm.name}-decode.log"
        plog = self.logs / f"{arm.name}-prefill.log"
        secret = ["--kv-secret-file", str(self.secret_file)]
        limit = (["--prefill-queue-limit", str(a.prefill_queue_limit)]
                 if a.prefill_queue_limit is not None else [])
        cmd, env = self.serve_cmd("127.0.0.1", dport, 1, a.budget, [
            "--role", "decode", "--kv-bind", kv, *secret, "--disagg-threshold",
            str(arm.threshold), *limit])
        d = self.procs.start(f"{arm.name} decode", cmd, dlog, env=env, cpus=a.cpu_decode)
        durl = f"http://127.0.0.1:{dport}"
        dep = Deployment(arm, durl, "decode worker (no router)", {"decode": durl}, [d])
        # The K/V port is bound before the HTTP port answers, so the prefill worker can
        # connect once /health does.
        wait_http(durl + "/health", [d], a.ready_timeout, f"{arm.name} decode worker", dlog)
        phost = v.ns_ip if v else "127.0.0.1"
        cmd, env = self.serve_cmd(phost, pport, 1, a.prefill_budget, [
            "--role", "prefill", "--kv-connect", kv, *secret])
        p = self.procs.start(f"{arm.name} prefill", cmd, plog, env=env, cpus=a.cpu_prefill,
                             netns=v.ns if v else None)
        dep.procs.append(p)
        purl = f"http://{phost}:{pport}"
        dep.scrape["prefill"] = purl
        wait_http(purl + "/health", [d, p], a.ready_timeout, f"{arm.name} prefill worker", plog)
        wait_peer(durl, [d, p], 120)
        if self.router:
            rport = free_port()
            rlog = self.logs / f"{arm.name}-router.log"
            r = self.procs.start(f"{arm.name} router", [
                *PW, "router", "--model", str(a.model), "--decode", durl, "--prefill", purl,
                "--host", "127.0.0.1", "--port", str(rport)], rlog)
            dep.procs.append(r)
            dep.url, dep.via = f"http://127.0.0.1:{rport}", "router"
            wait_http(dep.url + "/health", [d, p, r], a.ready_timeout, f"{arm.name} router",
                      rlog)
        return dep

    def stop(self, dep: Deployment) -> None:
        for p in reversed(dep.procs):
            self.procs.stop(p)


# -- workloads --------------------------------------------------------------------------------

@dataclass
class Workload:
    name: str
    input_len: int
    output_len: int
    num_prompts: int
    rates: list[float]
    slo: dict[str, float]
    intruder_fraction: float = 0.0
    intruder_len: int = 0

    def describe(self) -> str:
        intr = (f", {self.intruder_fraction:.0%} intruders of {self.intruder_len}"
                if self.intruder_fraction else "")
        return (f"{self.name}: {self.input_len} in{intr} / {self.output_len} out, "
                f"{self.num_prompts} requests; SLO "
                + " & ".join(f"{k}<={v:g}ms" for k, v in self.slo.items()))


def parse_slo_text(text: str) -> dict[str, float]:
    from phasewise.perf.summary import parse_slo

    slo = parse_slo([text])
    if "ttft" not in slo or "tpot" not in slo:
        raise SystemExit(f"an SLO here needs both ttft and tpot (ttft:MS,tpot:MS); got {text!r}")
    return slo


def workloads_of(a: argparse.Namespace) -> list[Workload]:
    w = {
        "chat": Workload("chat", a.chat_len, a.chat_out, a.chat_n, a.chat_rates,
                         parse_slo_text(a.chat_slo)),
        "long": Workload("long", a.long_len, a.long_out, a.long_n, a.long_rates,
                         parse_slo_text(a.long_slo)),
        "mix": Workload("mix", a.mix_len, a.mix_out, a.mix_n, a.mix_rates,
                        parse_slo_text(a.mix_slo), a.mix_intruder_fraction,
                        a.mix_intruder_len),
    }
    out = [w[name] for name in a.workloads]
    for wl in out:
        longest = max(wl.input_len, wl.intruder_len if wl.intruder_fraction else 0)
        if longest + wl.output_len > a.max_model_len:
            raise SystemExit(f"workload {wl.name}: {longest} + {wl.output_len} tokens exceed "
                             f"--max-model-len {a.max_model_len}")
    return out


# -- one point: one arm, one workload, one rate ------------------------------------------------

def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phasewise bench", add_help=False)
    add_bench_args(p)
    return p


def warm_up(dep: Deployment, corpus: list[int], lengths: list[int], model_name: str) -> None:
    """A few short requests (and, for a B arm, one just over its threshold), so first-call
    costs land outside the measurement."""
    n = len(corpus)
    with httpx.Client(timeout=600) as c:
        for i, length in enumerate(lengths):
            start = (7_777 + 104_729 * (i + 1)) % n
            ids = [corpus[(start + k) % n] for k in range(length)]
            r = c.post(dep.url + "/v1/completions", json={
                "model": model_name, "prompt": ids, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})
            if r.status_code != 200:
                raise RuntimeError(f"{dep.arm.name}: warm-up request of {length} tokens "
                                   f"answered {r.status_code}: {r.text[:300]}")


def scrape_all(dep: Deployment) -> dict[str, dict[str, float]]:
    return {role: scrape_phasewise_metrics(url, {}) or {} for role, url in dep.scrape.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def run_point(a: argparse.Namespace, dep: Deployment, wl: Workload, rate: float, seed: int,
              model_name: str, tokenizer: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    label = f"{dep.arm.name}-{wl.name}"
    path = a.results_dir / "runs" / f"{label}-rate{rate:g}.json"
    argv = ["--base-url", dep.url, "--model", model_name, "--num-prompts",
            str(wl.num_prompts), "--request-rate", str(rate), "--input-len", str(wl.input_len),
            "--output-len", str(wl.output_len), "--seed", str(seed), "--tokenizer",
            str(tokenizer), "--goodput", *[f"{k}:{v:g}" for k, v in wl.slo.items()],
            "--label", label, "--result-file", str(path)]
    if wl.intruder_fraction:
        argv += ["--intruder-fraction", str(wl.intruder_fraction), "--intruder-len",
                 str(wl.intruder_len)]
    ns = bench_parser().parse_args(argv)
    before = scrape_all(dep)
    text_log = a.results_dir / "runs" / f"{label}-rate{rate:g}.txt"
    text_log.parent.mkdir(parents=True, exist_ok=True)
    log(f"{label} @ {rate:g} req/s: {wl.num_prompts} requests (seed {seed}) -> {dep.via}")
    t0 = time.monotonic()
    with open(text_log, "w") as f, contextlib.redirect_stdout(f):
        bench_main(ns)  # phasewise bench itself: workload, prompts, client, summary, file
    after = scrape_all(dep)
    result = json.loads(path.read_text())
    log(f"  done in {time.monotonic() - t0:.0f}s: {result['completed']} ok, "
        f"{result['failed']} failed; goodput {result['request_goodput']:.3f} req/s, p99 ITL "
        f"{result['p99_itl_ms']:.0f} ms")
    return result, {role: delta(before.get(role, {}), after[role]) for role in after}


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def ttft_split(r: dict[str, Any]) -> dict[str, Any]:
    """Mean TTFT and its parts over the successful requests, from the server's ``timings``;
    missing parts count as 0, so the parts add up to the mean TTFT (``phasewise bench``'s own
    ``ttft_split`` averages each part over the requests that have it, and a remote request's
    ``prefill_s`` overlaps its remote parts, so it is not summed here; "router": the router's
    own TTFT less the worker's parts, when it sends ``router_ttft_s``; "other" is what no
    server's clock saw: HTTP to the first server and the client itself)."""
    parts: dict[str, list[float]] = {k: [] for k in (
        "ttft", "queue", "local_prefill", "remote_prefill", "kv_transfer", "first_step",
        "router", "other")}
    n_timed = n_remote = 0
    for ttft, err, t in zip(r["ttfts"], r["errors"], r.get("server_timings") or []):
        if ttft is None or err:
            continue
        t = t or {}
        n_timed += bool(t)
        q = t.get("queue_s") or 0.0
        if t.get("remote_prefill_s") is not None:
            n_remote += 1
            rp, kv, fs, lp = (t.get("remote_prefill_s") or 0.0, t.get("kv_transfer_s") or 0.0,
                              t.get("first_step_s") or 0.0, 0.0)
        else:
            rp = kv = fs = 0.0
            lp = t.get("prefill_s") or 0.0
        worker = q + lp + rp + kv + fs
        # Behind the router: its own TTFT less the worker's parts is the router's hop.
        hop = (t["router_ttft_s"] - worker) if t.get("router_ttft_s") is not None else 0.0
        vals = {"ttft": ttft, "queue": q, "local_prefill": lp, "remote_prefill": rp,
                "kv_transfer": kv, "first_step": fs, "router": hop,
                "other": ttft - worker - hop}
        for k, v in vals.items():
            parts[k].append(v)
    out = {f"mean_{k}_ms": (1e3 * m if (m := _mean(v)) is not None else None)
           for k, v in parts.items()}
    out.update({"requests_with_timings": n_timed, "requests_remote": n_remote})
    return out


def kv_figures(r: dict[str, Any], metrics: dict[str, dict[str, float]], kvm: KVModel | None,
               link: Any) -> dict[str, Any]:
    """Each remote prefill's K/V hand-off against the roofline's ``kv_transfer`` for the same
    bytes over ``link``.

    No one field isolates the transfer: a frame's bytes cross before it "lands", so they sit
    inside ``remote_prefill_s`` with the prefill worker's compute, and ``kv_transfer_s`` (first
    frame landed -> first token back) holds the later frames and, for a prompt of several
    chunks, the later chunks' compute. So the hand-off is measured as the decode side's span
    (``remote_prefill_s + kv_transfer_s``: request sent -> first token back) less the prefill
    worker's own queue + prefill time for the same requests (its /metrics over the run): what
    is left is the request's trip, the K/V not hidden behind compute (all of it for a
    one-frame prompt, the last chunk's for a longer one) and the control messages. Per
    request from ``timings`` when the decode worker sends them, else from its /metrics."""
    d, pw = metrics.get("decode", {}), metrics.get("prefill", {})
    out: dict[str, Any] = {
        "remote_done": d.get("phasewise:remote_prefills_total{outcome=done}"),
        "remote_failed": sum(d.get(f"phasewise:remote_prefills_total{{outcome={o}}}", 0.0)
                             for o in ("failed", "incomplete", "refused")) if d else None,
        "prefill_tokens_on": {role: m.get("phasewise:step_tokens_total{phase=prefill}")
                              for role, m in metrics.items()},
    }
    spans, windows, nbytes, frames = [], [], [], []
    for err, t in zip(r["errors"], r.get("server_timings") or []):
        if err or not t or t.get("remote_prefill_s") is None:
            continue
        spans.append(t["remote_prefill_s"] + (t.get("kv_transfer_s") or 0.0))
        windows.append(t.get("kv_transfer_s") or 0.0)
        if t.get("kv_bytes") is not None:
            nbytes.append(t["kv_bytes"])
        if t.get("kv_frames") is not None:
            frames.append(t["kv_frames"])
    n = d.get("phasewise:kv_transfer_bytes_count", 0.0)
    if spans:
        out["source"] = "timings"
    elif n:  # the run's means from the decode worker's histograms
        out["source"] = "metrics"
        spans = [d.get("phasewise:remote_prefill_seconds_sum", 0.0) / n]
        windows = [d.get("phasewise:kv_transfer_window_seconds_sum", 0.0)
                   / max(d.get("phasewise:kv_transfer_window_seconds_count", 0.0), 1.0)]
        nbytes = [d["phasewise:kv_transfer_bytes_sum"] / n]
        frames = [d.get("phasewise:kv_transfer_frames_sum", 0.0) / n]
    else:
        out["source"] = None
        return out
    out["n"] = len(spans) if out["source"] == "timings" else int(n)
    out["mean_bytes"] = _mean(nbytes)
    out["mean_frames"] = _mean(frames)
    out["decode_span_ms"] = 1e3 * statistics.fmean(spans)
    out["window_ms"] = 1e3 * statistics.fmean(windows)
    pn = pw.get("phasewise:request_prefill_time_seconds_count", 0.0)
    if pn:
        own = (pw.get("phasewise:request_prefill_time_seconds_sum", 0.0)
               + pw.get("phasewise:request_queue_time_seconds_sum", 0.0)) / pn
        out["prefill_worker_ms"] = 1e3 * own
        out["prefill_worker_requests"] = int(pn)
        out["handoff_ms"] = out["decode_span_ms"] - 1e3 * own
    if kvm is not None and link is not None and out["mean_bytes"]:
        out["predicted_ms"] = 1e3 * statistics.fmean(kvm.predict(b, link) for b in nbytes)
        if out.get("handoff_ms") is not None:
            out["handoff_over_predicted"] = out["handoff_ms"] / out["predicted_ms"]
    return out


def point_summary(arm: Arm, dep: Deployment, wl: Workload, rate: float, seed: int,
                  r: dict[str, Any], metrics: dict[str, dict[str, float]],
                  kvm: KVModel | None, link: Any, a: argparse.Namespace) -> dict[str, Any]:
    stall = r.get("longest_stall") or {}
    return {
        "arm": arm.name, "kind": arm.kind, "threshold": arm.threshold, "veth": arm.veth,
        "via": dep.via, "workload": wl.name, "rate": rate, "seed": seed,
        "slo": wl.slo, "completed": r["completed"], "failed": r["failed"],
        "duration_s": r["duration"], "goodput": r["request_goodput"],
        "request_throughput": r["request_throughput"],
        "output_throughput": r["output_throughput"],
        "p50_itl_ms": r["median_itl_ms"], "p99_itl_ms": r["p99_itl_ms"],
        "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
        "median_tpot_ms": r["median_tpot_ms"], "p99_tpot_ms": r["p99_tpot_ms"],
        "longest_stall": stall or None,
        "ttft_split": ttft_split(r),
        # phasewise bench's own split (each part's mean over the requests that have it).
        "bench_ttft_split": r.get("ttft_split"),
        "kv": kv_figures(r, metrics, kvm, link),
        "server_metrics": r.get("server_metrics"), "cpus": dep.cpus,
        "result_file": str(a.results_dir / "runs" / f"{arm.name}-{wl.name}-rate{rate:g}.json"),
    }


def add_ratios(points: list[dict[str, Any]]) -> None:
    """Goodput and p99 ITL (and the longest stall) as multiples of arm A's at the same
    workload and rate, from this run."""
    base = {(p["workload"], p["rate"]): p for p in points if p["arm"] == "A"}
    for p in points:
        b = base.get((p["workload"], p["rate"]))
        if b is None:
            p["vs_A"] = None
            continue

        def ratio(x: float | None, y: float | None) -> float | None:
            if x is None or y is None or (isinstance(y, float) and math.isnan(y)):
                return None
            if y == 0:
                return None if x == 0 else math.inf
            return x / y

        p["vs_A"] = {"goodput": ratio(p["goodput"], b["goodput"]),
                     "p99_itl": ratio(p["p99_itl_ms"], b["p99_itl_ms"]),
                     "longest_stall": ratio((p["longest_stall"] or {}).get("itl_ms"),
                                            (b["longest_stall"] or {}).get("itl_ms")),
                     "mean_ttft": ratio(p["ttft_split"]["mean_ttft_ms"],
                                        b["ttft_split"]["mean_ttft_ms"])}


# -- the report -------------------------------------------------------------------------------

def _f(x: Any, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}"


def _x(x: float | None) -> str:
    if x is None:
        return "-"
    return "xinf" if math.isinf(x) else f"x{x:.2f}"


def report(points: list[dict[str, Any]], workloads: list[Workload]) -> str:
    lines: list[str] = []
    by_wl = {wl.name: wl for wl in workloads}
    keys = sorted({(p["workload"], p["rate"]) for p in points},
                  key=lambda k: ([w.name for w in workloads].index(k[0]), k[1]))
    for wname, rate in keys:
        wl = by_wl[wname]
        lines += ["", f"== {wl.describe()}; Poisson {rate:g} req/s =="]
        lines.append(f"{'arm':<14}{'via':<9}{'ok':>6}{'goodput':>9}{'vs A':>8}"
                     f"{'p99 ITL':>9}{'vs A':>8}{'stall':>8}{'vs A':>8}  {'stall cause':<18}"
                     f"{'TTFT':>8}{'TPOT50':>8}{'remote':>8}")
        for p in points:
            if (p["workload"], p["rate"]) != (wname, rate):
                continue
            st = p["longest_stall"] or {}
            cause = ("-" if st.get("culprit") is None else
                     f"{st['culprit_prompt_len']}-tok prompt")
            v = p["vs_A"] or {}
            via = {"engine": "engine", "router": "router"}.get(p["via"], "direct")
            lines.append(
                f"{p['arm']:<14}{via:<9}{p['completed']:>3}/{p['completed'] + p['failed']:<2}"
                f"{_f(p['goodput'], 3):>9}{_x(v.get('goodput')):>8}"
                f"{_f(p['p99_itl_ms']):>9}{_x(v.get('p99_itl')):>8}"
                f"{_f(st.get('itl_ms')):>8}{_x(v.get('longest_stall')):>8}  {cause:<18}"
                f"{_f(p['ttft_split']['mean_ttft_ms']):>8}{_f(p['median_tpot_ms']):>8}"
                f"{p['ttft_split']['requests_remote']:>8}")
    lines += ["", "goodput: req/s meeting the TTFT and the TPOT SLO together; 'vs A': this "
              "arm's figure / arm A's at the same workload and rate (goodput: >1 better; "
              "p99 ITL, stall: <1 better). ITL and stall in ms. 'remote': requests whose "
              "timings show a remote prefill (needs the decode worker's remote timings)."]

    lines += ["", "== mean TTFT split (ms), from the server's timings ==",
              f"{'arm':<14}{'workload':<8}{'rate':>6}{'TTFT':>8}{'queue':>8}{'prefill':>9}"
              f"{'remote':>8}{'xfer':>8}{'1st step':>9}{'router':>8}{'other':>8}{'timed':>7}"]
    for p in points:
        s = p["ttft_split"]
        lines.append(
            f"{p['arm']:<14}{p['workload']:<8}{p['rate']:>6g}{_f(s['mean_ttft_ms']):>8}"
            f"{_f(s['mean_queue_ms']):>8}{_f(s['mean_local_prefill_ms']):>9}"
            f"{_f(s['mean_remote_prefill_ms']):>8}{_f(s['mean_kv_transfer_ms']):>8}"
            f"{_f(s['mean_first_step_ms']):>9}{_f(s['mean_router_ms']):>8}"
            f"{_f(s['mean_other_ms']):>8}"
            f"{s['requests_with_timings']:>7}")
    lines.append("prefill: computed on the engine that decoded; remote: request sent to the "
                 "first K/V frame; xfer: first frame to first token back; 1st step: first "
                 "token back to its emission; router: the router's own TTFT less the "
                 "worker's; other: what no server's clock saw (HTTP, the client).")

    lines += ["", "== K/V hand-off: measured against the roofline's kv_transfer for the same "
              "bytes ==",
              f"{'arm':<14}{'workload':<8}{'rate':>6}{'src':>8}{'n':>4}{'frames':>7}"
              f"{'KiB':>8}{'pred ms':>9}{'probe ms':>9}{'span ms':>9}{'prefill':>9}"
              f"{'hand-off':>9}{'vs pred':>9}{'window':>8}"]
    for p in points:
        k = p["kv"]
        if p["kind"] != "disagg":
            continue
        lines.append(
            f"{p['arm']:<14}{p['workload']:<8}{p['rate']:>6g}{k.get('source') or '-':>8}"
            f"{_f(k.get('n')):>4}{_f(k.get('mean_frames'), 1):>7}"
            f"{_f((k.get('mean_bytes') or 0) / 1024 or None):>8}"
            f"{_f(k.get('predicted_ms'), 2):>9}{_f(k.get('probe_ms'), 2):>9}"
            f"{_f(k.get('decode_span_ms')):>9}{_f(k.get('prefill_worker_ms')):>9}"
            f"{_f(k.get('handoff_ms'), 1):>9}{_x(k.get('handoff_over_predicted')):>9}"
            f"{_f(k.get('window_ms'), 1):>8}")
    lines.append("pred: kv_transfer's formula (link latency + bytes / bandwidth) for the "
                 "measured bytes over the measured link (loopback, or veth for veth arms); "
                 "probe: one pyzmq message of those bytes over that link, alone; span: decode "
                 "worker, request sent -> first token back; prefill: the prefill worker's own "
                 "queue + prefill for the same requests; hand-off = span - prefill (the "
                 "request's trip, the K/V not hidden behind compute, control messages); "
                 "window: first frame landed -> first token back. With frames > 1 only the "
                 "last chunk's K/V is exposed, so the hand-off can fall below pred.")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------

QUICK = dict(chat_len=48, chat_out=16, chat_n=6, chat_rates=[2.0, 4.0],
             chat_slo="ttft:500,tpot:50",
             long_len=160, long_out=16, long_n=4, long_rates=[1.0],
             long_slo="ttft:1500,tpot:50",
             mix_len=48, mix_out=16, mix_n=10, mix_rates=[2.0], mix_intruder_len=200,
             mix_slo="ttft:500,tpot:50",
             thresholds=["0", "64", "150", "never"], max_model_len=256, budget=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the bundled stdlib-coder, short lengths, few requests, "
                    "thresholds 0 64 150 never (flags given explicitly still win)")
    ap.add_argument("--model", type=Path, default=None,
                    help=f"default: {REFERENCE_MODEL.relative_to(REPO)} "
                    f"(--quick: {QUICK_MODEL.relative_to(REPO)})")
    ap.add_argument("--out", type=Path, default=None, help="write the whole report as JSON")
    ap.add_argument("--results-dir", type=Path, default=HERE / "results" / "disagg",
                    help="raw phasewise bench result files, server logs, HTML reports")
    ap.add_argument("--workloads", nargs="+", default=["chat", "long", "mix"],
                    choices=["chat", "long", "mix"])
    ap.add_argument("--thresholds", nargs="+", default=None,
                    help="B arms' --disagg-threshold values; 'never' is 10**9 "
                    "(default 0 256 1000 never)")
    ap.add_argument("--no-colocated", action="store_true", help="skip arm A")
    ap.add_argument("--bracket", action="store_true",
                    help="run arm A again at the end (A-end): its ratios against A show how "
                    "far the machine drifted during the run")
    ap.add_argument("--no-disagg", action="store_true", help="skip every B arm")
    ap.add_argument("--router", choices=["auto", "on", "off"], default="auto",
                    help="B arms behind 'phasewise router' (auto: when the command exists; "
                    "off: the client talks to the decode worker)")
    ap.add_argument("--a-via-router", action="store_true",
                    help="put arm A behind the router too (router --decode A only), so both "
                    "arms pay the same extra hop")
    ap.add_argument("--veth", action="store_true",
                    help="also run B arms with the prefill worker in its own network "
                    "namespace, K/V over a veth pair (root + iproute2)")
    ap.add_argument("--veth-thresholds", nargs="+", default=["0"])
    ap.add_argument("--netem-delay", default="2ms", help="one-way delay on the K/V direction "
                    "of the veth link ('' for none)")
    ap.add_argument("--netem-rate", default="1gbit", help="rate limit on the K/V direction "
                    "of the veth link, tc units ('' for none)")
    # Engines.
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=256,
                    help="--max-num-batched-tokens of arm A's engine and of the decode "
                    "worker (256 is phasewise's CPU default)")
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="the prefill worker's --max-num-batched-tokens (default: --budget)")
    ap.add_argument("--prefill-queue-limit", type=int, default=None,
                    help="the decode worker's --prefill-queue-limit (default: its own)")
    ap.add_argument("--cpus-a", default="0,1")
    ap.add_argument("--threads-a", type=int, default=2)
    ap.add_argument("--cpu-prefill", default="0")
    ap.add_argument("--cpu-decode", default="1")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    # Workloads: lengths, counts, rates, SLOs.
    ap.add_argument("--chat-len", type=int, default=200)
    ap.add_argument("--chat-out", type=int, default=24)
    ap.add_argument("--chat-n", type=int, default=6)
    ap.add_argument("--chat-rates", type=float, nargs="+", default=[0.15, 0.3])
    ap.add_argument("--chat-slo", default="ttft:4000,tpot:300")
    ap.add_argument("--long-len", type=int, default=1000)
    ap.add_argument("--long-out", type=int, default=16)
    ap.add_argument("--long-n", type=int, default=3)
    ap.add_argument("--long-rates", type=float, nargs="+", default=[0.05, 0.1])
    ap.add_argument("--long-slo", default="ttft:20000,tpot:300")
    ap.add_argument("--mix-len", type=int, default=200)
    ap.add_argument("--mix-out", type=int, default=24)
    ap.add_argument("--mix-n", type=int, default=10)
    ap.add_argument("--mix-rates", type=float, nargs="+", default=[0.15])
    ap.add_argument("--mix-intruder-len", type=int, default=2000)
    ap.add_argument("--mix-intruder-fraction", type=float, default=0.1)
    ap.add_argument("--mix-slo", default="ttft:4000,tpot:300")
    defaults = {k: ap.get_default(k) for k in QUICK}
    a = ap.parse_args(argv)
    if a.quick:  # the quick values, except where a flag was given on the command line
        given = {k for k in QUICK if getattr(a, k) != defaults[k]}
        for k, v in QUICK.items():
            if k not in given:
                setattr(a, k, v)
        a.model = a.model or QUICK_MODEL
    a.model = (a.model or REFERENCE_MODEL).resolve()
    a.thresholds = a.thresholds or ["0", "256", "1000", "never"]
    allowed = os.sched_getaffinity(0)
    for flag in ("cpus_a", "cpu_prefill", "cpu_decode"):
        try:
            cpus = {int(c) for c in getattr(a, flag).split(",")}
        except ValueError:
            ap.error(f"--{flag.replace('_', '-')} takes CPU numbers like 0 or 0,1")
        if not cpus <= allowed:
            ap.error(f"--{flag.replace('_', '-')} {getattr(a, flag)}: this process may run on "
                     f"CPUs {','.join(map(str, sorted(allowed)))} only")
    a.prefill_budget = a.prefill_budget or a.budget
    return a


def threshold_value(text: str) -> int:
    if text.lower() in ("never", "inf"):
        return NEVER
    if text.lower() == "always":
        return 0
    v = int(text)
    if v < 0:
        raise SystemExit(f"a threshold is >= 0 or 'never'; got {text!r}")
    return v


def arm_name(t: int, veth: bool = False) -> str:
    return f"B-{'veth-' if veth else ''}{'never' if t >= NEVER else f't{t}'}"


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.model = checkpoint_or_reference(a.model)
    tokenizer = a.model / "tokenizer.json"
    model_name = a.model.name  # the servers' default served name; sent by the client
    workloads = workloads_of(a)
    machine = machine_info()
    print(machine_line(machine), flush=True)
    arms: list[Arm] = [] if a.no_colocated else [Arm("A", "colocated")]
    if not a.no_disagg:
        if (os.cpu_count() or 1) < 2:
            raise SystemExit("the B arms pin two workers to two cores; this machine has one")
        arms += [Arm(arm_name(t), "disagg", t) for t in map(threshold_value, a.thresholds)]
        if a.veth:
            arms += [Arm(arm_name(t, True), "disagg", t, True)
                     for t in map(threshold_value, a.veth_thresholds)]
    if a.bracket and not a.no_colocated:
        arms.append(Arm("A-end", "colocated"))  # its 'vs A' is this run's drift

    rc, serve_help = cli_help("serve")
    if rc != 0:
        raise SystemExit(f"'phasewise serve --help' failed:\n{serve_help}")
    threads_flag = find_flag(serve_help, ("--threads", "--num-threads", "--torch-threads"))
    if a.prefill_queue_limit is not None and not find_flag(serve_help,
                                                           ("--prefill-queue-limit",)):
        raise SystemExit("--prefill-queue-limit: this phasewise serve has no such flag")
    router_rc, router_help = cli_help("router")
    has_router = router_rc == 0
    if a.router == "on" and not has_router:
        raise SystemExit("--router on, but 'phasewise router --help' fails: "
                         + router_help.strip().splitlines()[-1])
    use_router = has_router and a.router != "off"
    tools = {"threads_flag": threads_flag or "none (OMP_NUM_THREADS in the env)",
             "router": "phasewise router" if use_router else
             ("absent: the client talks to the decode worker" if not has_router
              else "off (--router off)")}
    print(f"model: {a.model} (served as {model_name!r}); step budget {a.budget} "
          f"(prefill worker {a.prefill_budget}); threads flag: {tools['threads_flag']}; "
          f"router: {tools['router']}", flush=True)
    print("arms: " + ", ".join(x.name for x in arms) + "; workloads: "
          + "; ".join(f"{w.describe()} @ {'/'.join(f'{r:g}' for r in w.rates)} req/s"
                      for w in workloads), flush=True)

    a.results_dir.mkdir(parents=True, exist_ok=True)
    corpus = tokens_from_file(tokenizer, corpus_text())
    kvm = KVModel.for_model(a.model)
    procs = Procs()
    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C stops the run cleanly even where SIGINT came in ignored (a shell's '&' job).
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    points: list[dict[str, Any]] = []
    links: dict[str, Any] = {}
    probes: dict[str, Any] = {}
    arm_errors: dict[str, str] = {}
    veth_info: dict[str, Any] | None = None
    secret_dir = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    interrupted = False
    failure: str | None = None
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, secret_dir, True)
            stack.callback(procs.stop_all)
            secret_file = secret_dir / "kv.secret"
            secret_file.write_text(secrets.token_hex(32) + "\n")
            secret_file.chmod(0o600)
            veth = None
            if any(x.veth for x in arms):
                veth = stack.enter_context(veth_link(a.netem_delay, a.netem_rate))
                veth_info = asdict(veth)
                print(f"veth: prefill worker in namespace {veth.ns} ({veth.ns_ip}), decode "
                      f"worker's K/V port on {veth.root_ip}; shaping: {veth.shaping}",
                      flush=True)
            # The links the transfers cross, measured with the K/V port's transport.
            probe_log = a.results_dir / "logs" / "link-probe.log"
            lo = probe_link(procs, "127.0.0.1", probe_log)
            probes["loopback"] = lo
            links["loopback"] = make_link("loopback-measured", "TCP loopback (pyzmq, measured)",
                                          lo, lo["rtt_s"] / 2)
            if veth is not None:
                vp = probe_link(procs, veth.root_ip, probe_log, netns=veth.ns)
                probes["veth"] = vp
                # Shaping delays only the K/V direction: one-way = its delay + half the rest.
                one_way = veth.delay_s + max(vp["rtt_s"] - veth.delay_s, 0.0) / 2
                links["veth"] = make_link("veth-measured", f"veth pair ({veth.shaping}, "
                                          "pyzmq, measured)", vp, one_way)
            for key, link in links.items():
                nominal = kvm.nominal(a.chat_len, link) if kvm else None
                print(f"link {key}: {link.bandwidth / 1e9:.2f} GB/s, one-way latency "
                      f"{link.latency_s * 1e6:.0f} us ({link.source})"
                      + (f"; roofline kv_transfer of one {a.chat_len}-token prompt: "
                         f"{nominal['bytes'] / 1024:.0f} KiB in "
                         f"{nominal['transfer_s'] * 1e3:.2f} ms" if nominal else ""),
                      flush=True)

            launcher = Launcher(a, procs, secret_file, threads_flag, use_router, veth)
            for arm in arms:
                log(f"starting arm {arm.name}")
                dep = None
                try:
                    dep = launcher.start(arm)
                    warm = [16, min(64, a.budget)]
                    if arm.kind == "disagg" and arm.threshold < NEVER:
                        over = arm.threshold + 16
                        if over <= min(300, a.max_model_len - 8):
                            warm.append(over)
                    warm_up(dep, corpus, warm, model_name)
                    link = links["veth" if arm.veth else "loopback"]
                    for wi, wl in enumerate(workloads):
                        for ri, rate in enumerate(wl.rates):
                            seed = a.seed + 100 * (wi + 1) + ri
                            r, metrics = run_point(a, dep, wl, rate, seed, model_name,
                                                   tokenizer)
                            points.append(point_summary(arm, dep, wl, rate, seed, r, metrics,
                                                        kvm, link, a))
                except Exception as e:  # this arm is lost; the next one starts afresh
                    arm_errors[arm.name] = f"{type(e).__name__}: {e}"
                    log(f"arm {arm.name} failed, going on with the next: "
                        f"{arm_errors[arm.name]}")
                finally:
                    if dep is not None:
                        launcher.stop(dep)
                    procs.stop_all()  # anything of this arm's that never made a deployment
            # The same bytes as each point's mean hand-off, alone over the same link.
            for key in links:
                pts = [p for p in points if p["kind"] == "disagg"
                       and ("veth" if p["veth"] else "loopback") == key
                       and p["kv"].get("mean_bytes")]
                if not pts:
                    continue
                sizes = [int(p["kv"]["mean_bytes"]) for p in pts]
                got = probe_link(procs, veth.root_ip if key == "veth" else "127.0.0.1",
                                 probe_log, netns=veth.ns if key == "veth" else None,
                                 sizes=sizes)
                probes[key + "_same_bytes"] = got
                for p, size in zip(pts, sizes):
                    p["kv"]["probe_ms"] = 1e3 * got["one_message_s"][size]
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: every process this script started has been stopped")
    except Exception as e:  # report what ran; the processes are already stopped
        failure = f"{type(e).__name__}: {e}"
        log(f"stopped by an error (every process this script started has been stopped): "
            f"{failure}")
    finally:
        for s, h in old.items():
            signal.signal(s, h)

    add_ratios(points)
    text = report(points, workloads)
    print("\n" + machine_line(machine))
    for key, link in links.items():
        print(f"link {key}: {link.bandwidth / 1e9:.2f} GB/s, one-way {link.latency_s * 1e6:.0f}"
              f" us; K/V {kvm.kv_bytes_per_token / 1024:.1f} KiB/token ({kvm.dtype})"
              if kvm else "")
    print(text)
    for name, err in arm_errors.items():
        print(f"\narm {name} FAILED: {err[:2000]}")
    html = []
    for wl in workloads:
        files = [p["result_file"] for p in points if p["workload"] == wl.name]
        if files:
            try:
                from phasewise.bench.report import render

                html.append(str(render(files, a.results_dir / f"report-{wl.name}.html")))
            except Exception as e:  # a report is a bonus; the figures are already out
                log(f"HTML report for {wl.name} failed: {type(e).__name__}: {e}")
    if html:
        print(f"\nHTML reports: {', '.join(html)}; raw results: {a.results_dir / 'runs'}")
    if a.out:
        doc = {
            "machine": machine, "tools": tools, "model": str(a.model),
            "kv_bytes_per_token": kvm.kv_bytes_per_token if kvm else None,
            "kv_dtype": kvm.dtype if kvm else None,
            "links": {k: l.as_dict() for k, l in links.items()}, "probes": probes,
            "veth": veth_info,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "arms": [asdict(x) for x in arms],
            "workloads": [asdict(w) for w in workloads],
            "points": points, "interrupted": interrupted, "error": failure,
            "arm_errors": arm_errors,
            "notes": [
                "B-never: --disagg-threshold 10**9 with the prefill worker connected (same "
                "processes and cores as the other B arms; nothing is sent to it).",
                "Ratios (vs_A) are against arm A at the same workload and rate, this run.",
                "K/V 'measured' is the decode worker's first-frame -> first-token window; "
                "only single-chunk prompts measure the transfer alone.",
            ],
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1, allow_nan=True, default=str))
        print(f"JSON written to {a.out}")
    if interrupted:
        return 130
    if failure or arm_errors:
        return 1
    return 0 if all(p["failed"] == 0 for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
