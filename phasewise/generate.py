"""``phasewise generate``: one prompt, streamed, then what each phase cost.

The steps: load the model (one line on stderr), run a short warm-up request so that one-time
costs stay out of the figures, stream the completion to stdout, then print on stderr the
prefill (its engine steps, prompt tokens per second, TTFT) and the decode (tokens, TPOT), and,
unless asked not to, both phases against this machine's measured roofline
(``phasewise.perf.explain``; a quick ``phasewise measure`` of what is missing the first time).
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO


@dataclass(frozen=True)
class GenerateOptions:
    """What one ``generate`` run does besides loading: the request and what to print."""

    prompt: str
    max_tokens: int = 64
    temperature: float | None = None  # None: the checkpoint's generation_config.json
    sample_seed: int | None = None
    chat: bool = False  # wrap the prompt in the checkpoint's chat template
    roofline: bool = True  # the closing [roofline] / [bound] lines


# generate's flags for the sampling fields they set, as its errors name them
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature",
                  "seed": "--sample-seed"}


def check_sampling(overrides: dict[str, Any]) -> None:
    """Refuse sampling values no request could take, naming the flag that gave each."""
    from phasewise import SamplingParams
    from phasewise.engine.validation import ValidationError

    try:
        SamplingParams(**overrides)
    except ValidationError as e:
        flag = SAMPLING_FLAGS.get(e.param or "")
        if flag is None:
            raise
        raise ValueError(f"{flag}{e.message[len(e.param or ''):]}".replace(", or unset", "")
                         if e.message.startswith(e.param or "\0") else
                         f"{flag}: {e.message}") from None


def run(model: str, engine_kwargs: dict[str, Any], opts: GenerateOptions,
        out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Load ``model`` with ``engine_kwargs`` (``EngineConfig`` fields), stream ``opts.prompt``
    to ``out`` and report both phases on ``err``. Returns the exit status."""
    from phasewise import LLM
    from phasewise.perf.contention import Contention, CpuSample

    out = out or sys.stdout
    err = err or sys.stderr
    # the machine's load over the whole command (this process's own work excluded):
    # [bound]'s evidence when a phase runs far above its roofline
    before = CpuSample.now()
    from phasewise.model.cpu.kernels import KERNELS

    overrides: dict[str, Any] = {"max_tokens": opts.max_tokens}
    if opts.temperature is not None:
        overrides["temperature"] = opts.temperature
    if opts.sample_seed is not None:
        overrides["seed"] = opts.sample_seed
    check_sampling(overrides)  # before the load, which can take minutes
    compiled_before = KERNELS.compile_s  # (a sum over the process: this load's share)
    t0 = time.monotonic()
    llm = LLM(model, **engine_kwargs)
    eng = llm.engine
    quant = f", {eng.config.quantization} weights" if eng.config.quantization else ""
    took = time.monotonic() - t0
    built = KERNELS.compile_s - compiled_before
    compiled = f" (and {built:.1f} s compiling the CPU kernels, once)" if built else ""
    print(f"loaded {eng.model_config.architecture} ({eng.model_config.num_params / 1e6:.1f} M "
          f"parameters, {str(eng.dtype).removeprefix('torch.')}{quant}, {eng.device}) in "
          f"{took - built:.1f} s{compiled}", file=err)
    if eng.cpu_backend is not None:  # where the plan came from, then what it runs
        print(f"[plan]     {eng.cpu_backend.plan_line()}", file=err)
        print(f"[kernels]  {eng.cpu_backend.kernels_line()}", file=err)
    if eng.device.type == "cuda":
        graphs = ("CUDA graphs for decode steps of up to "
                  f"{eng.runner.graphs.max_batch} rows" if eng.runner.graphs is not None
                  else "eager steps (enforce_eager)")
        print(f"[kernels]  {eng.gpu_kernels}; {graphs}", file=err)
    params = eng.default_sampling_params(**overrides)
    prompt: str | list[int] = opts.prompt
    if opts.chat:  # the template places any BOS itself, as the server's chat route does
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": opts.prompt}]), add_special_tokens=False)
    warm_up(llm)
    n0 = len(eng.step_stats)
    final = None
    echo = out.isatty() and not opts.chat
    for final in llm.stream(prompt, params):
        if echo:  # on a terminal, the prompt first, once the engine has accepted it
            out.write(opts.prompt)
            echo = False
        out.write(final.delta_text)
        out.flush()
    out.write("\n")
    out.flush()
    if final is None:
        return 1
    contention = Contention.between(before, CpuSample.now())
    m = final.metrics
    n_prompt, n_out = len(final.prompt_token_ids), len(final.token_ids)
    run_steps = list(eng.step_stats)[n0:]
    prefill_steps = [s for s in run_steps if s.num_prefill_tokens]
    chunks = [s.num_prefill_tokens for s in prefill_steps]
    prefill_s = sum(s.duration_s for s in prefill_steps)
    decode_s = (m.token_times[-1] - m.token_times[0]) if n_out > 1 else 0.0
    steps_text = (f"{len(chunks)} steps of " + " + ".join(map(str, chunks))
                  if len(chunks) > 1 else "1 step")
    ttft = ttft_words(m.ttft, prefill_s)
    print(f"[prefill]  {n_prompt} prompt tokens, {steps_text}, {prefill_s * 1e3:.1f} ms: "
          f"{n_prompt / max(prefill_s, 1e-9):.0f} tok/s{ttft}", file=err)
    verifies = None
    if n_out == 0:
        print(f"[decode]   none: no output token was asked for (--max-tokens 0); finish: "
              f"{final.finish_reason}", file=err)
    elif n_out > 1:
        cut = ""
        if final.finish_reason == "length" and n_out < params.max_tokens:
            cut = (f" (the model's context of {eng.max_model_len} tokens, prompt included, "
                   f"ended it before --max-tokens {params.max_tokens})")
        print(f"[decode]   {n_out - 1} tokens, {decode_s * 1e3:.1f} ms: "
              f"{(n_out - 1) / max(decode_s, 1e-9):.0f} tok/s (TPOT {m.tpot * 1e3:.1f} ms); "
              f"finish: {final.finish_reason}{cut}", file=err)
        if eng.proposer is not None:
            verifies = speculation_lines(run_steps, n_out - 1, err, eng.draft_policy)
    else:
        print(f"[decode]   no decode step: the only token came with the prefill; finish: "
              f"{final.finish_reason}", file=err)
    for line in (experts_line(eng, prefill_steps, run_steps), window_line(eng, run_steps)):
        if line is not None:
            print(line, file=err)
    if opts.roofline:
        decode_steps = [s for s in run_steps if s.num_decode_tokens and not s.num_prefill_tokens]
        forward = (forward_sum(prefill_steps), forward_sum(decode_steps) if n_out > 1 else None)
        for line in roofline_lines(llm, chunks, prefill_s, max(n_out - 1, 0), decode_s, verifies,
                                   contention, forward):
            print(line, file=err)
    return 0


