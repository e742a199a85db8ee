"""The kernel plan: which kernel runs each projection of a model at each row count on this CPU,
and where that choice came from. The one place that decides it.

A plan is:

* ``panels``: whether the decoder projections (and the LM head, where its vocabulary is a
  multiple of 16) are packed into panels and run there at every row count;
* ``linear``: a ``LinearSpec``, what ``LinearDispatch`` runs for weights left in rows: the
  AVX2 streams/tiles (``kernel``) up to ``kernel_max_rows``, an ``avx512bf16`` tier
  (``mid``) above them, the ``large`` method above that, and per projection shape a method
  for prompt chunks (``prompt_by_shape``);
* ``stream_prefetch``: how far ahead (bytes) the bf16 weight streams prefetch.

An engine never times anything to get one (``resolve``). In order:

1. a plan file given (``--kernel-plan FILE``, ``EngineConfig.kernel_plan``): pinned; a file
   that is malformed, made for another CPU, model shape, dtype, quantization or thread count,
   or that names a kernel this machine cannot run is refused (``PlanError``, a ValueError);
2. the stored plan for this key, ``<cache>/kernel-plans/<model>@<machine>.json``, written by
   ``phasewise tune`` (``phasewise.model.cpu.tune``), where it exists and is sound (else it is
   ignored, and the start says why);
3. the rule (``rule``), from what the CPU runs, timing nothing.

The key (``PlanKey``) is what a plan's timings depend on: the CPU's model name, vendor and
ISA flags, the threads, the model's shape, its dtype and quantization. Two starts with the
same key and the same stored plan run the same methods, so the same bits.

Torch-free: the CLI and ``EngineConfig`` read plan files without loading torch.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.files import write_text_atomic
from phasewise.model.cpu.capabilities import CpuCapabilities, isa_family

PLAN_FORMAT = "phasewise-kernel-plan"
PLAN_VERSION = 1
PLANS_DIR = "kernel-plans"  # under the kernels' cache folder (kernels.cache_dir())

# The methods of a weight in rows above the AVX2 kernel's rows (linear.py runs them).
LARGE_METHODS = ("torch", "upcast", "gemm", "amx", "avx512bf16")
MID_METHODS = ("avx512bf16",)  # the tier between the kernel's rows and ``large``
BF16_METHODS = ("torch", "amx", "avx512bf16")  # bf16 x bf16 products; the others widen to fp32
ALL_ROWS = 2**31 - 1  # kernel_max_rows meaning "the kernel at every row count"
PROMPT_ROWS = 256  # a shape's own method (prompt_by_shape) applies from this many rows
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The model's fields a plan depends on (the projections' shapes, the head's, int8 or not).
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "vocab_size", "tie_word_embeddings")
STREAM_PREFETCH_MAX = 16384  # as kernels.STREAM_PREFETCH_MAX (the C side's limit)
INT8_ROWS_MAX = 6  # as kernels.INT8_ROWS_MAX: the int8 streams' most rows (the C side's)
INT8_TILE_ROWS_MAX = 128  # the AVX2 int8 tiles' most rows; the packed GEMM above

# How far ahead (bytes) the bf16 weight streams of few-row decode prefetch, by vendor: Intel's
# cores keep more lines in flight than a short distance asks for, so the distance is longer
# there; AMD's cores reach memory speed at the shorter one (figures: benchmarks/RESULTS.md).
STREAM_PREFETCH_INTEL = 2048
STREAM_PREFETCH_OTHER = 256


class PlanError(ValueError):
    """A plan file that cannot be used here: malformed, for another key, or naming a kernel
    this machine cannot run. The message names the file, the problem and what is allowed."""


# -- the rule --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Runtime:
    """What runs here, as the kernel library reports once loaded (not only the CPU's flags:
    a compiler too old for AMX, or a kernel that refuses the tile state, takes kernels away)."""

    kernels: bool  # the AVX2 library loaded
    avx512bf16: bool  # its AVX512_BF16 kernels run
    amx: bool  # its AMX kernels run

    @classmethod
    def here(cls) -> Runtime:
        from phasewise.model.cpu import kernels

        return cls(kernels.load() is not None, kernels.avx512bf16_available(),
                   kernels.amx_available())


def stream_prefetch_rule(caps: CpuCapabilities) -> tuple[int, str]:
    """The weight streams' prefetch distance the rule gives this CPU, and why (its vendor)."""
    if caps.vendor == "GenuineIntel":
        return STREAM_PREFETCH_INTEL, "Intel"
    return STREAM_PREFETCH_OTHER, caps.vendor or "unknown CPU"


