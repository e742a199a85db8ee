"""Weight-only int8 linear layers at decode's row counts: phasewise's int8 kernel against its
bf16 kernel and torch's own int8 weight-only matmul (``aten._weight_int8pack_mm``).

Every projection shape of the reference checkpoint (Qwen2-0.5B's: q/k/v fused, o, gate/up
fused, down), at 1, 2 and 4 activation rows, with the weights cycled through >= 96 MiB of
copies so that each call reads them from memory, as a forward pass does; the methods are
interleaved shape by shape. It prints each method's time, the GB/s of weight bytes it
streamed, and the int8 kernel's speed-up over the bf16 kernel (the roofline's prediction:
2x, half the bytes).

    python benchmarks/bench_int8.py [--reps 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_disagg import machine_info, machine_line  # noqa: E402

from phasewise.model.cpu import kernels as cpu_kernels  # noqa: E402

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
CYCLE_BYTES = 96 * 2**20


def copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, -(-CYCLE_BYTES // nbytes)))]


def timed(fn, n: int, reps: int) -> float:
    for i in range(5):
        fn(i)
    t0 = time.perf_counter()
    for i in range(reps):
        fn(i)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_kernels.KERNELS.reason}")
    print(machine_line(machine_info()))
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'shape':>8} {'rows':>4} | {'int8 kernel':>16} | {'bf16 kernel':>16} | "
          f"{'torch int8pack':>16} | int8/bf16 speed-up")
    ups = []
    for name, (n, k) in SHAPES.items():
        w8 = copies(lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8), n * k)
        sc = [torch.rand(n) * 0.01 for _ in w8]
        scb = [s.bfloat16() for s in sc]
        wb = copies(lambda: torch.randn(n, k).bfloat16(), 2 * n * k)
        for m in (1, 2, 4):
            x = torch.randn(m, k).bfloat16()
            t8 = timed(lambda i: cpu_kernels.linear_int8(x, w8[i % len(w8)], sc[i % len(w8)]),
                       n, args.reps)
            tb = timed(lambda i: cpu_kernels.linear_bf16(x, wb[i % len(wb)]), n, args.reps)
            tt = timed(lambda i: torch.ops.aten._weight_int8pack_mm(x, w8[i % len(w8)],
                                                                   scb[i % len(w8)]),
                       n, args.reps)
            ups.append(tb / t8)

            def col(t: float, nbytes: int) -> str:
                return f"{t * 1e3:7.3f} ms {nbytes / t / 1e9:5.1f}GB/s"
            print(f"{name:>8} {m:>4} | {col(t8, n * k)} | {col(tb, 2 * n * k)} | "
                  f"{col(tt, n * k)} | x{tb / t8:.2f}")
    ups.sort()
    print(f"int8 kernel over bf16 kernel: median x{ups[len(ups) // 2]:.2f} "
          f"(min x{ups[0]:.2f}, max x{ups[-1]:.2f}); the roofline predicts x2.00")


if __name__ == "__main__":
    main()
