"""``phasewise``: one entry point. Argument parsing only; the work lives in the rooms."""

from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint folder (default: the bundled stdlib-coder)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 512MiB or 4GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per engine step (default: 256 on CPU, 2048 on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--policy", default="chunked", choices=["chunked", "prefill-first"])
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", default="auto", choices=["auto", "torch"],
                   help="auto: phasewise's CPU kernels for bf16 models on CPU; torch: none")


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
                block_size=a.block_size, kv_cache_memory=a.kv_cache_memory,
                max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                policy=a.policy, enable_prefix_caching=not a.no_prefix_caching, seed=a.seed,
                kernels=a.kernels)


def _model_arg(a: argparse.Namespace) -> str:
    from phasewise.config import resolve_model

    model = resolve_model(a.model)
    if a.model is None:
        print(f"model: stdlib-coder, the bundled default ({model}); --model DIR for another",
              file=sys.stderr)
    return model


def _compute_dtype(eng, dtype: str, rows: int) -> str:
    """Whose peak ``rows`` activation rows of a linear layer run at in this engine."""
    if eng.device.type != "cpu":
        return dtype
    if eng.linear_plan is not None:  # bf16 weights: the calibrated plan decides per row count
        return eng.linear_plan.compute_dtype(rows)
    # CPU fp16 has no measured peak (its matmul is an emulation); rate it against fp32.
    return "fp32" if dtype == "fp16" else dtype


def _roofline_lines(llm, prefill_chunks: list[int], prefill_s: float, decode_steps: int,
                    decode_s: float) -> list[str]:
    """The run's two phases against this machine's measured roofline (phasewise.perf)."""
    from phasewise.perf.explain import explain_generation
    from phasewise.perf.measure import ensure_local
    from phasewise.perf.models import ModelShape
    from phasewise.perf.roofline import norm_dtype

    eng = llm.engine
    dtype = norm_dtype(str(eng.dtype).removeprefix("torch."))
    pre = _compute_dtype(eng, dtype, max(prefill_chunks))
    dec = _compute_dtype(eng, dtype, 1)
    accel = ensure_local(str(eng.device), tuple(dict.fromkeys((pre, dec))))
    return explain_generation(ModelShape.from_path(eng.config.model), accel, dtype, pre, dec,
                              prefill_chunks, prefill_s, decode_steps, decode_s,
                              min(eng.scheduler.config.max_num_batched_tokens,
                                  eng.max_model_len))


