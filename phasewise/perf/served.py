"""What a step costs through ``phasewise serve``, not only in the engine.

A calibrated profile (``phasewise calibrate``) times steps in a quiet engine. A served step
costs more: the server's event loop (detokenising, SSE frames), its HTTP parsing and the
client share the CPU with the step's kernels, and the engine's loop runs between steps. The
machine also drifts from the speed it had when it was calibrated. A short probe through the
live server (``phasewise.bench.probe``) measures both, and ``Served`` carries them:

* ``prefill_scale`` / ``decode_scale``: the server's own step durations (its
  ``step_duration_seconds`` histogram) over the profile's prediction for the same steps: the
  drift since calibration and the CPU the rest of the process takes during a step;
* ``step_s`` and ``sample_s``: time between two steps as the client sees it, beyond the
  engine's step (the gap of a decode stream's token period over the step's own duration),
  per step and per sequence that samples in it (each streamed token's frame);
* ``request_s``: a request's own cost before its first step and after its first token (HTTP,
  tokenising, the first frame): the part of a lone request's TTFT the server's queue and
  prefill do not explain; ``request_busy_s`` the same for a request sent while its engine
  is mid-step (the event loop waits its turn for the interpreter lock);
* ``wake_s`` and ``wake_long_s``: what a request pays beyond that when the server has sat
  idle ``wake_idle_s`` seconds (CPUs and threads resume from idle states).

``ServedCostModel`` applies them to a cost model: a step's chunks' marginal cost at the
prefill scale, its decodes' at the decode scale, plus the per-step and per-sample gaps. The
simulator delays each request's arrival at its engine by its own cost (idle, busy, and the
wake-up for how long the engine idled).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from phasewise.engine.step_cost import Chunk

# A served step this many times the profile's, either way, says the profile may not be this
# server's model, machine or thread count (a calibration of another checkpoint, a server with
# other flags): applied, and said. Beyond SCALE_LIMIT the probe is refused.
SCALE_PLAUSIBLE = 2.0
SCALE_LIMIT = 100.0
# The probe's idle waits before its wake-up requests, and the idle time from which the
# simulator charges a wake-up. Between the two waits the cost goes as the log of the idle
# time; beyond the longer one it stays (what shared VMs show: a request after 0.1 s idle
# pays ~nothing, after 2 s ~60 ms, after 5 s ~110 ms, after 8-20 s ~130-170 ms).
IDLE_PROBE_S = 1.0
IDLE_LONG_S = 12.0
WAKE_AFTER_S = 0.5
WAKE_IDLE_CAP_S = 60.0  # the longest idle wait a probe may take


@dataclass(frozen=True)
class Served:
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    step_s: float = 0.0
    sample_s: float = 0.0
    request_s: float = 0.0
    source: str = ""
    # request_s when the request arrives while its engine is busy: the server's event loop
    # then waits for the interpreter lock between the engine's Python work.
    request_busy_s: float | None = None
    # What a request pays beyond request_s when its engine has sat idle (the machine's CPUs,
    # the engine's threads and the event loop resume from idle states, deeper the longer
    # they idled): measured after IDLE_PROBE_S and after IDLE_LONG_S idle.
    wake_s: float | None = None
    wake_long_s: float | None = None
    wake_idle_s: tuple[float, float] = (IDLE_PROBE_S, IDLE_LONG_S)  # the two idle times
    # what the scales multiply: a calibrated profile's step times, or (no profile for this
    # model on this machine) the roofline's at assumed efficiencies, which a real engine
    # misses by more than a machine drifts, so that a far scale then doubts nothing
    profiled: bool = True

    def __post_init__(self) -> None:
        for name in ("prefill_scale", "decode_scale"):
            v = getattr(self, name)
            if v is None:
                continue
            if not 1 / SCALE_LIMIT <= v <= SCALE_LIMIT:
                raise ValueError(
                    f"the served {name.replace('_', ' ')} x{v:.3g} is outside "
                    f"[{1 / SCALE_LIMIT:g}, {SCALE_LIMIT:g}]: "
                    + ("the profile does not describe this server's model, machine or "
                       "threads (calibrate it where the server runs, as it runs)"
                       if self.profiled else
                       "the assumed efficiencies are too far from this server's steps to "
                       "scale (phasewise calibrate fits a profile)"))
        if not 0 < self.wake_idle_s[0] < self.wake_idle_s[1] <= WAKE_IDLE_CAP_S:
            raise ValueError(f"the probe's idle waits must be 0 < short < long <= "
                             f"{WAKE_IDLE_CAP_S:g} s, got {self.wake_idle_s}")
        for name in ("step_s", "sample_s", "request_s", "request_busy_s", "wake_s",
                     "wake_long_s"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < 10:
                raise ValueError(f"the served {name} must be in [0, 10) seconds, got {v}")

    def wake_at(self, idle_s: float) -> float:
        """The wake-up cost of a request to an engine idle for ``idle_s`` (see above)."""
        if self.wake_s is None or idle_s < WAKE_AFTER_S:
            return 0.0
        short, long = self.wake_idle_s
        if self.wake_long_s is None or not long > short:
            return self.wake_s
        # a longer idle never costs less: a long probe cheaper than the short one is noise,
        # and the short one's cost is charged throughout
        slope = max(0.0, (self.wake_long_s - self.wake_s) / math.log(long / short))
        t = min(max(idle_s, short), long)
        return max(0.0, self.wake_s + slope * math.log(t / short))

    def doubt(self) -> str | None:
        """Why these figures may not be a drift from the profile, or None."""
        if not self.profiled:
            return ("no calibrated profile for this model on this machine: the scales fit "
                    "the served steps to the roofline at assumed efficiencies, not a drift "
                    "('phasewise calibrate' fits a profile)")
        far = [f"{n} x{v:.2f}" for n, v in (("prefill", self.prefill_scale),
                                             ("decode", self.decode_scale))
               if not 1 / SCALE_PLAUSIBLE <= v <= SCALE_PLAUSIBLE]
        if not far:
            return None
        return (f"served steps at {' and '.join(far)} the profile's: more than a machine "
                "drifts; is the profile this server's model, machine and threads?")

    def describe(self) -> str:
        doubt = self.doubt()
        busy = ("" if self.request_busy_s is None else
                f" (+{self.request_busy_s * 1e3:.1f} ms arriving at a busy engine)")
        if self.wake_s is not None:
            short, long = self.wake_idle_s
            busy += (f", +{self.wake_s * 1e3:.1f} ms more at an engine idle {short:g} s"
                     + ("" if self.wake_long_s is None else
                        f", +{self.wake_long_s * 1e3:.1f} ms idle {long:g} s"))
            if self.wake_long_s is not None and self.wake_long_s < self.wake_s:
                busy += (" (the longer idle measured cheaper: the probes' noise, not the "
                         f"idle; charged as {self.wake_s * 1e3:.1f} ms from {short:g} s on)")
        basis = "the profile's" if self.profiled else "the assumed efficiencies'"
        return (f"served: prefill x{self.prefill_scale:.3f}, decode x{self.decode_scale:.3f}"
                f" {basis} step times, +{self.step_s * 1e3:.2f} ms a step and "
                f"+{self.sample_s * 1e3:.2f} ms per sampled sequence between steps, "
                f"+{self.request_s * 1e3:.1f} ms a request{busy}"
                + (f" ({self.source})" if self.source else "")
                + (f"; {'WARNING' if self.profiled else 'NOTE'}: {doubt}" if doubt else ""))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ServedCostModel:
    """``cm``'s step times as ``served`` says the live server runs them."""

    def __init__(self, cm: Any, served: Served) -> None:
        self.cm, self.served = cm, served
        self.kv_bytes_per_token = cm.kv_bytes_per_token
        self.source = f"{cm.source}; {served.describe()}"

    @property
    def request_s(self) -> float:  # the simulator delays each arrival at its engine by it
        return self.served.request_s

    @property
    def request_busy_s(self) -> float:  # ... by this where that engine is mid-step
        s = self.served
        return s.request_s if s.request_busy_s is None else s.request_busy_s

    def wake(self, idle_s: float) -> float:  # ... and this more after idle_s idle
        return self.served.wake_at(idle_s)

    def __getattr__(self, name: str) -> Any:  # the rest of the cost model's interface
        return getattr(self.cm, name)

    def step_time(self, chunks: Sequence[Chunk] = (), decodes: Sequence[int] = ()) -> float:
        s = self.served
        total = self.cm.step_time(chunks, decodes)
        dec = self.cm.step_time((), decodes) if decodes and chunks else (
            total if decodes else 0.0)
        samples = len(decodes) + sum(1 for c in chunks if c.samples)
        return (s.prefill_scale * (total - dec) + s.decode_scale * dec + s.step_s
                + s.sample_s * samples)

    def describe(self) -> list[str]:
        return [*self.cm.describe(), "  " + self.served.describe()]


