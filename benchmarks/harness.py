"""What the benchmark scripts share, in one place.

The scripts are modules of the ``benchmarks`` package: run them from the repository root as
``.venv/bin/python -m benchmarks.<script> ...`` (``--help`` on each says what it takes). They
import this module as ``from benchmarks import harness`` (or names from it), never by editing
the import path, and nothing in ``tests/``.

- **The machine** (``machine_info``, ``machine_line``, ``print_machine``): the CPU model, the
  instruction-set flags that decide which kernels run (avx2, avx512_bf16, amx, ...), the cores
  this process may use, torch, python, the git commit, the load average at start. Every
  script prints the same header line.
- **Processes and servers** (``Procs``, ``stop_group``, ``free_port``, ``wait_http``,
  ``start_server`` / ``ServerProcess`` / ``served``): everything started runs on 127.0.0.1 on
  a free port, is awaited on ``/health``, and is stopped by its PID (SIGTERM, a timeout, then
  SIGKILL), never by name.
- **Interleaved rounds** (``per_call_s``, ``timed``, ``interleaved_rounds``,
  ``interleaved_medians``, ``paired_ratio``): variants run by turns, round after round, so
  the shared machine's drift hits them alike; medians, and the median of the per-round
  ratios with its spread.
- **The reference checkpoint** (``REFERENCE_MODEL``, ``reference_checkpoint``) and the
  bundled model (``BUNDLED_MODEL``); peers' scripts in their own venvs (``peer_command``).
- **P/D links** (``probe_link``, ``make_link``, ``wait_peer``): the K/V port's transport
  measured over a link, for the roofline's ``kv_transfer``.
- **Peaks** (``PeakNotes``, ``PeakRuns``): which of the peaks a figure divides by are
  unstable (stored so by ``phasewise measure``, or judged by its rule where a script measures
  its own), for the ``(UNSTABLE peak: ...)`` marks beside such figures.
- **A busy machine** (``cpu_hogs``, ``fresh_machine_file``): one busy process per core,
  stopped by PID; a machine file that starts absent.

Standard library and httpx only at import time; torch and phasewise are imported where used.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
REFERENCE_MODEL = HERE / ".checkpoints" / "qwen2-0.5b-shape-random"
BUNDLED_MODEL = REPO / "phasewise" / "assets" / "stdlib-coder"
VLLM_PY = Path("/tmp/vllm-venv/bin/python")
PW = [sys.executable, "-m", "phasewise.cli"]
NOTE_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
              "amx_int8")


def log(msg: str) -> None:
    """A timestamped line on stderr, prefixed with the running script's name."""
    name = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "bench"
    print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the machine -----------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    """CPU model, core count and the instruction-set flags that decide the kernels' speed."""
    model, flags = "unknown", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
            elif key.strip() == "Flags":
                flags = set(value.split())
    except (OSError, subprocess.CalledProcessError):
        pass
    if not flags and Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        rev, dirty = None, None
    return {"cpu_model": model, "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "affinity": sorted(os.sched_getaffinity(0)),
            "flags_of_note": {f: f in flags for f in NOTE_FLAGS},
            "torch": torch_version, "python": sys.version.split()[0],
            "git_rev": rev, "git_dirty": dirty, "hostname": socket.gethostname()}


def machine_line(m: dict[str, Any]) -> str:
    have = [f for f, v in m["flags_of_note"].items() if v]
    lack = [f for f, v in m["flags_of_note"].items() if not v]
    return (f"CPU: {m['cpu_model']}, {m['cpus']} CPUs (this process may use "
            f"{','.join(map(str, m['affinity']))}); flags: {' '.join(have) or '-'}; absent: "
            f"{' '.join(lack) or '-'}; torch {m['torch']}, python {m['python']}, phasewise "
            f"{m['git_rev']}{' (uncommitted changes)' if m['git_dirty'] else ''}; load average "
            f"{' '.join(map(str, m.get('loadavg') or [])) or '-'} at start")




