"""``phasewise serve``: load the engine, then run the API under uvicorn until SIGTERM/SIGINT.

On SIGTERM or Ctrl-C the server drains: it stops accepting connections and answers new
requests on open connections with 503, lets running streams finish for up to
``shutdown_grace_s`` seconds, then aborts what is left and stops the engine thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from phasewise.config import EngineConfig
from phasewise.engine.async_engine import AsyncEngine
from phasewise.engine.engine import LLMEngine
from phasewise.server.app import OpenAIServer, ServerConfig
from phasewise.server.metrics import PrometheusMetrics, StatLogger

log = logging.getLogger("phasewise.server")


def build_server(engine_config: EngineConfig, *, served_model_name: str | None = None,
                 log_interval_s: float = 5.0, **server_kwargs: Any) -> OpenAIServer:
    """Load the checkpoint and wire engine, metrics and HTTP app together."""
    t0 = time.monotonic()
    log.info("loading %s", engine_config.model)
    engine = LLMEngine(engine_config)
    log.info("loaded %s (%.1f M parameters) in %.1f s", engine.model_config.architecture,
             engine.model_config.num_params / 1e6, time.monotonic() - t0)
    name = served_model_name or Path(engine_config.model).resolve().name
    config = ServerConfig(served_model_name=name, **server_kwargs)
    metrics = PrometheusMetrics(name)
    observers: list[Any] = [metrics]
    if log_interval_s > 0:
        observers.append(StatLogger(log_interval_s))
    async_engine = AsyncEngine(engine, max_waiting=config.max_waiting_requests,
                               observers=observers)
    return OpenAIServer(async_engine, config, metrics)


def run(server: OpenAIServer, *, host: str = "127.0.0.1", port: int = 8000,
        shutdown_grace_s: float = 30.0, log_level: str = "info") -> None:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not server.draining:
                log.info("draining: refusing new requests; running streams get up to %.0fs",
                         shutdown_grace_s)
            server.draining = True
            server.engine.stop_accepting()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_grace_s, access_log=False,
                            lifespan="on")
    e = server.llm
    log.info("serving %s as %r on http://%s:%d (max_model_len %d, %d KV blocks of %d tokens, "
             "policy %s, %d tokens per step, dtype %s, device %s)", e.config.model,
             server.config.served_model_name, host, port, e.max_model_len, e.kv.num_blocks,
             e.config.block_size, e.config.policy, e.max_num_batched_tokens,
             str(e.dtype).removeprefix("torch."), e.device)
    DrainingServer(config).run()
