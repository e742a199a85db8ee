"""A short probe through a live ``phasewise serve``: what its steps cost as served.

Six phases, each sent to an idle server and each bracketed by two reads of its
``/metrics`` (the engine's ``step_duration_seconds`` by step kind):

1. one stream (``prompt_len`` tokens in, ``output_len`` out);
2. ``batch`` streams sent at once;
3. one prompt of ``prefill_len`` tokens, one token out;
4. the same, sent while a stream decodes (it arrives at a busy engine: the server's event
   loop then waits its turn for the interpreter lock);
5. the same again after ``IDLE_PROBE_S`` and after ``IDLE_LONG_S`` with nothing sent (an
   engine idle for seconds, as arrivals seconds apart find it, is slower to answer than one
   just used, and slower the longer it idled).

The client's token gaps, the server's step durations and the profile's predictions for the
same steps give ``phasewise.perf.served.Served`` (see there). Prompts are random token ids,
new for every phase and every probe, so the prefix cache serves none of them. A server with
other traffic gives wrong figures: the probe refuses to start on one that reports requests
running or waiting. Under P/D, pass every worker's ``/metrics``: the prefill worker's steps
are the remote prefills'.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx

from phasewise.bench.client import ClientConfig, run_workload
from phasewise.perf.served import IDLE_LONG_S, IDLE_PROBE_S, Phase, Served, fit_served
from phasewise.perf.workload import RequestSpec

STEP_METRIC = "phasewise:step_duration_seconds"
BUSY_GAUGES = ("phasewise:num_requests_running", "phasewise:num_requests_waiting")
SETTLE_S, SETTLE_READS = 0.05, 40
MAX_BACKGROUND_TOKENS = 1024  # the busy phase's decoding stream, at most


def read_steps(text: str) -> dict[str, tuple[int, float]]:
    """``{kind: (steps, seconds)}`` from a phasewise ``/metrics`` page (summed over its
    models), and the busy gauges under their names as ``(value, 0.0)``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (STEP_METRIC + "_count", STEP_METRIC + "_sum"):
                kind = s.labels.get("kind", "")
                cell = out.setdefault(kind, [0.0, 0.0])
                cell[0 if s.name.endswith("_count") else 1] += s.value
            elif s.name in BUSY_GAUGES:
                out.setdefault(s.name, [0.0, 0.0])[0] += s.value
    return {k: (int(v[0]), v[1]) for k, v in out.items()}


async def _metrics(client: httpx.AsyncClient, urls: Sequence[str]
                   ) -> dict[str, tuple[int, float]]:
    total: dict[str, tuple[int, float]] = {}
    for url in urls:
        r = await client.get(url.rstrip("/") + "/metrics")
        r.raise_for_status()
        for k, (n, s) in read_steps(r.text).items():
            n0, s0 = total.get(k, (0, 0.0))
            total[k] = (n0 + n, s0 + s)
    return total


async def _settled(client: httpx.AsyncClient, urls: Sequence[str],
                   kinds: Sequence[str] | None = None) -> dict[str, tuple[int, float]]:
    """``_metrics`` once two reads agree (on ``kinds`` only, where given: the others may
    move on meanwhile): the server records a step after it has sent the step's tokens, so
    the read that follows the last token can miss the last step."""
    def view(m: dict[str, tuple[int, float]]) -> Any:
        return m if kinds is None else [m.get(k) for k in kinds]

    last = await _metrics(client, urls)
    for _ in range(SETTLE_READS):
        await asyncio.sleep(SETTLE_S)
        now = await _metrics(client, urls)
        if view(now) == view(last):
            break
        last = now
    return last


