"""The engine's async front: ``LLMEngine`` runs in its own thread; asyncio code talks to it.

The engine thread owns the ``LLMEngine`` outright: it alone adds, aborts and steps requests,
so the engine needs no locks. Other threads reach it only through a command queue:

* ``add``: a group of requests (a batch of prompts, or ``n`` samples of one) joins the engine
  all together or not at all; the caller awaits the engine thread's verdict, so a request the
  engine can never serve raises ``ValueError`` in the caller.
* ``abort``: stops requests and frees their KV blocks before the next step runs.

Outputs travel back with ``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per group, so
the event loop never waits on a forward pass. Observers (metrics, the periodic log line) are
called on the engine thread after every step and after every batch of commands, with a
snapshot of the engine's state; they must be quick and thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from phasewise.engine.engine import LLMEngine
from phasewise.engine.outputs import RequestOutput, StepStats
from phasewise.engine.request import Request, RequestMetrics
from phasewise.engine.sampling_params import SamplingParams

log = logging.getLogger("phasewise.engine")


class EngineOverloaded(Exception):
    """The waiting queue is full; retry later."""


class EngineStopped(Exception):
    """The engine is shutting down (or has stopped) and takes no new requests."""


class EngineError(Exception):
    """The engine failed while running this request (a bug: the traceback is in the log)."""


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


@dataclass(frozen=True)
class FinishedRequest:
    """One request's end, for per-request metrics (aborted requests included)."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str  # "stop", "length" or "abort"
    metrics: RequestMetrics


class EngineObserver(Protocol):
    def on_step(self, step: StepStats | None, outputs: Sequence[RequestOutput],
                finished: Sequence[FinishedRequest], snapshot: EngineSnapshot) -> None:
        """``step`` is None when only commands (adds, aborts) changed the state."""


@dataclass(frozen=True)
class PromptSpec:
    """One request of a group: token ids (already validated by the caller) and its params."""

    token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


