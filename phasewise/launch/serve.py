"""What ``phasewise serve`` and ``phasewise router`` build: load the engine (with its roofline
cost model), wire backend, metrics, dashboard and HTTP app together, and for the P/D roles the
K/V worker around the engine (``phasewise.disagg.worker``) or the router in front of workers
(``phasewise.disagg.router``). Running what is built under uvicorn is the server's own
(``phasewise.server.serve.run``).

This room sits above ``server`` and ``disagg``, which import neither each other nor this.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from pathlib import Path
from typing import Any

from phasewise.config import DEFAULT_STEP_TIMEOUT_S, SERVE_ROLES, EngineConfig
from phasewise.engine.async_engine import AsyncEngine
from phasewise.perf.attribution import StepCostModel
from phasewise.server.app import OpenAIServer, ServerConfig
from phasewise.server.dashboard import DashboardFeed, Hub, peaks_of
from phasewise.server.dashboard.hub import relays_for
from phasewise.server.metrics import PrometheusMetrics, StatLogger
from phasewise.server.serve import check_port

log = logging.getLogger("phasewise.server")

ROLES = SERVE_ROLES


def read_secret(path: str | None, role: str) -> bytes:
    """The K/V port's shared secret, from a file (never the command line alone)."""
    if path is None:
        raise ValueError(f"--role {role} needs --kv-secret-file FILE: the shared secret (at "
                         "least 16 bytes) that prefill and decode workers authenticate with")
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"--kv-secret-file {path}: {e.strerror}") from e
    if len(secret) < 16:
        raise ValueError(f"--kv-secret-file {path} holds {len(secret)} bytes; the secret "
                         "needs at least 16")
    return secret


INTERNAL_KEY_MIN = 32


def read_internal_key(path: str | None) -> str | None:
    """The fleet's internal key (``--internal-key-file``): None without a file; else its
    text, at least ``INTERNAL_KEY_MIN`` printable ASCII characters with no space (it travels
    in a header). Long and random (``openssl rand -hex 32``), no guessing reaches it, which is
    why no address is ever locked out for a wrong one."""
    if path is None:
        return None
    try:
        key = Path(path).read_text(encoding="ascii", errors="replace").strip()
    except OSError as e:
        raise ValueError(f"--internal-key-file {path}: {e.strerror}") from e
    odd = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if odd is not None:
        raise ValueError(f"--internal-key-file {path} holds a character that is no printable "
                         f"ASCII or is a space (at position {odd}); use, for example, the "
                         "output of 'openssl rand -hex 32'")
    if len(key) < INTERNAL_KEY_MIN:
        raise ValueError(f"--internal-key-file {path} holds {len(key)} characters; the key "
                         f"needs at least {INTERNAL_KEY_MIN} (for example the output of "
                         "'openssl rand -hex 32')")
    return key


def _connect_prefill(engine: AsyncEngine, connect: list[str], secret: bytes, name: str,
                     wait_s: float) -> Any:
    """The prefill role's K/V connection. A decode worker that is still loading does not
    answer the handshake yet: retry (with a line every 10 s) until ``wait_s``; a refusal
    (the key, the version, the layout) is final."""
    from phasewise.disagg.transport import HandshakeError
    from phasewise.disagg.worker import PrefillSide

    deadline = time.monotonic() + wait_s
    note = time.monotonic() + 10
    while True:
        try:
            return PrefillSide(engine, connect, secret=secret, name=name)
        except HandshakeError as e:
            # No answer yet, or a challenge pushed out by a flood of others: try again.
            if e.field not in ("timeout", "nonce") or time.monotonic() >= deadline:
                raise ValueError(f"--kv-connect {' '.join(connect)}: {e}") from e
            if time.monotonic() >= note:
                log.info("waiting for the decode workers' K/V ports at %s", " ".join(connect))
                note = time.monotonic() + 10


