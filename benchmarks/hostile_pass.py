"""A hostile client's pass over phasewise's servers, each attack beside a victim stream.

Each class of attack that issue 46 found is sent while a victim stream runs, and the script
reports what the servers answered and what it cost everyone else.

The script starts what it attacks as subprocesses on 127.0.0.1, on free ports: ``phasewise
serve`` with default flags, a second one with ``--api-key``, and ``phasewise pd`` (router,
decode worker, prefill worker and the decode worker's K/V port), each only when a chosen class
needs it, and stops them by PID at the end. For each class a victim (a greedy streamed
completion of 200 tokens, ``ignore_eos``, read in a process of its own so that this one's work
cannot delay it) runs on the attacked server; the attack starts once the victim's first token
arrived, and victims are restarted until the attack ends. Clients bind distinct 127.x
addresses (all local on Linux), since several defences count per address: the victim, the
attacker and the bystanders each have their own.

Printed: the CPU and commit, then one table: per class the requests sent, their statuses,
unexpected 5xx, crashes (an attacked process that died; it is restarted so later classes
run), the largest inter-token gap the victims saw beside the baseline measured in the same run
with no attack, and the attacked process's RSS before/after. Then a verdict per class (``ok``
or what missed its target) with its details: what each sub-case answered, bystanders'
statuses, socket states, memory high-water marks. Server logs stay in the printed folder.

    .venv/bin/python -m benchmarks.hostile_pass [--quick] [--model DIR] [--classes 1 kv ...]

``--quick`` sends fewer and smaller attacks and waits at most 20 s on slow connections (about
2-3 minutes on a 2-core machine; the full pass about 5). ``--classes`` takes class numbers or
parts of their names.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import (REPO, ServerProcess, free_port, machine_info, machine_line,
                                start_server)

# Client addresses: the defences that count per address (grammar checks, idle connections,
# wrong keys) must see the victim, the attacker and each bystander as different clients.
VICTIM = "127.0.0.9"
ATTACKER = "127.0.0.2"
RAW_ATTACKER = "127.0.0.3"  # slowloris's raw sockets
BYSTANDER = "127.0.0.4"
CLIENT_A = "127.0.0.5"
CLIENT_B = "127.0.0.6"

API_KEY = "hostile-pass-key"
BODY_LIMIT = 8 * 2**20  # the servers' default --max-request-size
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 15, 60  # their default --timeout-header, --timeout-body
VICTIM_BODY = {"prompt": "def fibonacci(n):", "max_tokens": 200, "temperature": 0,
               "ignore_eos": True, "stream": True}
SMALL = {"prompt": "hello", "max_tokens": 4}
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Scale:
    """How much each class sends; the full pass is the issue's, --quick a smaller one."""

    ref_chains: tuple[int, ...] = (1000, 5000)
    rule_chains: tuple[int, ...] = (2800, 10_000)
    wide_props: int = 50_000
    heavy_n: int = 16
    fair_a: int = 8
    fair_b: int = 20
    allowed_regexes: int = 40
    empty_messages_at_once: int = 4
    slow_connections: int = 1000
    slow_cap_s: float = 90
    wrong_keys: int = 1000
    wrong_logins: int = 200
    emoji: int = 1_000_000
    router_requests: int = 300
    kv_single_mb: int = 1000
    kv_parts_mb: int = 200
    kv_json_mb: int = 60
    kv_json_count: int = 3
    kv_junk: int = 1000
    kv_raw_connections: int = 1000
    kv_hold_cap_s: float = 40


QUICK = Scale(ref_chains=(1000,), rule_chains=(2800,), wide_props=25_000, heavy_n=4,
              fair_a=3, fair_b=6, allowed_regexes=10, empty_messages_at_once=2,
              slow_connections=150, slow_cap_s=20, wrong_keys=60, wrong_logins=20,
              emoji=200_000, router_requests=40, kv_single_mb=100, kv_parts_mb=20,
              kv_json_mb=10, kv_json_count=1, kv_junk=100, kv_raw_connections=100,
              kv_hold_cap_s=10)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


# -- processes -------------------------------------------------------------------------------

def proc_mb(pid: int, key: str = "VmRSS") -> float | None:
    """A /proc/PID/status memory field (VmRSS, VmHWM) in MB; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
              "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def sockets_to(pid: int, ports: set[int]) -> Counter:
    """States of process ``pid``'s TCP sockets whose remote port is one of ``ports``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    states: Counter = Counter()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for row in f:
                cols = row.split()
                if int(cols[2].rsplit(":", 1)[1], 16) in ports and cols[9] in inodes:
                    states[TCP_STATES.get(cols[3], cols[3])] += 1
    return states


@dataclass
class PD:
    """``phasewise pd``: its launcher (a ServerProcess on the router's port) and the three
    processes it started, found by their command lines."""

    launcher: ServerProcess
    pids: dict[str, int]
    decode_port: int
    prefill_port: int
    kv_port: int

    @property
    def url(self) -> str:
        return self.launcher.url

    @property
    def decode_url(self) -> str:
        return f"http://127.0.0.1:{self.decode_port}"

    def processes(self) -> dict[str, int]:
        return {"pd launcher": self.launcher.proc.pid, **self.pids}

    def stop(self) -> None:
        self.launcher.stop()
        for pid in self.pids.values():  # the launcher stops them; this is for a dead launcher
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _pd_roles(launcher_pid: int) -> dict[str, int]:
    roles = {}
    for pid in children(launcher_pid):
        args = cmdline(pid)
        if "router" in args:
            roles["router"] = pid
        elif "--role" in args:
            roles[args[args.index("--role") + 1]] = pid
    return roles


class Servers:
    """The servers the chosen classes attack, each started on first use and again after it
    died (a crash the class that killed it reports)."""

    def __init__(self, model: Path | None, logs: Path) -> None:
        self.model, self.logs = model, logs
        self._serve: dict[str, ServerProcess] = {}
        self._pd: PD | None = None
        self._starts: Counter = Counter()

    def _log(self, name: str) -> Path:
        self._starts[name] += 1
        return self.logs / f"{name}.{self._starts[name]}.log"

    def serve(self, name: str = "main") -> ServerProcess:
        """``main``: default flags; ``keyed``: ``--api-key``."""
        s = self._serve.get(name)
        if s is None or s.proc.poll() is not None:
            log(f"  starting phasewise serve ({name})")
            s = start_server(self.model, self._log(name), "--log-interval", "0",
                             api_key=API_KEY if name == "keyed" else None)
            self._serve[name] = s
        return s

    def pd(self) -> PD:
        if self._pd is None or any(not alive(p) for p in self._pd.processes().values()):
            if self._pd is not None:
                self._pd.stop()
            log("  starting phasewise pd")
            ports = [free_port() for _ in range(4)]
            while len(set(ports)) < 4:
                ports = [free_port() for _ in range(4)]
            router, decode, prefill, kv = ports
            launcher = start_server(self.model, self._log("pd"), "--decode-port", str(decode),
                                    "--prefill-port", str(prefill), "--kv-port", str(kv),
                                    command="pd", port=router, timeout=300)
            self._pd = PD(launcher, _pd_roles(launcher.proc.pid), decode, prefill, kv)
        return self._pd

    def processes(self, name: str) -> dict[str, int]:
        """Role -> PID of what ``name`` (a serve name or ``pd``) runs now."""
        if name == "pd":
            return self._pd.processes() if self._pd else {}
        s = self._serve.get(name)
        return {f"serve ({name})": s.proc.pid} if s else {}

    def log_text(self, name: str) -> str:
        path = self.logs / f"{name}.{self._starts[name]}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        for s in self._serve.values():
            s.stop()
        if self._pd is not None:
            self._pd.stop()


# -- one row of the table --------------------------------------------------------------------

