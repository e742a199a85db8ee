"""Request state. One number drives everything: ``num_computed_tokens``.

``all_token_ids`` is the prompt followed by the outputs sampled so far. ``num_computed_tokens``
counts the leading tokens of that list whose K/V are in the cache. At any point:

* ``num_computed_tokens < num_prompt_tokens``: the prompt is (still) being prefilled;
* ``num_computed_tokens == num_tokens - 1``: the next step is a decode of the last sampled
  token;
* after preemption it drops to 0 and the prompt *and* the outputs so far are recomputed,
  as a prefill, before decoding resumes.

A step that computes up to ``num_tokens`` samples one new token; a step that stops short
(a prompt chunk) samples nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from phasewise.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # Holds blocks for its prompt, whose KV a prefill worker computes and sends; never
    # scheduled until that KV and the first token are in (or the remote prefill fails).
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class RemoteTiming:
    """A remote prefill's milestones on the decode worker's clock."""

    sent: float
    first_kv: float | None
    done: float
    kv_bytes: int
    kv_frames: int


@dataclass
class RequestMetrics:
    """Timestamps of a request's life, all on one clock: the caller's ``arrival_time``, then
    the scheduler's injected clock (``time.monotonic`` in the engine; virtual time in a
    simulator)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    # A prompt prefilled by a prefill worker (the decode role), on the same clock:
    # ``remote.sent``, ``remote.first_kv`` and ``remote.done`` (request sent, first K/V
    # frame landed, first token back) and ``remote.kv_bytes``; None for a local prefill.
    remote: RemoteTiming | None = None
    # Behind a router: the worker's own ``timings`` entry for this request.
    worker_timing: dict[str, Any] | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        prompt: str | None = None,
        arrival_time: float,
    ) -> None:
        """``arrival_time`` is on the scheduler's clock; a request reads no clock itself.
        Its random generator, if seeded, lives in the ``Sampler``."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self._all = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # One entry per prompt position: None for the first (nothing precedes it), then the
        # prompt token's own log-probability and the top N (filled chunk by chunk in prefill).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.metrics = RequestMetrics(arrival_time)
        # The client request it is one sample of (n samples, several prompts: one group),
        # a key no request id equals; None: its own. The scheduler shares seats fairly
        # between groups.
        self.group: Hashable | None = None
        # Its reader has stopped taking its outputs (a client that does not read its
        # stream): the scheduler runs none of its tokens, and gives its seat to a waiting
        # request that needs one, until the reader catches up (LLMEngine.park).
        self.parked = False
        # Structured output: its place in its grammar (a structured.Matcher, set by the
        # engine), advanced by each token it is given.
        self.grammar: Any = None
        # Speculative decoding: the draft tokens this step verifies after the last sampled
        # token (a decode of 1 + len(spec_token_ids) tokens); never part of all_token_ids.
        self.spec_token_ids: list[int] = []

    @property
    def all_token_ids(self) -> list[int]:
        return self._all

    @property
    def num_tokens(self) -> int:
        return len(self._all)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def output_complete(self) -> bool:
        """Its grammar can take nothing more (structured output): it ends here."""
        return self.grammar is not None and self.grammar.done

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions still lack their logprobs: its prefill must compute (not take
        from the prefix cache, nor from a prefill worker) every prompt token."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all.append(token_id)

    def truncate_outputs(self, n: int) -> None:
        """Keep the first ``n`` outputs (a stop string ended the request inside a step that
        emitted several), with their timestamps and logprobs."""
        drop = self.num_output_tokens - n
        if drop <= 0:
            return
        del self.output_token_ids[n:]
        del self._all[self.num_prompt_tokens + n:]
        del self.metrics.token_times[len(self.metrics.token_times) - drop:]
        if self.logprobs is not None and len(self.logprobs) > n:
            del self.logprobs[n:]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
