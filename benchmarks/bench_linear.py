"""The linear-layer methods of phasewise's CPU dispatch, side by side, on this machine.

For each projection of the reference checkpoint's shape (qkv 896->1152, o 896->896, gate_up
896->9728, down 4864->896, the LM head 896->32000) and each row count, it times:

* ``kernel``: phasewise's C kernel (the streaming GEMV up to 6 rows, the 2x6 register tiles
  above), bf16 weights in place;
* ``gemm``: phasewise's packed GEMM (weights widened to fp32 while packed, per call);
* ``upcast``: the weight widened to fp32 in a scratch buffer, then torch's fp32 GEMM;
* ``amx``: phasewise's AMX kernel (where the CPU has AMX-BF16), bf16 weights in place;
* ``avx512bf16``: phasewise's AVX512_BF16 kernel (where the CPU has AVX512_BF16), bf16 weights in
  place;
* ``panels``: phasewise's AVX512_BF16 kernel on weights packed into panels (where the CPU
  has AVX512_BF16: the engine packs its decoder projections so there, unless it has AMX),
  16 output channels a vector, no reduction across lanes;
* ``torch-bf16``: ``F.linear`` on the bf16 weight (fast only where the CPU has bf16 dot
  products: AVX512_BF16 / AMX);
* ``torch-fp32``: ``F.linear`` on an fp32 copy of the weight (twice the bytes), the
  machine's fp32 GEMM as a yardstick.

Each method's calls cycle through enough copies of the weight (>= 96 MiB) that weights come
from memory, as in a model's forward pass, not from the last-level cache; the methods run
interleaved, round after round, and the median round counts, so the shared machine's drift
hits them alike. It prints GFLOP/s, each method's ratio to the faster of ``torch-bf16`` and
``torch-fp32``, and the plan the engine's calibration would pick here (where the engine packs
its projections into panels instead, it says so).

``--int8`` measures weight-only int8 linear layers at decode's row counts instead (what
``bench_int8.py`` did): phasewise's int8 kernel against its bf16 kernel and torch's own int8
weight-only matmul (``aten._weight_int8pack_mm``), on the decoder's projection shapes (q/k/v
fused, o, gate/up fused, down; ``--shapes`` picks), at 1, 2 and 4 activation rows, the
weights cycled through >= 96 MiB of copies as above; the methods are interleaved shape by
shape, each timed over ``--reps`` calls. It prints each method's time, the GB/s of weight
bytes it streamed, and the int8 kernel's speed-up over the bf16 kernel (the roofline's
prediction: 2x, half the bytes).

    .venv/bin/python -m benchmarks.bench_linear [--rows 1 8 32 128 512] [--rounds 4]
                                                [--shapes qkv o gate_up down lm_head]
    .venv/bin/python -m benchmarks.bench_linear --int8 [--reps 200] [--shapes qkv o gate_up down]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import machine_info, machine_line  # noqa: E402

from phasewise.model.cpu import kernels as cpu_kernels  # noqa: E402
from phasewise.model.cpu.linear import LinearDispatch, Upcast  # noqa: E402

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864),
          "lm_head": (32000, 896),
          # one expert of bench_moe's Qwen-MoE-shaped checkpoint (hidden 1024, width 512):
          # at batch 64 with 4 of 32 experts a token, an expert gets ~8 rows
          "expert_gate_up": (1024, 1024), "expert_down": (1024, 512)}
DEFAULT_SHAPES = ["qkv", "o", "gate_up", "down", "lm_head"]  # the reference checkpoint's
INT8_SHAPES = ["qkv", "o", "gate_up", "down"]  # the decoder's projections (int8 leaves lm_head)
CYCLE_BYTES = 96 * 2**20


def methods() -> dict:
    out = {}
    if cpu_kernels.load() is not None:
        out["kernel"] = cpu_kernels.linear_bf16
        out["gemm"] = cpu_kernels.gemm_bf16
    if cpu_kernels.amx_available():
        out["amx"] = cpu_kernels.linear_amx
    if cpu_kernels.avx512bf16_available():
        out["avx512bf16"] = cpu_kernels.linear_avx512bf16
        out["panels"] = cpu_kernels.linear_pk  # over packed copies; see run()
    out["upcast"] = Upcast()
    out["torch-bf16"] = lambda x, w, b: F.linear(x, w, b)
    out["torch-fp32"] = None  # fp32 copies of the weights; see run()
    return out


def run(rows: list[int], rounds: int, shapes: list[str]) -> None:
    fns = methods()
    names = list(fns)
    print(f"{'shape':<8}{'rows':>6}" + "".join(f"{n:>12}" for n in names)
          + "   (GFLOP/s, then the ratio to torch's faster: bf16 or fp32)")
    for shape in shapes:
        n, k = SHAPES[shape]
        copies = max(2, (96 << 20) // (n * k * 2))
        ws = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        ws32 = [w.float() for w in ws[: max(2, copies // 2)]]  # the same bytes in fp32
        wps = [cpu_kernels.pack_panels(w) for w in ws] if "panels" in fns else []
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            x32 = x.float()
            times: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(rounds):
                for name in names:
                    fn, weights, xin = fns[name], ws, x
                    if name == "torch-fp32":
                        fn, weights, xin = (lambda a, w, b: F.linear(a, w, b)), ws32, x32
                    elif name == "panels":
                        weights = wps
                    fn(xin, weights[0], None)  # warm
                    t = time.perf_counter()
                    for w in weights:
                        fn(xin, w, None)
                    times[name].append((time.perf_counter() - t) / len(weights))
            rate = {name: 2 * m * n * k / statistics.median(t) / 1e9 for name, t in times.items()}
            ref = max(rate["torch-fp32"], rate["torch-bf16"])
            cells = "".join(f"{rate[name]:>7.1f} x{rate[name] / ref:<3.1f}"[:12].rjust(12)
                            for name in names)
            print(f"{shape:<8}{m:>6}{cells}", flush=True)
        del ws, ws32, wps
    # as phasewise tune calibrates: the 24 layers' gate_up weights of the reference checkpoint
    plan = LinearDispatch.calibrate([torch.randn(*SHAPES["gate_up"]).bfloat16()
                                     for _ in range(24)])
    packs = cpu_kernels.avx512bf16_available() and not cpu_kernels.amx_available()
    if packs:  # the kernel plan's rule packs panels here (phasewise.model.cpu.plan.rule)
        print("\nthe rule packs a bf16 model's decoder projections (and an LM head of whole "
              "16-row blocks) into panels on this machine: the `panels` column at every row "
              "count; for weights left in rows, phasewise tune's calibration (24 gate_up "
              f"weights) picks: {plan.describe()}")
    else:
        print(f"\nphasewise tune's calibration on this machine (24 gate_up weights): "
              f"{plan.describe()}")


def copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, -(-CYCLE_BYTES // nbytes)))]


def timed_reps(fn, reps: int) -> float:
    for i in range(5):
        fn(i)
    t0 = time.perf_counter()
    for i in range(reps):
        fn(i)
    return (time.perf_counter() - t0) / reps


def run_int8(reps: int, shapes: list[str]) -> None:
    """Weight-only int8 at decode's row counts (formerly bench_int8.py)."""
    if cpu_kernels.load() is None:
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_kernels.KERNELS.reason}")
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'shape':>8} {'rows':>4} | {'int8 kernel':>16} | {'bf16 kernel':>16} | "
          f"{'torch int8pack':>16} | int8/bf16 speed-up")
    ups = []
    for name in shapes:
        n, k = SHAPES[name]
        w8 = copies(lambda: torch.randint(-127, 128, (n, k), dtype=torch.int8), n * k)
        sc = [torch.rand(n) * 0.01 for _ in w8]
        scb = [s.bfloat16() for s in sc]
        wb = copies(lambda: torch.randn(n, k).bfloat16(), 2 * n * k)
        for m in (1, 2, 4):
            x = torch.randn(m, k).bfloat16()
            t8 = timed_reps(lambda i: cpu_kernels.linear_int8(x, w8[i % len(w8)],
                                                               sc[i % len(w8)]), reps)
            tb = timed_reps(lambda i: cpu_kernels.linear_bf16(x, wb[i % len(wb)]), reps)
            tt = timed_reps(lambda i: torch.ops.aten._weight_int8pack_mm(x, w8[i % len(w8)],
                                                                        scb[i % len(w8)]),
                            reps)
            ups.append(tb / t8)

            def col(t: float, nbytes: int) -> str:
                return f"{t * 1e3:7.3f} ms {nbytes / t / 1e9:5.1f}GB/s"
            print(f"{name:>8} {m:>4} | {col(t8, n * k)} | {col(tb, 2 * n * k)} | "
                  f"{col(tt, n * k)} | x{tb / t8:.2f}")
    ups.sort()
    print(f"int8 kernel over bf16 kernel: median x{ups[len(ups) // 2]:.2f} "
          f"(min x{ups[0]:.2f}, max x{ups[-1]:.2f}); the roofline predicts x2.00")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                    help="default: the reference checkpoint's five; with --int8, all but "
                    "lm_head; expert_*: an MoE expert's")
    ap.add_argument("--int8", action="store_true",
                    help="weight-only int8 at 1, 2 and 4 rows instead (formerly bench_int8.py)")
    ap.add_argument("--reps", type=int, default=200, help="--int8: calls timed per method")
    a = ap.parse_args()
    if a.int8:
        print(machine_line(machine_info()))
        run_int8(a.reps, a.shapes or INT8_SHAPES)
        return
    print(machine_line(machine_info()), file=sys.stderr)
    run(a.rows, a.rounds, a.shapes or DEFAULT_SHAPES)


if __name__ == "__main__":
    main()
