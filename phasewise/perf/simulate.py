"""``phasewise simulate``: a workload served in virtual time, by the real scheduler.

Discrete events over one virtual clock. Each engine (a co-located replica, a prefill worker
or a decode worker) is the real ``Scheduler`` over the real ``KVCacheManager``, stamping
requests with the virtual clock; a ``CostModel`` says how long each step takes from its exact
mix. No weights are loaded, nothing is computed: a sampled token is a placeholder id.

What each engine does is what the real one does:

* a step starts as soon as its engine is free and has work; requests that arrived meanwhile
  were added before it is scheduled (the server adds them between steps);
* the step's mix (prompt chunks with their contexts, decode contexts) is read before
  ``update()``, its duration priced, and ``update()`` stamps its tokens at the step's end;
* a request samples in a step that computes up to its last token.

Deployments (``Deployment``):

* ``colocated``: ``replicas`` engines behind a router that sends each request to the engine
  with the fewest requests queued or running (ties in turn), as ``phasewise router
  --routing least-load`` does; simulated prompts share no prefix, so its default ``prefix``
  policy, which then weighs load alone, would choose the same;
* ``pd``: ``prefill`` and ``decode`` workers. The router picks a decode worker the same way;
  the decode worker prefills a prompt remotely when its uncached part is at least the
  threshold, a prefill worker's queue is under the queue limit and its pool has room
  (``Scheduler.reserve_remote``), else locally. The prefill worker with the shortest queue
  runs it (its own prefix cache, its own chunked steps) and pushes each chunk's K/V as the
  chunk's step ends, over a link (one queue per prefill worker: bandwidth and latency); the
  request's first token lands on the decode worker when its last K/V byte has, plus a fixed
  hand-off cost (``Deployment.handoff_s``), and the decode worker takes it in at its next
  step boundary (``remote_prefill_done``: as the real one reads its commands between steps),
  and it decodes there.

A cost model probed through a live server (``phasewise.perf.served``) also carries each
request's own cost before its first step (``request_s``, or ``request_busy_s`` where the
engine is mid-step when the client sends it): its arrival at the engine is that much later
than the client's send, from which its TTFT counts.

The result is the bench's summary (``phasewise.perf.summary.summarize``), so simulated and
measured runs read alike and ``phasewise bench report`` lays them side by side; it adds
``simulated`` (per-worker busy time, steps by kind, transfers).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from phasewise.cache.manager import KVCacheManager
from phasewise.engine.request import Request, RequestStatus
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.scheduler import Scheduler, SchedulerConfig
from phasewise.engine.slo import SLO, group_forecast, judge, mean_context, prompt_share
from phasewise.engine.step_cost import Chunk
from phasewise.perf.costmodel import CostModel
from phasewise.perf.hardware import Link
from phasewise.perf.summary import RequestResult, meets_slo, summarize
from phasewise.perf.workload import RequestSpec

MODES = ("colocated", "pd")
ROUTING = ("least-load", "round-robin", "prefix")
MAX_WORKERS = 1024  # engines of one role a simulation holds (each is a scheduler and a pool)
_TOKEN = 1  # the id every simulated sample gets


@dataclass(frozen=True)
class EngineSpec:
    """One engine's limits, as ``phasewise serve`` would be started."""

    num_kv_blocks: int
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 128
    max_model_len: int = 4096
    policy: str = "chunked"
    block_size: int = 16
    enable_prefix_caching: bool = True
    # the sliding window every layer attends within (None: none): blocks behind it go back
    kv_window: int | None = None
    # where num_kv_blocks comes from, in words (phasewise.perf.commands.engine_spec says)
    kv_source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")

    def scheduler_config(self) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if self.policy == "prefill-first":  # as the engine does: whole prompts must fit
            budget = max(budget, self.max_model_len)
        return SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=self.max_num_seqs,
                               max_model_len=self.max_model_len, policy=self.policy)


