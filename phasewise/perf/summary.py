"""Summaries of a benchmark run, with vLLM's result field names so existing tooling reads them.

A run is a list of ``RequestResult`` (one request, timed by the client): the load generator
(``phasewise bench``) measures them against a server, the simulator (``phasewise simulate``)
computes them in virtual time, and both are summarised here, by the same code.

Definitions (as vLLM's ``bench serve`` and DistServe use them):

* TTFT: request sent -> first chunk carrying a token;
* ITL: gap between consecutive token-carrying chunks of a request (one entry per gap);
* TPOT: (e2e - TTFT) / (output tokens - 1), per request with at least 2 output tokens;
* e2e latency (``e2el``): request sent -> stream finished;
* goodput: completed requests per second that met every SLO given (``ttft``, ``tpot``,
  ``e2el``, in ms);
* the longest stall: the largest ITL of the run, the request it happened to, and the request
  most likely to have caused it (of the requests still waiting for their first token while the
  gap lasted, the one with the longest prompt: its prefill is what ran meanwhile).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.files import check_output, write_text_atomic

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request, timed by the client. Times are seconds; ``start`` is from the start of the
    run, the others from the request's own start."""

    index: int
    prompt_len: int
    output_len: int  # asked for
    intruder: bool
    start: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # every chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    output_tokens: int = 0
    latency: float = 0.0
    success: bool = False
    error: str = ""
    # The server's own split (phasewise servers send it on the final usage chunk):
    # {"queue_s", "prefill_s", "decode_s", ...}, else None.
    server_timing: dict[str, Any] | None = None
    # Prompt tokens the server's prefix cache served (usage.prompt_tokens_details.cached_tokens,
    # on the final usage chunk), None where the server does not say.
    cached_tokens: int | None = None

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1), as vLLM and DistServe define it."""
        if not self.success or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# A gap between two token-carrying chunks shorter than this is two tokens that arrived
# together: no engine step, CPU or GPU, is this short.
BURST_GAP_S = 1e-4
# The share of such gaps from which the summary says the timings measure delivery.
BURST_NOTE_SHARE = 0.2


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def parse_slo(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:2000", "tpot:200"]`` (or ``"ttft:2000,tpot:200"``) -> {name: ms}."""
    out: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            key, sep, value = part.partition(":")
            if key not in ("ttft", "tpot", "e2el") or not sep:
                raise ValueError(f"an SLO is ttft:MS, tpot:MS or e2el:MS; got {part!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"SLO {key} needs a number of milliseconds; got {value!r}")
            if not 0 < ms < float("inf"):  # (nan fails this too)
                raise ValueError(f"SLO {key} must be a finite number of ms > 0; got {value!r}")
            if key in out:
                raise ValueError(f"SLO {key} is given twice ({out[key]:g} and {ms:g} ms)")
            out[key] = ms
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.success or r.ttft is None:
        return False
    tpot = r.tpot if r.tpot is not None else 0.0
    return (r.ttft * 1e3 <= slo.get("ttft", math.inf)
            and tpot * 1e3 <= slo.get("tpot", math.inf)
            and r.latency * 1e3 <= slo.get("e2el", math.inf))


def longest_stall(results: Sequence[RequestResult]) -> dict[str, Any] | None:
    best: tuple[float, RequestResult, int] | None = None
    for r in results:
        for i, gap in enumerate(r.itls):
            if best is None or gap > best[0]:
                best = (gap, r, i)
    if best is None:
        return None
    gap, r, i = best
    begin = r.start + r.chunk_times[i]  # run time at which the stall began
    end = begin + gap
    culprit = None
    for other in results:
        if other is r or other.ttft is None:
            continue
        first = other.start + other.ttft
        if other.start < end and first > begin:  # it was waiting for its first token
            if culprit is None or other.prompt_len > culprit.prompt_len:
                culprit = other
    return {"itl_ms": gap * 1e3, "request": r.index, "at_s": begin,
            "culprit": culprit.index if culprit else None,
            "culprit_prompt_len": culprit.prompt_len if culprit else None,
            "culprit_intruder": culprit.intruder if culprit else None}


def failure_reasons(errors: Sequence[str | None]) -> list[tuple[str, int, bool]]:
    """The failed requests' errors grouped: (an example, how many, whether the group's
    messages differ in their numbers), most frequent first. Errors that differ only in
    numbers (a prompt's length, say) are one group."""
    groups: dict[str, list[str]] = {}
    for e in errors:
        if e:
            groups.setdefault(re.sub(r"\d+(\.\d+)?", "#", e), []).append(e)
    return sorted(((msgs[0], len(msgs), len(set(msgs)) > 1) for msgs in groups.values()),
                  key=lambda g: -g[1])


def failure_lines(result: dict[str, Any], width: int = 200) -> list[str]:
    """``N requests failed:`` and one line per reason (``x COUNT  ERROR``)."""
    reasons = failure_reasons(result.get("errors") or [])
    n = sum(count for _, count, _ in reasons)
    if not n:
        return []
    lines = [f"{n} request{'s' * (n != 1)} failed:"]
    for text, count, varies in reasons:
        text = text if len(text) <= width else text[:width - 1] + "…"
        lines.append(f"  x{count}  {text}" + ("  (the numbers vary)" if varies else ""))
    return lines


def _stats(name: str, values_s: Sequence[float], out: dict[str, Any]) -> None:
    ms = [v * 1e3 for v in values_s]
    out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else float("nan")
    out[f"median_{name}_ms"] = statistics.median(ms) if ms else float("nan")
    out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else float("nan")
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(ms, p)


def prefix_hits(ok: Sequence[RequestResult]) -> dict[str, Any]:
    """The prompt tokens the server's prefix cache served, over the requests whose usage said
    so: their count, the prompt tokens of those requests, and how many requests had a hit.
    All None where no request reported it (a server without the field)."""
    told = [r for r in ok if r.cached_tokens is not None]
    if not told:
        return {"cached_prompt_tokens": None, "cached_of_prompt_tokens": None,
                "requests_with_cache_hits": None}
    return {"cached_prompt_tokens": sum(r.cached_tokens or 0 for r in told),
            "cached_of_prompt_tokens": sum(r.prompt_len for r in told),
            "requests_with_cache_hits": sum(1 for r in told if r.cached_tokens)}


# Two modes: sorted values with an empty stretch of at least this ratio between two
# neighbours, each side holding at least MODE_SHARE of them (and two values): with the
# percentiles near that stretch, a few requests moving across it move p50 or p90 by the gap.
MODE_GAP = 1.3
MODE_SHARE = 0.15
# Too few values show a gap of MODE_GAP by chance (eight can split four and four).
MODE_MIN_VALUES = 20
MODE_MIN_EACH = 5  # values each mode holds at least


def modes(values: Sequence[float]) -> dict[str, Any] | None:
    """The two modes of ``values`` (seconds), or None where they have one: each mode's
    median (ms), the upper mode's share, and the empty stretch between them (ms)."""
    v = sorted(x for x in values if x is not None and x > 0)
    n = len(v)
    if n < MODE_MIN_VALUES:
        return None
    least = max(MODE_MIN_EACH, math.ceil(MODE_SHARE * n))
    best = None
    for i in range(least, n - least + 1):
        ratio = v[i] / v[i - 1]
        if ratio >= MODE_GAP and (best is None or ratio > best[1]):
            best = (i, ratio)
    if best is None:
        return None
    i = best[0]
    return {"low_ms": statistics.median(v[:i]) * 1e3, "high_ms": statistics.median(v[i:]) * 1e3,
            "high_share": (n - i) / n, "gap_ms": (v[i - 1] * 1e3, v[i] * 1e3)}


def summarize(results: Sequence[RequestResult], duration: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
    }
    out.update(prefix_hits(ok))
    dur = duration if duration > 0 else math.nan
    out["request_throughput"] = len(ok) / dur
    out["output_throughput"] = out["total_output_tokens"] / dur
    out["total_token_throughput"] = (out["total_input_tokens"]
                                     + out["total_output_tokens"]) / dur
    out["request_goodput"] = (sum(meets_slo(r, slo) for r in results) / dur) if slo else None
    out["slo"] = dict(slo) if slo else None
    _stats("ttft", [r.ttft for r in ok if r.ttft is not None], out)
    _stats("tpot", [r.tpot for r in ok if r.tpot is not None], out)
    out["tpot_modes"] = modes([r.tpot for r in ok if r.tpot is not None])
    gaps = [g for r in ok for g in r.itls]
    _stats("itl", gaps, out)
    # Gaps no engine step could make: tokens that arrived together (a proxy or the server's
    # own buffering held them, or speculative decoding emitted several in one step)
    out["burst_share"] = (sum(g < BURST_GAP_S for g in gaps) / len(gaps)) if gaps else None
    _stats("e2el", [r.latency for r in ok], out)
    out["longest_stall"] = longest_stall(ok)
    # Per-request detail, in vLLM's field names (seconds), plus what only this client keeps.
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_tokens for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itls for r in results]
    out["latencies"] = [r.latency for r in results]
    out["start_times"] = [r.start for r in results]
    out["errors"] = [r.error for r in results]
    out["chunk_times"] = [r.chunk_times for r in results]
    out["chunk_tokens"] = [r.chunk_tokens for r in results]
    out["intruders"] = [r.intruder for r in results]
    out["server_timings"] = [r.server_timing for r in results]
    out["ttft_split"] = ttft_split(out["server_timings"])
    return out