def cmd_generate(a: argparse.Namespace) -> int:
    from phasewise import LLM, SamplingParams

    model = _model_arg(a)
    t0 = time.monotonic()
    llm = LLM(model, **_engine_kwargs(a))
    eng = llm.engine
    print(f"loaded {eng.model_config.architecture} ({eng.model_config.num_params / 1e6:.1f} M "
          f"parameters, {str(eng.dtype).removeprefix('torch.')}, {eng.device}) in "
          f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
    params = eng.default_sampling_params(
        max_tokens=a.max_tokens, **({"temperature": a.temperature} if a.temperature is not None
                                    else {}), **({"seed": a.sample_seed} if a.sample_seed
                                                 is not None else {}))
    prompt: str | list[int] = a.prompt
    if a.chat:  # the template places any BOS itself, as the server's chat route does
        prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": a.prompt}]), add_special_tokens=False)
    # Warm-up: one greedy 2-token request first, so that one-time costs (buffers, first
    # kernel calls) stay out of the figures below; they are the steady state a server shows.
    # Its prompt is one token repeated, one row past the decode kernel's reach, so the
    # prefill path a real prompt takes is warm too (and no real prompt shares its prefix).
    rows = (eng.linear_plan.kernel_max_rows if eng.linear_plan is not None else 0) + 1
    rows = max(2, min(rows, eng.max_model_len - 2))
    filler = llm.tokenizer.encode(" ", add_special_tokens=False)[:1] or [0]
    llm.generate(filler * rows, SamplingParams(temperature=0.0, max_tokens=2,
                                               ignore_eos=True))
    n0 = len(eng.step_stats)
    out = None
    echo = sys.stdout.isatty() and not a.chat
    for out in llm.stream(prompt, params):
        if echo:  # on a terminal, the prompt first, once the engine has accepted it
            sys.stdout.write(a.prompt)
            echo = False
        sys.stdout.write(out.delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if out is None:
        return 1
    m = out.metrics
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    steps = list(eng.step_stats)[n0:]
    prefill_steps = [s for s in steps if s.num_prefill_tokens]
    prefill_s = sum(s.duration_s for s in prefill_steps)
    decode_s = (m.token_times[-1] - m.token_times[0]) if n_out > 1 else 0.0
    steps_text = (f"{len(prefill_steps)} steps of "
                  + " + ".join(str(s.num_prefill_tokens) for s in prefill_steps)
                  if len(prefill_steps) > 1 else "1 step")
    print(f"[prefill]  {n_prompt} prompt tokens, {steps_text}, {prefill_s * 1e3:.1f} ms: "
          f"{n_prompt / max(prefill_s, 1e-9):.0f} tok/s; TTFT {m.ttft * 1e3:.1f} ms",
          file=sys.stderr)
    if n_out > 1:
        print(f"[decode]   {n_out - 1} tokens, {decode_s * 1e3:.1f} ms: "
              f"{(n_out - 1) / max(decode_s, 1e-9):.0f} tok/s (TPOT {m.tpot * 1e3:.1f} ms); "
              f"finish: {out.finish_reason}", file=sys.stderr)
    else:
        print(f"[decode]   no decode step: the only token came with the prefill; finish: "
              f"{out.finish_reason}", file=sys.stderr)
    if not a.no_roofline:
        for line in _roofline_lines(llm, [s.num_prefill_tokens for s in prefill_steps],
                                    prefill_s, n_out - 1, decode_s):
            print(line, file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=getattr(logging, a.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _serve(a)
    except KeyboardInterrupt:  # Ctrl-C while loading: nothing to drain
        print("phasewise: interrupted", file=sys.stderr)
        return 130


def _serve(a: argparse.Namespace) -> int:
    from phasewise.config import EngineConfig, parse_memory
    from phasewise.server.serve import build_server, run

    if not 0 < a.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {a.port}")
    server = build_server(
        EngineConfig(model=_model_arg(a), **_engine_kwargs(a)),
        served_model_name=a.served_model_name,
        log_interval_s=a.log_interval, api_key=a.api_key,
        max_waiting_requests=a.max_waiting_requests,
        max_request_bytes=parse_memory(a.max_request_size))
    try:
        run(server, host=a.host, port=a.port, shutdown_grace_s=a.shutdown_grace,
            log_level=a.log_level)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has drained and shut down
        pass
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from phasewise.bench.run import main as run_bench

    return run_bench(a)


def cmd_bench_report(a: argparse.Namespace) -> int:
    from phasewise.bench.report import render
    from phasewise.bench.summary import parse_slo

    out = render(a.results, a.output, stall_factor=a.stall_factor,
                 slo=parse_slo(a.goodput) or None)
    print(f"report written to {out}", file=sys.stderr)
    return 0


def build_report_parser() -> argparse.ArgumentParser:
    r = argparse.ArgumentParser(prog="phasewise bench report",
                                description="HTML report from benchmark result files")
    r.add_argument("results", nargs="+", help="result JSON files (phasewise bench, or "
                   "vllm bench serve --save-detailed)")
    r.add_argument("-o", "--output", default="bench-report.html")
    r.add_argument("--stall-factor", type=float, default=5.0,
                   help="mark a stall where a gap exceeds this x the median ITL")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLO lines to draw (default: the results' own)")
    r.set_defaults(func=cmd_bench_report)
    return r


def cmd_roofline(a: argparse.Namespace) -> int:
    import json

    from phasewise.perf.analysis import analyse, format_text
    from phasewise.perf.hardware import ACCELERATORS, LINKS, lookup_accelerator, lookup_link
    from phasewise.perf.models import CATALOG, GenericModel, lookup_model

    if a.list:
        print("accelerators: " + ", ".join(ACCELERATORS) + ", cpu-local, gpu-local")
        print("models: " + ", ".join(m.name for m in CATALOG.values()))
        print("links: " + ", ".join(LINKS))
        return 0
    if (a.model is None) == (a.params is None):
        raise ValueError("give exactly one of --model NAME|PATH or --params N (e.g. 7e9)")
    model = GenericModel(a.params) if a.params is not None else lookup_model(a.model)
    result = analyse(model, lookup_accelerator(a.gpu), a.dtype, prompt_len=a.prompt_len,
                     prefix_len=a.prefix_len, output_len=a.output_len, batch=a.batch,
                     context=a.context, kv_dtype=a.kv_dtype, mfu=a.mfu, mbu=a.mbu,
                     link=lookup_link(a.link) if a.link else None, reserve_frac=a.reserve,
                     compute_dtype=a.compute_dtype)
    if a.plot:
        from phasewise.perf.plot import plot_roofline

        print(f"plot written to {plot_roofline(result, a.plot)}", file=sys.stderr)
    print(json.dumps(result, indent=1) if a.json else format_text(result))
    return 0


def cmd_measure(a: argparse.Namespace) -> int:
    from pathlib import Path

    from phasewise.perf.measure import measure

    result = measure(Path(a.out) if a.out else None, quick=a.quick)
    for key, entry in result.items():
        peaks = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in entry["peak_flops"].items())
        print(f"{key}: {entry['name']}: read {entry['mem_bandwidth'] / 1e9:.1f} GB/s; {peaks}")
    return 0


def cmd_make_tiny(a: argparse.Namespace) -> int:
    from phasewise.model.tiny import make_tiny_checkpoint

    t = time.monotonic()
    path = make_tiny_checkpoint(a.out, architecture=a.arch, vocab_size=a.vocab_size,
                                hidden_size=a.hidden_size, num_layers=a.layers, seed=a.seed)
    print(f"wrote a random-weight {a.arch} checkpoint to {path} "
          f"({time.monotonic() - t:.1f}s)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasewise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion for one prompt")
    _add_engine_args(g)
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None,
                   help="default: the checkpoint's generation_config.json")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--no-roofline", action="store_true",
                   help="skip the closing lines that hold both phases against this machine's "
                   "roofline (they need phasewise measure's figures; a quick measurement is "
                   "made and saved the first time)")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (streaming, /metrics)")
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the folder's name)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait for the engine; beyond it new ones get 503")
    s.add_argument("--max-request-size", default="8MiB", help="request body size limit")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running streams get to finish after SIGTERM")
    s.add_argument("--log-interval", type=float, default=5.0,
                   help="seconds between throughput log lines (0: off)")
    s.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="load-test any OpenAI-compatible server "
                       "('phasewise bench report FILES' renders an HTML report)")
    from phasewise.bench.options import add_args as add_bench_args

    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("roofline", help="predict which bound each phase hits, for any model "
                       "x accelerator x workload (no GPU, no weights, no torch)")
    r.add_argument("--model", default=None, help="catalog name or a config.json / folder")
    r.add_argument("--params", type=float, default=None,
                   help="a generic dense model of this many parameters, e.g. 7e9")
    r.add_argument("--gpu", "--accelerator", dest="gpu", default="h100-sxm",
                   help="catalog key (see --list), or cpu-local / gpu-local (phasewise measure)")
    r.add_argument("--dtype", default="bf16", help="fp32, bf16, fp16, fp8, int8, int4")
    r.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: --dtype)")
    r.add_argument("--compute-dtype", default=None,
                   help="whose peak the math runs at (default: --dtype; fp32 for bf16 weights "
                        "on CPUs without native bf16)")
    r.add_argument("--prompt-len", type=int, default=512)
    r.add_argument("--prefix-len", type=int, default=0, help="cached prefix before the prompt")
    r.add_argument("--output-len", type=int, default=128)
    r.add_argument("--batch", type=int, default=1, help="decode batch")
    r.add_argument("--context", type=int, default=None,
                   help="decode context length (default: prompt + output/2; 0 = weights only)")
    r.add_argument("--mfu", type=float, default=1.0, help="fraction of peak FLOP/s reached")
    r.add_argument("--mbu", type=float, default=1.0, help="fraction of peak bandwidth reached")
    r.add_argument("--link", default=None, help="price a KV transfer over this link")
    r.add_argument("--reserve", type=float, default=0.1,
                   help="memory fraction kept free of weights and KV")
    r.add_argument("--json", action="store_true")
    r.add_argument("--plot", default=None, metavar="FILE.png")
    r.add_argument("--list", action="store_true", help="list catalog entries and exit")
    r.set_defaults(func=cmd_roofline)

    m = sub.add_parser("measure", help="measure this machine's bandwidth and matmul peaks "
                       "(the cpu-local / gpu-local accelerators)")
    m.add_argument("--out", default=None, help="file to write (default: the cache folder)")
    m.add_argument("--quick", action="store_true", help="fewer repetitions")
    m.set_defaults(func=cmd_measure)

    t = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint (HF layout)")
    t.add_argument("out")
    t.add_argument("--arch", default="LlamaForCausalLM",
                   choices=["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                            "Qwen3ForCausalLM"])
    t.add_argument("--vocab-size", type=int, default=512)
    t.add_argument("--hidden-size", type=int, default=64)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["bench", "report"]:
        args = build_report_parser().parse_args(argv[2:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"phasewise: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
