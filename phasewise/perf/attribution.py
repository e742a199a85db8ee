"""What each engine step should have cost: its roofline FLOPs, bytes and time.

``StepCostModel`` holds one model's shape (from its ``config.json``), the dtype its weights and
KV cache are stored in, the arithmetic a step of ``rows`` tokens runs in, and this machine's
measured peaks. ``predict`` prices one step's exact mix, a fused pass over prompt chunks and
decode tokens (``Roofline.mixed``), in pure Python arithmetic: the engine calls it every step.

Peaks come from the file ``phasewise measure`` writes (``cpu-local`` or ``gpu-local``). When
none are stored, nothing is measured (that would slow every engine start): FLOPs and bytes are
still predicted, the time is None. This module imports no torch.

It is the engine's ``StepCoster`` (``phasewise.engine.step_cost``): whoever builds an engine
passes ``StepCostModel.for_engine`` as its ``cost_model``, since the engine room sits below this
one and imports none of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from phasewise.engine.step_cost import Chunk, StepPrediction
from phasewise.perf.hardware import Accelerator, load_local
from phasewise.perf.models import ModelShape, fit_routed_experts
from phasewise.perf.roofline import DTYPE_BYTES, Roofline, norm_dtype

# Stands in for the machine when no peaks are stored: FLOPs and bytes do not depend on it,
# and the times it would give are never reported.
_UNIT_PEAKS = Accelerator("unit", "no measured peaks", {d: 1.0 for d in DTYPE_BYTES}, 0.0, 1.0,
                          None, "placeholder")


def engine_weight_dtype(engine: Any) -> str:
    """For an ``LLMEngine``: how the weights a step streams are stored (``int8`` under
    ``--quantization int8``, else the model's dtype)."""
    if getattr(getattr(engine, "config", None), "quantization", None) == "int8":
        return "int8"
    return norm_dtype(str(engine.dtype).removeprefix("torch."))


def engine_compute_dtype(engine: Any) -> Callable[[int], str]:
    """For an ``LLMEngine``: the dtype whose peak a step of ``rows`` tokens runs at. On CPU
    the calibrated bf16 plan decides per row count (kernel or upcast: fp32; torch: bf16;
    every count bf16 where the projections are packed into panels),
    int8 weights are widened to fp32 by the paths that run them, except more rows than the
    int8 streams take on a CPU with AMX, which widens them to bf16 for the tiles; fp16 (an
    emulation there, with no measured peak) is rated against fp32; elsewhere the weights'
    dtype."""
    dtype = norm_dtype(str(engine.dtype).removeprefix("torch."))
    if engine.device.type == "cpu":
        if engine_weight_dtype(engine) == "int8":
            from phasewise.model.cpu import kernels as cpu_kernels

            if getattr(engine, "linear_plan", None) is not None and cpu_kernels.amx_available():
                return lambda rows: "bf16" if rows > cpu_kernels.INT8_ROWS_MAX else "fp32"
            return lambda rows: "fp32"
        plan = getattr(engine, "linear_plan", None)
        if plan is not None and getattr(engine, "panels_reason", None) == "":
            return lambda rows: "bf16"  # the projections' panels: dot products at any rows
        if plan is not None:
            return plan.compute_dtype
        if dtype == "fp16":
            dtype = "fp32"
    return lambda rows: dtype


def _threads_flag() -> str:
    """`` --threads N`` where this process runs another thread count than the cores (the
    peaks it reads are that count's), else ""."""
    import torch

    from phasewise.config import usable_cores

    n = torch.get_num_threads()
    return f" --threads {n}" if n != usable_cores() else ""


def stored_peaks(device_type: str, path: Path | None = None) -> Accelerator | None:
    """This machine's stored figures for ``device_type`` (``cpu`` or ``cuda``; on the CPU
    those measured at this process's thread count), or None when ``phasewise measure`` has
    stored none (or they are unreadable). Never measures."""
    key = "gpu-local" if device_type == "cuda" else "cpu-local"
    threads = None
    if device_type != "cuda":  # the figures measured at the threads this process runs
        import torch

        threads = torch.get_num_threads()
    try:
        accel = load_local(key, path, threads)
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return None
    if not accel.mem_bandwidth > 0:
        return None
    return accel


# A mixture of experts' measured routing: the steps the skew is fitted to, and how many new
# ones between fits (a fit costs ~10k evaluations of a power: milliseconds, off most steps)
ROUTING_STEPS = 256
ROUTING_REFIT = 32


class StepCostModel:
    """Roofline cost of engine steps for one model, dtype and machine; for a mixture of
    experts, at the routing skew its last steps measured (``observe_routing``)."""

    def __init__(self, shape: ModelShape, dtype: str, accel: Accelerator | None,
                 compute_dtype: Callable[[int], str] | None = None,
                 kv_dtype: str | None = None, moe_dtype: str | None = None) -> None:
        self.shape = shape
        self.dtype = norm_dtype(dtype)
        self.kv_dtype = kv_dtype
        self.moe_dtype = moe_dtype  # an MoE's experts, where not ``dtype`` (Roofline)
        self.accel = accel
        self.compute_dtype = compute_dtype or (lambda rows: self.dtype)
        self._roofs: dict[str, tuple[Roofline, bool]] = {}  # compute dtype -> (roof, timed)
        self._routing: deque[tuple[float, float]] = deque(maxlen=ROUTING_STEPS)
        self._unfitted = 0

    def observe_routing(self, tokens: int, experts: float) -> None:
        """A step's measured routing: its ``tokens`` and the distinct experts its sparse
        layers read on average (``StepStats.experts_read``). Every ``ROUTING_REFIT`` steps
        of two tokens or more, the skew is fitted to the last ``ROUTING_STEPS`` of them
        (``fit_routed_experts``), and later steps are priced at it."""
        s = self.shape
        if not s.is_moe or tokens < 2:
            return
        self._routing.append((float(tokens), float(experts)))
        self._unfitted += 1
        if self._unfitted < ROUTING_REFIT:
            return
        self._unfitted = 0
        fitted = fit_routed_experts(self._routing, s.num_experts, s.experts_per_token)
        old = s.routed_experts or s.num_experts
        if fitted is not None and abs(fitted - old) > 0.01 * old:
            self.shape = replace(s, routed_experts=fitted)
            self._roofs.clear()

    @classmethod
    def for_engine(cls, engine: Any, machine_file: Path | None = None) -> StepCostModel:
        """The model of an ``LLMEngine``: its checkpoint's shape, weight dtype, device and
        per-step arithmetic, at the peaks stored for its device (``machine_file``: default
        ``phasewise measure``'s file). An MoE's experts stay at the model's dtype under
        ``--quantization int8`` (``phasewise.model.cpu.quant``), and are priced so."""
        model_dtype = norm_dtype(str(engine.dtype).removeprefix("torch."))
        return cls(ModelShape.from_path(engine.config.model), engine_weight_dtype(engine),
                   stored_peaks(engine.device.type, machine_file),
                   engine_compute_dtype(engine), kv_dtype=model_dtype, moe_dtype=model_dtype)

    def roofline(self, compute_dtype: str) -> tuple[Roofline, bool]:
        """The roofline at ``compute_dtype``, and whether its times mean anything (the
        machine has a peak for that dtype)."""
        hit = self._roofs.get(compute_dtype)
        if hit is None:
            roof, timed = None, False
            if self.accel is not None:
                try:
                    roof = Roofline(self.shape, self.accel, self.dtype, self.kv_dtype,
                                    compute_dtype=compute_dtype, moe_dtype=self.moe_dtype)
                    timed = roof.peak_flops > 0
                except ValueError:  # no peak stored for that dtype
                    roof = None
            if roof is None or not timed:
                roof = Roofline(self.shape, _UNIT_PEAKS, self.dtype, self.kv_dtype,
                                compute_dtype=compute_dtype, moe_dtype=self.moe_dtype)
            hit = self._roofs[compute_dtype] = (roof, timed)
        return hit

    def predict(self, chunks: Sequence[Chunk], decodes: Sequence[int]) -> StepPrediction:
        """One step: prompt ``chunks`` and ``decodes`` (each decoding sequence's length with
        its new token), all in one fused pass."""
        rows = sum(c.tokens for c in chunks) + len(decodes)
        cdt = self.compute_dtype(rows)
        roof, timed = self.roofline(cdt)
        c = roof.mixed(chunks, decodes)
        return StepPrediction(c.flops, c.bytes, c.time if timed else None, cdt)

    def note(self, max_rows: int) -> str:
        """What /metrics' per-step predictions rest on, for the start-up log; ``max_rows``:
        the most tokens a step holds (the engine's step budget)."""
        accel = self.accel
        if accel is None:
            return ("per-step roofline: no figures are stored for this machine at this "
                    "thread count, so /metrics has each step's FLOPs and bytes but no "
                    f"predicted time; run 'phasewise measure{_threads_flag()}' and restart")
        used = sorted({self.compute_dtype(1), self.compute_dtype(max_rows)})
        missing = [d for d in used if d not in accel.peak_flops]
        peaks = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in accel.peak_flops.items())
        line = (f"per-step roofline: steps run in {'/'.join(used)}; this machine's stored "
                f"figures ({accel.name}): read {accel.mem_bandwidth / 1e9:.1f} GB/s, {peaks}")
        if missing:
            return (line + f"; no {'/'.join(missing)} peak is stored, so steps in it get no "
                    f"predicted time on /metrics: run 'phasewise measure{_threads_flag()}' "
                    "and restart")
        unstable = (accel.measured or {}).get("unstable") or {}
        shaky = [n for n in (*used, "mem_bandwidth") if n in unstable]
        if shaky:
            names = ", ".join(n.replace("mem_bandwidth", "read bandwidth") for n in shaky)
            line += (f"; UNSTABLE: {names} ({unstable[shaky[0]]}), so the predicted times "
                     "may be off by as much: run 'phasewise measure' on a quiet machine and "
                     "restart")
        return line + "; /metrics holds each step's predicted time beside its measured one"