def ttft_words(ttft: float | None, prefill_s: float) -> str:
    """The ``[prefill]`` line's TTFT clause; a TTFT well short of the prefill steps' time
    says why (the token is stamped when sampled, and its step's output work comes after)."""
    if ttft is None:
        return ""
    words = f"; TTFT {ttft * 1e3:.1f} ms"
    if prefill_s - ttft > max(1e-3, 0.1 * prefill_s):  # (not a hair's breadth)
        words += (" (stamped when the token was sampled; the step's work on its outputs came "
                  "after, within its time)")
    return words


def experts_line(eng: Any, prefill_steps: list[Any], run_steps: list[Any]) -> str | None:
    """A mixture of experts: the experts each phase's steps read (the engine's count,
    ``StepStats.experts_read``) and what that made of a decode step's weight bytes; None for
    a dense model."""
    decode = [s.experts_read for s in run_steps if s.num_decode_tokens
              and not s.num_prefill_tokens and s.experts_read is not None]
    pre = [s.experts_read for s in prefill_steps if s.experts_read is not None]
    if not decode and not pre:
        return None
    from phasewise.perf.models import ModelShape

    shape = ModelShape.from_path(eng.config.model)
    e, k = shape.num_experts, shape.experts_per_token
    from phasewise.perf.attribution import engine_weight_dtype
    from phasewise.perf.roofline import DTYPE_BYTES

    # int8 quantizes the attention and the LM head; the experts keep the model's dtype
    moe_wbytes = eng.dtype.itemsize
    wbytes = DTYPE_BYTES[engine_weight_dtype(eng)]
    parts = []
    if pre:
        parts.append(f"prefill read {sum(pre) / len(pre):.1f} of {e} experts a layer")
    if decode:
        x = sum(decode) / len(decode)
        read = shape.weight_bytes(wbytes, moe_wbytes, x)
        parts.append(f"decode {x:.1f} (its {k} a token): a decode step reads "
                     f"{read / 1e6:.3g} MB of the model's "
                     f"{shape.weight_bytes(wbytes, moe_wbytes) / 1e6:.3g}"
                     " MB of weights, and its bound follows those bytes")
    return "[experts]  " + ", ".join(parts)