def _outside(results: Sequence[Any]) -> tuple[float, ...]:
    """Per stream the server timed: its TTFT beyond the server's queue and prefill."""
    out = []
    for r in results:
        t = r.server_timing
        if r.ttft is not None and isinstance(t, dict) and isinstance(t.get("queue_s"), float) \
                and isinstance(t.get("prefill_s"), float):
            out.append(r.ttft - t["queue_s"] - t["prefill_s"])
    return tuple(out)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Away from the ends of the vocabulary, where special tokens sit.
    lo, hi = min(100, vocab // 4), max(vocab - 100, vocab * 3 // 4)
    return [rng.randrange(lo, hi) for _ in range(n)]


async def _phase(cfg: ClientConfig, metrics_urls: Sequence[str], rng: random.Random,
                 vocab: int, batch: int, prompt_len: int, output_len: int,
                 idle_s: float = 0.0) -> Phase:
    """``batch`` streams at once; ``idle_s``: sent that long after the server last heard
    from anyone (the first read of its /metrics comes before the wait: a read just before
    the request would wake it)."""
    specs = [RequestSpec(i, 0.0, prompt_len, output_len) for i in range(batch)]
    prompts = [_prompt(rng, prompt_len, vocab) for _ in range(batch)]
    async with httpx.AsyncClient(timeout=60.0) as client:
        before = await _settled(client, metrics_urls)
        busy = sum(before.get(g, (0, 0.0))[0] for g in BUSY_GAUGES)
        if busy:
            raise ValueError(f"the server holds {busy} other request(s): the probe needs it "
                             "idle (its figures would include their steps)")
        await asyncio.sleep(idle_s)
        results, _ = await run_workload(cfg, specs, prompts)
        after = await _settled(client, metrics_urls)
    bad = [r.error for r in results if not r.success]
    if bad:
        raise ValueError(f"probe requests failed: {bad[0]}")

    def diff(kind: str) -> tuple[int, float]:
        (n1, s1), (n0, s0) = after.get(kind, (0, 0.0)), before.get(kind, (0, 0.0))
        return n1 - n0, s1 - s0

    # Token gaps once every stream has its first token: the batch decodes in lockstep
    # (streams that ended before the last one started, on a model this fast, give none:
    # then every gap counts).
    start = max(r.ttft or 0.0 for r in results)
    gaps = [(a, b - a) for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    itls = [g for a, g in gaps if a >= start] or [g for _, g in gaps]
    pn, ps = diff("prefill")
    dn, ds = diff("decode")
    return Phase(batch, prompt_len, tuple(r.ttft or 0.0 for r in results), tuple(itls),
                 pn, ps, dn, ds, output_len, outside=_outside(results))


async def _busy_phase(cfg: ClientConfig, metrics_urls: Sequence[str], rng: random.Random,
                      vocab: int, prompt_len: int, prefill_len: int, lone: Phase) -> Phase:
    """One prompt of ``prefill_len`` tokens sent while a stream decodes: its chunks run in
    mixed steps, and it arrives at a busy engine. ``lone``: the one-stream phase, whose
    timing says when the stream is decoding and how long it must last."""
    itl = statistics.median(lone.lockstep_itls)
    delay = lone.ttfts[0] + 4 * itl
    # Long enough to outlast the prompt's prefill (about prefill_len / prompt_len times the
    # lone stream's TTFT) twice over.
    last = delay + 2 * lone.ttfts[0] * max(1.0, prefill_len / prompt_len) + 0.5
    out = min(MAX_BACKGROUND_TOKENS, max(16, int(last / max(itl, 1e-4)) + 8))
    background = asyncio.ensure_future(run_workload(
        cfg, [RequestSpec(0, 0.0, prompt_len, out)], [_prompt(rng, prompt_len, vocab)]))
    try:
        async with httpx.AsyncClient(timeout=60.0) as client:
            await asyncio.sleep(delay)
            before = await _metrics(client, metrics_urls)
            results, _ = await run_workload(cfg, [RequestSpec(1, 0.0, prefill_len, 1)],
                                            [_prompt(rng, prefill_len, vocab)])
            after = await _settled(client, metrics_urls, ("mixed", "prefill"))
        bg, _ = await background
    finally:
        background.cancel()
    bad = [r.error for r in [*results, *bg] if not r.success]
    if bad:
        raise ValueError(f"probe requests failed: {bad[0]}")

    def diff(kind: str) -> tuple[int, float]:
        (n1, s1), (n0, s0) = after.get(kind, (0, 0.0)), before.get(kind, (0, 0.0))
        return n1 - n0, s1 - s0

    # No step mixed the prompt with the stream's decodes: it did not find the engine busy,
    # and says nothing about a busy arrival.
    beside = diff("mixed")[0] > 0
    return Phase(1, prefill_len, (results[0].ttft or 0.0,), (), *diff("prefill"), 0, 0.0, 1,
                 outside=_outside(results) if beside else ())


def probe(base_url: str, cm: Any, vocab_size: int, *, metrics_urls: Sequence[str] = (),
          model: str | None = None, headers: dict[str, str] | None = None, batch: int = 4,
          prompt_len: int = 128, output_len: int = 48, prefill_len: int = 512,
          repeats: int = 2, seed: int | None = None,
          idle_s: tuple[float, float] | None = (IDLE_PROBE_S, IDLE_LONG_S)
          ) -> tuple[Served, list[Phase]]:
    """Probe the idle server at ``base_url`` (metrics from ``metrics_urls``, default the same
    server) and fit ``Served`` against the cost model ``cm``. Each phase runs ``repeats``
    times; the fit takes the median of each figure over the repeats' fits. ``idle_s`` None:
    no idle phases (no wake-up cost measured: the quickest probe)."""
    if idle_s is not None and not 0 < idle_s[0] < idle_s[1] <= 60:
        raise ValueError(f"the probe's idle waits must be 0 < short < long <= 60 s, got "
                         f"{idle_s}")
    if not 1 <= repeats <= 10:
        raise ValueError(f"the probe's rounds must be in [1, 10], got {repeats}")
    if batch < 2:
        raise ValueError(f"the probe's batch must be >= 2 (it separates per-step from "
                         f"per-sequence costs), got {batch}")
    cfg = ClientConfig(base_url=base_url, model=model, headers=dict(headers or {}))
    urls = list(metrics_urls) or [base_url]
    rng = random.Random(seed if seed is not None else time.time_ns())

    async def run() -> list[Phase]:
        out = []
        for _ in range(repeats):
            out.append(await _phase(cfg, urls, rng, vocab_size, 1, prompt_len, output_len))
            out.append(await _phase(cfg, urls, rng, vocab_size, batch, prompt_len, output_len))
            out.append(await _phase(cfg, urls, rng, vocab_size, 1, prefill_len, 1))
            out.append(await _busy_phase(cfg, urls, rng, vocab_size, prompt_len, prefill_len,
                                         out[-3]))
            for idle in idle_s or ():
                out.append(await _phase(cfg, urls, rng, vocab_size, 1, prefill_len, 1, idle))
        return out

    try:
        phases = asyncio.run(run())
    except httpx.HTTPError as e:
        raise ValueError(f"cannot probe {base_url}: {type(e).__name__}: {e or 'no answer'}; "
                         "is a phasewise server listening there, with /metrics?") from e
    per = 6 if idle_s else 4  # phases a round
    fits = [fit_served(cm, *phases[i:i + 3], busy=phases[i + 3],
                       woken=phases[i + 4] if idle_s else None,
                       woken_long=phases[i + 5] if idle_s else None)
            for i in range(0, len(phases), per)]
    when = time.strftime("%Y-%m-%d %H:%M")

    def med(name: str) -> float | None:
        vals = [getattr(f, name) for f in fits if getattr(f, name) is not None]
        return statistics.median(vals) if vals else None

    served = Served(*(med(name) for name in ("prefill_scale", "decode_scale", "step_s",
                                             "sample_s", "request_s")),
                    source=f"probed through {base_url} at {when}, {repeats} rounds",
                    request_busy_s=med("request_busy_s"),
                    wake_s=med("wake_s"), wake_long_s=med("wake_long_s"),
                    profiled=bool(getattr(cm, "knots", None)),  # none: assumed mfu/mbu
                    **({} if idle_s is None else
                       {"wake_idle_s": (float(idle_s[0]), float(idle_s[1]))}))
    return served, phases
