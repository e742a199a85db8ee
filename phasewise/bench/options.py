"""The flags of ``phasewise bench``, kept apart from the client so that building the CLI's
parser imports no HTTP or asyncio machinery (every ``phasewise`` command builds it)."""

from __future__ import annotations

import argparse
import math


def add_args(p: argparse.ArgumentParser) -> None:
    """Flags follow ``vllm bench serve`` where the concept is the same."""
    p.add_argument("--base-url", type=http_url, default="http://127.0.0.1:8000",
                   help="server root, e.g. http://127.0.0.1:8000 (HOST:PORT alone means "
                   "http://HOST:PORT)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"],
                   help="completions only: prompts are token ids, so lengths are exact")
    p.add_argument("--model", default=None, help="model name to send (default: none)")
    add_workload_args(p)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--request-timeout", type=positive_float, default=3600.0, metavar="S",
                   help="a request not ended this many seconds after it was sent, its "
                   "stream included, fails (a server that hangs or streams without end)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json for the prompts (default: the server's /tokenize)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's sampling temperature (0: greedy)")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at end-of-sequence (lengths become inexact)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--header", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra HTTP headers on every request")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def http_url(text: str) -> str:
    """An argparse type: a server's root, ``http://HOST:PORT`` or ``https://…``; a bare
    ``HOST:PORT`` (as curl takes it) means ``http://HOST:PORT``. Any other scheme, or none
    with no host, is refused by name."""
    url = text.strip()
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "http", url
    if scheme.lower() not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL such as "
                                         f"http://127.0.0.1:8000, got {text!r}")
    host = rest.split("/", 1)[0]
    if not host or host.startswith(":") or any(c.isspace() for c in rest):
        raise argparse.ArgumentTypeError(f"must name a host, as in http://127.0.0.1:8000; "
                                         f"got {text!r}")
    return f"{scheme.lower()}://{rest}"


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (nan and inf refused: a gap, a scale or a
    duration of either would never end or mean nothing)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def add_workload_args(p: argparse.ArgumentParser, simulated: bool = False,
                      results: bool = True) -> None:
    """What is sent and when, the SLOs and where results go: shared by ``phasewise bench``
    and the simulator (``phasewise simulate``, ``phasewise plan``), so one workload
    description drives a real run and a simulated one."""
    p.add_argument("--num-prompts", type=int, default=100,
                   help="requests to send (simulate, plan: to simulate)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests/s (inf: all at once); several values make a sweep")
    p.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", default="256",
                   help="prompt tokens: N, uniform:LO-HI or normal:MEAN,STD[,max=M]")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", default="64",
                   help="output tokens: N, uniform:LO-HI or normal:MEAN,STD[,max=M]")
    p.add_argument("--intruder-fraction", type=float, default=0.0,
                   help="share of requests that get a long prompt instead")
    p.add_argument("--intruder-len", default="2048", help="the intruders' prompt tokens")
    p.add_argument("--trace", default=None,
                   help="JSONL of {arrival, prompt_len|prompt, output_len} (replaces the "
                        "synthetic workload)")
    p.add_argument("--trace-time-scale", type=positive_float, default=1.0,
                   help="multiply the trace's arrival times by this (> 0)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the prompts' lengths and arrivals (default 0)" if simulated
                   else "seed of the prompts' lengths, arrivals and text (default: a fresh "
                   "one each run, printed, so that a second run is not served from the "
                   "server's prefix cache; give the printed seed to send the same requests "
                   "again)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    if not results:
        return
    p.add_argument("--label", default=None, help="name of this run in results and reports")
    p.add_argument("--result-file", "--result-filename", dest="result_file", default=None,
                   help="write the JSON result here (with a sweep: -rate<R> is added)")
    p.add_argument("--result-dir", default=None,
                   help="folder the result files go into")
    p.add_argument("--save-result", action="store_true",
                   help="write the result even without --result-file (name from the label)")
