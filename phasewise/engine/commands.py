"""Commands to the engine thread: plain frozen dataclasses that could cross a process boundary.

Nothing in a command refers to the caller's event loop: an add carries a ``ticket``, and the
verdict comes back as a ``Verdict`` for that ticket. So the same commands can be pickled onto
a socket when the engine runs in another process (the P/D workers).
"""

from __future__ import annotations

from dataclasses import dataclass

from phasewise.engine.backend import PromptSpec
from phasewise.engine.request import RemoteTiming


@dataclass(frozen=True)
class AddRequests:
    """Admit these requests all together or not at all. ``max_waiting``: refuse the group
    (``EngineOverloaded``) if the waiting queue would then hold more than this many."""

    ticket: int
    requests: tuple[tuple[str, PromptSpec], ...]
    arrival_time: float
    max_waiting: int | None = None


@dataclass(frozen=True)
class LoadRemoteKV:
    """K/V of a request waiting for a remote prefill: the blocks from prompt token
    ``first_token`` on, as raw bytes of ``dtype`` in ``shape`` (``phasewise.engine.kv_bytes``)."""

    request_id: str
    first_token: int
    dtype: str
    shape: tuple[int, ...]
    payload: bytes


@dataclass(frozen=True)
class FinishRemotePrefill:
    """The prefill worker's first sampled token: the request decodes on here. If its K/V is
    not all in, it is computed here instead (as after ``FailRemotePrefill``)."""

    request_id: str
    token: int
    logprobs: tuple[tuple[int, float], ...] | None = None
    timing: RemoteTiming | None = None  # the hand-off's milestones, for the request's metrics


@dataclass(frozen=True)
class FailRemotePrefill:
    """The remote prefill will not finish: compute what did not arrive here."""

    request_id: str


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class ParkRequests:
    """Hold (``parked``) or release requests whose reader stopped taking their outputs
    (``LLMEngine.park``)."""

    request_ids: tuple[str, ...]
    parked: bool


@dataclass(frozen=True)
class AbortAll:
    """End every request now; their streams get ``EngineStopped(reason)``."""

    reason: str


@dataclass(frozen=True)
class Stop:
    """Abort everything and stop the engine loop."""

    reason: str = "the server shut down"


Command = (AddRequests | AbortRequests | AbortAll | Stop | LoadRemoteKV | FinishRemotePrefill
           | FailRemotePrefill | ParkRequests)


@dataclass(frozen=True)
class Verdict:
    """The engine's answer to an ``AddRequests``: ``error`` is None when admitted, else
    (kind, message, param) with kind one of ``overloaded``, ``stopped``, ``invalid``, ``slo``
    (refused by its SLO target; param: ``reason:retry_after_s``)."""

    ticket: int
    error: tuple[str, str, str | None] | None = None  # (kind, message, param)
    remote_hits: tuple[int | None, ...] = ()  # per request of the group (PromptSpec.remote)
