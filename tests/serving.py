"""Start ``phasewise serve`` as a real process on 127.0.0.1 and stop it by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

Metrics = dict[tuple[str, tuple], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
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
                 port: int | None = None) -> ServerProcess:
    """``model_dir`` None: no ``--model`` (the bundled default). ``env``: added to this
    process's environment. ``command``: ``serve``, ``router`` or ``pd`` (its ``--port``
    is the one whose /health is awaited)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "phasewise.cli", command,
           *(["--model", str(model_dir)] if model_dir is not None else []),
           "--host", "127.0.0.1", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
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