@dataclass(frozen=True)
class Phase:
    """One probe phase: ``batch`` streams sent at once, what the client saw and what the
    server's step histogram gained meanwhile."""

    batch: int
    prompt_len: int
    ttfts: tuple[float, ...]  # seconds, one per stream
    lockstep_itls: tuple[float, ...]  # token gaps after every stream's first token
    prefill_steps: int
    prefill_sum_s: float
    decode_steps: int
    decode_sum_s: float
    output_len: int = 0
    # Per stream that the server timed: client TTFT less the server's queue and prefill
    # (HTTP, the event loop's turns before and after the engine's work).
    outside: tuple[float, ...] = ()


def prefill_chunks(prompt_len: int, steps: int) -> list[Chunk]:
    """A lone prompt of ``prompt_len`` tokens prefilled in ``steps`` chunks of equal budget
    (the last one shorter): the chunks the server ran, from its step count."""
    steps = max(1, steps)
    b = -(-prompt_len // steps)
    out, done = [], 0
    while done < prompt_len:
        n = min(b, prompt_len - done)
        out.append(Chunk(n, done, samples=done + n == prompt_len))
        done += n
    return out


def fit_served(cm: Any, lone: Phase, batched: Phase, prefill: Phase, source: str = "",
               busy: Phase | None = None, woken: Phase | None = None,
               woken_long: Phase | None = None) -> Served:
    """``Served`` from the probe's phases: ``lone`` (one stream), ``batched`` (several at
    once), ``prefill`` (one long prompt, one token), ``busy`` (that prompt sent while a
    stream decodes; None: no busy arrival cost), ``woken`` and ``woken_long`` (that
    prompt after ``IDLE_PROBE_S`` and ``IDLE_LONG_S`` idle; None: no wake-up cost)."""
    if not (lone.lockstep_itls and batched.lockstep_itls and lone.decode_steps
            and batched.decode_steps and prefill.prefill_steps):
        raise ValueError("the probe saw no decode or no prefill steps on the server: is it "
                         "idle, and does /metrics belong to the engine that served the probe?")
    chunks = prefill_chunks(prefill.prompt_len, prefill.prefill_steps)
    pred_prefill = sum(cm.step_time([c]) for c in chunks)
    prefill_scale = prefill.prefill_sum_s / pred_prefill

    def decode_pred(ph: Phase) -> float:  # a step at the phase's mean context
        ctx = ph.prompt_len + max(1, ph.output_len) // 2
        return cm.step_time((), [ctx] * ph.batch)

    lone_step = lone.decode_sum_s / lone.decode_steps
    batch_step = batched.decode_sum_s / batched.decode_steps
    decode_scale = statistics.median([lone_step / decode_pred(lone),
                                      batch_step / decode_pred(batched)])
    # Token period beyond the server's own step: per step and per sampled sequence (two
    # batch sizes give both; negative gaps are timer noise, read as none).
    g1 = max(0.0, statistics.median(lone.lockstep_itls) - lone_step)
    gb = max(0.0, statistics.median(batched.lockstep_itls) - batch_step)
    sample_s = max(0.0, (gb - g1) / (batched.batch - lone.batch))
    step_s = max(0.0, g1 - sample_s)
    # A lone request's TTFT beyond the server's queue and prefill (where the server timed
    # them), else beyond its prefill steps and the gaps after each of them.
    if prefill.outside or lone.outside:
        request_s = max(0.0, statistics.median([*prefill.outside, *lone.outside]))
    else:
        gaps = prefill.prefill_steps * (step_s + sample_s)
        request_s = max(0.0, statistics.median(prefill.ttfts) - prefill.prefill_sum_s - gaps)
    request_busy_s = None
    if busy is not None and busy.outside:
        request_busy_s = max(0.0, statistics.median(busy.outside))
    def wake(ph: Phase | None) -> float | None:  # its TTFT beyond a just-used engine's
        if ph is None or not ph.ttfts:
            return None
        return max(0.0, statistics.median(ph.ttfts) - statistics.median(prefill.ttfts))

    return Served(prefill_scale, decode_scale, step_s, sample_s, request_s, source,
                  request_busy_s, wake(woken), wake(woken_long))
