"""The internal relay between a router and the workers behind it: one JSON line per engine
output, so a router can rebuild each worker's ``RequestOutput`` stream as its own.

Both ends use this module: a worker's HTTP server (``phasewise.server.internal``) writes the
lines and the router (``phasewise.disagg.router``) reads them. It sits in the engine room, below
both, since it speaks only the engine's own types (``SamplingParams``, ``RequestOutput``).

A worker answers ``POST /internal/v1/generate`` (validated token ids and sampling parameters,
already tokenized by the router) with ``application/x-ndjson``: one ``encode_output`` line per
output, then, if the worker's engine failed or stopped, one ``{"error": ...}`` line. The
worker that starts to drain (SIGTERM) writes a ``{"notice": "handover"}`` line into each
stream, so the router can move it (``LLMEngine.add_request``'s ``resume``). The
router's ``OutputAssembler`` turns the lines back into ``RequestOutput``s with timestamps on
its own clock (so its TTFT and ITL are what its clients see) and keeps the worker's own split
of the request's time as ``RequestMetrics.worker_timing``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phasewise.engine.outputs import RequestOutput
from phasewise.engine.request import RequestMetrics
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.validation import is_count

MEDIA_TYPE = "application/x-ndjson"
# The header a router sends its workers' /internal/* routes the fleet's internal key in
# (--internal-key-file; phasewise.server.guard checks it).
INTERNAL_HEADER = "x-phasewise-internal"


def file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def checkpoint_identity(model_dir: Path) -> dict[str, str | None]:
    """What a router and its workers must share to serve one model: the hashes of the
    checkpoint's ``config.json`` and ``tokenizer.json`` (None for a file that cannot be read)."""
    return {"config_sha256": file_sha256(model_dir / "config.json"),
            "tokenizer_sha256": file_sha256(model_dir / "tokenizer.json")}


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as JSON-able values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(params).items()}


