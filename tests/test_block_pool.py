"""Tier 1: the block pool and the KV cache manager, without a model."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.cache.block_pool import BlockPool, chain_hash
from phasewise.cache.manager import KVCacheManager


class Req:
    """The slice of a request the cache reads."""

    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_computed_tokens = 0


def test_allocate_hands_out_lowest_ids_first_and_counts_refs():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert [x.block_id for x in a] == [0, 1]
    assert [x.block_id for x in b] == [2, 3, 4]
    assert all(x.ref_count == 1 for x in a + b)
    assert pool.num_free == 1
    with pytest.raises(RuntimeError, match="only 1 free"):
        pool.allocate(2)


def test_free_order_decides_eviction_order():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free([blocks[3], blocks[1]])
    pool.free([blocks[0]])
    assert pool.free_block_ids() == [3, 1, 0]
    assert [b.block_id for b in pool.allocate(2)] == [3, 1]


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.touch([blk])
    assert blk.ref_count == 2
    pool.free([blk])
    assert pool.num_free == 1 and blk.ref_count == 1
    pool.free([blk])
    assert pool.num_free == 2 and blk.ref_count == 0
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([blk])


def test_touching_a_free_cached_block_takes_it_off_the_queue():
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    assert pool.cache(blk, 123, None, (1, 2))
    pool.free([blk])
    assert blk.block_id in pool.free_block_ids()
    assert pool.lookup(123, None, (1, 2)) is blk
    pool.touch([blk])
    assert blk.block_id not in pool.free_block_ids()
    assert blk.ref_count == 1


def test_reallocating_a_cached_block_evicts_its_hash():
    pool = BlockPool(1)
    (blk,) = pool.allocate(1)
    pool.cache(blk, 7, None, (5,))
    pool.free([blk])
    (again,) = pool.allocate(1)
    assert again is blk
    assert pool.lookup(7, None, (5,)) is None
    assert pool.stats.evictions == 1
    assert blk.block_hash is None


def test_lookup_checks_content_not_only_hash():
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.cache(blk, 99, None, (1, 2, 3))
    assert pool.lookup(99, None, (1, 2, 4)) is None  # same hash, other tokens
    assert pool.lookup(99, 5, (1, 2, 3)) is None  # same tokens, other parent
    assert pool.lookup(99, None, (1, 2, 3)) is blk


# -- the manager ------------------------------------------------------------------------------

def _compute(kv: KVCacheManager, req: Req, n: int, prefix=None) -> None:
    assert kv.allocate_slots(req, n, prefix)
    req.num_computed_tokens += n + (prefix.num_tokens if prefix else 0)
    kv.cache_blocks(req)


def test_block_table_follows_token_positions():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = Req("a", list(range(10)))
    _compute(kv, r, 6)
    assert kv.block_table("a") == [0, 1]
    _compute(kv, r, 3)  # 9 tokens -> 3 blocks
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5


def test_prefix_reuse_shares_full_blocks_and_counts_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = Req("a", list(range(100, 110)))  # 10 tokens: 2 full blocks + 2
    prefix = kv.get_computed_blocks(a)
    assert prefix.num_tokens == 0
    _compute(kv, a, 10, prefix)
    assert kv.block_table("a") == [0, 1, 2]

    b = Req("b", list(range(100, 108)) + [7, 7, 7])  # shares 2 full blocks
    prefix = kv.get_computed_blocks(b)
    assert prefix.num_tokens == 8
    assert [blk.block_id for blk in prefix.blocks] == [0, 1]
    kv.record_prefix_lookup(b.num_computed_tokens + len(b.all_token_ids), prefix.num_tokens)
    _compute(kv, b, 3, prefix)
    assert kv.block_table("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert kv.stats.prefix_hits == 8 and kv.stats.prefix_queries == 11


def test_chained_hash_does_not_match_a_block_after_a_different_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=2)
    a = Req("a", [1, 2, 3, 4, 9])
    _compute(kv, a, 5)
    b = Req("b", [0, 0, 3, 4, 9])  # second block equal, first block differs
    assert kv.get_computed_blocks(b).num_tokens == 0


_HASH_SCRIPT = """
from phasewise.cache.block_pool import chain_hash
h1 = chain_hash(None, (1, 2, 3, 4))
h2 = chain_hash(h1, (5, 6, 7, 8))
print(h1.hex(), h2.hex(), hash("block"))
"""


def _hashes_in_subprocess(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], capture_output=True, text=True,
                         env=env, check=True)
    return out.stdout.split()


def test_block_hashes_are_stable_across_processes():
    a, b = _hashes_in_subprocess("1"), _hashes_in_subprocess("2")
    assert a[:2] == b[:2]  # the chain hashes agree...
    assert a[2] != b[2]  # ...in processes whose salted hash() differs
    assert a[:2] == [chain_hash(None, (1, 2, 3, 4)).hex(),
                     chain_hash(chain_hash(None, (1, 2, 3, 4)), (5, 6, 7, 8)).hex()]


def test_block_hash_is_blake2b_of_parent_and_little_endian_int64_tokens():
    parent = bytes(16)
    want = hashlib.blake2b(parent + struct.pack("<3q", 7, 300, 2**40), digest_size=16).digest()
    assert chain_hash(None, (7, 300, 2**40)) == want
    assert len(want) == 16


def test_different_chains_hash_differently():
    root = chain_hash(None, (1, 2, 3, 4))
    other_root = chain_hash(None, (1, 2, 3, 5))
    assert root != other_root
    assert chain_hash(root, (5, 6)) != chain_hash(other_root, (5, 6))  # same tokens, parents
    assert chain_hash(root, (5, 6)) != chain_hash(root, (6, 5))  # order matters
    assert chain_hash(None, (1,)) != chain_hash(None, (1, 0))  # lengths differ


def test_last_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = Req("a", list(range(8)))
    _compute(kv, a, 8)
    b = Req("b", list(range(8)))  # identical 2-block prompt
    assert kv.get_computed_blocks(b).num_tokens == 4


def test_free_releases_tail_first_and_cached_blocks_survive_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = Req("a", [1, 2, 3, 4, 5, 6, 7])
    _compute(kv, a, 7)
    assert kv.block_table("a") == [0, 1, 2, 3]
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    # Cached prefix still found after the owner left.
    b = Req("b", [1, 2, 3, 4, 5, 6, 0])
    assert kv.get_computed_blocks(b).num_tokens == 6
    # A request needing 2 fresh blocks evicts the tail blocks (3, then 2) first.
    c = Req("c", [9, 9, 9])
    _compute(kv, c, 3)
    assert kv.block_table("c") == [3, 2]
    assert kv.get_computed_blocks(b).num_tokens == 4  # block 2 (tokens 5, 6) was evicted


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = Req("a", list(range(20)))
    assert not kv.allocate_slots(a, 13)  # needs 4 blocks
    assert kv.num_free_blocks == 3 and kv.block_table("a") == []
    assert kv.can_allocate(a, 13) == 1
    assert kv.max_new_tokens(a) == 12
    assert kv.allocate_slots(a, 12)


def test_prefix_blocks_in_the_free_queue_count_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = Req("a", [1, 2, 3, 4, 5])
    _compute(kv, a, 5)
    kv.free(a)  # all 3 blocks free, two of them cached
    b = Req("b", [1, 2, 3, 4, 8, 8, 8, 8])
    prefix = kv.get_computed_blocks(b)
    assert prefix.num_tokens == 4
    # 8 tokens = 4 blocks; 2 come from the prefix, 2 must be new but only 1 is left free.
    assert kv.can_allocate(b, 4, prefix) == 1
    assert not kv.allocate_slots(b, 4, prefix)
    assert all(blk.ref_count == 0 for blk in prefix.blocks)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12), st.booleans()), max_size=40))
def test_ref_counts_always_match_holders(ops):
    """Random allocate/free sequences keep the pool's books consistent."""
    kv = KVCacheManager(num_blocks=12, block_size=3)
    live: dict[str, Req] = {}
    for i, (prefix_id, length, release) in enumerate(ops):
        if release and live:
            rid = sorted(live)[i % len(live)]
            kv.free(live.pop(rid))
            continue
        r = Req(f"r{i}", [prefix_id] * 3 + list(range(length)))
        prefix = kv.get_computed_blocks(r)
        if kv.allocate_slots(r, len(r.all_token_ids) - prefix.num_tokens, prefix):
            r.num_computed_tokens = len(r.all_token_ids)
            kv.cache_blocks(r)
            live[r.request_id] = r
        held: dict[int, int] = {}
        for rid in live:
            for b in kv.block_table(rid):
                held[b] = held.get(b, 0) + 1
        for blk in kv.pool.blocks:
            assert blk.ref_count == held.get(blk.block_id, 0)
        assert kv.num_free_blocks == kv.num_blocks - len(held)


def test_a_pool_of_a_billion_blocks_makes_only_the_blocks_it_hands_out():
    """A simulated accelerator's pool may hold millions of blocks: each is made when first
    handed out, and the queue's order is as for a small pool (never-used ids first, then
    those given back, in the order given)."""
    pool = BlockPool(10**9)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2] and pool.num_free == 10**9 - 3
    pool.free(list(reversed(a)))
    assert pool.num_free == 10**9
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]  # fresh ids before given-back
    assert len(pool.blocks._made) == 5
    small = BlockPool(4)
    blocks = small.allocate(4)
    small.free([blocks[2], blocks[0]])
    assert small.free_block_ids() == [2, 0]
    assert [b.block_id for b in small.allocate(2)] == [2, 0]
    with pytest.raises(RuntimeError, match="only 0 free"):
        small.allocate(1)