# The server's split of TTFT (phasewise's usage ``timings``): queue, then either a local
# prefill or, for a prompt a prefill worker computed, its remote prefill, transfer and the
# first step back on the decode worker.
SPLIT_KEYS = ("queue_s", "prefill_s", "remote_prefill_s", "kv_transfer_s", "first_step_s")


def ttft_split(timings: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Means (ms) of each part of TTFT over the requests the server timed, with how many
    were prefilled remotely and their mean K/V bytes; None when no request was timed."""
    timed = [t for t in timings if isinstance(t, dict)]
    if not timed:
        return None
    out: dict[str, Any] = {"requests": len(timed)}
    remote = [t for t in timed if t.get("kv_bytes") is not None]
    for key in SPLIT_KEYS:
        pool = remote if key in ("remote_prefill_s", "kv_transfer_s", "first_step_s") \
            else timed
        vals = [t[key] for t in pool if isinstance(t.get(key), (int, float))]
        out[f"mean_{key[:-2]}_ms"] = statistics.fmean(vals) * 1e3 if vals else None
    out["remote"] = len(remote)
    out["mean_kv_bytes"] = (statistics.fmean(t["kv_bytes"] for t in remote)
                            if remote else None)
    return out


def text_table(result: dict[str, Any]) -> str:
    """The plain-text summary printed after a run."""
    lines = []

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<37} {value}")  # (a long label still has its space)

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Benchmark duration (s):", f"{result['duration']:.2f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    cached, of = result.get("cached_prompt_tokens"), result.get("cached_of_prompt_tokens")
    if cached is not None and of:
        row("Prefix cache hits (server):", f"{cached} of {of} prompt tokens "
            f"({100 * cached / of:.1f}%) in {result['requests_with_cache_hits']} requests")
    row("Request throughput (req/s):", f"{result['request_throughput']:.3f}")
    if result.get("request_goodput") is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in result["slo"].items())
        row(f"Request goodput (req/s) [{slo}]:", f"{result['request_goodput']:.3f}")
    row("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                        ("e2el", "E2E latency")):
        values = [result[f"{k}_{name}_ms"] for k in ("mean", "median", "std", "p90", "p99")]
        if all(math.isnan(v) for v in values):  # nothing measured it (nan: no sample)
            row(f"{label} (ms):", "none (no request gave one)")
            continue
        stats = "  ".join(f"{k} {v:.1f}" for k, v in
                          zip(("mean", "median", "std", "p90", "p99"), values))
        row(f"{label} (ms):", stats)
    burst = result.get("burst_share")
    if burst is not None and burst >= BURST_NOTE_SHARE:
        row("Tokens arrived in bursts:", f"{burst:.0%} of the gaps between tokens were under "
            f"{BURST_GAP_S * 1e3:g} ms, shorter than any engine step: several tokens came "
            "together (held by a proxy or the server's buffering, or emitted by one "
            "speculative step), so ITL and TPOT measure their delivery, not the decode steps")
    m = result.get("tpot_modes")
    if m:
        row("TPOT has two modes:", f"{1 - m['high_share']:.0%} of requests near "
            f"{m['low_ms']:.1f} ms, {m['high_share']:.0%} near {m['high_ms']:.1f} ms, none "
            f"between {m['gap_ms'][0]:.1f} and {m['gap_ms'][1]:.1f} (a percentile near the "
            "gap moves by it when a few requests change mode)")
    stall = result.get("longest_stall")
    if stall:
        culprit = ("" if stall["culprit"] is None else
                   f"; likely cause: request {stall['culprit']} "
                   f"({stall['culprit_prompt_len']}-token prompt"
                   f"{', intruder' if stall['culprit_intruder'] else ''})")
        row("Longest stall:", f"{stall['itl_ms']:.1f} ms in request {stall['request']} at "
            f"t={stall['at_s']:.2f}s{culprit}")
    split = result.get("ttft_split")
    if split:
        # kv_transfer_s runs from the first K/V frame to the first token back: for a chunked
        # prompt, the prefill worker's later chunks too, so it is shown as the hand-off, not
        # as a copy's time
        parts = [f"{shown} {split[f'mean_{name}_ms']:.1f}" for name, shown in
                 (("queue", "queue"), ("prefill", "prefill"),
                  ("remote_prefill", "remote_prefill"), ("kv_transfer", "kv_handoff"),
                  ("first_step", "first_step"))
                 if split.get(f"mean_{name}_ms") is not None]
        remote = (f"; {split['remote']} of {split['requests']} prefilled remotely, "
                  f"a mean {split['mean_kv_bytes'] / 1e6:.2f} MB of K/V a request"
                  if split["remote"] else "")
        row("TTFT split, these requests (mean ms):", "  ".join(parts) + remote)
    lines += failure_lines(result)
    return "\n".join(lines)


def result_path(a: argparse.Namespace, label: str, rate: float, sweep: bool) -> Path | None:
    if not (a.result_file or a.save_result or a.result_dir):
        return None
    name = Path(a.result_file).name if a.result_file else f"{label}.json"
    if sweep:
        stem = name.removesuffix(".json")
        name = f"{stem}-rate{rate:g}.json"
    folder = Path(a.result_dir) if a.result_dir else (
        Path(a.result_file).parent if a.result_file else Path("."))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def check_result_flags(a: argparse.Namespace) -> None:
    """``--result-file`` and ``--result-dir`` checked before the run, not after it."""
    if a.result_file is not None:
        check_output(a.result_file, "--result-file")
    if a.result_dir is not None:
        check_output(a.result_dir, "--result-dir", folder=True)


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as null: JSON has no such numbers, and strict
    readers (JavaScript's JSON.parse, jq) refuse a file that holds them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def save_result(a: argparse.Namespace, out: dict[str, Any], label: str, rate: float,
                sweep: bool) -> None:
    """Write one run's result where the flags say (nowhere without them), and say where
    (a figure no request gave, such as the mean TTFT of a run where every one failed, is
    null)."""
    path = result_path(a, label, rate, sweep)
    if path is not None:
        write_text_atomic(path, json.dumps(_json_safe(out), indent=1, allow_nan=False))
        print(f"result written to {path}")