def params_from_wire(values: dict[str, Any]) -> SamplingParams:
    """The inverse of ``params_to_wire``; every value is validated by SamplingParams."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown sampling parameters {unknown} (allowed: "
                         f"{', '.join(sorted(fields))})")
    return SamplingParams(**values)


def param_defaults(params: SamplingParams) -> dict[str, Any]:
    """The fields of ``params`` that differ from SamplingParams() (a model's generation
    defaults), so a router applies a client's overrides over the same defaults a worker
    would."""
    base = params_to_wire(SamplingParams())
    return {k: v for k, v in params_to_wire(params).items() if base[k] != v}


def _entries(entries: list[dict[int, float] | None]) -> list[list[list[Any]] | None]:
    return [None if e is None else [[t, lp] for t, lp in e.items()] for e in entries]


def _parse_entries(raw: list[Any], vocab: int = 2**31) -> list[dict[int, float] | None]:
    """Logprob entries from the wire: ids in [0, vocab), log-probabilities finite or -inf
    (a token the filters ruled out); ValueError otherwise."""
    out: list[dict[int, float] | None] = []
    for e in raw:
        if e is None:
            out.append(None)
            continue
        entry = {}
        for t, lp in e:
            if not is_count(t, vocab - 1):
                raise ValueError(f"a logprob's token id {str(t)[:40]} is not in [0, {vocab})")
            v = float(lp)
            if math.isnan(v) or v > 0:
                raise ValueError(f"a log-probability of {v} is not one")
            entry[t] = v
        out.append(entry)
    return out


def encode_output(index: int, out: RequestOutput, timing: dict[str, Any] | None, *,
                  first: bool = False) -> bytes:
    """One line: what this output added (text, token ids, their logprobs), on a request's
    ``first`` line the prompt tokens this worker's prefix cache served and its prompt logprobs
    (if asked for), and on the last one the finish and the worker's ``timing`` of the
    request."""
    k = len(out.delta_token_ids)
    lps = None
    if out.logprobs is not None and k:
        lps = _entries(out.logprobs[-k:])
    line: dict[str, Any] = {"i": index, "text": out.delta_text, "ids": out.delta_token_ids,
                            "lp": lps}
    if first:
        line["cached"] = out.metrics.num_cached_tokens
        if out.prompt_logprobs is not None:
            line["plp"] = _entries(out.prompt_logprobs)
    if out.finished:
        line.update(fin=out.finish_reason, stop=out.stop_reason, err=out.error,
                    timing=timing)
    return json.dumps(line, ensure_ascii=False).encode() + b"\n"


def encode_notice(notice: str) -> bytes:
    """A line that ends nothing: ``handover`` (the worker is draining; a router that can
    resume the stream on another worker does so, else it reads on)."""
    return json.dumps({"notice": notice}).encode() + b"\n"


def encode_error(kind: str, message: str) -> bytes:
    """The stream's last line when the worker's engine failed (``engine``), the request's
    own grammar failed (``grammar``) or the worker is shutting down (``stopped``)."""
    return json.dumps({"error": {"kind": kind, "message": message}}).encode() + b"\n"


def _plain_timing(timing: Any) -> bool:
    """A worker's timing of a request: short names of finite numbers within ±1e12
    (seconds, counts, bytes), or of null."""
    return isinstance(timing, dict) and len(timing) <= 64 and all(
        isinstance(k, str) and len(k) <= 64 and (v is None or (
            isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and abs(v) <= 1e12))
        for k, v in timing.items())


# Characters a request's text may hold beyond its tokens' entries: a character the prompt's
# last token began and the first output token completes.
TEXT_SLACK = 64


class RelayError(Exception):
    """A line the router cannot use (a bug or a foreign peer): the request fails."""


class OutputAssembler:
    """The router's side: per request of a group, the outputs so far, rebuilt from lines."""

    def __init__(self, request_ids: list[str], prompts: list[list[int]],
                 texts: list[str | None], arrival_time: float,
                 clock: Callable[[], float] = time.monotonic,
                 vocab_size: int = 2**31, max_token_chars: int | None = None) -> None:
        self.vocab_size = vocab_size  # a token id past it is a foreign worker's line
        # A token's text is at most its vocabulary entry's characters (and a space a decoder
        # may put before it): a request's text longer than that over its tokens is a foreign
        # worker's, which would otherwise grow the router's memory without bound.
        self.max_token_chars = max_token_chars
        self.request_ids = request_ids
        self.prompts = prompts
        self.texts = texts
        self.clock = clock
        self.metrics = [RequestMetrics(arrival_time=arrival_time) for _ in request_ids]
        self.text = ["" for _ in request_ids]
        self.ids: list[list[int]] = [[] for _ in request_ids]
        self.logprobs: list[list[dict[int, float]] | None] = [None for _ in request_ids]
        self.finished = [False] * len(request_ids)
        self.prompt_logprobs: list[list[dict[int, float] | None] | None] = [
            None for _ in request_ids]
        # The prompt tokens the first worker that answered a request served from its cache.
        # A worker that resumes a moved request counts its cache hits over the prompt and the
        # tokens it was resumed with, which are not the prompt's: the first worker's count
        # is the one usage reports.
        self.cached: list[int | None] = [None for _ in request_ids]

    def admitted(self) -> None:
        """The worker took the group (its reply began)."""
        now = self.clock()
        for m in self.metrics:
            m.first_scheduled_time = now

    def feed(self, raw: bytes | str, index: list[int] | None = None) -> RequestOutput:
        """One output line -> that request's ``RequestOutput``. Raises ``RelayError``.
        ``index``: the request each of the relay's specs is (a relay that resumes some of a
        group's requests elsewhere numbers them from 0); None: the group's own order."""
        try:
            line = json.loads(raw)
            i = line["i"]
            if index is not None:
                i = index[i] if isinstance(i, int) and 0 <= i < len(index) else -1
            delta_text, delta_ids, lps = line["text"], line["ids"], line["lp"]
            vocab = self.vocab_size
            if not (isinstance(i, int) and 0 <= i < len(self.request_ids)
                    and not self.finished[i] and isinstance(delta_text, str)
                    and isinstance(delta_ids, list)
                    and all(is_count(t, vocab - 1) for t in delta_ids)):
                raise RelayError(f"malformed output line: {str(raw)[:200]}")
            if not delta_text.isascii():
                delta_text.encode()  # a lone surrogate: no UTF-8 a client could be sent
            if self.max_token_chars is not None:
                most = ((self.max_token_chars + 1) * (len(self.ids[i]) + len(delta_ids))
                        + TEXT_SLACK)
                if len(self.text[i]) + len(delta_text) > most:
                    raise RelayError(f"{len(self.text[i]) + len(delta_text)} characters of "
                                     f"text for {len(self.ids[i]) + len(delta_ids)} tokens, "
                                     f"more than their {most} could decode to")
            entries = None if lps is None else _parse_entries(lps, vocab)
            plp = _parse_entries(line["plp"], vocab) if "plp" in line else None
            timing = line.get("timing") if "fin" in line else None
            if timing is not None and not _plain_timing(timing):
                raise RelayError(f"malformed timing: {str(timing)[:200]}")
            if plp is not None:
                self.prompt_logprobs[i] = plp
            cached = line.get("cached")
            # a resumed request's prompt holds the tokens streamed before its move
            seen = len(self.prompts[i]) + len(self.ids[i])
            if cached is not None and not is_count(cached, seen):
                raise RelayError(f"a cached prompt count of {str(cached)[:40]} is not in "
                                 f"[0, {seen}]")
        except (ValueError, KeyError, TypeError) as e:
            raise RelayError(f"malformed output line ({type(e).__name__}: {e}): "
                             f"{str(raw)[:200]}") from None
        now = self.clock()
        m = self.metrics[i]
        if cached is not None and self.cached[i] is None:
            self.cached[i] = m.num_cached_tokens = cached
        if delta_ids and m.first_token_time is None:
            m.first_token_time = now
        m.token_times.extend([now] * len(delta_ids))
        self.text[i] += delta_text
        self.ids[i].extend(delta_ids)
        if entries is not None:
            if self.logprobs[i] is None:
                self.logprobs[i] = []
            self.logprobs[i].extend(entries)
        fin = line.get("fin")
        finished = "fin" in line
        if finished:
            self.finished[i] = True
            m.finished_time = now
            if isinstance(timing, dict):
                if self.cached[i] is None:  # a worker that does not send "cached"
                    m.num_cached_tokens = int(timing.get("cached_tokens") or 0)
                elif "cached_tokens" in timing:  # the prompt's, as usage says it
                    timing = {**timing, "cached_tokens": self.cached[i]}
                m.worker_timing = timing
                m.num_preemptions = int(timing.get("preemptions") or 0)
        # Copies, as the engine's outputs are: the reader of this output may take its delta
        # (the last entries) after later lines have grown the request's lists.
        lps_so_far = self.logprobs[i]
        return RequestOutput(
            request_id=self.request_ids[i], prompt=self.texts[i],
            prompt_token_ids=self.prompts[i], text=self.text[i], token_ids=list(self.ids[i]),
            delta_text=delta_text, delta_token_ids=list(delta_ids), finished=finished,
            finish_reason=fin, stop_reason=line.get("stop"),
            logprobs=None if lps_so_far is None else list(lps_so_far),
            metrics=m, error=line.get("err"), prompt_logprobs=self.prompt_logprobs[i])
