"""Validate the roofline against the real engine on this machine.

With this machine measured (``phasewise measure``: the ``cpu-local`` accelerator), predict
the engine's prefill time for 128 / 512 / 2048 tokens and its decode step time at batch
1 / 8 / 32 on the reference checkpoint, then measure them. Prints predicted vs measured and
the implied efficiency: MFU = predicted compute time / measured time and MBU = predicted
memory time / measured time (the one on the binding side is the step's efficiency). A peak
stored unstable (``phasewise measure``'s ``measured.unstable``) is named at the top, and each
figure computed from it is marked ``(UNSTABLE peak: ...)``.

Weights are bf16; phasewise's CPU kernels do their arithmetic in fp32 on CPUs without native
bf16, so the compute roof is the measured fp32 matmul peak (``--compute-dtype``).

    python -m benchmarks.validate_roofline [--model DIR] [--remeasure] [--compute-dtype fp32]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import HERE, REFERENCE_MODEL, PeakNotes, checkpoint_or_reference

DEFAULT_MODEL = REFERENCE_MODEL


def log(msg: str) -> None:
    print(f"[validate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--remeasure", action="store_true",
                    help="measure the machine even if machine.json exists")
    ap.add_argument("--compute-dtype", default="fp32")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "roofline_validation.json")
    a = ap.parse_args()
    a.model = checkpoint_or_reference(a.model)

    from phasewise.perf.hardware import load_local, machine_file
    from phasewise.perf.measure import measure
    from phasewise.perf.models import ModelShape
    from phasewise.perf.roofline import Roofline

    if a.remeasure or not machine_file().exists():
        log("measuring this machine (phasewise measure)")
        measure()
    acc = load_local("cpu-local")
    notes = PeakNotes.stored(acc)
    shape = ModelShape.from_path(a.model)
    roof = Roofline(shape, acc, "bf16", compute_dtype=a.compute_dtype)
    # the peaks this script divides by: the compute dtype's (MFU) and the read bandwidth (MBU)
    used = (roof.compute_dtype, "mem_bandwidth")
    log(notes.header("cpu-local, as stored"))
    log(f"cpu-local: read {acc.mem_bandwidth / 1e9:.1f} GB/s{notes.mark('mem_bandwidth')}, "
        f"{a.compute_dtype} {acc.peak_flops_for(a.compute_dtype) / 1e9:.1f} GFLOP/s"
        f"{notes.mark(roof.compute_dtype)}")

    from phasewise import LLM, SamplingParams

    llm = LLM(str(a.model), dtype="bfloat16", enable_prefix_caching=False,
              max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=4096)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, shape.vocab_size - 100) for _ in range(n)]

    llm.generate(prompt(64), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    rows = []
    for s in (128, 512, 2048):
        times = []
        for _ in range(2):
            n0 = len(llm.step_stats)
            llm.generate(prompt(s), SamplingParams(max_tokens=1, ignore_eos=True))
            steps = [st for st in llm.step_stats[n0:] if st.num_prefill_tokens]
            times.append(sum(st.duration_s for st in steps))
        rows.append(("prefill", s, roof.prefill(s), min(times)))
        log(f"prefill {s}: {min(times):.3f} s")
    ctx_in, ctx_out = 128, 32
    for b in (1, 8, 32):
        n0 = len(llm.step_stats)
        llm.generate([prompt(ctx_in) for _ in range(b)],
                     SamplingParams(max_tokens=ctx_out, ignore_eos=True))
        dec = [st.duration_s for st in llm.step_stats[n0:]
               if st.num_prefill_tokens == 0 and st.num_decode_tokens == b]
        measured = statistics.median(dec)
        rows.append(("decode", b, roof.decode(b, ctx_in + ctx_out // 2), measured))
        log(f"decode batch {b}: {measured * 1e3:.1f} ms per step")

    print(f"\n{notes.header('cpu-local, as stored')}")
    print(f"reference checkpoint ({shape.total_params / 1e6:.0f} M parameters, bf16) on "
          f"cpu-local: read {acc.mem_bandwidth / 1e9:.1f} GB/s{notes.mark('mem_bandwidth')}, "
          f"{a.compute_dtype} peak {acc.peak_flops_for(a.compute_dtype) / 1e9:.1f} GFLOP/s"
          f"{notes.mark(roof.compute_dtype)} ({acc.source})\n")
    print(f"{'step':<22}{'bound':>9}{'predicted':>12}{'measured':>12}{'meas/pred':>11}"
          f"{'MFU':>7}{'MBU':>7}")
    out = []
    for kind, n, pred, meas in rows:
        label = f"prefill {n} tokens" if kind == "prefill" else f"decode batch {n}"
        mfu, mbu = pred.t_compute / meas, pred.t_memory / meas
        # every column past "measured" divides by a peak: predicted time and meas/pred by
        # both, MFU by the compute peak, MBU by the read bandwidth
        print(f"{label:<22}{pred.bound:>9}{pred.time * 1e3:>10.1f}ms{meas * 1e3:>10.1f}ms"
              f"{meas / pred.time:>11.2f}{mfu:>7.2f}{mbu:>7.2f}{notes.mark(*used)}")
        out.append({"step": kind, "n": n, "predicted_s": pred.time, "measured_s": meas,
                    "bound": pred.bound, "mfu": mfu, "mbu": mbu,
                    "predicted": pred.as_dict()})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"accelerator": acc.as_dict(), "rows": out,
                                 "unstable_peaks": {k: v for k, v in notes.unstable.items()
                                                    if k in used}}, indent=1))
    print(f"\nwritten to {a.out}")


if __name__ == "__main__":
    main()
