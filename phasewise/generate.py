"""``phasewise generate``: one prompt, streamed, then what each phase cost.

The steps: load the model (one line on stderr), run a short warm-up request so that one-time
costs stay out of the figures, stream the completion to stdout, then print on stderr the
prefill (its engine steps, prompt tokens per second, TTFT) and the decode (tokens, TPOT), and,
unless asked not to, both phases against this machine's measured roofline
(``phasewise.perf.explain``; a quick ``phasewise measure`` of what is missing the first time).
"""

from __future__ import annotations

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


def run(model: str, engine_kwargs: dict[str, Any], opts: GenerateOptions,
        out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Load ``model`` with ``engine_kwargs`` (``EngineConfig`` fields), stream ``opts.prompt``
    to ``out`` and report both phases on ``err``. Returns the exit status."""
    from phasewise import LLM

    out = out or sys.stdout
    err = err or sys.stderr
    t0 = time.monotonic()
    llm = LLM(model, **engine_kwargs)
    eng = llm.engine
    quant = f", {eng.config.quantization} weights" if eng.config.quantization else ""
    print(f"loaded {eng.model_config.architecture} ({eng.model_config.num_params / 1e6:.1f} M "
          f"parameters, {str(eng.dtype).removeprefix('torch.')}{quant}, {eng.device}) in "
          f"{time.monotonic() - t0:.1f} s", file=err)
    if eng.cpu_backend is not None:  # where the plan came from, then what it runs
        print(f"[plan]     {eng.cpu_backend.plan_line()}", file=err)
        print(f"[kernels]  {eng.cpu_backend.kernels_line()}", file=err)
    if eng.device.type == "cuda":
        graphs = ("CUDA graphs for decode steps of up to "
                  f"{eng.runner.graphs.max_batch} rows" if eng.runner.graphs is not None
                  else "eager steps (enforce_eager)")
        print(f"[kernels]  {eng.gpu_kernels}; {graphs}", file=err)
    overrides: dict[str, Any] = {"max_tokens": opts.max_tokens}
    if opts.temperature is not None:
        overrides["temperature"] = opts.temperature
    if opts.sample_seed is not None:
        overrides["seed"] = opts.sample_seed
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
    m = final.metrics
    n_prompt, n_out = len(final.prompt_token_ids), len(final.token_ids)
    run_steps = list(eng.step_stats)[n0:]
    prefill_steps = [s for s in run_steps if s.num_prefill_tokens]
    chunks = [s.num_prefill_tokens for s in prefill_steps]
    prefill_s = sum(s.duration_s for s in prefill_steps)
    decode_s = (m.token_times[-1] - m.token_times[0]) if n_out > 1 else 0.0
    steps_text = (f"{len(chunks)} steps of " + " + ".join(map(str, chunks))
                  if len(chunks) > 1 else "1 step")
    print(f"[prefill]  {n_prompt} prompt tokens, {steps_text}, {prefill_s * 1e3:.1f} ms: "
          f"{n_prompt / max(prefill_s, 1e-9):.0f} tok/s; TTFT {m.ttft * 1e3:.1f} ms", file=err)
    verifies = None
    if n_out > 1:
        print(f"[decode]   {n_out - 1} tokens, {decode_s * 1e3:.1f} ms: "
              f"{(n_out - 1) / max(decode_s, 1e-9):.0f} tok/s (TPOT {m.tpot * 1e3:.1f} ms); "
              f"finish: {final.finish_reason}", file=err)
        if eng.proposer is not None:
            verifies = speculation_lines(run_steps, n_out - 1, err)
            if eng.draft_policy is not None:
                print(f"[speculative] {eng.draft_policy.describe()}", file=err)
    else:
        print(f"[decode]   no decode step: the only token came with the prefill; finish: "
              f"{final.finish_reason}", file=err)
    if opts.roofline:
        for line in roofline_lines(llm, chunks, prefill_s, n_out - 1, decode_s, verifies):
            print(line, file=err)
    return 0


def speculation_lines(steps: list[Any], decoded: int, err: TextIO) -> list[tuple[int, int]]:
    """Print the run's speculative decoding figures; returns each decode step's (rows,
    tokens emitted) for the roofline (the last step's emitted count is what the output's end
    left of it)."""
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
    return verifies


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
                   decode_s: float, verifies: list[tuple[int, int]] | None = None
                   ) -> list[str]:
    """The run's two phases against this machine's measured roofline (phasewise.perf)."""
    from phasewise.perf.attribution import engine_compute_dtype, engine_weight_dtype
    from phasewise.perf.explain import explain_generation
    from phasewise.perf.measure import ensure_local
    from phasewise.perf.models import ModelShape
    from phasewise.perf.roofline import norm_dtype

    eng = llm.engine
    arithmetic = engine_compute_dtype(eng)
    pre, dec = arithmetic(max(prefill_chunks)), arithmetic(1)
    accel = ensure_local(str(eng.device), tuple(dict.fromkeys((pre, dec))))
    return explain_generation(ModelShape.from_path(eng.config.model), accel,
                              engine_weight_dtype(eng), pre, dec,
                              prefill_chunks, prefill_s, decode_steps, decode_s,
                              min(eng.scheduler.config.max_num_batched_tokens,
                                  eng.max_model_len), verifies,
                              norm_dtype(str(eng.dtype).removeprefix("torch.")))
