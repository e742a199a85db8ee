"""The router's index of which worker holds which prompt prefixes, and the routing policies
that read it.

A prompt's full blocks hash as the workers' prefix caches hash them (``chain_hash``: stable
across processes), so the router computes the same hashes from the token ids it relays. Two
sources keep the index:

* what the router sent: a worker that prefilled a prompt holds its blocks afterwards (until
  it evicts them), so they are entered at once, before any report says so;
* what each worker reports (``/internal/v1/load?kv_since=N&kv_epoch=E``, read at every poll,
  ``phasewise.cache.kv_events``): every block its cache stored and evicted since the last
  poll, or, where the router fell behind or the worker restarted, the whole set it holds.
  The reports win: an evicted block leaves the index, however it got there.

Policies (``--routing``):

* ``least-load``: the fewest requests streaming or waiting (ties in turn);
* ``round-robin``: in turn, whatever the load;
* ``prefix``: ``prefix_weight`` x the share of the prompt's blocks the worker holds, plus
  ``load_weight`` x how much lighter than the busiest candidate it is (0 for the busiest, 1
  for the lightest; all 1 when loads are equal), the best score first (ties in turn). The
  default weights are llm-d's (3 : 2).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phasewise.cache.block_pool import chain_hash
from phasewise.cache.manager import windowed_hit
from phasewise.engine.validation import is_count

POLICIES = ("prefix", "least-load", "round-robin")
DEFAULT_POLICY = "prefix"
DEFAULT_PREFIX_WEIGHT = 3.0
DEFAULT_LOAD_WEIGHT = 2.0
# How often the router may move one response to another worker (``router``'s migration; here
# with the other routing settings, which the CLI reads without importing the router).
DEFAULT_MAX_MIGRATIONS = 2
MAX_MIGRATIONS_LIMIT = 16
# Blocks the index keeps per worker until its first poll says how many blocks its pool has
# (the router then keeps no more than that: entries it routed that the worker never cached
# go, oldest first).
DEFAULT_CAPACITY = 1 << 16


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain hashes of the prompt's full blocks, as a worker's prefix cache has them.
    A worker never caches the block holding a prompt's last token for that prompt (it must
    compute that token), so a hit can cover at most ``(len - 1) // block_size`` blocks."""
    out: list[bytes] = []
    parent = None
    for i in range((len(token_ids) - 1) // block_size if token_ids else 0):
        parent = chain_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


class WorkerBlocks:
    """One worker's blocks as the router knows them, least recently entered first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.epoch: str | None = None  # its KVEvents' epoch, and the next event to ask for
        self.next: int | None = None

    def held(self, hashes: Sequence[bytes], block_size: int = 16,
             window: int | None = None) -> int:
        """How many of ``hashes``, from the first, a prefix hit on it would cover: those it
        holds in a row; under a sliding ``window`` every layer shares, the longest prefix
        whose window's blocks it holds (those behind may have gone), as the worker's own
        lookup counts (``phasewise.cache.manager.windowed_hit``)."""
        return windowed_hit([h in self.blocks for h in hashes], block_size, window)

    def enter(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def report(self, kv: dict[str, Any]) -> None:
        """Apply a worker's ``kv_events`` answer (see the module)."""
        self.apply(parse_report(kv, self.capacity))

    def apply(self, parsed: ParsedReport) -> None:
        """Apply a report ``parse_report`` read (on the event loop: its work is bounded by
        the capacity; the parsing, which is not, may run on another thread)."""
        if parsed.held is not None:
            self.blocks = parsed.held
        for stored, b in parsed.events:
            if stored:
                self.blocks[b] = None
                self.blocks.move_to_end(b)
            else:
                self.blocks.pop(b, None)
        self.epoch, self.next = parsed.epoch, parsed.next
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


@dataclass(frozen=True)
class ParsedReport:
    """A worker's ``kv_events`` answer, checked: everything it holds (the newest
    ``capacity`` blocks: those the index would keep), then the events since the last (where
    there were more than the index could use, ``held`` is empty and only the newest
    events follow it)."""

    epoch: str
    next: int
    held: OrderedDict[bytes, None] | None
    events: list[tuple[bool, bytes]]


def parse_report(kv: Any, capacity: int) -> ParsedReport:
    """Check and decode a ``kv_events`` answer; ValueError names what is wrong. Of a list
    of events longer than twice the capacity only the newest are kept, over an empty index
    (what they do not say is forgotten: the index is a hint, and its work on the event loop
    stays bounded)."""
    if not isinstance(kv, dict):
        raise ValueError("kv_events is not an object")
    epoch, nxt = kv.get("epoch"), kv.get("next")
    if not isinstance(epoch, str) or not 0 < len(epoch) <= 64:
        raise ValueError("kv_events.epoch is not a short string")
    if not is_count(nxt):
        raise ValueError("kv_events.next is not an integer in [0, 2^62]")

    def block(h: Any) -> bytes:
        if not isinstance(h, str) or len(h) > 128:
            raise ValueError("a block hash is not a short hex string")
        return bytes.fromhex(h)

    if "held" in kv:
        held = kv["held"]
        if not isinstance(held, list):
            raise ValueError("kv_events.held is not a list")
        return ParsedReport(epoch, nxt, OrderedDict(
            (block(h), None) for h in held[max(0, len(held) - capacity):]), [])
    events = kv.get("events")
    if not isinstance(events, list):
        raise ValueError("kv_events.events is not a list")
    most = 2 * capacity + 1024
    fresh: OrderedDict[bytes, None] | None = OrderedDict() if len(events) > most else None
    out = []
    for e in events[max(0, len(events) - most):]:
        if not isinstance(e, list) or len(e) != 2 or e[0] not in ("s", "e"):
            raise ValueError("a K/V event is not [\"s\" or \"e\", hash]")
        out.append((e[0] == "s", block(e[1])))
    return ParsedReport(epoch, nxt, fresh, out)


@dataclass(frozen=True)
class Choice:
    """Where a request went and why: for the access log and ``/metrics``."""

    policy: str
    blocks: int  # the prompt's full blocks
    expected_hit: int  # of them, held by the chosen worker as the index knows it


def rank(policy: str, loads: Sequence[int], held: Sequence[int], blocks: int, turn: int,
         prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
         load_weight: float = DEFAULT_LOAD_WEIGHT) -> list[int]:
    """The candidates' indices, best first: ``loads`` and ``held`` (blocks of the prompt each
    holds) per candidate, ``blocks`` the prompt's full blocks, ``turn`` the router's counter
    (it breaks ties, so equal workers take turns)."""
    k = len(loads)
    order = [(i - turn) % k for i in range(k)]
    if policy == "round-robin":
        return sorted(range(k), key=lambda i: order[i])
    if policy == "least-load":
        return sorted(range(k), key=lambda i: (loads[i], order[i]))
    if policy != "prefix":
        raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    lo, hi = min(loads, default=0), max(loads, default=0)

    def score(i: int) -> float:
        hit = held[i] / blocks if blocks else 0.0
        light = 1.0 if hi == lo else (hi - loads[i]) / (hi - lo)
        return prefix_weight * hit + load_weight * light

    return sorted(range(k), key=lambda i: (-score(i), order[i]))
