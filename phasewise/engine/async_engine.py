"""The engine's async front: ``LLMEngine`` runs in its own thread; asyncio code talks to it.

``AsyncEngine`` is the in-process ``ServingBackend`` (see ``phasewise.engine.backend``).

The engine thread owns the ``LLMEngine`` outright: it alone adds, aborts and steps requests,
so the engine needs no locks. Other threads reach it only through a queue of typed commands
(``phasewise.engine.commands``):

* ``AddRequests``: a group of requests (a batch of prompts, or ``n`` samples of one) joins the
  engine all together or not at all; the caller awaits the engine thread's ``Verdict``, so a
  request the engine can never serve raises ``ValueError`` in the caller. The engine thread
  also applies the waiting limit there, against its own queue at that moment, so admission
  counts every request exactly once.
* ``AbortRequests``: stops requests and frees their KV blocks before the next step runs.
* ``AbortAll``: ends every request with ``EngineStopped`` (the end of a shutdown's grace).
* ``Stop``: aborts everything and ends the thread.
* ``LoadRemoteKV``, ``FinishRemotePrefill``, ``FailRemotePrefill`` (the decode role of P/D):
  a prefill worker's K/V blocks, its first token, or the end of its attempt.

Liveness: each round of the thread handles the commands queued, then runs at most one
step. A round that has lasted ``step_timeout_s`` means a step that does not end
(a kernel that hangs, a machine swapping): ``is_alive`` turns false, so ``/health`` answers
503 (an orchestrator's liveness probe restarts the process), a router moves the streams
elsewhere, and new requests get ``EngineUnavailable``, until the round ends.

Outputs travel back with ``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per group, so
the event loop never waits on a forward pass. Observers (metrics, the periodic log line) are
called on the engine thread after every step and after every batch of commands, with a
snapshot of the engine's state; they must be quick and thread-safe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from phasewise.config import DEFAULT_STEP_TIMEOUT_S
from phasewise.engine.backend import (BackendInfo, EngineError, EngineObserver,
                                      EngineOverloaded, EngineSnapshot, EngineStopped,
                                      EngineUnavailable, FinishedRequest, PromptSpec,
                                      RequestGroup, SLORefused, request_error)
from phasewise.engine.commands import (AbortAll, AbortRequests, AddRequests, Command,
                                       FailRemotePrefill, FinishRemotePrefill, LoadRemoteKV,
                                       ParkRequests, Stop, Verdict)
from phasewise.engine.request import RemoteTiming, Request, RequestStatus
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.structured import compile_thread
from phasewise.engine.validation import check_sequences

if TYPE_CHECKING:
    from phasewise.config import EngineConfig
    from phasewise.engine.engine import LLMEngine
    from phasewise.engine.step_cost import StepCoster
    from phasewise.model.tokenizer import Tokenizer

# Re-exported: these names lived here before the backend protocol had its own module.
__all__ = ["AsyncEngine", "EngineError", "EngineObserver", "EngineOverloaded",
           "EngineSnapshot", "EngineStopped", "FinishedRequest", "PromptSpec", "RequestGroup"]

log = logging.getLogger("phasewise.engine")


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, *, max_waiting: int | None = None,
                 observers: Sequence[EngineObserver] = (),
                 kv_sink: Callable[[str, int, int, Any], None] | None = None,
                 step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S) -> None:
        """``kv_sink`` (the prefill role): called on the engine thread with (request id,
        first token, end token, K/V blocks tensor) right after a forward pass filled blocks
        of a request added with ``PromptSpec.export_kv_from``. ``step_timeout_s``: how long
        one round of the engine thread may last before the engine counts as stuck (None:
        never; see the module)."""
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 or None, got {max_waiting}")
        if step_timeout_s is not None and not 0 < step_timeout_s <= 86400:
            raise ValueError(f"step_timeout_s must be in (0, 86400] seconds or None, got "
                             f"{step_timeout_s}")
        self.step_timeout_s = step_timeout_s
        # time.monotonic() when the engine thread's current round began; None while it waits
        # for a command (idle)
        self._busy_since: float | None = None
        self.engine = engine
        engine.kv_sink = kv_sink
        self.max_waiting = max_waiting
        self.observers = list(observers)
        self.tokenizer: Tokenizer = engine.tokenizer
        c = engine.config
        self.info = BackendInfo(
            model_path=str(c.model), architecture=engine.model_config.architecture,
            num_params=engine.model_config.num_params, max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size, max_waiting=max_waiting,
            description=(f"max_model_len {engine.max_model_len}, {engine.kv.num_blocks} KV "
                         f"blocks of {c.block_size} tokens, policy {c.policy}, "
                         f"{engine.max_num_batched_tokens} tokens per step, dtype "
                         f"{str(engine.dtype).removeprefix('torch.')}, device {engine.device}"),
            roofline=engine.cost_model.note(engine.max_num_batched_tokens))
        self._commands: queue.Queue[Command] = queue.Queue()
        self._groups: dict[str, RequestGroup] = {}  # request id -> its group (loop side)
        # ticket -> the caller's future (loop side): each request's remote_hits when admitted
        self._verdicts: dict[int, asyncio.Future[tuple[int | None, ...]]] = {}
        self._admitting: dict[int, RequestGroup] = {}  # by ticket: groups awaiting admission
        self._tickets = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._snapshot = self._take_snapshot()
        # Remote prefills (decode role), by how they ended: "done" (decoded on from the
        # remote K/V) or a fallback to computing here: "failed", "incomplete", "refused".
        self.remote_outcomes: dict[str, int] = {}
        self._abort_listeners: list[Callable[[Sequence[str]], None]] = []

    @classmethod
    def from_config(cls, config: EngineConfig, *,
                    cost_model: Callable[[LLMEngine], StepCoster] | None = None,
                    **kwargs: Any) -> AsyncEngine:
        """Load the checkpoint into an ``LLMEngine`` (pricing its steps with ``cost_model``,
        as ``LLMEngine`` takes it) and wrap it."""
        from phasewise.engine.engine import LLMEngine

        return cls(LLMEngine(config, cost_model=cost_model), **kwargs)

    @property
    def grammars(self) -> Any:
        """The engine's structured-output compiler: a server checks each request's grammar
        with it (on a worker thread), so the engine's copy starts from warm caches."""
        return self.engine.grammars

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        return self.engine.default_sampling_params(**overrides)

    def add_observer(self, observer: EngineObserver) -> None:
        """Call before ``start``: observers are read by the engine thread without a lock."""
        self.observers.append(observer)

    # -- life cycle ------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: running)."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is already running")
        self._loop = loop or asyncio.get_running_loop()
        self._accepting = True
        # It compiles the grammars no server thread compiled first: a stack of known size.
        self._thread = compile_thread(self._run, "phasewise-engine")

    def stop_accepting(self) -> None:
        """Refuse new requests (draining); running ones go on."""
        self._accepting = False

    def abort_all(self, reason: str) -> None:
        """End every request now (any thread); each open group gets ``EngineStopped``."""
        self._commands.put(AbortAll(reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the thread and wait for it."""
        self._accepting = False
        if self._thread is not None:
            self._commands.put(Stop())
            self._thread.join(timeout)
            if self._thread.is_alive():  # still in a long step; it stops after it
                log.warning("the engine thread is still finishing a step after %.0fs", timeout)
                return
        self._refuse_queued_adds()

    def _refuse_queued_adds(self) -> None:
        """Answer adds that reached the queue after the thread stopped reading it."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequests):
                self._reply(Verdict(cmd.ticket, ("stopped", "the server shut down", None)))

    @property
    def _thread_runs(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def round_s(self) -> float:
        """Seconds the engine thread has been in its current round (commands, then at most
        one step; 0 while it waits for work): under a second while it runs normally."""
        began = self._busy_since  # (read once: the engine thread sets it meanwhile)
        return 0.0 if began is None else time.monotonic() - began

    @property
    def stuck(self) -> bool:
        """The thread runs but its round has lasted more than ``step_timeout_s``."""
        return (self.step_timeout_s is not None and self._thread_runs
                and self.round_s > self.step_timeout_s)

    @property
    def is_alive(self) -> bool:
        """The engine thread runs, and no round of it has lasted ``step_timeout_s``."""
        return self._thread_runs and not self.stuck

    @property
    def down_reason(self) -> str:
        if self.stuck:
            return (f"the engine has been in one step for {self.round_s:.0f} s (the limit, "
                    f"--step-timeout, is {self.step_timeout_s:g} s); it takes no new "
                    "requests until that step ends")
        return "the engine thread is not running"

    def engine_health(self) -> str | None:
        """Why this process's own engine cannot serve (dead, or stuck in one step), or None:
        what a liveness probe asks (``/health/engine``), whatever other processes do."""
        return None if self.is_alive else self.down_reason

    @property
    def accepting(self) -> bool:
        return self._accepting and self._thread_runs

    @property
    def snapshot(self) -> EngineSnapshot:
        """The latest state the engine thread published."""
        return self._snapshot

    @property
    def num_open_groups(self) -> int:
        return len({id(g) for g in self._groups.values()})

    @property
    def block_size(self) -> int:
        return self.engine.kv.block_size

    @property
    def kv_window(self) -> int | None:
        """The sliding window every layer shares (positions), or None: its prefix hits need
        only the window's blocks (``phasewise.cache.manager.windowed_hit``)."""
        return self.engine.kv.window

    def kv_events(self, since: int | None, epoch: str | None) -> dict[str, Any]:
        """What the prefix cache stored and evicted since ``since`` (``KVEvents.since``):
        read from any thread, as a router's poll does."""
        return self.engine.kv.pool.events.since(since, epoch)

    # -- requests (event-loop side) --------------------------------------------------------
    async def add(self, specs: Sequence[PromptSpec], request_id: str,
                  arrival_time: float | None = None) -> RequestGroup:
        """Queue a group of requests (ids ``request_id`` or ``request_id-i``) and return its
        output stream. Raises ``EngineOverloaded``, ``EngineStopped`` or ``ValueError``."""
        if not self.accepting:
            raise EngineStopped("the server is shutting down and takes no new requests")
        if self.stuck:
            raise EngineUnavailable(self.down_reason)
        n = len(specs)
        check_sequences(n, 1, self.max_waiting)
        ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        for rid in ids:
            if rid in self._groups:
                raise ValueError(f"request id {rid!r} is already in use")
        group = RequestGroup(ids, self.abort, self._groups_closed, park=self.park)
        # Outputs reach it only once the engine has admitted it (_resolve): those still on
        # their way for a request of the same id that was aborted just before (a router
        # moving a stream back here) would otherwise land in this group.
        group.ready = False
        for rid in ids:
            self._groups[rid] = group
        assert self._loop is not None
        ticket = next(self._tickets)
        verdict: asyncio.Future[tuple[int | None, ...]] = self._loop.create_future()
        self._verdicts[ticket] = verdict
        self._admitting[ticket] = group
        arrival = time.monotonic() if arrival_time is None else arrival_time
        try:
            self._commands.put(AddRequests(ticket, tuple(zip(ids, specs)), arrival,
                                           self.max_waiting))
            if not self._thread_runs:  # it ended after the check above: nobody reads
                self._refuse_queued_adds()
            group.remote_hits = list(await verdict)
        except BaseException:
            # Refused by the engine, or the caller went away while waiting: nothing of the
            # group may stay behind.
            group._forget()
            self._groups_closed(ids)
            self.abort(ids)
            raise
        finally:
            self._verdicts.pop(ticket, None)
            self._admitting.pop(ticket, None)
        return group

    # -- remote prefill (the decode role; any thread) -------------------------------------
    def load_remote_kv(self, request_id: str, first_token: int, dtype: str,
                       shape: tuple[int, ...], payload: bytes) -> None:
        self._commands.put(LoadRemoteKV(request_id, first_token, dtype, tuple(shape),
                                        payload))

    def finish_remote_prefill(self, request_id: str, token: int,
                              logprobs: dict[int, float] | None = None,
                              timing: RemoteTiming | None = None) -> None:
        self._commands.put(FinishRemotePrefill(
            request_id, token, None if logprobs is None else tuple(logprobs.items()),
            timing))

    def fail_remote_prefill(self, request_id: str) -> None:
        self._commands.put(FailRemotePrefill(request_id))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (any thread); blocks are freed before the engine's next step.
        Listeners (``add_abort_listener``: a decode side telling its prefill worker) hear
        of it too."""
        if request_ids:
            self._commands.put(AbortRequests(tuple(request_ids)))
            for listener in self._abort_listeners:
                listener(request_ids)

    def park(self, request_ids: Sequence[str], parked: bool) -> None:
        """Hold or release requests whose reader stopped reading (any thread;
        ``LLMEngine.park``): a group calls it as its reader falls behind and catches up."""
        if request_ids:
            self._commands.put(ParkRequests(tuple(request_ids), parked))

    def add_abort_listener(self, listener: Callable[[Sequence[str]], None]) -> None:
        self._abort_listeners.append(listener)

    def _groups_closed(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._groups.pop(rid, None)

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        """On the event loop: hand outputs to their groups (closed groups are skipped)."""
        for rid, item in items:
            group = self._groups.get(rid)
            if group is not None and group.ready:
                group._put(item)

    def _reply(self, verdict: Verdict) -> None:
        """From the engine thread: answer an add on the event loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._resolve, verdict)

    def _resolve(self, verdict: Verdict) -> None:
        fut = self._verdicts.get(verdict.ticket)
        if fut is None or fut.done():
            return
        if verdict.error is None:
            group = self._admitting.get(verdict.ticket)
            if group is not None:  # (in the loop's order: after outputs sent before it)
                group.ready = True
            fut.set_result(verdict.remote_hits)
            return
        kind, message, param = verdict.error
        if kind == "overloaded":
            fut.set_exception(EngineOverloaded(message))
        elif kind == "slo":
            reason, _, retry = (param or "slo:1").partition(":")
            fut.set_exception(SLORefused(message, reason, int(retry)))
        elif kind == "stopped":
            fut.set_exception(EngineStopped(message))
        else:
            from phasewise.engine.validation import ValidationError

            fut.set_exception(ValidationError(message, param))

    # -- the engine thread -----------------------------------------------------------------
    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            kv_usage=e.kv.usage, num_free_blocks=e.kv.num_free_blocks,
            num_blocks=e.kv.num_blocks, num_preemptions=e.scheduler.num_preemptions,
            prefix_queries=e.kv.stats.prefix_queries, prefix_hits=e.kv.stats.prefix_hits,
            num_waiting_remote=len(e.scheduler.remote),
            num_parked=sum(r.parked for r in (*e.scheduler.running, *e.scheduler.waiting)),
            num_blocks_waiting_remote=sum(len(e.kv.block_table(r))
                                          for r in e.scheduler.remote),
            spec_verifies=e.spec_stats.verifies, spec_proposed=e.spec_stats.proposed,
            spec_accepted=e.spec_stats.accepted, spec_emitted=e.spec_stats.emitted)

    def _notify(self, step: Any, outputs: Sequence[Any], finished: Sequence[FinishedRequest],
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
            assert self._loop is not None  # adds taken off the queue but never answered
            self._loop.call_soon_threadsafe(self._fail_verdicts, err)

    def _fail_verdicts(self, error: BaseException) -> None:
        """On the event loop: every add still awaiting its verdict gets ``error``."""
        for fut in list(self._verdicts.values()):
            if not fut.done():
                fut.set_exception(error)

    def _loop_forever(self) -> None:
        engine, loop = self.engine, self._loop
        assert loop is not None
        stalled = False  # the last step found nothing it may run (seats held by remote K/V)
        while True:
            # Only a command (K/V arriving, an abort) can unstall it: wait for one.
            idle = stalled or not engine.has_unfinished_requests()
            commands: list[Command] = []
            self._busy_since = None  # (waiting for a command is not a round that lasts)
            try:
                commands.append(self._commands.get(timeout=0.5) if idle
                                else self._commands.get_nowait())
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            self._busy_since = time.monotonic()
            finished: list[FinishedRequest] = []
            firsts = []  # first tokens a prefill worker sent back
            for cmd in commands:
                if isinstance(cmd, AddRequests):
                    self._handle_add(cmd)
                elif isinstance(cmd, AbortRequests):
                    finished += self._abort(cmd.request_ids)
                elif isinstance(cmd, ParkRequests):
                    engine.park(cmd.request_ids, cmd.parked)
                elif isinstance(cmd, (LoadRemoteKV, FinishRemotePrefill, FailRemotePrefill)):
                    out = self._handle_remote(cmd)
                    if out is not None:
                        firsts.append(out)
                        if out.finished:
                            finished.append(FinishedRequest.of(out, default="stop"))
                elif isinstance(cmd, AbortAll):
                    finished += self._abort_all(EngineStopped(cmd.reason))
                elif isinstance(cmd, Stop):
                    finished += self._abort_all(EngineStopped(cmd.reason))
                    self._refuse_queued_adds()
                    self._notify(None, [], finished)
                    return
            if commands or idle:  # idle: lets observers flush periodic output
                self._notify(None, firsts, finished)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
                stalled = engine.stalled
            except Exception as e:  # a bug: fail the requests it touched, keep serving
                held = getattr(e, "request_ids", None)  # a StepFailed names the step's requests
                cause = getattr(e, "cause", e)
                log.exception("engine step failed; aborting %s", "the requests in flight"
                              if held is None else f"the {len(held)} request(s) of that step")
                err = EngineError(f"the engine failed: {type(cause).__name__}: {cause}")
                aborted = (self._abort_all(err) if held is None
                           else self._abort_some(held, err))
                self._notify(None, [], aborted)
                continue
            step = engine.step_stats[-1] if engine.step_stats else None
            done = [FinishedRequest.of(o) for o in outputs if o.finished]
            # Publish the state before the outputs: a caller that reacts to an output must
            # not see a queue length from before this step.
            self._snapshot = snap = self._take_snapshot()
            if outputs:  # a request that failed alone gets its error, not an output
                loop.call_soon_threadsafe(self._deliver, [
                    (o.request_id, o if o.error is None else request_error(o.error, o.error_code))
                    for o in outputs])
            self._notify(step, outputs, done, snap)

    def _handle_add(self, cmd: AddRequests) -> None:
        engine = self.engine
        n = len(cmd.requests)
        waiting = len(engine.scheduler.waiting)
        if cmd.max_waiting is not None and waiting + n > cmd.max_waiting:
            self._reply(Verdict(cmd.ticket, (
                "overloaded", f"{waiting} requests are waiting (limit {cmd.max_waiting}) and "
                f"this one adds {n}; retry later", None)))
            return
        added: list[str] = []
        hits: list[int | None] = []
        try:
            for rid, spec in cmd.requests:
                hit = None
                if spec.remote:
                    hit = engine.add_remote_request(spec.token_ids, spec.params,
                                                    request_id=rid,
                                                    arrival_time=cmd.arrival_time)
                if hit is None:  # not remote, or no room to reserve: prefill it here
                    engine.add_request(spec.token_ids, spec.params, request_id=rid,
                                       arrival_time=cmd.arrival_time,
                                       export_kv_from=spec.export_kv_from,
                                       resume=spec.resume)
                hits.append(hit)
                req = engine.requests[rid]
                if spec.prompt is not None:
                    req.prompt = spec.prompt
                if n > 1:  # one client request's sequences share their seats fairly
                    # (the add's ticket: no request id, which a client may choose, equals it)
                    req.group = cmd.ticket
                added.append(rid)
        except Exception as e:
            for rid in added:
                engine.abort_request(rid)
            self._reply(Verdict(cmd.ticket, ("invalid", str(e), getattr(e, "param", None))))
            return
        slo = cmd.requests[0][1].slo if cmd.requests else None
        if slo is not None and slo.any:
            refusal = engine.slo_refusal([engine.requests[rid] for rid in added], slo)
            if refusal is not None:
                for rid in added:
                    engine.abort_request(rid)
                self._reply(Verdict(cmd.ticket, ("slo", refusal.message,
                                                 f"{refusal.reason}:{refusal.retry_after_s}")))
                return
        # Publish the new queue length before the caller learns it was admitted.
        self._snapshot = self._take_snapshot()
        self._reply(Verdict(cmd.ticket, remote_hits=tuple(hits)))

    def _handle_remote(self, cmd: LoadRemoteKV | FinishRemotePrefill | FailRemotePrefill
                       ) -> Any:
        """A remote prefill's K/V, first token or failure. K/V for a request that is gone
        (aborted, already computed here) is dropped: the receiver never writes blocks a
        request no longer holds. Returns the output of a first token that came back (for
        the observers: its TTFT), else None."""
        engine, loop = self.engine, self._loop
        assert loop is not None
        rid = cmd.request_id
        req = engine.requests.get(rid)
        if req is None or req.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            log.debug("remote prefill message for %r dropped: it waits for none", rid)
            return None
        try:
            if isinstance(cmd, LoadRemoteKV):
                from phasewise.engine.kv_bytes import kv_from_bytes

                engine.load_remote_kv(rid, cmd.first_token,
                                      kv_from_bytes(cmd.payload, cmd.dtype, cmd.shape))
                return None
            if isinstance(cmd, FinishRemotePrefill) and engine.remote_kv_complete(rid):
                out = engine.finish_remote_prefill(
                    rid, cmd.token, None if cmd.logprobs is None else dict(cmd.logprobs))
                req.metrics.remote = cmd.timing  # read when the request finishes
                loop.call_soon_threadsafe(self._deliver, [(rid, out)])
                self._count_remote("done")
                return out
            outcome = "incomplete" if isinstance(cmd, FinishRemotePrefill) else "failed"
        except ValueError:
            log.warning("remote K/V for %r refused; computing its prompt here", rid,
                        exc_info=True)
            outcome = "refused"
        self._count_remote(outcome)
        engine.fail_remote_prefill(rid)  # failed, incomplete or refused: compute it here
        return None

    def _count_remote(self, outcome: str) -> None:
        self.remote_outcomes[outcome] = self.remote_outcomes.get(outcome, 0) + 1

    def _abort_all(self, error: BaseException) -> list[FinishedRequest]:
        """Abort every request in the engine, and fail every open group on the loop side:
        a failed step can lose outputs of requests the engine already forgot."""
        assert self._loop is not None
        aborted = self._abort(list(self.engine.requests))
        self._loop.call_soon_threadsafe(self._fail_open_groups, error)
        return aborted

    def _abort(self, request_ids: Sequence[str]) -> list[FinishedRequest]:
        """On the engine thread: end these requests; the ends of those still running."""
        ended = (self.engine.abort_request(rid) for rid in request_ids)
        return [_finished(req, "abort") for req in ended if req is not None]

    def _abort_some(self, request_ids: Sequence[str],
                    error: BaseException) -> list[FinishedRequest]:
        """Abort these requests and fail their groups (the rest run on)."""
        aborted = self._abort(request_ids)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, [(rid, error) for rid in request_ids])
        return aborted

    def _fail_open_groups(self, error: BaseException) -> None:
        """On the event loop: every group still open gets ``error``."""
        for group in {id(g): g for g in self._groups.values()}.values():
            if not group.finished:
                group._put(error)


def _finished(req: Request, reason: str) -> FinishedRequest:
    return FinishedRequest(req.request_id, req.num_prompt_tokens, req.num_output_tokens,
                           reason, req.metrics)
