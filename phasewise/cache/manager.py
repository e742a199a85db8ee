"""Per-request KV block bookkeeping on top of the ``BlockPool``, with prefix caching.

Block-table layout: request token ``t`` (0-based, over prompt then outputs) lives in
``block_table[t // block_size]`` at offset ``t % block_size``. The table grows at the end as
tokens are computed; it is released whole when the request finishes or is preempted.

Prefix caching: a *full* block whose tokens have all been computed is registered under a chain
hash of (hash of the previous block, its own token ids); see ``block_pool.chain_hash`` (stable
across processes). A new request walks its tokens block
by block and reuses every leading block found, up to but excluding the block holding its last
token, which must be computed to yield logits.

Sliding windows (``window``: set where every layer of the model attends to its last
``window`` positions only). A query at position ``p`` reads keys ``p - window + 1`` to ``p``,
and every later query reads later keys, so a block wholly before the next query's window is
never read again: it goes back to the pool (``drop_behind_window``; still in the prefix
cache, as any freed block) and its table entry becomes a hole (``None``; block 0 in
``block_table``). Such blocks are never allocated in the first place where the first
position a request computes already leaves them behind (a long prefix-cache hit takes only
the blocks inside its window; a remote prefill's reservation, ``first_query``, only those its
decoding reads). A request's blocks thus stop growing at about ``window / block_size + 1``
plus its chunk. A prefix hit longer than the window is valid, and needs only the blocks its
next query reads in the cache (a block's chain hash names every token before it), so blocks
evicted, or never held, behind the window do not cut it short (``get_computed_blocks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from phasewise.cache.block_pool import Block, BlockPool, chain_hash


class CacheRequest(Protocol):
    """What the cache needs to know about a request."""

    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


def window_blocks(num_tokens: int, block_size: int, window: int | None) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once to finish, one token
    a step: all of them, or under a sliding ``window`` the window's and the next token's."""
    blocks = -(-num_tokens // block_size)
    if window is None:
        return blocks
    return min(blocks, -(-window // block_size) + 1)


@dataclass
class CachedPrefix:
    """Result of a prefix lookup; pass it back to ``allocate_slots``. Opaque to callers
    except for ``num_tokens``. Under a window, blocks behind it may be holes (None)."""

    blocks: list[Block | None] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached


def dead_blocks(first_query: int, block_size: int, window: int | None) -> int:
    """How many leading blocks no query at position ``first_query`` or later reads (0
    without a window)."""
    if window is None:
        return 0
    return max(0, first_query - window + 1) // block_size


def windowed_hit(cached: Sequence[bool], block_size: int, window: int | None) -> int:
    """How many of a prompt's leading blocks a prefix hit covers, given which of them are
    cached (``cached[i]``: block i's hash is): without a window, the cached run from the
    first; under a ``window`` (positions), the longest m whose blocks a query at position
    m * block_size reads are all cached, whatever became of those behind (a block's hash
    chains every token before it, so it names the same K/V alone). The engine's prefix
    lookup and a router's estimate of it both follow this rule."""
    if window is None:
        m = 0
        while m < len(cached) and cached[m]:
            m += 1
        return m
    run, runs = 0, []  # cached blocks in a row, ending at each block
    for c in cached:
        run = run + 1 if c else 0
        runs.append(run)
    for m in range(len(cached), 0, -1):
        if runs[m - 1] >= m - dead_blocks(m * block_size, block_size, window):
            return m
    return 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.pool = BlockPool(num_blocks)
        # each request's table; None: a block behind its window, given back (see the module)
        self._blocks: dict[str, list[Block | None]] = {}
        # Chain hashes of the request's leading full blocks, computed so far.
        self._hashes: dict[str, list[bytes]] = {}
        # How many of the request's leading blocks are registered in (or found in) the cache.
        self._num_cached: dict[str, int] = {}
        self.stats = CacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def most_blocks(self, num_tokens: int) -> int:
        """``window_blocks`` of this pool's block size and window."""
        return window_blocks(num_tokens, self.block_size, self.window)

    def dead_blocks(self, first_query: int) -> int:
        """How many leading blocks no query at ``first_query`` or later reads (0 without a
        window)."""
        return dead_blocks(first_query, self.block_size, self.window)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids by position (a hole behind its window: 0, never read)."""
        return [b.block_id if b is not None else 0 for b in self._blocks.get(request_id, [])]

    def held_blocks(self, request_id: str) -> int:
        """The blocks the request holds now (its table less its holes)."""
        return sum(1 for b in self._blocks.get(request_id, []) if b is not None)

    def first_held_block(self, request_id: str) -> int:
        """The index of the request's first block not given back (0 without holes)."""
        blocks = self._blocks.get(request_id, [])
        return next((i for i, b in enumerate(blocks) if b is not None), len(blocks))

    def _hash_chain(self, request: CacheRequest, num_blocks: int) -> list[bytes]:
        """Chain hashes of the request's first ``num_blocks`` full blocks (memoized)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, tuple(tokens[i * bs:(i + 1) * bs])))
        return hashes[:num_blocks]

    def get_computed_blocks(self, request: CacheRequest) -> CachedPrefix:
        """Longest cached prefix of a request that has computed nothing yet. Under a window,
        a prefix of m blocks is a hit where the blocks its next query reads are cached (a
        block's hash chains every token before it, so it names the same K/V whatever became
        of the blocks behind it); those behind are holes (None) in the result."""
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return CachedPrefix()
        tokens = request.all_token_ids
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        hashes = self._hash_chain(request, max_blocks)
        found: list[Block | None] = []
        parent = None
        for i, h in enumerate(hashes):
            block = self.pool.lookup(h, parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if block is None and self.window is None:
                break
            found.append(block)
            parent = h
        if self.window is None:
            return CachedPrefix(found, len(found) * bs)
        m = windowed_hit([b is not None for b in found], bs, self.window)
        lo = self.dead_blocks(m * bs)
        return CachedPrefix([None] * lo + found[lo:m], m * bs) if m else CachedPrefix()

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (waiting requests may look up many times)."""
        self.stats.prefix_queries += num_tokens
        self.stats.prefix_hits += num_hit_tokens

    def _plan(self, request: CacheRequest, num_new_tokens: int, prefix: CachedPrefix | None,
              first_query: int | None) -> tuple[int, int, list[Block], int, int]:
        """(first live block, blocks the table will span, the prefix blocks it takes, table
        entries it has with the prefix's, blocks free for it)."""
        done = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        live = self.dead_blocks(done if first_query is None else first_query)
        pre = [b for b in prefix.blocks[live:] if b is not None] if prefix else []
        held = len(self._blocks.get(request.request_id, [])) + (
            len(prefix.blocks) if prefix else 0)
        # Prefix blocks sitting in the free queue stop being free once touched.
        available = self.pool.num_free - sum(1 for b in pre if b.ref_count == 0)
        return live, self.blocks_needed(done + num_new_tokens), pre, held, available

    def can_allocate(self, request: CacheRequest, num_new_tokens: int,
                     prefix: CachedPrefix | None = None, first_query: int | None = None) -> int:
        """Blocks still missing (0 when it fits) to compute ``num_new_tokens`` more tokens
        (``first_query``: see ``allocate_slots``)."""
        live, span, _, held, available = self._plan(request, num_new_tokens, prefix,
                                                     first_query)
        return self._missing(live, span, held, available)

    @staticmethod
    def _missing(live: int, span: int, held: int, available: int) -> int:
        """Blocks a table spanning ``span`` lacks: what it holds (or its holes reach) and
        the free ones cover the rest."""
        return max(0, span - max(held, live) - available)

    def fits_empty_pool(self, request: CacheRequest, num_new_tokens: int,
                        prefix: CachedPrefix | None = None) -> bool:
        """Whether ``allocate_slots`` could take ``num_new_tokens`` were every block free.
        Under a window it may not: a request holds only its window's blocks once computed,
        but the tokens of one step need blocks all at once."""
        live, span, pre, held, _ = self._plan(request, num_new_tokens, prefix, None)
        return span - max(held, live) + len(pre) <= self.num_blocks

    def fit_tokens(self, request: CacheRequest, prefix: CachedPrefix | None = None) -> int:
        """The most tokens the request could compute next (after ``prefix``) with the blocks
        free now: ``allocate_slots`` takes any count up to it."""
        live, _, _, held, available = self._plan(request, 0, prefix, None)
        done = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        return max(0, (max(held, live) + available) * self.block_size - done)

    def max_new_tokens(self, request: CacheRequest) -> int:
        """How many more tokens the request could compute with the blocks free now."""
        have = len(self._blocks.get(request.request_id, []))
        capacity = (have + self.pool.num_free) * self.block_size
        return max(0, capacity - request.num_computed_tokens)

    def allocate_slots(self, request: CacheRequest, num_new_tokens: int,
                       prefix: CachedPrefix | None = None, first_query: int | None = None
                       ) -> bool:
        """Make room to compute ``num_new_tokens`` tokens after the request's computed ones
        (and after ``prefix``, whose blocks it takes a reference on). All or nothing. Under
        a window, blocks behind the window of ``first_query`` (default: the first token
        computed) are left as holes, prefix ones untouched."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if (prefix is None and blocks is not None and first_query is None
                and self.blocks_needed(request.num_computed_tokens + num_new_tokens)
                <= len(blocks)):
            # The table already spans the tokens (a decode inside its last block, most
            # steps): _plan would find nothing missing and nothing to add.
            return True
        live, span, pre, held, available = self._plan(request, num_new_tokens, prefix,
                                                      first_query)
        if self._missing(live, span, held, available):
            return False
        if blocks is None:
            blocks = self._blocks.setdefault(rid, [])
        if prefix and prefix.blocks:
            if blocks:
                raise RuntimeError(f"request {rid} already holds blocks; a prefix must come first")
            self.pool.touch(pre)
            blocks.extend([None] * (len(prefix.blocks) - len(pre)) + pre)
            self._num_cached[rid] = len(prefix.blocks)
        if len(blocks) < live <= span:
            blocks.extend([None] * (live - len(blocks)))
        if span > len(blocks):
            blocks.extend(self.pool.allocate(span - len(blocks)))
        return True

    def drop_behind_window(self, request: CacheRequest) -> int:
        """Give back the request's blocks that lie wholly before the window of its next
        query (at ``num_computed_tokens``); returns how many went back."""
        blocks = self._blocks.get(request.request_id)
        if not blocks or self.window is None:
            return 0
        dead = min(self.dead_blocks(request.num_computed_tokens), len(blocks))
        gone = [b for b in blocks[:dead] if b is not None]
        if gone:
            blocks[:dead] = [None] * dead
            self.pool.free(list(reversed(gone)))  # its head evicted last, as free()'s
        return len(gone)

    def cache_blocks(self, request: CacheRequest) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        bs = self.block_size
        start = self._num_cached.get(rid, 0)
        n_full = min(request.num_computed_tokens, len(request.all_token_ids)) // bs
        if n_full <= start:  # no block filled since the last call (most decode steps)
            return
        blocks = self._blocks.get(rid, [])
        n_full = min(n_full, len(blocks))
        if n_full <= start:
            return
        hashes = self._hash_chain(request, n_full)
        tokens = request.all_token_ids
        for i in range(start, n_full):
            block = blocks[i]
            if block is None:  # behind the window before it was full (a remote prefill's)
                continue
            parent = hashes[i - 1] if i else None
            self.pool.cache(block, hashes[i], parent, tuple(tokens[i * bs:(i + 1) * bs]))
        self._num_cached[rid] = n_full

    def trim(self, request: CacheRequest, num_tokens: int) -> None:
        """Give back the tail blocks past the first ``num_tokens`` tokens' (the slots of
        rejected draft tokens, which no cached block holds)."""
        blocks = self._blocks.get(request.request_id)
        keep = max(self.blocks_needed(num_tokens), self._num_cached.get(request.request_id, 0))
        if blocks and len(blocks) > keep:
            tail = [b for b in blocks[keep:] if b is not None]
            del blocks[keep:]
            self.pool.free(list(reversed(tail)))

    def free(self, request: CacheRequest) -> None:
        """Release every block the request holds (tail first, so its tail is evicted first)."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, [])
        self.pool.free([b for b in reversed(blocks) if b is not None])
        self._num_cached.pop(rid, None)
        self._hashes.pop(rid, None)
