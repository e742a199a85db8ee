"""``phasewise``: one entry point. Argument parsing only; each command's work lives in its room
(``phasewise.generate``, ``phasewise.launch``, ``phasewise.bench``, ``phasewise.perf``).

The flags' choices and defaults come from the definitions they configure (``EngineConfig``
and its choice tuples, the scheduler's policies, the model registry's architectures).
Building the parser imports no torch, no HTTP stack: every command builds it.

Exit status and errors:

* a flag the command does not know, or a bad flag value: that command's usage and
  ``phasewise <command>: error: ...``, exit 2;
* an error in what was given (``ValueError`` or ``FileNotFoundError``: a missing model folder,
  a bad length distribution, an unknown accelerator; ``ConnectionError``: a server that
  cannot be reached): ``phasewise: error: ...``, exit 2;
* anything else is an internal error: one line ``phasewise: internal error: <type>: ...``,
  exit 1; ``--debug`` (on any command) prints the traceback before it;
* Ctrl-C: ``phasewise: interrupted``, exit 130 (``serve`` drains first and exits 0).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from dataclasses import fields
from pathlib import Path
from typing import Any

from phasewise.bench.options import http_url, positive_float
from phasewise.config import API_KEY_ENV

USER_ERRORS = (ValueError, FileNotFoundError, ConnectionError)
# plan --window: seconds of traffic a rate is simulated over (each such rate's requests are
# capped anyway; a longer window only makes a slower plan)
MAX_PLAN_WINDOW = 3600.0


def _plan_window(text: str) -> float:
    v = positive_float(text)
    if v > MAX_PLAN_WINDOW:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PLAN_WINDOW:g} s, got {text}")
    return v


def _roofline_dtype(text: str) -> str:
    """An argparse type: a roofline dtype or its alias, so that the error names the flag."""
    from phasewise.perf.roofline import norm_dtype

    try:
        return norm_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _threads(text: str) -> int:
    """An argparse type: a thread count from 1 to the cores this process may run on."""
    from phasewise.config import check_threads

    try:
        return check_threads(int(text) if text.strip().lstrip("+-").isdigit() else text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


THREADS_HELP = ("CPU threads for the kernels and torch, 1 to the cores this process may run "
                "on (default: torch's, the cores). On a machine where other work runs, fewer "
                "threads than cores can be several times faster: a kernel's threads wait for "
                "each other, so one that loses its core holds up the rest")


def _add_threads_arg(p: argparse.ArgumentParser, help: str = THREADS_HELP) -> None:
    p.add_argument("--threads", type=_threads, default=None, metavar="N", help=help)


def _engine_defaults() -> dict:
    from phasewise.config import EngineConfig

    return {f.name: f.default for f in fields(EngineConfig)}


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from phasewise.config import (
        DEFAULT_SPECULATIVE_TOKENS,
        DEVICES,
        DTYPE_CHOICES,
        KERNEL_CHOICES,
        LOAD_FORMATS,
        MAX_SPECULATIVE_TOKENS,
        POLICIES,
        SPECULATIVE_CHOICES,
    )

    d = _engine_defaults()
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint folder (default: the bundled stdlib-coder)")
    p.add_argument("--dtype", default=d["dtype"], choices=DTYPE_CHOICES,
                   help="weights' and activations' dtype (auto: the checkpoint's)")
    p.add_argument("--device", default=d["device"],
                   help=f"{', '.join(DEVICES)} or cuda:N (default: {d['device']})")
    p.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                   help="longest prompt plus output a request may have (default: the model's, "
                        "lowered to what the KV pool holds)")
    p.add_argument("--block-size", type=int, default=d["block_size"],
                   help="tokens per KV block, 1..1024 and at most the context (default 16)")
    p.add_argument("--kv-cache-memory", default=d["kv_cache_memory"],
                   help="KV pool size, e.g. 512MiB or 4GiB (default: 1GiB on CPU; on CUDA "
                   "90%% of the memory the weights leave)")
    p.add_argument("--num-kv-blocks", type=int, default=d["num_kv_blocks"],
                   help="the KV pool's exact block count (overrides --kv-cache-memory)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                   help="token budget per engine step (default: 256 on CPU, 2048 on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="most sequences one engine step holds (the decode batch's limit)")
    p.add_argument("--policy", default=d["policy"], choices=POLICIES,
                   help="chunked: prompt chunks join decode steps under the step budget; "
                   "prefill-first: waiting prompts run whole while decodes pause")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt afresh instead of reusing the K/V of blocks "
                   "computed before")
    p.add_argument("--seed", type=int, default=d["seed"],
                   help="seed of the engine's sampling (a request's own seed takes precedence)")
    p.add_argument("--kernels", default=d["kernels"], choices=KERNEL_CHOICES,
                   help="auto: phasewise's CPU kernels for bf16 models on CPU, its fused Triton "
                   "kernels on CUDA; torch: none")
    p.add_argument("--load-format", default=d["load_format"], choices=LOAD_FORMATS,
                   help="safetensors: the checkpoint's weights; dummy: seeded random weights "
                   "of its shape (the folder needs only config.json and a tokenizer)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: launch every step's kernels one by one instead of replaying "
                   "captured CUDA graphs for decode steps")
    p.add_argument("--quantization", default=d["quantization"], choices=["int8"],
                   help="int8: the decoder's projections and the LM head in int8, one scale "
                   "per output channel (CPU; halves the bytes a dense model's decode step "
                   "reads; an MoE model's experts and router keep the checkpoint's dtype)")
    p.add_argument("--speculative", default=d["speculative"], choices=SPECULATIVE_CHOICES,
                   help="ngram: speculative decoding by prompt lookup; each decode step also "
                   "verifies tokens proposed from the request's own prompt and outputs")
    p.add_argument("--num-speculative-tokens", type=int, default=d["num_speculative_tokens"],
                   help=f"drafts verified per step with --speculative (1.."
                   f"{MAX_SPECULATIVE_TOKENS}; default {DEFAULT_SPECULATIVE_TOKENS})")
    _add_kernel_plan_arg(p)
    _add_threads_arg(p)


def _add_kernel_plan_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel-plan", default=None, metavar="FILE",
                   help="CPU: follow this kernel plan file (phasewise tune writes them), "
                   "pinned; default: the plan phasewise tune stored for this machine and "
                   "model, else a rule from the CPU's flags (nothing is timed at start)")


def _engine_kwargs(a: argparse.Namespace) -> dict:
    if a.kernel_plan is not None:  # a malformed plan file is refused before any loading
        from phasewise.model.cpu.plan import read_plan_file

        read_plan_file(a.kernel_plan)
    return dict(dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
                block_size=a.block_size, kv_cache_memory=a.kv_cache_memory,
                num_kv_blocks=a.num_kv_blocks, max_num_batched_tokens=a.max_num_batched_tokens,
                max_num_seqs=a.max_num_seqs,
                policy=a.policy, enable_prefix_caching=not a.no_prefix_caching, seed=a.seed,
                kernels=a.kernels, quantization=a.quantization, speculative=a.speculative,
                num_speculative_tokens=a.num_speculative_tokens, load_format=a.load_format,
                enforce_eager=a.enforce_eager, kernel_plan=a.kernel_plan,
                num_threads=a.threads)


def _model_arg(a: argparse.Namespace) -> str:
    from phasewise.config import resolve_model
    from phasewise.perf.models import catalog_name

    return resolve_model(a.model, note=lambda line: print(line, file=sys.stderr),
                         catalog=catalog_name)


def cmd_generate(a: argparse.Namespace) -> int:
    from phasewise.generate import GenerateOptions, run

    return run(_model_arg(a), _engine_kwargs(a), GenerateOptions(
        prompt=a.prompt, max_tokens=a.max_tokens, temperature=a.temperature,
        sample_seed=a.sample_seed, chat=a.chat, roofline=not a.no_roofline))


def cmd_serve(a: argparse.Namespace) -> int:
    _logging(a.log_level)
    os.environ.pop(API_KEY_ENV, None)  # read (a.api_key); no child process inherits it
    try:
        return _serve(a)
    except KeyboardInterrupt:  # Ctrl-C while loading: nothing to drain
        print("phasewise: interrupted", file=sys.stderr)
        return 130


def _serve(a: argparse.Namespace) -> int:
    from phasewise.config import EngineConfig, parse_memory
    from phasewise.launch.serve import build_server, read_internal_key, read_secret
    from phasewise.server.serve import check_port, run

    model = _model_arg(a)
    check_port(a.host, a.port)  # before the minutes a large model can take to load
    _check_slo_args(a)
    limits = _connection_limits(a)
    secret = read_secret(a.kv_secret_file, a.role) if a.role != "both" else None
    internal_key = read_internal_key(a.internal_key_file)
    server = build_server(
        EngineConfig(model=model, **_engine_kwargs(a)),
        served_model_name=a.served_model_name,
        log_interval_s=a.log_interval, api_key=a.api_key,
        max_waiting_requests=a.max_waiting_requests,
        max_request_bytes=parse_memory(a.max_request_size), role=a.role,
        kv_bind=a.kv_bind, kv_connect=a.kv_connect, kv_secret=secret,
        disagg_threshold=a.disagg_threshold, prefill_queue_limit=a.prefill_queue_limit,
        remote_prefill_timeout=a.remote_prefill_timeout, kv_name=a.kv_name,
        slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, internal_key=internal_key)
    try:
        run(server, host=a.host, port=a.port, shutdown_grace_s=a.shutdown_grace,
            log_level=a.log_level, access_log=not a.no_access_log, limits=limits)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has drained and shut down
        pass
    return 0


def _api_key(value: str) -> str:
    """argparse's type for --api-key (its default, $PHASEWISE_API_KEY, goes through it too)."""
    from phasewise.config import check_api_key

    try:
        return check_api_key(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (from --api-key or ${API_KEY_ENV})") from None


def _check_slo_args(a: argparse.Namespace) -> None:
    from phasewise.engine.slo import check_slo_ms

    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if getattr(a, name) is not None:
            check_slo_ms(getattr(a, name), "--" + name.replace("_", "-"))


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    for name, what in (("ttft", "time to first token"), ("tpot", "time per output token")):
        p.add_argument(f"--slo-{name}-ms", type=float, default=None, metavar="MS",
                       help=f"refuse at once (429, Retry-After) a request predicted to miss "
                       f"this {what}, from the queue and the steps' measured cost; a "
                       f"request's slo_{name}_ms field or x-slo-{name}-ms header replaces "
                       "it; requests with no target are never refused for this (default: "
                       "none; docs/serving.md)")


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    from phasewise.server.limits import ConnectionLimits

    d = ConnectionLimits()
    p.add_argument("--timeout-header", type=float, default=d.timeout_header_s,
                   help="seconds a connection gets to send a request's headers, from its "
                   "opening or its previous response (then 408 and closed)")
    p.add_argument("--timeout-body", type=float, default=d.timeout_body_s,
                   help="seconds a request gets to send its body after its headers")
    p.add_argument("--timeout-write", type=float, default=d.timeout_write_s,
                   help="seconds a response may wait, its socket's buffer full, with its "
                   "client reading none of it, before the connection is closed")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="connections open at once (lowered to fit the open-file limit); "
                   "more are answered 503")
    p.add_argument("--max-connections-per-address", type=int,
                   default=d.max_connections_per_address,
                   help="connections one address may hold with no request in progress "
                   "(opening, sending a request, idle, not reading its answer); more are "
                   "answered 503")
    p.add_argument("--send-buffer", default=f"{d.send_buffer >> 10}KiB",
                   help="bytes of a response the kernel may hold for a client that does not "
                   "read them (SO_SNDBUF; 0: the system's own, up to MiBs): a stream whose "
                   "client stopped reading is parked once it is full")


