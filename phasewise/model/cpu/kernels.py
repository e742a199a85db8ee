"""Build, load and call the hand-written CPU kernels in ``csrc/``, one file per job and ISA:
AVX2 (every CPU with AVX2 and FMA) ``linear_avx2.c`` (bf16 and int8 linear layers: weight
streams, register tiles, packed GEMM), ``elementwise_avx2.c`` (RMSNorm, SiLU-and-multiply,
RoPE), ``attention_avx2.c`` (decode attention), ``fused_layer.c`` (the fused decode layer and
``pw_abi``), ``sampler_avx2.c`` (mask, argmax, sampling, penalties, logprobs); Intel AMX
``linear_amx.c`` and ``attention_amx.c``; AVX512_BF16 (for CPUs that have it without AMX: AMD
Zen 4 and 5) ``linear_avx512bf16.c`` (tiles and panels), ``elementwise_avx512bf16.c`` and
``attention_avx512bf16.c``; and the headers they include (``HEADERS``).

The C files are compiled on first use with the system's C compiler (gcc or cc) into one
library in a cache folder and loaded with ctypes; no torch headers are needed, so the build
takes a few seconds, once. On a machine without a compiler or without AVX2/FMA, ``load()``
returns None and callers fall back to torch. The AMX kernels run only where the CPU has
AMX-BF16 and AVX512_BF16 and Linux grants the process its tile state (``amx_available()``);
a compiler too old for AMX builds the others without them. The AVX512_BF16 kernels run where
the CPU has AVX512_BF16 with AVX-512 F/BW/VL/DQ (``avx512bf16_available()``). The state (the
library, whether loading was tried, why it failed, the limits the C side reports) lives in
one ``KernelLibrary``, the module's ``KERNELS``. What the CPU offers is
``capabilities.capabilities()``, read once.

Numbers both sides need (the fused decode layer's row limit and head size, the layout of its
argument struct, the values of its projection mode) are defined in C only (``abi.h``);
``pw_abi`` reports them and loading checks the ctypes mirror against it, so a mismatch
disables the kernels with a reason instead of corrupting memory.

The benchmark build (``KernelLibrary(bench_knobs=True)``, ``use_bench_build()``) compiles
with ``-DPW_BENCH_KNOBS``: the C globals that switch a kernel's variant for comparisons
(``pw_pk_nta``, ``pw_pk_spread``, ``pw_avx512bf16_attn_kl``) exist only there; the
production library has them as constants.

Cache folder: ``$PHASEWISE_CACHE_DIR`` or ``$XDG_CACHE_HOME/phasewise`` or
``~/.cache/phasewise`` (read when a kernel is first needed, never at import).
"""

from __future__ import annotations

import array
import ctypes
import enum
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phasewise.model.cpu.capabilities import AMX_FLAGS, AVX512BF16_FLAGS, capabilities

CSRC = Path(__file__).with_name("csrc")
# The AVX2 files, compiled with CFLAGS; SOURCE is the one that reports the ABI (pw_abi)
SOURCE = CSRC / "fused_layer.c"
SOURCES = [CSRC / f for f in ("linear_avx2.c", "elementwise_avx2.c", "attention_avx2.c",
                              "fused_layer.c", "sampler_avx2.c")]
# Each ISA's files, built under their own target pragma and left out together when they do not
# compile (the AVX2 files reach them only through weak symbols)
AMX_SOURCES = [CSRC / f for f in ("linear_amx.c", "attention_amx.c")]
AVX512BF16_SOURCES = [CSRC / f for f in ("linear_avx512bf16.c", "elementwise_avx512bf16.c",
                                         "attention_avx512bf16.c")]
