"""What the engine hands back: per-request outputs, text streaming and per-step stats."""

from __future__ import annotations

from dataclasses import dataclass

from phasewise.engine.finish import find_stop_string
from phasewise.engine.request import RequestMetrics
from phasewise.engine.sampling_params import SamplingParams
from phasewise.model.tokenizer import TextStream


@dataclass
class RequestOutput:
    """A request's state after a step. ``text``/``token_ids`` are everything so far;
    ``delta_text``/``delta_token_ids`` are what this step added (for streaming)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None  # the stop string or stop token that ended it
    logprobs: list[dict[int, float]] | None
    metrics: RequestMetrics
    # Set when this request failed alone (its sampling raised): it is finished, as "abort".
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt position, None for the first
    # (complete from the request's first output on).
    prompt_logprobs: list[dict[int, float] | None] | None = None


def new_token_gaps(out: RequestOutput) -> list[float]:
    """The gaps between consecutive output tokens that ``out``'s new tokens close: one per
    token after the request's first (a verify emits several at once, so some are 0)."""
    times = out.metrics.token_times
    return [times[i] - times[i - 1]
            for i in range(max(len(times) - len(out.delta_token_ids), 1), len(times))]


@dataclass(frozen=True)
class StepStats:
    """One engine step: its token mix, how long it took, and what the roofline says it
    should have cost (``phasewise.perf.attribution``): its FLOPs and bytes for the step's exact
    mix of chunks and decodes, and the time those take at this machine's measured peaks
    (``predicted_s``; None when no peaks are stored, or for a step nobody predicted)."""

    index: int
    start_time: float  # time.monotonic() at the start of the step
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_requests: int  # requests that computed tokens in this step
    num_running: int  # after the step
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by requests, after the step
    num_preempted: int
    predicted_flops: float | None = None
    predicted_bytes: float | None = None
    predicted_s: float | None = None
    # Who rode on the step (for the dashboard's playground and stall view): each prompt
    # chunk as (request id, tokens), and the ids of the requests that decoded one token.
    prefill_chunks: tuple[tuple[str, int], ...] = ()
    decode_ids: tuple[str, ...] = ()
    compute_dtype: str | None = None  # whose peak predicted_s is rated at
    # Speculative decoding: draft tokens this step verified, and how many it kept.
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class TextState:
    """Incremental text of one request, with stop-string matching.

    Stop strings (rule 6 of ``phasewise.engine.finish``) are matched on the decoded text, so
    they are found across token boundaries.
    While a request runs, the last ``max_stop_len - 1`` characters are held back from deltas,
    so a partial stop string never reaches the client.
    """

    def __init__(self, stream: TextStream, params: SamplingParams) -> None:
        self.stream = stream
        self.params = params
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0

    def add_token(self, token_id: int) -> str | None:
        """Append a token's text; return the stop string it completed, if any."""
        piece = self.stream.step(token_id)
        if not piece:
            return None
        old_len = len(self.text)
        self.text += piece
        if not self.params.stop:
            return None
        start = max(0, old_len - self.params.max_stop_len + 1)
        hit = find_stop_string(self.text, start, self.params.stop)
        if hit is None:
            return None
        pos, s = hit
        self.text = self.text[:pos + (len(s) if self.params.include_stop_str_in_output else 0)]
        return s

    def take_delta(self, finished: bool) -> str:
        hold = 0 if finished else max(0, self.params.max_stop_len - 1)
        limit = max(self.sent_chars, len(self.text) - hold)
        delta = self.text[self.sent_chars:limit]
        self.sent_chars = limit
        return delta
