"""What the engine hands back: per-request outputs and per-step stats (the text behind the
outputs is ``phasewise.engine.output_processor``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasewise.engine.request import RequestMetrics


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
    # Why, for the API: None (the engine's fault, a 500) or "invalid_grammar" (the request's
    # own grammar failed: backend.GrammarFailed, a 400).
    error_code: str | None = None
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
    should have cost (the engine's cost model, ``phasewise.engine.step_cost``: for ``LLM`` and
    the server, ``phasewise.perf.attribution``): its FLOPs and bytes for the step's exact mix
    of chunks and decodes, and the time those take at this machine's measured peaks
    (``predicted_s``; None when no peaks are stored; all None for an engine given no cost
    model)."""

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
    # What the step's decodes alone would have cost (its prediction without its prompt
    # chunks): predicted_s less this is the chunks' marginal cost, which the dashboard's
    # stall view weighs before it blames a chunk. None where unpriced.
    predicted_decode_s: float | None = None
    # Who rode on the step (for the dashboard's playground and stall view): each prompt
    # chunk as (request id, tokens), and the ids of the requests that decoded one token.
    prefill_chunks: tuple[tuple[str, int], ...] = ()
    decode_ids: tuple[str, ...] = ()
    # each prompt chunk's whole prompt in tokens, in prefill_chunks' order (empty where the
    # record was made without them)
    prefill_prompt_tokens: tuple[int, ...] = ()
    compute_dtype: str | None = None  # whose peak predicted_s is rated at
    # Speculative decoding: draft tokens this step verified, and how many it kept.
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    # The wall time of the step's forward pass (the model's kernels and per-layer calls,
    # from its first call to the sampled rows' logits; on CUDA up to where sampling reads
    # them: LLMEngine._forward_s), within duration_s; None where not measured.
    forward_s: float | None = None
    # A mixture of experts: the distinct experts the step's tokens routed to, averaged over
    # its sparse layers (the expert weights it read); None for a dense model.
    experts_read: float | None = None
    # A model with sliding windows: the positions its decodes' contexts held (summed over the
    # decode rows), and those whose K/V they read, averaged over the layers (a windowed layer
    # reads at most its window); None where every layer reads the whole context.
    kv_context: int | None = None
    kv_read: float | None = None

    @classmethod
    def of(cls, index: int, start: float, duration: float, batch: Any,
           riders: tuple[tuple[tuple[str, int], ...], tuple[str, ...], tuple[int, ...]],
           cost: Any,
           scheduler: Any, kv_usage: float, proposed: int, accepted: int,
           decode_s: float | None = None, forward_s: float | None = None,
           experts_read: float | None = None,
           kv_read: tuple[int, float] | None = None) -> StepStats:
        """The record of a step that ran ``batch`` (a ``ScheduledBatch``; ``riders``: its
        ``riders()``, read before the scheduler's update), priced at ``cost`` (a
        ``StepPrediction``; ``decode_s``: the seconds of its decodes alone), with
        ``scheduler``'s queues as they are after it; ``forward_s``: its forward pass's time;
        ``kv_read``: (``kv_context``, ``kv_read``)."""
        return cls(
            index=index, start_time=start, duration_s=duration,
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=batch.num_decode_tokens, num_requests=len(batch.requests),
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            kv_usage=kv_usage, num_preempted=len(batch.preempted),
            predicted_flops=cost.flops, predicted_bytes=cost.bytes, predicted_s=cost.seconds,
            predicted_decode_s=decode_s, prefill_chunks=riders[0], decode_ids=riders[1],
            prefill_prompt_tokens=riders[2],
            compute_dtype=cost.compute_dtype, num_spec_proposed=proposed,
            num_spec_accepted=accepted, forward_s=forward_s, experts_read=experts_read,
            kv_context=kv_read[0] if kv_read else None,
            kv_read=kv_read[1] if kv_read else None)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def host_s(self) -> float | None:
        """The step's time outside its forward pass: scheduling, batch layout, sampling,
        stop strings and outputs (None where forward_s is)."""
        return None if self.forward_s is None else max(self.duration_s - self.forward_s, 0.0)

