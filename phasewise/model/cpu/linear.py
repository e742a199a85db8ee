"""How each linear layer is computed: the methods, the dispatch by row count, and the timing
that ``phasewise tune`` runs to choose between them (never an engine's start: an engine runs
the plan ``phasewise.model.cpu.plan`` resolves, stored, pinned or ruled).

For bf16 weights on a CPU, six ways compute the same function:

* ``torch``: ``F.linear`` in bf16 (fast where the CPU has native bf16 dot products);
* ``amx``: phasewise's AMX kernel (``linear_amx.c``), on CPUs with AMX-BF16: bf16 tile
  products into fp32, the weights read in place at any row count (torch's oneDNN path
  reorders them on every call, which dominates a decode step's few rows);
* ``avx512bf16``: phasewise's AVX512_BF16 kernel (``linear_avx512bf16.c``), on CPUs with AVX512_BF16
  (AMD Zen 4 and 5, without AMX): VDPBF16PS register tiles, 4 weight rows read in place x up
  to 6 tokens, into fp32; it takes the rows between the streams and torch's GEMM (the
  plan's ``mid`` tier), and the fused decode layer's projections for those rows;
* ``kernel``: phasewise's AVX2 kernel (``linear_avx2.c``): for the few rows of a decode step it
  streams each weight once at close to memory speed; for more rows it runs register tiles
  that widen bf16 weights in registers, read in place (near torch's fp32 GEMM speed on an
  AVX2 CPU, at any row count);
* ``upcast``: widen the weight to fp32 in a reused scratch buffer, then torch's fp32 GEMM;
* ``gemm``: phasewise's packed GEMM (``linear_avx2.c``), widening bf16 to fp32 while packing.
  The last two are for many rows (prefill) on CPUs whose bf16 GEMM is slow.

``LinearDispatch.calibrate`` times them on the model's own weights (every layer's gate/up
projection, so that a few rows stream from memory as in a decode step) and keeps a plan: the
kernel up to a row count (or at every count, when it wins at the largest one timed), the
fastest of the others above it; where the AVX512_BF16 kernel is at hand and is not that
fastest, it takes the row counts where it beats both (a ``mid`` tier between them). Every
method accumulates in fp32, so they differ only in rounding order (which is why a plan must
not change between two starts: the same plan, the same bits). Where ``amx`` or
``avx512bf16`` is a candidate its products are bf16 x bf16 (exact in fp32), like torch's
bf16 path.
Each other projection shape (qkv, o, down) may get its own method for prompt chunks
(``prompt_by_shape``, ``calibrate_prompt_shape``), of the same arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from phasewise.model.cpu import kernels
from phasewise.model.cpu.plan import ALL_ROWS, LARGE_METHODS, PROMPT_ROWS

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
SMALL_ROWS = 64  # calibration: below this many rows a timing streams every weight given
MID_ROWS = (1, 2, 3, 4, 5, 6, 8, 16, 32, 64, 128)  # calibration: the mid tier's timed counts
# Against the streams (the fused decode layer's few rows), the mid tier must win by this much:
# one call each understates the fused layer's difference (the streams share its one parallel
# region; figures: benchmarks/RESULTS.md)
AVX512BF16_STREAM_MARGIN = 1.05
AMX_MARGIN = 1.05  # calibration: how much faster than AMX the kernel must be to keep a row count


TORCH_ROW_BUCKET = 32  # torch's GEMM sees prompt-sized row counts in multiples of this
TORCH_SMALL_BUCKET = 16  # and counts from TORCH_EXACT_ROWS + 1 to PROMPT_ROWS in these
TORCH_EXACT_ROWS = 32  # up to this many rows, torch's GEMM sees the rows as they are


def torch_bucket(rows: int) -> int:
    """The row count torch's GEMM sees for ``rows`` rows on a CPU: rows itself up to
    TORCH_EXACT_ROWS, else rounded up to a multiple of TORCH_SMALL_BUCKET below PROMPT_ROWS
    and of TORCH_ROW_BUCKET from there."""
    if rows <= TORCH_EXACT_ROWS:
        return rows
    bucket = TORCH_ROW_BUCKET if rows >= PROMPT_ROWS else TORCH_SMALL_BUCKET
    return -(-rows // bucket) * bucket


def torch_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """torch's ``F.linear``; on CPUs, inputs of more than TORCH_EXACT_ROWS rows padded with
    zero rows to the count ``torch_bucket`` gives. On CPUs torch's bf16 GEMM is oneDNN's,
    which builds and keeps one primitive per row count (up to 1024 of them, ~1-2 MB each for
    the reference checkpoint's shapes), and a server's steps come in every count up to the
    step budget: without buckets a server's resident memory grows with every new count, and
    prompt-sized counts (and, where the AVX512_BF16 kernel takes decode batches, the counts
    between it and the prompts') are many."""
    k = x.shape[-1]
    rows = x.numel() // k
    want = torch_bucket(rows)
    if want == rows or x.device.type != "cpu":
        return F.linear(x, w, b)
    padded = x.new_empty(want, k)
    padded[:rows].copy_(x.reshape(rows, k))
    padded[rows:].zero_()
    return F.linear(padded, w, b)[:rows].reshape(*x.shape[:-1], w.shape[0])


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
        return kernels.gemm_bf16
    if method == "amx":
        return kernels.linear_amx
    if method == "avx512bf16":
        return kernels.linear_avx512bf16
    return torch_linear


def _arithmetic(method: str) -> str:
    """Whose arithmetic a method runs in: bf16 products for torch's bf16 path, the AMX
    tiles and the AVX512_BF16 dot products; fp32 for the kernel, the upcast and the packed
    GEMM."""
    return "bf16" if method in ("torch", "amx", "avx512bf16") else "fp32"


def _avx512bf16_wins(t: dict[str, float], others: list[str]) -> bool:
    """Whether the dot-product kernel's time in ``t`` beats each of ``others``' (the streams'
    by AVX512BF16_STREAM_MARGIN)."""
    return all(t["avx512bf16"] * (AVX512BF16_STREAM_MARGIN if m == "kernel" else 1.0) < t[m]
               for m in others)


def _available_methods(weight: torch.Tensor) -> list[str]:
    """LARGE_METHODS that can run here on ``weight`` ([N, K] bf16, CPU)."""
    have_kernels = kernels.load() is not None
    have_amx = kernels.amx_available() and weight.shape[0] >= 16
    have_avx512bf16 = kernels.avx512bf16_available()
    return [m for m in LARGE_METHODS
            if (m != "gemm" or have_kernels) and (m != "amx" or have_amx)
            and (m != "avx512bf16" or have_avx512bf16)]


def _seconds(fn: LinearFn, x: torch.Tensor | dict[int, torch.Tensor],
             weights: list[torch.Tensor]) -> float:
    """Best of two passes of ``fn`` over every weight, after a warm-up call; ``x``: the
    input, or one per input width K (weights of several shapes)."""
    def x_for(w: torch.Tensor) -> torch.Tensor:
        return x[w.shape[1]] if isinstance(x, dict) else x

    fn(x_for(weights[0]), weights[0], None)
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        for w in weights:
            fn(x_for(w), w, None)
        best = min(best, time.perf_counter() - t)
    return best


@dataclass
class LinearDispatch:
    """Callable ``(x, w, b) -> y`` that picks a method by the number of activation rows."""

    kernel_max_rows: int  # use the kernel for row counts up to this (0: never)
    large: str  # one of LARGE_METHODS, for more rows
    timings: dict[str, dict[int, float]] | None = None  # calibration seconds, for reports
    # A weight shape (N, K) at PROMPT_ROWS rows or more (prompt chunks) -> the method that
    # times fastest for that projection there, where it is not ``large``; always one of the
    # same arithmetic as ``large`` (so compute_dtype holds for every shape).
    prompt_by_shape: dict[tuple[int, int], str] = field(default_factory=dict)
    # The AVX512_BF16 kernel's tier: rows from mid_min_rows (0: kernel_max_rows + 1) up to
    # ``mid`` ("avx512bf16"), where calibration found it faster than both neighbours.
    mid: str | None = None
    mid_max_rows: int = 0
    mid_min_rows: int = 0

    def __post_init__(self) -> None:
        if self.mid is not None and (self.mid != "avx512bf16"
                                     or _arithmetic(self.large) != "bf16"):
            raise ValueError(f"mid must be 'avx512bf16', beside a large method of bf16 "
                             f"arithmetic; got {self.mid!r} beside {self.large!r}")
        for m in (self.large, *self.prompt_by_shape.values()):
            if m not in LARGE_METHODS:
                raise ValueError(f"large must be one of {', '.join(LARGE_METHODS)}; "
                                 f"got {m!r}")
            if _arithmetic(m) != _arithmetic(self.large):
                raise ValueError(f"a prompt shape's method must compute as {self.large} "
                                 f"does ({_arithmetic(self.large)}); got {m!r}")
        self._large = _large_fn(self.large)
        self._mid = _large_fn(self.mid) if self.mid else None
        self._mid_lo = max(self.mid_min_rows, self.kernel_max_rows + 1)
        self._prompt = {nk: _large_fn(m) for nk, m in self.prompt_by_shape.items()}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                 ) -> torch.Tensor:
        k = x.shape[-1]
        rows = x.numel() // k
        if rows <= self.kernel_max_rows:
            return kernels.linear_bf16(x, w, b)
        if self._mid is not None and self._mid_lo <= rows <= self.mid_max_rows:
            return self._mid(x, w, b)
        if rows >= PROMPT_ROWS and self._prompt:
            fn = self._prompt.get(tuple(w.shape))
            if fn is not None:
                return fn(x, w, b)
        return self._large(x, w, b)

    def method_for(self, rows: int, shape: tuple[int, int]) -> str:
        """The method ``rows`` rows of a weight of ``shape`` (N, K) run, as ``__call__``
        picks it."""
        method = self.method(rows)
        if method == self.large and rows >= PROMPT_ROWS:
            return self.prompt_by_shape.get(shape, self.large)
        return method

    def method(self, rows: int) -> str:
        """The method ``rows`` activation rows run: ``kernel`` or one of LARGE_METHODS."""
        if rows <= self.kernel_max_rows:
            return "kernel"
        if self.mid is not None and self._mid_lo <= rows <= self.mid_max_rows:
            return self.mid
        return self.large

    def compute_dtype(self, rows: int) -> str:
        """Whose arithmetic ``rows`` activation rows run in: ``bf16`` for torch's own bf16
        ``F.linear``, the AMX tiles and the AVX512_BF16 kernel (bf16 products), ``fp32`` for
        the kernel, the upcast and the packed GEMM."""
        return _arithmetic(self.method(rows))

    def describe(self) -> str:
        if self.kernel_max_rows >= ALL_ROWS:
            return "kernel for all row counts"
        mid = ""
        if self.mid is not None and self.mid_max_rows >= self._mid_lo:
            lo = self._mid_lo
            span = f"{lo}-{self.mid_max_rows}" if self.mid_max_rows > lo else f"{lo}"
            mid = f"{self.mid} for {span} rows, "
        gap = (f"{self.large} for {self.kernel_max_rows + 1}-{self._mid_lo - 1} rows, "
               if mid and self._mid_lo > self.kernel_max_rows + 1 else "")
        if self.kernel_max_rows:
            text = f"kernel for <= {self.kernel_max_rows} rows, {gap}{mid}{self.large} above"
        elif mid:
            text = f"{gap}{mid}{self.large} above"
        else:
            text = f"{self.large} for all row counts"
        return text + "".join(f"; {m} for {k} -> {n} at >= {PROMPT_ROWS} rows"
                              for (n, k), m in sorted(self.prompt_by_shape.items()))

    def calibrate_prompt_shape(self, weights: list[torch.Tensor], rows: int = 512) -> None:
        """Time ``large`` and the other methods of its arithmetic on one projection shape
        (``weights``: that shape, e.g. several layers' down projections, each timing passing
        over all of them) at ``rows`` rows, and keep the fastest for that shape at PROMPT_ROWS
        rows or more: which of torch's oneDNN GEMM and the AMX tiles wins a prompt depends on
        the shape (the tiles re-read the weights where their token blocks are short)."""
        n, k = weights[0].shape
        candidates = [m for m in _available_methods(weights[0])
                      if _arithmetic(m) == _arithmetic(self.large)]
        # Only where AMX is among them: the one case where the winner varies by shape
        # (elsewhere the extra start-up time, seconds of fp32 GEMMs on an AVX2 CPU, buys
        # nothing).
        if "amx" not in candidates or self.kernel_max_rows >= rows:
            return
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(rows, k, generator=gen).to(weights[0].dtype)
        times = {}
        for m in candidates:
            times[m] = _seconds(_large_fn(m), x, weights)
            if self.timings is not None:
                self.timings.setdefault(f"{m} {k}->{n}", {})[rows] = times[m]
        best = min(candidates, key=times.__getitem__)
        if best != self.large:
            self.prompt_by_shape[(n, k)] = best
            self._prompt[(n, k)] = _large_fn(best)

    @classmethod
    def calibrate(cls, weight: torch.Tensor | list[torch.Tensor], large_rows: int = 256,
                  kernel_rows: tuple[int, ...] = (16, 32, 64, 128, 256, 512),
                  stream: list[torch.Tensor] | None = None) -> LinearDispatch:
        """Time the methods on ``weight`` ([N, K] bf16, CPU; or a list of such weights of
        one shape, e.g. every layer's) and build a plan: the kernel while it is at least as
        fast as the best other method at each of ``kernel_rows`` (ascending); if it never
        loses, at every row count.

        Below ``SMALL_ROWS`` rows a layer streams its weights from memory, so each timing
        passes over every weight given: with several layers' weights that is the memory
        stream of a decode step, not one weight sitting in the cache (which ranks the methods
        wrongly). Larger row counts, compute-bound, time the
        first two.

        Where AMX is the method above the kernel, the kernel's rows that the fused decode
        layer streams (1 to its most) are timed over ``stream`` when given: every weight a
        decode step reads (every projection of every layer), in their several shapes, since
        the two methods rank differently by shape."""
        weights = [weight] if isinstance(weight, torch.Tensor) else list(weight)
        gen = torch.Generator().manual_seed(0)

        def seconds(fn: LinearFn, rows: int, ws: list[torch.Tensor] | None = None) -> float:
            ws = ws or (weights if rows < SMALL_ROWS else weights[:2])
            xs = {k: torch.randn(rows, k, generator=gen).to(ws[0].dtype)
                  for k in sorted({w.shape[1] for w in ws})}
            return _seconds(fn, xs, ws)

        have_kernels = kernels.load() is not None
        candidates = _available_methods(weights[0])
        timings: dict[str, dict[int, float]] = {m: {} for m in (*candidates, "kernel")}
        # Two rounds, the candidates alternating, each keeping its best: with one timing each,
        # a moment of a shared machine's drift can pick the slower of two close methods.
        for _ in range(2):
            for m in candidates:
                t = seconds(_large_fn(m), large_rows)
                timings[m][large_rows] = min(t, timings[m].get(large_rows, t))
        large = min(candidates, key=lambda m: timings[m][large_rows])
        large_fn = _large_fn(large)
        kernel_max = 0
        if have_kernels:
            # Against AMX the kernel must win clearly, and at each row count the fused decode
            # layer streams (1 to decode_layer_max_rows): one call each understates what the
            # fused layer on AMX tiles gains from its better balanced threads; from a few rows
            # on, the streams' widening costs more than AMX's tiles.
            margin = AMX_MARGIN if large == "amx" else 1.0
            few = (range(1, kernels.KERNELS.decode_layer_max_rows + 1) if large == "amx"
                   else (1,))
            for rows in sorted({*few, *kernel_rows}):
                ws = stream if stream and large == "amx" and rows in few else None
                timings["kernel"][rows] = seconds(kernels.linear_bf16, rows, ws)
                if rows not in timings[large]:
                    timings[large][rows] = seconds(large_fn, rows, ws)
                if timings["kernel"][rows] * margin > timings[large][rows]:
                    break
                kernel_max = rows
            else:
                kernel_max = ALL_ROWS
        mid, mid_max = None, 0
        mid_min = 0
        if ("avx512bf16" in candidates and large != "avx512bf16" and _arithmetic(large) == "bf16"
                and kernel_max < ALL_ROWS):
            kernel_max, mid_min, mid_max = cls._calibrate_mid(seconds, timings, kernel_max,
                                                              large, large_rows, stream)
            mid = "avx512bf16" if mid_max else None
        return cls(kernel_max_rows=kernel_max, large=large, timings=timings, mid=mid,
                   mid_max_rows=mid_max, mid_min_rows=mid_min)

    @staticmethod
    def _calibrate_mid(seconds: Callable[..., float], timings: dict[str, dict[int, float]],
                       kernel_max: int, large: str, large_rows: int,
                       stream: list[torch.Tensor] | None) -> tuple[int, int, int]:
        """The AVX512_BF16 kernel's tier: at each of MID_ROWS below ``large_rows``, it
        against the methods the plan may have there (the streams up to ``kernel_max`` or the
        fused decode layer's rows, ``large`` above ``kernel_max``), over ``stream`` for the
        rows the fused layer takes (it runs its projections as these calls do); against the
        streams it must win by AVX512BF16_STREAM_MARGIN. The streams keep the counts they win from
        ``kernel_max`` on; the tier is the first run of counts where it wins, from the count
        after the last one timed before it (rows it lost at keep their method). Returns (the
        streams' new most rows, the tier's fewest and most rows: 0, 0 if it never wins)."""
        few = kernels.KERNELS.decode_layer_max_rows
        fns = {"kernel": kernels.linear_bf16, large: _large_fn(large),
               "avx512bf16": kernels.linear_avx512bf16}
        lo = hi = before = 0
        for rows in MID_ROWS:
            if rows >= large_rows:
                break
            ws = stream if stream and rows <= few else None
            others = ([*(("kernel",) if rows <= max(kernel_max, few) else ()),
                       *((large,) if rows > kernel_max else ())])
            t = {m: seconds(fns[m], rows, ws) for m in ("avx512bf16", *others)}
            if not _avx512bf16_wins(t, others):  # a loss ends the tier: time them again, keeping
                # each best (with one timing each, a moment's drift could end it early)
                t = {m: min(v, seconds(fns[m], rows, ws)) for m, v in t.items()}
            for m, v in t.items():
                timings[m][rows] = v
            streams_win = ("kernel" in others and large != "amx"
                           and t["kernel"] <= min(t[m] for m in others))
            if _avx512bf16_wins(t, others):
                lo, hi = lo or before + 1, rows
            elif streams_win and rows == max(kernel_max, hi) + 1 and hi <= kernel_max + 1:
                # the streams win the next count too (against AMX, the calibration has
                # settled the fused layer's rows with its own margin); a tier of one count
                # begun just below gives it back to them (a tier ended here would leave every
                # count after it to the large method, however slower it is there)
                kernel_max, lo, hi = rows, 0, 0
            elif lo:
                break
            before = rows
        if not lo or hi < kernel_max:  # none, or inside the streams' rows: keep them
            return kernel_max, 0, 0
        return min(kernel_max, lo - 1), lo, hi