@dataclass
class Row:
    """One attack class (or a part of one): what was sent and what came of it."""

    name: str
    statuses: Counter = field(default_factory=Counter)
    expected_5xx: frozenset = frozenset()  # 5xx the class's defence answers by design
    crashes: int = 0
    gap_ms: float | None = None
    base_ms: float | None = None
    rss: tuple[float | None, float | None] | None = None
    notes: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)
    skipped: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, status: int | str) -> None:
        with self._lock:
            self.statuses[status] += 1

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    @property
    def unexpected_5xx(self) -> int:
        return sum(n for s, n in self.statuses.items()
                   if isinstance(s, int) and s >= 500 and s not in self.expected_5xx)

    def expect(self, ok: bool, miss: str) -> None:
        if not ok:
            self.misses.append(miss)


def compact(c: Counter) -> str:
    """Counter({400: 40, 200: 10}) -> '400x40 200x10', most common first."""
    return " ".join(f"{k}x{n}" for k, n in c.most_common()) or "-"


def error_of(r: httpx.Response) -> dict[str, Any]:
    try:
        err = r.json().get("error")
        return err if isinstance(err, dict) else {}
    except (ValueError, AttributeError):
        return {}


def client(address: str, base_url: str, timeout: float = 120,
           headers: dict[str, str] | None = None) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=timeout, headers=headers,
                        transport=httpx.HTTPTransport(local_address=address))


def status_of(r: httpx.Response | None) -> int | str:
    return r.status_code if r is not None else "no answer"


def data_events(lines: list[str]) -> list[Any]:
    """The JSON of each ``data:`` line of a server-sent event stream ([DONE] as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            try:
                out.append(json.loads(line[6:]))
            except ValueError:
                out.append(line[6:])
    return out


def is_error(event: Any) -> bool:
    return isinstance(event, dict) and "error" in event


def send(c: httpx.Client, row: Row, path: str, body: Any, **kw: Any) -> httpx.Response | None:
    """POST ``body`` (an object, or JSON text as it is, so it can hold what ``json.dumps``
    cannot write); counts the status, or the exception's name when no answer came."""
    content = body if isinstance(body, (bytes, str)) else dumps(body)
    try:
        r = c.post(path, content=content, headers=kw.pop("headers", JSON), **kw)
    except httpx.HTTPError as e:
        row.count(type(e).__name__)
        return None
    row.count(r.status_code)
    return r


def stream_lines(c: httpx.Client, row: Row, path: str, body: str) -> tuple[int | None, list[str]]:
    """A streamed POST: its status and every line of its reply."""
    try:
        with c.stream("POST", path, content=body, headers=JSON) as r:
            row.count(r.status_code)
            return r.status_code, [x for x in r.iter_lines() if x]
    except httpx.HTTPError as e:
        row.count(type(e).__name__)
        return None, []


# -- the victim ------------------------------------------------------------------------------

class Victim:
    """Greedy streamed completions from their own address, one after another, until the
    ``with`` block ends (then the stream in flight is read to its end). They run in a process
    of their own (this script with ``--victim``), so that this process's work (building an
    8 MB body, parsing a 20 MB answer) cannot delay their reading. ``max_gap_ms``: the largest
    gap between two tokens of one stream, over all of them; ``gap_during(t0, t1)``: the
    largest that overlapped that span (CLOCK_MONOTONIC is shared by the processes)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None,
                 min_streams: int = 1) -> None:
        self.url, self.headers, self.min_streams = url, headers, min_streams
        self.gaps: list[tuple[float, float]] = []  # (token's arrival, gap before it)
        self.streams = 0
        self.failures: Counter = Counter()
        self.first = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)

    @property
    def max_gap_ms(self) -> float:
        return 1e3 * max((g for _, g in self.gaps), default=0.0)

    def gap_during(self, t0: float, t1: float) -> float:
        """In ms."""
        return 1e3 * max((g for end, g in list(self.gaps) if end >= t0 and end - g <= t1),
                         default=0.0)

    def __enter__(self) -> Victim:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.hostile_pass", "--victim", self.url,
             json.dumps(self.headers or {}), str(self.min_streams)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reader.start()
        if not self.first.wait(120):
            self.failures["no first token in 120 s"] += 1
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.stdin.close()  # its cue to stop after the stream in flight
        try:
            self._proc.wait(600)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(10)

    def _read(self) -> None:
        """The victim process's lines: ``gap END GAP``, ``first``, ``stream``, ``fail WHY``."""
        for line in self._proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "gap":
                end, gap = map(float, rest.split())
                self.gaps.append((end, gap))
            elif kind == "stream":
                self.streams += 1
            elif kind == "fail":
                self.failures[rest] += 1
            if kind in ("first", "fail"):  # a failed victim must not hold the attack back
                self.first.set()
        if self.streams == 0 and not self.failures:  # it died before it could say why
            self.failures[f"the victim process ended with status {self._proc.wait()}"] += 1
        self.first.set()


def victim_process(url: str, headers: dict[str, str], min_streams: int) -> int:
    """``--victim``: streams until stdin closes and ``min_streams`` streams finished."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    streams = 0

    def say(line: str) -> None:
        print(line, flush=True)

    def one(c: httpx.Client) -> bool:
        last = None
        try:
            with c.stream("POST", "/v1/completions", json=VICTIM_BODY) as r:
                if r.status_code != 200:
                    say(f"fail status {r.status_code}")
                    return False
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.monotonic()
                    if is_error(data_events([line])[0]):
                        say("fail error event")
                        return False
                    if last is None:
                        say("first")
                    else:
                        say(f"gap {now:.6f} {now - last:.6f}")
                    last = now
        except httpx.HTTPError as e:
            say(f"fail {type(e).__name__}")
            return False
        say("stream")
        return True

    with client(VICTIM, url, headers=headers) as c:
        while not (stop.is_set() and streams >= min_streams):
            if one(c):
                streams += 1
            elif stop.is_set():
                break
            else:
                time.sleep(0.5)
    return 0


# -- the run ---------------------------------------------------------------------------------

class Pass:
    """Runs the classes; holds the servers, the scale and each target's baseline gap."""

    def __init__(self, servers: Servers, scale: Scale) -> None:
        self.servers, self.scale = servers, scale
        self._baselines: dict[str, float] = {}

    def baseline_ms(self, url: str, headers: dict[str, str] | None = None) -> float:
        """The largest gap of victims with no attack (two streams, after a warm-up one)."""
        if url not in self._baselines:
            with Victim(url, headers, min_streams=1):
                pass
            with Victim(url, headers, min_streams=2) as v:
                pass
            self._baselines[url] = v.max_gap_ms
        return self._baselines[url]

    @contextmanager
    def attack(self, row: Row, url: str, pid: int | None,
               headers: dict[str, str] | None = None) -> Iterator[Victim]:
        """Around an attack: the baseline, a victim, and ``pid``'s RSS before and after.
        The row's gap is the largest that overlapped the attack (the victim's last stream
        may run on after it)."""
        row.base_ms = self.baseline_ms(url, headers)
        before = proc_mb(pid) if pid else None
        with Victim(url, headers) as v:
            start = time.monotonic()
            yield v
            end = time.monotonic()
        row.gap_ms = v.gap_during(start, end)
        if v.failures:
            row.misses.append(f"victim failed: {compact(v.failures)}")
        row.notes.append(f"victim: {v.streams} stream(s) over the {end - start:.1f} s attack, "
                         f"largest gap {row.gap_ms:.1f} ms (baseline {row.base_ms:.1f} ms)")
        if pid:
            row.rss = (before, proc_mb(pid))
            if None not in row.rss and row.rss[1] - row.rss[0] > 50:
                time.sleep(5)  # is it given back once the attack is over?
                row.notes.append(f"RSS 5 s later: {proc_mb(pid) or 0:.0f} MB")


CLASSES: dict[int, tuple[str, str, Callable[[Pass], list[Row]]]] = {}


