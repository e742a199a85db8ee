"""``phasewise serve``: run the API under uvicorn until SIGTERM/SIGINT (what it serves is built
by ``phasewise.launch.serve``).

On SIGTERM or Ctrl-C the server drains: it stops accepting connections and answers new
requests on open connections with 503, lets running streams finish for up to
``shutdown_grace_s`` seconds, then ends what is left: each such stream gets an error event
that names the shutdown, then ``[DONE]``; a waiting non-streamed request gets a 503. One log
line says how many were cut; no traceback.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Any

from phasewise.server.app import OpenAIServer
from phasewise.server.limits import ConnectionLimits, guarded_protocol

log = logging.getLogger("phasewise.server")

# uvicorn cancels what is left this long after our own grace period has ended every request:
# only a backstop, for a response that ignores the end of its request.
_BACKSTOP_S = 10.0


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """Fail now, before minutes of loading, if ``host:port`` cannot be bound (``flag``: the
    option that chose the port, which the error names)."""
    if not 0 < port < 65536:
        raise ValueError(f"{flag} must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve to an address: {e}") from e
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is already in use; choose another "
                                 f"with {flag} (or stop what is listening there)") from e
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; change --host "
                             f"or {flag}") from e


def run(server: OpenAIServer, *, host: str = "127.0.0.1", port: int = 8000,
        shutdown_grace_s: float = 30.0, log_level: str = "info",
        access_log: bool | None = None, limits: ConnectionLimits | None = None) -> None:
    """Serve until SIGTERM/SIGINT. ``access_log``: one line per request (None: as the
    server's config says; on by default). ``limits``: what a connection and an address may
    hold (``phasewise.server.limits``; the defaults when None)."""
    import resource

    import uvicorn

    if access_log is not None:
        server.access_log.enabled = access_log

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not server.draining:
                log.info("draining: refusing new requests; running streams get up to %.0fs",
                         shutdown_grace_s)
                server.begin_drain()
                loop = server.loop
                if loop is not None:  # a signal handler: hand the timer to the loop
                    loop.call_soon_threadsafe(
                        loop.call_later, shutdown_grace_s, server.end_open_streams,
                        shutdown_grace_s)
            super().handle_exit(sig, frame)

    asked = limits or ConnectionLimits()
    limits = asked.clamped(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    if limits.max_connections < asked.max_connections:
        log.info("--max-connections %d lowered to %d to fit the open-file limit (ulimit -n)",
                 asked.max_connections, limits.max_connections)
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_grace_s + _BACKSTOP_S,
                            access_log=False, lifespan="on", http=guarded_protocol(limits),
                            # no route takes a websocket; an upgrade would hand the
                            # connection to a protocol the limits do not follow
                            ws="none")
    info = server.backend.info
    log.info("serving %s as %r on http://%s:%d (%s)", info.model_path,
             server.config.served_model_name, host, port, info.description)
    DrainingServer(config).run()
