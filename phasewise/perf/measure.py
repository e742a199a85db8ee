"""``phasewise measure``: this machine's read bandwidth and matmul throughput per dtype,
stored as the ``cpu-local`` (and, with a GPU, ``gpu-local``) accelerator.

torch is imported here, when measuring, never when the analyser is imported.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

from phasewise.perf.hardware import Accelerator, accelerator_from_entry, machine_file


def _best_time(fn: Callable[[], Any], sync: Callable[[], None], reps: int, budget_s: float
               ) -> float:
    fn()
    sync()
    best = float("inf")
    t_start = time.monotonic()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.monotonic() - t_start > budget_s:
            break
    return best


def _matmul_size(torch: Any, dev: Any, dtype: Any, sync: Callable[[], None], n_max: int,
                 target_s: float = 1.0) -> int:
    """The largest square size up to ``n_max`` whose matmul takes about ``target_s`` or less,
    from a 256-cube probe: an emulated dtype (bf16 on a CPU without bf16 units, ~400x below
    fp32) would otherwise spend minutes per repetition at full size."""
    if dev.type == "cuda":
        return n_max  # a small probe there times the launch, not the arithmetic
    n = 256
    a = torch.randn(n, n, device=dev).to(dtype)
    probe = _best_time(lambda: a @ a, sync, 2, 5)
    while n * 2 <= n_max and probe * 8 <= target_s:
        n, probe = n * 2, probe * 8
    return n


def measure_device(device: str, progress: Callable[[str], None], quick: bool = False,
                   dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
                   read_bandwidth: bool = True) -> dict[str, Any]:
    """Read bandwidth (unless ``read_bandwidth`` is False: then it is None) and matmul peaks
    for ``dtypes`` on ``device``."""
    import torch

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    reps = 3 if quick else 10
    # Read bandwidth: sum a tensor far larger than the caches.
    n_bytes = (2 << 30) if dev.type == "cuda" else ((128 if quick else 512) << 20)
    bandwidth = None
    if read_bandwidth:
        x = torch.ones(n_bytes // 4, dtype=torch.float32, device=dev)
        progress(f"{device}: read bandwidth over {n_bytes >> 20} MiB")
        t = _best_time(lambda: x.sum(), sync, reps, 20)
        bandwidth = n_bytes / t
        progress(f"{device}: read {bandwidth / 1e9:.1f} GB/s")
        del x
    peaks: dict[str, float] = {}
    sizes: dict[str, int] = {}
    n_max = 8192 if dev.type == "cuda" else (1024 if quick else 2048)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                        ("fp16", torch.float16)):
        if name not in dtypes or (dev.type == "cpu" and name == "fp16"):
            continue  # CPU fp16 matmul is an emulation, not a peak worth quoting
        n = _matmul_size(torch, dev, dtype, sync, n_max)
        progress(f"{device}: {name} matmul {n}x{n}x{n}")
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        t = _best_time(lambda: a @ b, sync, reps, 20)
        peaks[name] = 2 * n ** 3 / t
        sizes[name] = n
        progress(f"{device}: {name} matmul {peaks[name] / 1e9:.1f} GFLOP/s")
    if dev.type == "cuda":
        mem = torch.cuda.get_device_properties(dev).total_memory
        name = torch.cuda.get_device_name(dev)
    else:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        name = f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
    return {"name": f"{name} (measured)", "peak_flops": peaks, "mem_bytes": float(mem),
            "mem_bandwidth": bandwidth,
            "source": f"measured by phasewise measure on {time.strftime('%Y-%m-%d %H:%M')}",
            "measured": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                         "matmul_n": sizes, "read_bytes": n_bytes, "quick": quick}}


def _progress(msg: str) -> None:
    print(f"measure: {msg}", file=sys.stderr, flush=True)


def measure(out: Path | None = None, quick: bool = False) -> dict[str, Any]:
    import torch

    progress = _progress
    result = {"cpu-local": measure_device("cpu", progress, quick)}
    if torch.cuda.is_available():
        result["gpu-local"] = measure_device("cuda", progress, quick)
    path = out or machine_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = _read_machine_file(path)
    existing.update(result)
    path.write_text(json.dumps(existing, indent=1))
    progress(f"written to {path}")
    return result


_ENTRY_KEYS = {"name", "peak_flops", "mem_bytes", "mem_bandwidth"}


def _read_machine_file(path: Path) -> dict[str, Any]:
    """The machine file's contents; {} when it is missing or unreadable (then rewritten)."""
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def ensure_local(device: str, compute_dtypes: tuple[str, ...],
                 path: Path | None = None) -> Accelerator:
    """This machine's ``cpu-local`` / ``gpu-local`` accelerator with peaks for
    ``compute_dtypes``: from ``phasewise measure``'s file or, when that lacks one, a quick
    measurement of what is missing (a few seconds, with progress), added to the file. A file
    that cannot be written only costs the saving."""
    is_cuda = device.startswith("cuda")
    key = "gpu-local" if is_cuda else "cpu-local"
    path = path or machine_file()
    data = _read_machine_file(path)
    old = data.get(key)
    if not isinstance(old, dict) or not _ENTRY_KEYS <= old.keys() \
            or not isinstance(old["peak_flops"], dict):
        old = {}  # missing or damaged: measured afresh
    missing = tuple(d for d in compute_dtypes if d not in old.get("peak_flops", {}))
    if old and not missing:
        return accelerator_from_entry(key, old, path)
    what = " and ".join(f"{d} matmul" for d in missing)
    _progress(f"no {what} figures for {key} in {path} yet: a quick measurement"
              f"{'' if old else ' of read bandwidth and ' + what} ('phasewise measure' does "
              "the full one)")
    entry = measure_device(device, _progress, quick=True, dtypes=missing,
                           read_bandwidth=not old)
    if old:  # keep what was measured before (a full run's bandwidth); add the new peaks
        entry = {**old, "peak_flops": {**old.get("peak_flops", {}), **entry["peak_flops"]}}
    data[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        _progress(f"written to {path}")
    except OSError as e:
        _progress(f"could not save to {path} ({e}); using the figures for this run only")
    return accelerator_from_entry(key, entry, path)
