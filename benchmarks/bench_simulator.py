"""How fast ``phasewise simulate`` runs: 10,000 requests in virtual time, against the 30 s the
planner's search can afford per point (issue 13's target), on this machine.

Three runs of the same 10,000-request workload (chat-like: 256 +- 64 prompt tokens, 128 +-
32 output, Poisson arrivals, 10% 2k-token intruders): Llama-3.1-8B on one H100 (co-located,
chunked), the same as P/D 1P:1D over 100 GbE, and 4 co-located replicas. It prints each run's
wall time, requests and engine steps simulated per second, and the ratio of the wall time to
the target. No model is loaded; torch is not imported.

    python -m benchmarks.bench_simulator [--requests N] [--rate R]
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.harness import machine_info, machine_line  # noqa: E402

from phasewise.perf.workload import LengthDist, build_workload  # noqa: E402
from phasewise.perf.costmodel import CostModel  # noqa: E402
from phasewise.perf.hardware import LINKS, lookup_accelerator  # noqa: E402
from phasewise.perf.models import lookup_model  # noqa: E402
from phasewise.perf.simulate import Deployment, EngineSpec, kv_blocks_for, simulate  # noqa: E402

TARGET_S = 30.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=20.0, help="req/s (per replica: x replicas)")
    a = ap.parse_args()
    print(machine_line(machine_info()))
    cm = CostModel(lookup_model("llama-3.1-8b"), lookup_accelerator("h100-sxm"))
    free = cm.accel.mem_bytes * 0.9 - cm.body_bytes - cm.head_bytes
    eng = EngineSpec(num_kv_blocks=kv_blocks_for(cm, free, 16), max_num_batched_tokens=2048,
                     max_model_len=8192)
    runs = [("co-located x1", Deployment(), 1),
            ("P/D 1P:1D, 100GbE", Deployment("pd", link=LINKS["100gbe"]), 1),
            ("co-located x4", Deployment(replicas=4), 4)]
    print(f"{a.requests} requests, 256+-64 in (10% 2048) / 128+-32 out, Llama-3.1-8B on "
          f"H100 SXM (assumed efficiencies); target: {TARGET_S:g} s each")
    print(f"{'deployment':<20}{'req/s':>7}{'wall s':>9}{'sim req/s':>11}{'steps':>9}"
          f"{'steps/s':>10}{'x target':>10}")
    for name, dep, scale in runs:
        specs = build_workload(a.requests, LengthDist.parse("normal:256,64"),
                               LengthDist.parse("normal:128,32"), request_rate=a.rate * scale,
                               intruder_fraction=0.1, intruder_len=LengthDist.parse("2048"),
                               seed=0)
        t0 = time.perf_counter()
        r = simulate(cm, eng, dep, specs)
        wall = time.perf_counter() - t0
        steps = sum(sum(w["steps"].values()) for w in r["simulated"]["workers"])
        print(f"{name:<20}{a.rate * scale:>7g}{wall:>9.2f}{a.requests / wall:>11.0f}"
              f"{steps:>9}{steps / wall:>10.0f}{wall / TARGET_S:>10.2f}")
        assert r["completed"] == a.requests, r["failed"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
