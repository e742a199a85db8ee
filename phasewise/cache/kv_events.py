"""What a block pool stored in and evicted from its prefix cache, in order, for a reader in
another thread (a router asking a worker which prefixes it holds).

The engine thread records each event; a reader asks for the events since the sequence number
it last saw. The log keeps the latest ``capacity`` events: a reader further behind (or one
that saw another incarnation of the worker: ``epoch`` differs) gets the whole set of hashes
the pool holds instead, from a mirror kept beside the log. Hashes are ``chain_hash``'s
(stable across processes), sent as hex.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from typing import Any

DEFAULT_CAPACITY = 65536  # events kept: ~4 MB of hashes; a reader polling twice a second
# falls behind only past ~130k blocks stored or evicted a second


class KVEvents:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.epoch = os.urandom(8).hex()
        self._lock = threading.Lock()
        self._log: deque[tuple[bool, bytes]] = deque(maxlen=capacity)  # (stored?, hash)
        self._next = 0  # the sequence number of the next event
        self._held: set[bytes] = set()

    def stored(self, block_hash: bytes) -> None:
        with self._lock:
            self._log.append((True, block_hash))
            self._next += 1
            self._held.add(block_hash)

    def evicted(self, block_hash: bytes) -> None:
        with self._lock:
            self._log.append((False, block_hash))
            self._next += 1
            self._held.discard(block_hash)

    def since(self, seq: int | None, epoch: str | None) -> dict[str, Any]:
        """``{"epoch", "next", "events": [["s"|"e", hex], ...]}``: the events from ``seq`` on;
        or ``{"epoch", "next", "held": [hex, ...]}``: every hash held now, where the log no
        longer reaches back to ``seq`` or ``epoch`` is not this log's (or ``seq`` is None)."""
        # Under the lock only the copies (the engine thread records while it waits); the
        # answer is built outside it.
        with self._lock:
            nxt, first = self._next, self._next - len(self._log)
            if seq is None or epoch != self.epoch or not first <= seq <= nxt:
                held = list(self._held)
                tail = None
            else:
                tail = list(itertools.islice(self._log, seq - first, None))
        if tail is None:
            return {"epoch": self.epoch, "next": nxt, "held": [h.hex() for h in held]}
        return {"epoch": self.epoch, "next": nxt,
                "events": [["s" if s else "e", h.hex()] for s, h in tail]}