def attack_class(number: int, name: str, target: str):
    """Registers a class: ``target`` is the server it attacks (its crashes are counted)."""
    def register(fn: Callable[[Pass], list[Row]]) -> Callable[[Pass], list[Row]]:
        CLASSES[number] = (name, target, fn)
        return fn
    return register


# -- payloads --------------------------------------------------------------------------------

def ref_chain(levels: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["a"]} for i in range(levels)}
    defs[f"d{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def ref_cycle(levels: int) -> dict:
    """``levels`` definitions, each one's optional property the next, the last the first."""
    return {"$defs": {f"d{i}": {"type": "object", "properties": {
        "a": {"$ref": f"#/$defs/d{(i + 1) % levels}"}}} for i in range(levels)},
        "$ref": "#/$defs/d0"}


def rule_chain(rules: int) -> str:
    return "\n".join(["start: r0"] + [f'r{i}: "t{i}" r{i + 1}?' for i in range(rules)]
                     + [f'r{rules}: "end"'])


def wide_schema(props: int, prefix: str = "p", required: bool = False) -> dict:
    names = [f"{prefix}{i}" for i in range(props)]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}}
    if required:
        schema["required"] = names
    return schema


def wide_objects(count: int, prefix: str = "p") -> dict:
    """An object of ``count`` required objects of two required fields: about 0.4 s of CPU to
    compile and start at 2,500, and within every bound."""
    inner = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
             "required": ["a", "b"]}
    names = [f"{prefix}{i}" for i in range(count)]
    return {"type": "object", "properties": {n: inner for n in names}, "required": names}


def nested_arrays(levels: int) -> str:
    """JSON text of an array schema ``levels`` deep (too deep for json.dumps)."""
    return '{"type":"array","items":' * levels + '{"type":"integer"}' + "}" * levels


def nested_lists(levels: int) -> str:
    return "[" * levels + "]" * levels


def schema_bodies(schema: str, routes: str = "chat completions responses"
                  ) -> list[tuple[str, str, str]]:
    """(route, path, body) carrying ``schema`` (JSON text) as each route's structured output."""
    out = []
    if "chat" in routes:
        out.append(("chat response_format", "/v1/chat/completions",
                    '{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,'
                    '"response_format":{"type":"json_schema","json_schema":{"name":"x",'
                    f'"schema":{schema}}}}}}}'))
    if "completions" in routes:
        out.append(("guided_json", "/v1/completions",
                    f'{{"prompt":"x","max_tokens":4,"guided_json":{schema}}}'))
    if "responses" in routes:
        out.append(("responses text.format", "/v1/responses",
                    '{"input":"hi","max_output_tokens":16,"text":{"format":{"type":'
                    f'"json_schema","name":"x","schema":{schema}}}}}}}'))
    return out


def crash_payloads(scale: Scale) -> list[tuple[str, str, str]]:
    """Class 1's grammars: (what, path, body), each of them to be a 400."""
    out = []
    for n in scale.ref_chains:
        out += [(f"$ref chain {n} via {r}", p, b) for r, p, b in schema_bodies(dumps(ref_chain(n)))]
    for n in scale.rule_chains:
        out.append((f"Lark rule chain {n}", "/v1/completions",
                    dumps({"prompt": "x", "max_tokens": 4, "guided_grammar": rule_chain(n)})))
    out += [(f"cycle of 500 defs via {r}", p, b)
            for r, p, b in schema_bodies(dumps(ref_cycle(500)), "chat completions")]
    # within every bound (depth 2, 6,001 subschemas), yet deep enough in llguidance's
    # recursion to overflow the check's 1 MiB stack: the child's crash is what refuses it
    out.append(("6000 properties (within the bounds)", "/v1/completions",
                dumps({"prompt": "x", "max_tokens": 4, "guided_json": wide_schema(6000)})))
    out += [(f"{scale.wide_props} properties via {r}", p, b)
            for r, p, b in schema_bodies(dumps(wide_schema(scale.wide_props)),
                                         "chat completions")]
    out += [(f"arrays 200 deep via {r}", p, b)
            for r, p, b in schema_bodies(nested_arrays(200), "completions")]
    out += [(f"arrays 5000 deep via {r}", p, b) for r, p, b in schema_bodies(nested_arrays(5000))]
    out.append(("[[...]] 5000 deep as a schema's const", "/v1/completions",
                '{"prompt":"x","max_tokens":4,"guided_json":{"const":'
                + nested_lists(5000) + "}}"))
    out.append(("[[...]] 5000 deep as the prompt", "/v1/completions",
                '{"max_tokens":4,"prompt":' + nested_lists(5000) + "}"))
    return out


def send_all_expecting_400(c: httpx.Client, row: Row, victim: Victim,
                           payloads: list[tuple[str, str, str]]) -> None:
    """Each payload; misses any that was not a 400, and notes those, the slow ones, those
    not refused as grammars, and those the victim felt (a gap over 3x its baseline)."""
    codes: Counter = Counter()
    for what, path, body in payloads:
        t0 = time.monotonic()
        r = send(c, row, path, body)
        t1 = time.monotonic()
        gap = victim.gap_during(t0, t1)
        status, err = status_of(r), error_of(r) if r is not None else {}
        codes[err.get("code") or "no code"] += 1
        row.expect(status == 400, f"{what}: {status} {str(err.get('message', ''))[:120]}")
        if (t1 - t0 > 5 or status != 400 or err.get("code") != "invalid_grammar"
                or gap > 3 * (row.base_ms or 0)):
            row.notes.append(f"{what} ({len(body) / 1e3:.0f} kB): {status} {err.get('code')} "
                             f"in {t1 - t0:.1f} s, victim gap {gap:.0f} ms: "
                             f"{str(err.get('message', ''))[:80]}")
    row.notes.append(f"400 codes: {compact(codes)}")


# -- 1-4: grammars ---------------------------------------------------------------------------

@attack_class(1, "grammar-crash", "main")
def grammar_crash(p: Pass) -> list[Row]:
    s = p.servers.serve()
    row = Row("grammar-crash")
    payloads = crash_payloads(p.scale)
    with p.attack(row, s.url, s.proc.pid) as victim, client(ATTACKER, s.url) as c:
        send_all_expecting_400(c, row, victim, payloads)
    return [row]


def regex_body(pattern: str, n: int, max_tokens: int = 30) -> dict:
    return {"prompt": "x", "n": n, "max_tokens": max_tokens, "guided_regex": pattern}


@attack_class(2, "grammar-cost", "main")
def grammar_cost(p: Pass) -> list[Row]:
    s = p.servers.serve()
    n = p.scale.heavy_n
    refused = [
        ("(a{1000}){1000}", regex_body("(a{1000}){1000}", 16)),
        ("(a{100}){101}", regex_body("(a{100}){101}", 16)),
        ("schema pattern (a{1000}){1000}", {"prompt": "x", "n": 16, "max_tokens": 30,
                                             "guided_json": {"type": "string",
                                                             "pattern": "(a{1000}){1000}"}}),
        ("Lark terminal /(a{1000}){1000}/", {"prompt": "x", "n": 16, "max_tokens": 30,
                                              "guided_grammar": "start: A\nA: /(a{1000}){1000}/"}),
        ("chat schema pattern (a{100}){101}", {
            "messages": [{"role": "user", "content": "hi"}], "n": 16, "max_tokens": 30,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "string", "pattern": "(a{100}){101}"}}}}),
    ]
    allowed = [
        ("(a{100}){100}", regex_body("(a{100}){100}", n)),
        ("([a-z]{100}){100}", regex_body("([a-z]{100}){100}", n)),
        ("schema pattern (a{100}){100}", {"prompt": "x", "n": n, "max_tokens": 30,
                                           "guided_json": {"type": "string",
                                                           "pattern": "(a{100}){100}"}}),
        ("Lark terminal /(a{100}){100}/", {"prompt": "x", "n": n, "max_tokens": 30,
                                            "guided_grammar": "start: A\nA: /(a{100}){100}/"}),
        ("2,500 required objects", {"prompt": "x", "n": n, "max_tokens": 30,
                                     "guided_json": wide_objects(2500, "q")}),
    ]
    rows = []
    for label, cases in (("refused", refused), (f"allowed, n={n}", allowed)):
        row = Row(f"grammar-cost ({label})")
        with p.attack(row, s.url, s.proc.pid) as victim, client(ATTACKER, s.url) as c:
            for what, body in cases:
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                t0 = time.monotonic()
                r = send(c, row, path, body)
                t1 = time.monotonic()
                status, err = status_of(r), error_of(r) if r is not None else {}
                row.notes.append(f"{what}: {status} {err.get('code') or ''} in {t1 - t0:.2f} s, "
                                 f"victim gap {victim.gap_during(t0, t1):.0f} ms"
                                 + (f" ({err.get('message', '')[:100]})" if err else ""))
                if cases is refused:
                    row.expect(status == 400, f"{what}: {status}, not a 400")
                else:
                    row.expect(status in (200, 400), f"{what}: {status}")
        rows.append(row)
    return rows


