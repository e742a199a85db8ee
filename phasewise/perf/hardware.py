"""Accelerators and links for the roofline analyser, each number beside its source.

Peak FLOP/s are dense (not the sparsity-doubled figures datasheets often lead with). The
``cpu-local`` / ``gpu-local`` entries are this machine, as ``phasewise measure`` measured it
(see ``phasewise/perf/measure.py``); they are read from the file it writes. A CPU's peaks
depend on the threads that reach them: figures measured at another thread count than the
file's ``cpu-local`` are kept as ``cpu-local@Nt`` (``local_slot``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

T = 1e12
G = 1e9


@dataclass(frozen=True)
class Link:
    key: str
    name: str
    bandwidth: float  # bytes/s, one direction
    source: str
    latency_s: float = 0.0

    def as_dict(self) -> dict:
        return {"key": self.key, "name": self.name, "bandwidth_Bps": self.bandwidth,
                "latency_s": self.latency_s, "source": self.source}


@dataclass(frozen=True)
class Accelerator:
    key: str
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s (int8: OP/s)
    mem_bytes: float
    mem_bandwidth: float  # bytes/s
    interconnect: str | None  # a LINKS key
    source: str
    notes: str = ""
    measured: dict = field(default_factory=dict)

    def peak_flops_for(self, dtype: str) -> float:
        d = {"fp16": "bf16"}.get(dtype, dtype) if dtype not in self.peak_flops else dtype
        if d not in self.peak_flops:
            hint = ("; 'phasewise measure' measures fp32, bf16 and fp16"
                    if self.key.startswith(("cpu-local", "gpu-local"))
                    and dtype in ("fp32", "bf16", "fp16") else "")
            raise ValueError(f"{self.name} has no {dtype} figure; it has "
                             f"{', '.join(sorted(self.peak_flops))}{hint}")
        return self.peak_flops[d]

    def as_dict(self) -> dict:
        return {"key": self.key, "name": self.name, "peak_flops": dict(self.peak_flops),
                "mem_bytes": self.mem_bytes, "mem_bandwidth_Bps": self.mem_bandwidth,
                "interconnect": self.interconnect, "source": self.source, "notes": self.notes}


def _acc(key, name, *, fp32, bf16, fp8=None, int8=None, mem_gb, bw_tbs, link, source,
         notes="") -> Accelerator:
    peak = {"bf16": bf16 * T}
    if fp32 is not None:
        peak["fp32"] = fp32 * T
    if fp8 is not None:
        peak["fp8"] = fp8 * T
    if int8 is not None:
        peak["int8"] = int8 * T
    return Accelerator(key, name, peak, mem_gb * G, bw_tbs * T, link, source, notes)


ACCELERATORS: dict[str, Accelerator] = {a.key: a for a in [
    _acc("h100-sxm", "NVIDIA H100 SXM5 80GB", fp32=67, bf16=989.4, fp8=1978.9, int8=1978.9,
         mem_gb=80, bw_tbs=3.35, link="nvlink4",
         source="NVIDIA H100 Tensor Core GPU datasheet (SXM column; tensor figures halved "
                "from the with-sparsity values)"),
    _acc("h100-pcie", "NVIDIA H100 PCIe 80GB", fp32=51, bf16=756, fp8=1513, int8=1513,
         mem_gb=80, bw_tbs=2.0, link="pcie5",
         source="NVIDIA H100 Tensor Core GPU datasheet (PCIe column; dense)"),
    _acc("h200", "NVIDIA H200 SXM 141GB", fp32=67, bf16=989.4, fp8=1978.9, int8=1978.9,
         mem_gb=141, bw_tbs=4.8, link="nvlink4",
         source="NVIDIA H200 Tensor Core GPU datasheet (SXM column; dense)"),
    _acc("b200", "NVIDIA B200 SXM 180GB (HGX B200, 1,000 W)", fp32=75, bf16=2250, fp8=4500,
         int8=4500, mem_gb=180, bw_tbs=7.7, link="nvlink5",
         source="NVIDIA HGX B200 specifications table (per GPU: FP8 9 PF, BF16 4.5 PF with "
                "sparsity, halved here; FP32 75 TF; 180 GB; 7.7 TB/s)",
         notes="GB200 parts run faster (BF16 2.5 PF dense, 8 TB/s); 8 TB/s is often quoted "
               "for B200 but the HGX table gives 7.7"),
    _acc("a100-40gb", "NVIDIA A100 SXM4 40GB", fp32=19.5, bf16=312, int8=624, mem_gb=40,
         bw_tbs=1.555, link="nvlink3",
         source="NVIDIA A100 Tensor Core GPU datasheet (40GB SXM; dense)"),
    _acc("a100-80gb", "NVIDIA A100 SXM4 80GB", fp32=19.5, bf16=312, int8=624, mem_gb=80,
         bw_tbs=2.039, link="nvlink3",
         source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM; dense)"),
    _acc("l40s", "NVIDIA L40S 48GB", fp32=91.6, bf16=362.05, fp8=733, int8=733, mem_gb=48,
         bw_tbs=0.864, link="pcie4",
         source="NVIDIA L40S GPU datasheet (dense: half the with-sparsity figures)"),
    _acc("l4", "NVIDIA L4 24GB", fp32=30.3, bf16=121, fp8=242.5, int8=242.5, mem_gb=24,
         bw_tbs=0.300, link="pcie4",
         source="NVIDIA L4 Tensor Core GPU datasheet (dense: half the with-sparsity figures)"),
    _acc("a10g", "NVIDIA A10G 24GB (AWS G5)", fp32=31.2, bf16=125, int8=250, mem_gb=24,
         bw_tbs=0.600, link="pcie4",
         source="memory: AWS EC2 G5 documentation (24 GB, 600 GB/s); compute: NVIDIA A10 "
                "datasheet (dense), as an upper bound",
         notes="NVIDIA publishes no A10G peaks; its tensor throughput is below the A10's, so "
               "compute-bound predictions here are optimistic"),
    _acc("mi300x", "AMD Instinct MI300X 192GB", fp32=163.4, bf16=1307.4, fp8=2614.9,
         int8=2614.9, mem_gb=192, bw_tbs=5.3, link="infinity-fabric",
         source="AMD Instinct MI300X accelerator data sheet (dense figures, as quoted from it; "
                "int8 assumed equal to fp8)"),
    _acc("tpu-v5e", "Google Cloud TPU v5e (per chip)", fp32=None, bf16=197, int8=393,
         mem_gb=16, bw_tbs=0.819, link="ici-v5e",
         source="Google Cloud TPU v5e documentation (system architecture: per-chip specs)",
         notes="no fp32 matrix peak is published"),
]}

LINKS: dict[str, Link] = {link.key: link for link in [
    Link("nvlink3", "NVLink 3 (A100), 600 GB/s total, 300 GB/s each way", 300 * G,
         "NVIDIA A100 Tensor Core GPU datasheet", 2e-6),
    Link("nvlink4", "NVLink 4 (H100/H200), 900 GB/s total, 450 GB/s each way", 450 * G,
         "NVIDIA H100 Tensor Core GPU datasheet", 2e-6),
    Link("nvlink5", "NVLink 5 (B200), 1.8 TB/s total, 900 GB/s each way", 900 * G,
         "NVIDIA DGX B200 datasheet", 2e-6),
    Link("infinity-fabric", "AMD Infinity Fabric (MI300X), 896 GB/s aggregate",
         448 * G, "AMD Instinct MI300X data sheet as quoted (7 links x 128 GB/s aggregate); "
         "half each way assumed", 2e-6),
    Link("ici-v5e", "TPU v5e inter-chip interconnect, 400 GB/s per chip both ways", 200 * G,
         "Google Cloud TPU v5e documentation (bidirectional ICI bandwidth per chip; half "
         "each way assumed)", 5e-6),
    Link("pcie4", "PCIe Gen4 x16, 31.5 GB/s each way", 31.5 * G,
         "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b", 5e-6),
    Link("pcie5", "PCIe Gen5 x16, 63 GB/s each way", 63 * G,
         "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b", 5e-6),
    Link("ib-hdr", "InfiniBand HDR 200 Gb/s", 25 * G, "NVIDIA ConnectX-6 / HDR InfiniBand "
         "product brief (200 Gb/s per port)", 5e-6),
    Link("ib-ndr", "InfiniBand NDR 400 Gb/s", 50 * G, "NVIDIA ConnectX-7 / NDR InfiniBand "
         "product brief (400 Gb/s per port)", 5e-6),
    Link("100gbe", "100 Gigabit Ethernet", 12.5 * G, "IEEE 802.3 (100 Gb/s)", 20e-6),
    Link("25gbe", "25 Gigabit Ethernet", 3.125 * G, "IEEE 802.3by (25 Gb/s)", 20e-6),
]}


def machine_file() -> Path:
    """Where ``phasewise measure`` keeps this machine's figures (read at call time)."""
    root = os.environ.get("PHASEWISE_CACHE_DIR") or Path.home() / ".cache" / "phasewise"
    return Path(root) / "machine.json"


