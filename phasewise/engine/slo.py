"""Admission by service-level objective: a request that carries a TTFT or TPOT target (its own,
or the server's ``--slo-ttft-ms``/``--slo-tpot-ms``) is refused at once when the engine
predicts it would miss it, instead of being served late. A request with no target is never
refused for this.

The forecast is pure (``forecast``): the queue as it stands (``QueueState``), the request's
uncached prompt tokens, and what a step costs (``cost(prefill_tokens, decode_rows)`` in
seconds). The simulator calls it with its own cost model, the engine with ``StepClock``:

* **TTFT**: the prompt tokens ahead of the request (running prompts' remaining chunks and the
  waiting queue's, FIFO) and its own are computed at the step budget less the decode rows
  each step carries first; the decode rows are those running now plus half the requests
  ahead (they join the decodes as their prompts finish). Where the seats (``max_num_seqs``)
  are short, the wait for as many running requests to finish as it is short of comes first
  (each at its remaining output tokens, fewest first).
* **TPOT**: a step at the batch the request joins (every running and waiting request and
  itself, up to the seats) that also carries the prompt tokens the steps of the last second
  carried on average (``interference``: under chunked prefill the prompts of requests that
  arrive later share its decode steps, at the rate prompts have been arriving).

``StepClock`` prices a step from the engine's own recent steps, so it holds on a busy machine:
with the roofline cost model (stored peaks) it scales the model's prediction by the median
ratio of the last steps' *periods* (start to next start: what a stream sees, the engine
loop's own time included) to their predictions; with none, it fits period ~ a + b x prefill
tokens + c x decode rows over the last steps. Until it has seen enough steps it says nothing
(``None``) and nothing is refused. Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# Targets a request or a server may set, in milliseconds (an hour: beyond it "no SLO").
SLO_MS_MIN = 1.0
SLO_MS_MAX = 3_600_000.0
# The share of a target a forecast may not use (judge): what the spread of a request's own
# TTFT and TPOT around the forecast mean needs.
MARGIN = 0.2
RETRY_MAX_S = 60  # the longest Retry-After a refusal asks for
# The recent past whose prompt tokens a new request's decode steps are expected to share:
# about as long as a short stream's decode, and an idle engine forgets a burst within it.
SHARE_WINDOW_S = 1.0
# Steps whose period the clock keeps, and the fewest it prices from.
CLOCK_STEPS = 256
MIN_STEPS = 8
# A step that follows the previous one after a gap longer than this (and than half that
# step) came after an idle engine: its predecessor's period is its duration.
IDLE_GAP_S = 0.02

Cost = Callable[[int, int], "float | None"]


@dataclass(frozen=True)
class SLO:
    """A request's targets, in seconds (None: none)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def over(self, default: SLO | None) -> SLO:
        """This request's targets, each falling back to the server's ``default``."""
        if default is None:
            return self
        return SLO(self.ttft_s if self.ttft_s is not None else default.ttft_s,
                   self.tpot_s if self.tpot_s is not None else default.tpot_s)

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None) -> SLO:
        return cls(None if ttft_ms is None else ttft_ms / 1e3,
                   None if tpot_ms is None else tpot_ms / 1e3)


def check_slo_ms(value: Any, name: str) -> float:
    """A target in milliseconds, checked: a finite number in [SLO_MS_MIN, SLO_MS_MAX].
    Raises ValueError naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not SLO_MS_MIN <= value <= SLO_MS_MAX:
        raise ValueError(f"{name} must be a number of milliseconds in [{SLO_MS_MIN:g}, "
                         f"{SLO_MS_MAX:g}]; got {value!r}")
    return float(value)


@dataclass(frozen=True)
class QueueState:
    """What is ahead of a new request: ``decodes`` running requests past their prompt;
    ``prefills`` requests with prompt tokens left (running chunks and the waiting queue) and
    ``prefill_tokens`` those tokens; ``seated`` requests running or waiting; ``finishing``
    the output tokens each running request may still take, fewest first; the step
    ``budget`` and the seats (``max_seqs``)."""

    decodes: int
    prefills: int
    prefill_tokens: int
    seated: int
    finishing: tuple[int, ...]
    budget: int
    max_seqs: int


@dataclass(frozen=True)
class Forecast:
    ttft_s: float | None  # None: the clock cannot say yet
    tpot_s: float | None


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: ``reason`` (``slo_ttft`` or ``slo_tpot``), the forecast
    against the target, and when to retry."""

    reason: str
    predicted_s: float
    target_s: float
    retry_after_s: int

    @property
    def message(self) -> str:
        what = "time to first token" if self.reason == "slo_ttft" else "time per output token"
        pred = "never (no step has room for its prompt)" if math.isinf(self.predicted_s) \
            else f"{self.predicted_s * 1e3:.0f} ms"
        return (f"refused at admission: its {what} would be {pred} at the current load, too "
                f"near its target of {self.target_s * 1e3:.0f} ms (it is admitted within "
                f"{1 - MARGIN:.0%} of it); retry after "
                f"{self.retry_after_s} s, or send it without the target")