def window_line(eng: Any, run_steps: list[Any]) -> str | None:
    """A model with sliding windows: how much of the last decode's context its K/V reads
    covered (the engine's count, ``StepStats.kv_read``), in bytes a step, and whether the
    blocks behind the window went back to the pool; None where every layer reads the whole
    context."""
    decode = [s for s in run_steps if s.num_decode_tokens and not s.num_prefill_tokens
              and s.kv_context]
    if not decode:
        return None
    mc = eng.model_config
    windows = [mc.window_of(i) for i in range(mc.num_layers)]
    w = next(x for x in windows if x)
    windowed = sum(1 for x in windows if x)
    last = decode[-1]
    per_pos = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * eng.dtype.itemsize
    ctx, read = last.kv_context / last.num_decode_tokens, last.kv_read / last.num_decode_tokens
    head = f"[window]   {w}-token sliding window on {windowed} of {len(windows)} layers: "
    if ctx <= w:
        return (head + f"the last decode's {ctx:.0f} positions all lie inside it, so its K/V "
                f"reads ({_size(ctx * per_pos)} a step) grow with the context until "
                f"position {w}")
    bytes_read = f"{_size(read * per_pos)} of {_size(ctx * per_pos)} a step"
    if windowed == len(windows):
        return (head + f"the last decode read the K/V of {w} of its {ctx:.0f} positions "
                f"({bytes_read}): its K/V reads stopped growing at position {w} where the "
                "window binds; the blocks behind the window went back to the pool")
    return (head + f"the last decode read the K/V of {w} of its {ctx:.0f} positions in the "
            f"windowed layers and all {ctx:.0f} in the others ({bytes_read}): the windowed "
            f"layers' reads stopped growing at position {w}, the others' grow with the "
            "context; the pool keeps every block, which those layers read")


def _size(n: float) -> str:
    """Bytes in kB, MB or GB (three figures)."""
    unit, scale = next(((u, x) for u, x in (("GB", 1e9), ("MB", 1e6)) if n >= x), ("kB", 1e3))
    return f"{n / scale:.3g} {unit}"


def forward_sum(steps: list[Any]) -> float | None:
    """The steps' summed forward-pass time (``StepStats.forward_s``); None where any step's
    was not measured, or there is no step."""
    times = [s.forward_s for s in steps]
    return None if not times or None in times else sum(times)


