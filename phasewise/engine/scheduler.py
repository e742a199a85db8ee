"""Continuous batching under a per-step token budget.

Every step, each running request asks for ``num_tokens - num_computed_tokens`` tokens: one for
a decode, more for a prompt (or, after preemption, a recompute). The scheduler hands out up to
``max_num_batched_tokens`` of them and admits waiting requests while budget, KV blocks and the
sequence cap (``max_num_seqs``) allow. There is no phase flag anywhere: a step's prefill/decode
mix is read off the token counts it holds.

Policies:

* ``chunked`` (default): decodes first (one token each), then partly prefilled prompts, then
  new prompts, each cut to the budget that is left. A long prompt never stalls the streams.
* ``prefill-first``: while prompts wait, a step runs only whole waiting prompts and no
  decodes. This is the naive behaviour; it is kept to show the stall it causes. (A prompt
  longer than a windowed model's pool, which only a window at a time of it fits, is the
  exception: its step is scheduled as ``chunked`` schedules, decodes and its chunk.)

Preemption (by recompute): when a running request needs a block and none is free, the victim
is the most recently admitted running request that has not been given tokens in this step
(the lowest priority under first-come-first-served). If the request asking is itself the most
recently admitted, it is the one preempted (a prompt chunk just waits instead). A victim
frees all its blocks, goes back to the *front* of the waiting queue with
``num_computed_tokens = 0``, and later recomputes its prompt and outputs so far (the prefix
cache often keeps most of them). No new request is admitted in a step that preempted.

Fairness between client requests: one request of many sequences (n samples of several
prompts: a group, ``Request.group``) must not hold every seat while another client's request
waits for its first token. Admission takes, of the waiting requests, the first whose group
holds the fewest seats (FCFS among equals, so requests of one sequence each are admitted in
arrival order, and a preempted request first); and where no seat is free, a request whose
group holds none waits, and some group holds more than half of ``max_num_seqs`` (and at
least two), that group's most recently admitted sequence is preempted, once a step, so that
the newcomer gets the seat.

Time: the scheduler reads no clock of its own. Every timestamp it stamps on a request
(``first_scheduled_time``, ``first_token_time``, ``token_times``, ``finished_time``) comes from
the ``clock`` it is given: the engine passes ``time.monotonic``; a simulator passes its virtual
time. The clock is required, so no caller gets wall-clock stamps by accident. Like the KV
manager, this module imports no torch.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from phasewise.cache.manager import CachedPrefix, KVCacheManager
from phasewise.config import POLICIES
from phasewise.engine.finish import token_finish
from phasewise.engine.request import Request, RequestStatus
from phasewise.engine.step_cost import Chunk
from phasewise.engine.validation import ValidationError, check_context


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    policy: str = "chunked"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.policy == "prefill-first" and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"policy 'prefill-first' runs whole prompts, so max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )

    @classmethod
    def of(cls, budget: int, max_num_seqs: int, max_model_len: int,
           policy: str) -> SchedulerConfig:
        """An engine's scheduler: ``budget`` tokens a step, except that ``prefill-first``
        runs whole prompts, so its steps take up to the context's length."""
        if policy == "prefill-first":
            budget = max(budget, max_model_len)
        return cls(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                   max_model_len=max_model_len, policy=policy)


