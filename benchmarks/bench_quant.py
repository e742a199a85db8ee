"""Weight-only int8 against bf16, in the engine, on the reference checkpoint: which phase it
moves, and by how much the roofline says it should.

One run on one machine; the two engines (``--quantization int8`` and the bf16 default) are
loaded side by side and measured in interleaved rounds, each figure beside a fresh reading of
the read bandwidth (a shared machine's drifts by 10-20% within minutes):

* decode at batch 1 (a 128-token prompt, then timed decode steps, in segments that alternate
  between the engines, each after a fresh bandwidth reading): tok/s, the int8 / bf16 ratio
  segment pair by segment pair, and the fraction of the bandwidth roofline, (weight + K/V
  bytes of the step) / bandwidth / measured step time, with each engine's own bytes (int8:
  half the weights);
* decode steps at batch 8 and 32: median step time against the roofline step time, the larger
  of bytes / bandwidth and FLOPs / (the matmul peak of the arithmetic the step runs in, as
  the engine's cost model says: fp32 for the AVX2 paths, bf16 for AMX tiles, on which int8
  weights of more than 6 rows are widened to bf16);
* prefill of 512 tokens.

It prints each figure, int8 / bf16 ratios and the roofline's predicted ratio. Each peak a
roofline fraction divides by is judged as ``phasewise measure`` judges its own
(``harness.PeakRuns``); an unstable one is named at the top of the report, and the fractions
computed from it are marked ``(UNSTABLE peak: ...)``. With
``--llama-python`` (a venv made by ``benchmarks/peers/llamacpp_setup.sh``) it also runs
llama.cpp on the same checkpoint converted to Q8_0 and bf16 GGUF
(``benchmarks/peers/llamacpp_decode.py``), and prints phasewise int8 / llama.cpp Q8_0.

    .venv/bin/python -m benchmarks.bench_quant [--model DIR] [--rounds 3]
                                               [--llama-python /tmp/llamacpp-venv/bin/python]

Without ``--model`` it builds (once) the reference checkpoint (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from benchmarks import harness
from benchmarks.bench_engine import matmul_gflops, read_gbps
from benchmarks.harness import PeakRuns, machine_info, machine_line
from benchmarks.workloads import prompts
from phasewise.model.loader import huge_page_empty

ENGINES = ("bf16", "int8")


def reference_checkpoint() -> str:
    return str(harness.reference_checkpoint())


def load(model: str, name: str):
    from phasewise import LLM

    return LLM(model, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=64,
               max_num_batched_tokens=4096, quantization=None if name == "bf16" else "int8")


def decode_b1_paired(llms: dict, segments: int, steps: int, salt: int,
                     probe: torch.Tensor, runs: PeakRuns | None = None
                     ) -> dict[str, dict[str, list[float]]]:
    """Batch-1 decode on every engine at once, in alternating segments of ``steps`` steps
    (each engine's request stays live across them), each segment after a fresh bandwidth
    reading over ``probe``: per engine, the step seconds, the roofline fraction at its own
    bytes and those bytes, one entry per segment. Pairing the engines segment by segment
    keeps a shared machine's drift out of their ratio. ``runs``: where each reading is
    recorded (``mem_bandwidth``, without its runs: the kernels' probe returns its best
    alone, so it is judged on the machine's load)."""
    from phasewise import SamplingParams
    from phasewise.model.cpu import kernels as cpu_kernels

    live = {}
    for name, llm in llms.items():
        eng = llm.engine
        rid = eng.add_request(prompts(1, 128, salt)[0], SamplingParams(
            temperature=0, max_tokens=segments * steps + 4, ignore_eos=True))
        eng.step()  # the prefill
        eng.step()  # one untimed decode step
        live[name] = (eng, rid)
    out: dict[str, dict[str, list[float]]] = {n: {"s": [], "roofline": [], "bytes": []}
                                              for n in llms}
    for seg in range(segments):
        order = list(live) if seg % 2 == 0 else list(reversed(live))
        for name in order:
            eng, rid = live[name]
            bw = cpu_kernels.stream_read_gbps(probe, reps=2) * 1e9
            if runs is not None:
                runs.add("mem_bandwidth")
            ctx = eng.requests[rid].num_tokens
            t = time.perf_counter()
            for _ in range(steps):
                eng.step()
            step_s = (time.perf_counter() - t) / steps
            nbytes = eng.cost_model.predict([], [ctx + steps // 2]).bytes
            out[name]["s"].append(step_s)
            out[name]["roofline"].append(nbytes / bw / step_s)
            out[name]["bytes"].append(nbytes)
    for eng, rid in live.values():
        eng.abort_request(rid)
    return out


def decode_batch(llm, batch: int, salt: int) -> tuple[float, float, float, str]:
    """(median decode-only step seconds, its roofline bytes, FLOPs, the dtype whose peak its
    arithmetic runs at) at ``batch`` requests of 128 prompt + 32 output tokens."""
    from phasewise import SamplingParams

    n0 = len(llm.step_stats)
    llm.generate(prompts(batch, 128, salt), SamplingParams(temperature=0, max_tokens=32,
                                                           ignore_eos=True))
    steps = [s for s in list(llm.step_stats)[n0:]
             if s.num_decode_tokens == batch and not s.num_prefill_tokens]
    pred = llm.engine.cost_model.predict([], [128 + 16] * batch)
    return (statistics.median(s.duration_s for s in steps), pred.bytes, pred.flops,
            pred.compute_dtype)


def prefill512(llm, salt: int) -> float:
    from phasewise import SamplingParams

    t = time.perf_counter()
    llm.generate(prompts(1, 512, salt), SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t


def quantiles(xs: list[float]) -> list[float]:
    return statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3


def run_llama(python: str, model: str, quick: bool) -> dict | None:
    """llama.cpp's figures; a run killed by a signal is retried once without its extra
    buffer types (weight repacking, the AMX backend), which crashed on an AMX Xeon; the
    result then says so (``extra_bufts: False``)."""
    cmd = harness.peer_command(python, "llamacpp_decode", model, *(["--quick"] if quick else []))
    for extra in ([], ["--no-extra-bufts"]):
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=3600,
                              cwd=harness.REPO)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                out = json.loads(line[len("RESULT "):])
                out["extra_bufts"] = not extra
                return out
        print(f"  llama.cpp run{' ' + extra[0] if extra else ''} failed (exit "
              f"{proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
        if proc.returncode >= 0:
            break
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the reference checkpoint)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--segments", type=int, default=12, help="paired batch-1 segments")
    ap.add_argument("--steps", type=int, default=12, help="decode steps per batch-1 segment")
    ap.add_argument("--llama-python", help="python of a llama-cpp-python venv")
    ap.add_argument("--quick", action="store_true", help="one round, fewer steps")
    ap.add_argument("--b1-only", action="store_true", help="only the paired batch-1 decode")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.segments, args.steps = 1, 4, 8
    model = args.model or reference_checkpoint()
    print(machine_line(machine_info()))
    llms = {name: load(model, name) for name in ENGINES}
    # 512 MiB, kept (no churn), in huge pages as the weights are
    probe = huge_page_empty(512 << 20).view(torch.bfloat16).fill_(1.0)
    for name, llm in llms.items():  # warm both paths (the kernels' first calls, buffers)
        decode_batch(llm, 8, salt=2)
    decode_b1_paired(llms, 2, 4, salt=1, probe=probe)
    rows: dict[str, dict[str, list[float]]] = {n: {} for n in ENGINES}

    def add(name: str, key: str, value: float) -> None:
        rows[name].setdefault(key, []).append(value)

    b1_runs = PeakRuns()
    b1 = decode_b1_paired(llms, args.segments, args.steps, salt=10, probe=probe, runs=b1_runs)
    b1_notes = b1_runs.notes()
    b1_mark = b1_notes.mark("mem_bandwidth")
    for name in ENGINES:
        rows[name]["b1_tok_s"] = [1 / s for s in b1[name]["s"]]
        rows[name]["b1_roofline"] = b1[name]["roofline"]
        rows[name]["b1_bytes"] = b1[name]["bytes"]
    pair = [b / q for b, q in zip(b1["bf16"]["s"], b1["int8"]["s"])]
    if args.b1_only:
        print(b1_notes.header("read beside the batch-1 segments"))
        for name in ENGINES:
            print(f"{name}: b1 {statistics.median(rows[name]['b1_tok_s']):.1f} tok/s, "
                  f"{statistics.median(rows[name]['b1_roofline']):.0%} of its roofline"
                  + b1_mark)
        print(f"int8 / bf16: decode b1 x{statistics.median(pair):.2f} (median of {len(pair)} "
              f"paired segments, quartiles x{quantiles(pair)[0]:.2f}-x{quantiles(pair)[2]:.2f})")
        return
    round_runs = PeakRuns()
    used = {"mem_bandwidth"}  # the peaks the b8 / b32 fractions divide by
    for r in range(args.rounds):
        for name, llm in (llms.items() if r % 2 == 0 else reversed(llms.items())):
            bw = read_gbps(reps=2, runs=round_runs) * 1e9
            peaks = {"fp32": matmul_gflops(torch.float32, round_runs) * 1e9,
                     "bf16": matmul_gflops(torch.bfloat16, round_runs) * 1e9}
            for b in (8, 32):
                s, nb, fl, arith = decode_batch(llm, b, salt=20 + r + b)
                peak = peaks.get(arith, peaks["fp32"])
                used.add(arith if arith in peaks else "fp32")
                add(name, f"b{b}_step_s", s)
                add(name, f"b{b}_roofline", max(nb / bw, fl / peak) / s)
                add(name, f"b{b}_bound", float(fl / peak > nb / bw))
            add(name, "prefill512_s", prefill512(llm, salt=40 + r))
            print(f"  round {r + 1}/{args.rounds} {name}: b8 step "
                  f"{rows[name]['b8_step_s'][-1] * 1e3:.0f} ms at {bw / 1e9:.1f} GB/s",
                  file=sys.stderr, flush=True)

    round_notes = round_runs.notes()
    # beside each row: the marks of the peaks its b1 and rf fractions divide by
    rf_mark = round_notes.mark(*sorted(used))
    marks = "; ".join(f"{what}{mark}" for what, mark in (("b1", b1_mark), ("rf", rf_mark))
                      if mark)
    med = {n: {k: statistics.median(v) for k, v in rows[n].items()} for n in ENGINES}
    b, q = med["bf16"], med["int8"]
    print(f"\n{b1_notes.header('read beside the batch-1 segments')}")
    print(round_notes.header("measured before each round's b8 / b32 steps"))
    print(f"reference checkpoint {model}; {args.rounds} interleaved rounds; medians")
    print(f"{'':6} | {'b1 decode':>17} | {'b8 decode step':>18} | {'b32 decode step':>18} | "
          f"{'prefill 512':>11}")
    for name in ENGINES:
        m = med[name]
        print(f"{name:6} | {m['b1_tok_s']:6.1f} tok/s {m['b1_roofline']:4.0%} | "
              f"{m['b8_step_s'] * 1e3:7.1f} ms {m['b8_roofline']:4.0%} rf | "
              f"{m['b32_step_s'] * 1e3:7.1f} ms {m['b32_roofline']:4.0%} rf | "
              f"{m['prefill512_s']:9.3f} s" + (f"  [{marks}]" if marks else ""))
    print("(b1: fraction of the bandwidth roofline at each engine's own bytes; rf: roofline "
          "step time / measured)")
    bound = {k: "compute" if q[f"{k}_bound"] >= 0.5 else "memory" for k in ("b8", "b32")}
    print(f"int8 / bf16: decode b1 x{statistics.median(pair):.2f} (median of {len(pair)} "
          f"paired segments, quartiles x{quantiles(pair)[0]:.2f}-x{quantiles(pair)[2]:.2f}; "
          f"bytes per step predict x{b['b1_bytes'] / q['b1_bytes']:.2f}); b8 step x"
          f"{b['b8_step_s'] / q['b8_step_s']:.2f} (int8 roofline: {bound['b8']}-bound); b32 "
          f"step x{b['b32_step_s'] / q['b32_step_s']:.2f} ({bound['b32']}-bound{rf_mark}); "
          f"prefill 512 "
          f"x{b['prefill512_s'] / q['prefill512_s']:.2f} (compute-bound: same FLOPs)")
    if args.llama_python:
        peer = run_llama(args.llama_python, model, args.quick)
        if peer:
            print("\nllama.cpp through llama-cpp-python, built from its sdist (the same "
                  "checkpoint converted to GGUF, 2 threads"
                  + ("" if peer.pop("extra_bufts") else "; without its extra buffer types, "
                     "which crashed here") + "):")
            for kind, mine in (("q8_0", "int8"), ("bf16", "bf16")):
                p = peer.get(kind)
                if not p:
                    continue
                print(f"  {kind:5}: decode b1 {p['b1_decode_tok_s']:.1f} tok/s, prefill 512 "
                      f"{p['prefill512_s']:.3f} s; phasewise {mine} / llama.cpp {kind}: "
                      f"decode b1 x{med[mine]['b1_tok_s'] / p['b1_decode_tok_s']:.2f}, "
                      f"prefill x{p['prefill512_s'] / med[mine]['prefill512_s']:.2f}")


if __name__ == "__main__":
    main()
