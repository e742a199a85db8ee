"""Start ``phasewise serve`` (or ``router``, ``pd``) as a real process on 127.0.0.1 and stop
it by PID: the benchmarks' harness does exactly this, so the tests use it rather than a copy
(``benchmarks`` imports nothing from ``tests``)."""

from __future__ import annotations

from benchmarks.harness import Metrics, ServerProcess, free_port, start_server

__all__ = ["Metrics", "ServerProcess", "free_port", "start_server"]