@attack_class(3, "grammar-fairness", "main")
def grammar_fairness(p: Pass) -> list[Row]:
    """A's grammars are each slow to check but pass (``wide_objects(2500)``, the slowest
    found); B's are json_object."""
    s = p.servers.serve()
    row = Row("grammar-fairness (A)")
    b_row = Row("B")
    tag = f"{os.getpid()}{int(time.time())}"  # fresh schemas: none checked before
    a_bodies = [{"prompt": "x", "max_tokens": 4,
                 "guided_json": wide_objects(2500, f"a{tag}_{i}_")}
                for i in range(p.scale.fair_a)]
    b_body = {"messages": [{"role": "user", "content": "Say hi in JSON."}], "max_tokens": 8,
              "response_format": {"type": "json_object"}}
    b_latency: list[float] = []

    def b_one(_: int) -> None:
        with client(CLIENT_B, s.url) as c:
            t0 = time.monotonic()
            send(c, b_row, "/v1/chat/completions", b_body)
            b_latency.append(time.monotonic() - t0)

    def a_one(body: dict) -> None:
        with client(CLIENT_A, s.url) as c:
            send(c, row, "/v1/completions", body)

    t0 = time.monotonic()
    with p.attack(row, s.url, s.proc.pid), ThreadPoolExecutor(p.scale.fair_a) as a_pool:
        a_done = [a_pool.submit(a_one, b) for b in a_bodies]
        time.sleep(0.3)  # A's checks are under way before B asks
        with ThreadPoolExecutor(p.scale.fair_b) as b_pool:
            list(b_pool.map(b_one, range(p.scale.fair_b)))
        b_took = time.monotonic() - t0
        for f in a_done:
            f.result()
    a_took = time.monotonic() - t0
    row.notes.append(f"A: {p.scale.fair_a} schemas of 2,500 required objects: "
                     f"{compact(row.statuses)}, all answered in {a_took:.1f} s")
    row.notes.append(f"B: {p.scale.fair_b} json_object requests at once: "
                     f"{compact(b_row.statuses)}, slowest {max(b_latency) * 1e3:.0f} ms, "
                     f"all answered {b_took:.1f} s after A began")
    row.expect(b_row.statuses == Counter({200: p.scale.fair_b}),
               f"B got {compact(b_row.statuses)}")
    row.expect(b_row.unexpected_5xx == 0, "B got 5xx")
    return [row]


@attack_class(4, "grammar-memory", "main")
def grammar_memory(p: Pass) -> list[Row]:
    s = p.servers.serve()
    row = Row("grammar-memory")
    pid = s.proc.pid
    with p.attack(row, s.url, pid), client(ATTACKER, s.url) as c:
        start = proc_mb(pid)
        for n in range(1000, 990, -1):
            r = send(c, row, "/v1/completions", regex_body(f"(a{{1000}}){{{n}}}", 1, 2))
            row.expect(r is not None and r.status_code == 400, f"(a{{1000}}){{{n}}}: not a 400")
        after_refused = proc_mb(pid)
        # distinct grammars that pass, each kept compiled within the cache's 256 MB budget
        for k in range(p.scale.allowed_regexes):
            r = send(c, row, "/v1/completions", regex_body(f"(a{{100}}){{{61 + k}}}", 1, 2))
            row.expect(r is not None and r.status_code == 200,
                       f"(a{{100}}){{{61 + k}}}: {r.status_code if r else 'no answer'}")
        after_allowed = proc_mb(pid)
    row.notes.append(f"RSS {start:.0f} MB -> {after_refused:.0f} after 10 refused "
                     f"(a{{1000}}){{N}} -> {after_allowed:.0f} after "
                     f"{p.scale.allowed_regexes} allowed (a{{100}}){{61..}}")
    row.expect(after_refused - start < 50, f"refused grammars kept "
               f"{after_refused - start:.0f} MB")
    row.expect(after_allowed - after_refused < 256 + 64,
               f"allowed grammars took {after_allowed - after_refused:.0f} MB, over the "
               "cache's 256 MB budget")
    return [row]


# -- 5: lone surrogates ----------------------------------------------------------------------

SURROGATE = "@SURROGATE@"


def with_surrogate(body: dict) -> str:
    """``body`` as JSON text, each ``SURROGATE`` string (key or value) a lone ``\\ud800``."""
    return dumps(body).replace(f'"{SURROGATE}"', '"\\ud800"')


def surrogate_cases() -> list[tuple[str, str, dict]]:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def tool(parameters: dict) -> dict:
        return {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": parameters}}]}

    schema_key = {"type": "object", "properties": {SURROGATE: {"type": "string"}}}
    responses = {"input": "hi", "max_output_tokens": 16}
    return [
        ("tools parameters key", "/v1/chat/completions",
         tool({"type": "object", "properties": {SURROGATE: {"type": "string"}}})),
        ("tools parameters value", "/v1/chat/completions",
         tool({"type": "object", "description": SURROGATE})),
        ("responses metadata key", "/v1/responses", {**responses, "metadata": {SURROGATE: "v"}}),
        ("responses metadata value", "/v1/responses",
         {**responses, "metadata": {"k": SURROGATE}}),
        ("chat response_format schema key", "/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema", "json_schema": {
             "name": "x", "schema": schema_key}}}),
        ("guided_json schema key", "/v1/completions",
         {"prompt": "x", "max_tokens": 4, "guided_json": schema_key}),
        ("responses text.format schema key", "/v1/responses",
         {**responses, "text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": schema_key}}}),
        ("chat_template_kwargs value", "/v1/chat/completions",
         {**chat, "chat_template_kwargs": {"k": SURROGATE}}),
        ("prompt", "/v1/completions", {"prompt": SURROGATE, "max_tokens": 4}),
    ]


def stream_ends_cleanly(path: str, lines: list[str]) -> bool:
    """A failed stream's end: an error event then [DONE], or Responses' response.failed."""
    if path == "/v1/responses":
        return any(x == "event: response.failed" for x in lines)
    events = data_events(lines)
    return len(events) >= 2 and events[-1] == "[DONE]" and is_error(events[-2])


@attack_class(5, "surrogates", "main")
def surrogates(p: Pass) -> list[Row]:
    s = p.servers.serve()
    row = Row("surrogates")
    params: Counter = Counter()
    with p.attack(row, s.url, s.proc.pid), client(ATTACKER, s.url) as c:
        for what, path, body in surrogate_cases():
            for stream in (False, True):
                text = with_surrogate({**body, "stream": stream})
                label = f"{what}{' (streamed)' if stream else ''}"
                if not stream:
                    r = send(c, row, path, text)
                    status = r.status_code if r is not None else None
                    if status == 400:
                        params[error_of(r).get("param")] += 1
                    row.expect(status == 400, f"{label}: {status}, not a 400")
                    continue
                status, lines = stream_lines(c, row, path, text)
                if status == 400:
                    params[error_of_lines(lines).get("param")] += 1
                elif status == 200:
                    clean = stream_ends_cleanly(path, lines)
                    row.notes.append(f"{label}: 200, then {'an' if clean else 'no'} error event")
                    row.expect(clean, f"{label}: streamed without ending in an error: "
                               f"{lines[-2:]}")
                else:
                    row.misses.append(f"{label}: {status}")
    row.notes.append("400 params: " + "; ".join(f"{k} x{n}" for k, n in params.items()))
    return [row]


