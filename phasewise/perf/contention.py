"""How much of this machine's CPU other work took while phasewise ran: the signal that tells a
step slowed by other load from a step slowed by its own work.

Read from Linux's ``/proc/stat`` (every CPU's busy, idle and steal time) and
``/proc/self/stat`` (this process's own CPU time, all its threads), both in clock ticks, at
the start and the end of a window. Over the window, what the machine's CPUs spent busy less
this process's share and less steal is other processes' work. The ticks are coarse (10 ms
each, per CPU), so a window shorter than ``MIN_WINDOW_S`` gives no verdict. Elsewhere than
Linux nothing is read and the load is unknown.

Torch-free; imports nothing of phasewise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

MIN_WINDOW_S = 0.2  # shorter windows hold too few ticks to say anything
BUSY_SHARE = 0.25  # other processes' share of all CPU time above which the run was shared
STEAL_SHARE = 0.10  # the hypervisor's share above which the run was shared


@dataclass(frozen=True)
class CpuSample:
    wall: float  # time.monotonic()
    busy: int  # ticks, all CPUs: user, nice, system, irq, softirq, steal
    total: int  # busy + idle + iowait
    steal: int
    own: int  # this process's user + system ticks, and its waited-for children's

    @classmethod
    def now(cls, root: Path = Path("/proc")) -> CpuSample | None:
        """A sample, or None where /proc does not read as Linux's."""
        try:
            fields = (root / "stat").read_text().split("\n", 1)[0].split()
            # the process's name (field 2) may hold spaces: count from its closing ")"
            own_fields = (root / "self" / "stat").read_text().rsplit(")", 1)[1].split()
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[1:9])
            # utime, stime, cutime, cstime: the children it ran (a compiler) are its work too
            own = sum(int(own_fields[i]) for i in (11, 12, 13, 14))
        except (OSError, ValueError, IndexError):
            return None
        busy = user + nice + system + irq + softirq + steal
        return cls(time.monotonic(), busy, busy + idle + iowait, steal, own)


@dataclass(frozen=True)
class Contention:
    """Shares of all the machine's CPU time over a window: other processes' and steal's."""

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

    def words(self) -> str:
        steal = f", the hypervisor {self.steal:.0%} (steal)" if self.steal >= 0.005 else ""
        return (f"other processes used {self.others:.0%} of this machine's CPU time over "
                f"{self.window_s:.1f} s{steal}")