def print_machine(file=sys.stderr) -> dict[str, Any]:
    """Print the standard header line (on stderr by default) and return the facts."""
    m = machine_info()
    print(machine_line(m), file=file, flush=True)
    return m


# -- the peaks a figure divides by ------------------------------------------------------------

PEAK_WORDS = {"mem_bandwidth": "read bandwidth", "copy": "copy bandwidth",
              "weight_memory": "read bandwidth of the engine's weight memory"}


def peak_words(name: str) -> str:
    """A peak's name (``phasewise measure``'s: ``mem_bandwidth``, ``fp32``, ...) in words."""
    return PEAK_WORDS.get(name, f"{name} matmul")


@dataclass
class PeakNotes:
    """Which of the peaks a script divides by are unstable, and why: peak name (as
    ``phasewise measure`` names them) -> reason. Every figure computed from an unstable peak
    (a share of the roofline, MBU, MFU) carries ``mark(...)`` beside it, and the report
    opens with ``header(...)``."""

    unstable: dict[str, str] = field(default_factory=dict)

    @classmethod
    def stored(cls, accel: Any) -> PeakNotes:
        """The peaks of a measured accelerator (``cpu-local``, ``gpu-local``) as its machine
        file has them (``measured.unstable``); a catalogue entry has none unstable."""
        return cls(dict(((getattr(accel, "measured", None) or {}).get("unstable")) or {}))

    def mark(self, *names: str) -> str:
        """`` (UNSTABLE peak: <peak>: <why>; ...)`` for each of ``names`` that is unstable;
        empty where all are stable."""
        bad = [f"{peak_words(n)}: {self.unstable[n]}" for n in dict.fromkeys(names)
               if n in self.unstable]
        return f" (UNSTABLE peak: {'; '.join(bad)})" if bad else ""

    def header(self, what: str) -> str:
        """One line naming the unstable peaks of ``what`` (e.g. "this machine's stored
        peaks"), or saying that none is."""
        if not self.unstable:
            return f"peaks ({what}): none unstable"
        listed = "; ".join(f"{peak_words(n)} ({why})" for n, why in self.unstable.items())
        return (f"UNSTABLE peaks ({what}): {listed}; every figure computed from one is "
                "marked (UNSTABLE peak: ...)")


class PeakRuns:
    """The peaks a script measures for itself, judged as ``phasewise measure`` judges its
    figures (``phasewise.perf.measure.unstable_reasons``): a reading whose two best runs
    disagree by more than ``STABLE_BAND``, or any reading taken while other processes held a
    share of the CPUs (over the window from this object's creation to ``notes()``; with
    ``cpu_load`` False, as for a GPU's peaks, the load is not counted). ``add`` records one
    reading's run times; a peak read several times (beside each segment of a run) is
    unstable where any of its readings is. A reading given without its runs is judged on
    the load alone."""

    def __init__(self, cpu_load: bool = True) -> None:
        from phasewise.perf.contention import CpuSample

        self.cpu_load = cpu_load
        self.before = CpuSample.now() if cpu_load else None
        self.readings: dict[str, list[list[float]]] = {}

    def add(self, name: str, times: list[float] | None = None) -> None:
        self.readings.setdefault(name, []).append(list(times or []))

    def notes(self) -> PeakNotes:
        from phasewise.perf.contention import Contention, CpuSample
        from phasewise.perf.measure import unstable_reasons

        contention = (Contention.between(self.before, CpuSample.now()) if self.cpu_load
                      else None)
        # the window's load, in measure's words (a figure with no runs is judged on it alone)
        loaded = unstable_reasons({"": []}, contention).get("")
        out: dict[str, str] = {}
        for name, readings in self.readings.items():
            why = []
            for i, times in enumerate(readings):  # the first reading whose runs disagree
                gap = unstable_reasons({name: times}, None).get(name)
                if gap:
                    which = f" (reading {i + 1} of {len(readings)})" if len(readings) > 1 else ""
                    why.append(gap + which)
                    break
            if loaded:
                why.append(loaded)
            if why:
                out[name] = ", ".join(why)
        return PeakNotes(out)