# What the sources include (part of the build's cache key, so that an edited header rebuilds)
HEADERS = [CSRC / h for h in ("abi.h", "avx2_common.h", "avx512_common.h", "amx_common.h",
                              "paged_cache.h")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
BENCH_CFLAGS = ["-DPW_BENCH_KNOBS"]  # the benchmark build's comparison switches
LIBS = ["-lm"]
STREAM_PREFETCH_MAX = 16384  # the farthest the C side prefetches (pw_set_stream_prefetch)

INT8_ROWS_MAX = 6  # the most activation rows the int8 kernels take (checked against the C side)
# With DecodeLayerArgs.experts_dp, a mixture's projection of this many rows or more runs on the
# AVX512_BF16 dot products, fewer stream (csrc/abi.h; checked against the C side)
EXPERT_DP_ROWS = 4


class ProjMode(enum.IntEnum):
    """How the fused decode layer runs its projections (``DecodeLayerArgs.proj_mode``): the
    C side's ``enum pw_proj_mode``, value by value (loading checks each through ``pw_abi``)."""

    STREAMS = 0  # the AVX2 row streams (few rows; int8 alike)
    AMX = 1  # AMX tiles (bf16; int8 widened on the tiles above the int8 streams' rows)
    AVX512BF16 = 2  # AVX512_BF16 dot products over bf16 rows (int8 ones stream)
    PANELS = 3  # the same over weights packed into panels (every projection, any rows)
    AVX2_TILES = 4  # the AVX2 2 x 6 register tiles above the streams' rows (bf16 only)


class DecodeLayerArgs(ctypes.Structure):
    """Mirror of ``DecodeLayer`` in csrc/abi.h (same fields, same order). Loading checks
    every field's offset and the size against the C side's ``pw_abi``. ``proj_mode`` holds a
    ``ProjMode``."""

    _fields_ = (
        [(n, ctypes.c_int) for n in ("M", "H", "Q", "KV", "I", "n_heads", "n_kv", "hd", "bs",
                                      "max_blocks", "qk_norm", "nthreads")]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
        + [(n, ctypes.c_void_p) for n in (
            "hidden", "delta", "out", "w_in_norm", "w_qkv", "b_qkv", "w_q_norm", "w_k_norm",
            "w_o", "b_o", "w_post_norm", "w_gate_up", "b_gate_up", "w_down", "b_down",
            "k_cache", "v_cache", "slots", "block_tables", "seq_lens", "cos", "sin",
            "s_qkv", "s_o", "s_gate_up", "s_down")]
        + [("proj_mode", ctypes.c_int), ("window", ctypes.c_int)]
        + [(n, ctypes.c_int) for n in ("n_experts", "top_k", "norm_topk")]
        + [(n, ctypes.c_void_p) for n in ("w_router", "w_experts_gate_up", "w_experts_down")]
        + [("experts_read", ctypes.c_int), ("shared_I", ctypes.c_int)]
        + [(n, ctypes.c_void_p) for n in ("w_shared_gate_up", "w_shared_down",
                                          "w_shared_gate")]
        + [("experts_dp", ctypes.c_int)]
    )


def cache_dir() -> Path:
    root = os.environ.get("PHASEWISE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "phasewise"


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``capabilities().flags``; empty off x86-64)."""
    return set(capabilities().flags)


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def _build(sources: list[Path], out: Path, cflags: list[str] = CFLAGS) -> None:
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        # the headers from the package, wherever a source lies (tests build edited copies)
        include = ["-I", str(CSRC)]
        subprocess.run([cc, *cflags, *include, *map(str, sources), "-o", tmp, *LIBS],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, out)  # atomic: concurrent builders never see a half-written file
    except subprocess.CalledProcessError as e:
        names = ", ".join(s.name for s in sources)
        raise RuntimeError(f"compiling {names} failed: {e.stderr.strip()[:500]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _signatures() -> dict[str, tuple[Any, list[Any]]]:
    P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    return {
        "pw_linear_bf16": (I, [P, P, P, P, I, I, I, I]),
        "pw_gemm_bf16": (I, [P, P, P, P, I, I, I, I]),
        "pw_linear_int8": (I, [P, P, P, P, P, I, I, I, I]),
        "pw_add_rmsnorm_bf16": (None, [P, P, P, P, I, I, F, I]),
        "pw_silu_mul_bf16": (None, [P, P, I, I, I]),
        "pw_rope_bf16": (None, [P, L, P, P, I, I, I, I]),
        "pw_decode_attention_bf16": (I, [P, L, P, P, P, I, P, P, I, I, I, I, I, F, I, I]),
        "pw_decode_layer_bf16": (I, [ctypes.POINTER(DecodeLayerArgs)]),
        "pw_moe_mlp_bf16": (I, [ctypes.POINTER(DecodeLayerArgs), P, I, P]),
        "pw_moe_route": (I, [P, I, I, I, I, P, P]),
        "pw_decode_stack_bf16": (I, [ctypes.POINTER(DecodeLayerArgs), I, P, P, P, P]),
        "pw_decode_stack_head_bf16": (I, [ctypes.POINTER(DecodeLayerArgs), I, P, P, P, P, P, F,
                                          P, P, I, P]),
        "pw_stream_read_bf16": (F, [P, L, I]),
        "pw_set_stream_prefetch": (None, [I]),
        "pw_stream_prefetch": (I, []),
        "pw_mask_logits": (None, [P, I, P, I]),
        "pw_argmax_f32": (None, [P, I, I, P, I]),
        "pw_sample_f32": (I, [P, I, I, P, P, P, P, P, P, I]),
        "pw_penalties_f32": (I, [P, I, P, I, P, P, P, P, P, P, I]),
        "pw_logprobs_f32": (I, [P, I, P, I, P, P, P, P, P, I]),
        "pw_enable_avx512": (None, [I]),
        "pw_enable_avx512_norm": (None, [I]),
        "pw_enable_avx512bf16_attention": (None, [I]),
        "pw_abi": (L, [ctypes.c_char_p]),
    }


AVX512BF16_SIGNATURES = {
    "pw_linear_avx512bf16": (ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4),
    "pw_silu_mul_avx512bf16": (None, [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3),
    "pw_linear_pk": (ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4),
    "pw_linear_pk_f32": (ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4),
    "pw_linear_pk_glu": (ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4),
    "pw_pk_pack": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_int]),
    "pw_pk_unpack": (None, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]),
    "pw_pk_rows": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_long, ctypes.c_void_p, ctypes.c_int]),
    # as pw_prefill_attention_amx's (AMX_SIGNATURES)
    "pw_prefill_attention_avx512bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]),
}


AMX_SIGNATURES = {
    "pw_amx_init": (ctypes.c_int, []),
    "pw_linear_amx": (ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4),
    "pw_linear_glu_amx": (ctypes.c_int, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4),
    "pw_linear_int8_amx": (ctypes.c_int, [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4),
    "pw_mlp_amx": (ctypes.c_int, [ctypes.c_void_p] * 6 + [ctypes.c_int] * 4),
    "pw_linear_glu_int8_amx": (ctypes.c_int, [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4),
    "pw_amx_tile_flops": (ctypes.c_double, [ctypes.c_long, ctypes.c_int]),
    # q, q_stride, k_cache, v_cache, table, bs, ctx, n, out, out_stride, heads, kv, hd,
    # scale, threads
    "pw_prefill_attention_amx": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_long,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]),
}


def _bind(lib: ctypes.CDLL, signatures: dict[str, tuple[Any, list[Any]]]) -> None:
    """Give each of ``signatures``' functions in ``lib`` its result and argument types."""
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def abi_mismatches(abi: Callable[[str], int]) -> list[str]:
    """Where ``DecodeLayerArgs`` or ``ProjMode`` disagrees with the C side's layout and
    values, as reported by ``abi`` (``pw_abi``: a name -> a number); empty when they agree."""
    bad = []
    if abi("int8_rows_max") != INT8_ROWS_MAX:
        bad.append(f"int8_rows_max is {abi('int8_rows_max')} in C, {INT8_ROWS_MAX} here")
    if abi("expert_dp_rows") != EXPERT_DP_ROWS:
        bad.append(f"expert_dp_rows is {abi('expert_dp_rows')} in C, {EXPERT_DP_ROWS} here")
    size = abi("sizeof DecodeLayer")
    if size != ctypes.sizeof(DecodeLayerArgs):
        bad.append(f"sizeof DecodeLayer is {size} in C, {ctypes.sizeof(DecodeLayerArgs)} here")
    for name, _ in DecodeLayerArgs._fields_:
        offset = abi(name)
        mine = getattr(DecodeLayerArgs, name).offset
        if offset != mine:
            bad.append(f"DecodeLayer.{name} is at {offset} in C, {mine} here")
    for mode in ProjMode:
        value = abi(f"PW_PROJ_{mode.name}")
        if value != mode.value:
            bad.append(f"PW_PROJ_{mode.name} is {value} in C, {mode.value} here")
    return bad


class _Unavailable(Exception):
    """Why the kernels cannot be had (becomes ``KernelLibrary.reason``)."""


class KernelLibrary:
    """The compiled kernels, loaded once on first use: ``lib`` (None until loaded, and when
    they cannot be had), ``reason`` (why not), and the limits the C side reports
    (``decode_layer_max_rows``: rows the fused decode layer takes; ``amx_layer_max_rows``:
    rows it takes when its projections all run on AMX tiles; ``max_head_dim``;
    ``max_experts``: the most experts its mixture-of-experts MLP routes among), and
    whether the AMX kernels may run (``amx``; ``amx_reason``: why not), and the AVX512_BF16
    ones (``avx512bf16``; ``avx512bf16_reason``); how far ahead the bf16 weight streams
    prefetch (``stream_prefetch`` bytes; ``stream_prefetch_reason``: the kernel plan's rule
    at load, the plan an engine runs once it sets it). ``bench_knobs``: the benchmark build
    (``-DPW_BENCH_KNOBS``: the comparison switches as C globals), cached apart."""

    def __init__(self, source: Path = SOURCE, amx_sources: Path | list[Path] = AMX_SOURCES,
                 avx512bf16_sources: Path | list[Path] = AVX512BF16_SOURCES,
                 bench_knobs: bool = False) -> None:
        self.source = source  # stands in for SOURCE among the AVX2 files (tests build copies)
        self.sources = [source if s == SOURCE else s for s in SOURCES]
        self.amx_sources = [amx_sources] if isinstance(amx_sources, Path) else list(amx_sources)
        self.avx512bf16_sources = ([avx512bf16_sources] if isinstance(avx512bf16_sources, Path)
                                   else list(avx512bf16_sources))
        self.cflags = CFLAGS + (BENCH_CFLAGS if bench_knobs else [])
        self.lib: ctypes.CDLL | None = None
        self.reason: str | None = None
        self.tried = False
        self.decode_layer_max_rows = 0
        self.amx_layer_max_rows = 0
        self.max_head_dim = 0
        self.max_experts = 0
        self.amx = False
        self.amx_reason: str | None = "the kernels are not loaded"
        self.avx512bf16 = False
        self.avx512bf16_reason: str | None = "the kernels are not loaded"
        self.stream_prefetch = 0
        self.stream_prefetch_reason = "the kernels are not loaded"
        self.compile_s = 0.0  # seconds this process spent compiling them (0: cached)

    def load(self) -> ctypes.CDLL | None:
        """The library, building it if needed; None if it cannot be had (see ``reason``)."""
        if not self.tried:
            from phasewise.model.cpu.plan import stream_prefetch_rule

            self.stream_prefetch, self.stream_prefetch_reason = stream_prefetch_rule(
                capabilities())
            self.tried = True
            try:
                self.lib = self._open()
            except _Unavailable as e:
                self.reason = str(e)
        return self.lib

    def set_stream_prefetch(self, nbytes: int, reason: str) -> None:
        """Have the bf16 weight streams prefetch ``nbytes`` ahead (0 to STREAM_PREFETCH_MAX,
        a multiple of 64: a cache line), for ``reason`` (printed beside it). The library is
        one per process: the last engine's plan to set it holds for every engine in it."""
        if (not isinstance(nbytes, int) or isinstance(nbytes, bool)
                or not 0 <= nbytes <= STREAM_PREFETCH_MAX or nbytes % 64):
            raise ValueError(f"stream_prefetch must be a whole number of bytes from 0 to "
                             f"{STREAM_PREFETCH_MAX}, a multiple of 64 (a cache line); got "
                             f"{nbytes!r}")
        lib = self.load()
        self.stream_prefetch, self.stream_prefetch_reason = nbytes, reason
        if lib is not None:
            lib.pw_set_stream_prefetch(nbytes)

    def _compiled(self, sources: list[Path]) -> ctypes.CDLL:
        headers = [h for h in HEADERS if h.exists()]
        key = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, *headers])
                             + " ".join(self.cflags).encode()).hexdigest()[:16]
        path = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
        if not path.exists():
            print(f"compiling phasewise's CPU kernels (once; cached in {path.parent})",
                  file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                _build(sources, path, self.cflags)
            finally:
                self.compile_s += time.monotonic() - t0
        return ctypes.CDLL(str(path))

    def _open(self) -> ctypes.CDLL:
        if not _cpu_has_avx2_fma():
            raise _Unavailable("this CPU lacks AVX2/FMA")
        # The extra ISAs' files, all of them if they compile, else each ISA's alone, else none
        # (e.g. a compiler that predates AMX: the AVX512_BF16 kernels and AVX2 ones without it).
        extras = {"amx": self.amx_sources, "avx512bf16": self.avx512bf16_sources}
        reasons = {k: ", ".join(p.name for p in ps if not p.exists()) + " missing"
                   for k, ps in extras.items() if not all(p.exists() for p in ps)}
        present = {k: ps for k, ps in extras.items() if k not in reasons}
        lib, errors = None, {}
        for combo in ([*present], *([k] for k in present if len(present) > 1), []):
            try:
                lib = self._compiled([*self.sources, *(p for k in combo for p in present[k])])
            except RuntimeError as e:
                errors[tuple(combo)] = str(e)
                continue
            except OSError as e:
                raise _Unavailable(str(e)) from e
            for k in present:
                if k not in combo:
                    reasons[k] = errors.get((k,), next(iter(errors.values()), "not compiled"))
            break
        if lib is None:
            raise _Unavailable(errors.get((), "compiling the kernels failed"))
        self.amx_reason, self.avx512bf16_reason = reasons.get("amx"), reasons.get("avx512bf16")
        _bind(lib, _signatures())

        def abi(what: str) -> int:
            return int(lib.pw_abi(what.encode()))

        bad = abi_mismatches(abi)
        if bad:
            raise _Unavailable(f"{self.source.name} and {Path(__file__).name} disagree: "
                               + "; ".join(bad))
        self.decode_layer_max_rows = abi("row_stream_max")
        self.amx_layer_max_rows = abi("amx_layer_max")
        self.max_head_dim = abi("max_head_dim")
        self.max_experts = abi("max_experts")
        lib.pw_set_stream_prefetch(self.stream_prefetch)
        if self.amx_reason is None:
            self._enable_amx(lib)
        if self.avx512bf16_reason is None:
            self._enable_avx512bf16(lib)
        return lib

    def _enable_avx512bf16(self, lib: ctypes.CDLL) -> None:
        missing = AVX512BF16_FLAGS - cpu_flags()
        if missing:
            self.avx512bf16_reason = "this CPU lacks " + ", ".join(sorted(missing))
            return
        _bind(lib, AVX512BF16_SIGNATURES)
        self.avx512bf16 = True
        lib.pw_enable_avx512_norm(1)  # the RMSNorms on 16 lanes, rounding in one instruction
        if not self.amx:  # decode attention on AVX512_BF16 where AMX's does not run
            lib.pw_enable_avx512bf16_attention(1)

    def _enable_amx(self, lib: ctypes.CDLL) -> None:
        missing = AMX_FLAGS - cpu_flags()
        if missing:
            self.amx_reason = "this CPU lacks " + ", ".join(sorted(missing))
            return
        _bind(lib, AMX_SIGNATURES)
        if lib.pw_amx_init() != 0:
            self.amx_reason = "Linux refused the AMX tile state (arch_prctl)"
            return
        self.amx = True
        lib.pw_enable_avx512(1)  # the RMSNorms too: bf16 rounding in one instruction


KERNELS = KernelLibrary()


def use_bench_build() -> KernelLibrary:
    """Make the module's library the benchmark build (``bench_knobs``: the comparison
    switches as C globals, ``ctypes.c_int.in_dll(lib, name)``) for the rest of the process,
    and return it; before anything has loaded the production one (benchmarks call it first)."""
    global KERNELS
    if KERNELS.tried and KERNELS.cflags != CFLAGS + BENCH_CFLAGS:
        raise RuntimeError("use_bench_build: the production kernels are loaded already")
    if KERNELS.cflags != CFLAGS + BENCH_CFLAGS:
        KERNELS = KernelLibrary(bench_knobs=True)
    return KERNELS


def load() -> ctypes.CDLL | None:
    """The compiled kernel library (``KERNELS.load()``)."""
    return KERNELS.load()


def amx_available() -> bool:
    """Whether the AMX kernels can run here (the library loaded, the CPU and the kernel
    allow it)."""
    return KERNELS.load() is not None and KERNELS.amx


def avx512bf16_available() -> bool:
    """Whether the AVX512_BF16 kernels (``*_avx512bf16.c``) can run here."""
    return KERNELS.load() is not None and KERNELS.avx512bf16


def __getattr__(name: str) -> Any:
    if name == "unavailable_reason":  # older spelling of KERNELS.reason
        return KERNELS.reason
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _call(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
          scale: torch.Tensor | None = None, n: int | None = None,
          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A linear kernel's call: ``name(x, w[, scale], bias, y, M, N, K, threads)`` over x's
    rows, y [..., N] bf16 (or ``out_dtype``, the kernel's; ``scale``: int8 weights' per-row
    scales; ``n``: the output width N when it is not w's row count)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {KERNELS.reason}")
    k = x.shape[-1]
    n = w.shape[0] if n is None else n
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    if m:
        scales = [] if scale is None else [scale.data_ptr()]
        rc = getattr(lib, name)(x2.data_ptr(), w.data_ptr(), *scales,
                                bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                m, n, k, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"{name} could not allocate scratch memory")
    return y.view(*x.shape[:-1], n)


def mask_logits(row: torch.Tensor, bits: torch.Tensor) -> bool:
    """Structured output: set ``row`` (fp32, contiguous, on CPU) to -inf wherever the
    bitmask ``bits`` (int32, contiguous: bit j of word i is token 32 i + j) has a clear bit,
    and past its end. Returns False, touching nothing, when the kernels are unavailable."""
    lib = load()
    if lib is None:
        return False
    lib.pw_mask_logits(row.data_ptr(), row.numel(), bits.data_ptr(), bits.numel())
    return True


def _argmax_into(logits: torch.Tensor, make_out: Callable[[int], Any]) -> Any:
    """``pw_argmax_f32`` over ``logits`` into ``make_out(rows)`` (a buffer of int64s: its
    address from ``data_ptr()`` or ``buffer_info()``), or None when the kernels are
    unavailable or the tensor is not a non-empty contiguous 2-D fp32 CPU one."""
    lib = load()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32
            or logits.device.type != "cpu" or not logits.is_contiguous()
            or 0 in logits.shape):
        return None
    out = make_out(logits.shape[0])
    addr = out.data_ptr() if isinstance(out, torch.Tensor) else out.buffer_info()[0]
    lib.pw_argmax_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], addr,
                      torch.get_num_threads())
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax (int64) of a 2-D fp32 CPU tensor, as ``Tensor.argmax(-1)`` takes
    it (the first maximum; the first NaN where a row has one), or None when the kernels are
    unavailable or the tensor is not of that kind."""
    return _argmax_into(logits, lambda rows: torch.empty(rows, dtype=torch.int64))


def argmax_list(logits: torch.Tensor) -> list[int] | None:
    """``argmax_rows(logits).tolist()`` without the tensor: the kernel writes into an
    ``array`` (None where ``argmax_rows`` would be)."""
    out = _argmax_into(logits, lambda rows: array.array("q", bytes(8 * rows)))
    return None if out is None else out.tolist()


def sample_list(logits: torch.Tensor, temps: list[float], top_ks: list[int],
                top_ps: list[float], min_ps: list[float], u: list[float]) -> list[int] | None:
    """One token a row of a 2-D fp32 CPU tensor of logits (``pw_sample_f32``: the
    temperature, top-k, top-p and min-p filters by radix selection, no sort, then a draw at
    ``u``), with each row's settings (top_k 0 and top_p >= 1 mean off; temperatures > 0).
    None where the kernels are unavailable or the tensor is not of that kind; -1 for a row
    with nothing to draw (no finite logit, or +inf), which the caller draws another way."""
    lib = load()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32
            or logits.device.type != "cpu" or not logits.is_contiguous()
            or 0 in logits.shape):
        return None
    rows = logits.shape[0]
    bufs = [array.array("f", temps), array.array("i", top_ks), array.array("f", top_ps),
            array.array("f", min_ps), array.array("f", u)]
    out = array.array("q", bytes(8 * rows))
    lib.pw_sample_f32(logits.data_ptr(), rows, logits.shape[1],
                      *(b.buffer_info()[0] for b in bufs), out.buffer_info()[0],
                      torch.get_num_threads())
    return out.tolist()


def apply_penalties(logits: torch.Tensor, rows: list[int], token_ids: list[list[int]],
                    num_prompt: list[int], repetition: list[float], presence: list[float],
                    frequency: list[float]) -> bool:
    """In place on ``rows`` of a 2-D fp32 CPU tensor (``pw_penalties_f32``): each row's
    repetition penalty over its ``token_ids`` (prompt then outputs), then presence and
    frequency over the outputs (``token_ids[num_prompt:]``), as ``Sampler``'s torch path
    does them. Returns False, touching nothing, where the kernels are unavailable or the
    tensor is not of that kind; raises MemoryError where a thread's count table cannot be
    allocated (some rows may then be done already: no other way may redo them)."""
    lib = load()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32
            or logits.device.type != "cpu" or not logits.is_contiguous() or not rows):
        return False
    ids = array.array("i")
    offs = array.array("q", [0])
    for t in token_ids:
        ids.extend(t)
        offs.append(len(ids))
    if not ids:
        ids.append(0)  # an address to pass; no row reads it
    bufs = [array.array("i", rows), ids, offs, array.array("q", num_prompt),
            array.array("f", repetition), array.array("f", presence),
            array.array("f", frequency)]
    addr = [b.buffer_info()[0] for b in bufs]
    if lib.pw_penalties_f32(logits.data_ptr(), logits.shape[1], addr[0], len(rows),
                            *addr[1:], torch.get_num_threads()):
        raise MemoryError(f"no memory for a count table of {logits.shape[1]} tokens "
                          "(the penalties kernel)")
    return True


def logprob_entries(logits: torch.Tensor, rows: list[int], tokens: list[int],
                    ns: list[int]) -> list[dict[int, float]] | None:
    """For ``rows`` of a 2-D fp32 CPU tensor (``pw_logprobs_f32``): {token id: log-prob}
    of each row's ``tokens`` entry and its ``ns`` (<= 20) most likely tokens, as
    ``torch.log_softmax`` and ``topk`` give them. None where the kernels are unavailable,
    the tensor is not of that kind, or a row has a NaN or no finite logit."""
    lib = load()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32
            or logits.device.type != "cpu" or not logits.is_contiguous() or not rows):
        return None
    k = len(rows)
    tok_lp = array.array("f", bytes(4 * k))
    top_lp = array.array("f", bytes(4 * 20 * k))
    top_ids = array.array("q", bytes(8 * 20 * k))
    bufs = [array.array("i", rows), array.array("q", tokens), array.array("i", ns),
            tok_lp, top_lp, top_ids]
    addr = [b.buffer_info()[0] for b in bufs]
    if lib.pw_logprobs_f32(logits.data_ptr(), logits.shape[1], addr[0], k, *addr[1:],
                           torch.get_num_threads()):
        return None
    out = []
    for i in range(k):
        entry = {tokens[i]: tok_lp[i]}
        n = min(ns[i], 20)
        entry.update((t, v) for t, v in zip(top_ids[20 * i:20 * i + n], top_lp[20 * i:20 * i + n])
                     if t >= 0)  # -1: past a vocabulary smaller than n
        out.append(entry)
    return out


def linear_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``F.linear`` for bf16 CPU tensors, streaming each weight once (few rows of ``x``).

    x: [..., K], w: [N, K] contiguous, bias: [N] or None -> [..., N], all bf16.
    """
    return _call("pw_linear_bf16", x, w, bias)