def build_server(engine_config: EngineConfig, *, served_model_name: str | None = None,
                 log_interval_s: float = 5.0, role: str = "both",
                 kv_bind: str = "tcp://127.0.0.1:8100",
                 kv_connect: str | list[str] | None = None,
                 kv_secret: bytes | None = None, disagg_threshold: int = 0,
                 prefill_queue_limit: int = 8, kv_connect_wait_s: float = 300.0,
                 remote_prefill_timeout: float = 300.0, kv_name: str | None = None,
                 step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
                 **server_kwargs: Any) -> OpenAIServer:
    """Load the checkpoint and wire backend, metrics and HTTP app together.

    ``role``: ``both`` (one engine does prefill and decode), ``decode`` (opens the K/V port
    ``kv_bind``; prompts of at least ``disagg_threshold`` uncached tokens go to a connected
    prefill worker with fewer than ``prefill_queue_limit`` prompts queued; the rest, and every
    fault, are prefilled here) or ``prefill`` (connects to a decode worker's K/V port
    ``kv_connect``, one or several, and computes the prompts each sends). ``step_timeout_s``:
    how long one engine step may run before the engine counts as stuck (``AsyncEngine``;
    None: never)."""
    if role not in ROLES:
        raise ValueError(f"--role must be one of {', '.join(ROLES)}; got {role!r}")
    if isinstance(kv_connect, str):
        kv_connect = [kv_connect]
    for url in ([kv_bind] if role == "decode" else []) + (kv_connect or []):
        if not re.fullmatch(r"tcp://[^:/\s]+:\d{1,5}", url):
            raise ValueError(f"K/V address {url!r} must be tcp://HOST:PORT")
    if role == "decode":  # before the minutes a large model can take to load
        host, port = kv_bind[len("tcp://"):].rsplit(":", 1)
        if int(port):
            try:
                check_port("127.0.0.1" if host == "*" else host, int(port), "--kv-bind")
            except ValueError as e:
                raise ValueError(f"--kv-bind {kv_bind}: {e}") from e
    if role == "prefill" and not kv_connect:
        raise ValueError("--role prefill needs --kv-connect tcp://HOST:PORT, the decode "
                         "worker's K/V port")
    if disagg_threshold < 0:
        raise ValueError(f"--disagg-threshold must be >= 0, got {disagg_threshold}")
    if not 1 <= prefill_queue_limit <= 1_000_000:  # (below a stuck worker's STUCK_QUEUE)
        raise ValueError(f"--prefill-queue-limit must be in 1..1000000, got "
                         f"{prefill_queue_limit}")
    if not remote_prefill_timeout > 0:
        raise ValueError(f"--remote-prefill-timeout must be > 0, got {remote_prefill_timeout}")
    if step_timeout_s is not None and not 0 < step_timeout_s <= 86400:
        raise ValueError(f"--step-timeout must be in (0, 86400] seconds, or 0 for never; got "
                         f"{step_timeout_s}")
    from phasewise.model.cpu.kernels import KERNELS

    compiled_before = KERNELS.compile_s  # (a sum over the process: this load's share)
    t0 = time.monotonic()
    log.info("loading %s", engine_config.model)
    name = served_model_name or Path(engine_config.model).resolve().name
    config = ServerConfig(served_model_name=name, role=role, **server_kwargs)
    metrics = PrometheusMetrics(name)
    feed = DashboardFeed(model_name=name, role=role)
    observers: list[Any] = [metrics, feed]
    if log_interval_s > 0:
        import torch

        observers.append(StatLogger(log_interval_s, threads=torch.get_num_threads))
    engine = AsyncEngine.from_config(engine_config, cost_model=StepCostModel.for_engine,
                                     max_waiting=config.max_waiting_requests,
                                     observers=observers, step_timeout_s=step_timeout_s)
    feed.peaks = peaks_of(engine.engine.cost_model.accel)
    feed.info = dashboard_info(engine.engine)
    backend: Any = engine
    if role != "both":
        from phasewise.disagg.worker import DecodeSide

        assert kv_secret is not None
        if role == "decode":
            backend = DecodeSide(engine, secret=kv_secret, bind=kv_bind,
                                 threshold=disagg_threshold, queue_limit=prefill_queue_limit,
                                 request_timeout=remote_prefill_timeout)
            from phasewise.disagg.metrics import DisaggCollector, TransferMetrics

            metrics.registry.register(DisaggCollector(backend, name))
            histograms = TransferMetrics(metrics.registry, name)

            def on_transfer(t: Any) -> None:
                histograms.observe(t)
                feed.on_transfer(t)

            backend.on_transfer = on_transfer
            log.info("decode role: K/V port %s; %s go to a connected prefill worker",
                     backend.endpoint, "all prompts" if disagg_threshold == 0 else
                     f"prompts of {disagg_threshold}+ uncached tokens")
        else:
            backend = _connect_prefill(engine, kv_connect, kv_secret,
                                       kv_name or f"prefill@{socket.gethostname()}",
                                       kv_connect_wait_s)
            log.info("prefill role: connected to the decode worker's K/V port %s",
                     " ".join(kv_connect))
    info = backend.info
    built = KERNELS.compile_s - compiled_before
    log.info("loaded %s (%.1f M parameters) in %.1f s%s", info.architecture,
             info.num_params / 1e6, time.monotonic() - t0 - built,
             f" (and {built:.1f} s compiling the CPU kernels, once)" if built else "")
    if info.roofline:
        log.info("%s", info.roofline)
    cpu = getattr(engine.engine, "cpu_backend", None)
    if cpu is not None:  # where the CPU kernel plan came from, then what it runs
        log.info("plan: %s", cpu.plan_line())
        log.info("kernels: %s", cpu.kernels_line())
    feed.info["description"] = info.description
    return OpenAIServer(backend, config, metrics, dashboard=Hub(feed))


def dashboard_info(engine: Any) -> dict[str, Any]:
    """What the dashboard's header says about an ``LLMEngine``."""
    cfg = engine.config
    return {"max_model_len": engine.max_model_len,
            "budget": engine.max_num_batched_tokens, "policy": cfg.policy,
            "block_size": cfg.block_size, "device": engine.device.type,
            "dtype": str(engine.dtype).removeprefix("torch.")}


def build_router(model: str, decode: list[str], prefill: list[str], *,
                 served_model_name: str | None = None, api_key: str | None = None,
                 wait_s: float = 300.0, routing: dict[str, Any] | None = None,
                 internal_key: str | None = None, **server_kwargs: Any) -> OpenAIServer:
    """``phasewise router``: wait for the workers, check they serve ``model``'s checkpoint,
    and put the OpenAI API in front of them (``phasewise.disagg.router``)."""
    from phasewise.disagg.router import Router, RouterCollector

    router = Router(decode, prefill, model_dir=model, api_key=api_key, wait_s=wait_s,
                    internal_key=internal_key, **(routing or {}))
    router.connect()
    name = served_model_name or Path(model).resolve().name
    config = ServerConfig(served_model_name=name, role="router", api_key=api_key,
                          internal_key=internal_key, **server_kwargs)
    metrics = PrometheusMetrics(name)
    router.add_observer(metrics)
    metrics.registry.register(RouterCollector(router))
    feed = DashboardFeed(model_name=name, role="router",
                         info={"description": router.info.description})
    router.add_observer(feed)
    hub = Hub(feed)
    relays_for(hub, router.workers, router.headers)
    return OpenAIServer(router, config, metrics, dashboard=hub,
                        trace_lookup=router.find_trace)
