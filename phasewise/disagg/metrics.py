"""P/D figures on ``/metrics``, read from the decode side's counters at scrape time (nothing
is added to the engine's or the transport's hot path)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "phasewise:"


class DisaggCollector:
    """A prometheus-client collector over a ``DecodeSide``."""

    def __init__(self, side: Any, model_name: str) -> None:
        self.side = side
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        counts = self.side.server.counters()
        frames = CounterMetricFamily(
            PREFIX + "kv_frames", "K/V frames received, by what the gate made of them (ok, "
            "stale, foreign, duplicate, out_of_range, mismatch) or how they failed (checksum, "
            "size, malformed).", labels=["model_name", "outcome"])
        refused = CounterMetricFamily(
            PREFIX + "kv_peers_refused", "K/V peers refused at connect time, by the field at "
            "fault (auth, nonce, version, layout.*).", labels=["model_name", "reason"])
        for key, value in sorted(counts.items()):
            head, _, rest = key.partition(".")
            if head in ("frames", "frame_errors") and rest:
                frames.add_metric([self.model_name, rest], value)
            elif head == "refused" and rest:
                refused.add_metric([self.model_name, rest], value)
        outcomes = CounterMetricFamily(
            PREFIX + "remote_prefills", "Remote prefills by how they ended: done (decoded on "
            "from the remote K/V), or computed here instead: failed (an error, a lost or "
            "replaced peer), incomplete (a frame missing), refused (bad K/V).",
            labels=["model_name", "outcome"])
        for outcome in ("done", "failed", "incomplete", "refused"):
            outcomes.add_metric([self.model_name, outcome],
                                self.side.backend.remote_outcomes.get(outcome, 0))
        in_flight = GaugeMetricFamily(
            PREFIX + "remote_prefills_in_flight", "Requests sent to a prefill worker whose "
            "first token has not come back.", labels=["model_name"])
        in_flight.add_metric([self.model_name], self.side.num_attempts)
        peers = GaugeMetricFamily(PREFIX + "kv_peers_alive", "Prefill workers connected and "
                                  "heard from within the heartbeat deadline.",
                                  labels=["model_name"])
        peers.add_metric([self.model_name], self.side.num_live_peers)
        yield from (frames, refused, outcomes, in_flight, peers)
