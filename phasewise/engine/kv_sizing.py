"""How many KV blocks an engine's pool holds, and the context length they allow.

The pool is sized from ``EngineConfig``: an exact block count (``num_kv_blocks``), a memory
budget (``kv_cache_memory``), 1 GiB on CPU, or on CUDA 90% of the memory the weights leave
free. It never holds more than ``max_num_seqs`` full-length sequences could use (under a
sliding window shared by every layer, a sequence holds only its window's blocks:
``phasewise.cache.manager.window_blocks``). Where the
size is known before the weights load, the sizes are settled first, so a context that cannot
fit fails before minutes of loading. Pure arithmetic, torch-free: the caller measures free
memory and names the K/V element size (``block_bytes``). The simulator (``phasewise simulate``
and ``plan``) sizes its engines' pools with these same functions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Protocol

from phasewise.cache.manager import window_blocks
from phasewise.config import EngineConfig, parse_memory

DEFAULT_CPU_KV_MEMORY = 1 << 30
DEFAULT_BLOCK_SIZE = EngineConfig.block_size  # (the dataclass field's default)
CUDA_FREE_FRACTION = 0.9  # of the memory free after the weights; the rest: a step's activations


class KVShape(Protocol):
    """What one block's bytes depend on (a ``ModelConfig``, or the perf room's ``ModelShape``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class ContextLimits(Protocol):
    """What the sizing reads of a model besides its K/V shape. A ``ModelConfig`` has it; the
    simulator builds one for a model it knows only by its shape. ``kv_window``: the sliding
    window every layer attends within (None: some layer reads the whole context), which
    bounds the blocks a sequence holds at once."""

    architecture: str
    max_position_embeddings: int

    @property
    def kv_window(self) -> int | None: ...


def block_bytes(shape: KVShape, block_size: int, element_size: int) -> int:
    """One block's K and V over all layers, at ``element_size`` bytes an element (the
    engine's dtype: 4 for float32, 2 for bfloat16 and float16); only the KV heads are
    stored (GQA)."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element_size * block_size


@dataclass(frozen=True)
class KVPlan:
    """The pool's size in blocks and the context length it allows. ``num_blocks`` is None
    while it waits for the memory the weights leave (CUDA without a budget: ``on_free``)."""

    num_blocks: int | None
    max_model_len: int
    block_bytes: int
    # every sequence at full length, plus one block: the pool must hold max_len + 1 tokens
    # (see fit_context), which a single full-length sequence would otherwise miss
    most_blocks: int

    @classmethod
    def plan(cls, config: EngineConfig, mc: ContextLimits, block_bytes: int,
             device_type: str) -> KVPlan:
        """The sizes known before the weights load (``block_bytes``: one block's K and V
        over all layers)."""
        max_len = config.max_model_len or mc.max_position_embeddings
        if config.max_model_len and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({mc.max_position_embeddings})")
        # A block holds one sequence's tokens: one longer than any sequence only wastes the
        # pool (the default's, under a context shorter than it, wastes little)
        if config.block_size > max(max_len, DEFAULT_BLOCK_SIZE):
            raise ValueError(f"block_size {config.block_size} exceeds the context length "
                             f"{max_len}: no sequence could fill a block; choose a block_size "
                             f"of {max(max_len, DEFAULT_BLOCK_SIZE)} or less")
        most = config.max_num_seqs * window_blocks(max_len, config.block_size, mc.kv_window) + 1
        num_blocks: int | None
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory is not None:
            num_blocks = min(most, parse_memory(config.kv_cache_memory) // block_bytes)
        elif device_type == "cpu":
            num_blocks = min(most, DEFAULT_CPU_KV_MEMORY // block_bytes)
        else:
            num_blocks = None  # CUDA: decided from the memory left after the weights
        if num_blocks is not None:
            max_len = fit_context(num_blocks, max_len, config, mc, block_bytes)
        return cls(num_blocks, max_len, block_bytes, most)

    def on_free(self, free_bytes: int, config: EngineConfig, mc: ContextLimits) -> KVPlan:
        """The plan once the weights are in: a pool still unsized takes its share of
        ``free_bytes``; a sized one is kept as it is."""
        if self.num_blocks is not None:
            return self
        share = int(free_bytes * CUDA_FREE_FRACTION)
        num_blocks = min(self.most_blocks, share // self.block_bytes)
        return replace(self, num_blocks=num_blocks, max_model_len=fit_context(
            num_blocks, self.max_model_len, config, mc, self.block_bytes))


def host_memory_available() -> int | None:
    """Bytes this process could still allocate without swapping or being killed: Linux's
    MemAvailable, or less where a cgroup (a container's limit, a Kubernetes pod's) leaves
    less; None where it cannot tell."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    # cgroup v2, then v1: the limit less what the group uses already
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f:
                text = f.read().strip()
            if text == "max":
                continue
            with open(usage) as f:
                found.append(max(0, int(text) - int(f.read().strip())))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def check_host_memory(plan: KVPlan, config: EngineConfig,
                      available: int | None = None) -> None:
    """Refuse a pool in host memory that the user sized (``num_kv_blocks`` or
    ``kv_cache_memory``) past the memory this machine has free (``available``, default
    ``host_memory_available()``), before anything is allocated: such a pool would otherwise
    fail deep in an allocation, or take the machine's memory page by page as it fills."""
    if plan.num_blocks is None or (config.num_kv_blocks is None
                                   and config.kv_cache_memory is None):
        return
    avail = host_memory_available() if available is None else available
    need = plan.num_blocks * plan.block_bytes
    if avail is None or need <= avail:
        return
    given = (f"num_kv_blocks {config.num_kv_blocks}" if config.num_kv_blocks is not None
             else f"kv_cache_memory {config.kv_cache_memory}")
    raise ValueError(f"{given} asks for a KV cache of {plan.num_blocks} blocks of "
                     f"{plan.block_bytes} bytes ({need / 2**30:.1f} GiB), more than the "
                     f"{avail / 2**30:.1f} GiB this machine has available; at most "
                     f"{avail // plan.block_bytes} blocks fit")


def fit_context(num_blocks: int, max_len: int, config: EngineConfig, mc: ContextLimits,
                block_bytes: int) -> int:
    """Check the pool against the context length (lowering a default one to fit); returns
    max_model_len. Under a sliding window every layer shares, a sequence needs only its
    window's blocks, so the context may exceed the pool."""
    bs = config.block_size
    if num_blocks < 1:
        raise ValueError("the KV cache budget holds no block of "
                         f"{block_bytes} bytes; raise kv_cache_memory")
    capacity = num_blocks * bs
    if window_blocks(max_len + 1, bs, mc.kv_window) <= num_blocks:
        return max_len
    if capacity - 1 < max_len:
        w = mc.kv_window
        if config.max_model_len and w is not None and w < max_len:
            need = window_blocks(max_len + 1, bs, w)
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {bs} tokens, too few for one "
                f"sequence of this model: its {w}-token sliding window needs {need} blocks at "
                f"once; raise kv_cache_memory to {need} blocks or more")
        if config.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {bs}), too few "
                f"for max_model_len {max_len}; raise kv_cache_memory or lower max_model_len")
        max_len = capacity - 1
    return max_len