def rule(key: PlanKey, runtime: Runtime, caps: CpuCapabilities) -> tuple[
        bool, LinearSpec, int, str]:
    """The plan without a stored one, from what runs here and the model's shape, timing
    nothing: (panels, linear, stream_prefetch, why). It is what ``LinearDispatch.calibrate``
    picks for the reference checkpoint on a quiet machine of each kind:

    * AMX (an AMX Xeon): the AVX2 streams up to 2 rows (they beat the tiles there with the
      Intel prefetch distance, and lose from 4), AMX tiles above, every shape;
    * AVX512_BF16 without AMX (AMD Zen 4/5): every decoder projection in panels (and the LM
      head where its vocabulary is a multiple of 16: then nothing reads rows); a weight left
      in rows (int8 models, a head the panels do not take, a plan with panels off): the
      streams up to 3 rows, the ``avx512bf16`` tier to 32, torch's oneDNN GEMM above;
    * AVX2 alone (Zen 2/3, older Intel): the AVX2 kernel up to 128 rows (streams, then its
      register tiles), the packed GEMM above (torch's bf16 GEMM is emulated there);
    * no kernel library: torch's bf16 GEMM where the CPU has native bf16, else the fp32
      upcast."""
    prefetch, vendor = stream_prefetch_rule(caps)
    if not runtime.kernels:
        large = "torch" if caps.avx512bf16 or caps.amx else "upcast"
        return False, LinearSpec(0, large), prefetch, f"no kernel library: {large} everywhere"
    if runtime.amx:
        return (False, LinearSpec(2, "amx"), prefetch,
                f"AMX: AVX2 streams to 2 rows, AMX tiles above; prefetch {vendor}")
    if runtime.avx512bf16:
        rows = LinearSpec(3, "torch", mid="avx512bf16", mid_max_rows=32)
        if not key.panels_fit():
            return (False, rows, prefetch, "AVX512_BF16 without AMX, weights in rows ("
                    f"{key.panels_misfit()}); prefetch {vendor}")
        if key.head_fits_panels():  # nothing is read as rows: the linear plan is idle
            return (True, LinearSpec(0, "torch"), prefetch,
                    f"AVX512_BF16 without AMX: panels, the LM head too; prefetch {vendor}")
        return (True, rows, prefetch, "AVX512_BF16 without AMX: panels; the LM head in rows "
                f"(vocabulary {key.shape_dict['vocab_size']} % 16); prefetch {vendor}")
    return (False, LinearSpec(128, "gemm"), prefetch,
            f"AVX2 without AVX512_BF16: kernel to 128 rows, packed GEMM above; "
            f"prefetch {vendor}")


# -- what a plan holds -----------------------------------------------------------------------

def _int(d: Mapping[str, Any], name: str, where: str, lo: int = 0, hi: int = ALL_ROWS) -> int:
    if name not in d:
        raise PlanError(f"{where}: {name} is missing (a whole number from {lo} to {hi})")
    v = d[name]
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise PlanError(f"{where}: {name} must be a whole number from {lo} to {hi}; got {v!r}")
    return v