def gemm_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Same contract as ``linear_bf16``, as a packed, cache-blocked GEMM (many rows)."""
    return _call("pw_gemm_bf16", x, w, bias)


def linear_amx(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Same contract as ``linear_bf16``, on AMX tiles (any row count; ``amx_available()``
    must hold). The weight is read in place; fewer than 16 output features go to torch."""
    if w.shape[0] < 16:
        return torch.nn.functional.linear(x, w, bias)
    _need_amx()
    return _call("pw_linear_amx", x, w, bias)


def linear_avx512bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Same contract as ``linear_bf16``, on AVX512_BF16 dot products (any row count;
    ``avx512bf16_available()`` must hold): the weight read in place, 4 of its rows against up to 6
    tokens a register tile, products of bf16 pairs summed in fp32, one rounding."""
    if not avx512bf16_available():
        raise RuntimeError("AVX512_BF16 kernels unavailable: "
                           f"{KERNELS.avx512bf16_reason or KERNELS.reason}")
    return _call("pw_linear_avx512bf16", x, w, bias)


def is_panels(w: torch.Tensor) -> bool:
    """Whether ``w`` is a weight in the panels layout (``pack_panels``): int32 [N / 16,
    K / 2, 16] on a CPU."""
    return w.dtype == torch.int32 and w.dim() == 3 and w.shape[2] == 16 and w.device.type == "cpu"


def can_pack_panels(w: torch.Tensor) -> bool:
    """Whether ``w`` ([N, K] bf16, CPU) can take the panels layout: N % 16 == 0, K even,
    and the AVX512_BF16 kernels run here."""
    return (avx512bf16_available() and w.dim() == 2 and w.dtype == torch.bfloat16
            and w.device.type == "cpu" and w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0
            and w.shape[0] > 0 and w.shape[1] > 0)


def pack_panels(w: torch.Tensor, in_place: bool = False, glu: bool = False) -> torch.Tensor:
    """``w`` ([N, K] bf16; ``can_pack_panels``) in the panels layout of ``pw_linear_pk``:
    int32 [N / 16, K / 2, 16]. Channel c of block b (row 16 b +
    c) has a 32-bit word per pair p, w[16 b + c, 2p] (low half) | w[16 b + c, 2p + 1] (high
    half); blocks come in groups of two (the last perhaps alone), and a group's two blocks
    take turns pair by pair, so its 2 x 16 words of pair p lie side by side: flat word
    (16 (2g) K/2 + (2p + j) 16 + c) for block 2g + j of a full group (``panels_word`` for
    any). A tile then reads one stream. (The int32 view's axes are no longer block, pair
    and lane; nothing indexes them.) ``glu``: a SwiGLU's [2I, K] gate/up weight (I % 16 ==
    0) with its blocks reordered first, gate block i then up block i, so each group is one
    unit of the activations (``glu_pk`` reads it; ``linear_pk`` would give the channels in
    that order).
    Same byte count as ``w``; a new tensor, or with ``in_place`` (``w`` contiguous, 4-byte
    aligned) ``w``'s own bytes, repacked a group of 32 rows at a time (``w`` no longer holds
    rows then; with ``glu`` a transient copy reorders its blocks first)."""
    if not can_pack_panels(w):
        raise ValueError(f"cannot pack a {tuple(w.shape)} {w.dtype} weight into panels (N % 16, "
                         "K % 2 and the AVX512_BF16 kernels are needed)")
    n, k = w.shape
    if glu and n % 32:
        raise ValueError(f"pack_panels(glu=True) needs a [2I, K] gate/up weight with I % 16 == 0;"
                         f" got {tuple(w.shape)}")
    if in_place:
        if not w.is_contiguous() or w.data_ptr() % 4:
            raise ValueError("pack_panels in place needs a contiguous, 4-byte aligned weight")
        src = w.detach()
        out = src.view(torch.int32).view(n // 16, k // 2, 16)
        if glu:  # blocks reordered (through a transient copy), then packed in place
            src.copy_(_glu_order(src))
    else:
        src = _glu_order(w) if glu else w.contiguous()
        out = torch.empty(n // 16, k // 2, 16, dtype=torch.int32)
    if load().pw_pk_pack(src.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("pw_pk_pack could not allocate a group's scratch memory")
    return out


def panels_word(n: int, k: int, row: int, pair: int) -> int:
    """The flat index, in ``pack_panels``' int32 output for an [n, k] weight, of the word
    holding row ``row``'s values 2 ``pair`` and 2 ``pair`` + 1 (see ``pack_panels``)."""
    b, c, kp = row // 16, row % 16, k // 2
    g0 = b - b % 2
    width = min(2, n // 16 - g0)  # blocks in the group
    return 16 * g0 * kp + (pair * width + b - g0) * 16 + c


def _glu_order(w: torch.Tensor, undo: bool = False) -> torch.Tensor:
    """A [2I, K] gate/up weight's 16-row blocks reordered as units: gate block i, then up
    block i (a new tensor); ``undo``: back from units to gate rows, then up rows."""
    n, k = w.shape
    halves = (n // 32, 2) if undo else (2, n // 32)
    return w.reshape(*halves, 16, k).transpose(0, 1).reshape(n, k).contiguous()


def unpack_panels(wp: torch.Tensor, glu: bool = False) -> torch.Tensor:
    """The [N, K] bf16 weight that ``pack_panels`` packed into ``wp`` (with ``glu`` as it
    was packed)."""
    if not is_panels(wp) or not avx512bf16_available():
        raise ValueError("not a weight in the panels layout, or no AVX512_BF16 kernels here")
    n, k = wp.shape[0] * 16, wp.shape[1] * 2
    out = torch.empty(n, k, dtype=torch.bfloat16)
    load().pw_pk_unpack(wp.contiguous().data_ptr(), n, k, out.data_ptr())
    return _glu_order(out, undo=True) if glu else out


def panels_rows(wp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of the [N, K] bf16 weight packed into ``wp``
    (``pack_panels``, not glu) -> [*ids.shape, K] bf16: the embedding lookup of a table
    that is packed as the LM head. IndexError for an id outside [0, N), as ``F.embedding``."""
    if not is_panels(wp) or not wp.is_contiguous() or not avx512bf16_available():
        raise ValueError("panels_rows: not contiguous panels, or no AVX512_BF16 kernels here")
    if ids.dtype not in (torch.int32, torch.int64) or ids.device.type != "cpu":
        raise TypeError(f"panels_rows: ids must be int32 or int64 on the CPU; got {ids.dtype} "
                        f"on {ids.device}")
    n, k = 16 * wp.shape[0], 2 * wp.shape[1]
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(*ids.shape, k, dtype=torch.bfloat16)
    if load().pw_pk_rows(wp.data_ptr(), n, k, flat.data_ptr(), flat.numel(), out.data_ptr(),
                         torch.get_num_threads()):
        raise IndexError(f"panels_rows: token id out of range [0, {n}): "
                         f"{int(flat.min())}..{int(flat.max())}")
    return out


def linear_pk(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Same contract as ``linear_bf16``, with the weight in the panels layout
    (``pack_panels``; N = 16 wp.shape[0]): AVX512_BF16 dot products, 16 output channels a
    vector, each token's pairs broadcast, products of bf16 pairs summed in fp32 pair by
    pair, one rounding. ``out_dtype`` torch.float32: the same bf16 values, written widened
    to fp32 (``pw_linear_pk_f32``: the decode step's logits)."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"linear_pk: out_dtype must be torch.bfloat16 or torch.float32; "
                         f"got {out_dtype}")
    kernel = "pw_linear_pk" if out_dtype == torch.bfloat16 else "pw_linear_pk_f32"
    return _pk_call("linear_pk", kernel, x, wp, bias, n=16 * wp.shape[0], out_dtype=out_dtype)


def _pk_call(name: str, kernel: str, x: torch.Tensor, wp: torch.Tensor,
             bias: torch.Tensor | None, n: int,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``linear_pk``'s and ``glu_pk``'s checks (``name`` in their messages), then their
    C ``kernel``'s call (output width ``n``, values of ``out_dtype``)."""
    if not avx512bf16_available():
        raise RuntimeError("AVX512_BF16 kernels unavailable: "
                           f"{KERNELS.avx512bf16_reason or KERNELS.reason}")
    if not is_panels(wp) or x.shape[-1] != 2 * wp.shape[1] or not wp.is_contiguous():
        raise ValueError(f"{name}: weight {tuple(wp.shape)} {wp.dtype} is not contiguous "
                         f"panels of the input's width {x.shape[-1]}")
    width = 16 * wp.shape[0]
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (width,)
                             or not bias.is_contiguous() or bias.device.type != "cpu"):
        raise ValueError(f"{name}: bias must be a contiguous bf16 CPU tensor of {width} "
                         f"values; got {tuple(bias.shape)} {bias.dtype}")
    return _call(kernel, x.to(torch.bfloat16), wp, bias, n=n, out_dtype=out_dtype)


def glu_pk(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """A SwiGLU MLP's gate/up projection and SiLU-and-multiply in one pass over panels:
    ``wp`` a [2I, K] weight (gate rows, then up rows) packed with ``pack_panels(w,
    glu=True)`` (I % 16 == 0), bias [2I] (gate, then up) or None -> [..., I] =
    bf16(bf16(silu(g)) * u), the bits of ``silu_mul`` after ``linear_pk`` over the rows
    packed plainly, without the [..., 2I] projection."""
    if not is_panels(wp) or wp.shape[0] % 2:
        raise ValueError(f"glu_pk: weight {tuple(wp.shape)} {wp.dtype} is not panels of an "
                         "even number of 16-row blocks (I % 16 == 0)")
    return _pk_call("glu_pk", "pw_linear_pk_glu", x, wp, bias, n=8 * wp.shape[0])


def _need_amx() -> None:
    if not amx_available():
        raise RuntimeError(f"AMX kernels unavailable: {KERNELS.amx_reason or KERNELS.reason}")


def glu_amx(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """A SwiGLU MLP's gate/up projection and SiLU-and-multiply in one AMX pass: w [2I, K]
    (gate rows, then up rows), bias [2I] or None -> [..., I] = bf16(bf16(silu(g)) * u), the
    values ``silu_mul(linear(x, w, bias))`` gives. Needs ``amx_available()`` and I >= 16."""
    inter = w.shape[0] // 2
    if w.shape[0] % 2 or inter < 16:
        raise ValueError(f"glu_amx: w must have an even number >= 32 of rows; got {w.shape[0]}")
    _need_amx()
    return _call("pw_linear_glu_amx", x, w, bias, n=inter)


def linear_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, scale[:, None] * w, bias)`` for weight-only int8: x [..., K] bf16, w [N,
    K] int8 contiguous, scale [N] fp32, bias [N] bf16 or None -> [..., N] bf16. Up to
    ``INT8_ROWS_MAX`` rows each weight byte is read once, at memory speed. More rows run on
    AMX tiles where the CPU has them (``linear_int8_amx``), else the packed GEMM, which
    widens the int8 weights block by block (no full-size copy)."""
    _check_int8("linear_int8", x, w, scale, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > INT8_ROWS_MAX and w.shape[0] >= 16 and amx_available():
        return _call("pw_linear_int8_amx", x, w.contiguous(), bias, scale.contiguous())
    return _call("pw_linear_int8", x, w.contiguous(), bias, scale.contiguous())


def _check_int8(name: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> None:
    k, n = x.shape[-1], w.shape[0]
    if (w.dtype != torch.int8 or scale.dtype != torch.float32 or x.dtype != torch.bfloat16
            or (bias is not None and bias.dtype != torch.bfloat16)):
        raise TypeError(f"{name} needs bf16 x, int8 w, fp32 scale and a bf16 bias; got "
                        f"{x.dtype}, {w.dtype}, {scale.dtype}, "
                        f"{None if bias is None else bias.dtype}")
    if w.shape[1] != k or scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"{name}: x [..., {k}] against w {tuple(w.shape)}, scale "
                         f"{tuple(scale.shape)}")


def mlp_amx(x: torch.Tensor, w_gate_up: torch.Tensor, b_gate_up: torch.Tensor | None,
            w_down: torch.Tensor, b_down: torch.Tensor | None) -> torch.Tensor:
    """A SwiGLU MLP on AMX tiles, bf16: ``linear_amx(glu_amx(x, w_gate_up, b_gate_up),
    w_down, b_down)`` bit for bit, the activations handed from the first pass to the second
    already in the tiles' packed order (no [rows, I] tensor, no packing). w_gate_up [2I, H],
    w_down [H, I] with I % 32 == 0 and H >= 16; needs ``amx_available()``."""
    inter, hidden = w_gate_up.shape[0] // 2, x.shape[-1]
    if (w_gate_up.shape != (2 * inter, hidden) or w_down.shape != (hidden, inter)
            or inter % 32 or hidden < 16):
        raise ValueError(f"mlp_amx: gate/up {tuple(w_gate_up.shape)} and down "
                         f"{tuple(w_down.shape)} for x [..., {hidden}]: need [2I, H] and "
                         f"[H, I], I a multiple of 32, H >= 16")
    for t in (x, w_gate_up, w_down, b_gate_up, b_down):
        if t is not None and t.dtype != torch.bfloat16:
            raise TypeError(f"mlp_amx takes bf16 tensors; got {t.dtype}")
    _need_amx()
    x2 = x.reshape(-1, hidden).contiguous()
    y = torch.empty(x2.shape[0], hidden, dtype=torch.bfloat16)
    if x2.shape[0]:
        ptr = [None if t is None else t.contiguous().data_ptr()
               for t in (b_gate_up, b_down)]
        rc = KERNELS.lib.pw_mlp_amx(x2.data_ptr(), w_gate_up.contiguous().data_ptr(), ptr[0],
                                    w_down.contiguous().data_ptr(), ptr[1], y.data_ptr(),
                                    x2.shape[0], inter, hidden, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("pw_mlp_amx could not allocate scratch memory")
    return y.view(*x.shape[:-1], hidden)


def linear_int8_amx(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_int8`` on AMX tiles for any row count: each weight panel widened to bf16
    (exact: -127..127 are bf16 integers) as it comes in, the scales applied to the fp32 sums
    before the bias and the one rounding. Needs ``amx_available()`` and >= 16 rows of w."""
    _check_int8("linear_int8_amx", x, w, scale, bias)
    if w.shape[0] < 16:
        raise ValueError(f"linear_int8_amx: w must have >= 16 rows; got {w.shape[0]}")
    _need_amx()
    return _call("pw_linear_int8_amx", x, w.contiguous(), bias, scale.contiguous())


def glu_int8_amx(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``glu_amx`` for an int8 gate/up weight [2I, K] with per-row scales [2I]: the values
    ``silu_mul(linear_int8_amx(x, w, scale, bias))`` gives."""
    _check_int8("glu_int8_amx", x, w, scale, bias)
    inter = w.shape[0] // 2
    if w.shape[0] % 2 or inter < 16:
        raise ValueError(f"glu_int8_amx: w must have an even number >= 32 of rows; got "
                         f"{w.shape[0]}")
    _need_amx()
    return _call("pw_linear_glu_int8_amx", x, w.contiguous(), bias, scale.contiguous(),
                 n=inter)


def amx_tile_gflops(seconds: float = 0.2) -> float | None:
    """The AMX tile unit's ceiling on this machine (GFLOP/s, all threads): tile products on
    operands already in the tile registers, no memory traffic. None without AMX."""
    import time

    if not amx_available():
        return None
    fn, threads = KERNELS.lib.pw_amx_tile_flops, torch.get_num_threads()
    fn(1000, threads)
    iters = 1000
    while True:
        t = time.perf_counter()
        flops = fn(iters, threads)
        dt = time.perf_counter() - t
        if dt >= seconds:
            return flops / dt / 1e9
        iters *= 4


def stream_read_gbps(buf: torch.Tensor, reps: int = 3) -> float | None:
    """Best read bandwidth (GB/s) of the kernels' own streaming pattern over ``buf`` (bf16,
    CPU, contiguous), or None without the kernels. A probe for roofline measurements."""
    import time

    lib = load()
    if lib is None:
        return None
    n = buf.numel()
    lib.pw_stream_read_bf16(buf.data_ptr(), n, torch.get_num_threads())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        lib.pw_stream_read_bf16(buf.data_ptr(), n, torch.get_num_threads())
        best = min(best, time.perf_counter() - t)
    return n * 2 / best / 1e9
