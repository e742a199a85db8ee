"""How each linear layer is computed, chosen by measuring this machine.

For bf16 weights on a CPU, five ways compute the same function:

* ``torch``: ``F.linear`` in bf16 (fast where the CPU has native bf16 dot products);
* ``amx``: phasewise's AMX kernel (``cpu_amx.c``), on CPUs with AMX-BF16: bf16 tile
  products into fp32, the weights read in place at any row count (torch's oneDNN path
  reorders them on every call, which dominates a decode step's few rows);
* ``kernel``: phasewise's AVX2 kernel (``cpu_kernels.c``): for the few rows of a decode step it
  streams each weight once at close to memory speed; for more rows it runs register tiles
  that widen bf16 weights in registers, read in place (near torch's fp32 GEMM speed on an
  AVX2 CPU, at any row count);
* ``upcast``: widen the weight to fp32 in a reused scratch buffer, then torch's fp32 GEMM;
* ``gemm``: phasewise's packed GEMM (``cpu_kernels.c``), widening bf16 to fp32 while packing.
  The last two are for many rows (prefill) on CPUs whose bf16 GEMM is slow.

``LinearDispatch.calibrate`` times them on the model's own weights (every layer's gate/up
projection, so that a few rows stream from memory as in a decode step) at engine start (one
to three seconds on the reference checkpoint) and keeps a plan: the kernel up to a row
count (or at every count, when it wins at the largest one timed), the fastest of the others
above it. Every method accumulates in fp32, so they differ only in rounding order. Where
``amx`` is a candidate its products are bf16 x bf16 (exact in fp32), like torch's bf16 path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phasewise.model import cpu_kernels

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
LARGE_METHODS = ("torch", "upcast", "gemm", "amx")
ALL_ROWS = 2**31 - 1  # kernel_max_rows meaning "the kernel at every row count"
SMALL_ROWS = 64  # calibration: below this many rows a timing streams every weight given


def torch_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


class Upcast:
    """bf16 weight -> fp32 scratch (reused, so no page faults per call) -> fp32 GEMM."""

    def __init__(self) -> None:
        self._scratch = torch.empty(0, dtype=torch.float32)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        n = w.numel()
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float32)
        w32 = self._scratch[:n].view(w.shape).copy_(w)
        y = F.linear(x.float(), w32, b.float() if b is not None else None)
        return y.to(x.dtype)


def _large_fn(method: str) -> LinearFn:
    if method == "upcast":
        return Upcast()
    if method == "gemm":
        return cpu_kernels.gemm_bf16
    if method == "amx":
        return cpu_kernels.linear_amx
    return torch_linear


@dataclass
class LinearDispatch:
    """Callable ``(x, w, b) -> y`` that picks a method by the number of activation rows."""

    kernel_max_rows: int  # use the kernel for row counts up to this (0: never)
    large: str  # one of LARGE_METHODS, for more rows
    timings: dict[str, dict[int, float]] | None = None  # calibration seconds, for reports

    def __post_init__(self) -> None:
        if self.large not in LARGE_METHODS:
            raise ValueError(f"large must be one of {', '.join(LARGE_METHODS)}; "
                             f"got {self.large!r}")
        self._large = _large_fn(self.large)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                 ) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.kernel_max_rows:
            return cpu_kernels.linear_bf16(x, w, b)
        return self._large(x, w, b)

    def method(self, rows: int) -> str:
        """The method ``rows`` activation rows run: ``kernel`` or one of LARGE_METHODS."""
        return "kernel" if rows <= self.kernel_max_rows else self.large

    def compute_dtype(self, rows: int) -> str:
        """Whose arithmetic ``rows`` activation rows run in: ``bf16`` for torch's own bf16
        ``F.linear`` and the AMX tiles (bf16 products), ``fp32`` for the kernel, the upcast
        and the packed GEMM."""
        return "bf16" if self.method(rows) in ("torch", "amx") else "fp32"

    def describe(self) -> str:
        if self.kernel_max_rows >= ALL_ROWS:
            return "kernel for all row counts"
        if self.kernel_max_rows:
            return (f"kernel for <= {self.kernel_max_rows} rows, {self.large} above")
        return f"{self.large} for all row counts"

    @classmethod
    def calibrate(cls, weight: torch.Tensor | list[torch.Tensor], large_rows: int = 256,
                  kernel_rows: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
                  ) -> LinearDispatch:
        """Time the methods on ``weight`` ([N, K] bf16, CPU; or a list of such weights of
        one shape, e.g. every layer's) and build a plan: the kernel while it is at least as
        fast as the best other method at each of ``kernel_rows`` (ascending); if it never
        loses, at every row count.

        Below ``SMALL_ROWS`` rows a layer streams its weights from memory, so each timing
        passes over every weight given: with several layers' weights that is the memory
        stream of a decode step, not one weight sitting in the cache (which ranked the
        methods wrongly on a 2-core AMX Xeon). Larger row counts, compute-bound, time the
        first two."""
        weights = [weight] if isinstance(weight, torch.Tensor) else list(weight)
        k = weights[0].shape[1]
        gen = torch.Generator().manual_seed(0)

        def seconds(fn: LinearFn, rows: int) -> float:
            ws = weights if rows < SMALL_ROWS else weights[:2]
            x = torch.randn(rows, k, generator=gen).to(ws[0].dtype)
            fn(x, ws[0], None)  # warm-up
            best = float("inf")
            for _ in range(2):
                t = time.perf_counter()
                for w in ws:
                    fn(x, w, None)
                best = min(best, time.perf_counter() - t)
            return best

        have_kernels = cpu_kernels.load() is not None
        have_amx = cpu_kernels.amx_available() and weights[0].shape[0] >= 16
        candidates = [m for m in LARGE_METHODS
                      if (m != "gemm" or have_kernels) and (m != "amx" or have_amx)]
        timings: dict[str, dict[int, float]] = {m: {} for m in (*candidates, "kernel")}
        for m in candidates:
            timings[m][large_rows] = seconds(_large_fn(m), large_rows)
        large = min(candidates, key=lambda m: timings[m][large_rows])
        large_fn = _large_fn(large)
        kernel_max = 0
        if have_kernels:
            if seconds(cpu_kernels.linear_bf16, 1) <= seconds(large_fn, 1):
                kernel_max = 1
                for rows in kernel_rows:
                    timings["kernel"][rows] = seconds(cpu_kernels.linear_bf16, rows)
                    if rows not in timings[large]:
                        timings[large][rows] = seconds(large_fn, rows)
                    if timings["kernel"][rows] > timings[large][rows]:
                        break
                    kernel_max = rows
                else:
                    kernel_max = ALL_ROWS
        return cls(kernel_max_rows=kernel_max, large=large, timings=timings)
