"""The seam between the HTTP server and whatever produces tokens: ``ServingBackend``.

The server (``phasewise.server``) talks to one ``ServingBackend`` and to nothing else of the
engine. ``AsyncEngine`` implements it over an in-process ``LLMEngine``; the P/D router will
implement it over remote prefill and decode workers, so one server fronts either. Everything
here is plain data or a protocol: this module imports no torch and no engine internals.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

from phasewise.engine.outputs import RequestOutput, StepStats
from phasewise.engine.request import RequestMetrics
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.slo import SLO
from phasewise.engine.validation import is_count

if TYPE_CHECKING:
    from phasewise.model.tokenizer import Tokenizer


class EngineOverloaded(Exception):
    """The waiting queue is full; retry later."""


class EngineStopped(Exception):
    """The engine is shutting down (or has stopped) and takes no new requests."""


class SLORefused(Exception):
    """The engine predicts the request would miss its SLO target (``phasewise.engine.slo``):
    refused at admission. ``reason``: ``slo_ttft`` or ``slo_tpot``; retry after
    ``retry_after_s`` seconds."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class EngineUnavailable(Exception):
    """Nothing behind this backend can take the request now (a router with no reachable
    worker); retry later."""


class EngineError(Exception):
    """The engine failed while running this request (a bug: the traceback is in the log).
    ``status``, ``type`` and ``code`` are what the API answers with."""

    status = 500
    type = "server_error"
    code = "engine_error"