@dataclass(frozen=True)
class Deployment:
    mode: str = "colocated"
    replicas: int = 1  # colocated engines
    prefill: int = 1  # pd
    decode: int = 1  # pd
    threshold: int = 0  # pd: prompts with fewer uncached tokens prefill on the decode worker
    prefill_queue_limit: int = 8  # pd: prefill locally while every prefill queue is this long
    link: Link | None = None  # pd: how K/V travels (None: instantly)
    # pd: fixed cost of one remote prefill beyond its bytes (the request message, the hops
    # between the workers' threads, the final message): ~10-25 ms over loopback for
    # phasewise's own workers (bench_disagg.py), a few ms for RDMA transfer engines.
    handoff_s: float = 0.005
    prefill_engine: EngineSpec | None = None  # pd: the prefill workers' limits (default: same)
    # Admission by SLO (phasewise.engine.slo): every request carries these targets, and an
    # engine refuses one it predicts would miss them, as a server with --slo-ttft-ms and
    # --slo-tpot-ms does; the router tries each front engine in turn. None: no admission.
    admission: SLO | None = None
    # How the router picks a front engine: least-load (fewest requests, ties in turn),
    # round-robin (in turn), or prefix, which weighs the prompt blocks an engine holds
    # against its load: simulated prompts share no prefix, so it picks as least-load does.
    routing: str = "least-load"
    # colocated: replica 0 dies at this virtual time; the router moves each request it held
    # to the others with its outputs so far (one prefill of prompt and outputs there), as
    # phasewise router's migration does; its step in flight is lost. None: no failure.
    fail_at: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        for name in ("replicas", "prefill", "decode", "prefill_queue_limit"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if v > MAX_WORKERS:
                raise ValueError(f"{name} must be <= {MAX_WORKERS}, got {v}")
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}; got "
                             f"{self.routing!r}")
        if self.fail_at is not None and (self.mode != "colocated" or self.replicas < 2
                                         or not 0 <= self.fail_at < math.inf):
            raise ValueError("fail_at needs a co-located deployment of at least 2 replicas "
                             f"and a time >= 0 (s); got {self.fail_at!r} with {self.mode} "
                             f"x{self.replicas}")
        if not 0 <= self.handoff_s < 60:
            raise ValueError(f"handoff_s must be in [0, 60) seconds, got {self.handoff_s}")

    @property
    def accelerators(self) -> int:
        return self.replicas if self.mode == "colocated" else self.prefill + self.decode

    def describe(self) -> str:
        if self.mode == "colocated":
            fail = ("" if self.fail_at is None else
                    f", replica 0 fails at {self.fail_at:g} s")
            routing = "" if self.routing == "least-load" else f", {self.routing} routing"
            return f"co-located x{self.replicas}" + routing + fail + self._admits()
        return (f"P/D {self.prefill}P:{self.decode}D, threshold {self.threshold}"
                + f", K/V link {self.link.key if self.link else 'instant'}" + self._admits())

    def _admits(self) -> str:
        a = self.admission
        if a is None:
            return ""
        parts = [f"{k} {v * 1e3:g} ms" for k, v in (("TTFT", a.ttft_s), ("TPOT", a.tpot_s))
                 if v is not None]
        return f", SLO admission ({', '.join(parts)})"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Transfer:
    """A remote prefill in flight: the decode side's request and where its K/V goes."""

    decode_req: Request
    decoder: _Engine
    first_token: int | None = None
    last_byte: float = 0.0  # when the K/V sent so far has all landed
    nbytes: float = 0.0
    start_block: int = 0  # K/V from this block on is sent (the decode side's cached prefix)
    sent_upto: int = 0  # tokens whose K/V is on its way (a recompute sends nothing again)
    prefill_done: float | None = None  # its last chunk's step ended


@dataclass
class _Engine:
    name: str
    role: str  # "both", "prefill" or "decode"
    scheduler: Scheduler
    busy: bool = False
    busy_s: float = 0.0
    steps: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0,
                                                            "mixed": 0})
    link_free: float = 0.0  # prefill role: when its link finishes what it was given
    transfers: dict[str, _Transfer] = field(default_factory=dict)  # prefill role
    landing: int = 0  # prefill role: prefills done whose K/V has not landed yet
    # decode role: remote prefills whose K/V landed during a step; the engine takes them in
    # at the step's end, as the real one reads its commands between steps
    landed: list[_Transfer] = field(default_factory=list)
    active_until: float = float("-inf")  # when its last step ended
    dead: bool = False  # it failed (Deployment.fail_at): nothing it does lands any more
    # (start, prompt tokens) of its last steps: what SLO admission expects the next to carry
    prompt_tokens: deque = field(default_factory=lambda: deque(maxlen=256))

    @property
    def load(self) -> int:
        """Requests it holds; for a prefill worker also those whose K/V is still on the
        link (the decode side counts what it sent and has not heard back from)."""
        s = self.scheduler
        return len(s.waiting) + len(s.running) + len(s.remote) + self.landing


