"""What ``/dashboard`` shows, gathered on the engine's thread: ``DashboardFeed``.

The feed is an engine observer. Each step it appends one small record (the step's token mix,
its time, its roofline prediction, the queue and the KV pool after it) to a bounded ring, adds
the step's TTFTs and ITLs to two fixed-bucket histograms, follows every request it sees
(its counts, for the stall view) and keeps a full trace of the playground's (the steps it
rode on, each output's time and text), and flags *stalls*: a step holding a prompt chunk that
took far longer than the recent decode-only steps while other requests were streaming. A
stall is blamed on its prompt chunks only where their cost explains it: the chunks' marginal
cost as the engine's cost model prices it (the step's prediction less that of its decodes
alone), scaled by how far this machine's recent steps ran from their predictions, must be at
least ``CHUNK_SHARE`` of the step's excess over the decode baseline. Otherwise the step is
recorded as a slow step with no intruder: where the engine timed its forward pass and the
host time it spent outside it (``StepStats.forward_s``, ``host_s``) beyond the decode steps'
median host time makes up at least ``CHUNK_SHARE`` of the excess, the excess is host time
(``host_share``); else nothing measured says what it was (other load on the machine, a page
fault, a collection). Unpriced steps (no stored peaks) blame their chunks as before, marked so.
Nothing here is heavier than a few appends per request per step, and nothing is encoded on
the engine's thread.

Only the playground's requests (ids that start with ``PLAYGROUND_PREFIX``) are traced in
full, their text included: another client's request is kept only as its counts, so a
dashboard viewer never reads what others generated.

``frame(cursor)`` (on the event loop, under the lock, bounded) returns what is new since the
caller's cursor, ready for JSON. This module imports no torch and no web framework.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from phasewise.engine.backend import EngineSnapshot, FinishedRequest
from phasewise.engine.outputs import RequestOutput, StepStats, new_token_gaps

# Latency histogram edges: 1 ms to ~63 s, five per decade (the last bin is open).
LATENCY_EDGES = tuple(round(1e-3 * 10 ** (i / 5), 6) for i in range(26))
STEP_HISTORY = 2048  # steps kept (the page's charts show the last few hundred)
MAX_STEPS_PER_FRAME = 512  # a frame carries at most this many new steps (the rest: skipped)
STALL_FACTOR = 3.0  # a step is a stall when it takes this many times the decode baseline...
STALL_MIN_EXTRA_S = 0.005  # ...and at least this much longer
BASELINE_STEPS = 32  # decode-only steps the baseline is the median of
CHUNK_SHARE = 0.5  # a stall's chunks must explain at least this share of its excess
SLOWDOWN_STEPS = 32  # recent prompt-bearing steps whose measured/predicted chunk cost is kept
MAX_TRACES = 4096  # requests followed at once (beyond: the oldest is forgotten)
FINISHED_TRACES = 256  # finished playground requests whose traces are kept
MAX_TRACE_EVENTS = 4096  # outputs (and steps) kept per playground trace
PLAYGROUND_PREFIX = "cmpl-playground-"  # the playground's request ids
STALL_HISTORY = 64
TRANSFER_HISTORY = 512
MAX_VICTIM_IDS = 8


def _sig(x: float | None) -> float | None:
    """``x`` to four significant digits."""
    return None if x is None else float(f"{x:.4g}")


def _round(x: float | None) -> float | None:
    """A step time as the step rows carry it (to 0.1 us)."""
    return None if x is None else round(x, 7)


def _median(values: Any) -> float:
    """The upper median (the feed's windows are small and their order does not matter)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def bucket(edges: Sequence[float], x: float) -> int:
    """Index of the bin of ``x``: bin i holds edges[i-1] <= x < edges[i]; the last is open."""
    lo, hi = 0, len(edges)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < edges[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass
class Trace:
    """One request as the engine ran it (times in seconds since its arrival)."""

    request_id: str
    arrival: float
    prompt_tokens: int = 0
    first_scheduled: float | None = None
    # (step index, tokens, "prefill" or "decode") per step it rode on
    steps: list[tuple[int, int, str]] = field(default_factory=list)
    # (time, new tokens, text) per output
    outputs: list[tuple[float, int, str]] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    truncated: bool = False
    full: bool = False  # a playground request: its steps and outputs are kept

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.request_id, "prompt_tokens": self.prompt_tokens,
                "queue_s": self.first_scheduled, "steps": self.steps,
                "outputs": self.outputs, "num_tokens": self.num_tokens,
                "finished": self.finish_reason is not None,
                "finish_reason": self.finish_reason, "truncated": self.truncated}


class DashboardFeed:
    """Engine observer behind ``/dashboard`` (see the module). ``peaks``: this machine's
    stored figures (``{"name", "bandwidth", "flops": {dtype: FLOP/s}}``) or None."""

    def __init__(self, *, model_name: str, role: str = "both",
                 peaks: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
                 clock: Any = time.monotonic) -> None:
        self.model_name = model_name
        self.role = role
        self.peaks = peaks
        self.info = info or {}
        self.clock = clock
        self.t0 = clock()
        self._lock = threading.Lock()
        self._steps: deque[list[Any]] = deque(maxlen=STEP_HISTORY)
        self._num_steps = 0  # steps seen (the cursor of frames)
        self._decode_times: deque[float] = deque(maxlen=BASELINE_STEPS)
        # the decode-only steps' predicted seconds (beside _decode_times, where priced), and
        # recent prompt-bearing steps' ratio of measured to predicted marginal chunk cost
        self._decode_predicted: deque[float] = deque(maxlen=BASELINE_STEPS)
        # the decode-only steps' host time (outside the forward pass), where measured
        self._decode_host: deque[float] = deque(maxlen=BASELINE_STEPS)
        self._chunk_slowdown: deque[float] = deque(maxlen=SLOWDOWN_STEPS)
        self.ttft = [0] * (len(LATENCY_EDGES) + 1)
        self.itl = [0] * (len(LATENCY_EDGES) + 1)
        self._snapshot: EngineSnapshot | None = None
        self._stalls: deque[dict[str, Any]] = deque(maxlen=STALL_HISTORY)
        self._num_stalls = 0
        self._transfers: deque[list[Any]] = deque(maxlen=TRANSFER_HISTORY)
        self._num_transfers = 0
        self._active: dict[str, Trace] = {}
        self._done: OrderedDict[str, Trace] = OrderedDict()
        self.num_finished = 0

    # -- the engine's thread ---------------------------------------------------------------
    def _trace(self, rid: str, arrival: float | None) -> Trace:
        tr = self._active.get(rid)
        if tr is None:
            if len(self._active) >= MAX_TRACES:  # its end was never reported: let it go
                del self._active[next(iter(self._active))]
            tr = self._active[rid] = Trace(rid, self.clock() if arrival is None else arrival,
                                           full=rid.startswith(PLAYGROUND_PREFIX))
        return tr

    def on_step(self, step: StepStats | None, outputs: Sequence[RequestOutput],
                finished: Sequence[FinishedRequest], snapshot: EngineSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot
            if step is not None:
                self._on_step(step)
            for out in outputs:
                self._on_output(out)
            for f in finished:
                self._on_finished(f)

    def _on_step(self, step: StepStats) -> None:
        self._num_steps += 1
        for rid, n in step.prefill_chunks:
            tr = self._trace(rid, None)
            if tr.full and len(tr.steps) < MAX_TRACE_EVENTS:
                tr.steps.append((step.index, n, "prefill"))
        for rid in step.decode_ids:  # (a remotely prefilled request is first seen here)
            tr = self._active.get(rid)
            if tr is None and rid.startswith(PLAYGROUND_PREFIX):
                tr = self._trace(rid, None)
            if tr is not None and tr.full and len(tr.steps) < MAX_TRACE_EVENTS:
                tr.steps.append((step.index, 1, "decode"))
        self._steps.append([  # (rounded to what a chart shows: a smaller frame to encode)
            step.index, round(step.start_time - self.t0, 4), round(step.duration_s, 7),
            step.num_prefill_tokens, step.num_decode_tokens, _sig(step.predicted_s),
            _sig(step.predicted_bytes), _sig(step.predicted_flops), step.compute_dtype,
            step.num_requests, step.num_running, step.num_waiting, round(step.kv_usage, 4),
            _round(step.forward_s), _round(step.host_s), _round(step.experts_read),
            step.kv_context, _round(step.kv_read)])
        if step.num_prefill_tokens == 0:
            if step.num_decode_tokens:
                self._decode_times.append(step.duration_s)
                if step.predicted_s:
                    self._decode_predicted.append(step.predicted_s)
                if step.host_s is not None:
                    self._decode_host.append(step.host_s)
            return
        self._check_stall(step)

    @staticmethod
    def _marginal_s(step: StepStats) -> float | None:
        """The step's prompt chunks' predicted cost: its prediction less that of its decodes
        alone; None where the step is unpriced."""
        if step.predicted_s is None or step.predicted_decode_s is None:
            return None
        return max(step.predicted_s - step.predicted_decode_s, 0.0)

    def _expected_chunk_s(self, marginal: float, base: float) -> float:
        """What prompt chunks of predicted cost ``marginal`` should have added to a step's
        decodes, in this machine's seconds: ``marginal`` times the median ratio of measured
        to predicted over recent prompt-bearing steps (before there are four of those: the
        decode steps' ratio, at least 1)."""
        if len(self._chunk_slowdown) >= 4:
            ratio = _median(self._chunk_slowdown)
        elif self._decode_predicted:
            predicted = _median(self._decode_predicted)
            ratio = max(1.0, base / predicted) if predicted > 0 else 1.0
        else:
            ratio = 1.0
        return marginal * ratio

    def _check_stall(self, step: StepStats) -> None:
        if len(self._decode_times) < 4:
            return
        base = _median(self._decode_times)
        marginal = self._marginal_s(step)
        if step.duration_s < max(STALL_FACTOR * base, base + STALL_MIN_EXTRA_S):
            if marginal and step.num_decode_tokens:  # a step that ran as its batch says
                self._chunk_slowdown.append(max(step.duration_s - base, 0.0) / marginal)
            return
        expected = None if marginal is None else self._expected_chunk_s(marginal, base)
        victims = list(step.decode_ids)
        if not victims:  # a prompt-only step: the streams it held back did not run at all
            riding = {rid for rid, _ in step.prefill_chunks}
            victims = [rid for rid, tr in self._active.items()
                       if tr.num_tokens and tr.finish_reason is None and rid not in riding]
        if not victims:
            return
        excess = step.duration_s - base
        explained = expected is None or expected >= CHUNK_SHARE * excess
        # the host's part of the excess: its time outside the forward pass beyond the decode
        # steps' usual (None where either is unmeasured)
        host = step.host_s
        base_host = _median(self._decode_host) if self._decode_host else None
        host_share = (None if host is None or base_host is None or excess <= 0
                      else max(host - base_host, 0.0) / excess)
        # each chunk's prompt: from the step (the request may not have output anything yet),
        # else from its trace
        prompts = dict(zip((rid for rid, _ in step.prefill_chunks), step.prefill_prompt_tokens))
        intruders = sorted(step.prefill_chunks, key=lambda c: -c[1]) if explained else []
        self._num_stalls += 1
        self._stalls.append({
            "n": self._num_stalls, "step": step.index,
            "t": round(step.start_time - self.t0, 4), "duration_s": step.duration_s,
            "baseline_s": base, "priced": expected is not None,
            "expected_chunk_s": expected, "explained": explained,
            "forward_s": step.forward_s, "host_s": host, "baseline_host_s": base_host,
            "host_share": None if host_share is None else round(host_share, 4),
            "chunks": [{"id": rid, "tokens": n} for rid, n in step.prefill_chunks
                       ][:MAX_VICTIM_IDS] if not explained else [],
            "intruders": [{"id": rid, "tokens": n,
                           "prompt_tokens": prompts.get(rid) or (
                               self._active[rid].prompt_tokens or None
                               if rid in self._active else None)}
                          for rid, n in intruders],
            "num_victims": len(victims), "victims": victims[:MAX_VICTIM_IDS]})

    def _on_output(self, out: RequestOutput) -> None:
        m = out.metrics
        times = m.token_times
        if not times:
            return
        new = len(out.delta_token_ids)
        if new:
            if len(times) == new:  # its first token(s)
                self.ttft[bucket(LATENCY_EDGES, times[0] - m.arrival_time)] += 1
            for gap in new_token_gaps(out):
                self.itl[bucket(LATENCY_EDGES, gap)] += 1
        full = out.request_id.startswith(PLAYGROUND_PREFIX)
        if out.finished and not full and out.request_id not in self._active:
            return  # (one step from admission to its end: nothing to follow)
        tr = self._trace(out.request_id, m.arrival_time)
        tr.arrival = m.arrival_time
        tr.prompt_tokens = len(out.prompt_token_ids)
        tr.num_tokens = len(times)
        if not tr.full:
            return
        if m.first_scheduled_time is not None:
            tr.first_scheduled = m.first_scheduled_time - m.arrival_time
        if len(tr.outputs) < MAX_TRACE_EVENTS:
            tr.outputs.append((times[-1] - m.arrival_time, new, out.delta_text))
        else:
            tr.truncated = True

    def _on_finished(self, f: FinishedRequest) -> None:
        self.num_finished += 1
        tr = self._active.pop(f.request_id, None)
        if tr is None or not tr.full:
            return
        tr.finish_reason = f.finish_reason
        self._done[f.request_id] = tr
        while len(self._done) > FINISHED_TRACES:
            self._done.popitem(last=False)

    def on_transfer(self, t: Any) -> None:
        """A remote prefill's K/V landed (the decode role's ``DecodeSide.on_transfer``)."""
        if t.done_at is None:
            return
        start = t.first_frame_at if t.first_frame_at is not None else t.sent_at
        window = t.done_at - start
        with self._lock:
            self._num_transfers += 1
            self._transfers.append([
                self._num_transfers, round(t.done_at - self.t0, 4), t.peer or "?", t.nbytes,
                t.frames, window, t.done_at - t.sent_at,
                t.nbytes / window / 1e9 if window > 0 else None])

    # -- the event loop --------------------------------------------------------------------
    def hello(self, history: int = 400, cursor: Cursor | None = None) -> dict[str, Any]:
        """The first event a page gets: what it is looking at, and recent history.
        ``cursor`` (optional) is left where the hello ends, for frames to go on from."""
        with self._lock:
            start = Cursor(max(0, self._num_steps - history),
                           max(0, self._num_stalls - STALL_HISTORY),
                           max(0, self._num_transfers - TRANSFER_HISTORY))
        frame = self.frame(start)
        if cursor is not None:
            cursor.steps, cursor.stalls, cursor.transfers = (start.steps, start.stalls,
                                                             start.transfers)
        frame.update(kind="hello", model=self.model_name, role=self.role, peaks=self.peaks,
                     info=self.info, edges=LATENCY_EDGES,
                     step_fields=["index", "t", "duration_s", "prefill", "decode",
                                  "predicted_s", "bytes", "flops", "dtype", "requests",
                                  "running", "waiting", "kv_usage", "forward_s",
                                  "host_s", "experts_read", "kv_context", "kv_read"],
                     transfer_fields=["n", "t", "peer", "bytes", "frames", "window_s",
                                      "span_s", "gbps"])
        return frame

    def frame(self, cursor: Cursor) -> dict[str, Any]:
        """What is new since ``cursor`` (advanced in place); bounded in size."""
        with self._lock:
            new = self._num_steps - cursor.steps
            take = min(new, MAX_STEPS_PER_FRAME, len(self._steps))
            steps = list(self._steps)[len(self._steps) - take:] if take else []
            skipped = new - take
            cursor.steps = self._num_steps
            n_st = min(self._num_stalls - cursor.stalls, len(self._stalls))
            stalls = list(self._stalls)[len(self._stalls) - n_st:] if n_st else []
            cursor.stalls = self._num_stalls
            n_tr = min(self._num_transfers - cursor.transfers, len(self._transfers))
            transfers = list(self._transfers)[len(self._transfers) - n_tr:] if n_tr else []
            cursor.transfers = self._num_transfers
            snap = self._snapshot
            ttft, itl = list(self.ttft), list(self.itl)
            active = len(self._active)
            finished = self.num_finished
        return {"kind": "frame", "t": round(self.clock() - self.t0, 4), "steps": steps,
                "skipped": skipped, "stalls": stalls, "transfers": transfers,
                "snapshot": None if snap is None else {
                    "running": snap.num_running, "waiting": snap.num_waiting,
                    "kv_usage": snap.kv_usage, "free_blocks": snap.num_free_blocks,
                    "blocks": snap.num_blocks, "preemptions": snap.num_preemptions,
                    "prefix_queries": snap.prefix_queries, "prefix_hits": snap.prefix_hits,
                    "waiting_remote": snap.num_waiting_remote, "parked": snap.num_parked},
                "ttft": ttft, "itl": itl, "traced": active, "finished": finished}

    def trace(self, request_id: str) -> dict[str, Any] | None:
        """A playground request's trace (running or recently finished), or None."""
        with self._lock:
            tr = self._active.get(request_id) or self._done.get(request_id)
            if tr is None or not tr.full:
                return None
            d = tr.as_dict()
            d["steps"] = list(d["steps"])
            d["outputs"] = list(d["outputs"])
            first = d["steps"][0][0] if d["steps"] else None
            recent = [s for s in self._steps if first is not None and s[0] >= first]
        by_index = {s[0]: s for s in recent}
        # each step it rode on, with that step's whole mix (for "the steps it rode on")
        d["step_detail"] = [
            {"index": i, "tokens": n, "phase": phase,
             **({"duration_s": s[2], "prefill": s[3], "decode": s[4], "requests": s[9],
                 "predicted_s": s[5], "forward_s": s[13], "host_s": s[14]}
                if (s := by_index.get(i)) is not None else {})}
            for i, n, phase in d["steps"]]
        return d


@dataclass
class Cursor:
    """How far one page has been sent: steps, stalls and transfers seen."""

    steps: int = 0
    stalls: int = 0
    transfers: int = 0


def peaks_of(accel: Any) -> dict[str, Any] | None:
    """The page's view of an ``Accelerator`` (None: no figures stored for this machine)."""
    if accel is None:
        return None
    return {"name": accel.name, "bandwidth": accel.mem_bandwidth,
            "flops": dict(accel.peak_flops)}
