"""Prometheus metrics (``/metrics``) and the periodic log line, fed by the engine thread.

Every interval comes from the engine's own timestamps (``RequestMetrics``), as vLLM defines
them: queue = arrival -> first scheduled; prefill = first scheduled -> first token;
decode = first token -> last token; e2e = arrival -> finish. The README lists every metric.

Each step is also held against the roofline (``StepStats.predicted_*``, from
``phasewise.perf.attribution``): the bandwidth and FLOP/s it achieved (its predicted bytes and
FLOPs over its measured duration) and, where this machine's peaks are stored, its measured time
over the roofline's lower bound.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phasewise.engine.backend import EngineSnapshot, FinishedRequest
from phasewise.engine.outputs import RequestOutput, StepStats, new_token_gaps
from phasewise.perf.contention import Contention, CpuSample, fewer_threads

PREFIX = "phasewise:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
# experts a layer (top-k counts to the largest expert counts served)
_EXPERT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Per-step roofline figures: decades with a 3x point between, wide enough for a laptop CPU
# (~1e9 B/s, 1e10 FLOP/s) up to a large GPU (~5e12 B/s, 1e15 FLOP/s).
_BANDWIDTH_BUCKETS = tuple(m * 10.0 ** e for e in range(6, 14) for m in (1, 3))
_FLOPS_BUCKETS = tuple(m * 10.0 ** e for e in range(6, 17) for m in (1, 3))
_ROOFLINE_RATIO_BUCKETS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1000.0)
_PREDICTED_BUCKETS = (1e-6, 1e-5, 1e-4, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STEP_KINDS = ("prefill", "decode", "mixed")
_FINISH_REASONS = ("stop", "length", "abort")


def step_kind(step: StepStats) -> str:
    """``prefill``, ``decode`` or ``mixed``, read off the step's token counts."""
    if step.num_prefill_tokens and step.num_decode_tokens:
        return "mixed"
    return "prefill" if step.num_prefill_tokens else "decode"


class RefusalCollector:
    """``phasewise:requests_refused_total{reason}``: requests refused at admission because
    the server predicted they would miss their SLO target (read at scrape time)."""

    def __init__(self, refused: dict[str, int], model_name: str) -> None:
        self.refused = refused
        self.model_name = model_name

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily(PREFIX + "requests_refused", "Requests refused at admission "
                                  "by their SLO target: slo_ttft (predicted time to first "
                                  "token over it), slo_tpot (predicted time per output token "
                                  "over it).", labels=["model_name", "reason"])
        for reason, n in list(self.refused.items()):
            fam.add_metric([self.model_name, reason], n)
        yield fam


