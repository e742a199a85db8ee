"""``phasewise measure``: this machine's read bandwidth and matmul throughput per dtype,
stored as the ``cpu-local`` (and, with a GPU, ``gpu-local``) accelerator.

Each figure is the best of several runs (the roofline is an upper bound); the runs' band
(slowest to fastest) is stored beside it and printed, so a noisy reading shows as one. A quick
measurement (``--quick``, or the one ``phasewise generate`` makes of what is missing) never
replaces a full one in the machine file.

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

from phasewise.files import write_text_atomic
from phasewise.perf.hardware import (Accelerator, accelerator_from_entry, local_slot,
                                     machine_file)

CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def largest_cache_bytes(root: Path = CPU_CACHE_DIR) -> int | None:
    """The largest cache the first CPU reports in sysfs (``index*/size``, e.g. ``491520K``),
    in bytes; None where it reports none."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = None
    for f in root.glob("index*/size"):
        text = f.read_text().strip()
        try:
            size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
        except (ValueError, KeyError):
            continue
        best = size if best is None else max(best, size)
    return best


def cpu_read_bytes(root: Path = CPU_CACHE_DIR) -> int:
    """How much a CPU read-bandwidth probe reads: twice the largest cache (so that the
    reads come from memory, not from a large L3 that some VMs report: a probe that fits in
    it reads faster than decode ever will), at least 256 MiB and at most 2 GiB, in whole
    MiB; 1 GiB where the caches are not reported."""
    cache = largest_cache_bytes(root)
    if cache is None:
        return 1 << 30
    return min(max(2 * cache, 256 << 20), 2 << 30) // (1 << 20) * (1 << 20)


def cpu_read_times(n_bytes: int, reps: int, budget_s: float = 20.0) -> tuple[list[float], str]:
    """Seconds per read of ``n_bytes`` of CPU memory, by the faster reader, and which: torch's
    sum, or the kernels' own streaming read (the decode GEMV's pattern), over huge-page
    memory (``huge_page_empty``), as the engine keeps its weights; the faster one is the
    bandwidth (the kernels must not look good only because a probe reads slowly)."""
    import torch

    from phasewise.model.cpu import kernels as cpu_kernels
    from phasewise.model.loader import huge_page_empty

    x = huge_page_empty(n_bytes).view(torch.float32).fill_(1.0)
    times, by = _times(lambda: x.sum(), lambda: None, reps, budget_s), "torch's sum"
    lib = cpu_kernels.load()
    if lib is not None:
        n, threads = n_bytes // 2, torch.get_num_threads()
        own = _times(lambda: lib.pw_stream_read_bf16(x.data_ptr(), n, threads), lambda: None,
                     reps, budget_s)
        if min(own) < min(times):
            times, by = own, "phasewise's streaming read"
    return times, by


# A figure is the best of its runs; it is stable when its two best runs agree within this
# fraction. Until they do, up to UNTIL_STABLE_FACTOR times the runs asked for are made
# (within the time budget): one lucky or one unlucky run must not decide a peak.
STABLE_BAND = 0.10
UNTIL_STABLE_FACTOR = 3


def best_two_gap(times: list[float]) -> float | None:
    """How far apart the two fastest runs are, as a fraction of the slower of the two; None
    with fewer than two runs."""
    if len(times) < 2:
        return None
    a, b = sorted(times)[:2]
    return (b - a) / b if b > 0 else 0.0


def _times(fn: Callable[[], Any], sync: Callable[[], None], reps: int, budget_s: float
           ) -> list[float]:
    """Seconds per call of ``fn`` over ``reps`` calls after one warm-up, then more (up to
    ``UNTIL_STABLE_FACTOR * reps``) while its two best disagree by more than
    ``STABLE_BAND``; fewer once ``budget_s`` is spent (at least one)."""
    fn()
    sync()
    times: list[float] = []
    t_start = time.monotonic()
    while len(times) < UNTIL_STABLE_FACTOR * reps:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if time.monotonic() - t_start > budget_s:
            break
        gap = best_two_gap(times)
        if len(times) >= reps and (gap is None or gap <= STABLE_BAND):
            break
    return times


