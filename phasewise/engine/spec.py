"""Speculative decoding: propose a few tokens cheaply, verify them in one forward pass.

Decode reads every weight to make one token per request. A verify step feeds a request's last
sampled token and ``k`` proposed ones (its *drafts*) through the model in the same pass; the
``k + 1`` rows of logits say which drafts the model itself would have produced, and the step
emits the accepted drafts plus one token of its own: between 1 and ``k + 1`` tokens for one
read of the weights. What a rejected draft costs is compute, which decode at small batch
leaves idle.

Pieces:

* a ``Proposer`` (``propose(request, k) -> drafts``), kept per request and released when the
  engine forgets it. ``NgramProposer`` is prompt lookup: the longest recent n-gram that
  ends the request's tokens is looked up earlier in its own prompt and outputs, and the
  tokens that followed it there are proposed. It needs no draft model and suits prompts that
  repeat their context (code edits, RAG). A draft model would be another ``Proposer``.
* ``verify`` turns a request's ``k + 1`` rows of logits into its emitted tokens. Greedy
  requests keep drafts while they equal the row's argmax, so the output is the one greedy
  decoding gives. Sampled requests use rejection sampling against the proposal, which is a
  point mass on the draft (q(d) = 1): draft ``d`` is kept with probability ``p(d)``, where p
  is the request's filtered distribution (temperature, top-k/p, min-p) at that row; on the
  first rejection the emitted token is drawn from p with ``d`` removed (``max(p - q, 0)``
  renormalised), and when every draft is kept one more token is drawn from the last row.
  Each emitted token is then distributed exactly as plain sampling would give it.

The scheduler treats a verify as a decode of ``1 + k`` tokens (``Request.spec_token_ids`` holds
the drafts of the step); the runner lays its rows out as ``k + 1`` decode rows of one request,
each attending one position further, so the decode kernels run it; the scheduler rolls back
the K/V slots of rejected drafts (``KVCacheManager.trim``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from phasewise.engine.model_runner import RunnerOutput
    from phasewise.engine.request import Request
    from phasewise.engine.sampler import Failure, Sampler

NGRAM_MAX = 3  # the longest n-gram prompt lookup matches
NGRAM_MIN = 1  # the shortest


class Proposer(Protocol):
    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (the request's prompt and outputs)."""

    def release(self, request_id: str) -> None:
        """Forget a request."""


