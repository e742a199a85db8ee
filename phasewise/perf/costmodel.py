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
(``phasewise calibrate``). A ``CostModel`` with no fit (a catalog accelerator) uses one
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
        self.body_bytes = s.num_layers * (s.attn_params_per_layer + s.mlp_params_per_layer) \
            * self.wbytes
        self.head_flops_per_row = 2.0 * s.lm_head_params
        self.head_bytes = s.lm_head_params * self.wbytes
        self.attn_flops_per_pos = 4.0 * s.num_layers * s.num_heads * s.head_dim
        self.kv_bytes_per_token = s.kv_bytes_per_token(self.wbytes)
        self.bandwidth = self.accel.mem_bandwidth
        self.knots.sort(key=lambda k: k.rows)
        self._log_rows = [math.log2(k.rows) for k in self.knots]
        self._peak = {k.compute_dtype: self.accel.peak_flops_for(k.compute_dtype)
                      for k in self.knots}
        cdt = norm_dtype(self.compute_dtype or self.dtype)
        self.default_peak = self.accel.peak_flops_for(cdt)
        # Attention arithmetic is rated against the peak the largest row counts run at.
        self.attn_peak = self._peak[self.knots[-1].compute_dtype] if self.knots \
            else self.default_peak

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

    def _linear_roof(self, rows: int, flops_per_row: float, nbytes: float, peak: float) -> float:
        return max(rows * flops_per_row / peak, nbytes / self.bandwidth)

    def features(self, mix: StepMix) -> list[float]:
        """The step's design row: ``TERMS`` first, then one column per knot (the matmuls'
        roofline time carried by that knot). Linear in the unknowns ``fit`` solves for."""
        rows, samples = mix.rows, mix.samples
        positions = chunk_positions(mix.chunks)
        row = [1.0, float(mix.seqs),
               positions * self.attn_flops_per_pos / self.attn_peak,
               sum(c.context for c in mix.chunks) * self.kv_bytes_per_token / self.bandwidth,
               sum(max(d - 1, 0) for d in mix.decodes) * self.kv_bytes_per_token
               / self.bandwidth]
        cols = [0.0] * len(self.knots)
        for n, fpr, nb in ((rows, self.body_flops_per_row, self.body_bytes),
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
        positions = chunk_positions(mix.chunks) + sum(mix.decodes)
        flops = (mix.rows * self.body_flops_per_row + mix.samples * self.head_flops_per_row
                 + positions * self.attn_flops_per_pos)
        kv = (sum(c.context + c.tokens for c in mix.chunks)
              + sum(mix.decodes)) * self.kv_bytes_per_token
        nbytes = self.body_bytes + (self.head_bytes if mix.samples else 0.0) + kv
        return self.overhead_s + self.per_seq_s * mix.seqs + max(flops / peak, nbytes / bw)

    def kv_bytes(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token

    # -- describing it -----------------------------------------------------------------------
    def describe(self) -> list[str]:
        """Readable lines: where the numbers come from and what each efficiency is."""
        lines = [f"cost model: {self.shape.name} ({self.dtype}) on {self.accel.name}; "
                 f"{self.source}"]
        if not self.knots:
            lines.append(f"  assumed: {self.mfu:.0%} of peak FLOP/s, {self.mbu:.0%} of "
                         f"bandwidth, {self.overhead_s * 1e3:.3g} ms per step")
            return lines
        lines.append(f"  per step {self.overhead_s * 1e3:.3g} ms + {self.per_seq_s * 1e6:.3g} "
                     "µs per sequence")
        over = [k for k in self.knots if k.inv_eff < 1]
        lines.append("  matmuls reach " + ", ".join(
            f"{1 / k.inv_eff:.0%} at {k.rows} rows" if k.inv_eff >= 1 else
            f">100%* at {k.rows} rows" for k in self.knots) + " of their roofline")
        if over:
            lines.append("  * above the roofline: at these row counts the fit carries the "
                         "matmuls' time in the fixed per-step cost (the two are nearly "
                         "collinear there); their sum is what the steps measured")
        for name, u in (("prompt attention arithmetic", self.attn_prefill_inv_eff),
                        ("prompt context K/V reads", self.kv_prefill_inv_eff),
                        ("decode K/V reads", self.kv_decode_inv_eff)):
            lines.append(f"  {name}: " + (f"{1 / u:.0%} of roofline" if u > 0 else
                                           "not measurable in the grid (0)"))
        fr = self.fit_report
        if fr:
            lines.append(f"  fit over {fr['points']} measured steps: median error "
                         f"{fr['median_abs_rel_err']:.1%}, worst {fr['max_abs_rel_err']:.1%}")
        return lines

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
    x = nnls(a / t[:, None], np.ones_like(t))
    model.overhead_s, model.per_seq_s = float(x[0]), float(x[1])
    model.attn_prefill_inv_eff, model.kv_prefill_inv_eff, model.kv_decode_inv_eff = \
        (float(v) for v in x[2:5])
    # A knot no measured step leaned on (or fitted at 0: nothing is free) takes the value of
    # the nearest knot that was fitted.
    used = (a[:, 5:] > 0).any(axis=0)
    inv = [float(v) for v in x[5:]]
    good = [j for j in range(len(knots)) if used[j] and inv[j] > 0]
    for i, k in enumerate(knots):
        u = inv[i] if i in good else (inv[min(good, key=lambda j: abs(j - i))] if good else 1.0)
        model.knots[i] = Knot(k.rows, k.compute_dtype, u)
    pred = np.array([model.step_time(m.chunks, m.decodes) for m, _ in steps])
    err = np.abs(pred - t) / t
    model.fit_report = {"points": len(steps), "median_abs_rel_err": float(np.median(err)),
                        "max_abs_rel_err": float(err.max())}
    return model