class RequestGroup:
    """The outputs of a group of requests, in the order the engine produced them.

    Iterate with ``async for index, output in group``; ``index`` is the request's position in
    the group. Iteration ends when every request has finished. ``close()`` aborts whatever is
    still running (call it in a ``finally``); it is safe to call more than once.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._open = set(request_ids)

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self._open.discard(item.request_id)
        return self._index[item.request_id], item

    @property
    def finished(self) -> bool:
        return not self._open

    def close(self) -> None:
        if self._open:
            self._engine.abort(sorted(self._open))
            self._open.clear()
        self._engine._groups_closed(self.request_ids)


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None,
                 observers: Sequence[EngineObserver] = ()) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 or None, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.observers = list(observers)
        self._commands: queue.Queue[tuple] = queue.Queue()
        self._groups: dict[str, RequestGroup] = {}  # request id -> its group (loop side)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._pending = 0  # requests submitted but not yet taken by the engine thread
        self._snapshot = self._take_snapshot()
        self._ids = 0

    # -- life cycle ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: running)."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is already running")
        self._loop = loop or asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="phasewise-engine", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """Refuse new requests (draining); running ones go on."""
        self._accepting = False

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the thread and wait for it."""
        self._accepting = False
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout)
            if self._thread.is_alive():  # still in a long step; it stops after it
                log.warning("the engine thread is still finishing a step after %.0fs", timeout)
                return
        self._refuse_queued_adds()

    def _refuse_queued_adds(self) -> None:
        """Answer adds that reached the queue after the thread stopped reading it."""
        loop = self._loop
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add" and loop is not None:
                loop.call_soon_threadsafe(self._resolve, cmd[3], EngineStopped(
                    "the server shut down"))

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self.is_alive

    @property
    def snapshot(self) -> EngineSnapshot:
        """The latest state the engine thread published."""
        return self._snapshot

    @property
    def num_open_groups(self) -> int:
        return len(self._groups)

    # -- requests (event-loop side) --------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    async def add(self, specs: Sequence[PromptSpec], request_id: str,
                  arrival_time: float | None = None) -> RequestGroup:
        """Queue a group of requests (ids ``request_id`` or ``request_id-i``) and return its
        output stream. Raises ``EngineOverloaded``, ``EngineStopped`` or ``ValueError``."""
        if not self.accepting:
            raise EngineStopped("the server is shutting down and takes no new requests")
        n = len(specs)
        if self.max_waiting is not None and n > self.max_waiting:
            raise ValueError(f"this request asks for {n} sequences (prompts x n), more than the "
                             f"{self.max_waiting} that may wait at once; split it")
        if self.max_waiting is not None:
            queued = self._pending + self._snapshot.num_waiting
            if queued + n > self.max_waiting:
                raise EngineOverloaded(
                    f"{queued} requests are waiting (limit {self.max_waiting}); retry later")
        ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        group = RequestGroup(self, ids)
        for rid in ids:
            if rid in self._groups:
                raise ValueError(f"request id {rid!r} is already in use")
        for rid in ids:
            self._groups[rid] = group
        assert self._loop is not None
        verdict: asyncio.Future[None] = self._loop.create_future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._pending += n
        try:
            self._commands.put(("add", list(zip(ids, specs)), arrival, verdict))
            await verdict
        except BaseException:
            # Refused by the engine, or the caller went away while waiting: nothing of the
            # group may stay behind.
            group._open.clear()
            self._groups_closed(ids)
            self.abort(ids)
            raise
        finally:
            self._pending -= n
        return group

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (any thread); blocks are freed before the engine's next step."""
        if request_ids:
            self._commands.put(("abort", list(request_ids)))

    def _groups_closed(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._groups.pop(rid, None)

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """On the event loop: hand outputs to their groups (closed groups are skipped)."""
        for rid, item in items:
            group = self._groups.get(rid)
            if group is not None:
                group._put(item)

    def _resolve(self, fut: asyncio.Future, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    # -- the engine thread -----------------------------------------------------------------
    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            kv_usage=e.kv.usage, num_free_blocks=e.kv.num_free_blocks,
            num_blocks=e.kv.num_blocks, num_preemptions=e.scheduler.num_preemptions,
            prefix_queries=e.kv.stats.prefix_queries, prefix_hits=e.kv.stats.prefix_hits)

    def _notify(self, step: StepStats | None, outputs: Sequence[RequestOutput],
                finished: Sequence[FinishedRequest],
                snap: EngineSnapshot | None = None) -> None:
        """Publish the state (``snap``, if just taken, else a new one) and tell observers."""
        if snap is None:
            snap = self._take_snapshot()
        self._snapshot = snap
        for obs in self.observers:
            try:
                obs.on_step(step, outputs, finished, snap)
            except Exception:  # an observer must never stop the engine
                log.exception("engine observer %r failed", obs)

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # the thread is dying: nobody may be left waiting
            log.exception("the engine thread failed")
            err = EngineError(f"the engine thread failed: {type(e).__name__}: {e}")
            try:
                self._abort_all(err)
            except BaseException:
                log.exception("aborting the requests in flight failed too")
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._fail_open_groups, err)
            self._refuse_queued_adds()

    def _loop_forever(self) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        while True:
            idle = not engine.has_unfinished_requests()
            commands = []
            try:
                commands.append(self._commands.get(timeout=0.5) if idle
                                else self._commands.get_nowait())
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            finished: list[FinishedRequest] = []
            stop = False
            for cmd in commands:
                if cmd[0] == "add":
                    self._handle_add(cmd[1], cmd[2], cmd[3])
                elif cmd[0] == "abort":
                    for rid in cmd[1]:
                        req = engine.abort_request(rid)
                        if req is not None:
                            finished.append(_finished(req, "abort"))
                elif cmd[0] == "stop":
                    stop = True
            if stop:
                finished += self._abort_all(EngineStopped("the server shut down"))
                self._refuse_queued_adds()
                self._notify(None, [], finished)
                return
            if commands or idle:  # idle: lets observers flush periodic output
                self._notify(None, [], finished)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug: fail the requests in flight, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                aborted = self._abort_all(EngineError(
                    f"the engine failed: {type(e).__name__}: {e}"))
                self._notify(None, [], aborted)
                continue
            step = engine.step_stats[-1] if engine.step_stats else None
            done = [FinishedRequest(o.request_id, len(o.prompt_token_ids), len(o.token_ids),
                                    o.finish_reason or "abort", o.metrics)
                    for o in outputs if o.finished]
            # Publish the state before the outputs: a caller that reacts to an output must
            # not see a queue length from before this step.
            self._snapshot = snap = self._take_snapshot()
            if outputs:
                loop.call_soon_threadsafe(self._deliver, [(o.request_id, o) for o in outputs])
            self._notify(step, outputs, done, snap)

    def _handle_add(self, items: list[tuple[str, PromptSpec]], arrival: float,
                    verdict: asyncio.Future) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        added: list[str] = []
        try:
            for rid, spec in items:
                prompt: str | list[int] = spec.token_ids
                engine.add_request(prompt, spec.params, request_id=rid, arrival_time=arrival)
                if spec.prompt is not None:
                    engine.requests[rid].prompt = spec.prompt
                added.append(rid)
        except Exception as e:
            for rid in added:
                engine.abort_request(rid)
            loop.call_soon_threadsafe(self._resolve, verdict, e)
            return
        # Publish the new queue length before the caller learns it was admitted, so an
        # admission check that follows sees this group as waiting.
        self._snapshot = self._take_snapshot()
        loop.call_soon_threadsafe(self._resolve, verdict, None)

    def _abort_all(self, error: BaseException) -> list[FinishedRequest]:
        """Abort every request in the engine, and fail every open group on the loop side:
        a failed step can lose outputs of requests the engine already forgot."""
        engine, loop = self.engine, self._loop
        assert loop is not None
        aborted = []
        for rid in list(engine.requests):
            req = engine.abort_request(rid)
            if req is not None:
                aborted.append(_finished(req, "abort"))
        loop.call_soon_threadsafe(self._fail_open_groups, error)
        return aborted

    def _fail_open_groups(self, error: BaseException) -> None:
        """On the event loop: every group still open gets ``error``."""
        for group in {id(g): g for g in self._groups.values()}.values():
            if not group.finished:
                group._put(error)


def _finished(req: Request, reason: str) -> FinishedRequest:
    return FinishedRequest(req.request_id, req.num_prompt_tokens, req.num_output_tokens,
                           reason, req.metrics)
