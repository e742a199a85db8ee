"""``phasewise pd``: one prefill worker, one decode worker and a router on this machine, as
three processes started the way an operator would start them (``phasewise serve --role ...``
and ``phasewise router``), so what runs here is what a Kubernetes Deployment per role runs.

Order: the decode worker first (it opens the K/V port), then the prefill worker (it connects
to that port), then the router (it waits for both). Stopping the launcher (Ctrl-C or SIGTERM)
stops all three, each by its process group; if any of them exits, the others are stopped and
the launcher exits with an error naming it.
"""

from __future__ import annotations

import http.client
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from phasewise.config import API_KEY_ENV
from phasewise.server.serve import check_port

log = logging.getLogger("phasewise.pd")


@dataclass
class PDConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000  # the router's
    decode_port: int | None = None  # default: port + 1
    prefill_port: int | None = None  # default: port + 2
    kv_port: int = 8100
    kv_secret_file: str | None = None  # default: a fresh random one, removed at the end
    disagg_threshold: int = 0
    api_key: str | None = None
    pin: bool = False  # each worker on its own core, with one thread
    engine_args: list[str] = field(default_factory=list)
    log_level: str = "info"
    start_timeout_s: float = 600.0

    def ports(self) -> tuple[int, int]:
        return (self.decode_port or self.port + 1, self.prefill_port or self.port + 2)


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM it if the launcher dies, even by SIGKILL,
    so no worker outlives it holding its ports."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        # (HTTPException: a probe of a port nobody listens on yet can connect to itself on
        # loopback and read its own request back as a bad status line)
        return False


class Launcher:
    def __init__(self, cfg: PDConfig) -> None:
        self.cfg = cfg
        self.procs: dict[str, subprocess.Popen] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._stopping = False

    def _fresh_secret(self, name: str) -> str:
        """A new random secret in a file only this user reads, removed when pd stops."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="phasewise-pd-")
        path = Path(self._tmp.name) / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        return str(path)

    def _secret_file(self) -> str:
        return self.cfg.kv_secret_file or self._fresh_secret("kv.secret")

    def commands(self, secret_file: str,
                 internal_key_file: str | None = None) -> dict[str, list[str]]:
        c = self.cfg
        dport, pport = c.ports()
        # -P: the current folder is not put first on the path, so a folder named phasewise
        # there (a clone's parent) cannot shadow the installed package in the workers
        base = [sys.executable, "-P", "-m", "phasewise"]
        auth: list[str] = []  # the key goes in the environment (_start), not argv
        # the router's own key to the workers' /internal/* routes: a client sharing this
        # host's address and sending wrong API keys to a worker cannot lock the router out
        internal = ["--internal-key-file", internal_key_file] if internal_key_file else []
        common = ["--model", c.model, "--host", c.host, "--log-level", c.log_level, *auth,
                  *internal]
        kv = f"tcp://{c.host}:{c.kv_port}"
        cmds = {
            "decode": [*base, "serve", *common, *c.engine_args, "--role", "decode",
                       "--port", str(dport), "--kv-bind", kv, "--kv-secret-file", secret_file,
                       "--disagg-threshold", str(c.disagg_threshold)],
            "prefill": [*base, "serve", *common, *c.engine_args, "--role", "prefill",
                        "--port", str(pport), "--kv-connect", kv,
                        "--kv-secret-file", secret_file],
            "router": [*base, "router", *common, "--port", str(c.port),
                       "--decode", f"http://{c.host}:{dport}",
                       "--prefill", f"http://{c.host}:{pport}"],
        }
        if c.pin:  # on the cores this process may use (taskset, a cgroup), not the machine's
            cores = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                     else list(range(os.cpu_count() or 1)))
            cmds["decode"] = ["taskset", "-c", str(cores[0]), *cmds["decode"]]
            cmds["prefill"] = ["taskset", "-c", str(cores[1 % len(cores)]), *cmds["prefill"]]
        return cmds

    def _start(self, role: str, cmd: list[str]) -> subprocess.Popen:
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if self.cfg.api_key:  # not on the command line, which every user can list
            env[API_KEY_ENV] = self.cfg.api_key
        if self.cfg.pin and role != "router":
            env["OMP_NUM_THREADS"] = "1"
        log.info("starting the %s: %s", role, " ".join(
            "***" if prev == "--api-key" else a for prev, a in zip(["", *cmd], cmd)))
        proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux"
                                else None)
        self.procs[role] = proc
        return proc

    def _wait_ready(self, role: str, url: str) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        note = time.monotonic() + 10
        while not _ready(url):
            proc = self.procs[role]
            if proc.poll() is not None:
                raise ConnectionError(f"the {role} exited with code {proc.returncode} while "
                                   "starting (its log is above)")
            if time.monotonic() > deadline:
                raise ConnectionError(f"the {role} was not ready at {url}/health after "
                                   f"{self.cfg.start_timeout_s:.0f} s")
            if time.monotonic() > note:
                log.info("waiting for the %s at %s", role, url)
                note = time.monotonic() + 10
            time.sleep(0.2)

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM each process group (they drain), then SIGKILL what is left."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for role, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("the %s did not stop in %.0f s; killing it", role, grace_s)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    log.error("the %s (pid %d) survived SIGKILL", role, proc.pid)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def run(self) -> int:
        c = self.cfg
        dport, pport = c.ports()
        ports = [c.port, dport, pport, c.kv_port]
        if len(set(ports)) != len(ports):
            raise ValueError(f"the router, decode, prefill and K/V ports must differ; got "
                             f"{ports}")
        flags = ("--port", "--decode-port", "--prefill-port", "--kv-port")
        for p, flag in zip(ports, flags):
            check_port(c.host, p, flag)
        cmds = self.commands(self._secret_file(), self._fresh_secret("internal.key"))

        def on_signal(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGTERM, on_signal)
        try:
            self._start("decode", cmds["decode"])
            self._wait_ready("decode", f"http://{c.host}:{dport}")
            self._start("prefill", cmds["prefill"])
            self._wait_ready("prefill", f"http://{c.host}:{pport}")
            self._start("router", cmds["router"])
            self._wait_ready("router", f"http://{c.host}:{c.port}")
            log.info("P/D ready: the OpenAI API is at http://%s:%d/v1 (decode worker :%d, "
                     "prefill worker :%d, K/V port %d); Ctrl-C stops all three", c.host,
                     c.port, dport, pport, c.kv_port)
            while True:
                for role, proc in self.procs.items():
                    if proc.poll() is not None:
                        log.error("the %s exited with code %s; stopping the others", role,
                                  proc.returncode)
                        return 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            log.info("stopping the router, the prefill and the decode worker")
            return 0
        finally:
            # A second Ctrl-C or SIGTERM must not cut the stop short (the SIGKILL of what
            # does not drain, the secret's removal).
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                self.stop()
            finally:
                signal.signal(signal.SIGTERM, old)
                signal.signal(signal.SIGINT, old_int)