def error_of_lines(lines: list[str]) -> dict[str, Any]:
    try:
        return json.loads("".join(lines)).get("error") or {}
    except (ValueError, AttributeError):
        return {}


# -- 6: large bodies -------------------------------------------------------------------------

def empty_messages_body(count: int = 280_000) -> str:
    """``count`` empty chat messages in compact JSON (280,000: 8.1 MB, under the limit)."""
    return ('{"messages":[' + ",".join(['{"role":"user","content":""}'] * count)
            + '],"max_tokens":4}')


def token_ids_body(limit: int = BODY_LIMIT) -> str:
    """One prompt of as many 4-digit token ids as fit in ``limit`` bytes."""
    head, tail = '{"max_tokens":1,"prompt":[', "]}"
    count = (limit - len(head) - len(tail) + 1) // 5
    return head + ",".join(["1000"] * count) + tail


@attack_class(6, "large-bodies", "main")
def large_bodies(p: Pass) -> list[Row]:
    s = p.servers.serve()
    row = Row("large-bodies")
    messages, ids = empty_messages_body(), token_ids_body()
    n_messages = messages.count('"role"')
    at_once = p.scale.empty_messages_at_once

    def one(path: str, body: str) -> str:
        with client(ATTACKER, s.url) as c:
            t0 = time.monotonic()
            r = send(c, row, path, body)
            code = error_of(r).get("code") if r is not None else None
            return f"{status_of(r)} {code or ''} in {time.monotonic() - t0:.1f} s"

    def case(victim: Victim, what: str, run: Callable[[], str]) -> None:
        t0 = time.monotonic()
        got = run()
        row.notes.append(f"{what}: {got}; victim gap meanwhile "
                         f"{victim.gap_during(t0, time.monotonic()):.0f} ms")

    with p.attack(row, s.url, s.proc.pid) as victim:
        case(victim, f"{len(messages) / 2**20:.2f} MiB chat body of {n_messages:,} empty "
             "messages", lambda: one("/v1/chat/completions", messages))
        with ThreadPoolExecutor(at_once) as pool:
            case(victim, f"{at_once} of them at once", lambda: "; ".join(
                pool.map(lambda _: one("/v1/chat/completions", messages), range(at_once))))
        case(victim, f"{len(ids) / 2**20:.2f} MiB of token ids ({ids.count(',') + 1:,}) to "
             "/v1/completions", lambda: one("/v1/completions", ids))
    row.expect(set(row.statuses) <= {400, 413}, f"not all 400/413: {compact(row.statuses)}")
    return [row]


# -- 7: slowloris ----------------------------------------------------------------------------

@dataclass
class Conn:
    kind: str
    sock: socket.socket | None
    opened: float
    got: bytes = b""
    outcome: str | None = None
    closed_after: float | None = None
    reset: bool = False


PARTIAL_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
SLOW_BODY_HEADERS = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")


def slowloris(port: int, connections: int, cap_s: float) -> list[Conn]:
    """Opens ``connections`` from RAW_ATTACKER: by turns partial headers, headers then a body
    byte a second, nothing; reads each until the server closes it (or ``cap_s``)."""
    conns = []
    sel = selectors.DefaultSelector()
    t0 = time.monotonic()
    for i in range(connections):
        kind = ("partial headers", "slow body", "nothing")[i % 3]
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                            source_address=(RAW_ATTACKER, 0))
        except OSError as e:
            conns.append(Conn(kind, None, time.monotonic(), outcome=type(e).__name__))
            continue
        conn = Conn(kind, sock, time.monotonic())
        try:
            if kind == "partial headers":
                sock.sendall(PARTIAL_HEADERS)
            elif kind == "slow body":
                sock.sendall(SLOW_BODY_HEADERS + b"{")
        except OSError as e:
            conn.outcome = type(e).__name__
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, conn)
        conns.append(conn)
    next_byte = time.monotonic() + 1
    while sel.get_map() and time.monotonic() - t0 < cap_s:
        for key, _ in sel.select(timeout=0.2):
            conn = key.data
            try:
                chunk = conn.sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk, conn.reset = b"", True
            if chunk:
                conn.got += chunk
                continue
            sel.unregister(conn.sock)
            conn.closed_after = time.monotonic() - conn.opened
            conn.sock.close()
        if time.monotonic() >= next_byte:
            next_byte += 1
            for key in list(sel.get_map().values()):
                conn = key.data
                if conn.kind == "slow body" and not conn.got:
                    try:
                        conn.sock.send(b" ")
                    except OSError:
                        pass
    for key in list(sel.get_map().values()):
        key.data.sock.close()
    for conn in conns:
        if conn.outcome is None:
            conn.outcome = outcome_of(conn)
    return conns


def outcome_of(conn: Conn) -> str:
    """A status, or how the connection ended without one. A refusal of a connection that
    had sent bytes the server never read ends in a TCP reset, which can overtake its 503:
    ``reset at once``."""
    status = re.match(rb"HTTP/1\.[01] (\d{3})", conn.got)
    if status:
        return status.group(1).decode()
    if conn.closed_after is None:
        return "open at cap"
    if conn.closed_after < 2:
        return "reset at once" if conn.reset else "closed at once"
    return "closed"


@attack_class(7, "slowloris", "main")
def slowloris_class(p: Pass) -> list[Row]:
    s = p.servers.serve()
    row = Row("slowloris", expected_5xx=frozenset({503}))
    legit = Row("legit")
    legit_ms: list[float] = []
    done = threading.Event()

    def legit_client() -> None:
        with client(BYSTANDER, s.url) as c:
            while not done.is_set():
                t0 = time.monotonic()
                send(c, legit, "/v1/completions", SMALL)
                legit_ms.append((time.monotonic() - t0) * 1e3)
                done.wait(1.0)

    with p.attack(row, s.url, s.proc.pid):
        bystander = threading.Thread(target=legit_client)
        bystander.start()
        try:
            conns = slowloris(s.port, p.scale.slow_connections, p.scale.slow_cap_s)
        finally:
            done.set()
            bystander.join()
    for conn in conns:
        row.count(int(conn.outcome) if conn.outcome.isdigit() else conn.outcome)
    for kind in ("partial headers", "slow body", "nothing"):
        mine = [c for c in conns if c.kind == kind]
        by: dict[str, list[float]] = {}
        for c in mine:
            by.setdefault(c.outcome, []).append(c.closed_after if c.closed_after is not None
                                                else float("nan"))
        row.notes.append(f"{kind} ({len(mine)}): " + ", ".join(
            f"{o} x{len(t)}" + (f" (closed after {min(t):.1f}-{max(t):.1f} s)"
                                if all(x == x for x in t) else "")
            for o, t in sorted(by.items(), key=lambda kv: -len(kv[1]))))
    row.notes.append(f"legit client from another address: {compact(legit.statuses)}, slowest "
                     f"{max(legit_ms):.0f} ms")
    row.expect(set(legit.statuses) == {200}, f"legit client got {compact(legit.statuses)}")
    refused_late = [c for c in conns if c.outcome == "503" and c.closed_after is not None
                    and c.closed_after > 2]
    row.expect(not refused_late, f"{len(refused_late)} refusals took over 2 s")
    if p.scale.slow_cap_s > BODY_TIMEOUT_S + HEADER_TIMEOUT_S:
        still = [c for c in conns if c.outcome == "open at cap"]
        row.expect(not still, f"{len(still)} connections still open after "
                   f"{p.scale.slow_cap_s:.0f} s")
    # (the server's clock starts at its accept, a moment before this side's)
    late_408 = [c for c in conns if c.outcome == "408"
                and not HEADER_TIMEOUT_S - 1 <= c.closed_after < HEADER_TIMEOUT_S + 5]
    row.expect(not late_408, f"{len(late_408)} 408 answer(s) outside {HEADER_TIMEOUT_S}"
               f"-{HEADER_TIMEOUT_S + 5} s")
    odd_closes = [c for c in conns if c.outcome == "closed" and not (
        c.kind == "slow body" and BODY_TIMEOUT_S - 1 <= c.closed_after < BODY_TIMEOUT_S + 5)]
    row.expect(not odd_closes, f"{len(odd_closes)} closed without an answer, and not a "
               "slow body at its timeout")
    unexpected = {o for o in row.statuses
                  if o not in (503, 408, "closed", "open at cap", "reset at once")}
    row.expect(not unexpected, f"unexpected outcomes {unexpected}")
    return [row]


