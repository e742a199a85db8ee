"""What this CPU is, read once: its model, vendor, feature flags, the ISA families phasewise's
kernels are built for, and how many cores this process may use.

``capabilities()`` reads /proc/cpuinfo and the process's CPU affinity the first time it is
called and keeps the answer (a frozen ``CpuCapabilities``) for the process's life: every
decision that depends on the CPU (which kernels compile and load, the kernel plan's rule, a
stored plan's key) reads the same record. What actually *runs* also depends on the compiler
and the kernel (AMX needs Linux to grant the tile state): ``kernels.KERNELS`` says that once
loaded; this module only says what the CPU offers.

No torch here: the CLI and the plan files read it cheaply.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

from phasewise.config import usable_cores

# The flags that pick a kernel or change a plan's timings: a stored plan's key holds these
# (not the whole flag list, whose hypervisor and microcode bits vary between hosts of one CPU).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
             "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
AVX2_FLAGS = frozenset({"avx2", "fma"})
AVX512BF16_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
AMX_FLAGS = AVX512BF16_FLAGS | {"amx_tile", "amx_bf16"}


def isa_family(flags) -> str:
    """The widest kernel family a set of CPU flags offers, as files and profiles name it:
    ``amx``, ``avx512bf16``, ``avx2`` or ``base``. Stored kernel plans and cost profiles both
    carry it in their file names, so one CPU must map to one name in both."""
    f = set(flags)
    return ("amx" if AMX_FLAGS <= f else "avx512bf16" if AVX512BF16_FLAGS <= f
            else "avx2" if AVX2_FLAGS <= f else "base")


@dataclass(frozen=True)
class CpuCapabilities:
    """One CPU as the kernels see it. ``flags``: every feature flag /proc/cpuinfo lists (empty
    off x86-64); ``cores``: the CPUs this process may run on (its affinity)."""

    vendor: str  # GenuineIntel, AuthenticAMD; "" when unknown
    model_name: str  # /proc/cpuinfo's "model name", or the platform's processor name
    flags: frozenset[str]
    cores: int

    @property
    def avx2(self) -> bool:
        """AVX2 with FMA: the base every phasewise kernel needs."""
        return AVX2_FLAGS <= self.flags

    @property
    def avx512bf16(self) -> bool:
        """AVX512_BF16 with AVX-512 F/BW/VL/DQ: the dot-product and panels kernels."""
        return AVX512BF16_FLAGS <= self.flags

    @property
    def amx(self) -> bool:
        """AMX-BF16 tiles (with the AVX-512 they are driven by)."""
        return AMX_FLAGS <= self.flags

    @property
    def isa(self) -> tuple[str, ...]:
        """The flags of ISA_FLAGS this CPU has, in that order (a stored plan's key)."""
        return tuple(f for f in ISA_FLAGS if f in self.flags)

    @property
    def families(self) -> tuple[str, ...]:
        """The kernel families the CPU offers, widest last: ``avx2``, ``avx512bf16``,
        ``amx``."""
        return tuple(name for name, ok in (("avx2", self.avx2), ("avx512bf16", self.avx512bf16),
                                           ("amx", self.amx)) if ok)

    def describe(self) -> str:
        fam = ", ".join(self.families) or "no AVX2/FMA"
        return f"{self.model_name or 'unknown CPU'} ({fam}; {self.cores} cores)"


def _cpuinfo(text: str) -> dict[str, str]:
    """The first value of each key in /proc/cpuinfo's text (the first processor's block)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() not in out:
            out[name.strip()] = value.strip()
    return out


def read_capabilities(cpuinfo: str | None = None, machine: str | None = None,
                      cores: int | None = None) -> CpuCapabilities:
    """This CPU's record from ``cpuinfo`` (/proc/cpuinfo's text; read from the file when
    None), ``machine`` (``platform.machine()``) and ``cores`` (the affinity's size)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    info = _cpuinfo(cpuinfo)
    machine = (machine or platform.machine()).lower()
    flags = frozenset(info.get("flags", "").split()) if machine in ("x86_64", "amd64") \
        else frozenset()
    if cores is None:
        cores = usable_cores()
    return CpuCapabilities(vendor=info.get("vendor_id", ""),
                           model_name=info.get("model name", "") or platform.processor(),
                           flags=flags, cores=cores)


@functools.lru_cache(maxsize=1)
def capabilities() -> CpuCapabilities:
    """This CPU, read once per process."""
    return read_capabilities()
