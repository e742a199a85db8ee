"""How long an engine step takes: roofline terms, priced by efficiencies fitted to this machine.

A step is one fused pass over prompt chunks and decode tokens (``Roofline.mixed``'s mix). Its
time is modelled as a sum of roofline terms, each divided by the efficiency it reaches:

    t = overhead + per_seq * sequences
        + body(rows) / e(rows) + head(samples) / e(samples)
        + prefill attention FLOPs / (peak * e_attn)
        + prefill context K/V bytes / (bandwidth * e_kv_prefill)
        + decode K/V bytes / (bandwidth * e_kv_decode)

* ``body(rows)`` is the layers' matmuls for ``rows`` tokens at their roofline,
  ``max(2 * linear params * rows / peak, linear weight bytes / bandwidth)``; ``head`` the same
  for the LM head, which runs only on the positions that sample. Their efficiency ``e`` is a
  curve over the row count (kernels change with it: a decode step of 4 rows streams weights,
  a prefill chunk of 256 runs a GEMM), tabulated at knots and interpolated in log2(rows);
  each knot is rated against the peak of the arithmetic the engine runs at that row count.
* Attention is split as it runs: a prompt chunk's attention is arithmetic over its own
  positions and its context (``4 * layers * heads * head_dim * sum of positions``) and reads
  its context's K/V; a decode's attention reads its sequence's K/V.
* ``overhead`` is what every step pays (scheduling, sampling, Python); ``per_seq`` what each
  sequence in it adds (its block table, its sampling row).

Written as inverse efficiencies (``u = 1 / e``), the model is linear in its unknowns, so
``fit`` solves it by non-negative least squares on relative errors from measured steps
(``phasewise calibrate``), with the roofline terms' ``u`` held at 1 or more (no efficiency
above 100%) where that costs no accuracy; ``describe`` prints a figure that is not a
measurement (above a roofline, or a coefficient driven to its bound) with the reason. A ``CostModel`` with no fit (a catalog accelerator) uses one
assumed MFU and MBU for every term, and a fixed overhead, and says so in ``source``.

Pure arithmetic (numpy only to fit): the simulator calls ``step_time`` for every step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from phasewise.engine.step_cost import Chunk
from phasewise.perf.hardware import Accelerator
from phasewise.perf.models import ModelShape
from phasewise.perf.roofline import DTYPE_BYTES, chunk_positions, norm_dtype

# Assumed for an accelerator nobody calibrated (the planner's catalog GPUs): a tuned engine's
# dense GEMMs reach about half the datasheet peak, its decode steps about three quarters of
# the bandwidth, and a step costs a millisecond beyond its kernels.
DEFAULT_MFU = 0.5
DEFAULT_MBU = 0.75
DEFAULT_OVERHEAD_S = 1e-3
DEFAULT_PER_SEQ_S = 1e-5

TERMS = ("overhead", "per_seq", "attn_prefill", "kv_prefill", "kv_decode")
BOUNDED = (2, 3, 4)  # TERMS whose efficiency is a fraction of a roofline: at most 1


@dataclass(frozen=True)
class Knot:
    rows: int
    compute_dtype: str  # whose peak the matmuls at this row count are rated against
    inv_eff: float  # 1 / efficiency: measured time over roofline time


@dataclass
class StepMix:
    """One step's exact mix: ``chunks`` (prompt chunks with their contexts) and ``decodes``
    (each decoding sequence's length with its new token)."""

    chunks: Sequence[Chunk] = ()
    decodes: Sequence[int] = ()

    @property
    def rows(self) -> int:
        return sum(c.tokens for c in self.chunks) + len(self.decodes)

    @property
    def samples(self) -> int:
        return sum(1 for c in self.chunks if c.samples) + len(self.decodes)

    @property
    def seqs(self) -> int:
        return len(self.chunks) + len(self.decodes)

    @property
    def kind(self) -> str:
        if self.chunks and self.decodes:
            return "mixed"
        return "prefill" if self.chunks else "decode"


@dataclass
class CostModel:
    """Step times for one model stored at ``dtype`` on one machine (``accel``'s peaks)."""

    shape: ModelShape
    accel: Accelerator
    dtype: str = "bf16"
    knots: list[Knot] = field(default_factory=list)  # empty: assumed mfu/mbu
    overhead_s: float = DEFAULT_OVERHEAD_S
    per_seq_s: float = DEFAULT_PER_SEQ_S
    attn_prefill_inv_eff: float = 1 / DEFAULT_MFU
    kv_prefill_inv_eff: float = 1 / DEFAULT_MBU
    kv_decode_inv_eff: float = 1 / DEFAULT_MBU
    mfu: float = DEFAULT_MFU  # used only without knots
    mbu: float = DEFAULT_MBU
    compute_dtype: str | None = None  # default: the dtype (without knots)
    source: str = "assumed efficiencies"
    fit_report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.dtype = norm_dtype(self.dtype)
        self.wbytes = DTYPE_BYTES[self.dtype]
        s = self.shape
        self.body_flops_per_row = 2.0 * s.active_linear_params
        self.body_bytes = (s.num_layers * s.attn_params_per_layer + s.mlp_params) \
            * self.wbytes
        self.head_flops_per_row = 2.0 * s.lm_head_params
        self.head_bytes = s.lm_head_params * self.wbytes
        self.attn_flops_per_pos = s.attn_flops_per_position
        self.kv_bytes_per_token = s.kv_bytes_per_token(self.wbytes)
        self.bandwidth = self.accel.mem_bandwidth
        self.knots.sort(key=lambda k: k.rows)
        self._log_rows = [math.log2(k.rows) for k in self.knots]
        self._peak = {k.compute_dtype: self.accel.peak_flops_for(k.compute_dtype)
                      for k in self.knots}
        cdt = norm_dtype(self.compute_dtype or self.dtype)
        self.default_peak = self.accel.peak_flops_for(cdt)
        # Attention arithmetic is rated against the peak the largest row counts run at.
        self.attn_dtype = self.knots[-1].compute_dtype if self.knots else cdt
        self.attn_peak = self._peak[self.attn_dtype] if self.knots else self.default_peak

    # -- the terms ---------------------------------------------------------------------------
    def _knot_weights(self, rows: int) -> list[tuple[int, float]]:
        """(knot index, weight) pairs interpolating at ``rows`` (clamped at the ends)."""
        x = math.log2(max(rows, 1))
        xs = self._log_rows
        if x <= xs[0]:
            return [(0, 1.0)]
        if x >= xs[-1]:
            return [(len(xs) - 1, 1.0)]
        j = bisect.bisect_right(xs, x)
        f = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
        return [(j - 1, 1.0 - f), (j, f)]

    def _body_bytes(self, rows: int) -> float:
        """The layers' weight bytes a step of ``rows`` rows reads: all of them, but for an
        MoE model only the experts its rows route to (``ModelShape.params_read``)."""
        s = self.shape
        if not s.is_moe:
            return self.body_bytes
        return self.body_bytes - s.idle_expert_params(s.experts_touched(rows)) * self.wbytes

    def _linear_roof(self, rows: int, flops_per_row: float, nbytes: float, peak: float) -> float:
        return max(rows * flops_per_row / peak, nbytes / self.bandwidth)

    def features(self, mix: StepMix) -> list[float]:
        """The step's design row: ``TERMS`` first, then one column per knot (the matmuls'
        roofline time carried by that knot). Linear in the unknowns ``fit`` solves for."""
        rows, samples = mix.rows, mix.samples
        s = self.shape
        if s.windowed:  # a layer with a window sees at most the window
            positions = sum(s.attended_sum(c.context + 1, c.context + c.tokens)
                            for c in mix.chunks)
            chunk_read = sum(s.attended(c.context) for c in mix.chunks)
            decode_read = sum(s.attended(max(d - 1, 0)) for d in mix.decodes)
        else:
            positions = chunk_positions(mix.chunks)
            chunk_read = sum(c.context for c in mix.chunks)
            decode_read = sum(max(d - 1, 0) for d in mix.decodes)
        row = [1.0, float(mix.seqs),
               positions * self.attn_flops_per_pos / self.attn_peak,
               chunk_read * self.kv_bytes_per_token / self.bandwidth,
               decode_read * self.kv_bytes_per_token / self.bandwidth]
        cols = [0.0] * len(self.knots)
        for n, fpr, nb in ((rows, self.body_flops_per_row, self._body_bytes(rows)),
                           (samples, self.head_flops_per_row, self.head_bytes)):
            if n == 0:
                continue
            for i, w in self._knot_weights(n):
                peak = self._peak[self.knots[i].compute_dtype]
                cols[i] += w * self._linear_roof(n, fpr, nb, peak)
        return row + cols

    def step_time(self, chunks: Sequence[Chunk] = (), decodes: Sequence[int] = ()) -> float:
        mix = StepMix(chunks, decodes)
        if not self.knots:
            return self._assumed_time(mix)
        f = self.features(mix)
        coef = [self.overhead_s, self.per_seq_s, self.attn_prefill_inv_eff,
                self.kv_prefill_inv_eff, self.kv_decode_inv_eff] + [k.inv_eff for k in self.knots]
        return sum(a * b for a, b in zip(f, coef))

    def _assumed_time(self, mix: StepMix) -> float:
        """Without a fit: the roofline of the fused step at the assumed MFU and MBU."""
        peak, bw = self.default_peak * self.mfu, self.bandwidth * self.mbu
        s = self.shape
        if s.windowed:
            positions = (sum(s.attended_sum(c.context + 1, c.context + c.tokens)
                             for c in mix.chunks) + sum(s.attended(d) for d in mix.decodes))
            kv = (sum(s.attended(c.context) + c.tokens for c in mix.chunks)
                  + sum(s.attended(d) for d in mix.decodes)) * self.kv_bytes_per_token
        else:
            positions = chunk_positions(mix.chunks) + sum(mix.decodes)
            kv = (sum(c.context + c.tokens for c in mix.chunks)
                  + sum(mix.decodes)) * self.kv_bytes_per_token
        flops = (mix.rows * self.body_flops_per_row + mix.samples * self.head_flops_per_row
                 + positions * self.attn_flops_per_pos)
        nbytes = self._body_bytes(mix.rows) + (self.head_bytes if mix.samples else 0.0) + kv
        return self.overhead_s + self.per_seq_s * mix.seqs + max(flops / peak, nbytes / bw)

    def kv_bytes(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token

    # -- describing it -----------------------------------------------------------------------
    def describe(self) -> list[str]:
        """Readable lines: where the numbers come from and what each efficiency is. No figure
        that cannot be a measurement is printed as one: a fraction of a roofline above 100%
        says why it cannot be trusted, and a coefficient the fit drove to its bound says that
        these measurements did not resolve it."""
        lines = [f"cost model: {self.shape.name} ({self.dtype}) on {self.accel.name}; "
                 f"{self.source}"]
        if not self.knots:
            lines.append(f"  assumed: {self.mfu:.0%} of peak FLOP/s, {self.mbu:.0%} of "
                         f"bandwidth, {self.overhead_s * 1e3:.3g} ms per step")
            return lines
        fr = self.fit_report
        if fr and fr.get("unstable"):
            lines.append(f"  WARNING: this profile is not trusted: {fr['unstable']}; run "
                         "'phasewise calibrate' again on a quiet machine")
        at_bound = set(fr.get("at_bound", ())) if fr else set()
        over_s = self.overhead_s > 0 and "overhead" not in at_bound
        seq_s = self.per_seq_s > 0 and "per_seq" not in at_bound
        if over_s and seq_s:
            lines.append(f"  per step {self.overhead_s * 1e3:.3g} ms + "
                         f"{self.per_seq_s * 1e6:.3g} µs per sequence")
        else:
            if over_s:
                lines.append(f"  per step {self.overhead_s * 1e3:.3g} ms")
            else:
                lines.append("  per step (fixed cost): " + self._unresolved(
                    "what every step pays beyond its kernels", "the matmuls at few rows"))
            if seq_s:
                lines.append(f"  per sequence {self.per_seq_s * 1e6:.3g} µs")
            else:
                lines.append("  per sequence: " + self._unresolved(
                    "what each sequence adds", "the terms that grow with the batch (its rows' "
                    "matmuls, its K/V reads)"))
        # Only the knots at row counts some step had: a knot between them is a free
        # point of the curve, which only its neighbours' steps constrain.
        measured = set(fr.get("rows_measured", ())) if fr else set()
        shown = [k for k in self.knots if not measured or k.rows in measured]
        between = [k.rows for k in self.knots if k not in shown]
        over = [k for k in shown if k.inv_eff < 1]
        lines.append("  matmuls reach " + ", ".join(
            f"{1 / k.inv_eff:.0%} at {k.rows} rows" if k.inv_eff >= 1 else
            f">100%* at {k.rows} rows" for k in shown) + " of their roofline"
            + (f" (the curve's points at {', '.join(map(str, between))} rows lie between the "
               "measured steps' rows: not shown)" if between else ""))
        if over:
            lines.append("  * above the roofline: at these row counts the fit cannot tell the "
                         "matmuls' time from the other terms that grow with a step (its "
                         "fixed cost, attention, K/V reads); the steps' total is what was "
                         "measured, not this split (not trusted)")
        held = fr.get("held_at_roofline", {}) if fr else {}
        for term, name, u in (("attn_prefill", "prompt attention arithmetic",
                               self.attn_prefill_inv_eff),
                              ("kv_prefill", "prompt context K/V reads", self.kv_prefill_inv_eff),
                              ("kv_decode", "decode K/V reads", self.kv_decode_inv_eff)):
            if term in (fr.get("unmeasured", ()) if fr else ()) or (u <= 0 and not fr):
                text = "not measured: no step in the grid has any"
            elif u <= 0:
                text = self._unresolved("its time", "the terms that grow with it")
            elif term in held:
                wanted = (f"put it at {held[term]:.0%}" if held[term] is not None else
                          "gave it no time at all")
                text = (f"held at 100% of roofline, its bound: unbounded, the fit {wanted}, "
                        f"{self._too_fast(term)}; the bound costs the fit "
                        "no accuracy beyond the steps' spread, so it holds, but 100% is the "
                        "bound, not a measurement (not trusted)")
            elif term in at_bound and u == 1:
                text = ("held at 100% of roofline, its bound: the fit pressed it there, so "
                        "these measurements say only that it runs near its roofline (not "
                        "trusted as a figure)")
            elif u < 1:
                text = f"{1 / u:.0%} of roofline: {self._too_fast(term)}; not trusted"
                cost = (fr.get("above_roofline") or {}).get(term) if fr else None
                if cost:
                    text += (f" (held at 100%, the fit's rms error over the grid would "
                             f"rise from {fr.get('rms_rel_err', 0.0):.1%} to "
                             f"{cost['bounded_rms_rel_err']:.1%}, so the step times keep "
                             "it for predicting)")
            else:
                text = f"{1 / u:.0%} of roofline"
            lines.append(f"  {name}: {text}")
        if fr:
            lines.append(f"  fit over {fr['points']} measured steps: median error "
                         f"{fr['median_abs_rel_err']:.1%}, worst {fr['max_abs_rel_err']:.1%}")
        return lines

    def _too_fast(self, term: str) -> str:
        """Why a roofline fraction above 1 cannot be a measurement, naming the peak."""
        spread = (self.accel.measured or {}).get("spread") or {}
        if term == "attn_prefill":
            peak = f"{self.attn_peak / 1e9:.4g} GFLOP/s {self.attn_dtype}"
            runs = spread.get(self.attn_dtype)
            unit, scale = "GFLOP/s", 1e9
        else:
            peak = f"{self.bandwidth / 1e9:.4g} GB/s"
            runs = spread.get("mem_bandwidth")
            unit, scale = "GB/s", 1e9
        where = self.accel.source
        if runs and len(runs) == 2:
            where += f"; its runs spread {runs[0] / scale:.4g}-{runs[1] / scale:.4g} {unit}"
        return (f"faster than the peak it is rated at ({peak}, {where}), so that peak is too "
                "low or the term absorbs another")

    def _unresolved(self, what: str, beside: str) -> str:
        fr = self.fit_report
        if not fr:
            return f"not resolved (0: {what} was given as nothing)"
        n, k = fr["points"], fr.get("unknowns", 5 + len(self.knots))
        why = (f"too few steps ({n} for {k} unknowns)" if n <= k else
               f"over {n} steps at a median error of {fr['median_abs_rel_err']:.1%}, "
               f"{what} is too small to separate from noise and from {beside}")
        return f"not resolved by these measurements (the fit drove it to its bound, 0: {why})"

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "knots": [asdict(k) for k in self.knots],
                "overhead_s": self.overhead_s, "per_seq_s": self.per_seq_s,
                "attn_prefill_inv_eff": self.attn_prefill_inv_eff,
                "kv_prefill_inv_eff": self.kv_prefill_inv_eff,
                "kv_decode_inv_eff": self.kv_decode_inv_eff, "mfu": self.mfu, "mbu": self.mbu,
                "compute_dtype": self.compute_dtype, "source": self.source,
                "fit": self.fit_report}

    @classmethod
    def from_dict(cls, shape: ModelShape, accel: Accelerator, d: dict[str, Any]) -> CostModel:
        return cls(shape, accel, d["dtype"], [Knot(**k) for k in d.get("knots", [])],
                   d["overhead_s"], d["per_seq_s"], d["attn_prefill_inv_eff"],
                   d["kv_prefill_inv_eff"], d["kv_decode_inv_eff"], d.get("mfu", DEFAULT_MFU),
                   d.get("mbu", DEFAULT_MBU), d.get("compute_dtype"), d.get("source", ""),
                   d.get("fit", {}))


# -- fitting --------------------------------------------------------------------------------
def knot_rows(rows: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
    """Powers of two spanning the measured row counts (at least two knots), and the
    ``extra`` row counts within them: the batch sizes measured as pure decode steps, where
    the kernels change with every few rows (a curve through powers of two alone misses a
    batch of 3 by 15%)."""
    lo, hi = max(1, min(rows)), max(rows)
    out = [1 << i for i in range(int(math.log2(lo)), int(math.ceil(math.log2(hi))) + 1)]
    out = sorted(set(out) | {r for r in extra if lo <= r <= out[-1]})
    return out if len(out) > 1 else [out[0], out[0] * 2]


def nnls(a: Any, b: Any, iters: int = 200) -> Any:
    """Non-negative least squares (Lawson and Hanson's active set): x >= 0 minimising
    ||a x - b||. numpy only (scipy is not a dependency)."""
    import numpy as np

    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 1e-12 * max(1.0, float(np.abs(a).max())) * max(m, n)
    for _ in range(iters):
        if passive.all() or (w[~passive] <= tol).all():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
        w = a.T @ (b - a @ x)
    return x


def fit(shape: ModelShape, accel: Accelerator, dtype: str,
        steps: Sequence[tuple[StepMix, float]],
        compute_dtype: Callable[[int], str] = lambda rows: "fp32",
        source: str = "fitted") -> CostModel:
    """The ``CostModel`` whose step times best match ``steps`` (mix, measured seconds), in
    relative error. ``compute_dtype(rows)``: the arithmetic the engine runs at that many rows
    (each knot is rated against that dtype's peak)."""
    import numpy as np

    if len(steps) < 4:
        raise ValueError(f"fitting needs at least 4 measured steps, got {len(steps)}")
    rows = [m.rows for m, _ in steps] + [m.samples for m, _ in steps if m.samples]
    decode_rows = {m.rows for m, _ in steps if m.kind == "decode"}
    knots = [Knot(r, norm_dtype(compute_dtype(r)), 1.0) for r in knot_rows(rows, decode_rows)]
    model = CostModel(shape, accel, dtype, knots, source=source)
    a = np.array([model.features(m) for m, _ in steps])
    t = np.array([s for _, s in steps], dtype=float)
    if (t <= 0).any():
        raise ValueError("measured step times must be > 0")
    # Relative error: each row scaled by its own measured time.
    ar = a / t[:, None]
    used = (a > 0).any(axis=0)
    # The roofline terms (prompt attention arithmetic, K/V reads) cannot run faster than
    # their roofline: their inverse efficiency is bounded below by 1 (a term no step has
    # stays at 0, unmeasured). Unbounded, the fit can trade one of these columns against the
    # others it is nearly collinear with over the grid (attention grows with chunk x context,
    # like the context K/V reads and the chunk's matmuls) and land above 100%.
    lower = np.zeros(a.shape[1])
    for j in BOUNDED:
        lower[j] = 1.0 if used[j] else 0.0
    x_free = nnls(ar, np.ones_like(t))
    x, held, above = x_free, {}, {}
    wants = [j for j in BOUNDED if used[j] and x_free[j] < 1.0]
    if wants:
        x_bound = lower + nnls(ar, np.ones_like(t) - ar @ lower)
        free_err, bound_err = np.abs(ar @ x_free - 1), np.abs(ar @ x_bound - 1)
        # Held at the bound when that costs no accuracy beyond the steps' own spread: then
        # the figure above 100% was the fit compensating. Else the steps really ran faster
        # than the rated peak allows (a peak measured too low): the free fit keeps the
        # predictions right, and its figure is printed as not trusted.
        free_rms, bound_rms = _rms(free_err), _rms(bound_err)
        if bound_rms <= 1.1 * free_rms + 0.005:
            x = x_bound
            held = {TERMS[j]: 1.0 / float(x_free[j]) if x_free[j] > 0 else None
                    for j in wants}
        else:
            above = {TERMS[j]: {"efficiency": 1.0 / max(float(x_free[j]), 1e-12),
                                "bounded_rms_rel_err": bound_rms} for j in wants}
    at_bound = [TERMS[j] for j in range(len(TERMS)) if used[j] and x[j] <= lower[j]]
    model.overhead_s, model.per_seq_s = float(x[0]), float(x[1])
    model.attn_prefill_inv_eff, model.kv_prefill_inv_eff, model.kv_decode_inv_eff = \
        (float(v) for v in x[2:5])
    # A knot no measured step leaned on (or fitted at 0: nothing is free) takes the value of
    # the nearest knot that was fitted.
    used_knot = used[5:]
    inv = [float(v) for v in x[5:]]
    good = [j for j in range(len(knots)) if used_knot[j] and inv[j] > 0]
    for i, k in enumerate(knots):
        u = inv[i] if i in good else (inv[min(good, key=lambda j: abs(j - i))] if good else 1.0)
        model.knots[i] = Knot(k.rows, k.compute_dtype, u)
    pred = np.array([model.step_time(m.chunks, m.decodes) for m, _ in steps])
    err = np.abs(pred - t) / t
    model.fit_report = {"points": len(steps), "unknowns": int(a.shape[1]),
                        "median_abs_rel_err": float(np.median(err)),
                        "max_abs_rel_err": float(err.max()), "rms_rel_err": _rms(err),
                        "at_bound": at_bound,
                        "unmeasured": [TERMS[j] for j in range(len(TERMS)) if not used[j]],
                        "rows_measured": sorted(set(rows))}
    if held:
        model.fit_report["held_at_roofline"] = held
    if above:
        model.fit_report["above_roofline"] = above
    return model


def _rms(v: Any) -> float:
    return float((v ** 2).mean() ** 0.5)