# -- 8: wrong keys ---------------------------------------------------------------------------

@attack_class(8, "brute-force", "keyed")
def brute_force(p: Pass) -> list[Row]:
    s = p.servers.serve("keyed")
    good = {"Authorization": f"Bearer {API_KEY}"}
    row = Row("brute-force")
    with p.attack(row, s.url, s.proc.pid, headers=good):
        with client(ATTACKER, s.url) as c:
            t0 = time.monotonic()
            for i in range(p.scale.wrong_keys):
                send(c, row, "/v1/completions", SMALL,
                     headers={**JSON, "Authorization": f"Bearer guess-{i}"})
            bearer = Counter(row.statuses)
            guessing_s = time.monotonic() - t0
            r_locked = send(c, row, "/v1/completions", SMALL, headers={**JSON, **good})
        with client(BYSTANDER, s.url) as c:
            r_other = send(c, row, "/v1/completions", SMALL, headers={**JSON, **good})
        logins = Row("logins")
        with client(CLIENT_A, s.url) as c:
            for i in range(p.scale.wrong_logins):
                send(c, logins, "/dashboard/login", f"key=guess-{i}",
                     headers={"content-type": "application/x-www-form-urlencoded"})
    row.statuses.update(logins.statuses)
    locked = r_locked.status_code if r_locked is not None else None
    other = r_other.status_code if r_other is not None else None
    row.notes.append(f"{p.scale.wrong_keys} wrong bearer keys from {ATTACKER}: "
                     f"{compact(bearer)}; then the right key from {ATTACKER}: {locked} "
                     f"(Retry-After {r_locked.headers.get('retry-after') if r_locked else '-'}"
                     f"), from {BYSTANDER}: {other}")
    row.notes.append(f"{p.scale.wrong_logins} wrong /dashboard/login posts from {CLIENT_A}: "
                     f"{compact(logins.statuses)}")
    row.expect(other == 200, f"right key from another address: {other}")
    row.expect(locked == 429, f"right key from the locked address: {locked}")
    # 5 compared, then one more each time a lock (1 s, doubling) ran out while guessing
    compared = 5 + 1 + int(math.log2(guessing_s + 1))
    row.expect(bearer[401] <= compared and bearer[429] >= p.scale.wrong_keys - compared,
               f"bearer guesses {compact(bearer)} in {guessing_s:.1f} s")
    row.expect(logins.statuses[429] >= p.scale.wrong_logins - 5,
               f"login guesses {compact(logins.statuses)}")
    return [row]


# -- 9: tokenize -----------------------------------------------------------------------------

@attack_class(9, "tokenize", "main")
def tokenize(p: Pass) -> list[Row]:
    s = p.servers.serve()
    row = Row("tokenize")
    small = Row("small")
    small_body = {"prompt": "def fibonacci(n):"}

    def small_ms(c: httpx.Client) -> float:
        t0 = time.monotonic()
        send(c, small, "/tokenize", small_body)
        return (time.monotonic() - t0) * 1e3

    with client(BYSTANDER, s.url) as c:
        base = max(small_ms(c) for _ in range(20))
    small.statuses.clear()
    big = json.dumps({"prompt": "\U0001F600" * p.scale.emoji}, ensure_ascii=False).encode()
    result: dict[str, Any] = {}

    def big_one() -> None:
        with client(ATTACKER, s.url) as c:
            t0 = time.monotonic()
            r = send(c, row, "/tokenize", big)
            result["took"] = time.monotonic() - t0
            result["answer"] = (f"{r.status_code} count={r.json().get('count')}"
                                if r is not None and r.status_code == 200 else
                                f"{r.status_code if r is not None else 'no answer'} "
                                f"{error_of(r).get('message', '')[:100] if r is not None else ''}")

    with p.attack(row, s.url, s.proc.pid):
        sender = threading.Thread(target=big_one)
        sender.start()
        time.sleep(0.05)
        took = []
        with client(BYSTANDER, s.url) as c:
            while sender.is_alive() or len(took) < 20:
                took.append(small_ms(c))
                time.sleep(0.05)
        sender.join()
    row.notes.append(f"/tokenize of {p.scale.emoji:,} emoji ({len(big) / 2**20:.1f} MiB): "
                     f"{result.get('answer')} in {result.get('took', 0):.1f} s")
    row.notes.append(f"{len(took)} small /tokenize from {BYSTANDER} meanwhile: "
                     f"{compact(small.statuses)}, slowest {max(took):.0f} ms (baseline slowest "
                     f"of 20: {base:.0f} ms)")
    row.expect(set(small.statuses) == {200}, f"small ones got {compact(small.statuses)}")
    row.expect(max(took) < max(10 * base, 250), f"a small /tokenize took {max(took):.0f} ms")
    return [row]


# -- 10: the relay's parameters --------------------------------------------------------------

@attack_class(10, "relay", "main")
def relay(p: Pass) -> list[Row]:
    s = p.servers.serve()  # its role is both: it serves the internal API a router calls
    row = Row("relay")
    ids = httpx.post(s.url + "/tokenize", json={"prompt": "def f(x):"}, timeout=30).json()["tokens"]
    bad = {"ignore_eos": "no", "skip_special_tokens": "yes", "max_tokens": "4",
           "temperature": True, "stop": 5, "seed": 2**70, "logprobs": -1, "bogus": 1,
           "structured_output": dumps({"type": "regex", "pattern": "(a{1000}){1000}"})}
    with p.attack(row, s.url, s.proc.pid), client(ATTACKER, s.url) as c:
        for i, (name, value) in enumerate(bad.items()):
            body = {"request_id": f"hostile-{i}", "specs": [
                {"token_ids": ids, "params": {"max_tokens": 4, name: value}}]}
            r = send(c, row, "/internal/v1/generate", body)
            status = r.status_code if r is not None else None
            param = error_of(r).get("param") if r is not None else None
            row.notes.append(f"{name}={value!r:.40}: {status} param={param}")
            row.expect(status == 400, f"{name}: {status}, not a 400")
            if name in ("ignore_eos", "skip_special_tokens"):
                row.expect(param == f"specs.0.params.{name}", f"{name}: param {param}")
    return [row]


# -- 11-13: P/D ------------------------------------------------------------------------------

def router_request(url: str, kind: str, row: Row) -> None:
    try:
        _router_request(url, kind, row)
    except httpx.HTTPError as e:
        row.count(type(e).__name__)


