"""``phasewise bench``: build the workload, make the prompts, run it (once per request rate),
summarise, and write vLLM-format result files. Reads the server's ``/metrics`` before and
after each run when it is a phasewise server, to record its own queue/prefill/decode split."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import sys
import time
from typing import Any

import httpx

from phasewise.bench.client import ClientConfig, Progress, run_workload
from phasewise.bench.prompts import (corpus_text, make_prompts,
                                     tokens_from_file, tokens_from_server)
from phasewise.perf.summary import (
    check_result_flags,
    parse_slo,
    save_result,
    summarize,
    text_table,
)
from phasewise.perf.workload import build_workload, check_fits, load_trace, workload_lengths

SERVER_HISTOGRAMS = ("request_queue_time_seconds", "request_prefill_time_seconds",
                     "request_decode_time_seconds", "time_to_first_token_seconds",
                     "inter_token_latency_seconds")
# A sweep's rate i draws its prompts' text from seed + i * this (its lengths from seed alone).
SWEEP_TEXT_STRIDE = 1_000_003
# Above this share of prompt tokens served from the prefix cache, a synthetic run (whose
# prompts share no prefix by design) was not computed cold, and says so.
CACHE_WARN_SHARE = 0.1


def scrape_phasewise_metrics(base_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The ``phasewise:`` samples of /metrics, or None if the server is not phasewise."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or "phasewise:" not in r.text:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                 if k not in ("model_name", "le"))
                if "le" in s.labels:
                    continue  # bucket counts: the sums and counts are enough here
                if not math.isfinite(s.value) or abs(s.value) > 1e15:
                    raise ValueError(f"{s.name} is {s.value}")
                out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    except ValueError as e:  # (the parser's errors too): no split, and the run goes on
        print(f"warning: {base_url}/metrics could not be read as phasewise's ({e}); the "
              "server's own split is left out", file=sys.stderr)
        return None
    return out


def server_split(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Means of the server's own intervals over the run, and its step mix."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    split: dict[str, Any] = {}
    for h in SERVER_HISTOGRAMS:
        n = d.get(f"phasewise:{h}_count", 0.0)
        split[f"mean_{h.removesuffix('_seconds')}_ms"] = (
            1e3 * d.get(f"phasewise:{h}_sum", 0.0) / n if n else None)
    split["engine_steps"] = {k: int(d.get(f"phasewise:engine_steps_total{{kind={k}}}", 0))
                             for k in ("prefill", "decode", "mixed")}
    split["step_tokens"] = {p: int(d.get(f"phasewise:step_tokens_total{{phase={p}}}", 0))
                            for p in ("prefill", "decode")}
    split["preemptions"] = int(d.get("phasewise:num_preemptions_total", 0))
    split["prompt_tokens"] = int(d.get("phasewise:prompt_tokens_total", 0))
    split["generation_tokens"] = int(d.get("phasewise:generation_tokens_total", 0))
    return split


def server_wide_line(sm: dict[str, Any], completed: int) -> str:
    """The summary's line from ``server_split``: from /metrics before and after the run, so
    every request the server served meanwhile, another client's too (the TTFT split above:
    this run's requests alone)."""
    steps = ", ".join(f"{n} {kind}" for kind, n in sm["engine_steps"].items())
    if completed and not any(sm["engine_steps"].values()):
        steps = ("none counted by this server (a router runs no engine: each worker's "
                 "/metrics counts its own)")
    return (f"{'Server-wide, all clients (mean ms):':<37} queue "
            f"{_fmt(sm['mean_request_queue_time_ms'])}  prefill "
            f"{_fmt(sm['mean_request_prefill_time_ms'])}  decode "
            f"{_fmt(sm['mean_request_decode_time_ms'])}; steps: {steps}")


def _headers(a: argparse.Namespace) -> dict[str, str]:
    h = {}
    for item in a.header:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--header takes KEY=VALUE, got {item!r}")
        # RFC 9110's token characters for the name; no line breaks in the value
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", key) or "\n" in value \
                or "\r" in value:
            raise ValueError(f"--header {item!r}: not a valid HTTP header (a name of letters, "
                             "digits and !#$%&'*+-.^_`|~, a value without line breaks)")
        h[key] = value
    if a.api_key:
        h["Authorization"] = f"Bearer {a.api_key}"
    return h



