"""How much of this machine's CPU other work took while phasewise ran: the signal that tells a
step slowed by other load from a step slowed by its own work.

Read from Linux's ``/proc/stat`` (each CPU's busy, idle and steal time) and
``/proc/self/stat`` (this process's own CPU time, all its threads), both in clock ticks, at
the start and the end of a window. Over the window, what the CPUs this process may run on
spent busy less this process's share and less steal is other processes' work. Only those
CPUs count: a container pinned to two of a host's 64 CPUs reads the host's counters, where
two busy neighbours on its own CPUs would be lost among 62 idle ones. The ticks are coarse
(10 ms each, per CPU), so a window shorter than ``MIN_WINDOW_S`` gives no verdict. Elsewhere
than Linux nothing is read and the load is unknown.

Torch-free; imports nothing of phasewise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MIN_WINDOW_S = 0.2  # shorter windows hold too few ticks to say anything
BUSY_SHARE = 0.25  # other processes' share of the CPUs' time above which the run was shared
STEAL_SHARE = 0.10  # the hypervisor's share above which the run was shared


@dataclass(frozen=True)
class CpuSample:
    wall: float  # time.monotonic()
    busy: int  # ticks, summed over the CPUs counted: user, nice, system, irq, softirq, steal
    total: int  # busy + idle + iowait
    steal: int
    own: int  # this process's user + system ticks, and its waited-for children's

    @classmethod
    def now(cls, root: Path = Path("/proc"), cpus: Iterable[int] | None = None
            ) -> CpuSample | None:
        """A sample, or None where /proc does not read as Linux's. ``cpus``: the CPUs counted
        (default: those this process may run on); all of them (the summary line) where
        they include every CPU /proc/stat lists, or none of them."""
        try:
            lines = (root / "stat").read_text().splitlines()
            rows = _cpu_rows(lines, _allowed_cpus() if cpus is None else set(cpus))
            # the process's name (field 2) may hold spaces: count from its closing ")"
            own_fields = (root / "self" / "stat").read_text().rsplit(")", 1)[1].split()
            # user nice system idle iowait irq softirq steal, summed over the rows
            user, nice, system, idle, iowait, irq, softirq, steal = (
                sum(col) for col in zip(*(map(int, row[1:9]) for row in rows), strict=True))
            # utime, stime, cutime, cstime: the children it ran (a compiler) are its work too
            own = sum(int(own_fields[i]) for i in (11, 12, 13, 14))
        except (OSError, ValueError, IndexError):
            return None
        busy = user + nice + system + irq + softirq + steal
        return cls(time.monotonic(), busy, busy + idle + iowait, steal, own)


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on; empty where the system does not say."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set()


def _cpu_rows(lines: list[str], allowed: set[int]) -> list[list[str]]:
    """/proc/stat's rows to sum: the ``cpuN`` rows of ``allowed`` where it leaves some listed
    CPU out, else the summary ``cpu`` row (the first line) alone. Each row has at least the
    eight counters (IndexError otherwise)."""
    per_cpu = {int(f[0][3:]): f for f in (line.split() for line in lines)
               if f and f[0].startswith("cpu") and f[0][3:].isdigit()}
    mine = sorted(allowed & per_cpu.keys())
    rows = [per_cpu[c] for c in mine] if mine and set(per_cpu) - allowed else [lines[0].split()]
    if not rows[0] or not rows[0][0].startswith("cpu") or any(len(r) < 9 for r in rows):
        raise IndexError("not /proc/stat's layout")
    return rows


@dataclass(frozen=True)
class Contention:
    """Shares of the counted CPUs' time over a window (``CpuSample``): other processes' and
    steal's."""

    window_s: float
    others: float
    steal: float

    @classmethod
    def between(cls, a: CpuSample | None, b: CpuSample | None) -> Contention | None:
        """None where either sample is missing or the window is too short to tell."""
        if a is None or b is None or b.wall - a.wall < MIN_WINDOW_S or b.total <= a.total:
            return None
        total = b.total - a.total
        steal = b.steal - a.steal
        others = max(0, (b.busy - a.busy) - steal - (b.own - a.own))
        return cls(b.wall - a.wall, others / total, steal / total)

    @property
    def shared(self) -> bool:
        """Whether other work took enough of the CPUs to explain a slow run."""
        return self.others >= BUSY_SHARE or self.steal >= STEAL_SHARE

    def most_slowdown(self, threads: int | None) -> float | None:
        """The most this share of other work can slow a run of ``threads`` threads, or None
        where it has no bound. One thread gets at least the share of the CPUs others leave:
        1 / that share, taken twice over for margin; slower has a cause beyond the
        contention. Several threads wait at each kernel's end for any that lost its core,
        a scheduler's time slice (milliseconds) per kernel: a step of many short kernels
        can run 100x slower (two threads beside 48% of other work: decode 130x above its
        roofline time, 1.6x on the quiet machine), so no bound is claimed."""
        if threads != 1:
            return None
        return 2.0 / max(0.05, 1.0 - self.others - self.steal)

    def words(self) -> str:
        steal = f", the hypervisor {self.steal:.0%} (steal)" if self.steal >= 0.005 else ""
        return (f"other processes used {self.others:.0%} of this machine's CPU time over "
                f"{self.window_s:.1f} s{steal}")


def fewer_threads(threads: int) -> str:
    """What to try where other work took the CPUs from an engine running ``threads`` (> 1)
    threads: every kernel waits for the slowest of them."""
    return (f"the engine's {threads} threads wait for each other at the end of every kernel, "
            f"so one that loses its core holds up the rest: --threads {threads - 1} may run "
            "faster")