def _connection_limits(a: argparse.Namespace) -> Any:
    from phasewise.server.limits import ConnectionLimits

    from phasewise.config import parse_memory

    try:
        zero = re.fullmatch(r"\s*0*\.?0*\s*[a-zA-Z]*\s*", str(a.send_buffer)) and \
            re.search(r"0", str(a.send_buffer))
        send = 0 if zero else parse_memory(a.send_buffer)
    except ValueError as e:
        raise ValueError(f"--send-buffer: {e}") from None
    return ConnectionLimits(a.timeout_header, a.timeout_body, a.max_connections,
                            a.max_connections_per_address, a.timeout_write, send)


def _logging(level: str) -> None:
    import logging

    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_router(a: argparse.Namespace) -> int:
    from phasewise.config import parse_memory
    from phasewise.launch.serve import build_router, read_internal_key
    from phasewise.server.serve import check_port, run

    _logging(a.log_level)
    os.environ.pop(API_KEY_ENV, None)  # read (a.api_key); no child process inherits it
    model = _model_arg(a)
    check_port(a.host, a.port)
    _check_slo_args(a)
    limits = _connection_limits(a)
    try:
        server = build_router(model, a.decode, a.prefill or [],
                              served_model_name=a.served_model_name, api_key=a.api_key,
                              internal_key=read_internal_key(a.internal_key_file),
                              wait_s=a.wait, max_waiting_requests=a.max_waiting_requests,
                              slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms,
                              max_request_bytes=parse_memory(a.max_request_size),
                              routing={"routing": a.routing, "prefix_weight": a.prefix_weight,
                                       "load_weight": a.load_weight,
                                       "max_migrations": a.max_migrations,
                                       "stream_deadline": a.stream_deadline,
                                       "admit_timeout": a.admit_timeout,
                                       "discover": a.discover,
                                       "discover_interval": a.discover_interval})
        run(server, host=a.host, port=a.port, shutdown_grace_s=a.shutdown_grace,
            log_level=a.log_level, access_log=not a.no_access_log, limits=limits)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_pd(a: argparse.Namespace) -> int:
    from phasewise.launch.pd import Launcher, PDConfig

    _logging(a.log_level)
    if a.pin and a.threads not in (None, 1):
        raise ValueError(f"--pin runs each worker on a core of its own with one thread; "
                         f"--threads {a.threads} cannot apply (leave one of them out)")
    engine = []
    for flag, value in (("--dtype", a.dtype), ("--max-model-len", a.max_model_len),
                        ("--kv-cache-memory", a.kv_cache_memory),
                        ("--max-num-batched-tokens", a.max_num_batched_tokens),
                        ("--max-num-seqs", a.max_num_seqs), ("--kernel-plan", a.kernel_plan),
                        ("--threads", a.threads)):
        if value is not None:
            engine += [flag, str(value)]
    return Launcher(PDConfig(
        model=_model_arg(a), host=a.host, port=a.port, decode_port=a.decode_port,
        prefill_port=a.prefill_port, kv_port=a.kv_port, kv_secret_file=a.kv_secret_file,
        disagg_threshold=a.disagg_threshold, api_key=a.api_key, pin=a.pin,
        engine_args=engine, log_level=a.log_level)).run()


