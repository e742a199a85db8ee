"""Build, load and call the hand-written CPU kernels in ``cpu_kernels.c``.

The C file is compiled on first use with the system's C compiler (gcc or cc) into a cache
folder and loaded with ctypes; no torch headers are needed, so the build takes about a second.
On a machine without a compiler or without AVX2/FMA, ``load()`` returns None and callers fall
back to torch.

Cache folder: ``$PHASEWISE_CACHE_DIR`` or ``$XDG_CACHE_HOME/phasewise`` or
``~/.cache/phasewise`` (read when a kernel is first needed, never at import).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
LIBS = ["-lm"]

# Most rows the fused decode layer takes (ROW_STREAM_MAX in cpu_kernels.c).
DECODE_LAYER_MAX_ROWS = 6


class DecodeLayerArgs(ctypes.Structure):
    """Mirror of ``DecodeLayer`` in cpu_kernels.c (same fields, same order)."""

    _fields_ = (
        [(n, ctypes.c_int) for n in ("M", "H", "Q", "KV", "I", "n_heads", "n_kv", "hd", "bs",
                                      "max_blocks", "qk_norm", "nthreads")]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
        + [(n, ctypes.c_void_p) for n in (
            "hidden", "delta", "out", "w_in_norm", "w_qkv", "b_qkv", "w_q_norm", "w_k_norm",
            "w_o", "b_o", "w_post_norm", "w_gate_up", "b_gate_up", "w_down", "b_down",
            "k_cache", "v_cache", "slots", "block_tables", "seq_lens", "cos", "sin")]
    )


_lib: ctypes.CDLL | None = None
_tried = False
unavailable_reason: str | None = None


def cache_dir() -> Path:
    root = os.environ.get("PHASEWISE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "phasewise"


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        return False
    return False


def _build(out: Path) -> None:
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, *LIBS], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, out)  # atomic: concurrent builders never see a half-written file
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"compiling {SOURCE.name} failed: {e.stderr.strip()[:500]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it if needed; None if it cannot be had."""
    global _lib, _tried, unavailable_reason
    if _tried:
        return _lib
    _tried = True
    if not _cpu_has_avx2_fma():
        unavailable_reason = "this CPU lacks AVX2/FMA"
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    try:
        if not path.exists():
            print(f"compiling phasewise's CPU kernels (once; cached in {path.parent})",
                  file=sys.stderr, flush=True)
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as e:
        unavailable_reason = str(e)
        return None
    P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    signatures = {
        "pw_linear_bf16": (I, [P, P, P, P, I, I, I, I]),
        "pw_gemm_bf16": (I, [P, P, P, P, I, I, I, I]),
        "pw_add_rmsnorm_bf16": (None, [P, P, P, P, I, I, F, I]),
        "pw_silu_mul_bf16": (None, [P, P, I, I, I]),
        "pw_rope_bf16": (None, [P, L, P, P, I, I, I]),
        "pw_decode_attention_bf16": (I, [P, L, P, P, P, I, P, P, I, I, I, I, I, F, I]),
        "pw_decode_layer_bf16": (I, [ctypes.POINTER(DecodeLayerArgs)]),
        "pw_stream_read_bf16": (F, [P, L, I]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    _lib = lib
    return lib


def _call(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
          ) -> torch.Tensor:
    lib = load()
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason}")
    k = x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m:
        rc = getattr(lib, name)(x2.data_ptr(), w.data_ptr(),
                                bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                m, n, k, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"{name} could not allocate scratch memory")
    return y.view(*x.shape[:-1], n)


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