def _router_request(url: str, kind: str, row: Row) -> None:
    body: dict[str, Any] = {"prompt": "def fibonacci(n):", "max_tokens": 8,
                            "stream": "stream" in kind, "n": 2 if "n=2" in kind else 1}
    with client(ATTACKER, url, timeout=60) as c:
        if kind == "gone mid-stream":
            body.update(max_tokens=200, ignore_eos=True)
            with c.stream("POST", "/v1/completions", json=body) as r:
                row.count(r.status_code)
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines, None)
            return  # leaving the block closes the connection mid-stream
        if not body["stream"]:
            send(c, row, "/v1/completions", body)
            return
        status, lines = stream_lines(c, row, "/v1/completions", dumps(body))
        events = data_events(lines)
        if status == 200 and (not events or events[-1] != "[DONE]"
                              or any(map(is_error, events))):
            row.count("stream not ended cleanly")


@attack_class(11, "router-connections", "pd")
def router_connections(p: Pass) -> list[Row]:
    pd = p.servers.pd()
    row = Row("router-connections")
    kinds = ["stream", "not streamed", "gone mid-stream", "n=2 stream", "n=2 not streamed"]
    plan = [kinds[i % len(kinds)] for i in range(p.scale.router_requests)]
    router = pd.pids["router"]
    with p.attack(row, pd.url, router):
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda k: router_request(pd.url, k, row), plan))
    workers = {pd.decode_port, pd.prefill_port}
    right_after = sockets_to(router, workers)
    time.sleep(3)  # the router drops idle pooled connections after 2 s
    later = sockets_to(router, workers)
    health = httpx.get(pd.url + "/health", timeout=10).status_code
    row.notes.append(f"{len(plan)} requests ({', '.join(kinds)}; 6 at a time)")
    row.notes.append(f"router's sockets to the workers right after: {compact(right_after)}; "
                     f"3 s later: {compact(later)}; router /health {health}")
    row.expect(later["CLOSE_WAIT"] == 0 and right_after["CLOSE_WAIT"] == 0,
               f"CLOSE_WAIT sockets: {right_after['CLOSE_WAIT']} then {later['CLOSE_WAIT']}")
    row.expect(sum(later.values()) <= 8, f"{sum(later.values())} sockets still open")
    row.expect(health == 200, f"router /health {health}")
    row.expect(set(row.statuses) == {200}, f"not all 200: {compact(row.statuses)}")
    return [row]


@attack_class(12, "grammar-crash via router", "pd")
def grammar_crash_router(p: Pass) -> list[Row]:
    pd = p.servers.pd()
    row = Row("grammar-crash via router")
    payloads = crash_payloads(p.scale)
    with p.attack(row, pd.url, pd.pids["router"]) as victim, client(ATTACKER, pd.url) as c:
        send_all_expecting_400(c, row, victim, payloads)
    health = {role: httpx.get(url + "/health", timeout=10).status_code for role, url in
              (("router", pd.url), ("decode", pd.decode_url),
               ("prefill", f"http://127.0.0.1:{pd.prefill_port}"))}
    row.notes.append("/health: " + ", ".join(f"{k} {v}" for k, v in health.items()))
    row.expect(set(health.values()) == {200}, f"/health {health}")
    return [row]


# A ZMTP 3.0 greeting offering CURVE, as a real peer's: signature, version, mechanism,
# as-server 0, filler
ZMTP_CURVE_GREETING = (b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0])
                       + b"CURVE".ljust(20, b"\0") + b"\0" + bytes(31))


def kv_held_frames(port: int, pid: int, connections: int, cap_s: float) -> tuple[str, float]:
    """Raw connections, each a greeting and a command frame that declares the port's largest
    part and sends all of it but its last byte: zmq buffers a frame before anything is
    authenticated, so this is what strangers can make the port hold. Notes the decode
    worker's RSS with them held and how long the port kept them; returns the note and the MB
    held."""
    try:
        from phasewise.disagg.wire import KV_PART_BYTES as frame
    except ImportError:
        frame = 256 << 10
    head = ZMTP_CURVE_GREETING + b"\x06" + frame.to_bytes(8, "big")  # a long command
    body = bytes(frame - 1)
    before = proc_mb(pid)
    errors: Counter = Counter()
    socks = []
    t0 = time.monotonic()
    for _ in range(connections):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                            source_address=(RAW_ATTACKER, 0))
            sock.sendall(head + body)
            socks.append(sock)
        except OSError as e:
            errors[type(e).__name__] += 1
    time.sleep(1)
    held = proc_mb(pid)
    sel = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
    closed = []
    while sel.get_map() and time.monotonic() - t0 < cap_s:
        for key, _ in sel.select(timeout=0.5):
            try:
                if key.fileobj.recv(65536):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            sel.unregister(key.fileobj)
            closed.append(time.monotonic() - t0)
    for sock in socks:
        sock.close()
    time.sleep(1)
    kept = (f"the port closed {len(closed)} of them after {min(closed):.0f}-{max(closed):.0f} s"
            if closed else "the port closed none of them")
    note = (f"{connections} raw connections, each a CURVE greeting and {frame // 1024} KiB "
            f"less a byte of one command frame ({len(socks)} sent"
            + (f"; {compact(errors)}" if errors else "") + f"): decode RSS {before:.0f} -> "
            f"{held:.0f} MB with them held; {kept}, {len(socks) - len(closed)} still open at "
            f"{cap_s:.0f} s, then closed here; RSS {proc_mb(pid) or 0:.0f} MB a second later")
    return note, held - before


