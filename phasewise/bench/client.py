"""The load generator: send a workload to an OpenAI-compatible server and time every chunk.

Requests go to ``/v1/completions`` with the prompt as token ids (so the stated lengths are
exact) and ``stream: true``. Each SSE chunk's arrival is taken from the client's monotonic
clock; the tokens it carries are counted from ``usage.completion_tokens`` when the server sends
usage on every chunk (vLLM's and phasewise's ``continuous_usage_stats``), else one per chunk
with text. Nothing here imports the engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from phasewise.perf.summary import RequestResult
from phasewise.perf.workload import RequestSpec


@dataclass
class ClientConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "/v1/completions"
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 3600.0  # each request's whole life, its stream included
    extra_body: dict[str, Any] = field(default_factory=dict)


def _body(cfg: ClientConfig, spec: RequestSpec, prompt: list[int] | str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": spec.output_len, "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if cfg.model:
        body["model"] = cfg.model
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def error_message(body: str) -> str:
    """An error reply's message: ``error.message`` of an OpenAI-style JSON body (or
    ``message`` / ``detail`` at the top), else the body on one line (an HTML page: its
    title, or its text without tags: no OpenAI-compatible server answers so)."""
    try:
        data = json.loads(body)
    except ValueError:
        return _one_line(body)
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail")
            if isinstance(msg, str) and msg:
                return msg
        elif isinstance(err, str) and err:
            return err
    return _one_line(body)


def _one_line(body: str) -> str:
    title = re.search(r"<title[^>]*>(.*?)</title>", body, re.I | re.S)
    if title is not None:
        return "an HTML page, not an OpenAI-compatible reply: " + " ".join(
            title.group(1).split())
    if re.search(r"<(html|body|!doctype)", body, re.I):
        text = re.sub(r"<[^>]*>", " ", body)
        return "an HTML page, not an OpenAI-compatible reply: " + " ".join(text.split())
    return " ".join(body.split())


# The longest server-sent event line read: an OpenAI chunk of a few tokens is bytes to
# kilobytes; a longer line is not one, and is not held in memory.
MAX_EVENT_LINE = 16 << 20
MAX_COUNT = 2**31  # a token count a server may report


async def _event_lines(r: httpx.Response) -> AsyncIterator[str]:
    """The response's lines, each at most ``MAX_EVENT_LINE`` bytes (ValueError past it)."""
    buf = bytearray()
    async for chunk in r.aiter_bytes():
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            yield buf[start:end].decode("utf-8", errors="replace").rstrip("\r")
            start = end + 1
        del buf[:start]
        if len(buf) > MAX_EVENT_LINE:
            raise ValueError(f"an event line longer than {MAX_EVENT_LINE >> 20} MiB")
    if buf:
        yield buf.decode("utf-8", errors="replace").rstrip("\r")