class GrammarFailed(EngineError):
    """The request's own grammar could not go on mid-generation (llguidance's parser hit a
    limit, or a token's mask took too long): the client's grammar is at fault, not the
    engine, and no other request is affected."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_grammar"


def request_error(message: str, code: str | None) -> EngineError:
    """The exception for a request that failed alone (``RequestOutput.error``/``error_code``)."""
    return GrammarFailed(message) if code == GrammarFailed.code else EngineError(message)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state, taken on its own thread. Counters are cumulative."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks held by requests
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached
    num_waiting_remote: int = 0  # requests holding blocks while a prefill worker computes
    num_blocks_waiting_remote: int = 0  # the blocks those requests hold
    # requests whose reader stopped taking their outputs (Request.parked), running or not
    num_parked: int = 0
    # Speculative decoding: verifies (request-steps with drafts), drafts proposed, accepted,
    # and the tokens those verifies emitted.
    spec_verifies: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_emitted: int = 0

    @classmethod
    def from_wire(cls, d: Any) -> EngineSnapshot:
        """A snapshot another process sent (a worker's ``/internal/v1/load``), every field
        checked: counts are integers in [0, 2^62], ``kv_usage`` a fraction. ValueError
        names the first field that is not (a router sums and ranks by them)."""
        if not isinstance(d, dict):
            raise ValueError("the snapshot is not an object")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                if f.default is MISSING:
                    raise ValueError(f"the snapshot has no {f.name}")
                continue
            v = d[f.name]
            if f.name == "kv_usage":
                ok = (isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v) and 0 <= v <= 1)
            else:
                ok = is_count(v)
            if not ok:
                raise ValueError(f"the snapshot's {f.name} is {str(v)[:40]!r}, not "
                                 + ("a fraction" if f.name == "kv_usage"
                                    else "an integer in [0, 2^62]"))
            values[f.name] = v
        return cls(**values)


@dataclass(frozen=True)
class FinishedRequest:
    """One request's end, for per-request metrics (aborted requests included)."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str  # "stop", "length" or "abort"
    metrics: RequestMetrics

    @classmethod
    def of(cls, out: RequestOutput, reason: str | None = None,
           default: str = "abort") -> FinishedRequest:
        """The end of the request ``out`` is the latest output of: ``reason``, else its own
        finish reason, else ``default``."""
        return cls(out.request_id, len(out.prompt_token_ids), len(out.token_ids),
                   reason or out.finish_reason or default, out.metrics)


class EngineObserver(Protocol):
    def on_step(self, step: StepStats | None, outputs: Sequence[RequestOutput],
                finished: Sequence[FinishedRequest], snapshot: EngineSnapshot) -> None:
        """``step`` is None when only commands (adds, aborts) changed the state."""


@dataclass(frozen=True)
class PromptSpec:
    """One request of a group: token ids (already validated by the caller) and its params.

    P/D (see ``LLMEngine``'s remote prefill): ``remote`` (the decode role) reserves blocks
    for a prompt a prefill worker computes, or prefills it here when there is no room (the
    group's ``remote_hits`` then says None); ``export_kv_from`` (the prefill role) ships its
    prompt's K/V from that token on through the engine's ``kv_sink``.

    ``resume``: outputs another worker generated and streamed before it went away (a router
    migrates the request; ``LLMEngine.add_request``); the outputs carry only what follows.
    ``slo``: its targets (``phasewise.engine.slo``): the group is refused (``SLORefused``)
    if the engine predicts it would miss them (the first spec's speak for the group)."""

    token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    remote: bool = False
    export_kv_from: int | None = None
    resume: tuple[int, ...] = ()
    slo: SLO | None = None


@dataclass(frozen=True)
class BackendInfo:
    """What a server needs to know about its backend to validate requests and describe
    itself. ``description`` is shown in the server's start-up line; ``roofline`` says what
    each step's predicted cost is measured against (for the log)."""

    model_path: str
    architecture: str
    num_params: int
    max_model_len: int
    vocab_size: int
    max_waiting: int | None
    description: str
    roofline: str = ""


@dataclass(frozen=True)
class _Notice:
    text: str


class _Slot:
    """A request's output waiting in its group's queue; a later output of the same request
    merges into it until the reader takes it (``RequestGroup._put``)."""

    __slots__ = ("out",)

    def __init__(self, out: RequestOutput) -> None:
        self.out = out


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One output that says what ``old`` then ``new`` said: ``new``'s state (everything so
    far) with both deltas."""
    return replace(new, delta_text=old.delta_text + new.delta_text,
                   delta_token_ids=old.delta_token_ids + new.delta_token_ids)


class RequestGroup:
    """The outputs of a group of requests, in the order the backend produced them.

    Iterate with ``async for index, output in group``; ``index`` is the request's position in
    the group. Iteration ends when every request has finished. ``close()`` aborts whatever is
    still running (call it in a ``finally``); it is safe to call more than once. An exception
    put into the group (``_put``) ends the iteration by raising it. A notice (``notify``:
    text for the group's reader that ends nothing) comes out between outputs as
    ``(-1, text)``; only the relay's own groups get them (``phasewise.server.internal``).

    A reader that falls far behind (a client that stops reading its stream) finds at most
    ``MERGE_AFTER`` outputs of a request waiting: past that, a request's outputs merge into
    its latest one not yet taken (``merge_outputs``; deltas joined, the rest the latest),
    never across a notice. Each output holds everything so far, so a queue of them would
    grow with the square of the output's length while its stream stands still; a reader a
    few steps behind still gets one output per step (a stream, one chunk per token).

    A request whose outputs begin to merge is parked (``park(ids, True)``, where the backend
    gives ``park``): it runs no more tokens, and gives its seat to a waiting request that
    needs one, until its reader has taken every output of it (``park(ids, False)``).
    """

    MERGE_AFTER = 16  # outputs of one request waiting before later ones merge

    def __init__(self, request_ids: list[str], abort: Callable[[list[str]], None],
                 on_close: Callable[[list[str]], None],
                 park: Callable[[list[str], bool], None] | None = None) -> None:
        self.request_ids = request_ids
        self._abort = abort
        self._on_close = on_close
        self._park = park
        self._parked: set[str] = set()
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        # Per request with PromptSpec.remote: the prompt tokens the decode engine already
        # holds (the prefill worker sends K/V from there), or None: it prefills here.
        self.remote_hits: list[int | None] = []
        self.routing: str | None = None  # behind a router: the worker it chose, and why
        # whether outputs may reach it yet (AsyncEngine: once its engine admitted it)
        self.ready = True
        self._queue: asyncio.Queue[_Slot | BaseException | _Notice] = asyncio.Queue()
        self._waiting: dict[str, _Slot] = {}  # request id -> its latest output not yet taken
        self._queued: dict[str, int] = {}  # request id -> its outputs not yet taken
        self._open = set(request_ids)

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        if isinstance(item, BaseException):
            self._waiting.clear()
            self._queue.put_nowait(item)
            return
        rid = item.request_id
        slot = self._waiting.get(rid)
        if slot is not None and self._queued.get(rid, 0) >= self.MERGE_AFTER:
            slot.out = merge_outputs(slot.out, item)
            if self._park is not None and rid not in self._parked and not item.finished:
                self._parked.add(rid)
                self._park([rid], True)
            return
        self._waiting[rid] = slot = _Slot(item)
        self._queued[rid] = self._queued.get(rid, 0) + 1
        self._queue.put_nowait(slot)

    def notify(self, text: str) -> None:  # on the event loop
        self._waiting.clear()  # an output after the notice stays after it
        self._queue.put_nowait(_Notice(text))

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._open:
            raise StopAsyncIteration
        got = await self._queue.get()
        if isinstance(got, _Notice):
            return -1, got.text  # type: ignore[return-value]
        if isinstance(got, BaseException):
            self.close()
            raise got
        item = got.out
        rid = item.request_id
        if self._waiting.get(rid) is got:
            del self._waiting[rid]
        n = self._queued.get(rid, 0) - 1
        if n > 0:
            self._queued[rid] = n
        else:
            self._queued.pop(rid, None)
            if rid in self._parked:  # its reader has caught up: it may run again
                self._parked.discard(rid)
                if not item.finished and self._park is not None:
                    self._park([rid], False)
        if item.finished:
            self._open.discard(item.request_id)
        return self._index[item.request_id], item

    @property
    def finished(self) -> bool:
        return not self._open

    def _forget(self) -> None:
        """Mark every request finished without aborting (the backend already dropped them)."""
        self._open.clear()

    def close(self) -> None:
        if self._open:
            self._abort(sorted(self._open))
            self._open.clear()
        self._on_close(self.request_ids)


class ServingBackend(Protocol):
    """Everything the HTTP server needs from what serves it.

    Life cycle: ``start(loop)`` once the event loop runs; ``stop_accepting()`` when draining
    begins; ``abort_all(reason)`` ends every open request with ``EngineStopped(reason)``;
    ``shutdown()`` (blocking: call it off the loop) stops the backend.
    """

    info: BackendInfo
    tokenizer: Tokenizer

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """The model's sampling defaults with ``overrides`` applied (raises
        ``phasewise.engine.validation.ValidationError`` naming the field)."""

    async def add(self, specs: Sequence[PromptSpec], request_id: str,
                  arrival_time: float | None = None) -> RequestGroup:
        """Admit a group (all or nothing). Raises ``EngineOverloaded``, ``EngineStopped``,
        ``EngineUnavailable`` (nothing can take it now: retry later) or ``ValueError``."""

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def park(self, request_ids: Sequence[str], parked: bool) -> None:
        """Hold (``parked``) or release requests whose reader stopped reading (see
        ``RequestGroup``)."""

    def abort_all(self, reason: str) -> None: ...

    @property
    def snapshot(self) -> EngineSnapshot: ...

    def add_observer(self, observer: EngineObserver) -> None: ...

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None: ...

    def stop_accepting(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...

    @property
    def is_alive(self) -> bool:
        """It can serve: false while its engine is down or stuck in one step (``/health``
        answers 503 then)."""

    @property
    def down_reason(self) -> str:
        """Why ``is_alive`` is false, in a sentence for ``/health``."""

    @property
    def num_open_groups(self) -> int: ...