def kv_counters(decode_url: str) -> dict[str, float]:
    """The decode worker's K/V port counters of strangers' traffic, from /metrics."""
    text = httpx.get(decode_url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("phasewise:kv_") and ("unauthenticated" in line or "refused" in line
                                                 or "handshake" in line):
            name, _, value = line.rpartition(" ")
            out[name.replace("phasewise:", "")] = float(value)
    return out


def kv_send(endpoint: str, messages: list[list[Any]], settle_s: float) -> str:
    """Sends ``messages`` (each a list of parts) on a fresh DEALER with no secret, then
    watches the connection for ``settle_s``; returns what it did, from a socket monitor
    (zmq tells nothing of a message's delivery)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    names = {getattr(zmq, n): n[len("EVENT_"):].lower() for n in dir(zmq)
             if n.startswith("EVENT_") and not n.startswith("EVENT_ALL")}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    monitor = sock.get_monitor_socket()
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    events: Counter = Counter()
    queued = 0
    try:
        sock.connect(endpoint)
        for parts in messages:
            try:
                sock.send_multipart(parts, copy=False)
                queued += 1
            except zmq.Again:  # no connection took it within SNDTIMEO
                break
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            if monitor.poll(100):
                events[names.get(recv_monitor_message(monitor)["event"], "?")] += 1
    finally:
        sock.close(0)
        monitor.close(0)
        ctx.term()
    seen = ", ".join(f"{e} x{n}" if n > 1 else e for e, n in events.items())
    if any(e.startswith("handshake_failed") for e in events):
        reading = "zmq's security handshake refused it: no byte reached the application"
    elif events["handshake_succeeded"]:
        reading = "past zmq's handshake: the application judged the messages"
    else:
        reading = "no handshake"
    return f"{queued}/{len(messages)} queued; {reading} ({seen or 'no events'})"


@attack_class(13, "kv-port", "pd")
def kv_port(p: Pass) -> list[Row]:
    pd = p.servers.pd()
    row = Row("kv-port")
    pid = pd.pids["decode"]
    endpoint = f"tcp://127.0.0.1:{pd.kv_port}"
    sc = p.scale
    part = bytes(64 * 1024)
    nested = b"[" * 4000 + b"]" * 4000  # 8,000 bytes: within the 8 KiB a stranger may send
    attacks: list[tuple[str, Callable[[], list[list[Any]]], float]] = [
        (f"one {sc.kv_single_mb} MB single-part message",
         lambda: [[bytearray(sc.kv_single_mb * 2**20)]], 8),
        (f"{sc.kv_parts_mb} MB as 64 KiB parts of one message",
         lambda: [[part] * (sc.kv_parts_mb * 2**20 // len(part))], 5),
        (f"{sc.kv_json_count} x {sc.kv_json_mb} MB JSON",
         lambda: [[b'{"kind":"hello","pad":"' + b"a" * (sc.kv_json_mb * 2**20) + b'"}']] *
         sc.kv_json_count, 5),
        ("nested JSON (4,000 deep in 8 kB; 100,000 deep in 200 kB)",
         lambda: [[nested], [b"[" * 100_000 + b"]" * 100_000]], 2),
        (f"{sc.kv_junk} small junk messages",
         lambda: [[os.urandom(100)] for _ in range(sc.kv_junk)], 2),
    ]
    hwm0 = proc_mb(pid, "VmHWM")
    counters0 = kv_counters(pd.decode_url)
    with p.attack(row, pd.url, pid) as victim:
        for what, make, settle in attacks:
            messages = make()
            t0 = time.monotonic()
            try:
                outcome = kv_send(endpoint, messages, settle)
                row.count("sent")
            except Exception as e:  # noqa: BLE001 - whatever the port does is the finding
                outcome = f"client error {type(e).__name__}: {e}"
                row.count(type(e).__name__)
            del messages
            row.notes.append(f"{what}: {outcome}; decode RSS {proc_mb(pid) or 0:.0f} MB; "
                             f"victim gap {victim.gap_during(t0, time.monotonic()):.0f} ms")
        t0 = time.monotonic()
        note, held = kv_held_frames(pd.kv_port, pid, sc.kv_raw_connections,
                                    sc.kv_hold_cap_s)
        row.count("sent")
        row.notes.append(f"{note}; victim gap {victim.gap_during(t0, time.monotonic()):.0f} ms")
    time.sleep(1)
    hwm1 = proc_mb(pid, "VmHWM")
    counters1 = kv_counters(pd.decode_url)
    moved = {k: v - counters0.get(k, 0) for k, v in counters1.items()
             if v != counters0.get(k, 0)}
    row.notes.append(f"decode VmHWM {hwm0:.0f} -> {hwm1:.0f} MB (+{hwm1 - hwm0:.0f})")
    row.notes.append("decode worker's counters: " + (", ".join(
        f"{k} +{v:.0f}" for k, v in moved.items()) or "none moved"))
    with client(BYSTANDER, pd.url) as c:
        after = send(c, Row("after"), "/v1/completions", SMALL)
    row.notes.append(f"a completion through the router afterwards: "
                     f"{after.status_code if after is not None else 'no answer'}")
    row.expect(after is not None and after.status_code == 200, "P/D did not serve afterwards")
    row.expect(hwm1 - hwm0 < 100, f"decode VmHWM grew {hwm1 - hwm0:.0f} MB")
    row.expect(held < 100, f"strangers' unfinished frames held {held:.0f} MB")
    if row.rss and None not in row.rss:
        row.expect(row.rss[1] - row.rss[0] < 50,
                   f"decode RSS grew {row.rss[1] - row.rss[0]:.0f} MB")
    return [row]


# -- the report ------------------------------------------------------------------------------

# an access-log line with a 5xx status (connections refused at the cap get no such line)
SERVER_ERROR = re.compile(r"phasewise\.access: .* 5\d\d prompt=")


def run_class(p: Pass, number: int) -> list[Row]:
    name, target, fn = CLASSES[number]
    log(f"[{number}] {name}")
    t0 = time.monotonic()
    text = p.servers.log_text(target)
    tracebacks_before = text.count("Traceback")
    logged_5xx_before = len(SERVER_ERROR.findall(text))
    try:
        rows = fn(p)
    except Exception as e:  # noqa: BLE001 - one class's failure must not end the pass
        row = Row(name)
        row.skipped = f"{type(e).__name__}: {str(e)[:300]}"
        rows = [row]
    died = {role: pid for role, pid in p.servers.processes(target).items() if not alive(pid)}
    for row in rows:
        row.name = f"{number} {row.name}"
    if died:
        rows[0].crashes = len(died)
        rows[0].misses.append(f"died: {', '.join(died)} (restarted for the next classes)")
    text = p.servers.log_text(target)
    tracebacks = text.count("Traceback") - tracebacks_before
    logged_5xx = len(SERVER_ERROR.findall(text)) - logged_5xx_before
    if tracebacks > 0:
        rows[0].notes.append(f"{tracebacks} traceback(s) in the {target} server's log")
    if logged_5xx > 0:
        rows[0].misses.append(f"the {target} server's access log has {logged_5xx} 5xx line(s) "
                              "(answers no client read, or the client was gone)")
    rows[-1].notes.append(f"took {time.monotonic() - t0:.0f} s")
    return rows


def table(rows: list[Row]) -> str:
    head = ["class", "sent", "statuses", "5xx", "crashes", "victim gap ms (baseline)",
            "RSS MB before->after"]
    body = []
    for r in rows:
        if r.skipped:
            body.append([r.name, "-", "not run", "-", str(r.crashes), "-", "-"])
            continue
        gap = (f"{r.gap_ms:.1f} ({r.base_ms:.1f})" if r.gap_ms is not None
               and r.base_ms is not None else "-")
        rss = (f"{r.rss[0] or 0:.0f} -> {r.rss[1] or 0:.0f}" if r.rss else "-")
        body.append([r.name, str(r.sent), compact(r.statuses), str(r.unexpected_5xx),
                     str(r.crashes), gap, rss])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(x.ljust(w) if i in (0, 2) else x.rjust(w)
                       for i, (x, w) in enumerate(zip(cells, widths)))
             for cells in [head, *body]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def verdicts(rows: list[Row]) -> str:
    out = []
    for r in rows:
        if r.skipped:
            out.append(f"{r.name}: NOT RUN: {r.skipped}")
        else:
            misses = list(r.misses)
            if r.unexpected_5xx:
                misses.insert(0, f"{r.unexpected_5xx} unexpected 5xx")
            out.append(f"{r.name}: " + ("ok" if not misses else "MISSED: " + "; ".join(misses)))
        out += [f"    {n}" for n in r.notes]
    return "\n".join(out)


def chosen(spec: list[str] | None) -> list[int]:
    if not spec:
        return sorted(CLASSES)
    picked = set()
    for s in spec:
        for number, (name, _, _) in CLASSES.items():
            if s == str(number) or (not s.isdigit() and s in name):
                picked.add(number)
    return sorted(picked)


def main() -> int:
    if sys.argv[1:2] == ["--victim"]:
        return victim_process(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller attacks (2-3 min)")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bundled)")
    ap.add_argument("--classes", nargs="*", default=None,
                    help="class numbers or parts of names: " + ", ".join(
                        f"{k} {v[0]}" for k, v in CLASSES.items()))
    a = ap.parse_args()
    numbers = chosen(a.classes)
    if not numbers:
        ap.error(f"no class matches {a.classes}")
    logs = Path(tempfile.mkdtemp(prefix="hostile-pass-"))
    servers = Servers(Path(a.model) if a.model else None, logs)
    p = Pass(servers, QUICK if a.quick else Scale())
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "phasewise"],
                           capture_output=True, text=True).stdout.split("\n")
    print(machine_line(machine_info()))
    changed = [line[3:] for line in dirty if line.strip()]
    if changed:
        print(f"uncommitted changes under phasewise/ were run too: {', '.join(changed)}")
    print(f"model: {a.model or 'bundled stdlib-coder'}; {'quick' if a.quick else 'full'} pass; "
          f"load average {os.getloadavg()[0]:.2f} at the start (other work on this machine "
          f"stretches gaps too); server logs in {logs}", flush=True)
    t0 = time.monotonic()
    rows: list[Row] = []
    try:
        for number in numbers:
            rows += run_class(p, number)
    finally:
        servers.stop_all()
    print()
    print(table(rows))
    print("5xx: unexpected ones; slowloris's 503 too_many_connections is its defence")
    print()
    print(verdicts(rows))
    print(f"\n{len(numbers)} classes in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