@dataclass
class ScheduledBatch:
    """One step's work. Requests with a single-token chunk come first (see attention.py)."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens computed per request
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def mix(self) -> tuple[list[Chunk], list[int]]:
        """The step's exact mix, as the roofline prices it: each prompt chunk with its
        context (and whether it reaches its request's last token, so samples), and each
        decode's sequence length with its new token. Read it before ``update()`` advances
        the computed counts."""
        chunks, decodes = [], []
        for req, n in zip(self.requests, self.num_tokens):
            done = req.num_computed_tokens
            if is_decode(req, n):  # a verify's rows are decodes, one position apart
                decodes.extend(range(done + 1, done + 1 + n))
            else:
                chunks.append(Chunk(n, done, done + n == req.num_tokens))
        return chunks, decodes

    def riders(self) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...], tuple[int, ...]]:
        """Who rides on the step: each prompt chunk as (request id, tokens), the ids of the
        decoding requests, and each chunk's whole prompt in tokens (in the chunks' order).
        Read it before ``update()``, as ``mix``."""
        chunks, decodes, prompts = [], [], []
        for req, n in zip(self.requests, self.num_tokens):
            if is_decode(req, n):
                decodes.append(req.request_id)
            else:
                chunks.append((req.request_id, n))
                prompts.append(req.num_prompt_tokens)
        return tuple(chunks), tuple(decodes), tuple(prompts)


def _group(req: Request) -> Hashable:
    return req.group if req.group is not None else req.request_id


def is_decode(req: Request, n: int) -> bool:
    """One token on top of a fully computed history, and that token is a sampled output,
    with the step's draft tokens behind it if it verifies some (speculative decoding)."""
    return (n == 1 + len(req.spec_token_ids) and req.num_output_tokens > 0
            and req.num_computed_tokens == req.num_tokens - 1)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order (earliest first)
        # Requests holding blocks whose prompt KV comes from a prefill worker (see
        # reserve_remote); they count against max_num_seqs but are never scheduled.
        self.remote: dict[str, Request] = {}
        self.num_preemptions = 0
        # Longest a request may grow: max_model_len, or less when the whole pool holds fewer
        # tokens (the engine sizes them to agree; a scheduler built directly may not), so a
        # request alone in the pool always finishes instead of preempting itself forever.
        # Under a sliding window a request holds only its window's blocks (most_blocks).
        fits = kv.most_blocks(config.max_model_len + 1) <= kv.num_blocks
        self.max_len = (config.max_model_len if fits
                        else min(config.max_model_len, kv.num_blocks * kv.block_size - 1))

    # -- admission -------------------------------------------------------------------------
    def check_admissible(self, req: Request) -> None:
        """Raise ``ValidationError`` (a ValueError, ``param="prompt"``) if the request could
        never be scheduled: an empty prompt, one that leaves the context no room for an output
        token, or one the whole KV pool cannot hold. A ``max_tokens`` beyond the room left is
        not refused here: generation then ends at the context length (finish ``length``)."""
        n = req.num_prompt_tokens
        check_context(n, None, self.config.max_model_len)
        if self.kv.most_blocks(n + 1) > self.kv.num_blocks:
            capacity = self.kv.num_blocks * self.kv.block_size
            raise ValidationError(f"prompt has {n} tokens but the whole KV cache holds "
                                  f"{capacity}; raise the KV cache memory or shorten the prompt",
                                  param="prompt")

    def add_request(self, req: Request) -> None:
        self.check_admissible(req)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        """Whether a step has work: requests waiting for remote KV do not count (nothing
        runs for them until their KV is in)."""
        return bool(self.waiting or self.running)

    # -- remote prefill (the decode role) --------------------------------------------------
    def reserve_remote(self, req: Request) -> int | None:
        """Admit a request whose prompt KV a prefill worker will send: it takes its cached
        prefix from this pool and blocks for the rest of its prompt, and waits in
        ``remote``. Returns the prompt tokens found cached here (a multiple of block_size:
        the prefill worker sends KV from there on), or None when the sequence cap or the free
        blocks leave no room now (the caller prefills it locally instead)."""
        self.check_admissible(req)
        if not self._has_seat():
            return None
        prefix = self._cached_prefix(req)
        # under a window, only the blocks its decoding reads (the prefill worker sends those)
        if not self.kv.allocate_slots(req, req.num_tokens - prefix.num_tokens, prefix,
                                      first_query=req.num_tokens):
            return None
        self.kv.record_prefix_lookup(req.num_tokens, prefix.num_tokens)
        req.metrics.first_scheduled_time = self.clock()
        req.metrics.num_cached_tokens = prefix.num_tokens
        req.num_computed_tokens = prefix.num_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[req.request_id] = req
        return prefix.num_tokens

    def remote_prefill_done(self, req: Request, token: int) -> None:
        """Its whole prompt's KV is in and the prefill worker sampled ``token``: it runs on
        as if this engine had prefilled it (its next step is a decode)."""
        del self.remote[req.request_id]
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._append_token(req, token, self.clock())

    def remote_prefill_failed(self, req: Request, num_valid_tokens: int) -> None:
        """The remote prefill will not finish: keep the first ``num_valid_tokens`` of the
        prompt whose KV arrived, and compute the rest here, chunked, like any prompt."""
        del self.remote[req.request_id]
        kept = max(req.num_computed_tokens, min(num_valid_tokens, req.num_tokens - 1))
        if self.kv.dead_blocks(kept) < self.kv.first_held_block(req.request_id):
            # under a window its reservation holds only the blocks decoding reads, not those
            # computing from `kept` needs: it starts over, its prefix looked up again
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            return
        req.num_computed_tokens = kept
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop string, abort): drop it from its queue and free its blocks."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            self.remote.pop(req.request_id, None)
        req.status = status
        req.metrics.finished_time = self.clock()
        self.kv.free(req)

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        if self.config.policy == "prefill-first" and self.waiting:
            hog = self._make_room(self._seats())
            if hog is not None:  # the newcomer's seat: a decode step, then its prompt
                batch = self._schedule(admit=False)
                batch.preempted.insert(0, hog)
                return batch
            batch = self._schedule_whole_prompts()
            if batch.requests or batch.preempted:  # (preempted: its chunked fallback's)
                return batch
            return self._schedule(admit=False)
        return self._schedule(admit=True)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _pick_victim(self, asking: Request, scheduled: set[str]) -> Request | None:
        """A parked request (its reader takes nothing), else the latest-admitted running
        request not yet scheduled this step, if it ranks below ``asking``; None means
        ``asking`` itself is the lowest-priority candidate."""
        parked = self._latest_parked(besides=asking)
        if parked is not None:
            return parked
        for cand in reversed(self.running):
            if cand is asking:
                return None
            if cand.request_id not in scheduled:
                return cand
        return None

    def _schedule(self, admit: bool) -> ScheduledBatch:
        batch = self._schedule_once(admit)
        runnable = [r for r in self.running if not r.parked]
        if not batch.requests and not batch.preempted and runnable:
            # Safety net: nothing could run although requests hold blocks (running prompts
            # filled the pool). Preempt the lowest-priority one so the others move on.
            victim = runnable[-1]
            self._preempt(victim)
            batch = self._schedule_once(admit=False)
            batch.preempted.insert(0, victim)
        return batch

    def _schedule_once(self, admit: bool) -> ScheduledBatch:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        batch = ScheduledBatch()
        scheduled: set[str] = set()
        seats: Counter[Hashable] = Counter()
        if admit and self.waiting:  # (the seats by group matter only to admission)
            seats = self._seats()
            hog = self._make_room(seats)
            if hog is not None:
                batch.preempted.append(hog)
        # a parked request's reader takes nothing: its tokens wait until it reads again
        active = [r for r in self.running if not r.parked]
        decodes = [r for r in active if r.num_tokens - r.num_computed_tokens == 1]
        chunks = [r for r in active if r.num_tokens - r.num_computed_tokens > 1]
        picked: list[tuple[Request, int]] = []
        # Speculative drafts get only what is left once every decode has its token and the
        # prompts their chunks: they never take budget or blocks from another request.
        drafts = {}
        for r in active:
            if r.spec_token_ids:
                drafts[r.request_id] = r.spec_token_ids
                r.spec_token_ids = []

        for req in decodes + chunks:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, budget)
            while not self.kv.allocate_slots(req, n):
                fit = self.kv.max_new_tokens(req)
                if remaining > 1 and 1 <= fit < n:
                    n = fit  # a prompt chunk shrinks to the blocks that are free
                    continue
                victim = self._pick_victim(req, scheduled)
                if victim is None:
                    if remaining == 1:
                        self._preempt(req)
                        batch.preempted.append(req)
                    n = 0
                    break
                self._preempt(victim)
                batch.preempted.append(victim)
            if n:
                picked.append((req, n))
                scheduled.add(req.request_id)
                budget -= n

        if admit and not batch.preempted:
            while self.waiting and budget > 0 and self._has_seat():
                req = self._next_waiting(seats)
                if req is None:
                    break
                ok, prefix, n = self._first_slots(req, budget, False, seats, batch)
                if not ok:
                    # a window's request needs only its window's blocks at once: a first
                    # chunk larger than the pool holds shrinks (else it could never start)
                    fit = self.kv.fit_tokens(req, prefix) if self.kv.window else 0
                    if not 1 <= fit < n or not self.kv.allocate_slots(req, fit, prefix):
                        break
                    n = fit
                self._admit(req, prefix.num_tokens)
                seats[_group(req)] += 1
                picked.append((req, n))
                budget -= n

        if drafts and not batch.preempted:
            for i, (req, n) in enumerate(picked):
                mine = drafts.get(req.request_id)
                if not mine or budget == 0 or not is_decode(req, n):
                    continue
                extra = min(len(mine), budget, self.kv.max_new_tokens(req) - n)
                if extra > 0 and self.kv.allocate_slots(req, n + extra):
                    req.spec_token_ids = mine[:extra]
                    picked[i] = (req, n + extra)
                    budget -= extra

        # Flat-batch order: single-token chunks and decodes (a verify's rows are decode rows)
        # first, then the longer chunks.
        picked.sort(key=lambda rn: rn[1] != 1 and not is_decode(*rn))
        for req, n in picked:
            batch.requests.append(req)
            batch.num_tokens.append(n)
            if is_decode(req, n):
                batch.num_decode_tokens += n
            else:
                batch.num_prefill_tokens += n
        return batch

    def _schedule_whole_prompts(self) -> ScheduledBatch:
        """prefill-first: admit waiting prompts whole; no decodes run in this step."""
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        seats = self._seats()
        while self.waiting and self._has_seat():
            req = self._next_waiting(seats)
            if req is None:
                break
            ok, prefix, n = self._first_slots(req, budget, True, seats, batch)
            if not ok:
                if not batch.requests and not self.kv.fits_empty_pool(req, n, prefix):
                    # Under a sliding window the pool may hold a request a window at a time
                    # but never its whole prompt (or, preempted, its tokens so far) at
                    # once: it is prefilled in chunks, as the chunked policy would, rather
                    # than wait for room that cannot come.
                    return self._schedule(admit=True)
                break
            self._admit(req, prefix.num_tokens)
            seats[_group(req)] += 1
            batch.requests.append(req)
            batch.num_tokens.append(n)
            batch.num_prefill_tokens += n
            budget -= n
        # Prompt chunks of one token would break the decode-first layout; sort as above.
        order = sorted(range(len(batch.requests)), key=lambda i: batch.num_tokens[i] != 1)
        batch.requests = [batch.requests[i] for i in order]
        batch.num_tokens = [batch.num_tokens[i] for i in order]
        return batch

    def _latest_parked(self, besides: Request | None = None) -> Request | None:
        """The most recently admitted parked running request (not ``besides``), or None."""
        return next((r for r in reversed(self.running) if r.parked and r is not besides),
                    None)

    def _first_slots(self, req: Request, budget: int, whole: bool, seats: Counter[Hashable],
                     batch: ScheduledBatch) -> tuple[bool, CachedPrefix, int]:
        """Blocks for a waiting request's first chunk (``whole``: its whole prompt, which must
        fit ``budget``; else as much as ``budget`` takes), preempting parked requests for
        them while they do not fit (their blocks, to a request that will run). Returns
        whether they were allocated, the cached prefix and the chunk's tokens."""
        while True:
            prefix = self._cached_prefix(req)
            n = req.num_tokens - prefix.num_tokens
            if not whole:
                n = min(n, budget)
            fits = not whole or n <= budget
            ok = fits and self.kv.allocate_slots(req, n, prefix)
            parked = None if ok or not fits else self._latest_parked()
            if parked is None:
                return ok, prefix, n
            self._preempt(parked)
            batch.preempted.append(parked)
            seats[_group(parked)] -= 1

    def _cached_prefix(self, req: Request) -> CachedPrefix:
        """The prefix cache's blocks for a request, none for one that still needs its prompt
        logprobs (cached blocks hold K/V, not the logits its positions need)."""
        if req.needs_prompt_logprobs:
            return CachedPrefix()
        return self.kv.get_computed_blocks(req)

    def _seats(self) -> Counter[Hashable]:
        """Seats each group holds: its running requests and those waiting for remote K/V."""
        return Counter(_group(r) for r in (*self.running, *self.remote.values()))

    def _next_waiting(self, seats: Counter[Hashable]) -> Request | None:
        """The waiting request to admit next: the first whose group holds the fewest seats
        (the queue's head where every group holds none); parked ones wait. None: every
        waiting request is parked."""
        best, fewest = None, 0
        for r in self.waiting:
            if r.parked:
                continue
            n = seats[_group(r)]
            if best is None or n < fewest:
                best, fewest = r, n
                if n == 0:
                    break
        return best

    def _make_room(self, seats: Counter[Hashable]) -> Request | None:
        """With every seat taken, preempt the request ``_seat_for_a_newcomer`` names (its
        seat leaves ``seats``); returns it, or None."""
        if self._has_seat():
            return None
        hog = self._parked_seat() or self._seat_for_a_newcomer(seats)
        if hog is not None:
            self._preempt(hog)
            seats[_group(hog)] -= 1
        return hog

    def _parked_seat(self) -> Request | None:
        """With every seat taken and a request waiting that may run: the latest admitted
        parked request (to preempt: its reader takes nothing, and its tokens so far are
        computed again, or found in the prefix cache, once it reads again), else None."""
        if not any(not r.parked for r in self.waiting):
            return None
        return self._latest_parked()

    def _seat_for_a_newcomer(self, seats: Counter[Hashable]) -> Request | None:
        """With every seat taken: where a waiting request's group holds none and another
        group holds more than half of them, and two or more, that group's most recently
        admitted running request (to preempt), else None. (A request of one sequence is
        never preempted so: under one or two seats, each newcomer would preempt the one
        before it, and none would finish.)"""
        if not any(seats[_group(r)] == 0 and not r.parked for r in self.waiting):
            return None
        hog, held = max(seats.items(), key=lambda kv: kv[1], default=(None, 0))
        if held < 2 or held * 2 <= self.config.max_num_seqs:
            return None
        return next((r for r in reversed(self.running) if _group(r) == hog), None)

    def _has_seat(self) -> bool:
        """Under max_num_seqs: requests waiting for remote K/V hold their seat too."""
        return len(self.running) + len(self.remote) < self.config.max_num_seqs

    def _admit(self, req: Request, num_cached: int) -> None:
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        self.kv.record_prefix_lookup(req.num_tokens, num_cached)
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = self.clock()
            req.metrics.num_cached_tokens = num_cached
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    # -- after the forward pass ------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: dict[str, list[int]]
               ) -> list[tuple[Request, int]]:
        """Advance computed counts, append sampled tokens, finish requests that hit a stop
        condition. ``sampled``: each request's new tokens (one, or for a verify its accepted
        drafts and one more). Returns the requests that received tokens this step, each
        with how many it kept (fewer than sampled when one of them finished it)."""
        now = self.clock()
        got_token = []
        for req, n in zip(batch.requests, batch.num_tokens):
            tokens = sampled.get(req.request_id)
            verify = bool(req.spec_token_ids)
            req.spec_token_ids = []
            if not verify:
                req.num_computed_tokens += n
            if not tokens:
                if verify:  # its sampling failed: only the last sampled token's K/V holds
                    req.num_computed_tokens += 1
                self.kv.cache_blocks(req)
                continue
            if req.params.max_tokens == 0:  # it only prefilled: no output, ended by length
                self.kv.cache_blocks(req)
                self.finish_request(req, RequestStatus.FINISHED_LENGTH)
                got_token.append((req, 0))
                continue
            kept = 0
            for token in tokens:
                kept += 1
                self._append_token(req, token, now)
                if req.finished:
                    break
            if verify and not req.finished:
                # The last sampled token and the accepted drafts (every new token but the
                # last) hold valid K/V; the rejected drafts' slots go back.
                req.num_computed_tokens += kept
                self.kv.trim(req, req.num_computed_tokens + 1)
                self.kv.cache_blocks(req)
            got_token.append((req, kept))
        for req in batch.requests:  # under a window: the blocks no query reads again
            if not req.finished:
                self.kv.drop_behind_window(req)
        return got_token

    def _append_token(self, req: Request, token: int, now: float) -> None:
        """Give a request its sampled token, register its full computed blocks in the prefix
        cache (those of a request this token ends too: a one-token request leaves its prompt
        cached), and finish it if the token meets a stop condition."""
        req.append_output(token)
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        self.kv.cache_blocks(req)
        end = token_finish(req.params, req.eos_token_ids, token, req.num_output_tokens,
                           req.num_tokens, self.max_len)
        if end is None and req.output_complete:
            end = (RequestStatus.FINISHED_STOPPED, None)
        if end is not None:
            status, req.stop_reason = end
            self.finish_request(req, status)