def speculation_lines(steps: list[Any], decoded: int, err: TextIO,
                      policy: Any = None) -> list[tuple[int, int]]:
    """Print the run's speculative decoding figures: drafts and tokens per weight read, the
    speedup over plain decode measured in this run (``plain_speedup_line``), and what the
    draft ``policy`` (if any) decided. Returns each decode step's (rows, tokens emitted) for
    the roofline (the last step's emitted count is what the output's end left of it)."""
    dec = [s for s in steps if s.num_decode_tokens and not s.num_prefill_tokens]
    verifies = [(s.num_decode_tokens, 1 + s.num_spec_accepted) for s in dec]
    if verifies:
        rows, emitted = verifies[-1]
        verifies[-1] = (rows, max(1, emitted - (sum(e for _, e in verifies) - decoded)))
    proposed = sum(s.num_spec_proposed for s in dec)
    accepted = sum(s.num_spec_accepted for s in dec)
    rate = f"{accepted / proposed:.0%}" if proposed else "n/a"
    print(f"[speculative] ngram: {proposed} draft tokens proposed, {accepted} accepted "
          f"({rate}); {decoded} tokens in {len(dec)} decode steps: "
          f"{decoded / max(len(dec), 1):.2f} tokens per weight read", file=err)
    if dec:
        print(f"[speculative] {plain_speedup_line(dec, [e for _, e in verifies])}", file=err)
    if policy is not None:
        print(f"[speculative] {policy_line(policy.describe())}", file=err)
    return verifies


def plain_speedup_line(dec: list[Any], emitted: list[int]) -> str:
    """Speculative decoding's speedup over plain decode in this run, and what it is measured
    against: the median time of this run's own plain decode steps (decode-only steps that
    verified no draft) of the same batch. ``dec``: the run's decode-only steps; ``emitted``:
    the tokens each gave.

    The figure is (tokens emitted x plain step time) / (time the decode steps take), each
    step priced at the median of its kind (plain or with drafts, at its batch): a stall of a
    busy machine lands on a few steps of either kind, and priced at their own times those
    would count as speculation's cost (or gain). That is tokens per weight read x (plain step
    / mean step). A step with drafts reads the weights once as a plain step does and computes
    more rows, so it cannot be cheaper: a figure above tokens per weight read is timing noise,
    and the line gives the bound instead, with the measured figure and why. Without a plain
    step to compare with, no figure is given, only that bound and why."""
    per_read = sum(emitted) / len(dec)
    plain: dict[int, list[float]] = {}
    for s in dec:
        if not s.num_spec_proposed:
            plain.setdefault(s.num_requests, []).append(s.duration_s)
    missing = sorted({s.num_requests for s in dec} - set(plain))
    if missing:
        why = ("no decode step of this run went without drafts" if not plain else
               "no plain decode step of this run at batch " + ", ".join(map(str, missing)))
        return (f"speedup over plain decode: not measured ({why}, so there is nothing "
                f"to compare with); at most x{per_read:.2f}, the tokens per weight read, if "
                "a step with drafts costs at least what a plain one does")
    drafted: dict[int, list[float]] = {}
    for s in dec:
        if s.num_spec_proposed:
            drafted.setdefault(s.num_requests, []).append(s.duration_s)
    base = {n: statistics.median(t) for n, t in plain.items()}
    draft_med = {n: statistics.median(t) for n, t in drafted.items()}
    taken = sum(draft_med[s.num_requests] if s.num_spec_proposed else base[s.num_requests]
                for s in dec)
    would = sum(e / max(s.num_requests, 1) * base[s.num_requests]
                for s, e in zip(dec, emitted))
    n_plain = sum(len(t) for t in plain.values())
    n_draft = len(dec) - n_plain
    batches = ", ".join(map(str, sorted(base)))
    each = f" of {base[min(base)] * 1e3:.2f} ms" if len(base) == 1 else ""
    rough = (f"; rough: {n_plain} plain step{'s' * (n_plain != 1)} only" if n_plain < 3
             else "")
    speedup = would / max(taken, 1e-12)
    figure = f"x{speedup:.2f}"
    if speedup > per_read:  # its steps with drafts beat its plain ones: noise
        figure = (f"at most x{per_read:.2f}, the tokens per weight read; measured "
                  f"x{speedup:.2f}, but its steps with drafts took less than its plain ones, "
                  "so the timings are noisy")
    return (f"speedup over plain decode: {figure} ({sum(emitted)} tokens in {len(dec)} "
            f"decode steps, {n_draft} with drafts: {taken * 1e3:.1f} ms at each kind's median "
            f"step time, where plain steps{each} would take {would * 1e3:.1f} ms; medians of "
            f"this run's {n_plain} plain and {n_draft} drafting decode steps at batch "
            f"{batches}, so that a stall of the machine is not counted as speculation's"
            f"{rough})")