PROGRESS_EVERY_S = 10.0  # wall seconds between a long run's progress lines


class Simulation:
    def __init__(self, cost: CostModel, engine: EngineSpec, deployment: Deployment) -> None:
        self.cost = cost
        self.spec = engine
        self.dep = deployment
        self.clock = _Clock()
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._turn = itertools.count()

        def make(name: str, role: str, spec: EngineSpec) -> _Engine:
            kv = KVCacheManager(spec.num_kv_blocks, spec.block_size, spec.enable_prefix_caching,
                                spec.kv_window)
            return _Engine(name, role, Scheduler(spec.scheduler_config(), kv, self.clock))

        d = deployment
        if d.mode == "colocated":
            self.front = [make(f"replica-{i}", "both", engine) for i in range(d.replicas)]
            self.prefillers: list[_Engine] = []
        else:
            self.front = [make(f"decode-{i}", "decode", engine) for i in range(d.decode)]
            pspec = d.prefill_engine or engine
            self.prefillers = [make(f"prefill-{i}", "prefill", pspec) for i in range(d.prefill)]
        self.engines = self.front + self.prefillers
        self.kv_bytes_per_token = cost.kv_bytes_per_token
        # A request's own cost before its first step (HTTP, tokenising), where the cost model
        # was probed through a live server (phasewise.perf.served); its TTFT counts it.
        self.request_s = float(getattr(cost, "request_s", 0.0) or 0.0)
        # ... and where the engine it goes to is mid-step when it is sent (the server's event
        # loop then waits its turn beside the engine's own Python work).
        self.request_busy_s = float(getattr(cost, "request_busy_s", self.request_s) or 0.0)
        # ... and its wake-up cost where that engine has sat idle (by how long)
        self.wake: Callable[[float], float] | None = getattr(cost, "wake", None)
        self.remote_prefills = 0
        self.refused: dict[str, str] = {}  # request id -> why admission refused it
        self.migrated = 0  # requests moved off a failed replica (Deployment.fail_at)
        self.failed = False  # whether it failed before the run ended
        self.local_prefills: dict[str, int] = {}
        self.transfer_s: list[float] = []
        self._remote_of: dict[str, Request] = {}  # the prefill workers' side of a request
        self._landed_at: dict[str, _Transfer] = {}

    # -- events ---------------------------------------------------------------------------
    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self, specs: Sequence[RequestSpec], slo: dict[str, float] | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """``progress``: told every ``PROGRESS_EVERY_S`` of wall time how far the run is (a
        long one takes minutes). The wall clock decides only when it is told: the run
        itself is in virtual time, and the same inputs give the same result."""
        self.requests: list[tuple[RequestSpec, Request]] = []
        self._sent_all = len(specs)  # the requests the run sends
        for spec in specs:
            self._at(spec.arrival, lambda spec=spec: self._send(spec))
        if self.dep.fail_at is not None:
            self._at(self.dep.fail_at, self._fail)
        next_note = time.monotonic() + PROGRESS_EVERY_S if progress else math.inf
        events = 0
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            self.clock.now = t
            fn()
            events += 1
            if events % 256 == 0 and time.monotonic() >= next_note:
                done = sum(r.finished for _, r in self.requests)
                progress(f"simulating: {self.clock.now:.0f} s of traffic, {done} of "  # type: ignore[misc]
                         f"{len(specs)} requests finished")
                next_note = time.monotonic() + PROGRESS_EVERY_S
        return self._summary(slo)

    def _wake(self, e: _Engine) -> None:
        if not e.busy and e.scheduler.has_unfinished():
            e.busy = True
            self._at(self.clock.now, lambda: self._step(e))

    # -- arrivals and routing --------------------------------------------------------------
    def _pick(self, engines: Sequence[_Engine]) -> _Engine:
        turn = next(self._turn)
        k = len(engines)
        if self.dep.routing == "round-robin":
            return engines[turn % k]
        return min(enumerate(engines), key=lambda ie: (ie[1].load, (ie[0] - turn) % k))[1]

    def _fail(self) -> None:
        """Replica 0 dies: each request it held moves to the others, its outputs so far
        recomputed there with its prompt (``LLMEngine.add_request``'s resume); its timings
        go on, so the move shows as the gap before its next token."""
        if len(self.requests) == self._sent_all and all(r.finished for _, r in self.requests):
            return  # the run ended before the failure was due: nothing fails
        dead = self.front[0]
        dead.dead = True
        self.failed = True
        self.front = self.front[1:]
        where = {req.request_id: i for i, (_, req) in enumerate(self.requests)}
        s = dead.scheduler
        for req in [*s.running, *s.waiting]:
            moved = Request(req.request_id, req.prompt_token_ids, req.params,
                            arrival_time=req.metrics.arrival_time)
            for t in req.output_token_ids:
                moved.append_output(t)
            moved.metrics = req.metrics
            target = self._pick(self.front)
            target.scheduler.add_request(moved)
            i = where[req.request_id]
            self.requests[i] = (self.requests[i][0], moved)
            self.migrated += 1
            self._wake(target)

    def _new_request(self, spec: RequestSpec, rid: str, max_tokens: int) -> Request:
        base = spec.index * 1_000_003 + 7  # distinct ids per request: no accidental sharing
        ids = list(range(base, base + spec.prompt_len))
        return Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_time=spec.arrival)

    def _send(self, spec: RequestSpec) -> None:
        """The client sends it: it reaches an engine after the request's own cost."""
        if not (self.request_s or self.request_busy_s or self.wake):
            self._arrive(spec)  # a cost model that prices no request: nothing to look up
            return
        e = min(self.front, key=lambda e: e.load)
        delay = self.request_busy_s if e.busy else self.request_s
        if self.wake is not None and not e.busy and not e.scheduler.has_unfinished():
            delay += self.wake(self.clock.now - e.active_until)
        if delay > 0:
            self._at(self.clock.now + delay, lambda: self._arrive(spec))
        else:
            self._arrive(spec)

    def _arrive(self, spec: RequestSpec) -> None:
        engine = self._pick(self.front)
        req = self._new_request(spec, f"r{spec.index}", spec.output_len)
        self.requests.append((spec, req))
        if self.dep.admission is not None:
            engine = self._admit(engine, req)
            if engine is None:
                return
        if engine.role == "decode" and self._try_remote(engine, req):
            return
        try:
            engine.scheduler.add_request(req)
        except ValueError:  # it could never fit (too long): the server would refuse it
            req.status = RequestStatus.FINISHED_ABORTED
            return
        self._wake(engine)

    def _admit(self, first: _Engine, req: Request) -> _Engine | None:
        """The engine that takes ``req`` under SLO admission: ``first`` (the router's pick)
        unless it predicts a miss, then the others by load; None (refused) where all do.
        Each judges as the real one does (``group_forecast``, the request queued behind
        what it holds; a decode worker counts a prompt it would send to a prefill worker as
        no work of its own), pricing steps with the simulation's cost model."""
        slo = self.dep.admission
        assert slo is not None
        others = sorted((e for e in self.front if e is not first), key=lambda e: e.load)
        refusal = None
        for e in (first, *others):
            s = e.scheduler
            remote = (e.role == "decode"
                      and req.num_prompt_tokens >= max(1, self.dep.threshold))
            queue = s.remote if remote else None
            if queue is not None:
                queue[req.request_id] = req
            else:
                s.waiting.append(req)
            ctx = mean_context(s, [req])

            def cost(p: int, d: int) -> float:
                return self.cost.step_time([Chunk(p, 0)] if p else [], [ctx] * d)

            share = prompt_share(e.prompt_tokens, self.clock.now)
            try:
                refusal = judge(slo, group_forecast(s, s.kv, [req], cost, share))
            finally:
                if queue is not None:
                    del queue[req.request_id]
                else:
                    s.waiting.remove(req)
            if refusal is None:
                return e
            s.kv.free(req)  # (the lookup's memo of its hashes)
        assert refusal is not None
        req.status = RequestStatus.FINISHED_ABORTED
        self.refused[req.request_id] = refusal.reason
        return None

    def _try_remote(self, dec: _Engine, req: Request) -> bool:
        d = self.dep
        threshold = max(1, d.threshold)
        if req.num_prompt_tokens < threshold:
            self._local("short_prompt")
            return False
        peer = min(self.prefillers, key=lambda p: p.load)
        if peer.load >= d.prefill_queue_limit:
            self._local("prefill_busy")
            return False
        try:
            hit = dec.scheduler.reserve_remote(req)
        except ValueError:
            return False
        if hit is None:
            self._local("no_room")
            return False
        if req.num_prompt_tokens - hit < threshold:
            self._local("cached")
            dec.scheduler.remote_prefill_failed(req, hit)
            self._wake(dec)
            return True
        preq = Request(req.request_id, req.prompt_token_ids, SamplingParams(max_tokens=1,
                       ignore_eos=True), arrival_time=self.clock.now)
        try:
            peer.scheduler.add_request(preq)
        except ValueError:
            dec.scheduler.remote_prefill_failed(req, hit)
            self._wake(dec)
            return True
        peer.transfers[req.request_id] = _Transfer(req, dec, start_block=hit // self.spec.block_size)
        self._remote_of[req.request_id] = preq
        self.remote_prefills += 1
        self._wake(peer)
        return True

    def _local(self, why: str) -> None:
        self.local_prefills[why] = self.local_prefills.get(why, 0) + 1

    # -- steps --------------------------------------------------------------------------------
    def _step(self, e: _Engine) -> None:
        if e.dead:
            e.busy = False
            return
        s = e.scheduler
        batch = s.schedule()
        if not batch.requests:
            e.busy = False
            if batch.preempted:  # it freed blocks: the next schedule() can run something
                self._wake(e)
            return  # else nothing is runnable until remote K/V lands (which wakes it)
        chunks, decodes = batch.mix()
        # Which requests sample: those whose step reaches their last token.
        ends = [r.num_computed_tokens + n == r.num_tokens
                for r, n in zip(batch.requests, batch.num_tokens)]
        dt = self.cost.step_time(chunks, decodes)
        kind = "mixed" if chunks and decodes else ("prefill" if chunks else "decode")
        e.steps[kind] += 1
        e.prompt_tokens.append((self.clock.now, sum(c.tokens for c in chunks)))
        e.busy_s += dt
        self._at(self.clock.now + dt, lambda: self._step_end(e, batch, ends))

    def _step_end(self, e: _Engine, batch: Any, ends: list[bool]) -> None:
        if e.dead:  # it failed mid-step: what the step computed is lost with it
            e.busy = False
            return
        sampled = {r.request_id: [_TOKEN] for r, end in zip(batch.requests, ends) if end}
        if e.role == "prefill":
            self._push(e, batch, sampled)
        e.scheduler.update(batch, sampled)
        e.busy = False
        e.active_until = self.clock.now
        landed, e.landed = e.landed, []
        for tr in landed:
            self._join(tr)
        self._wake(e)

    def _push(self, e: _Engine, batch: Any, sampled: dict[str, list[int]]) -> None:
        """The prefill role: each chunk's K/V goes on the link as its step ends; a request
        whose last chunk ran lands its first token once its last byte has."""
        now = self.clock.now
        link = self.dep.link
        bs = self.spec.block_size
        for req, n in zip(batch.requests, batch.num_tokens):
            tr = e.transfers.get(req.request_id)
            if tr is None:
                continue
            end = req.num_computed_tokens + n
            first = max(tr.sent_upto, tr.start_block * bs)
            sent = max(0, end - first)
            tr.sent_upto = max(tr.sent_upto, end)
            nbytes = sent * self.kv_bytes_per_token
            tr.nbytes += nbytes
            if link is not None:
                start = max(now, e.link_free)
                e.link_free = start + nbytes / link.bandwidth
                tr.last_byte = e.link_free + link.latency_s
            else:
                tr.last_byte = now
            if req.request_id in sampled:
                del e.transfers[req.request_id]
                e.landing += 1  # still this worker's, as the decode side counts it
                at = max(now, tr.last_byte) + self.dep.handoff_s
                self.transfer_s.append(at - now)
                tr.prefill_done = now
                self._at(at, lambda tr=tr, e=e: self._landed(tr, e))

    def _landed(self, tr: _Transfer, peer: _Engine) -> None:
        peer.landing -= 1
        self._landed_at[tr.decode_req.request_id] = tr
        if tr.decoder.busy:  # taken in at the decode engine's next step boundary
            tr.decoder.landed.append(tr)
        else:
            self._join(tr)
            self._wake(tr.decoder)

    def _join(self, tr: _Transfer) -> None:
        """The decode side takes a landed prefill in: its first token is stamped now."""
        req = tr.decode_req
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            tr.decoder.scheduler.remote_prefill_done(req, _TOKEN)

    # -- results ------------------------------------------------------------------------------
    def _summary(self, slo: dict[str, float] | None) -> dict[str, Any]:
        results = []
        end = 0.0
        for spec, req in self.requests:
            m = req.metrics
            r = RequestResult(spec.index, spec.prompt_len, spec.output_len, spec.intruder,
                              start=m.arrival_time)
            if m.first_token_time is not None and req.status is not \
                    RequestStatus.FINISHED_ABORTED:
                r.ttft = m.first_token_time - m.arrival_time
                r.chunk_times = [t - m.arrival_time for t in m.token_times]
                r.chunk_tokens = [1] * len(m.token_times)
                r.output_tokens = len(m.token_times)
                r.latency = (m.finished_time or m.token_times[-1]) - m.arrival_time
                r.success = req.finished
                end = max(end, m.finished_time or 0.0)
            why = self.refused.get(req.request_id)
            if why is not None:
                r.error = f"refused at admission ({why})"
            elif not r.success:
                r.error = "the request could not be served (longer than the context or pool)"
            # Queue: arrival to the first step that computed part of its prompt, wherever.
            remote = self._remote_of.get(req.request_id)
            queue = remote.metrics.queue_time if remote is not None else m.queue_time
            r.server_timing = None if queue is None else {
                "queue_s": queue, "remote": remote is not None,
                "prefill_s": None if r.ttft is None else r.ttft - queue}
            tr = self._landed_at.get(req.request_id)
            if r.server_timing is not None and tr is not None and tr.prefill_done is not None:
                # As the decode role reports a remote prefill (bench's ttft_split reads it).
                # Unlike the server's, queue_s here is the wait for the prefill worker's
                # first step (the server's starts at its own reservation, ~0).
                landed = m.first_token_time or tr.prefill_done
                r.server_timing.update(
                    kv_bytes=tr.nbytes,
                    remote_prefill_s=tr.prefill_done - m.arrival_time,
                    kv_transfer_s=max(0.0, landed - tr.prefill_done))
            results.append(r)
        start = min((s.arrival for s, _ in self.requests), default=0.0)
        out = summarize(results, max(end - start, 1e-9), slo)
        out["simulated"] = {
            "deployment": self.dep.describe(),
            "cost_model": self.cost.source,
            "workers": [{"name": e.name, "role": e.role, "steps": e.steps,
                         "busy_s": e.busy_s, "utilization": e.busy_s / max(end - start, 1e-9),
                         "preemptions": e.scheduler.num_preemptions} for e in self.engines],
            "remote_prefills": self.remote_prefills,
            "local_prefills": dict(self.local_prefills),
            "mean_transfer_wait_ms": (1e3 * sum(self.transfer_s) / len(self.transfer_s)
                                      if self.transfer_s else None),
        }
        if self.dep.fail_at is not None and self.failed:
            out["simulated"]["migrated"] = self.migrated
        if self.dep.admission is not None:
            admitted = [r for r in results if r.error is None or
                        not r.error.startswith("refused at admission")]
            met = sum(meets_slo(r, slo) for r in admitted) if slo else None
            reasons: dict[str, int] = {}
            for why in self.refused.values():
                reasons[why] = reasons.get(why, 0) + 1
            out["simulated"]["admission"] = {
                "refused": len(self.refused), "by_reason": reasons,
                "admitted": len(admitted),
                "admitted_met_slo": (met / len(admitted) if admitted and met is not None
                                     else None)}
        return out


def simulate(cost: CostModel, engine: EngineSpec, deployment: Deployment,
             specs: Sequence[RequestSpec], slo: dict[str, float] | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Serve ``specs`` in virtual time; the bench's summary dict, plus ``simulated``
    (``progress``: see ``Simulation.run``)."""
    return Simulation(cost, engine, deployment).run(specs, slo, progress)


def kv_blocks_for(cost: CostModel, memory_bytes: float, block_size: int) -> int:
    """Blocks of K/V in ``memory_bytes``, at the cost model's bytes a token: no more. The
    engine also caps its pool at what ``max_num_seqs`` full-length sequences use; the CLI's
    engines are sized as the engine sizes them (``phasewise.perf.commands.engine_spec``)."""
    per_block = cost.kv_bytes_per_token * block_size
    n = int(memory_bytes // per_block) if per_block > 0 else 0
    if n < 1:
        raise ValueError(f"{memory_bytes / 2**20:.0f} MiB holds no {block_size}-token K/V "
                         f"block ({per_block / 2**20:.2f} MiB each)")
    return n