class NgramProposer:
    """Prompt lookup over each request's own tokens, indexed as they grow.

    Per request, every n-gram (``NGRAM_MIN`` <= n <= ``NGRAM_MAX``) that is followed by a
    token maps to the position of that following token, the latest occurrence winning. A
    proposal looks up the request's last n tokens, longest first, and returns up to ``k``
    tokens from where they last led. Indexing a new token costs ``NGRAM_MAX`` dict updates,
    so a step never rescans a long context."""

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n; got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        # per request: its index, how many of its tokens it covers, and the last of them
        self._index: dict[str, tuple[dict[tuple[int, ...], int], int, int]] = {}

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def _indexed(self, request_id: str, tokens: list[int]) -> dict[tuple[int, ...], int]:
        """The request's index, brought up to ``tokens``: a request's tokens only grow, so
        what was indexed is kept when ``tokens`` is as long and ends it with the same token
        (rebuilt otherwise); no step compares the whole history."""
        entry = self._index.get(request_id)
        if entry is None or entry[1] > len(tokens) or (
                entry[1] and tokens[entry[1] - 1] != entry[2]):
            entry = ({}, 0, -1)
        index, seen, _ = entry
        for j in range(seen, len(tokens)):  # token j follows the n-grams ending at j-1
            for n in range(self.min_n, min(self.max_n, j) + 1):
                index[tuple(tokens[j - n:j])] = j
        self._index[request_id] = (index, len(tokens), tokens[-1] if tokens else -1)
        return index

    def catch_up(self, request_id: str, tokens: list[int]) -> None:
        """Index the request's tokens up to ``tokens`` now (``propose`` does it anyway): the
        engine calls it before timing a step that drafts after steps that did not."""
        if tokens:
            self._indexed(request_id, tokens)

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        if k < 1 or not tokens:
            return []
        index = self._indexed(request_id, tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = index.get(tuple(tokens[end - n:]))
            # The suffix itself was indexed only up to its own last token, so a hit is an
            # earlier occurrence; what followed it is the proposal.
            if start is not None and start < end:
                return tokens[start:start + k]
        return []


class DraftPolicy:
    """Whether the decoding requests draft in a step: only at batch sizes where steps with
    drafts have been measured faster, per token, than plain steps of the same batch.

    Whether a draft pays depends on the machine and the model, not on the phase's name. While
    a step is bound by reading the weights, an extra row is nearly free and every kept draft
    is a token gained. Once rows cost real time (compute, attention, per-row Python, a kernel
    path that changes at some row count: the fused AMX layer stops at 32 rows), the rejected
    drafts slow every request in the batch. The roofline alone cannot see most of that, so
    the policy measures it, on decode-only steps:

    * a plain step's time per exact batch size (a moving average: contexts grow);
    * per batch-size bucket (powers of two), the **speedup** of drafting steps: the time
      plain steps of the same batch would have taken to emit what each drafting step emitted
      (its tokens per request times the plain step's time), over the time it took; recent
      steps weigh most (each older one by ``decay`` more);
    * until both kinds have been seen ``warmup`` times in a bucket, its steps alternate
      between them, drafting first;
    * then a step drafts when the speedup is above 1, and one step in ``check_every`` of
      that bucket does the other, so that a change (longer contexts, other prompts) is
      noticed.

    Within a drafting step every request gets what the proposer finds, up to ``k``.
    """

    def __init__(self, decay: float = 0.8, warmup: int = 3, check_every: int = 32) -> None:
        if not 0 < decay <= 1 or warmup < 1 or check_every < 2:
            raise ValueError(f"need 0 < decay <= 1, warmup >= 1, check_every >= 2; got "
                             f"{decay}, {warmup}, {check_every}")
        self.decay, self.warmup, self.check_every = decay, warmup, check_every
        self._plain: dict[int, float] = {}  # batch size -> a plain step's seconds
        # per bucket: [drafting steps seen, plain steps seen, decayed plain-equivalent
        # seconds of the drafting steps, decayed seconds they took]
        self._buckets: dict[int, list[float]] = {}
        self._steps: dict[int, int] = {}  # per bucket: steps begun
        self.drafting = True

    def plain_seconds(self, decoding: int) -> float | None:
        """A plain decode-only step's time at ``decoding`` requests (from the nearest batch
        size measured), or None before any."""
        if decoding in self._plain:
            return self._plain[decoding]
        if not self._plain:
            return None
        return self._plain[min(self._plain, key=lambda n: (abs(n - decoding), n))]

    def speedup(self, decoding: int) -> float | None:
        """Drafting steps' measured speedup over plain ones at about ``decoding`` requests,
        or None where none was measured."""
        b = self._buckets.get(decoding.bit_length())
        return b[2] / b[3] if b is not None and b[3] > 0 else None

    def describe(self) -> str:
        """One line: per batch size seen, drafting's measured speedup over plain decoding,
        and whether steps of that size draft."""
        parts = []
        for key in sorted(self._buckets):
            lo, hi = 1 << (key - 1), (1 << key) - 1
            size = str(lo) if lo == hi else f"{lo}-{hi}"
            b, speed = self._buckets[key], self.speedup(lo)
            if speed is None or min(b[0], b[1]) < self.warmup:
                parts.append(f"{size}: measuring")
            else:
                parts.append(f"{size}: x{speed:.2f}, {'drafts' if speed > 1 else 'no drafts'}")
        return ("drafting / plain speed by decoding batch: " + "; ".join(parts)) if parts \
            else "no decode-only step measured yet"

    def begin_step(self, decoding: int) -> bool:
        """A step of about ``decoding`` decoding requests begins: whether its requests draft."""
        key = decoding.bit_length()
        self._steps[key] = n = self._steps.get(key, 0) + 1
        b = self._buckets.get(key)
        if b is None or min(b[0], b[1]) < self.warmup:
            self.drafting = b is None or b[0] <= b[1]
            return self.drafting
        speed = self.speedup(decoding)
        better = speed is not None and speed > 1
        self.drafting = better if n % self.check_every else not better
        return self.drafting

    def observe_step(self, drafted: bool, decoding: int, tokens: int, seconds: float) -> None:
        """A decode-only step of ``decoding`` requests (drafting or not) emitted ``tokens`` in
        ``seconds``."""
        if seconds <= 0 or decoding < 1:
            return
        b = self._buckets.setdefault(decoding.bit_length(), [0, 0, 0.0, 0.0])
        if not drafted:
            b[1] += 1
            prev = self._plain.get(decoding)
            # A plain step under half the estimate replaces it: the estimate began at a cold
            # step (a warm-up's first decode runs several times slower), and averaging it
            # away would credit the next drafting steps against a plain time too slow.
            self._plain[decoding] = (seconds if prev is None or seconds < 0.5 * prev
                                     else 0.8 * prev + 0.2 * seconds)
            return
        b[0] += 1
        plain = self.plain_seconds(decoding)
        if plain is None:
            return
        b[2] = b[2] * self.decay + tokens / decoding * plain
        b[3] = b[3] * self.decay + seconds


@dataclass
class SpecStats:
    """Counters over the engine's life (``/metrics``, ``generate``'s report)."""

    verifies: int = 0  # request-steps that carried drafts
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    emitted: int = 0  # tokens those verifies produced (accepted + one each, unless cut)

    def add(self, proposed: int, accepted: int, emitted: int) -> None:
        self.verifies += 1
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += emitted

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted(self) -> float | None:
        """Drafts kept per verify."""
        return self.accepted / self.verifies if self.verifies else None


class Speculator:
    """Speculative decoding's part in an engine's step: before scheduling, drafts for the
    decoding requests (``propose``); after the forward pass, each verify's rows of logits
    turned into its tokens (``verify``); then the step's timing for the draft policy
    (``observe``). ``k``: the most drafts a request verifies in one step; ``policy``: lets a
    step draft only at batch sizes where drafting has delivered more tokens per second on
    this engine (None: every step drafts)."""

    def __init__(self, proposer: Proposer, k: int, policy: DraftPolicy | None) -> None:
        self.proposer = proposer
        self.k = k
        self.policy = policy
        self.untimed_s = 0.0  # spent in this step but not by it (the draft policy's view)

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)

    def propose(self, running: Iterable[Request], max_len: int) -> None:
        """Give each decoding request drafts to verify in this step: at most ``k``, no more
        than its context (``max_len``) and ``max_tokens`` leave room for, none for a request
        whose sampling needs the history token by token (penalties, ``min_tokens`` still
        masking its stop tokens, a grammar), and none at all in a step that ``policy`` finds
        drafting does not pay in."""
        self.untimed_s = 0.0
        decoding = [r for r in running
                    if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1]
        policy = self.policy
        if policy is not None:
            drafted_before = policy.drafting
            if not policy.begin_step(len(decoding)):
                return
            catch_up = getattr(self.proposer, "catch_up", None)
            if not drafted_before and catch_up is not None:
                # steps that did not draft left the proposer's index behind: bringing it up
                # to date is not what drafting costs a step, so it stays out of the timing
                t = time.monotonic()
                for req in decoding:
                    catch_up(req.request_id, req.all_token_ids)
                self.untimed_s = time.monotonic() - t
        for req in decoding:
            p = req.params
            if (p.needs_penalties or req.num_output_tokens < p.min_tokens
                    or req.grammar is not None):
                continue
            room = min(self.k, max_len - req.num_tokens)
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - 1)
            if room >= 1:
                req.spec_token_ids = self.proposer.propose(req.request_id, req.all_token_ids,
                                                           room)

    @staticmethod
    def verify(sampler: Sampler, ran: RunnerOutput, tokens: dict[str, list[int]],
               failed: list[Failure]) -> dict[str, tuple[int, int]]:
        """Turn each verify's rows of logits into its tokens (added to ``tokens``; a request
        whose verification raises joins ``failed``). Returns (drafts, accepted) per
        verifying request."""
        verified: dict[str, tuple[int, int]] = {}
        for req, row, n in ran.spans():
            if n == 1:
                continue
            try:
                out, accepted = sampler.verify(ran.logits[row:row + n], req)
            except Exception as e:  # noqa: BLE001 - reported on that request only
                failed.append((req, f"sampling failed for this request: "
                                    f"{type(e).__name__}: {e}", None))
                continue
            tokens[req.request_id] = out.token_ids
            if req.logprobs is not None:
                req.logprobs.extend(lp for lp in out.logprobs if lp is not None)
            verified[req.request_id] = (n - 1, accepted)
        return verified

    def observe(self, drafted: bool, decoding: int, tokens: int, seconds: float) -> None:
        """A decode-only step's outcome, for the policy: whether it drafted, its requests,
        the tokens it gave and its duration (less what ``propose`` kept out of it)."""
        if self.policy is not None:
            self.policy.observe_step(drafted, decoding, tokens, seconds - self.untimed_s)


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) from ``len(drafts) + 1`` rows of logits: drafts
    while each equals its row's argmax, then the argmax of the first row that disagrees (or
    of the last row)."""
    top = logits.argmax(dim=-1).tolist()
    m = 0
    while m < len(drafts) and drafts[m] == top[m]:
        m += 1
    return drafts[:m] + [top[m]], m


def verify_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None
                   ) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) by rejection sampling: ``probs`` holds the target
    distribution of each of the ``len(drafts) + 1`` rows, the proposal is the draft itself."""
    dev = probs.device
    u = torch.rand(len(drafts), generator=generator, device=dev).tolist() if drafts else []
    for m, d in enumerate(drafts):
        p = probs[m]
        if u[m] < float(p[d]):
            continue
        residual = p.clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # all of p on d (u < 1 = p(d) up to rounding): kept
            continue
        return drafts[:m] + [_draw(residual, generator)], m
    return drafts + [_draw(probs[len(drafts)], generator)], len(drafts)


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from the (unnormalised) weights ``p``, from one uniform number (as the
    sampler's draws)."""
    u = torch.rand(1, generator=generator, device=p.device)
    return int(inverse_cdf(p[None].float(), u)[0])


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` ([n, K], non-negative, not all zero), the first position whose
    running sum passes ``u`` (in [0, 1)) times the row's total: a draw from the row's weights.
    Never a position of weight zero: the first sum past a value rises there, and a ``u`` of 1
    (past the total) picks the position where the sum reaches the total, the last with
    weight."""
    cum = weights.double().cumsum(dim=-1)  # the kernel's running sums are doubles too
    total = cum[:, -1:].contiguous()
    pos = torch.searchsorted(cum, u[:, None].double() * total, right=True)
    last = torch.searchsorted(cum, total, right=False)
    return torch.minimum(pos, last)[:, 0]