def _count(value: Any, name: str) -> int:
    """A token count the server reported: a whole number in [0, 2^31] (ValueError naming
    it otherwise: a count that is not one fails its request, not the run's summary)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value <= MAX_COUNT) or value != int(value):
        raise ValueError(f"the server reported {name} {str(value)[:40]}, not a token count")
    return int(value)


def _timing(entry: dict[str, Any]) -> dict[str, Any]:
    """A server's timing of a request, its figures only where they are finite numbers
    within ±1e9 (seconds, counts, bytes): what the summary averages."""
    return {k: v for k, v in entry.items() if isinstance(k, str) and (
        v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v) and abs(v) <= 1e9))}


async def send_one(client: httpx.AsyncClient, cfg: ClientConfig, spec: RequestSpec,
                   prompt: list[int] | str, t_run0: float) -> RequestResult:
    """One request; it fails (never the run) on an error, an odd reply, or past
    ``cfg.timeout_s`` from its start, stream included."""
    res = RequestResult(spec.index, spec.prompt_len, spec.output_len, spec.intruder)
    t0 = time.monotonic()
    try:
        return await asyncio.wait_for(_send_one(client, cfg, spec, prompt, t_run0, res),
                                      cfg.timeout_s)
    except TimeoutError:
        res.success = False
        res.error = f"no end within --request-timeout {cfg.timeout_s:g} s"
        res.latency = time.monotonic() - t0
        return res


async def _send_one(client: httpx.AsyncClient, cfg: ClientConfig, spec: RequestSpec,
                    prompt: list[int] | str, t_run0: float,
                    res: RequestResult) -> RequestResult:
    t0 = time.monotonic()
    res.start = t0 - t_run0
    counted = 0  # completion tokens reported by usage so far
    saw_usage = False
    try:
        async with client.stream("POST", cfg.endpoint, json=_body(cfg, spec, prompt)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {error_message(text)[:500]}"
                res.latency = time.monotonic() - t0
                return res
            async for line in _event_lines(r):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.monotonic() - t0
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict)
                                    else err)[:500]
                    res.latency = time.monotonic() - t0
                    return res
                choices = chunk.get("choices") or []
                usage = chunk.get("usage")
                if choices:
                    text = choices[0].get("text") or (choices[0].get("delta") or {}).get(
                        "content") or ""
                    if usage is not None:
                        saw_usage = True
                        n = _count(usage.get("completion_tokens"),
                                   "usage.completion_tokens") - counted
                        counted += n
                    else:
                        n = 1 if text else 0
                    if n > 0:
                        if res.ttft is None:
                            res.ttft = now
                        res.chunk_times.append(now)
                        res.chunk_tokens.append(n)
                elif usage is not None:  # the final usage-only chunk
                    res.output_tokens = _count(usage.get("completion_tokens"),
                                               "usage.completion_tokens")
                    if isinstance(prompt, str) and usage.get("prompt_tokens"):
                        # a text prompt's length
                        res.prompt_len = _count(usage["prompt_tokens"], "usage.prompt_tokens")
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and details.get("cached_tokens") is not None:
                        res.cached_tokens = _count(details["cached_tokens"],
                                                   "usage.prompt_tokens_details.cached_tokens")
                    timings = chunk.get("timings")
                    if isinstance(timings, list) and timings and isinstance(timings[0], dict):
                        res.server_timing = _timing(timings[0])
        res.latency = time.monotonic() - t0
        if not res.output_tokens:
            res.output_tokens = counted if saw_usage else sum(res.chunk_tokens)
        res.success = res.ttft is not None
        if not res.success:
            res.error = "the stream ended without a token"
    except Exception as e:  # any odd reply fails this request, never the whole run
        res.error = f"{type(e).__name__}: {e}"[:500]
        res.latency = time.monotonic() - t0
    return res


class Progress:
    """Progress on stderr: a one-line bar on a terminal; elsewhere (logs, pipes) a plain line
    every 10 seconds and at the end. ``enabled=False`` silences it."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total, self.label, self.done, self.failed = total, label, 0, 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self._last = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        if self.enabled and not self.tty:
            if now - self._last > 10 or self.done == self.total:
                self._last = now
                print(f"{self.label}: {self.done}/{self.total} done ({self.failed} failed), "
                      f"{now - self.t0:.0f}s", file=sys.stderr, flush=True)
            return
        if self.enabled and (now - self._last > 0.2 or self.done == self.total):
            self._last = now
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total} ({self.failed} failed) "
                             f"{now - self.t0:.0f}s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_workload(cfg: ClientConfig, specs: Sequence[RequestSpec],
                       prompts: Sequence[list[int] | str], *,
                       progress: Progress | None = None,
                       on_result: Callable[[RequestResult], None] | None = None,
                       ) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival offset (waiting for a concurrency slot when
    ``max_concurrency`` is set). Returns the results in workload order and the run's
    duration (first send to last completion)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=cfg.headers,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=60.0),
                                 limits=limits) as client:
        t_run0 = time.monotonic()

        async def one(spec: RequestSpec, prompt: list[int] | str) -> RequestResult:
            delay = spec.arrival - (time.monotonic() - t_run0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                async with sem:
                    res = await send_one(client, cfg, spec, prompt, t_run0)
            else:
                res = await send_one(client, cfg, spec, prompt, t_run0)
            if progress is not None:
                progress.update(res.success)
            if on_result is not None:
                on_result(res)
            return res

        results = await asyncio.gather(*(one(s, p) for s, p in zip(specs, prompts)))
        duration = max((r.start + r.latency for r in results), default=0.0)
    return list(results), duration


def result_rows(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    return [dict(asdict(r), itls=r.itls, tpot=r.tpot) for r in results]


def finite(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None