def cmd_bench(a: argparse.Namespace) -> int:
    from phasewise.bench.run import main as run_bench

    return run_bench(a)


def cmd_bench_report(a: argparse.Namespace) -> int:
    from phasewise.bench.report import render
    from phasewise.files import check_output
    from phasewise.perf.summary import parse_slo

    check_output(a.output, "-o/--output")
    out = render(a.results, a.output, stall_factor=a.stall_factor,
                 slo=parse_slo(a.goodput) or None)
    print(f"report written to {out}", file=sys.stderr)
    return 0


def cmd_roofline(a: argparse.Namespace) -> int:
    import json

    from phasewise.perf.analysis import analyse, catalog_dict, format_catalog, format_text
    from phasewise.perf.hardware import lookup_accelerator, lookup_link
    from phasewise.perf.models import GenericModel, lookup_model, with_routing

    if a.list:
        if a.json:
            print(json.dumps(catalog_dict(), indent=2))
        else:
            print(format_catalog())
        return 0
    if (a.model is None) == (a.params is None):
        raise ValueError("give exactly one of --model NAME|PATH or --params N (e.g. 7e9)")
    for flag, value, least in (("--prompt-len", a.prompt_len, 1), ("--prefix-len", a.prefix_len, 0),
                               ("--output-len", a.output_len, 1), ("--batch", a.batch, 1),
                               ("--context", a.context, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be an integer >= {least}, got {value}")
    for flag, value in (("--mfu", a.mfu), ("--mbu", a.mbu)):
        if not 0 < value <= 1:
            raise ValueError(f"{flag} is a fraction of the peak: in (0, 1], got {value}")
    if not 0 <= a.reserve < 1:
        raise ValueError(f"--reserve is a fraction of the memory the weights leave: in [0, 1), "
                         f"got {a.reserve}")
    if a.plot:
        from phasewise.files import check_output

        check_output(a.plot, "--plot")
    model = GenericModel(a.params) if a.params is not None else lookup_model(a.model)
    if a.experts_read is not None:
        model = with_routing(model, a.experts_read)
    result = analyse(model, lookup_accelerator(a.gpu), a.dtype, prompt_len=a.prompt_len,
                     prefix_len=a.prefix_len, output_len=a.output_len, batch=a.batch,
                     context=a.context, kv_dtype=a.kv_dtype, mfu=a.mfu, mbu=a.mbu,
                     link=lookup_link(a.link) if a.link is not None else None,
                     reserve_frac=a.reserve,
                     compute_dtype=a.compute_dtype)
    if a.plot:
        from phasewise.perf.plot import plot_roofline

        print(f"plot written to {plot_roofline(result, a.plot)}", file=sys.stderr)
    print(json.dumps(result, indent=1) if a.json else format_text(result))
    return 0


def cmd_measure(a: argparse.Namespace) -> int:
    from pathlib import Path

    from phasewise.files import check_output
    from phasewise.perf.measure import format_entry, measure

    if a.out is not None:
        check_output(a.out, "--out")
    if a.threads is not None:
        import torch

        torch.set_num_threads(a.threads)
    for key, entry in measure(Path(a.out) if a.out else None, quick=a.quick,
                              replace=a.replace).items():
        print(format_entry(key, entry))
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from pathlib import Path

    from phasewise.files import check_output
    from phasewise.perf.calibrate import calibrate

    if a.out is not None:
        check_output(a.out, "--out")
    if a.block_size is not None and a.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {a.block_size}")
    kw = {k: v for k, v in (("dtype", a.dtype), ("device", a.device),
                            ("kernels", a.kernels), ("block_size", a.block_size),
                            ("max_num_batched_tokens", a.max_num_batched_tokens),
                            ("kernel_plan", a.kernel_plan), ("num_threads", a.threads))
          if v is not None}
    cm, path = calibrate(_model_arg(a), engine_kwargs=kw, quick=a.quick, reps=a.reps,
                         out=Path(a.out) if a.out else None, max_context=a.max_context)
    print("\n".join(cm.describe()))
    print(f"profile written to {path}")
    return 0


def cmd_tune(a: argparse.Namespace) -> int:
    from pathlib import Path

    from phasewise.files import check_output

    if a.out is not None:
        check_output(a.out, "--out")
    if a.threads is not None:  # (a plan is kept per machine and thread count)
        import torch

        torch.set_num_threads(a.threads)
    from phasewise.model.cpu.plan import KernelPlan, Runtime
    from phasewise.model.cpu.tune import tune

    stored, path = tune(_model_arg(a), dtype=a.dtype, quantization=a.quantization,
                        load_format=a.load_format, rounds=a.rounds,
                        out=Path(a.out) if a.out else None)
    plan = KernelPlan(stored.key, stored.panels, stored.linear, stored.stream_prefetch,
                      "stored", str(path), path)
    print(plan.table(Runtime.here()))
    m = stored.measured
    if m.get("rounds"):
        print(f"chosen by {m['agreement']} rounds: {m['chosen']} (the rule: {m['rule']})")
    print(f"plan written to {path}; engines with this machine, model, dtype, quantization and "
          f"{stored.key.threads} threads follow it (--kernel-plan {path} pins it elsewhere)")
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    from phasewise.perf.commands import run_simulate
    from phasewise.perf.summary import check_result_flags

    check_result_flags(a)
    return run_simulate(a, _sim_model(a), _served(a))


def cmd_plan(a: argparse.Namespace) -> int:
    from phasewise.files import check_output
    from phasewise.perf.commands import run_plan

    if a.k8s_out is not None:
        check_output(a.k8s_out, "--k8s-out", folder=True)
    return run_plan(a, _sim_model(a), _served(a))


def _served(a: argparse.Namespace):
    """``--served URL``: the cost model as that live, idle server runs it (a probe through
    it: ``phasewise.bench.probe``), or None."""
    if not a.served:
        return None

    def wrap(cm):
        from phasewise.bench.probe import probe
        from phasewise.perf.served import ServedCostModel

        headers = {"Authorization": f"Bearer {a.served_api_key}"} if a.served_api_key else {}
        print(f"probing {a.served} ({a.served_rounds} round(s) of six short phases) ...",
              file=sys.stderr)
        served, _ = probe(a.served, cm, cm.shape.vocab_size, headers=headers,
                          metrics_urls=a.served_metrics or (), repeats=a.served_rounds,
                          idle_s=tuple(a.served_idle))
        return ServedCostModel(cm, served)
    return wrap


def _sim_model(a: argparse.Namespace) -> str:
    """A catalog name as given; else a checkpoint folder (default: the bundled model)."""
    from phasewise.perf.models import CATALOG

    if a.model is not None and a.model.lower() in CATALOG:
        return a.model.lower()
    return _model_arg(a)


def _add_sim_args(p: argparse.ArgumentParser, results: bool = True) -> None:
    """What ``simulate`` and ``plan`` model: the model, the machine, one engine's limits."""
    from phasewise.bench.options import add_workload_args
    from phasewise.config import POLICIES

    d = _engine_defaults()
    p.add_argument("--model", default=None, help="catalog name (phasewise roofline --list) or "
                   "a checkpoint folder (default: the bundled stdlib-coder)")
    p.add_argument("--gpu", "--accelerator", dest="gpu", default="cpu-local",
                   help="catalog key (phasewise roofline --list), or cpu-local / gpu-local: "
                   "this machine as phasewise measure measured it (default: cpu-local)")
    p.add_argument("--profile", default=None, help="a phasewise calibrate profile (default: "
                   "the stored one for this model on this machine, with --gpu cpu-local)")
    p.add_argument("--dtype", default="bf16", type=_roofline_dtype,
                   help="how the weights and K/V are stored")
    p.add_argument("--served", default=None, metavar="URL",
                   help="price steps as this live, idle phasewise server runs them: a short "
                   "probe through it measures its steps' drift from the profile and what "
                   "serving costs beyond the engine's steps (docs/predicting.md)")
    p.add_argument("--served-metrics", nargs="+", default=None, metavar="URL",
                   help="--served under P/D: every worker's URL, whose /metrics hold the "
                   "probe's steps (default: the --served URL)")
    p.add_argument("--served-api-key", default=None, help="--served: the server's API key")
    p.add_argument("--served-rounds", type=int, default=2,
                   help="--served: rounds of the probe; each figure is their median (1-10)")
    p.add_argument("--served-idle", type=float, nargs=2, default=[1.0, 12.0],
                   metavar=("SHORT", "LONG"), help="--served: the idle waits (s) after which "
                   "the probe measures what a request to an idle engine pays (default 1 12)")
    p.add_argument("--link", default=None, help="P/D: the K/V link, 'instant' (K/V arrives "
                   "at once; the default) or a catalog link (roofline --list shows them)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the simulated engines' context (default: the model's)")
    p.add_argument("--block-size", type=int, default=d["block_size"],
                   help="tokens per KV block, 1..1024 and at most the context (default 16)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="K/V pool per engine (default: 1GiB on a CPU; on an accelerator 90%% "
                   "of its memory less the weights)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="step budget (default: 256 on a CPU, 2048 on an accelerator)")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="most sequences one simulated step holds")
    p.add_argument("--policy", default=d["policy"], choices=POLICIES,
                   help="the simulated engines' scheduling, as serve's --policy")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="simulate engines that reuse no cached prompt blocks")
    p.add_argument("--prefill-queue-limit", type=int, default=None,
                   help="P/D: prefill on the decode worker while every prefill queue is this "
                   "long (default 8)")
    p.add_argument("--slo-admission", action="store_true",
                   help="every request carries the --goodput TTFT and TPOT targets and an "
                   "engine refuses one it predicts would miss them, as serve --slo-ttft-ms "
                   "--slo-tpot-ms does (plan: compare the winner with and without it)")
    add_workload_args(p, simulated=True, results=results)


def _check_tiny_size(a: argparse.Namespace, window: dict[str, Any]) -> int:
    """The weights' bytes make-tiny would write; refused where this machine's memory or the
    folder's disk could not take them (the tensors and their serialised copy are both held
    while writing)."""
    import shutil

    from phasewise.engine.kv_sizing import host_memory_available
    from phasewise.model.tiny import tiny_config
    from phasewise.perf.models import ModelShape

    cfg = tiny_config(a.arch, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                      num_layers=a.layers, **window)
    size = int(ModelShape.from_hf_config(cfg, name=a.arch, source="make-tiny").total_params) * 4
    avail = host_memory_available()
    if avail is not None and 2 * size > avail:
        raise ValueError(f"--hidden-size {a.hidden_size} and --layers {a.layers} make "
                         f"{size / 2**30:.1f} GiB of float32 weights, which take about "
                         f"{2 * size / 2**30:.1f} GiB of memory to write; this machine has "
                         f"{avail / 2**30:.1f} GiB available: choose a smaller size")
    there = Path(a.out).resolve()
    while not there.exists():
        there = there.parent
    free = shutil.disk_usage(there).free
    if size > free:
        raise ValueError(f"{a.out}: {size / 2**30:.1f} GiB of weights, more than the "
                         f"{free / 2**30:.1f} GiB free on its disk")
    return size


def cmd_make_tiny(a: argparse.Namespace) -> int:
    from phasewise.model.tiny import make_tiny_checkpoint

    t = time.monotonic()
    # A random checkpoint to try things on: 4 heads of hidden/4 (RoPE pairs: a multiple of
    # 8), a byte-level tokenizer's 256 bytes and specials at least, and small enough to
    # write in seconds; anything else is refused by its flag rather than written broken.
    for flag, value, lo, hi, step in (("--hidden-size", a.hidden_size, 8, 4096, 8),
                                      ("--layers", a.layers, 1, 64, 1),
                                      ("--vocab-size", a.vocab_size, 300, 65536, 1)):
        if not lo <= value <= hi or value % step:
            also = f", a multiple of {step}" if step > 1 else ""
            raise ValueError(f"{flag} must be in {lo}..{hi}{also}; got {value}")
    if not a.out.strip():
        raise ValueError("make-tiny needs a folder to write into, got an empty path")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        raise ValueError(f"{a.out} is a file; make-tiny writes a checkpoint folder")
    held = sorted(p.name for p in Path(a.out).glob("*")) if Path(a.out).is_dir() else []
    if held and not a.force:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(f"{a.out} is not empty ({shown}): make-tiny would overwrite a "
                         "checkpoint's files there; choose a new folder, or --force")
    window: dict[str, Any] = {}
    if a.sliding_window is not None:
        if a.sliding_window < 1:
            raise ValueError(f"--sliding-window must be >= 1, got {a.sliding_window}")
        if a.arch == "LlamaForCausalLM":
            raise ValueError("--sliding-window: Llama attends to the whole context; choose "
                             "--arch MistralForCausalLM, MixtralForCausalLM or a Qwen one")
        window = {"sliding_window": a.sliding_window}
        if a.arch.startswith("Qwen"):  # Qwen: enabled, and named on every layer
            window.update(use_sliding_window=True, max_window_layers=0,
                          layer_types=["sliding_attention"] * a.layers)
    size = _check_tiny_size(a, window)
    if size > 64 * 2**20:  # seconds or more: say what is coming (the bundled model: 30 MB)
        print(f"writing {size / 2**30:.2f} GiB of float32 weights to {a.out} ...",
              file=sys.stderr)
    path = make_tiny_checkpoint(a.out, architecture=a.arch, vocab_size=a.vocab_size,
                                hidden_size=a.hidden_size, num_layers=a.layers, seed=a.seed,
                                **window)
    print(f"wrote a random-weight {a.arch} checkpoint to {path} ({size / 2**20:.0f} MiB, "
          f"{time.monotonic() - t:.1f}s)", file=sys.stderr)
    return 0


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already says it or there is
    none to say (None, off, a list left empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        shown = not (d is None or d is False or d is argparse.SUPPRESS
                     or (isinstance(d, list) and not d))
        if action.option_strings and "default" not in text.lower() and shown:
            text += " (default: %(default)s)"
        return text


DESCRIPTION = ("phasewise: an LLM inference engine that shows and controls the two phases of "
               "generation, prefill and decode. Serve a checkpoint behind an OpenAI-compatible "
               "API, measure each step against the hardware's roofline, and predict and plan "
               "deployments. 'phasewise COMMAND --help' describes each command.")


def _common(top: bool = True) -> argparse.ArgumentParser:
    """Flags every command takes, before or after its name (``top``: the parser that sets
    their defaults; a subcommand's parser leaves a flag unset unless it is given there, so
    that ``phasewise --debug serve`` keeps it)."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="on an internal error, print the traceback too")
    return c


def build_report_parser() -> argparse.ArgumentParser:
    r = argparse.ArgumentParser(prog="phasewise bench report", parents=[_common()],
                                description="HTML report from benchmark result files",
                                formatter_class=HelpFormatter)
    r.add_argument("results", nargs="+", help="result JSON files (phasewise bench, or "
                   "vllm bench serve --save-detailed)")
    r.add_argument("-o", "--output", default="bench-report.html", help="the HTML file to write")
    r.add_argument("--stall-factor", type=float, default=5.0,
                   help="mark a stall where a gap exceeds this x the median ITL")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLO lines to draw (default: the results' own)")
    r.set_defaults(func=cmd_bench_report, parser=r)
    return r


def build_parser() -> argparse.ArgumentParser:
    from phasewise.bench.options import add_args as add_bench_args
    from phasewise.config import (DTYPE_CHOICES, KERNEL_CHOICES, LOAD_FORMATS, LOG_LEVELS,
                                  SERVE_ROLES)
    from phasewise.model.config import SUPPORTED_ARCHITECTURES
    from phasewise.perf.roofline import DTYPE_BYTES

    parser = argparse.ArgumentParser(prog="phasewise", description=DESCRIPTION,
                                     parents=[_common()], formatter_class=HelpFormatter)
    from phasewise import __version__

    parser.add_argument("--version", action="version", version=f"phasewise {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_common(top=False)]

    def command(name: str, help: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, parents=common,
                           formatter_class=HelpFormatter)
        p.set_defaults(func=func, parser=p)
        return p

    g = command("generate", "stream a completion for one prompt", cmd_generate)
    _add_engine_args(g)
    g.add_argument("prompt",
                   help="the prompt text (with --chat: the user's message)")
    g.add_argument("--max-tokens", type=int, default=64,
                   help="tokens to generate (0: the prompt's K/V alone)")
    g.add_argument("--temperature", type=float, default=None,
                   help="default: the checkpoint's generation_config.json")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--no-roofline", action="store_true",
                   help="skip the closing lines that hold both phases against this machine's "
                   "roofline (they need phasewise measure's figures; a quick measurement is "
                   "made and saved the first time)")

    s = command("serve", "OpenAI-compatible HTTP server (streaming, /metrics)", cmd_serve)
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    s.add_argument("--port", type=int, default=8000,
                   help="port to listen on")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the folder's name)")
    s.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, type=_api_key,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                   "/detokenize, and a login for /dashboard (/health, /metrics and /version "
                   f"stay open; docs/serving.md#authentication); default: ${API_KEY_ENV}, "
                   "which keeps the key out of the process list")
    s.add_argument("--internal-key-file", default=None, metavar="FILE",
                   help="behind a router: the fleet's own key (32+ characters, e.g. "
                   "'openssl rand -hex 32'), which /internal/* then take instead of --api-key, "
                   "so that wrong API keys never lock the router out (default: --api-key "
                   "guards them)")
    _add_slo_args(s)
    s.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait for the engine; beyond it new ones get 503")
    s.add_argument("--max-request-size", default="8MiB", help="request body size limit")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running streams get to finish after SIGTERM")
    s.add_argument("--log-interval", type=float, default=5.0,
                   help="seconds between throughput log lines (0: off)")
    s.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="least severe log lines shown")
    s.add_argument("--role", default="both", choices=SERVE_ROLES,
                   help="both: prefill and decode here; decode: open the K/V port and send "
                   "prompts to prefill workers; prefill: compute prompts for a decode worker")
    s.add_argument("--kv-bind", default="tcp://127.0.0.1:8100",
                   help="decode role: the K/V port to listen on")
    s.add_argument("--kv-connect", nargs="+", default=None, metavar="URL",
                   help="prefill role: the decode workers' K/V ports, tcp://HOST:PORT "
                   "(one or more: it prefills for each)")
    s.add_argument("--kv-secret-file", default=None,
                   help="prefill/decode roles: file holding the shared secret (>= 16 bytes)")
    s.add_argument("--disagg-threshold", type=int, default=0,
                   help="decode role: prompts with fewer uncached tokens prefill here "
                   "(0: every prompt a prefill worker can take)")
    s.add_argument("--prefill-queue-limit", type=int, default=8,
                   help="decode role: prefill here while every prefill worker holds this "
                   "many prompts or more")
    s.add_argument("--remote-prefill-timeout", type=float, default=300.0,
                   help="decode role: seconds from sending a prompt (its wait in the prefill "
                   "worker's queue included) to its first token back, after which the prompt "
                   "is computed here")
    s.add_argument("--kv-name", default=None,
                   help="prefill role: the name decode workers know this worker by (default "
                   "prefill@HOSTNAME); a worker that connects under a name already connected "
                   "replaces it, so give each prefill worker on one host its own")
    s.add_argument("--no-access-log", action="store_true",
                   help="no log line per request")
    _add_connection_args(s)

    ro = command("router", "the OpenAI API in front of P/D workers (decode workers "
                 "decide what to prefill remotely)", cmd_router)
    ro.add_argument("--model", default=None,
                    help="the checkpoint folder the workers serve (for its tokenizer; "
                    "default: the bundled stdlib-coder); checked against each worker")
    ro.add_argument("--decode", nargs="+", required=True, metavar="URL", type=http_url,
                    help="decode (or --role both) workers, http://HOST:PORT")
    ro.add_argument("--prefill", nargs="*", default=[], metavar="URL", type=http_url,
                    help="prefill workers, http://HOST:PORT (watched for /health and "
                    "/metrics; their K/V goes to the decode workers directly)")
    ro.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    ro.add_argument("--port", type=int, default=8000,
                    help="port to listen on")
    ro.add_argument("--served-model-name", default=None,
                    help="the model name clients send (default: the folder's name)")
    ro.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, type=_api_key,
                    help=f"required of clients, and sent to the workers (default: "
                    f"${API_KEY_ENV})")
    ro.add_argument("--internal-key-file", default=None, metavar="FILE",
                    help="the workers' --internal-key-file, sent to their /internal/* routes")
    ro.add_argument("--max-waiting-requests", type=int, default=256,
                    help="requests allowed to wait for a worker; beyond it new ones get 503")
    _add_slo_args(ro)
    ro.add_argument("--max-request-size", default="8MiB",
                    help="request body size limit")
    ro.add_argument("--shutdown-grace", type=float, default=30.0,
                    help="seconds running streams get to finish after SIGTERM")
    ro.add_argument("--wait", type=float, default=300.0,
                    help="seconds to wait for the workers at start-up")
    from phasewise.disagg.prefix_index import (DEFAULT_LOAD_WEIGHT, DEFAULT_POLICY,
                                               DEFAULT_PREFIX_WEIGHT, POLICIES)
    ro.add_argument("--routing", default=DEFAULT_POLICY, choices=POLICIES,
                    help="how a decode worker is chosen: prefix (the prompt blocks it holds "
                    "against its load), least-load or round-robin (default: "
                    f"{DEFAULT_POLICY}; docs/pd.md)")
    ro.add_argument("--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT,
                    help="--routing prefix: weight of the share of the prompt's blocks a "
                    f"worker holds (default {DEFAULT_PREFIX_WEIGHT:g})")
    ro.add_argument("--load-weight", type=float, default=DEFAULT_LOAD_WEIGHT,
                    help="--routing prefix: weight of how much lighter than the busiest "
                    f"worker it is (default {DEFAULT_LOAD_WEIGHT:g})")
    from phasewise.disagg.prefix_index import DEFAULT_MAX_MIGRATIONS, MAX_MIGRATIONS_LIMIT
    ro.add_argument("--max-migrations", type=int, default=DEFAULT_MAX_MIGRATIONS,
                    help="how often one response may be moved to another decode worker when "
                    "its worker dies, stops or drains mid-stream (each move recomputes the "
                    f"prompt and the tokens so far there); 0: never, the response ends with "
                    f"an error (0-{MAX_MIGRATIONS_LIMIT}, default {DEFAULT_MAX_MIGRATIONS})")
    ro.add_argument("--discover", action="store_true",
                    help="each --decode URL names a DNS name whose addresses are the decode "
                    "workers (a Kubernetes headless Service): resolved again every "
                    "--discover-interval seconds, workers join and leave as pods do")
    ro.add_argument("--discover-interval", type=float, default=5.0,
                    help="--discover: seconds between DNS lookups (default 5)")
    ro.add_argument("--stream-deadline", type=float, default=15.0,
                    help="seconds a decode worker may answer no poll before its streams are "
                    "moved to another worker (or ended, where none can take them); a worker "
                    "that closes its connections is moved from at once (default 15)")
    ro.add_argument("--admit-timeout", type=positive_float, default=120.0, metavar="S",
                    help="seconds a decode worker may take to take or refuse a request (its "
                    "reply's headers) before the router tries the next worker")
    ro.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                    help="least severe log lines shown")
    ro.add_argument("--no-access-log", action="store_true",
                    help="no log line per request")
    _add_connection_args(ro)

    pd = command("pd", "start 1 prefill worker, 1 decode worker and a router here "
                 "(Ctrl-C stops all three)", cmd_pd)
    pd.add_argument("--model", default=None,
                    help="checkpoint folder (default: the bundled stdlib-coder)")
    pd.add_argument("--host", default="127.0.0.1",
                    help="address the router and both workers bind (0.0.0.0: all)")
    pd.add_argument("--port", type=int, default=8000, help="the router's port")
    pd.add_argument("--decode-port", type=int, default=None, help="default: --port + 1")
    pd.add_argument("--prefill-port", type=int, default=None, help="default: --port + 2")
    pd.add_argument("--kv-port", type=int, default=8100,
                    help="the decode worker's K/V port, which the prefill worker connects to")
    pd.add_argument("--kv-secret-file", default=None,
                    help="default: a fresh random secret, removed when it stops")
    pd.add_argument("--disagg-threshold", type=int, default=0,
                    help="prompts with fewer uncached tokens prefill on the decode worker (0: "
                         "every prompt goes to the prefill worker)")
    pd.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, type=_api_key,
                    help="require 'Authorization: Bearer KEY' on the router's and workers' "
                         "/v1/*, /tokenize and /detokenize, and a login for /dashboard "
                         f"(default: ${API_KEY_ENV}; the three processes get it so, never "
                         "on their command lines)")
    pd.add_argument("--pin", action="store_true",
                    help="decode worker on the first core this process may use, prefill "
                    "worker on the second, one thread each")
    pd.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                    help="both workers' dtype (default: serve's, auto)")
    pd.add_argument("--max-model-len", type=int, default=None,
                    help="both workers' --max-model-len (default: serve's)")
    pd.add_argument("--kv-cache-memory", default=None,
                    help="each worker's KV pool, e.g. 512MiB (default: serve's)")
    pd.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="each worker's step budget (default: serve's)")
    pd.add_argument("--max-num-seqs", type=int, default=None,
                    help="each worker's most sequences a step (default: serve's)")
    _add_kernel_plan_arg(pd)
    _add_threads_arg(pd, "each worker's CPU threads (--threads of serve; default: torch's, "
                     "the cores; --pin: 1)")
    pd.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                    help="least severe log lines shown")

    b = command("bench", "load-test any OpenAI-compatible server "
                "('phasewise bench report FILES' renders an HTML report)", cmd_bench)
    add_bench_args(b)

    r = command("roofline", "predict which bound each phase hits, for any model x "
                "accelerator x workload (no GPU, no weights, no torch)", cmd_roofline)
    r.add_argument("--model", default=None, help="catalog name or a config.json / folder "
                   "(this or --params is required)")
    r.add_argument("--params", type=positive_float, default=None,
                   help="a generic dense model of this many parameters, e.g. 7e9 (this or "
                   "--model is required)")
    r.add_argument("--gpu", "--accelerator", dest="gpu", default="h100-sxm",
                   help="catalog key (see --list), or cpu-local / gpu-local (phasewise measure)")
    dtypes = ", ".join(DTYPE_BYTES)
    r.add_argument("--dtype", default="bf16", type=_roofline_dtype, help=dtypes)
    r.add_argument("--kv-dtype", default=None, type=_roofline_dtype,
                   help="KV cache dtype (default: --dtype; bf16 for the weight-only int8/int4)")
    r.add_argument("--compute-dtype", default=None, type=_roofline_dtype,
                   help="whose peak the math runs at (default: --dtype; fp32 for bf16 weights "
                        "on CPUs without native bf16)")
    r.add_argument("--prompt-len", type=int, default=512,
                   help="prompt tokens per request")
    r.add_argument("--prefix-len", type=int, default=0, help="cached prefix before the prompt")
    r.add_argument("--output-len", type=int, default=128,
                   help="output tokens per request")
    r.add_argument("--batch", type=int, default=1, help="decode batch")
    r.add_argument("--context", type=int, default=None,
                   help="decode context length (default: prefix + prompt + output/2; 0 = "
                   "weights only)")
    r.add_argument("--mfu", type=float, default=1.0, help="fraction of peak FLOP/s reached")
    r.add_argument("--mbu", type=float, default=1.0, help="fraction of peak bandwidth reached")
    r.add_argument("--link", default=None, help="price a KV transfer over this link")
    r.add_argument("--reserve", type=float, default=0.1,
                   help="fraction of the memory the weights leave that is kept free of K/V, "
                   "for activations and the runtime (the engine's rule on a GPU)")
    r.add_argument("--experts-read", default=None, metavar="T:X[,T:X...]",
                   help="a mixture of experts' routing as measured: X distinct experts a "
                   "layer read in steps of T tokens (StepStats.experts_read, "
                   "phasewise:step_experts_read); the analyser fits the skew to them")
    r.add_argument("--json", action="store_true",
                   help="print the analysis as JSON")
    r.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw the roofline chart into this PNG (needs matplotlib)")
    r.add_argument("--list", action="store_true",
                   help="list the catalogs (accelerators, models, links) with each figure's "
                   "source, and exit")

    m = command("measure", "measure this machine's bandwidth and matmul peaks (the "
                "cpu-local / gpu-local accelerators)", cmd_measure)
    m.add_argument("--out", default=None, help="file to write (default: the cache folder)")
    m.add_argument("--quick", action="store_true",
                   help="fewer repetitions; never replaces a full measurement in the file")
    m.add_argument("--replace", action="store_true",
                   help="store every figure of this run, even one measured unstable where "
                   "the file holds a stable one (by default that one is kept)")
    _add_threads_arg(m, "CPU threads to measure with (default: torch's, the cores); figures "
                     "for another count than the file's cpu-local are kept as cpu-local@Nt, "
                     "which engines run with --threads N read")

    ca = command("calibrate", "time the real engine over a grid of steps and fit the step "
                 "cost model that simulate and plan use (a profile per model x machine)",
                 cmd_calibrate)
    ca.add_argument("--model", default=None,
                    help="checkpoint folder (default: the bundled stdlib-coder)")
    ca.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                    help="as serve will load it (default: serve's, auto)")
    ca.add_argument("--device", default=None,
                    help="as serve will run it (default: serve's, auto)")
    ca.add_argument("--kernels", default=None, choices=KERNEL_CHOICES,
                    help="as serve will run it (default: serve's, auto)")
    ca.add_argument("--block-size", type=int, default=None,
                    help="as serve will run it (default: serve's, 16)")
    ca.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the largest step the grid holds (default: 544, --quick 160)")
    ca.add_argument("--max-context", type=int, default=4096,
                    help="the longest context the grid reaches (the model's own is the cap)")
    ca.add_argument("--reps", type=int, default=3, help="steps timed per grid point (median)")
    ca.add_argument("--quick", action="store_true", help="a small grid (a smoke test)")
    ca.add_argument("--out", default=None, help="profile file (default: the cache folder's "
                    "profiles/MODEL@MACHINE.json, which simulate and plan read)")
    _add_kernel_plan_arg(ca)
    _add_threads_arg(ca, "as serve will run it (default: serve's, torch's; a profile is kept "
                     "per thread count)")

    tu = command("tune", "measure the CPU kernel plan for this machine and a model, once, "
                 "and store it for every later start (serve and generate follow it)", cmd_tune)
    tu.add_argument("--model", default=None,
                    help="checkpoint folder (default: the bundled stdlib-coder)")
    tu.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                    help="as the engines will load it (the CPU kernels run bfloat16)")
    tu.add_argument("--quantization", default=None, choices=["int8"],
                    help="as the engines will load it")
    tu.add_argument("--load-format", default="safetensors", choices=LOAD_FORMATS,
                    help="as the engines will load it")
    _add_threads_arg(tu, "CPU threads to tune for, 1 to the cores this process may run on "
                     "(default: torch's; the plan is kept per thread count)")
    tu.add_argument("--rounds", type=int, default=3,
                    help="calibrations run; the plan most of them chose is kept (1-20)")
    tu.add_argument("--out", default=None, metavar="FILE",
                    help="plan file (default: the cache folder's kernel-plans/"
                    "MODEL@MACHINE.json, which engines find by themselves)")

    si = command("simulate", "serve a workload in virtual time: the real scheduler, step "
                 "times from the cost model, the bench's summary", cmd_simulate)
    _add_sim_args(si)
    si.add_argument("--mode", default="colocated", choices=["colocated", "pd"],
                    help="colocated: --replicas engines that run both phases; pd: --prefill and "
                         "--decode workers")
    # (None: not given, so that a flag of the other mode is refused rather than ignored)
    si.add_argument("--replicas", type=int, default=None,
                    help="co-located engines behind a router (default 1)")
    si.add_argument("--prefill", type=int, default=None, help="P/D: prefill workers (default 1)")
    si.add_argument("--decode", type=int, default=None, help="P/D: decode workers (default 1)")
    si.add_argument("--disagg-threshold", type=int, default=None,
                    help="P/D: prompts with fewer uncached tokens prefill on the decode worker "
                    "(default 0)")
    si.add_argument("--routing", default="least-load",
                    choices=["least-load", "round-robin", "prefix"],
                    help="how the router picks an engine (prefix weighs cached prompt blocks "
                    "against load: simulated prompts share none, so it picks as least-load)")
    si.add_argument("--fail-at", type=float, default=None, metavar="SECONDS",
                    help="co-located: replica 0 dies at this time; its requests move to the "
                    "others with their outputs so far, as phasewise router's migration does")

    pl = command("plan", "search co-located and P/D deployments for the most goodput per "
                 "accelerator under TTFT and TPOT SLOs; emit Kubernetes manifests", cmd_plan)
    _add_sim_args(pl, results=False)  # its result is the table and the manifests
    next(x for x in pl._actions if "--goodput" in x.option_strings).help = (
        "the SLOs each candidate must meet (required): ttft:MS tpot:MS")
    pl.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048],
                    help="step budgets to try")
    pl.add_argument("--ratios", nargs="+", default=None,
                    help="P/D prefill:decode ratios to try (default: 1:1 1:2 2:1 1:3 3:1)")
    pl.add_argument("--thresholds", type=int, nargs="+", default=None,
                    help="P/D disaggregation thresholds to try (default: 0 512 1024)")
    pl.add_argument("--no-pd", action="store_true",
                    help="co-located candidates only (the P/D flags are then refused)")
    pl.add_argument("--window", type=_plan_window, default=30.0,
                    help="seconds of traffic simulated per rate (requests = rate x window, "
                    "at least --num-prompts, at most 20000; more than 0, up to "
                    f"{MAX_PLAN_WINDOW:g} s)")
    pl.add_argument("--k8s-out", default=None, metavar="DIR",
                    help="write the winner's Kubernetes manifests here")
    # The manifests' flags default to None so that one given without --k8s-out is refused
    # rather than ignored (perf.commands.check_plan_flags gives them the manifests' defaults).
    pl.add_argument("--name", default=None,
                    help="manifests: prefix of every object (default: phasewise)")
    pl.add_argument("--namespace", default=None,
                    help="the manifests' Kubernetes namespace (default: none, kubectl's current "
                         "one)")
    pl.add_argument("--image", default=None,
                    help="manifests: the container image (phasewise publishes none: build one) "
                    "(default: phasewise:latest)")
    pl.add_argument("--model-pvc", default=None,
                    help="manifests: the PersistentVolumeClaim holding the checkpoints "
                    "(default: phasewise-models)")
    pl.add_argument("--model-path", default=None,
                    help="manifests: the checkpoint folder in the container "
                    "(default: /models/NAME)")
    pl.add_argument("--cpus", type=int, default=None,
                    help="manifests: CPUs per engine pod (default: 2)")

    t = command("make-tiny", "write a tiny random-weight checkpoint (HF layout)",
                cmd_make_tiny)
    t.add_argument("out",
                   help="folder to write the checkpoint into")
    t.add_argument("--arch", default="LlamaForCausalLM", choices=list(SUPPORTED_ARCHITECTURES),
                   help="the architecture (the config.json's architectures)")
    t.add_argument("--vocab-size", type=int, default=512,
                   help="vocabulary size (300-65536)")
    t.add_argument("--hidden-size", type=int, default=64,
                   help="hidden size (8-4096, a multiple of 8)")
    t.add_argument("--layers", type=int, default=2,
                   help="decoder layers (1-64)")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights")
    t.add_argument("--force", action="store_true",
                   help="write into a folder that already holds files (overwriting them)")
    t.add_argument("--sliding-window", type=int, default=None, metavar="N",
                   help="attend to the last N positions only, in every layer (default: the "
                   "whole context)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's arguments; a flag it does not know gets its own usage (exit 2)."""
    if argv[:2] == ["bench", "report"]:
        parser, argv = build_report_parser(), argv[2:]
    else:
        parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError as e:
        if not _stdout_closed():  # another pipe broke: not the reader leaving
            return _internal_error(e, args)
        # stdout's reader left (| head): stop quietly, as a filter does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit's flush does not fail again
        return 141  # 128 + SIGPIPE, the status a shell gives a program the pipe stopped
    except USER_ERRORS as e:
        print(f"phasewise: error: {by_flag(str(e), getattr(args, 'parser', None))}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phasewise: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or a broken environment, not the user's input
        return _internal_error(e, args)


def by_flag(message: str, parser: argparse.ArgumentParser | None) -> str:
    """``message`` with each option it names as the Python API spells it (``max_model_len``,
    as ``EngineConfig`` and the engine report it) spelled as this command's flag
    (``--max-model-len``), where the command has that flag: the user typed the flag."""
    if parser is None:
        return message
    flags = {s for a in parser._actions for s in a.option_strings}

    def flag(m: re.Match[str]) -> str:
        name = "--" + m.group(0).replace("_", "-")
        return name if name in flags else m.group(0)

    # (not inside a path, a file name or a quoted value: only a word standing alone)
    return re.sub(r"(?<![\w\-/.\\'\"])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w\-/.\\'\"])", flag,
                  message)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (the kernel flags its write end with
    an error: poll says so without writing)."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd, or no poll on this platform
        return False


def _internal_error(e: BaseException, args: argparse.Namespace) -> int:
    if args.debug:
        traceback.print_exception(e)
    text = " ".join(str(e).split()) or "(no message)"
    print(f"phasewise: internal error: {type(e).__name__}: {text}"
          + ("" if args.debug else " (--debug shows the traceback)"), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