def local_slot(key: str, threads: int | None, data: Any) -> str:
    """The machine file's entry for ``key`` measured at ``threads`` CPU threads: ``key``
    itself where it is free, was measured at that count, or no count is asked for; else
    ``key@Nt``. A CPU's peaks depend on the threads that reach them: figures from 2 threads
    would rate a 1-thread engine's steps against twice the arithmetic it has."""
    if threads is None or key != "cpu-local" or not isinstance(data, dict):
        return key
    entry = data.get(key)
    measured = entry.get("measured") if isinstance(entry, dict) else None
    had = measured.get("threads") if isinstance(measured, dict) else None
    return key if entry is None or had is None or had == threads else f"{key}@{threads}t"


def load_local(key: str = "cpu-local", path: Path | None = None,
               threads: int | None = None) -> Accelerator:
    """``key``'s stored figures (``cpu-local@Nt``: those measured at N threads); with
    ``threads``, those measured at that count (``local_slot``)."""
    path = path or machine_file()
    if not path.exists():
        raise ValueError(f"{key} is this machine as measured: run 'phasewise measure' first "
                         f"(it writes {path})")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}); run 'phasewise measure' again") from e
    slot = local_slot(key, threads, data)
    entry = data.get(slot) if isinstance(data, dict) else None
    if entry is None:
        raise ValueError(f"{path} holds no {slot!r} entry; run 'phasewise measure'"
                         + (f" with {threads} threads (--threads {threads})"
                            if slot != key else ""))
    return accelerator_from_entry(key, entry, path)