def unstable_reasons(times: dict[str, list[float]], contention: Any) -> dict[str, str]:
    """Per figure, why it cannot be trusted as this machine's peak: its two best runs apart
    by more than ``STABLE_BAND``, or other processes busy on the CPU while it was measured
    (``phasewise.perf.contention``: every run slowed alike looks stable and is not); both,
    where both hold (the load is what explains the gap, and what a reader can act on)."""
    out = {}
    loaded = (f"measured while {contention.words()}"
              if contention is not None and contention.shared else None)
    for name, ts in times.items():
        gap = best_two_gap(ts)
        why = [loaded] if loaded else []
        if gap is not None and gap > STABLE_BAND:
            why.insert(0, f"its two best runs are {gap:.0%} apart")
        if why:
            out[name] = ", ".join(why)
    return out


def _best_time(fn: Callable[[], Any], sync: Callable[[], None], reps: int, budget_s: float
               ) -> float:
    return min(_times(fn, sync, reps, budget_s))


def _rates(work: float, times: list[float]) -> tuple[float, list[float]]:
    """The best rate (``work`` per second of the fastest run) and the band [slowest, fastest]
    over the runs: the figure the roofline uses, and how noisy it was."""
    return work / min(times), [work / max(times), work / min(times)]


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

    from phasewise.perf.contention import Contention, CpuSample

    before = CpuSample.now()
    all_times: dict[str, list[float]] = {}
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    reps = 3 if quick else 10
    # Read bandwidth: sum a tensor far larger than the caches.
    n_bytes = (2 << 30) if dev.type == "cuda" else cpu_read_bytes()
    bandwidth = None
    spread: dict[str, list[float]] = {}  # figure -> [slowest, fastest] over its runs
    runs: dict[str, int] = {}
    read_by = "torch's sum"
    if read_bandwidth:
        progress(f"{device}: read bandwidth over {n_bytes >> 20} MiB")
        if dev.type == "cpu":
            times, read_by = cpu_read_times(n_bytes, reps)
        else:
            x = torch.ones(n_bytes // 4, dtype=torch.float32, device=dev)
            times = _times(lambda: x.sum(), sync, reps, 20)
            del x
        bandwidth, spread["mem_bandwidth"] = _rates(n_bytes, times)
        runs["mem_bandwidth"] = len(times)
        all_times["mem_bandwidth"] = times
        progress(f"{device}: read {bandwidth / 1e9:.1f} GB/s "
                 f"{band(spread['mem_bandwidth'], len(times), 1e9)}")
    peaks: dict[str, float] = {}
    sizes: dict[str, int] = {}
    by: dict[str, str] = {}  # peak -> whose matmul set it, where not torch's
    n_max = 8192 if dev.type == "cuda" else (1024 if quick else 2048)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                        ("fp16", torch.float16)):
        if name not in dtypes or (dev.type == "cpu" and name == "fp16"):
            continue  # CPU fp16 matmul is an emulation, not a peak worth quoting
        n = _matmul_size(torch, dev, dtype, sync, n_max)
        progress(f"{device}: {name} matmul {n}x{n}x{n}")
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        times = _times(lambda: a @ b, sync, reps, 20)
        peaks[name], spread[name] = _rates(2 * n ** 3, times)
        if dev.type == "cpu" and name == "bf16":
            # Where phasewise's AMX kernel runs the engine's bf16 matmuls, its speed is this
            # machine's bf16 peak too: the faster of the two counts (as the engine picks).
            from phasewise.model.cpu import kernels as cpu_kernels
            # Likewise its panels kernel where the CPU has AVX512_BF16 (and no AMX: there the
            # engine packs its projections into panels; a peak of the machine, as the AMX
            # kernel's, also where an engine keeps its rows: a plan without panels, int8).
            own_fn = None
            if cpu_kernels.amx_available():
                bt = b.t().contiguous()  # [N, K]: the kernel's weight layout
                own_fn, own_name = (lambda: cpu_kernels.linear_amx(a, bt),
                                    "phasewise's AMX kernel")
            elif cpu_kernels.avx512bf16_available() and n % 16 == 0:
                bp = cpu_kernels.pack_panels(b.t().contiguous())
                own_fn, own_name = (lambda: cpu_kernels.linear_pk(a, bp),
                                    "phasewise's AVX512_BF16 panels kernel")
            if own_fn is not None:
                own = _times(own_fn, sync, reps, 20)
                rate, own_spread = _rates(2 * n ** 3, own)
                if rate > peaks[name]:
                    peaks[name], spread[name], times = rate, own_spread, own
                    by["bf16"] = own_name
        runs[name] = len(times)
        all_times[name] = times
        sizes[name] = n
        progress(f"{device}: {name} matmul {peaks[name] / 1e9:.1f} GFLOP/s "
                 f"{band(spread[name], len(times), 1e9)}")
    contention = Contention.between(before, CpuSample.now()) if dev.type == "cpu" else None
    unstable = unstable_reasons(all_times, contention)
    for name, why in unstable.items():
        progress(f"{device}: {name.replace('mem_bandwidth', 'read bandwidth')} is unstable: "
                 f"{why}; it is stored as such and measured again before it is relied on")
    conditions: dict[str, Any] = {"loadavg": round(os.getloadavg()[0], 2)
                                  if hasattr(os, "getloadavg") else None}
    if contention is not None:
        conditions.update(others=round(contention.others, 3), steal=round(contention.steal, 3),
                          window_s=round(contention.window_s, 2))
    if dev.type == "cuda":
        mem = torch.cuda.get_device_properties(dev).total_memory
        name = torch.cuda.get_device_name(dev)
    else:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        threads = torch.get_num_threads()
        name = (f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, "
                f"{threads} thread{'s' * (threads != 1)}")
    return {"name": f"{name} (measured)", "peak_flops": peaks, "mem_bytes": float(mem),
            "mem_bandwidth": bandwidth,
            "source": f"measured by phasewise measure on {time.strftime('%Y-%m-%d %H:%M')}",
            "measured": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                         "matmul_n": sizes, "matmul_by": by, "read_bytes": n_bytes,
                         "read_by": read_by if bandwidth is not None else None,
                         "quick": quick,
                         "spread": spread, "runs": runs, "unstable": unstable,
                         "conditions": conditions,
                         "figure_conditions": {n: conditions for n in all_times}}}