# -- processes -------------------------------------------------------------------------------

def stop_group(p: subprocess.Popen, timeout: float = 30.0, name: str | None = None) -> None:
    """Stop a process started with ``start_new_session=True`` and whatever it spawned: SIGTERM
    to its process group (by its PID), up to ``timeout`` seconds, then SIGKILL."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            log(f"{name or 'process'} (pid {p.pid}) ignored SIGTERM for {timeout:.0f}s: "
                "SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    else:  # its own process exited; anything it left in its group goes too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


class Procs:
    """Every process this script starts, each in its own process group (session), so that
    stopping it (by PID, as a group) stops whatever it spawned too."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen] = []
        self.names: dict[int, str] = {}
        self.opened: set[Path] = set()  # logs begun in this run (older runs' are replaced)

    def start(self, name: str, cmd: list[str], log_path: Path, *,
              env: dict[str, str] | None = None, cpus: str | None = None,
              netns: str | None = None) -> subprocess.Popen:
        full = list(cmd)
        preexec = None
        if cpus is not None:
            if shutil.which("taskset"):
                full = ["taskset", "-c", cpus, *full]
            else:  # the same pinning without util-linux: set it before the exec
                cpu_set = {int(c) for c in cpus.split(",")}
                preexec = lambda: os.sched_setaffinity(0, cpu_set)  # noqa: E731
        if netns is not None:
            full = ["ip", "netns", "exec", netns, *full]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab" if log_path in self.opened else "wb") as f:
            self.opened.add(log_path)
            f.write(f"\n### {time.strftime('%H:%M:%S')} {' '.join(full)}\n".encode())
            f.flush()
            p = subprocess.Popen(full, stdout=f, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, preexec_fn=preexec)
        self.live.append(p)
        self.names[p.pid] = name
        return p

    def stop(self, p: subprocess.Popen, timeout: float = 30.0) -> None:
        stop_group(p, timeout, self.names.get(p.pid))
        if p in self.live:
            self.live.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.live)):  # the last started (router) first
            self.stop(p)


_HANDED_OUT: set[int] = set()  # the ports free_port returned in this process


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and never one this process was given before: two calls
    before either port is bound (a server's HTTP and K/V ports) would otherwise get the same
    one back from the kernel."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free port that this process has not been given already")


