"""What several commands share: argument types, flag groups and how they become the engine's
and the server's settings. Building a parser imports no torch and no HTTP stack."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from phasewise.config import API_KEY_ENV

# What each command module's add_commands(command) gets: command(name, help, cmd_func) adds
# that subcommand (with the flags every command takes) and returns its parser.
Command = Callable[[str, str, Callable[[argparse.Namespace], int]], argparse.ArgumentParser]


def roofline_dtype(text: str) -> str:
    """An argparse type: a roofline dtype or its alias, so that the error names the flag."""
    from phasewise.perf.roofline import norm_dtype

    try:
        return norm_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def thread_count(text: str) -> int:
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


def add_threads_arg(p: argparse.ArgumentParser, help: str = THREADS_HELP) -> None:
    p.add_argument("--threads", type=thread_count, default=None, metavar="N", help=help)


def engine_defaults() -> dict:
    from phasewise.config import EngineConfig

    return {f.name: f.default for f in fields(EngineConfig)}


def add_engine_args(p: argparse.ArgumentParser) -> None:
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

    d = engine_defaults()
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
    add_kernel_plan_arg(p)
    add_threads_arg(p)


def add_kernel_plan_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel-plan", default=None, metavar="FILE",
                   help="CPU: follow this kernel plan file (phasewise tune writes them), "
                   "pinned; default: the plan phasewise tune stored for this machine and "
                   "model, else a rule from the CPU's flags (nothing is timed at start)")


def engine_kwargs(a: argparse.Namespace) -> dict:
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


def model_arg(a: argparse.Namespace) -> str:
    from phasewise.config import resolve_model
    from phasewise.perf.models import catalog_name

    return resolve_model(a.model, note=lambda line: print(line, file=sys.stderr),
                         catalog=catalog_name)


def api_key_arg(value: str) -> str:
    """argparse's type for --api-key (its default, $PHASEWISE_API_KEY, goes through it too)."""
    from phasewise.config import check_api_key

    try:
        return check_api_key(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (from --api-key or ${API_KEY_ENV})") from None


def check_seconds(a: argparse.Namespace, *limits: tuple[str, float, float, bool]) -> None:
    """Each (dest, least, most, zero_is_off) flag holds a number of seconds in [least, most]
    (or 0, where that turns it off); nan, inf and negatives are refused by the flag's
    name."""
    for dest, least, most, zero in limits:
        v = getattr(a, dest)
        if v is None or (zero and v == 0) or least <= v <= most:
            continue
        off = " (0: off)" if zero else ""
        raise ValueError(f"--{dest.replace('_', '-')} must be a number of seconds in "
                         f"[{least:g}, {most:g}]{off}, got {v}")


def check_slo_args(a: argparse.Namespace) -> None:
    from phasewise.engine.slo import check_slo_ms

    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if getattr(a, name) is not None:
            check_slo_ms(getattr(a, name), "--" + name.replace("_", "-"))


def add_slo_args(p: argparse.ArgumentParser) -> None:
    for name, what in (("ttft", "time to first token"), ("tpot", "time per output token")):
        p.add_argument(f"--slo-{name}-ms", type=float, default=None, metavar="MS",
                       help=f"refuse at once (429, Retry-After) a request predicted to miss "
                       f"this {what}, from the queue and the steps' measured cost; a "
                       f"request's slo_{name}_ms field or x-slo-{name}-ms header replaces "
                       "it; requests with no target are never refused for this (default: "
                       "none; docs/serving.md)")


def add_connection_args(p: argparse.ArgumentParser) -> None:
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


def connection_limits(a: argparse.Namespace) -> Any:
    from phasewise.config import parse_memory
    from phasewise.server.limits import ConnectionLimits

    try:
        zero = re.fullmatch(r"\s*0*\.?0*\s*[a-zA-Z]*\s*", str(a.send_buffer)) and \
            re.search(r"0", str(a.send_buffer))
        send = 0 if zero else parse_memory(a.send_buffer)
    except ValueError as e:
        raise ValueError(f"--send-buffer: {e}") from None
    return ConnectionLimits(a.timeout_header, a.timeout_body, a.max_connections,
                            a.max_connections_per_address, a.timeout_write, send)


def setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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



def common_flags(top: bool = True) -> argparse.ArgumentParser:
    """Flags every command takes, before or after its name (``top``: the parser that sets
    their defaults; a subcommand's parser leaves a flag unset unless it is given there, so
    that ``phasewise --debug serve`` keeps it)."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="on an internal error, print the traceback too")
    return c

