"""One generation's two phases held against this machine's roofline.

``phasewise generate`` prints these lines after the stream: for the prefill (the prompt's
chunks) and the decode steps it ran, the arithmetic intensity the roofline gives them, the
bound that intensity means on this machine (its measured ridge point), and how the measured
time compares with the roofline's lower bound. The last line says, in one sentence, which phase
was compute-bound and which memory-bound, and from what prompt length (and decode batch) the
answer would flip: the bound follows from bytes per FLOP, not from the phase's name. A phase
far above its roofline gets a line of its own: how its time split between the forward passes
and the host (both measured in the run), and what its excess is made of: other processes'
load where it was high, else the larger of the host time and the forward passes' own excess.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from phasewise.perf.contention import Contention, fewer_threads
from phasewise.perf.hardware import Accelerator
from phasewise.perf.models import ModelShape
from phasewise.perf.roofline import Roofline, StepCost

OVERHEAD_RATIO = 3.0  # measured / roofline time above which fixed costs are named


@dataclass(frozen=True)
class PhaseCost:
    """A phase's steps on one roofline: their summed cost, the sum of each step's own time
    bound, and the measured time."""

    name: str
    steps: int
    total: StepCost  # flops and bytes summed over the steps (same peaks: times add up too)
    t_bound: float  # sum over steps of max(t_compute, t_memory), not the max of the sums
    measured_s: float
    # the part of measured_s its forward passes took (the rest is the host's: scheduling,
    # sampling, outputs); None where not measured
    forward_s: float | None = None

    @property
    def tokens(self) -> int:
        return self.total.tokens

    @property
    def flops(self) -> float:
        return self.total.flops

    @property
    def bytes(self) -> float:
        return self.total.bytes

    @property
    def intensity(self) -> float:
        return self.total.intensity

    @property
    def bound(self) -> str:
        return self.total.bound

    @property
    def margin(self) -> float:
        """How many times the binding side outweighs the other."""
        return self.total.ratio

    @property
    def vs_roofline(self) -> float:
        """Measured time over the roofline's lower bound (1.0 = at the roof)."""
        return self.measured_s / self.t_bound if self.t_bound > 0 else float("inf")

    @property
    def forward_vs_roofline(self) -> float | None:
        """The forward passes' time over the same bound: the roofline counts exactly their
        work (arithmetic, weight and K/V reads), none of the host's."""
        if self.forward_s is None:
            return None
        return self.forward_s / self.t_bound if self.t_bound > 0 else float("inf")

    @property
    def host_s(self) -> float | None:
        """The time outside the forward passes (None where forward_s is)."""
        return None if self.forward_s is None else max(self.measured_s - self.forward_s, 0.0)


def _total(name: str, costs: list[StepCost], measured_s: float) -> PhaseCost:
    summed = StepCost(name, *(sum(getattr(c, f) for c in costs) for f in (
        "tokens", "flops", "bytes", "weight_bytes", "kv_read_bytes", "kv_write_bytes",
        "act_bytes")), costs[0].peak_flops, costs[0].bandwidth)
    return PhaseCost(name, len(costs), summed, sum(c.time for c in costs), measured_s)


def prefill_cost(roof: Roofline, chunks: Sequence[int], measured_s: float) -> PhaseCost:
    """The prompt as the engine ran it: ``chunks`` tokens per step, each after the last."""
    costs, done = [], 0
    for n in chunks:
        costs.append(roof.prefill(n, prefix_len=done))
        done += n
    return _total("prefill", costs, measured_s)


def decode_cost(roof: Roofline, prompt_len: int, steps: int, measured_s: float,
                verifies: Sequence[tuple[int, int]] | None = None) -> PhaseCost:
    """``steps`` single-sequence decode steps after a ``prompt_len``-token prompt (the first
    output token came with the prefill). With speculative decoding, ``verifies`` gives each
    step's (rows, tokens emitted): a step of r rows is r decode rows one position apart (the
    last sampled token and its drafts), and the context grows by what it emitted."""
    if verifies is None:
        verifies = [(1, 1)] * steps
    costs, ctx = [], prompt_len + 1
    for rows, emitted in verifies:
        costs.append(roof.mixed(decodes=range(ctx, ctx + rows)))
        ctx += emitted
    return _total("decode", costs, measured_s)


def compute_bound_prompt_len(roof: Roofline, limit: int) -> int | None:
    """The shortest prompt whose one-step prefill is compute-bound (None: none up to limit)."""
    lo, hi = 1, limit
    if roof.prefill(hi).bound != "compute":
        return None
    while lo < hi:  # intensity grows with the prompt: bisect
        mid = (lo + hi) // 2
        if roof.prefill(mid).bound == "compute":
            hi = mid
        else:
            lo = mid + 1
    return lo


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 0.01 else f"{s * 1e3:.1f} ms"


