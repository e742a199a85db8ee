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

from dataclasses import dataclass
from typing import Protocol

import torch

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
    drafts have delivered more tokens per second than steps without them, on this engine.

    Whether a draft pays depends on the machine and the model, not on the phase's name. While
    a step is bound by reading the weights, an extra row is nearly free and every kept draft
    is a token gained. Once rows cost real time (compute, attention, per-row Python, a kernel
    path that changes at some row count: the fused AMX layer stops at 32 rows), the rejected
    drafts slow every request in the batch. The roofline alone cannot see most of that, so
    the policy measures it:

    * per batch size (decoding requests, in powers of two), the tokens that decode-only steps
      emitted (each request's token plus the drafts kept) over their duration, kept apart for
      steps with drafts and steps without, older steps decaying by ``decay`` per step;
    * until both kinds have been seen ``warmup`` times at a size, its steps alternate, the
      less seen kind first;
    * then a step drafts when drafting delivered more, and one step in ``check_every`` (of
      that size) does the other, so that a change (longer contexts, other prompts) is
      noticed.

    Within a drafting step every request gets what the proposer finds, up to ``k``.
    """

    def __init__(self, decay: float = 0.97, warmup: int = 3, check_every: int = 32) -> None:
        if not 0 < decay <= 1 or warmup < 1 or check_every < 2:
            raise ValueError(f"need 0 < decay <= 1, warmup >= 1, check_every >= 2; got "
                             f"{decay}, {warmup}, {check_every}")
        self.decay, self.warmup, self.check_every = decay, warmup, check_every
        # per size bucket, [without, with] drafts: [steps seen, decayed tokens, seconds]
        self._rates: dict[int, list[list[float]]] = {}
        self._steps: dict[int, int] = {}  # per size bucket: steps begun
        self._bucket, self.drafting = 0, True

    def delivered(self, decoding: int) -> tuple[float | None, float | None]:
        """Tokens per second that decode-only steps of about ``decoding`` requests delivered
        (without drafts, with them); None where no such step was seen."""
        arms = self._rates.get(decoding.bit_length())
        if arms is None:
            return None, None
        plain, spec = ((tok / sec if sec > 0 else None) for _, tok, sec in arms)
        return plain, spec

    def describe(self) -> str:
        """One line: per batch size seen, drafting's measured tokens/s over plain decoding's,
        and whether steps of that size draft."""
        parts = []
        for b in sorted(self._rates):
            if b == 0:
                continue
            lo, hi = 1 << (b - 1), (1 << b) - 1
            size = str(lo) if lo == hi else f"{lo}-{hi}"
            plain, spec = self.delivered(lo)
            if plain is None or spec is None or min(a[0] for a in self._rates[b]) < self.warmup:
                parts.append(f"{size}: measuring")
            else:
                parts.append(f"{size}: x{spec / plain:.2f}, "
                             f"{'drafts' if spec > plain else 'no drafts'}")
        return ("drafting / plain tok/s by decoding batch: " + "; ".join(parts)) if parts \
            else "no decode-only step measured yet"

    def begin_step(self, decoding: int) -> bool:
        """A step of ``decoding`` decoding requests begins: whether its requests draft."""
        self._bucket = b = decoding.bit_length()
        self._steps[b] = n = self._steps.get(b, 0) + 1
        arms = self._rates.get(b)
        if arms is None or min(arms[0][0], arms[1][0]) < self.warmup:
            self.drafting = arms is None or arms[1][0] <= arms[0][0]
            return self.drafting
        plain, spec = self.delivered(decoding)
        better = spec is not None and plain is not None and spec > plain
        self.drafting = better if n % self.check_every else not better
        return self.drafting

    def observe_step(self, drafted: bool, tokens: int, seconds: float) -> None:
        """The decode-only step begun last (with drafts or not) emitted ``tokens`` in
        ``seconds``."""
        if seconds <= 0:
            return
        arms = self._rates.setdefault(self._bucket, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
        arm, d = arms[1 if drafted else 0], self.decay
        arm[0], arm[1], arm[2] = arm[0] + 1, arm[1] * d + tokens, arm[2] * d + seconds


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
    """One draw from the (unnormalised) weights ``p``: argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(p).exponential_(generator=generator)
    return int((p / noise).argmax())