def main(a: argparse.Namespace) -> int:
    slo = parse_slo(a.goodput)
    headers = _headers(a)
    check_result_flags(a)
    if not 0 <= a.temperature <= 100:  # the server's own bounds (nan fails both)
        raise ValueError(f"--temperature must be a number in [0, 100], got {a.temperature}")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (or left out: no limit), got "
                         f"{a.max_concurrency}")
    for r in a.request_rate:
        if not r > 0:
            raise ValueError(f"--request-rate values must be > 0 (or inf), got {r}")
    dists = workload_lengths(a)
    label = a.label or "phasewise-bench"
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(2**31)
    drawn = "" if a.seed is not None else \
        f" (drawn for this run; --seed {seed} sends the same requests again)"
    print(f"seed {seed}{drawn}", file=sys.stderr)
    if a.trace:
        base_specs = load_trace(a.trace, a.trace_time_scale)
    else:
        base_specs = None
    need_corpus = base_specs is None or any(s.prompt is None for s in base_specs)
    corpus_ids: list[int] = []
    context: int | None = None  # the server's max_model_len, where its /tokenize says it
    if need_corpus:
        t0 = time.monotonic()
        text = corpus_text()
        if a.tokenizer:
            corpus_ids = tokens_from_file(a.tokenizer, text)
        else:
            corpus_ids, context = tokens_from_server(a.base_url, text, headers, a.model)
        print(f"prompt corpus: {len(corpus_ids)} tokens ({time.monotonic() - t0:.1f}s)",
              file=sys.stderr)
    sweep = len(a.request_rate) > 1
    summaries = []
    for i, rate in enumerate(a.request_rate):
        if base_specs is not None:
            specs = base_specs
        else:
            specs = build_workload(
                a.num_prompts, dists[0], dists[1], request_rate=rate,
                burstiness=a.burstiness, intruder_fraction=a.intruder_fraction,
                intruder_len=dists[2], seed=seed)
        if context is not None:
            check_fits(specs, context, trace=base_specs is not None)
        # The same lengths and arrivals at every rate of a sweep, but other text: a rate's
        # prompts must not be served from the cache the previous rate filled.
        prompts = make_prompts(specs, corpus_ids, seed + SWEEP_TEXT_STRIDE * i) \
            if corpus_ids else [s.prompt or "" for s in specs]
        cfg = ClientConfig(base_url=a.base_url, model=a.model, endpoint=a.endpoint,
                           max_concurrency=a.max_concurrency, ignore_eos=not a.no_ignore_eos,
                           temperature=a.temperature, headers=headers,
                           timeout_s=a.request_timeout)
        before = scrape_phasewise_metrics(a.base_url, headers)
        progress = Progress(len(specs), f"rate {rate:g} req/s", enabled=not a.disable_tqdm)
        results, duration = asyncio.run(run_workload(cfg, specs, prompts, progress=progress))
        after = scrape_phasewise_metrics(a.base_url, headers)
        out = summarize(results, duration, slo or None)
        out.update({
            "label": label, "base_url": a.base_url, "endpoint": a.endpoint,
            "model_id": a.model, "request_rate": rate if math.isfinite(rate) else "inf",
            "burstiness": a.burstiness, "max_concurrency": a.max_concurrency,
            "num_prompts": len(specs), "seed": seed, "input_len": a.input_len,
            "output_len": a.output_len, "intruder_fraction": a.intruder_fraction,
            "intruder_len": a.intruder_len if a.intruder_fraction else None,
            "trace": a.trace, "date": time.strftime("%Y%m%d-%H%M%S"), "sweep": sweep,
            "server_metrics": server_split(before, after) if before and after else None,
        })
        print(f"\n==== {label}: request rate {rate:g} req/s ====")
        print(text_table(out))
        warning = cache_warning(out, synthetic=base_specs is None)
        if warning:
            print(warning)
        if out["server_metrics"]:
            print(server_wide_line(out["server_metrics"], out["completed"]))
        save_result(a, out, label, rate, sweep)
        summaries.append(out)
    if sweep:
        print("\n==== sweep ====")
        print(f"{'rate':>8} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'ITL p99':>9} {'goodput':>8}")
        for s in summaries:
            gp = s["request_goodput"]
            print(f"{s['request_rate']!s:>8} {s['request_throughput']:>8.3f} "
                  f"{s['output_throughput']:>10.1f} {s['median_ttft_ms']:>9.0f} "
                  f"{s['p99_ttft_ms']:>9.0f} {s['median_tpot_ms']:>9.1f} "
                  f"{s['p99_itl_ms']:>9.0f} {'-' if gp is None else f'{gp:.3f}':>8}")
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def cache_warning(out: dict[str, Any], synthetic: bool) -> str | None:
    """A warning where a synthetic workload (meant to be computed cold: its prompts are
    windows of a corpus that share no prefix by design) was served in part from the server's
    prefix cache: its requests were sent before (a repeated ``--seed``, or an earlier run
    with the same seed), so its TTFTs measure cache hits rather than prefill."""
    cached, of = out.get("cached_prompt_tokens"), out.get("cached_of_prompt_tokens")
    if not synthetic or not cached or not of or cached < CACHE_WARN_SHARE * of:
        return None
    # one window that starts where an earlier request's did is chance (a few requests over
    # a corpus a busy server has seen much of): half of them hitting is not
    hits = out.get("requests_with_cache_hits") or 0
    if hits < max(2, out.get("completed", 0) / 2):
        return None
    return (f"warning: the server's prefix cache served {100 * cached / of:.0f}% of the prompt "
            f"tokens ({out['requests_with_cache_hits']} requests): these prompts (seed "
            f"{out['seed']}) were sent to it before, so TTFT here measures cache hits, not "
            "prefill. Run without --seed (a fresh one is drawn), or restart the server.")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"