@dataclass(frozen=True)
class LinearSpec:
    """What ``LinearDispatch`` runs for a weight in rows (its fields, torch-free):
    ``kernel`` up to ``kernel_max_rows`` (ALL_ROWS: every count), ``mid`` from
    max(``mid_min_rows``, kernel_max_rows + 1) to ``mid_max_rows``, ``large`` above, and for
    a weight of shape (N, K) at PROMPT_ROWS rows or more ``prompt_by_shape``'s method."""

    kernel_max_rows: int
    large: str
    mid: str | None = None
    mid_min_rows: int = 0
    mid_max_rows: int = 0
    prompt_by_shape: tuple[tuple[int, int, str], ...] = ()  # (N, K, method), sorted

    def __post_init__(self) -> None:
        self.check("linear")

    def check(self, where: str) -> None:
        """Raise PlanError where the fields do not make a plan (``where``: for the message)."""
        if self.large not in LARGE_METHODS:
            raise PlanError(f"{where}: large must be one of {', '.join(LARGE_METHODS)}; got "
                            f"{self.large!r}")
        arith = _arithmetic(self.large)
        if self.mid is not None and (self.mid not in MID_METHODS or arith != "bf16"):
            raise PlanError(f"{where}: mid must be null or one of {', '.join(MID_METHODS)}, "
                            f"beside a large method of bf16 arithmetic "
                            f"({', '.join(BF16_METHODS)}); got {self.mid!r} beside "
                            f"{self.large!r}")
        for n, k, m in self.prompt_by_shape:
            if m not in LARGE_METHODS or _arithmetic(m) != arith:
                raise PlanError(f"{where}: the method for shape {k} -> {n} must be one of "
                                f"{', '.join(x for x in LARGE_METHODS if _arithmetic(x) == arith)}"
                                f" (the arithmetic of large, {self.large}); got {m!r}")

    def methods(self) -> set[str]:
        """Every method the plan may run (``kernel`` included where it takes rows)."""
        out = {self.large, *(m for _, _, m in self.prompt_by_shape)}
        if self.kernel_max_rows:
            out.add("kernel")
        if self.mid is not None and self.mid_max_rows:
            out.add(self.mid)
        return out

    def ranges(self, shape: tuple[int, int]) -> list[tuple[int, int, str]]:
        """(first row, last row, method) for a weight of ``shape`` (N, K), in order; the
        last range ends at ALL_ROWS."""
        if self.kernel_max_rows >= ALL_ROWS:
            return [(1, ALL_ROWS, "kernel")]
        out: list[tuple[int, int, str]] = []
        lo = max(self.mid_min_rows, self.kernel_max_rows + 1)
        has_mid = self.mid is not None and self.mid_max_rows >= lo
        if self.kernel_max_rows:
            out.append((1, self.kernel_max_rows, "kernel"))
        if has_mid:
            if lo > self.kernel_max_rows + 1:
                out.append((self.kernel_max_rows + 1, lo - 1, self.large))
            out.append((lo, self.mid_max_rows, self.mid))
        start = (self.mid_max_rows if has_mid else self.kernel_max_rows) + 1
        prompt = dict(((n, k), m) for n, k, m in self.prompt_by_shape).get(tuple(shape))
        if prompt is not None and prompt != self.large and start < PROMPT_ROWS:
            out.append((start, PROMPT_ROWS - 1, self.large))
            out.append((PROMPT_ROWS, ALL_ROWS, prompt))
        elif prompt is not None and prompt != self.large:
            out.append((start, ALL_ROWS, prompt))
        else:
            out.append((start, ALL_ROWS, self.large))
        merged: list[tuple[int, int, str]] = []
        for r in out:  # neighbours of one method as one range
            if merged and merged[-1][2] == r[2] and merged[-1][1] + 1 == r[0]:
                merged[-1] = (merged[-1][0], r[1], r[2])
            else:
                merged.append(r)
        return merged

    def dispatch(self) -> Any:
        """The ``LinearDispatch`` that runs this spec (imports torch)."""
        from phasewise.model.cpu.linear import LinearDispatch

        return LinearDispatch(kernel_max_rows=self.kernel_max_rows, large=self.large,
                              mid=self.mid, mid_min_rows=self.mid_min_rows,
                              mid_max_rows=self.mid_max_rows,
                              prompt_by_shape={(n, k): m for n, k, m in self.prompt_by_shape})

    @classmethod
    def of(cls, dispatch: Any) -> LinearSpec:
        """The spec of a ``LinearDispatch`` (a calibrated one: ``phasewise tune``)."""
        return cls(kernel_max_rows=dispatch.kernel_max_rows, large=dispatch.large,
                   mid=dispatch.mid if dispatch.mid_max_rows else None,
                   mid_min_rows=dispatch.mid_min_rows if dispatch.mid_max_rows else 0,
                   mid_max_rows=dispatch.mid_max_rows,
                   prompt_by_shape=tuple(sorted((n, k, m) for (n, k), m
                                                in dispatch.prompt_by_shape.items())))

    def to_json(self) -> dict[str, Any]:
        return {"kernel_max_rows": self.kernel_max_rows, "large": self.large, "mid": self.mid,
                "mid_min_rows": self.mid_min_rows, "mid_max_rows": self.mid_max_rows,
                "prompt_by_shape": [{"n": n, "k": k, "method": m}
                                    for n, k, m in self.prompt_by_shape]}

    @classmethod
    def from_json(cls, d: Any, where: str) -> LinearSpec:
        if not isinstance(d, dict):
            raise PlanError(f"{where}: must be an object with kernel_max_rows, large, mid, "
                            f"mid_min_rows, mid_max_rows, prompt_by_shape; got {d!r}")
        shapes = d.get("prompt_by_shape", [])
        if not isinstance(shapes, list) or not all(
                isinstance(e, dict) and set(e) == {"n", "k", "method"} for e in shapes):
            raise PlanError(f"{where}: prompt_by_shape must be a list of "
                            f'{{"n": N, "k": K, "method": M}}; got {shapes!r}')
        by_shape = tuple(sorted((_int(e, "n", where, 1), _int(e, "k", where, 1), e["method"])
                                for e in shapes))
        fields = dict(kernel_max_rows=_int(d, "kernel_max_rows", where),
                      large=d.get("large"), mid=d.get("mid"),
                      mid_min_rows=_int(d, "mid_min_rows", where),
                      mid_max_rows=_int(d, "mid_max_rows", where), prompt_by_shape=by_shape)
        try:
            return cls(**fields)
        except PlanError as e:  # __post_init__ says "linear: ..."; the file's name instead
            raise PlanError(f"{where}{str(e).removeprefix('linear')}") from None