def _phase_line(p: PhaseCost, per: str, emitted: int | None = None) -> str:
    """``emitted``: the tokens the decode steps produced, when that differs from one a step
    (speculative decoding): they are shown per weight read (a step reads every weight once)."""
    if p.name == "prefill":
        what = f"{p.tokens} token{'s' * (p.tokens != 1)} in {p.steps} step{'s' * (p.steps != 1)}"
    elif emitted is None:
        what = f"{p.steps} steps of 1 token"
    else:
        what = (f"{p.steps} steps of {p.tokens / p.steps:.1f} rows, {emitted} tokens: "
                f"{emitted / p.steps:.2f} tokens per weight read")
    return (f"[roofline] {p.name + ':':8s} {what}, {p.intensity:.1f} FLOP/byte: "
            f"{p.bound}-bound ({p.margin:.1f}x); took {per} = {p.vs_roofline:.1f}x its "
            f"roofline time")


def _split_words(p: PhaseCost) -> str | None:
    """How a phase's time splits between its forward passes and the host, with numbers (per
    step for decode); None where the forward passes were not timed."""
    fwd, host, ratio = p.forward_s, p.host_s, p.forward_vs_roofline
    if fwd is None or host is None or ratio is None:
        return None
    n = p.steps if p.name == "decode" else 1
    each = " a step" if n > 1 else ""
    return (f"of {_ms(p.measured_s / n)}{each}, {_ms(fwd / n)} in the forward pass "
            f"({ratio:.1f}x its roofline time) and {_ms(host / n)} outside it (scheduling, "
            "sampling, outputs)")


def _excess_words(p: PhaseCost) -> str:
    """What the excess over the roofline of a phase whose forward passes were timed is made
    of, where other load does not explain it. The forward passes' own excess (their time
    over the roofline's, which counts exactly their work) is set against the host time,
    which the roofline does not count at all: the larger is named. The forward pass is
    called slow only where it ran more than OVERHEAD_RATIO times its roofline time."""
    fwd, host, ratio = p.forward_s or 0.0, p.host_s or 0.0, p.forward_vs_roofline or 0.0
    slow_kernels = ratio > OVERHEAD_RATIO
    if host >= fwd - p.t_bound:
        return ("most of the excess is host work outside the forward pass, and the forward "
                "pass's kernels and per-layer calls also ran below this machine's peaks"
                if slow_kernels else "the excess is host work outside the forward pass")
    return ("the excess is in the forward pass: its kernels and per-layer calls ran below "
            "this machine's peaks" if slow_kernels else
            "the excess is split between the forward pass and host work outside it")


def noise_factor(accel: Accelerator, compute: str) -> float | None:
    """How far the figures a verdict compares could be off: over the peak for ``compute``
    and the read bandwidth, for each one stored as unstable (``phasewise measure``'s
    ``measured.unstable``), its fastest/slowest ratio, or where other processes held a share
    of the CPU while it was measured (``measured.figure_conditions[name].others``) the
    slowdown that share could cause, whichever is larger; None where both are stable."""
    m = accel.measured or {}
    unstable, spread = m.get("unstable") or {}, m.get("spread") or {}
    per_figure = m.get("figure_conditions") or {}
    worst = None
    for name in (compute, "mem_bandwidth"):
        if name not in unstable:
            continue
        # the conditions this figure was measured in (older files: the newest run's)
        others = ((per_figure.get(name) or m.get("conditions") or {}).get("others")) or 0.0
        band = spread.get(name)
        ratio = band[1] / band[0] if band and len(band) == 2 and band[0] > 0 else 1.0
        worst = max(worst or 1.0, ratio, 1.0 / max(1.0 - others, 0.1))
    return worst


def unstable_note(accel: Accelerator, compute: str) -> str | None:
    """A line for a prediction made from ``accel``'s figures where the ones it uses (the peak
    for ``compute`` and the read bandwidth) are stored as unstable: which, why, how far off
    they could be. None where both are stable (or not measured: a catalog entry)."""
    factor = noise_factor(accel, compute)
    if factor is None:
        return None
    unstable = (accel.measured or {}).get("unstable") or {}
    which = "; ".join(f"{'read bandwidth' if n == 'mem_bandwidth' else f'{n} matmul'}: "
                      f"{unstable[n]}" for n in (compute, "mem_bandwidth") if n in unstable)
    return (f"{accel.key}'s figures were measured UNSTABLE ({which}): they could be off by "
            f"up to x{factor:.2f}, and so could the times below and a bound within that of "
            "the ridge; 'phasewise measure' on a quiet machine replaces them")


