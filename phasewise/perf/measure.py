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

from phasewise.perf.hardware import machine_file


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


def measure_device(device: str, progress: Callable[[str], None], quick: bool = False
                   ) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    reps = 3 if quick else 10
    # Read bandwidth: sum a tensor far larger than the caches.
    n_bytes = (2 << 30) if dev.type == "cuda" else ((128 if quick else 512) << 20)
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=dev)
    progress(f"{device}: read bandwidth over {n_bytes >> 20} MiB")
    t = _best_time(lambda: x.sum(), sync, reps, 20)
    bandwidth = n_bytes / t
    del x
    peaks: dict[str, float] = {}
    n = 8192 if dev.type == "cuda" else (1024 if quick else 2048)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                        ("fp16", torch.float16)):
        if dev.type == "cpu" and name == "fp16":
            continue  # CPU fp16 matmul is an emulation, not a peak worth quoting
        progress(f"{device}: {name} matmul {n}x{n}x{n}")
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        t = _best_time(lambda: a @ b, sync, reps, 20)
        peaks[name] = 2 * n ** 3 / t
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
                         "matmul_n": n, "read_bytes": n_bytes}}


def measure(out: Path | None = None, quick: bool = False) -> dict[str, Any]:
    import torch

    def progress(msg: str) -> None:
        print(f"measure: {msg}", file=sys.stderr, flush=True)

    result = {"cpu-local": measure_device("cpu", progress, quick)}
    if torch.cuda.is_available():
        result["gpu-local"] = measure_device("cuda", progress, quick)
    path = out or machine_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing.update(result)
    path.write_text(json.dumps(existing, indent=1))
    progress(f"written to {path}")
    return result