def _arithmetic(method: str) -> str:
    return "bf16" if method in BF16_METHODS else "fp32"


@dataclass(frozen=True)
class PlanKey:
    """What a plan's choice depends on; a stored plan is used only where its key is this
    engine's, field for field."""

    cpu: str  # the CPU's model name
    vendor: str
    isa: tuple[str, ...]  # capabilities.ISA_FLAGS the CPU has
    threads: int  # torch's threads (the kernels run on as many)
    shape: tuple[tuple[str, Any], ...]  # SHAPE_FIELDS, in order
    dtype: str  # torch's name without "torch.": bfloat16
    quantization: str | None  # int8 or None

    @classmethod
    def of(cls, caps: CpuCapabilities, model_config: Any, dtype: str,
           quantization: str | None, threads: int) -> PlanKey:
        return cls(cpu=caps.model_name, vendor=caps.vendor, isa=caps.isa, threads=threads,
                   shape=tuple((f, getattr(model_config, f)) for f in SHAPE_FIELDS),
                   dtype=str(dtype).removeprefix("torch."), quantization=quantization)

    @property
    def shape_dict(self) -> dict[str, Any]:
        return dict(self.shape)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Each projection's weight shape (N, K), and the LM head's."""
        s = self.shape_dict
        h, i = s["hidden_size"], s["intermediate_size"]
        q, kv = s["num_heads"] * s["head_dim"], s["num_kv_heads"] * s["head_dim"]
        return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * i, h),
                "down_proj": (h, i), "lm_head": (s["vocab_size"], h)}

    def panels_misfit(self) -> str:
        """Why the decoder projections cannot take panels ("" where they can)."""
        if self.dtype != "bfloat16":
            return f"{self.dtype} weights"
        if self.quantization is not None:
            return f"{self.quantization} weights"
        for name, (n, k) in self.projection_shapes().items():
            if name != "lm_head" and (n % 16 or k % 2):
                return f"a [{n}, {k}] {name} weight (N % 16, K % 2)"
        return ""

    def panels_fit(self) -> bool:
        return self.panels_misfit() == ""

    def head_fits_panels(self) -> bool:
        n, k = self.projection_shapes()["lm_head"]
        return self.panels_fit() and n % 16 == 0 and k % 2 == 0

    def mismatches(self, other: PlanKey) -> list[str]:
        """``other``'s fields that differ from this key's, as 'field: the plan's X, here Y'."""
        out = []
        for name in ("cpu", "vendor", "isa", "threads", "dtype", "quantization"):
            a, b = getattr(other, name), getattr(self, name)
            if a != b:
                show = (lambda v: " ".join(v) or "none") if name == "isa" else repr
                out.append(f"{name}: the plan's {show(a)}, here {show(b)}")
        mine, theirs = self.shape_dict, other.shape_dict
        for f in SHAPE_FIELDS:
            if mine.get(f) != theirs.get(f):
                out.append(f"model {f}: the plan's {theirs.get(f)!r}, here {mine.get(f)!r}")
        return out

    def file_name(self) -> str:
        """``<model shape>@<machine>.json``: one file per key (the full key is inside)."""
        s = self.shape_dict
        model = (f"h{s['hidden_size']}-i{s['intermediate_size']}-l{s['num_layers']}"
                 f"-a{s['num_heads']}x{s['num_kv_heads']}x{s['head_dim']}-v{s['vocab_size']}"
                 f"{'-tied' if s['tie_word_embeddings'] else ''}-{self.dtype}"
                 f"{'-' + self.quantization if self.quantization else ''}")
        cpu = re.sub(r"[^a-z0-9]+", "-", self.cpu.lower()).strip("-")[:40] or "cpu"
        return f"{model}@{cpu}-{isa_family(self.isa)}-{self.threads}t.json"

    def to_json(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "vendor": self.vendor, "isa": list(self.isa),
                "threads": self.threads, "model": dict(self.shape), "dtype": self.dtype,
                "quantization": self.quantization}

    @classmethod
    def from_json(cls, d: Any, where: str) -> PlanKey:
        want = ("cpu", "vendor", "isa", "threads", "model", "dtype", "quantization")
        if not isinstance(d, dict) or set(want) - set(d):
            raise PlanError(f"{where}: must be an object with {', '.join(want)}; got {d!r}")
        model = d["model"]
        if not isinstance(model, dict) or set(SHAPE_FIELDS) - set(model):
            raise PlanError(f"{where}.model: must hold {', '.join(SHAPE_FIELDS)}; got "
                            f"{model!r}")
        if not isinstance(d["isa"], list) or not all(isinstance(f, str) for f in d["isa"]):
            raise PlanError(f"{where}.isa: must be a list of flag names; got {d['isa']!r}")
        return cls(cpu=str(d["cpu"]), vendor=str(d["vendor"]), isa=tuple(d["isa"]),
                   threads=_int(d, "threads", where, 1, 1 << 16),
                   shape=tuple((f, model[f]) for f in SHAPE_FIELDS), dtype=str(d["dtype"]),
                   quantization=d["quantization"])