def _stored(roof: Roofline) -> str:
    """How ``roof``'s weights are stored: "int8", or "int8; experts bf16"."""
    if roof.moe_dtype == roof.dtype or not getattr(roof.model, "is_moe", False):
        return roof.dtype
    return f"{roof.dtype}; experts {roof.moe_dtype}"


def explain_generation(shape: ModelShape, accel: Accelerator, weight_dtype: str,
                       prefill_compute: str, decode_compute: str,
                       prefill_chunks: Sequence[int], prefill_s: float, decode_steps: int,
                       decode_s: float, max_step_tokens: int,
                       verifies: Sequence[tuple[int, int]] | None = None,
                       kv_dtype: str | None = None,
                       contention: Contention | None = None,
                       prefill_forward_s: float | None = None,
                       decode_forward_s: float | None = None,
                       moe_dtype: str | None = None,
                       threads: int | None = None) -> list[str]:
    """The lines ``phasewise generate`` prints after the stream (see the module doc).

    ``*_compute``: whose peak each phase's arithmetic runs at (it may differ from the
    weights' dtype, and between phases: fp32 kernels for decode rows, bf16 GEMM for prefill
    on some CPUs). ``max_step_tokens``: the most prompt tokens one step can take (the step
    budget, capped by the context), which bounds the crossover search. ``decode_steps``: the
    decode tokens; ``verifies`` (speculative decoding): each decode step's (rows, tokens
    emitted), whose emitted tokens sum to ``decode_steps``. ``kv_dtype``: the K/V cache's,
    when it is not the weights' (int8 weights keep the model's K/V). ``contention``: other
    processes' share of the CPUs around the run (``phasewise.perf.contention``), which is
    what a phase far above its roofline is blamed on where it is high; None: unknown.
    ``*_forward_s``: the part of ``prefill_s`` / ``decode_s`` the forward passes took
    (``StepStats.forward_s`` summed), which splits a phase far above its roofline into the
    kernels' time and the host's; None: not measured, and the excess is left unexplained.
    ``moe_dtype``: how an MoE's experts are stored, where not ``weight_dtype`` (int8
    weights keep the model's experts). ``threads``: the CPU threads the kernels ran on; where
    other work contended for the CPUs and there were several, the blame says that fewer
    could run faster (each kernel's threads wait for the one that lost its core).
    """
    pre_roof = Roofline(shape, accel, weight_dtype, kv_dtype, compute_dtype=prefill_compute,
                        moe_dtype=moe_dtype)
    dec_roof = Roofline(shape, accel, weight_dtype, kv_dtype, compute_dtype=decode_compute,
                        moe_dtype=moe_dtype)
    prompt_len = sum(prefill_chunks)
    peaks = ", ".join(f"{d} matmul {r.peak_flops / 1e9:.1f} GFLOP/s"
                      for d, r in {prefill_compute: pre_roof, decode_compute: dec_roof}.items())
    ridges = " / ".join(dict.fromkeys(f"{r.peak_flops / r.bandwidth:.1f}"
                                      for r in (pre_roof, dec_roof)))
    lines = [f"[roofline] this machine ({accel.key}): {peaks}, read "
             f"{pre_roof.bandwidth / 1e9:.1f} GB/s: ridge {ridges} FLOP/byte; weights "
             f"{pre_roof.weight_bytes / 1e6:.1f} MB ({_stored(pre_roof)})"]
    pre = replace(prefill_cost(pre_roof, prefill_chunks, prefill_s),
                  forward_s=prefill_forward_s)
    lines.append(_phase_line(pre, _ms(prefill_s)) + f" {_ms(pre.t_bound)}")
    phases = [pre]
    dec = None
    if decode_steps > 0:
        dec = replace(decode_cost(dec_roof, prompt_len, decode_steps, decode_s, verifies),
                      forward_s=decode_forward_s)
        per_step = f" ({_ms(decode_s / dec.steps)}/step)" if verifies else ""
        lines.append(_phase_line(dec, _ms(decode_s / decode_steps) + "/token" + per_step,
                                 decode_steps if verifies else None)
                     + f" {_ms(dec.t_bound / decode_steps)}")
        phases.append(dec)

    def verdict(p: PhaseCost, compute: str) -> str:
        noise = noise_factor(accel, compute)
        if noise is not None and p.margin < noise:
            return (f"{p.name} was {p.bound}-bound by {p.margin:.2f}x, within the noise of "
                    f"this machine's unstable peaks (x{noise:.2f}): either bound")
        return f"{p.name} was {p.bound}-bound"

    verdicts = [verdict(p, c) for p, c in zip(phases, (prefill_compute, decode_compute))]
    # a hedged verdict ends in a clause of its own: "and" would run it into the next one
    said = ("; " if any(v.endswith("either bound") for v in verdicts) else " and ").join(
        verdicts)
    flips = []
    crossover = compute_bound_prompt_len(pre_roof, max(1, max_step_tokens))
    if pre.bound == "memory":
        flips.append(f"a prompt chunk of {crossover} tokens or more would make prefill "
                     "compute-bound" if crossover else
                     f"no prompt chunk up to the {max_step_tokens}-token step limit would "
                     "make prefill compute-bound")
    elif crossover and crossover > 1:
        flips.append(f"prompt chunks under {crossover} tokens would leave prefill memory-bound")
    if dec is not None and dec.bound == "memory":
        context = prompt_len + decode_steps
        batch = dec_roof.critical_batch(context)
        flips.append(f"decode would need a batch of ~{max(2, math.ceil(batch))} sequences to "
                     "turn compute-bound" if batch else
                     "decode stays memory-bound at any batch at this context")
        limit = dec_roof.never_compute_bound_context()
        if batch and limit is not None and context >= limit / 2:
            # the batch grows without bound as the context nears the limit: a figure this
            # close to it says little beyond "not at any batch a server runs"
            flips[-1] += (f" at a context of {context} tokens, which nears the {limit:.0f} "
                          "past which decode never turns compute-bound at any batch")
    # The crossovers move with the ridge (peak over bandwidth): from unstable peaks they are
    # as unsure as the verdicts, and say so.
    noisy = [n for n in (noise_factor(accel, prefill_compute),
                         noise_factor(accel, decode_compute)) if n is not None]
    if flips and noisy:
        flips[-1] += (f" (from unstable peaks: the ridge these come from could be off by up to "
                      f"x{max(noisy):.2f})")
    lines.append(f"[bound]    on this machine {said}" + ("; " + "; ".join(flips) if flips
                                                           else "") + ".")
    slow = [p for p in phases if p.vs_roofline > OVERHEAD_RATIO]
    fast = [p for p in phases if p.vs_roofline < 1.0 and p.bound == "memory"]
    contended = contention if contention is not None and contention.shared else None
    blame = ("the excess is that contention, not this work; the verdicts above may differ on "
             "a quiet machine")
    if threads is not None and threads > 1:
        blame += f"; {fewer_threads(threads)} while the machine is busy"
    # the most the contention can explain (None: no bound, with several threads)
    most = contended.most_slowdown(threads) if contended is not None else None
    for p in slow:  # one line each: how its time splits, then what the excess is
        # one decimal below 10x, as the [roofline] lines print the same ratio
        times = f"{p.vs_roofline:.1f}" if p.vs_roofline < 10 else f"{p.vs_roofline:.0f}"
        line = f"[bound]    {p.name} ran {times}x above the roofline time"
        split = _split_words(p)
        if contended is not None and most is not None and p.vs_roofline > most:
            # more than the load can explain: it is named, and so is the rest
            load = (f"{contended.words()}, which can explain up to ~{most:.0f}x, not "
                    f"{times}x")
            line += (f": {split}; {load}: beyond it, {_excess_words(p)}" if split is not None
                     else f" while {load}: the rest is not explained by this step's work as "
                     "the roofline counts it (arithmetic, weight and K/V reads), and its "
                     "forward pass was not timed apart from the host's work")
        elif split is None and contended is not None:
            line += f" while {contended.words()}: {blame}"
        elif split is None:
            load = (f"with the CPUs to itself ({contention.words()})" if contention is not None
                    else "(this machine's load during the run is unknown)")
            line += (f" {load}: not explained by this step's work as the roofline counts it "
                     "(arithmetic, weight and K/V reads), and its forward pass was not timed "
                     "apart from the host's work")
        elif contended is not None:
            line += f": {split}; {contended.words()}: {blame}"
        else:
            load = (f"with the CPUs to itself ({contention.words()})" if contention is not None
                    else "with this machine's load during the run unknown")
            line += f": {split}; {load}, {_excess_words(p)}"
        lines.append(line)
    if fast and accel.key == "cpu-local":
        lines.append("[bound]    " + " and ".join(p.name for p in fast) + " beat the "
                     "roofline time, which assumes DRAM bandwidth: the "
                     f"{pre_roof.weight_bytes / 1e6:.0f} MB of weights stay in the CPU caches")
    return lines