def policy_line(described: str) -> str:
    """The draft policy's decisions by batch size, without its speed figure: that one is its
    own running estimate (drafting steps only, recent ones weighted most, against plain-step
    times kept since the engine started, warm-up included), not this run's speedup."""
    decisions = re.sub(r"x\d+(?:\.\d+)?, ", "", described)
    if "drafting / plain speed by decoding batch: " not in decisions:
        return decisions  # nothing measured yet
    return (decisions.replace("drafting / plain speed by decoding batch: ",
                              "draft policy by decoding batch: ")
            + " (decided on its running estimate over recent drafting steps)")


def warm_up(llm: Any) -> None:
    """One greedy 2-token request, so that one-time costs (buffers, first kernel calls) stay
    out of the figures that follow; they are the steady state a server shows. Its prompt is
    one token repeated, one row past the reach of the kernel and of the AVX512_BF16 tier in
    the linear plan (65 rows when the kernel takes every row count), so the prefill path a
    real prompt takes is warm too (and no real prompt shares its prefix)."""
    from phasewise import SamplingParams
    from phasewise.model.cpu.plan import ALL_ROWS

    eng = llm.engine
    plan = eng.linear_plan
    kernel_max = plan.kernel_max_rows if plan is not None else 0
    if plan is not None and plan.mid is not None:  # past the AVX512_BF16 tier too
        kernel_max = max(kernel_max, plan.mid_max_rows)
    # Past the fused decode layer's few rows the kernel's tiles take over: 65 rows warm them.
    rows = 65 if kernel_max >= ALL_ROWS else kernel_max + 1
    rows = max(2, min(rows, eng.max_model_len - 2))
    filler = llm.tokenizer.encode(" ", add_special_tokens=False)[:1] or [0]
    llm.generate(filler * rows, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


def roofline_lines(llm: Any, prefill_chunks: list[int], prefill_s: float, decode_steps: int,
                   decode_s: float, verifies: list[tuple[int, int]] | None = None,
                   contention: Any = None,
                   forward: tuple[float | None, float | None] = (None, None)) -> list[str]:
    """The run's two phases against this machine's measured roofline (phasewise.perf).
    ``forward``: the seconds of the prefill's and of the decode's forward passes."""
    import torch

    from phasewise.perf.attribution import engine_compute_dtype, engine_weight_dtype
    from phasewise.perf.explain import explain_generation
    from phasewise.perf.measure import ensure_local
    from phasewise.perf.models import ModelShape
    from phasewise.perf.roofline import norm_dtype

    eng = llm.engine
    arithmetic = engine_compute_dtype(eng)
    pre, dec = arithmetic(max(prefill_chunks)), arithmetic(1)
    accel = ensure_local(str(eng.device), tuple(dict.fromkeys((pre, dec))))
    model_dtype = norm_dtype(str(eng.dtype).removeprefix("torch."))
    return explain_generation(ModelShape.from_path(eng.config.model), accel,
                              engine_weight_dtype(eng), pre, dec,
                              prefill_chunks, prefill_s, decode_steps, decode_s,
                              min(eng.scheduler.config.max_num_batched_tokens,
                                  eng.max_model_len), verifies,
                              model_dtype, contention,
                              prefill_forward_s=forward[0], decode_forward_s=forward[1],
                              moe_dtype=model_dtype,
                              threads=torch.get_num_threads() if eng.device.type == "cpu"
                              else None)
