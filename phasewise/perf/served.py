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
  tokenising, the first frame): the part of a lone request's TTFT its steps do not explain.

``ServedCostModel`` applies them to a cost model: a step's chunks' marginal cost at the
prefill scale, its decodes' at the decode scale, plus the per-step and per-sample gaps. The
simulator delays each request's arrival at its engine by ``request_s``.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Served:
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    step_s: float = 0.0
    sample_s: float = 0.0
    request_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("prefill_scale", "decode_scale"):
            v = getattr(self, name)
            if not 1 / SCALE_LIMIT <= v <= SCALE_LIMIT:
                raise ValueError(
                    f"the served {name.replace('_', ' ')} x{v:.3g} is outside "
                    f"[{1 / SCALE_LIMIT:g}, {SCALE_LIMIT:g}]: the profile does not describe "
                    "this server's model, machine or threads (calibrate it where the server "
                    "runs, as it runs)")
        for name in ("step_s", "sample_s", "request_s"):
            v = getattr(self, name)
            if not 0 <= v < 10:
                raise ValueError(f"the served {name} must be in [0, 10) seconds, got {v}")

    def doubt(self) -> str | None:
        """Why these figures may not be a drift from the profile, or None."""
        far = [f"{n} x{v:.2f}" for n, v in (("prefill", self.prefill_scale),
                                             ("decode", self.decode_scale))
               if not 1 / SCALE_PLAUSIBLE <= v <= SCALE_PLAUSIBLE]
        if not far:
            return None
        return (f"served steps at {' and '.join(far)} the profile's: more than a machine "
                "drifts; is the profile this server's model, machine and threads?")

    def describe(self) -> str:
        doubt = self.doubt()
        return (f"served: prefill x{self.prefill_scale:.3f}, decode x{self.decode_scale:.3f} "
                f"the profile's step times, +{self.step_s * 1e3:.2f} ms a step and "
                f"+{self.sample_s * 1e3:.2f} ms per sampled sequence between steps, "
                f"+{self.request_s * 1e3:.1f} ms a request"
                + (f" ({self.source})" if self.source else "")
                + (f"; WARNING: {doubt}" if doubt else ""))

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


def fit_served(cm: Any, lone: Phase, batched: Phase, prefill: Phase, source: str = ""
               ) -> Served:
    """``Served`` from three probe phases: ``lone`` (one stream), ``batched`` (several at
    once) and ``prefill`` (one long prompt, one token)."""
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
    # A lone request's TTFT beyond its prefill steps and the gaps after each of them.
    gaps = prefill.prefill_steps * (step_s + sample_s)
    request_s = max(0.0, statistics.median(prefill.ttfts) - prefill.prefill_sum_s - gaps)
    return Served(prefill_scale, decode_scale, step_s, sample_s, request_s, source)
