"""Whether a busy machine changes what the first ``phasewise generate`` says about the bound.

The first ``generate`` on a machine measures the peaks it lacks (a quick ``phasewise
measure``) and closes with ``[roofline]`` / ``[bound]`` lines: which phase was compute-bound
and which memory-bound. Measured while other processes hold the CPUs, those peaks are low,
and a verdict drawn from them could flip. This script runs that first ``generate`` on the
bundled model (greedy, a short prompt, a few tokens) twice, each time with a machine file
that starts absent: on the machine as it is ("quiet"), then with one busy Python loop per
core this process may use (``harness.cpu_hogs``, stopped by PID however the run ends).

It prints, per condition, the load (other processes' share of the CPUs while the peaks were
measured, and the load average), each figure stored (and whether it is stored unstable, and
why) and the verdict lines; then, per phase, the quiet verdict beside the busy one. PASS where
every busy verdict names the quiet one's bound or says "either bound" (the verdict is within
the noise of unstable peaks); FAIL otherwise, with exit status 1.

    .venv/bin/python -m benchmarks.busy_machine [--prompt TEXT] [--max-tokens 16]
                                                [--model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import PW, cpu_hogs, fresh_machine_file, log, peak_words, print_machine

# "prefill was memory-bound", or "... by 1.20x, within the noise of this machine's unstable
# peaks (x2.00): either bound" (phasewise/perf/explain.py's verdict)
VERDICT = re.compile(r"(prefill|decode) was (compute|memory)-bound"
                     r"(?: by [\d.]+x, within the noise of [^:]*: (either bound))?")


@dataclass
class Run:
    """One ``generate`` and what it left: the machine file's entries, its closing lines."""

    condition: str
    rc: int
    entries: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)  # [roofline] / [bound]
    unstable_said: list[str] = field(default_factory=list)  # its "... is unstable" lines
    stderr: str = ""

    def verdicts(self) -> dict[str, tuple[str, bool]]:
        """Per phase: (its bound, whether the verdict says "either bound")."""
        out: dict[str, tuple[str, bool]] = {}
        for line in self.lines:
            if line.startswith("[bound]") and "on this machine" in line:
                for phase, bound, either in VERDICT.findall(line):
                    out[phase] = (bound, bool(either))
        return out


def generate(condition: str, prompt: str, max_tokens: int, model: str | None) -> Run:
    """The first ``phasewise generate`` with a machine file that starts absent."""
    cmd = [*PW, "generate", prompt, "--max-tokens", str(max_tokens), "--temperature", "0",
           *(["--model", model] if model else [])]
    with fresh_machine_file() as (env, path):
        log(f"{condition}: {' '.join(cmd[2:])} (machine file {path})")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        entries = json.loads(path.read_text()) if path.exists() else {}
    err = proc.stderr.splitlines()
    return Run(condition, proc.returncode, entries,
               [ln for ln in err if ln.startswith(("[roofline]", "[bound]"))],
               [ln for ln in err if ln.startswith("measure:") and "unstable" in ln],
               proc.stderr)


def figure_rows(entry: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, value, how it is stored) for each figure of a machine-file entry."""
    unstable = (entry.get("measured") or {}).get("unstable") or {}

    def stored(name: str) -> str:
        return f"UNSTABLE: {unstable[name]}" if name in unstable else "stable"

    rows = []
    if entry.get("mem_bandwidth") is not None:
        rows.append((peak_words("mem_bandwidth"), f"{entry['mem_bandwidth'] / 1e9:.1f} GB/s",
                     stored("mem_bandwidth")))
    for name, v in (entry.get("peak_flops") or {}).items():
        rows.append((peak_words(name), f"{v / 1e9:.1f} GFLOP/s", stored(name)))
    return rows


def load_text(entry: dict[str, Any]) -> str:
    cond = (entry.get("measured") or {}).get("conditions") or {}
    others = cond.get("others")
    share = f"others {others:.0%} of the CPUs" if others is not None else "others unknown"
    return f"{share} while measured; load avg {cond.get('loadavg', '-')}"


def print_run(run: Run) -> None:
    print(f"\n== {run.condition}" + (f" (generate exited {run.rc})" if run.rc else ""))
    if not run.entries:
        print("  no machine file was written")
    for key, entry in run.entries.items():
        print(f"  {key}: {load_text(entry)}")
        print(f"    {'figure':<16}{'value':>18}  stored as")
        for name, value, how in figure_rows(entry):
            print(f"    {name:<16}{value:>18}  {how}")
    for line in run.unstable_said:
        print(f"  {line}")
    for line in run.lines:
        print(f"  {line}")
    if run.rc:
        print("  " + "\n  ".join(run.stderr.splitlines()[-15:]))


def judge(quiet: Run, busy: Run) -> tuple[bool, list[str]]:
    """Whether every busy verdict is the quiet one's bound or says "either bound", and the
    comparison's lines."""
    q, b = quiet.verdicts(), busy.verdicts()
    lines = [f"{'phase':<9}{'quiet':<34}{'busy':<34}agrees"]
    ok = bool(q) and quiet.rc == 0 and busy.rc == 0

    def words(v: tuple[str, bool] | None) -> str:
        return "-" if v is None else f"{v[0]}-bound" + (", either bound" if v[1] else "")

    for phase in sorted(set(q) | set(b), key=["prefill", "decode"].index):
        qv, bv = q.get(phase), b.get(phase)
        if qv is None or bv is None:
            agrees = "no (a verdict is missing)"
        elif bv[1]:
            agrees = "says either bound"
        elif bv[0] == qv[0]:
            agrees = "same bound"
        else:
            agrees = "NO: the bound flipped with no caveat"
        ok = ok and not agrees.lower().startswith("no")
        lines.append(f"{phase:<9}{words(qv):<34}{words(bv):<34}{agrees}")
    return ok, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the bundled)")
    ap.add_argument("--out", type=Path, default=None, help="write the runs here as JSON")
    a = ap.parse_args()
    print_machine()
    quiet = generate("quiet (the machine as it is)", a.prompt, a.max_tokens, a.model)
    with cpu_hogs() as hogs:
        busy = generate(f"busy ({len(hogs)} busy processes, one per core)", a.prompt,
                        a.max_tokens, a.model)
    for run in (quiet, busy):
        print_run(run)
    ok, lines = judge(quiet, busy)
    print("\n" + "\n".join(lines))
    from phasewise.perf.contention import BUSY_SHARE

    quiet_others = [((e.get("measured") or {}).get("conditions") or {}).get("others") or 0.0
                    for e in quiet.entries.values()]
    if any(o >= BUSY_SHARE for o in quiet_others):
        print(f"note: the quiet run was not quiet (other processes held {max(quiet_others):.0%}"
              " of the CPUs while it measured): its verdicts are a busy machine's too")
    busy_unstable = bool(busy.entries) and all((e.get("measured") or {}).get("unstable")
                                               for e in busy.entries.values())
    print(f"busy run's stored figures marked unstable: {'yes' if busy_unstable else 'NO'}")
    print(f"{'PASS' if ok else 'FAIL'}: under a busy process per core, the first generate's "
          + ("verdicts are the quiet machine's or say 'either bound'" if ok else
             "verdicts differ from the quiet machine's without saying 'either bound'"))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"pass": ok, "runs": [
            {"condition": r.condition, "rc": r.rc, "entries": r.entries, "lines": r.lines,
             "verdicts": r.verdicts()} for r in (quiet, busy)]}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
