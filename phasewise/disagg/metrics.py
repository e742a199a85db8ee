"""P/D figures on ``/metrics``, read from the decode side's counters at scrape time (nothing
is added to the engine's or the transport's hot path)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from phasewise.disagg.transport import PREAUTH_DROP_REASONS

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
            "stale, foreign, duplicate, out_of_range, mismatch), how they failed (checksum, "
            "size, malformed), sent by a peer that never completed the handshake "
            "(unauthenticated, dropped unread, control messages included), or counted by a "
            "prefill worker's Done but never landed (missing).",
            labels=["model_name", "outcome"])
        refused = CounterMetricFamily(
            PREFIX + "kv_peers_refused", "K/V peers refused at connect time, by the field at "
            "fault (auth, nonce, version, layout.*).", labels=["model_name", "reason"])
        for key, value in sorted(counts.items()):
            head, _, rest = key.partition(".")
            if head in ("frames", "frame_errors") and rest:
                frames.add_metric([self.model_name, rest], value)
            elif head == "refused" and rest:
                refused.add_metric([self.model_name, rest], value)
        frames.add_metric([self.model_name, "unauthenticated"], counts.get("unauthenticated", 0))
        strangers = CounterMetricFamily(
            PREFIX + "kv_unauthenticated_messages", "What the K/V port refused from peers "
            "that had not completed the handshake, by reason: curve (connections that failed "
            "zmq's security handshake: no CURVE, or keys not derived from this secret; zmq "
            "took no message from them), and messages from peers past it, dropped: oversized "
            "(over the few KiB a handshake message needs: dropped unread), malformed (not a "
            "well-formed open or hello: bad UTF-8 or JSON, nested too deeply), unexpected "
            "(several parts, or a message other than an open or a hello). The sum of the "
            "message reasons is kv_frames{outcome=\"unauthenticated\"}.",
            labels=["model_name", "reason"])
        for reason in ("curve", *PREAUTH_DROP_REASONS):
            strangers.add_metric([self.model_name, reason],
                                 counts.get(f"unauthenticated.{reason}", 0))
        tallies = self.side.tallies()
        frames.add_metric([self.model_name, "missing"], tallies.missing_frames)
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
        local = CounterMetricFamily(
            PREFIX + "local_prefills", "Prompts the decode worker prefilled itself, by "
            "reason: short_prompt (under --disagg-threshold), cached (its uncached part "
            "under the threshold), no_prefill_worker, prefill_busy (every prefill worker at "
            "--prefill-queue-limit), no_room (no blocks to reserve), resumed (migrated here "
            "by a router with its outputs so far). Fault fallbacks are "
            "remote_prefills{outcome!=done}.", labels=["model_name", "reason"])
        for reason, value in tallies.local_prefills.items():
            local.add_metric([self.model_name, reason], value)
        queues = GaugeMetricFamily(
            PREFIX + "prefill_queue_depth", "Prompts each connected prefill worker holds "
            "(its last heartbeat, or what this worker sent it and awaits, if more).",
            labels=["model_name", "peer"])
        for identity, p in self.side.server.peers().items():
            if p.state in ("accepted", "alive"):
                queues.add_metric([self.model_name, p.name or identity],
                                  self.side._queue_of(identity, p.queue))
        kinds = CounterMetricFamily(
            PREFIX + "remote_prefill_failures", "Remote prefills failed (and computed here) by "
            "kind: error (the prefill worker said so), peer_lost / peer_replaced / "
            "peer_closed, timeout (--remote-prefill-timeout), send_failed, peer_gone.",
            labels=["model_name", "kind"])
        for kind, value in tallies.failures.items():
            kinds.add_metric([self.model_name, kind], value)
        yield from (frames, strangers, refused, outcomes, in_flight, peers, local, queues,
                    kinds)


_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_BYTES = tuple(10.0 ** k for k in range(3, 11))


class TransferMetrics:
    """Histograms of each remote prefill that decoded on (``DecodeSide.on_transfer``)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, ["model_name"], registry=registry,
                             buckets=buckets).labels(model_name)

        self.span = hist("remote_prefill_seconds", "PrefillRequest sent to first token back: "
                         "the prefill worker's queue and compute plus the K/V transfer.",
                         _SECONDS)
        self.window = hist("kv_transfer_window_seconds", "First K/V frame landed to first "
                           "token back: the transfer, plus the compute of later chunks when "
                           "the prompt came in several.", _SECONDS)
        self.nbytes = hist("kv_transfer_bytes", "K/V bytes landed per remote prefill.",
                           _BYTES)
        self.frames = hist("kv_transfer_frames", "K/V frames per remote prefill.",
                           (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.rate = hist("kv_transfer_gbytes_per_second", "K/V bytes landed over the "
                         "transfer window, in GB/s (a lower bound on the link's rate when "
                         "the window holds later chunks' compute).",
                         (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0))

    def observe(self, t: Any) -> None:
        self.span.observe(t.done_at - t.sent_at)
        if t.first_frame_at is not None:
            window = t.done_at - t.first_frame_at
            self.window.observe(window)
            if window > 0:
                self.rate.observe(t.nbytes / window / 1e9)
        self.nbytes.observe(t.nbytes)
        self.frames.observe(t.frames)