def wait_http(url: str, procs: list[subprocess.Popen], timeout: float, name: str,
              log_path: Path | None = None, poll_s: float = 0.5) -> None:
    """Until ``url`` answers 200; fails at once if one of ``procs`` exits meanwhile (with the
    end of ``log_path``, when given). Says every 30 s that it is still waiting."""
    t0 = last = time.monotonic()
    while True:
        for p in procs:
            if p.poll() is not None:
                tail = ""
                if log_path is not None and log_path.exists():
                    text = log_path.read_text(errors="replace")
                    tail = f"; the end of {log_path}:\n" + text[text.rfind("\n### "):][-3000:]
                raise RuntimeError(f"{name}: a process exited with {p.returncode} before it "
                                   f"was ready{tail}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                log(f"{name} ready after {time.monotonic() - t0:.0f}s")
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{name} not ready after {timeout:.0f}s (see {log_path})")
        if time.monotonic() - last > 30:
            last = time.monotonic()
            log(f"waiting for {name} ({time.monotonic() - t0:.0f}s)")
        time.sleep(poll_s)


def wait_peer(decode_url: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Until the decode worker counts a live prefill worker (``kv_peers_alive``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a worker exited with {p.returncode} before the prefill "
                                   "worker connected")
        from phasewise.bench.run import scrape_phasewise_metrics

        m = scrape_phasewise_metrics(decode_url, {}) or {}
        if m.get("phasewise:kv_peers_alive", 0) >= 1:
            return
        time.sleep(0.3)
    raise RuntimeError(f"the prefill worker did not connect within {timeout:.0f}s")


# -- a busy machine --------------------------------------------------------------------------

HOG = "import sys; print('busy', flush=True)\nwhile True: pass"


@contextlib.contextmanager
def cpu_hogs(n: int | None = None, procs: Procs | None = None,
             log_dir: Path | None = None, ready_s: float = 30.0
             ) -> Iterator[list[subprocess.Popen]]:
    """``n`` busy Python loops (default: one per core this process may use, each pinned to
    its core) for the ``with`` block, each a process in its own group started through
    ``Procs``, spinning before the block begins, and stopped by its PID however it ends.
    ``log_dir``: where their logs go (default: a temporary folder, removed after)."""
    cores = sorted(os.sched_getaffinity(0))
    n = len(cores) if n is None else n
    own = procs or Procs()
    started: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        folder = log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            logs = []
            for i in range(n):
                logs.append(folder / f"cpu-hog-{i}.log")
                started.append(own.start(f"cpu hog {i}", [sys.executable, "-c", HOG], logs[-1],
                                         cpus=str(cores[i % len(cores)])))
            deadline = time.monotonic() + ready_s
            for p, path in zip(started, logs):
                while "busy" not in path.read_text(errors="replace").splitlines():
                    if p.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"cpu hog (pid {p.pid}) did not start: "
                                           f"{path.read_text(errors='replace')[-500:]}")
                    time.sleep(0.02)
            yield started
        finally:
            for p in reversed(started):
                own.stop(p, timeout=5)


@contextlib.contextmanager
def fresh_machine_file() -> Iterator[tuple[dict[str, str], Path]]:
    """An environment for a phasewise command whose machine file (``PHASEWISE_CACHE_DIR``'s
    ``machine.json``) starts absent, in a temporary folder removed after the block, and the
    path that file will have. The compiled kernels and kernel plans of this environment's
    cache folder are linked into it, so that only the machine's figures start from nothing
    (not a kernel build, which would run inside the command)."""
    from phasewise.model.cpu.kernels import cache_dir
    from phasewise.model.cpu.plan import PLANS_DIR

    shared = cache_dir()
    with tempfile.TemporaryDirectory(prefix="phasewise-machine-") as tmp:
        root = Path(tmp)
        (shared / "kernels").mkdir(parents=True, exist_ok=True)  # built once, kept there
        for sub in ("kernels", PLANS_DIR):
            if (shared / sub).is_dir():
                (root / sub).symlink_to(shared / sub, target_is_directory=True)
        yield {**os.environ, "PHASEWISE_CACHE_DIR": str(root)}, root / "machine.json"


# -- one phasewise server (serve, router or pd) -----------------------------------------------

Metrics = dict[tuple[str, tuple], float]


@dataclass
class ServerProcess:
    """A ``phasewise serve`` (or ``router``, ``pd``) started by ``start_server``."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout: float = 60, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers, **kw)

    def metrics(self) -> Metrics:
        """{(sample name, sorted labels without model_name): value}, parsed from /metrics
        by prometheus-client's own parser."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=30, headers=self.headers).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def wait_idle(self, timeout: float = 60) -> Metrics:
        """Poll /metrics until no request runs or waits; returns the last scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m[("phasewise:num_requests_running", ())] == 0
                    and m[("phasewise:num_requests_waiting", ())] == 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Stop it by its PID: ``sig``, up to ``timeout`` seconds, then SIGKILL."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(model_dir: Path | None, log_path: Path, *args: str,
                 api_key: str | None = None, timeout: float = 120,
                 env: dict[str, str] | None = None, command: str = "serve",
                 port: int | None = None, cwd: str | Path | None = None) -> ServerProcess:
    """``phasewise <command>`` on 127.0.0.1 (a free port unless ``port``), once its /health
    answers 200. ``model_dir`` None: no ``--model`` (the bundled default). ``env``: added to
    this process's environment. ``command``: ``serve``, ``router`` or ``pd`` (its ``--port``
    is the one whose /health is awaited). ``cwd``: the folder it runs in, whose package it
    imports (another checkout's server): first on ``PYTHONPATH`` too, as the processes ``pd``
    starts run ``python -P``, which does not put their folder first."""
    port = port or free_port()
    cmd = [*PW, command, *(["--model", str(model_dir)] if model_dir is not None else []),
           "--host", "127.0.0.1", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, **(env or {})}
    env.pop("PHASEWISE_API_KEY", None)  # a key the caller did not give would refuse its clients
    if cwd is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(cwd).resolve()), *filter(None, [env.get("PYTHONPATH")])])
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    server = ServerProcess(proc, port, log_path)
    if api_key:
        server.headers = {"Authorization": f"Bearer {api_key}"}
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise RuntimeError(f"server did not come up in {timeout}s:\n{server.log()}")
        time.sleep(0.1)


@contextlib.contextmanager
def served(model_dir: Path | None, log_path: Path, *args: str,
           **kw: Any) -> Iterator[ServerProcess]:
    """``start_server``'s server for the ``with`` block, stopped by its PID however the
    block ends."""
    server = start_server(model_dir, log_path, *args, **kw)
    try:
        yield server
    finally:
        server.stop()

def stream_gaps(url: str, body: dict[str, Any], gaps: list[float],
                started: Any = None, line_prefix: str = "data: ",
                timeout: float = 300.0) -> None:
    """Stream ``body`` to ``url``'s /v1/completions and append to ``gaps`` the seconds
    between consecutive lines that start with ``line_prefix`` (``data: {``: the chunks,
    without [DONE]); ``started`` (a ``threading.Event``), if given, is set at the first."""
    last = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith(line_prefix):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if started is not None:
                    started.set()


# -- P/D links: measured latency and bandwidth, for the roofline's kv_transfer ----------------

PROBE_CHILD = r"""
import sys, zmq
s = zmq.Context.instance().socket(zmq.PAIR)
s.setsockopt(zmq.LINGER, 0)
s.connect(sys.argv[1])
bufs = {}
while True:
    m = s.recv()
    if m == b"ping":
        s.send(b"pong")
    elif m.startswith(b"go "):
        _, size, count = m.split()
        size, count = int(size), int(count)
        buf = bufs.setdefault(size, b"\x5a" * size)
        for _ in range(count):
            s.send(buf, copy=False)
    else:
        break
"""


def probe_link(procs: Procs, bind_ip: str, log_path: Path, netns: str | None = None,
               sizes: list[int] | None = None, size: int = 16 << 20, count: int = 8,
               reps: int = 3, pings: int = 200) -> dict[str, Any]:
    """Round-trip time and one-way bandwidth (child -> this process, the K/V direction) over
    pyzmq TCP, the K/V port's own transport; with ``sizes``, also the one-way time of a
    single message of each size (median of 5, less half the round trip). The child runs in
    ``netns`` when given."""
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 60_000)
    s.setsockopt(zmq.SNDTIMEO, 60_000)
    port = s.bind_to_random_port(f"tcp://{bind_ip}")
    child = procs.start("link probe", [sys.executable, "-c", PROBE_CHILD,
                                       f"tcp://{bind_ip}:{port}"], log_path, netns=netns)

    def burst(nbytes: int, k: int) -> float:
        t = time.perf_counter()
        s.send(f"go {nbytes} {k}".encode())
        for _ in range(k):
            s.recv(copy=False)
        return time.perf_counter() - t

    try:
        for _ in range(20):
            s.send(b"ping")
            s.recv()
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            s.send(b"ping")
            s.recv()
            rtts.append(time.perf_counter() - t)
        rtt = statistics.median(rtts)
        burst(size, 1)  # warm the child's buffer
        best = statistics.median(burst(size, count) for _ in range(reps))
        one = {}
        for nbytes in sorted(set(sizes or [])):
            burst(nbytes, 1)
            one[nbytes] = max(statistics.median(burst(nbytes, 1) for _ in range(5))
                              - rtt / 2, 0.0)
        s.send(b"bye")
    finally:
        s.close()
        ctx.term()
        procs.stop(child, timeout=10)
    return {"rtt_s": rtt, "bandwidth_Bps": size * count / max(best - rtt / 2, 1e-9),
            "probe_bytes": size * count, "probe_message_bytes": size, "one_message_s": one,
            "method": f"pyzmq PAIR over tcp://{bind_ip}: median of {pings} ping-pongs; "
                      f"{count} x {size >> 20} MiB messages, median of {reps}"}


def make_link(key: str, name: str, probe: dict[str, Any], one_way_latency: float):
    from phasewise.perf.hardware import Link

    return Link(key, name, probe["bandwidth_Bps"], probe["method"], one_way_latency)



# -- interleaved rounds ----------------------------------------------------------------------

def per_call_s(fn: Callable[[], Any], seconds: float) -> float:
    """Seconds a call of ``fn``: one untimed call, then as many as fit in ``seconds``."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / max(n, 1)


def timed(fn: Callable[[], Any], budget_s: float = 0.02) -> float:
    """Seconds a call: ``fn`` repeated for about ``budget_s`` (the count set by one call)."""
    t = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t, 1e-6)
    n = max(1, int(budget_s / once))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def interleaved_rounds(calls: dict[str, Callable[[], float]], rounds: int,
                       alternate: bool = True) -> dict[str, list[float]]:
    """Each call's figures (each call returns one, e.g. seconds), the calls run by turns,
    round after round, so that the machine's drift hits them alike; with ``alternate`` the
    order is reversed every other round."""
    res: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names if (r % 2 == 0 or not alternate) else names[::-1]:
            res[name].append(calls[name]())
    return res


def interleaved_medians(calls: dict[str, Callable[[], float]], rounds: int,
                        alternate: bool = True) -> dict[str, float]:
    """The median of each call's figures over ``interleaved_rounds``."""
    return {name: statistics.median(v)
            for name, v in interleaved_rounds(calls, rounds, alternate).items()}


def paired_ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """The median of the per-round ratios a[i] / b[i], with their lowest and highest: a
    ratio taken within each round, so drift between rounds cancels."""
    ratios = [x / y for x, y in zip(a, b, strict=True) if y]
    return statistics.median(ratios), min(ratios), max(ratios)


def ratio_text(a: list[float], b: list[float]) -> str:
    """``x1.23 (1.10-1.31 over N rounds)``: ``paired_ratio`` as text."""
    med, lo, hi = paired_ratio(a, b)
    return f"x{med:.2f} ({lo:.2f}-{hi:.2f} over {len(a)} rounds)"


# -- checkpoints and peers -------------------------------------------------------------------

def reference_checkpoint(out: Path = REFERENCE_MODEL) -> Path:
    """The reference checkpoint's folder, built first if absent (docs/benchmarks.md, "The
    reference checkpoint"; ``benchmarks.make_reference_checkpoint`` builds it)."""
    if (out / "config.json").exists():
        return out
    from benchmarks.make_reference_checkpoint import build

    return build(out)


def checkpoint_or_reference(model: Path) -> Path:
    """``model`` where it holds a checkpoint; the reference checkpoint, built if absent,
    where ``model`` is its folder (a script's default); else SystemExit naming the folder."""
    if (model / "config.json").exists():
        return model
    if model.resolve() == REFERENCE_MODEL.resolve():
        return reference_checkpoint(REFERENCE_MODEL)
    raise SystemExit(f"no checkpoint at {model} (a folder with config.json); leave --model "
                     "out for the reference checkpoint, which is built when missing")


def peer_command(python: str | Path, script: str, *args: str) -> list[str]:
    """The command that runs ``benchmarks/peers/<script>.py`` in a peer's own venv
    (``python``): as a module of this package, so run it with ``cwd=REPO``."""
    return [str(python), "-m", f"benchmarks.peers.{script}", *args]