def accelerator_from_entry(key: str, entry: dict, path: Path | None = None) -> Accelerator:
    """An ``Accelerator`` from one machine-file entry (as ``phasewise measure`` writes it);
    a damaged entry (a missing field, a figure that is not a finite number > 0) raises
    ValueError naming the file."""
    try:
        peaks = {str(k): float(v) for k, v in entry["peak_flops"].items()}
        mem, bw = float(entry["mem_bytes"]), float(entry["mem_bandwidth"])
        if not peaks or not all(0 < v < math.inf for v in (*peaks.values(), mem, bw)):
            raise ValueError("its peaks, memory and bandwidth must be finite numbers > 0")
        measured = entry.get("measured", {})
        if not isinstance(measured, dict):
            raise TypeError(f"measured must be an object, got a {type(measured).__name__}")
        return Accelerator(key, str(entry["name"]), peaks, mem, bw, None,
                           str(entry.get("source", f"measured by phasewise measure ({path})")),
                           str(entry.get("notes", "")), measured)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{path or 'the machine file'}: its {key!r} entry is damaged "
                         f"({type(e).__name__}: {e}); run 'phasewise measure' again") from None


def lookup_accelerator(key: str) -> Accelerator:
    k = key.lower()
    if k in ("cpu-local", "gpu-local") or re.fullmatch(r"cpu-local@[0-9]+t", k):
        return load_local(k)
    if k in ACCELERATORS:
        return ACCELERATORS[k]
    raise ValueError(f"unknown accelerator {key!r}; choose one of "
                     f"{', '.join(ACCELERATORS)}, cpu-local, gpu-local")


def lookup_link(key: str) -> Link:
    k = key.lower()
    if k in LINKS:
        return LINKS[k]
    raise ValueError(f"unknown link {key!r}; choose one of {', '.join(LINKS)}")


INSTANT = "instant"  # simulate/plan --link: K/V arrives at once, the fixed hand-off cost aside


def sim_link(key: str | None) -> Link | None:
    """A simulated P/D deployment's K/V link: None (``instant``, the default) or a catalog
    link."""
    if key is None or key.lower() == INSTANT:
        return None
    k = key.lower()
    if k in LINKS:
        return LINKS[k]
    raise ValueError(f"unknown link {key!r}; choose {INSTANT} or one of {', '.join(LINKS)}")