@dataclass(frozen=True)
class StoredPlan:
    """A plan file's contents: the key it was measured for, the plan, when, and the
    measurements behind it (``measured``: rounds, each round's plan, timings with spreads)."""

    key: PlanKey
    panels: bool
    linear: LinearSpec
    stream_prefetch: int
    created: str  # ISO 8601, UTC
    measured: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "created": self.created,
                "key": self.key.to_json(),
                "plan": {"panels": self.panels, "stream_prefetch": self.stream_prefetch,
                         "linear": self.linear.to_json()},
                "measured": self.measured}

    @classmethod
    def from_json(cls, d: Any, where: str) -> StoredPlan:
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise PlanError(f"{where}: not a kernel plan (format must be {PLAN_FORMAT!r}, as "
                            "phasewise tune writes)")
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"{where}: version must be {PLAN_VERSION}; got "
                            f"{d.get('version')!r} (run phasewise tune again)")
        plan = d.get("plan")
        if not isinstance(plan, dict):
            raise PlanError(f"{where}: plan must be an object with panels, stream_prefetch, "
                            f"linear; got {plan!r}")
        if not isinstance(plan.get("panels"), bool):
            raise PlanError(f"{where}: plan.panels must be true or false; got "
                            f"{plan.get('panels')!r}")
        prefetch = _int(plan, "stream_prefetch", f"{where}: plan", 0, STREAM_PREFETCH_MAX)
        if prefetch % 64:
            raise PlanError(f"{where}: plan.stream_prefetch must be a multiple of 64 (a cache "
                            f"line) from 0 to {STREAM_PREFETCH_MAX}; got {prefetch}")
        linear = LinearSpec.from_json(plan.get("linear"), f"{where}: plan.linear")
        measured = d.get("measured", {})
        return cls(key=PlanKey.from_json(d.get("key"), f"{where}: key"),
                   panels=plan["panels"], linear=linear, stream_prefetch=prefetch,
                   created=str(d.get("created", "undated")),
                   measured=measured if isinstance(measured, dict) else {})