def band(spread: list[float] | None, runs: int | None, scale: float) -> str:
    """``[lo–hi over N runs, X% spread]`` for a figure's band (in units of ``scale``)."""
    if not spread or len(spread) != 2:
        return "[no spread recorded]"
    lo, hi = spread
    pct = 100 * (hi - lo) / hi if hi > 0 else 0.0
    over = f" over {runs} run{'s' * (runs != 1)}" if runs else ""
    return f"[{lo / scale:.1f}-{hi / scale:.1f}{over}, {pct:.0f}% spread]"


def format_entry(key: str, entry: dict[str, Any]) -> str:
    """One machine-file entry as ``phasewise measure`` prints it: each figure with its band."""
    m = entry.get("measured") or {}
    spread, runs = m.get("spread") or {}, m.get("runs") or {}
    unstable = m.get("unstable") or {}

    def flag(name: str) -> str:
        return f" (UNSTABLE: {unstable[name]})" if name in unstable else ""

    parts = [f"read {entry['mem_bandwidth'] / 1e9:.1f} GB/s "
             f"{band(spread.get('mem_bandwidth'), runs.get('mem_bandwidth'), 1e9)}"
             + flag("mem_bandwidth")]
    quick_figures = set(m.get("quick_figures", []))
    for name, v in entry["peak_flops"].items():
        parts.append(f"{name} matmul {v / 1e9:.1f} GFLOP/s "
                     f"{band(spread.get(name), runs.get(name), 1e9)}"
                     + (" (quick)" if name in quick_figures else "") + flag(name))
    kind = "quick" if m.get("quick") else "full"
    return f"{key}: {entry['name']} ({kind}): " + "; ".join(parts)


