"""Per-request KV block bookkeeping on top of the ``BlockPool``, with prefix caching.

Block-table layout: request token ``t`` (0-based, over prompt then outputs) lives in
``block_table[t // block_size]`` at offset ``t % block_size``. The table grows at the end as
tokens are computed; it is released whole when the request finishes or is preempted.

Prefix caching: a *full* block whose tokens have all been computed is registered under a chain
hash of (hash of the previous block, its own token ids); see ``block_pool.chain_hash`` (stable
across processes). A new request walks its tokens block
by block and reuses every leading block found, up to but excluding the block holding its last
token, which must be computed to yield logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from phasewise.cache.block_pool import Block, BlockPool, chain_hash


class CacheRequest(Protocol):
    """What the cache needs to know about a request."""

    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass
class CachedPrefix:
    """Result of a prefix lookup; pass it back to ``allocate_slots``. Opaque to callers
    except for ``num_tokens``."""

    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[Block]] = {}
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

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

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
        """Longest cached prefix of a request that has computed nothing yet."""
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return CachedPrefix()
        tokens = request.all_token_ids
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        hashes = self._hash_chain(request, max_blocks)
        found: list[Block] = []
        parent = None
        for i, h in enumerate(hashes):
            block = self.pool.lookup(h, parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if block is None:
                break
            found.append(block)
            parent = h
        return CachedPrefix(found, len(found) * bs)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (waiting requests may look up many times)."""
        self.stats.prefix_queries += num_tokens
        self.stats.prefix_hits += num_hit_tokens

    def can_allocate(self, request: CacheRequest, num_new_tokens: int,
                     prefix: CachedPrefix | None = None) -> int:
        """Blocks still missing (0 when it fits) to compute ``num_new_tokens`` more tokens."""
        have = self._blocks.get(request.request_id, [])
        pre = prefix.blocks if prefix else []
        total = request.num_computed_tokens + (prefix.num_tokens if prefix else 0) + num_new_tokens
        need = self.blocks_needed(total) - len(have) - len(pre)
        # Prefix blocks sitting in the free queue stop being free once touched.
        available = self.pool.num_free - sum(1 for b in pre if b.ref_count == 0)
        return max(0, need - available)

    def max_new_tokens(self, request: CacheRequest) -> int:
        """How many more tokens the request could compute with the blocks free now."""
        have = len(self._blocks.get(request.request_id, []))
        capacity = (have + self.pool.num_free) * self.block_size
        return max(0, capacity - request.num_computed_tokens)

    def allocate_slots(self, request: CacheRequest, num_new_tokens: int,
                       prefix: CachedPrefix | None = None) -> bool:
        """Make room to compute ``num_new_tokens`` tokens after the request's computed ones
        (and after ``prefix``, whose blocks it takes a reference on). All or nothing."""
        if self.can_allocate(request, num_new_tokens, prefix):
            return False
        rid = request.request_id
        blocks = self._blocks.setdefault(rid, [])
        if prefix and prefix.blocks:
            if blocks:
                raise RuntimeError(f"request {rid} already holds blocks; a prefix must come first")
            self.pool.touch(prefix.blocks)
            blocks.extend(prefix.blocks)
            self._num_cached[rid] = len(prefix.blocks)
        total = request.num_computed_tokens + (prefix.num_tokens if prefix else 0) + num_new_tokens
        need = self.blocks_needed(total) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def cache_blocks(self, request: CacheRequest) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self._blocks.get(rid, [])
        bs = self.block_size
        n_full = min(min(request.num_computed_tokens, len(request.all_token_ids)) // bs,
                     len(blocks))
        start = self._num_cached.get(rid, 0)
        if n_full <= start:
            return
        hashes = self._hash_chain(request, n_full)
        tokens = request.all_token_ids
        for i in range(start, n_full):
            parent = hashes[i - 1] if i else None
            self.pool.cache(blocks[i], hashes[i], parent, tuple(tokens[i * bs:(i + 1) * bs]))
        self._num_cached[rid] = n_full

    def trim(self, request: CacheRequest, num_tokens: int) -> None:
        """Give back the tail blocks past the first ``num_tokens`` tokens' (the slots of
        rejected draft tokens, which no cached block holds)."""
        blocks = self._blocks.get(request.request_id)
        keep = max(self.blocks_needed(num_tokens), self._num_cached.get(request.request_id, 0))
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free(list(reversed(tail)))

    def free(self, request: CacheRequest) -> None:
        """Release every block the request holds (tail first, so its tail is evicted first)."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, [])
        self.pool.free(list(reversed(blocks)))
        self._num_cached.pop(rid, None)
        self._hashes.pop(rid, None)