class PrometheusMetrics:
    """Engine observer that keeps the ``phasewise:`` metrics in its own registry."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=r,
                             buckets=buckets).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds",
                         "Arrival to first output token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Gap between consecutive output tokens of a request.", _LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: decode time / (output tokens - 1).", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "First scheduled to first token.", _LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "First token to last token.", _LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length per request.",
                               _TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Output length per request.",
                            _TOKEN_BUCKETS)
        self.step_tokens = hist("iteration_tokens", "Tokens (prefill + decode) per engine step.",
                                _TOKEN_BUCKETS)
        # a mixture of experts: the experts a step's tokens routed to, per sparse layer
        self.step_experts = hist("step_experts_read", "Mixture-of-experts models: the "
                                 "distinct experts a step's tokens routed to, averaged over "
                                 "its sparse layers (the expert weights the step read).",
                                 _EXPERT_BUCKETS)
        self.step_bandwidth = hist(
            "step_achieved_bandwidth_bytes_per_second",
            "Per engine step: roofline-predicted bytes moved / measured step duration.",
            _BANDWIDTH_BUCKETS)
        self.step_flops = hist(
            "step_achieved_flops_per_second",
            "Per engine step: roofline-predicted FLOPs / measured step duration.", _FLOPS_BUCKETS)
        self.step_over_roofline = hist(
            "step_time_over_roofline",
            "Per engine step: measured duration / roofline lower bound at this machine's "
            "measured peaks (1 = at the roof; only when peaks are stored).",
            _ROOFLINE_RATIO_BUCKETS)
        self.step_predicted = hist(
            "step_predicted_seconds",
            "Per engine step: roofline lower bound on its time at this machine's measured peaks "
            "(only when peaks are stored).", _PREDICTED_BUCKETS)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted once "
                                     "per request, when its first token is sampled).")
        self.generation_tokens = counter("generation_tokens", "Output tokens sampled.")
        success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.finished = {reason: success.labels(model_name, reason)
                         for reason in _FINISH_REASONS}
        self.preemptions = counter("num_preemptions", "Requests preempted (recompute).")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        # Speculative decoding (vLLM's names): acceptance rate = accepted / draft tokens;
        # mean accepted length = accepted / drafts (verifies).
        self.spec_counters = {
            "spec_verifies": counter("spec_decode_num_drafts",
                                     "Speculative decoding: request-steps that verified drafts."),
            "spec_proposed": counter("spec_decode_num_draft_tokens",
                                     "Speculative decoding: draft tokens proposed and verified."),
            "spec_accepted": counter("spec_decode_num_accepted_tokens",
                                     "Speculative decoding: draft tokens accepted."),
            "spec_emitted": counter("spec_decode_num_emitted_tokens",
                                    "Speculative decoding: tokens the verifies emitted."),
        }
        steps = Counter(PREFIX + "engine_steps", "Engine steps by token mix.",
                        labels + ["kind"], registry=r)
        self.steps = {kind: steps.labels(model_name, kind) for kind in _STEP_KINDS}
        step_time = Histogram(PREFIX + "step_duration_seconds",
                              "Engine step durations (schedule, forward pass, sampling) by "
                              "token mix.", labels + ["kind"], buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.step_time = {kind: step_time.labels(model_name, kind) for kind in _STEP_KINDS}
        step_host = Histogram(PREFIX + "step_host_seconds",
                              "Engine step time outside the forward pass (schedule, batch "
                              "layout, sampling, outputs) by token mix; only where the engine "
                              "timed the forward pass.", labels + ["kind"],
                              buckets=_PREDICTED_BUCKETS, registry=r)  # (down to 1 us)
        self.step_host = {kind: step_host.labels(model_name, kind) for kind in _STEP_KINDS}
        step_tok = Counter(PREFIX + "step_tokens", "Tokens computed in engine steps by phase.",
                           labels + ["phase"], registry=r)
        self.step_prefill_tokens = step_tok.labels(model_name, "prefill")
        self.step_decode_tokens = step_tok.labels(model_name, "decode")

        self.running = gauge("num_requests_running", "Requests holding KV blocks.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.waiting_remote = gauge("num_requests_waiting_remote_kv",
                                    "Requests holding KV blocks while a prefill worker "
                                    "computes their prompt (P/D).")
        self.blocks_waiting_remote = gauge("num_blocks_waiting_remote_kv",
                                           "KV blocks those requests hold (P/D).")
        self.parked = gauge("num_requests_parked",
                            "Requests held because their client stopped reading its stream "
                            "(running none of their tokens; the first to give up a seat).")
        self.kv_usage = gauge("kv_cache_usage_perc",
                              "Fraction of KV-cache blocks held by requests (0..1).")
        self.kv_free_blocks = gauge("kv_cache_free_blocks", "KV-cache blocks not held.")
        self.kv_blocks = gauge("kv_cache_blocks", "KV-cache blocks in the pool.")
        self._last: EngineSnapshot | None = None

    def on_step(self, step: StepStats | None, outputs: Sequence[RequestOutput],
                finished: Sequence[FinishedRequest], snapshot: EngineSnapshot) -> None:
        if step is not None:
            self.steps[step_kind(step)].inc()
            self.step_time[step_kind(step)].observe(step.duration_s)
            if step.host_s is not None:
                self.step_host[step_kind(step)].observe(step.host_s)
            self.step_tokens.observe(step.num_tokens)
            self.step_prefill_tokens.inc(step.num_prefill_tokens)
            self.step_decode_tokens.inc(step.num_decode_tokens)
            if step.experts_read is not None:
                self.step_experts.observe(step.experts_read)
            self._observe_roofline(step)
        for out in outputs:
            times = out.metrics.token_times
            if not times:
                if out.finished and out.finish_reason == "length":  # max_tokens 0: scored
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                continue
            new = len(out.delta_token_ids)
            self.generation_tokens.inc(new)
            if len(times) == new:  # this step gave the request its first token
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            for gap in new_token_gaps(out):
                self.itl.observe(gap)
        for f in finished:
            self._observe_request(f)
        last = self._last
        cumulative = {"num_preemptions": self.preemptions, "prefix_queries": self.prefix_queries,
                      "prefix_hits": self.prefix_hits, **self.spec_counters}
        for field, metric in cumulative.items():
            now = getattr(snapshot, field)
            metric.inc(max(0, now - getattr(last, field)) if last is not None else now)
        self._last = snapshot
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.waiting_remote.set(snapshot.num_waiting_remote)
        self.blocks_waiting_remote.set(snapshot.num_blocks_waiting_remote)
        self.parked.set(snapshot.num_parked)
        self.kv_usage.set(snapshot.kv_usage)
        self.kv_free_blocks.set(snapshot.num_free_blocks)
        self.kv_blocks.set(snapshot.num_blocks)

    def _observe_roofline(self, step: StepStats) -> None:
        dt = step.duration_s
        if dt > 0:
            if step.predicted_bytes is not None:
                self.step_bandwidth.observe(step.predicted_bytes / dt)
            if step.predicted_flops is not None:
                self.step_flops.observe(step.predicted_flops / dt)
        if step.predicted_s is not None and step.predicted_s > 0:
            self.step_predicted.observe(step.predicted_s)
            self.step_over_roofline.observe(dt / step.predicted_s)

    def _observe_request(self, f: FinishedRequest) -> None:
        m = f.metrics
        self.finished.get(f.finish_reason, self.finished["abort"]).inc()
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            if f.finish_reason == "length":  # max_tokens 0: it only scored its prompt
                self.prompt_len.observe(f.num_prompt_tokens)
                self.gen_len.observe(0)
            return  # no first token: no prefill/decode figures
        self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        self.decode_time.observe(m.token_times[-1] - m.first_token_time)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        self.prompt_len.observe(f.num_prompt_tokens)
        self.gen_len.observe(f.num_output_tokens)


class StatLogger:
    """Engine observer that logs one throughput line at most every ``interval_s`` seconds,
    and only when something happened since the last line. Where other processes took a
    large share of the CPUs over the interval (``phasewise.perf.contention``), the line says
    so, and, where the engine runs several threads (``threads()``), that fewer may run
    faster: a warning, at most every ``CONTENTION_WARN_S``."""

    CONTENTION_WARN_S = 60.0

    def __init__(self, interval_s: float = 5.0,
                 logger: logging.Logger | None = None,
                 threads: Callable[[], int] | None = None) -> None:
        self.interval_s = interval_s
        self.log = logger or logging.getLogger("phasewise.stats")
        self._threads = threads
        self._t0 = time.monotonic()
        self._prompt = 0
        self._gen = 0
        self._last: EngineSnapshot | None = None
        self._base: EngineSnapshot | None = None
        self._cpu = CpuSample.now()
        self._warned = -math.inf

    def on_step(self, step: StepStats | None, outputs: Sequence[RequestOutput],
                finished: Sequence[FinishedRequest], snapshot: EngineSnapshot) -> None:
        if step is not None:
            self._prompt += step.num_prefill_tokens
            self._gen += len(outputs)
        if self._base is None:
            self._base = snapshot
        self._last = snapshot
        now = time.monotonic()
        if now - self._t0 >= self.interval_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> str | None:
        """Log (and return) the line for the interval just ended, if anything happened."""
        now = time.monotonic() if now is None else now
        snap, base = self._last, self._base
        dt = max(now - self._t0, 1e-9)
        line = None
        cpu = CpuSample.now()
        if snap is not None and (self._prompt or self._gen or snap.num_running
                                 or snap.num_waiting):
            queries = snap.prefix_queries - (base.prefix_queries if base else 0)
            hits = snap.prefix_hits - (base.prefix_hits if base else 0)
            hit_rate = 100.0 * hits / queries if queries else 0.0
            line = (f"prompt {self._prompt / dt:.1f} tok/s, generation {self._gen / dt:.1f} "
                    f"tok/s, running {snap.num_running}, waiting {snap.num_waiting}, "
                    f"KV usage {100 * snap.kv_usage:.1f}%, prefix hit rate {hit_rate:.1f}%")
            warn = False
            busy = Contention.between(self._cpu, cpu)
            if busy is not None and busy.shared:
                line += f"; {busy.words()}"
                threads = self._threads() if self._threads is not None else 1
                if threads > 1:
                    line += f": {fewer_threads(threads)} while this lasts"
                    warn = now - self._warned >= self.CONTENTION_WARN_S
            if warn:
                self._warned = now
                self.log.warning(line)
            else:
                self.log.info(line)
        self._cpu = cpu
        self._t0, self._prompt, self._gen, self._base = now, 0, 0, snap
        return line