def read_plan_file(path: str | Path) -> StoredPlan:
    """A plan file, checked for form (not against this machine: ``resolve`` does that);
    PlanError names what is wrong."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise PlanError(f"kernel plan {p}: cannot be read ({e.strerror or e})") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise PlanError(f"kernel plan {p}: not JSON ({e})") from e
    return StoredPlan.from_json(data, f"kernel plan {p}")


def write_plan_file(plan: StoredPlan, path: Path) -> Path:
    """Write ``plan`` to ``path`` atomically (a reader never sees half a file)."""
    write_text_atomic(path, json.dumps(plan.to_json(), indent=1) + "\n")
    return path


def plans_dir() -> Path:
    """Where ``phasewise tune`` stores plans: the kernels' cache folder's ``kernel-plans``."""
    from phasewise.model.cpu.kernels import cache_dir

    return cache_dir() / PLANS_DIR


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- resolution ------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelPlan:
    """The plan an engine runs, and where it came from: ``origin`` ``pinned`` (a file given),
    ``stored`` (``phasewise tune``'s file for this key) or ``rule``; ``source``: that, in
    words, for the start's ``[plan]`` line."""

    key: PlanKey
    panels: bool
    linear: LinearSpec
    stream_prefetch: int
    origin: str
    source: str
    path: Path | None = None

    def projection_ranges(self, runtime: Runtime) -> dict[str, list[tuple[int, int, str]]]:
        """Per projection (and ``lm_head``), (first row, last row, method) in order: the
        method that runs each row count (int8 weights: the int8 kernels' own split)."""
        out = {}
        head_panels = self.panels and self.key.head_fits_panels()
        for name, shape in self.key.projection_shapes().items():
            if self.panels and (name != "lm_head" or head_panels):
                out[name] = [(1, ALL_ROWS, "panels")]
            elif self.key.quantization == "int8":
                above = ([(INT8_ROWS_MAX + 1, ALL_ROWS, "int8-amx")] if runtime.amx else
                         [(INT8_ROWS_MAX + 1, INT8_TILE_ROWS_MAX, "int8-avx2-tiles"),
                          (INT8_TILE_ROWS_MAX + 1, ALL_ROWS, "int8-gemm")])
                out[name] = [(1, INT8_ROWS_MAX, "int8-streams"), *above]
            else:
                out[name] = self.linear.ranges(shape)
        return out

    def table(self, runtime: Runtime) -> str:
        """``projection_ranges`` as lines: ``qkv_proj [1152, 896]: kernel 1-3, ...``."""
        shapes = self.key.projection_shapes()
        lines = []
        for name, ranges in self.projection_ranges(runtime).items():
            n, k = shapes[name]
            parts = [f"{m} {lo}+" if hi >= ALL_ROWS else
                     f"{m} {lo}" if lo == hi else f"{m} {lo}-{hi}" for lo, hi, m in ranges]
            lines.append(f"{name} [{n}, {k}]: " + ", ".join(parts))
        return "\n".join(lines)


def unrunnable(panels: bool, linear: LinearSpec, runtime: Runtime) -> list[str]:
    """The plan's kernels this machine cannot run (empty where it runs them all)."""
    bad = []
    if panels and not runtime.avx512bf16:
        bad.append("panels (needs the AVX512_BF16 kernels)")
    for m in sorted(linear.methods()):
        if m in ("kernel", "gemm") and not runtime.kernels:
            bad.append(f"{m} (needs the kernel library)")
        elif m == "amx" and not runtime.amx:
            bad.append("amx (needs the AMX kernels)")
        elif m == "avx512bf16" and not runtime.avx512bf16:
            bad.append("avx512bf16 (needs the AVX512_BF16 kernels)")
    return bad


def _checked(stored: StoredPlan, key: PlanKey, runtime: Runtime, path: Path) -> None:
    """Raise PlanError where ``stored`` is not for ``key`` or names kernels that cannot run."""
    bad = key.mismatches(stored.key)
    if bad:
        raise PlanError(f"kernel plan {path} was made for another machine or model: "
                        + "; ".join(bad))
    if stored.panels and not key.panels_fit():
        raise PlanError(f"kernel plan {path}: panels is true, but this model cannot take "
                        f"them ({key.panels_misfit()}); panels must be false")
    missing = unrunnable(stored.panels, stored.linear, runtime)
    if missing:
        raise PlanError(f"kernel plan {path} names kernels that cannot run here: "
                        + ", ".join(missing))


def _created(stored: StoredPlan) -> str:
    return stored.created.replace("T", " ").replace("Z", " UTC")


def resolve(key: PlanKey, runtime: Runtime, caps: CpuCapabilities,
            pinned: str | Path | None = None, directory: Path | None = None) -> KernelPlan:
    """The plan for ``key``: the ``pinned`` file (PlanError where it cannot be used), else the
    stored one in ``directory`` (default ``plans_dir()``) where it is sound, else the rule.
    Nothing is timed."""
    if pinned is not None:
        path = Path(pinned)
        stored = read_plan_file(path)
        _checked(stored, key, runtime, path)
        return KernelPlan(key, stored.panels, stored.linear, stored.stream_prefetch, "pinned",
                          f"pinned plan {path} (tuned {_created(stored)})", path)
    path = (directory or plans_dir()) / key.file_name()
    note = f"no stored plan ({path}; phasewise tune stores one)"
    if path.exists():
        try:
            stored = read_plan_file(path)
            _checked(stored, key, runtime, path)
        except PlanError as e:
            note = f"stored plan ignored: {e}"
        else:
            return KernelPlan(key, stored.panels, stored.linear, stored.stream_prefetch,
                              "stored", f"stored plan {path} (tuned {_created(stored)})", path)
    panels, linear, prefetch, why = rule(key, runtime, caps)
    return KernelPlan(key, panels, linear, prefetch, "rule",
                      f"rule from the CPU's flags ({why}); {note}", None)