def is_full(entry: Any) -> bool:
    """Whether a machine-file entry is a full ``phasewise measure`` run (not a quick one, nor
    one whose kind is unknown: older files did not record it, and count as full)."""
    return isinstance(entry, dict) and not (entry.get("measured") or {}).get("quick", False)


def _progress(msg: str) -> None:
    print(f"measure: {msg}", file=sys.stderr, flush=True)


def figure_label(name: str) -> str:
    """A machine-file figure's name in words: ``mem_bandwidth`` or a dtype's peak."""
    return "read bandwidth" if name == "mem_bandwidth" else f"{name} matmul"


def figure_value(entry: dict[str, Any], name: str) -> float | None:
    """An entry's ``name`` figure (bytes/s, or a dtype's FLOP/s; None where it has none)."""
    return entry["mem_bandwidth"] if name == "mem_bandwidth" else entry["peak_flops"].get(name)


def figure_rate(value: float, name: str) -> str:
    """``value`` of the ``name`` figure with its unit: ``28.6 GB/s``, ``421.6 GFLOP/s``."""
    return f"{value / 1e9:.1f} {'GB/s' if name == 'mem_bandwidth' else 'GFLOP/s'}"


def keep_stable(old: dict[str, Any], new: dict[str, Any]
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """``new`` (a full measurement) with each figure that it measured unstable where ``old``
    (a full entry) held it stable, or unstable and higher, put back from ``old`` with its band
    and conditions: the figures a busy machine would otherwise overwrite. Returns the entry
    and, for each figure put back, what this run measured and why it was unstable."""
    m_old, m_new = old.get("measured") or {}, new.get("measured") or {}
    old_unstable, new_unstable = m_old.get("unstable") or {}, m_new.get("unstable") or {}
    # between two unstable figures the higher stays (a peak is an upper bound)
    kept = [n for n in new_unstable if figure_value(old, n) is not None
            and (n not in old_unstable or figure_value(old, n) > figure_value(new, n))]
    if not kept:
        return new, {}
    why = {n: f"{figure_rate(figure_value(new, n), n)}, {new_unstable[n]}" for n in kept}
    peaks, bandwidth = dict(new["peak_flops"]), new["mem_bandwidth"]
    measured = {**m_new, "unstable": {**{n: w for n, w in new_unstable.items() if n not in kept},
                                      **{n: old_unstable[n] for n in kept if n in old_unstable}}}
    old_conditions = m_old.get("figure_conditions") or {}
    for field in ("spread", "runs", "figure_conditions"):
        measured[field] = dict(m_new.get(field) or {})
    for n in kept:
        if n == "mem_bandwidth":
            bandwidth = old["mem_bandwidth"]
        else:
            peaks[n] = old["peak_flops"][n]
        for field in ("spread", "runs"):
            measured[field][n] = (m_old.get(field) or {}).get(n)
        measured["figure_conditions"][n] = old_conditions.get(n, m_old.get("conditions"))
    what = ", ".join(map(figure_label, kept))
    source = (f"{new['source']}; {what} kept from an earlier full run "
              f"({str(old.get('source', 'undated')).split('; ')[0]})")
    return {**new, "peak_flops": peaks, "mem_bandwidth": bandwidth, "measured": measured,
            "source": source}, why


def measure(out: Path | None = None, quick: bool = False,
            replace: bool = False) -> dict[str, Any]:
    """Measure this machine (``cpu-local``, and ``gpu-local`` with a GPU) and store it in the
    machine file. A quick measurement never replaces a full one: it is reported, and the
    file keeps the full entry (``phasewise generate`` reads the file, and a quick run's noise
    could flip its verdict on the bound). Nor, unless ``replace``, does a figure a full run
    measured unstable replace the stable one of an earlier full run (``keep_stable``).
    Returns the entries as stored."""
    import torch

    progress = _progress
    path = out or machine_file()
    existing = _read_machine_file(path)
    # the CPU's entry for this thread count (local_slot: cpu-local@Nt beside another count's)
    result = {local_slot("cpu-local", torch.get_num_threads(), existing):
              measure_device("cpu", progress, quick)}
    if torch.cuda.is_available():
        result["gpu-local"] = measure_device("cuda", progress, quick)
    kept = [k for k in result if quick and _complete(existing.get(k))
            and is_full(existing[k])]
    for key in kept:
        progress(f"{key}: kept the full measurement in {path} "
                 f"({existing[key].get('source', 'undated')}); a quick one never replaces it "
                 "(run 'phasewise measure' without --quick for a new full one)")
    new = {k: v for k, v in result.items() if k not in kept}
    for key in list(new):
        if replace or quick or not (_complete(existing.get(key)) and is_full(existing[key])):
            continue
        new[key], figures = keep_stable(existing[key], new[key])
        result[key] = new[key]
        for name, why in figures.items():
            label = figure_label(name)
            was = ("higher unstable" if name in (existing[key].get("measured") or {}).get(
                "unstable", {}) else "stable")
            progress(f"{key}: kept the {was} {label} of the earlier full measurement; this "
                     f"run's was unstable ({why}); 'phasewise measure --replace' stores it "
                     "anyway")
    if new:
        existing.update(new)
        write_text_atomic(path, json.dumps(existing, indent=1))
        progress(f"{', '.join(new)} written to {path}")
    return result


_ENTRY_KEYS = {"name", "peak_flops", "mem_bytes", "mem_bandwidth"}


def _complete(entry: Any) -> bool:
    """Whether a machine-file entry holds every figure the analyser reads, each one usable
    (a damaged one is measured afresh rather than refused)."""
    if not (isinstance(entry, dict) and _ENTRY_KEYS <= entry.keys()
            and isinstance(entry["peak_flops"], dict)):
        return False
    try:
        accelerator_from_entry("entry", entry)
    except ValueError:
        return False
    return True


def _read_machine_file(path: Path) -> dict[str, Any]:
    """The machine file's contents; {} when it is missing or unreadable (then rewritten)."""
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def merge_entry(old: dict[str, Any], new: dict[str, Any], dtypes: tuple[str, ...],
                read: bool) -> dict[str, Any]:
    """``old`` with ``new``'s figures for ``dtypes`` (and its read bandwidth where ``read``):
    a figure measured again replaces an unstable one where it is stable; where both are
    unstable the higher stays (a peak is an upper bound) and stays marked unstable; a stable
    figure is never replaced by an unstable one."""
    m_old, m_new = old.get("measured") or {}, new.get("measured") or {}
    unstable = dict(m_old.get("unstable") or {})
    new_unstable = m_new.get("unstable") or {}
    peaks, bandwidth = dict(old["peak_flops"]), old["mem_bandwidth"]
    spread, runs = dict(m_old.get("spread") or {}), dict(m_old.get("runs") or {})
    # Each figure keeps the conditions it was measured in (a figure kept from an earlier
    # run was not measured in this one's); "conditions" is the newest run's.
    figure_conditions = dict(m_old.get("figure_conditions") or {
        n: m_old.get("conditions") for n in [*old["peak_flops"], "mem_bandwidth"]})
    taken = []
    names = [*dtypes, *(("mem_bandwidth",) if read else ())]
    for name in names:
        value = figure_value(new, name)
        before = bandwidth if name == "mem_bandwidth" else peaks.get(name)
        stable_now = name not in new_unstable
        if before is None or stable_now or (name in unstable and value > before):
            if name == "mem_bandwidth":
                bandwidth = value
            else:
                peaks[name] = value
            taken.append(name)
            spread[name] = (m_new.get("spread") or {}).get(name)
            runs[name] = (m_new.get("runs") or {}).get(name)
            figure_conditions[name] = m_new.get("conditions")
        if stable_now:
            unstable.pop(name, None)
        elif name in unstable or name in taken:  # a kept stable figure stays stable
            unstable[name] = new_unstable[name]
    measured = {**m_old, "spread": spread, "runs": runs, "unstable": unstable,
                "conditions": m_new.get("conditions"), "figure_conditions": figure_conditions,
                "quick_figures": sorted({*m_old.get("quick_figures", []),
                                         *(n for n in taken if n != "mem_bandwidth")})}
    source = str(old.get("source", "")).split("; ")[0]  # (the full measurement's words)
    if taken:  # where a figure now comes from, as roofline --list and calibrate cite it
        what = ", ".join(map(figure_label, taken))
        source += f"; {what} measured again quickly on {time.strftime('%Y-%m-%d %H:%M')}"
    return {**old, "peak_flops": peaks, "mem_bandwidth": bandwidth, "measured": measured,
            "source": source}


def ensure_local(device: str, compute_dtypes: tuple[str, ...],
                 path: Path | None = None) -> Accelerator:
    """This machine's ``cpu-local`` / ``gpu-local`` accelerator with peaks for
    ``compute_dtypes``: from ``phasewise measure``'s file or, when that lacks one, a quick
    measurement of what is missing (a few seconds, with progress), added to the file. A file
    that cannot be written only costs the saving."""
    import torch

    is_cuda = device.startswith("cuda")
    path = path or machine_file()
    data = _read_machine_file(path)
    # the peaks at the threads this process runs (local_slot), under their own entry
    local = "gpu-local" if is_cuda else "cpu-local"
    key = local_slot(local, torch.get_num_threads(), data)  # (gpu-local: itself)
    old = data.get(key)
    if not _complete(old):
        old = {}  # missing or damaged: measured afresh
    missing = tuple(d for d in compute_dtypes if d not in old.get("peak_flops", {}))
    was_unstable = (old.get("measured") or {}).get("unstable") or {}
    redo = tuple(d for d in compute_dtypes if d in was_unstable and d not in missing)
    redo_read = bool(old) and "mem_bandwidth" in was_unstable
    if old and not missing and not redo and not redo_read:
        return accelerator_from_entry(local, old, path)
    if missing:
        what = " and ".join(f"{d} matmul" for d in missing)
        _progress(f"no {what} figures for {key} in {path} yet: a quick measurement"
                  f"{'' if old else ' of read bandwidth and ' + what} ('phasewise measure' "
                  "does the full one)")
    for name in (*redo, *(("mem_bandwidth",) if redo_read else ())):
        _progress(f"{key}: the stored {name.replace('mem_bandwidth', 'read bandwidth')} is "
                  f"unstable ({was_unstable[name]}): measured again")
    entry = measure_device(device, _progress, quick=True, dtypes=missing + redo,
                           read_bandwidth=not old or redo_read)
    if old:
        measured_now = entry
        entry = merge_entry(old, entry, missing + redo, redo_read)
        for name in (*redo, *(("mem_bandwidth",) if redo_read else ())):
            now, kept = figure_value(measured_now, name), figure_value(entry, name)
            if kept != now:  # both unstable: the higher stays, as merge_entry says
                _progress(f"{key}: kept the stored {figure_label(name)} "
                          f"{figure_rate(kept, name)}, higher than this run's "
                          f"{figure_rate(now, name)} (both unstable: a peak is the highest "
                          "seen)")
    data[key] = entry
    try:
        write_text_atomic(path, json.dumps(data, indent=1))
        _progress(f"written to {path}")
    except OSError as e:
        _progress(f"could not save to {path} ({e}); using the figures for this run only")
    return accelerator_from_entry(local, entry, path)