def forecast(q: QueueState, own_tokens: int, n: int, cost: Cost,
             interference: float = 0.0) -> Forecast:
    """TTFT and TPOT of a group of ``n`` requests with ``own_tokens`` uncached prompt tokens
    in all, joining ``q``, its decode steps carrying ``interference`` prompt tokens each (see
    the module)."""
    decoding = min(q.max_seqs, q.decodes + q.prefills // 2)
    wait: float | None = 0.0
    short = q.seated + n - q.max_seqs  # seats that must free before its last one runs
    if short > 0 and q.finishing:
        step = cost(0, max(1, min(q.decodes, q.max_seqs)))
        left = q.finishing[min(short, len(q.finishing)) - 1]
        wait = None if step is None else left * step
    room = q.budget - decoding
    work = q.prefill_tokens + own_tokens
    ttft: float | None
    if wait is None:
        ttft = None
    elif room < 1:
        ttft = math.inf
    else:
        full, rest = divmod(work, room)
        a = cost(room, decoding) if full else 0.0
        b = cost(rest, decoding) if rest else 0.0
        ttft = None if a is None or b is None else wait + full * a + b
    # every request seated (running, waiting, or reserved for a remote prefill) decodes
    batch = max(1, min(q.max_seqs, max(q.seated, q.decodes + q.prefills) + n))
    shared = max(0, min(round(interference), q.budget - batch))
    return Forecast(ttft, cost(shared, batch))


def group_forecast(scheduler: Any, kv: Any, group: list[Any], cost: Cost,
                   interference: float = 0.0) -> Forecast:
    """The forecast for ``group``, requests just added to ``scheduler``'s waiting queue (or
    reserved for a remote prefill, which adds no prompt work here), against the rest of its
    queue; ``kv`` (its ``KVCacheManager``) says how much of each prompt is cached. The engine
    and the simulator both call this."""
    s = scheduler
    mine = {r.request_id for r in group}
    decodes = prefills = ahead = 0
    finishing = []
    # a parked request (its client stopped reading) runs nothing and gives up its seat to a
    # newcomer first: no load ahead of the group
    parked = 0
    for r in s.running:
        if r.parked:
            parked += 1
            continue
        left = r.num_tokens - r.num_computed_tokens
        if left <= 1:
            decodes += 1
        else:
            prefills += 1
            ahead += left
        cap = s.max_len - r.num_tokens
        if r.params.max_tokens is not None:
            cap = min(cap, r.params.max_tokens - r.num_output_tokens)
        finishing.append(max(0, cap))
    for r in s.waiting:
        if r.parked:
            parked += 1
        elif r.request_id not in mine:
            prefills += 1
            ahead += r.num_tokens - r.num_computed_tokens
    own = sum(r.num_tokens - kv.get_computed_blocks(r).num_tokens
              for r in group if r.request_id not in s.remote)
    seated = len(s.running) + len(s.remote) + len(s.waiting) - len(group) - parked
    q = QueueState(decodes, prefills, ahead, max(0, seated), tuple(sorted(finishing)),
                   s.config.max_num_batched_tokens, s.config.max_num_seqs)
    return forecast(q, own, len(group), cost, interference)


def mean_context(scheduler: Any, group: list[Any]) -> int:
    """The decode context a step's rows have now (the running requests' mean length; the
    group's first prompt where none runs): what a forecast prices decode rows at."""
    lengths = [r.num_tokens for r in scheduler.running] or [group[0].num_tokens]
    return sum(lengths) // len(lengths)


def judge(slo: SLO, fc: Forecast, margin: float = MARGIN) -> Refusal | None:
    """The refusal a forecast earns against ``slo``, or None (a target the forecast cannot
    speak to is met). A forecast is a mean, and a request's own figure spreads around it
    (which steps its tokens share with prompt chunks, the machine's other load), so a
    request is admitted only where its forecast is within ``1 - margin`` of each target."""
    for reason, target, got in (("slo_ttft", slo.ttft_s, fc.ttft_s),
                                ("slo_tpot", slo.tpot_s, fc.tpot_s)):
        bound = None if target is None else target * (1 - margin)
        if bound is not None and got is not None and got > bound:
            # the queue ahead drains in about the time it is over (at least a second; at
            # most RETRY_MAX_S: a forecast that far out is too unsure to send a client away
            # for longer)
            over = got - bound if math.isfinite(got) else 1.0
            return Refusal(reason, got, target, min(RETRY_MAX_S, max(1, math.ceil(over))))
    return None


def prompt_share(starts: Iterable[tuple[float, int]], now: float) -> float:
    """Prompt tokens a step carried on average over the steps (``(start, prompt tokens)``)
    that began in the last ``SHARE_WINDOW_S`` before ``now`` (0 where none did: an idle
    engine carries none, however busy it was before, so refusals stop once the load that
    caused them has). The engine's clock and the simulator's engines both ask this."""
    recent = [p for t, p in starts if t >= now - SHARE_WINDOW_S]
    return sum(recent) / len(recent) if recent else 0.0


class StepClock:
    """A step's cost on this engine now, learnt from its recent steps (see the module)."""

    def __init__(self, keep: int = CLOCK_STEPS) -> None:
        # (prefill tokens, decode rows, period, predicted seconds or None)
        self.steps: deque[tuple[int, int, float, float | None]] = deque(maxlen=keep)
        self._starts: deque[tuple[float, int]] = deque(maxlen=keep)  # (start, prompt tokens)
        self._last: Any = None  # the step whose period the next one closes
        self._fit: tuple[float, float | None, float] | None = None
        self._scale: float | None = None
        self._dirty = True

    def prompt_share(self, now: float) -> float:
        """``prompt_share`` of this engine's recent steps."""
        return prompt_share(self._starts, now)

    def observe(self, step: Any) -> None:
        """A finished step (``StepStats``): its predecessor's period is now known."""
        self._starts.append((step.start_time, step.num_prefill_tokens))
        prev, self._last = self._last, step
        if prev is None:
            return
        gap = step.start_time - (prev.start_time + prev.duration_s)
        period = (step.start_time - prev.start_time
                  if gap <= max(IDLE_GAP_S, 0.5 * prev.duration_s) else prev.duration_s)
        self.steps.append((prev.num_prefill_tokens, prev.num_decode_tokens, period,
                           prev.predicted_s))
        self._dirty = True

    def _learn(self) -> None:
        self._dirty = False
        ratios = [p / s for _, _, p, s in self.steps if s]
        self._scale = (statistics.median(ratios[-64:]) if len(ratios) >= MIN_STEPS
                       else None)
        self._fit = _fit([(a, b, p) for a, b, p, _ in self.steps])

    def cost(self, prefill_tokens: int, decode_rows: int,
             predicted: Callable[[int, int], float | None] | None = None) -> float | None:
        """Seconds a step of this mix takes now: ``predicted`` (the cost model's seconds for
        it) x the live scale where both exist, else the fit; None before enough steps."""
        if self._dirty:
            self._learn()
        if predicted is not None and self._scale is not None:
            base = predicted(prefill_tokens, decode_rows)
            if base is not None:
                return base * self._scale
        if self._fit is None:
            return None
        a, b, c = self._fit
        if b is None:
            return None if prefill_tokens else a + c * decode_rows
        return a + b * prefill_tokens + c * decode_rows


def _fit(rows: list[tuple[int, int, float]]) -> tuple[float, float | None, float] | None:
    """Least squares of period ~ a + b x prefill + c x decodes, every coefficient >= 0: the
    first of the models (all three terms, then without the decode term, then without the
    intercept) whose fit is solvable and non-negative (steps that all decode the same rows
    cannot tell the intercept from the decode term). Without two steps with prompt tokens
    (a decode worker whose prompts a prefill worker computes) there is no prefill slope:
    ``b`` is None, and only decode steps are priced. None without enough steps."""
    if len(rows) < MIN_STEPS:
        return None
    if sum(1 for p, _, _ in rows if p) < 2:
        for use in ([True, False, True], [True, False, False]):
            coef = _solve(rows, use)
            if coef is not None and min(coef) >= -1e-9:
                return max(0.0, coef[0]), None, max(0.0, coef[2])
        return None
    for use in ([True, True, True], [True, True, False], [False, True, True]):
        coef = _solve(rows, use)
        # (a coefficient that is zero in truth comes out a rounding error either side)
        if coef is not None and min(coef) >= -1e-9:
            return max(0.0, coef[0]), max(0.0, coef[1]), max(0.0, coef[2])
    return None


def _solve(rows: list[tuple[int, int, float]], use: list[bool]
           ) -> list[float] | None:
    """Least squares over the kept columns of (1, prefill, decodes), as [a, b, c] with the
    others 0; None where those columns cannot be told apart (rank below their number)."""
    cols = [i for i in range(3) if use[i]]
    x = np.array([(1.0, p, d) for p, d, _ in rows])[:, cols]
    coef, _, rank, _ = np.linalg.lstsq(x, np.array([t for _, _, t in rows]), rcond=None)
    if rank < len(cols):
        return None
    out = [0.0, 0.0, 0.0]
    for i, col in enumerate(cols):
        out[col] = float(coef[i])
    return out
