"""The KV block pool: allocation, ref counts, prefix-cache hashing, usage stats."""

from phasewise.cache.block_pool import Block, BlockPool
from phasewise.cache.manager import CachedPrefix, KVCacheManager

__all__ = ["Block", "BlockPool", "CachedPrefix", "KVCacheManager"]
