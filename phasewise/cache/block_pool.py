"""The KV block pool: a fixed set of block ids with ref counts and an LRU free queue.

A block is *free* when no request references it (``ref_count == 0``). A free block may still
hold a cached prefix (it keeps its hash) until it is handed out again, at which point its hash
is dropped: that is an eviction. Free blocks are handed out from the front of the free queue,
so the block freed longest ago is evicted first.

This module never touches tensors: the model writes K/V into the slots of the ids it is given.

Block hashes are stable: the same tokens after the same parent hash to the same 16 bytes in
every process and on every machine (Python's ``hash()`` is salted per process), so block
identities can be compared across processes, e.g. between a prefill and a decode worker.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from phasewise.cache.kv_events import KVEvents

HASH_BYTES = 16
_ROOT = bytes(HASH_BYTES)  # the "parent" of a request's first block


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set while the block is registered in the prefix cache.
        self.block_hash: bytes | None = None
        self.parent_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"Block({self.block_id}, ref={self.ref_count}, hash={h})"


def chain_hash(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Hash of a full block: its tokens chained to the hash of the block before it.

    BLAKE2b with a 16-byte digest over the parent's 16-byte hash (16 zero bytes for a
    request's first block) followed by the token ids as little-endian signed 64-bit integers.
    """
    h = hashlib.blake2b(parent_hash if parent_hash is not None else _ROOT,
                        digest_size=HASH_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass
class PoolStats:
    evictions: int = 0


class _Blocks:
    """The pool's blocks by id, each made when first asked for: a pool of millions of
    blocks (a simulated accelerator's) costs nothing until its blocks are used."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._made: dict[int, Block] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Block:
        if not 0 <= i < self._n:
            raise IndexError(f"block {i} of a pool of {self._n}")
        block = self._made.get(i)
        if block is None:
            block = self._made[i] = Block(i)
        return block

    def __iter__(self):
        return (self[i] for i in range(self._n))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = _Blocks(num_blocks)
        # The free queue in eviction order (front = next handed out): the ids never handed
        # out (from _fresh up, in order), then the blocks given back (values unused). A block
        # given back joins the back, behind every fresh id, so the fresh ids are always the
        # queue's front, and need no entry of their own.
        self._fresh = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, Block] = {}
        self.stats = PoolStats()
        # What the prefix cache stored and evicted, for a router's index of who holds what.
        self.events = KVEvents()

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they would be handed out."""
        return [*range(self._fresh, self.num_blocks), *self._free]

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` free blocks (ref count 1 each), evicting cached contents they held."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free} free")
        out = []
        for _ in range(n):
            if self._fresh < self.num_blocks:
                block_id = self._fresh
                self._fresh += 1
            else:
                block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)
                self.stats.evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Add a reference to each block (a prefix-cache hit), taking free ones off the queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue's back in
        the order given (so pass a request's blocks tail first: its tail is evicted first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def lookup(self, block_hash: bytes, parent_hash: bytes | None,
               token_ids: tuple[int, ...]) -> Block | None:
        """The cached block with exactly this content and parent, or None."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def cache(self, block: Block, block_hash: bytes, parent_hash: bytes | None,
              token_ids: tuple[int, ...]) -> bool:
        """Register a full block under its hash; False if an equal block is already cached."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block
        self.events.stored(block_hash)
        return True

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        self.events.evicted(block.block_hash)
        block.block_hash, block.parent_hash, block.token_ids = None, None, ()
