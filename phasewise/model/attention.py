"""Attention over the paged KV cache for a flat, mixed batch.

Layout of one step's flat batch (built by ``engine.ModelRunner``, relied on here):

* the first ``num_decode_tokens`` tokens are decode tokens, one per request, in the order of
  ``decode_block_tables`` rows;
* after them come the prefill chunks, each a contiguous span described by a ``PrefillSpan``.

KV cache layout, per layer: ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size,
n_kv_heads, head_dim]``. Token ``t`` of a request lives in block ``block_table[t //
block_size]`` at offset ``t % block_size``; its flat *slot* is ``block_id * block_size +
offset``. ``slot_mapping[i]`` is the slot where token ``i`` of the flat batch is written.

A request's attention covers its whole context: the ``context_len`` tokens already in the
cache plus its chunk, causally inside the chunk. In a layer with a sliding window ``W``
(``window``), the query at position ``p`` attends to the keys at ``p - W + 1`` to ``p`` only
(transformers' rule: key ``k`` is seen where ``p - W < k <= p``). Such a layer reads no block
that lies wholly before its queries' windows: the engine may have given those blocks back to
the pool (``KVCacheManager``), and their table entries then name block 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One request's prompt chunk inside the flat batch."""

    start: int  # index of its first token in the flat batch
    end: int  # one past its last token
    context_len: int  # tokens of this request already in the KV cache before this chunk
    block_table: torch.Tensor  # [n_blocks] int64: the blocks of the context and this chunk
    mask: torch.Tensor | None  # [chunk, context_len + chunk] bool (True = attend); None
    # when context_len == 0 (causal within the chunk)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    # [num_decodes, 1, 1, max_blocks * block_size] bool: which keys each decode attends to;
    # None until torch's decode attention first asks (decode_key_mask): the fused CPU layers
    # and the Triton kernels read decode_seq_lens instead
    decode_mask: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64: keys each decode attends to
    prefills: list[PrefillSpan]
    # the longest decode row's keys (0: not known; a windowed layer then assumes its window
    # may bind)
    decode_max_len: int = 0
    # decode_window's tables and masks, by window, built on a windowed layer's first call
    _windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        *,
        chunk_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Build metadata for requests laid out in flat-batch order.

        ``chunk_lens[r]`` tokens of request ``r`` are computed this step on top of its
        ``context_lens[r]`` cached tokens. Requests with a chunk of 1 must come first.
        """
        slots: list[int] = []
        num_decodes = 0
        for r, (n, ctx) in enumerate(zip(chunk_lens, context_lens)):
            if n == 1 and r == num_decodes:
                num_decodes += 1
            table = block_tables[r]
            for pos in range(ctx, ctx + n):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)

        decode_tables = seq_lens = None
        if num_decodes:
            max_blocks = max(len(block_tables[r]) for r in range(num_decodes))
            padded = [block_tables[r] + [0] * (max_blocks - len(block_tables[r]))
                      for r in range(num_decodes)]
            decode_tables = torch.tensor(padded, dtype=torch.int64, device=device)
            seq_lens = torch.tensor([context_lens[r] + 1 for r in range(num_decodes)],
                                    dtype=torch.int64, device=device)

        prefills = []
        start = num_decodes
        for r in range(num_decodes, len(chunk_lens)):
            n, ctx = chunk_lens[r], context_lens[r]
            mask = None
            n_blocks = (ctx + n + block_size - 1) // block_size
            table = torch.tensor(block_tables[r][:n_blocks], dtype=torch.int64, device=device)
            if ctx > 0:
                q_pos = torch.arange(ctx, ctx + n, device=device)
                k_pos = torch.arange(ctx + n, device=device)
                mask = k_pos[None, :] <= q_pos[:, None]
            prefills.append(PrefillSpan(start, start + n, ctx, table, mask))
            start += n
        longest = max((context_lens[r] + 1 for r in range(num_decodes)), default=0)
        return cls(slot_mapping, num_decodes, decode_tables, None, seq_lens, prefills, longest)

    def window_binds(self, window: int | None) -> bool:
        """Whether a layer with this window sees fewer keys than the whole context in some
        decode row (False: the whole-context path computes the same)."""
        return window is not None and (self.decode_max_len == 0
                                       or self.decode_max_len > window)

    def decode_window(self, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' tables and key masks in a layer with sliding window ``window``:
        ``tables`` [num_decodes, width] the blocks from the one holding each row's first
        key in the window (``width`` blocks, enough for any window's keys), and ``mask``
        [num_decodes, 1, 1, width * block_size] which of their keys the row attends to.
        Built on the first call of the step for that window (its layers share it)."""
        got = self._windows.get(window)
        if got is None:
            assert self.decode_block_tables is not None and self.decode_seq_lens is not None
            tables, lens = self.decode_block_tables, self.decode_seq_lens
            starts = (lens - window).clamp(min=0)
            first = starts // block_size
            width = min(tables.shape[1], (window + block_size - 2) // block_size + 1)
            cols = (first[:, None] + torch.arange(width, device=lens.device)).clamp(
                max=tables.shape[1] - 1)
            pos = first[:, None] * block_size + torch.arange(width * block_size,
                                                            device=lens.device)
            mask = (pos >= starts[:, None]) & (pos < lens[:, None])
            got = self._windows[window] = (tables.gather(1, cols), mask[:, None, None, :])
        return got

    def decode_key_mask(self, block_size: int) -> torch.Tensor:
        """``decode_mask``, built on the first call of the step (every layer shares it)."""
        if self.decode_mask is None:
            assert self.decode_block_tables is not None and self.decode_seq_lens is not None
            seq_lens = self.decode_seq_lens
            keys = torch.arange(self.decode_block_tables.shape[1] * block_size,
                                device=seq_lens.device)
            self.decode_mask = (keys[None, :] < seq_lens[:, None])[:, None, None, :]
        return self.decode_mask


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys and values ([num_tokens, n_kv_heads, head_dim]) in their slots."""
    n_kv, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, n_kv, hd).index_copy_(0, slot_mapping, v)


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """Attention of the decode group: q [num_decodes, n_heads, hd] -> same shape. With a
    sliding ``window``, each row gathers only the blocks its window's keys lie in."""
    assert meta.decode_block_tables is not None
    if meta.window_binds(window):
        assert window is not None
        bt, mask = meta.decode_window(window, k_cache.shape[1])
    else:
        bt, mask = meta.decode_block_tables, meta.decode_key_mask(k_cache.shape[1])
    nd, n_heads, hd = q.shape
    n_kv = k_cache.shape[2]
    length = bt.shape[1] * k_cache.shape[1]
    # Gather each request's context: [B, nb, block_size, n_kv, hd] -> [B, n_kv, L, hd]
    kc = k_cache[bt].view(nd, length, n_kv, hd).transpose(1, 2)
    vc = v_cache[bt].view(nd, length, n_kv, hd).transpose(1, 2)
    qd = q.reshape(nd, n_kv, n_heads // n_kv, hd)  # [B, n_kv, group, hd]
    scores = torch.matmul(qd, kc.transpose(-1, -2)).float() * scale  # [B, n_kv, group, L]
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, vc).view(nd, n_heads, hd)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_fn: Callable[..., torch.Tensor] = decode_attention_torch,
    prefill_fn: Callable[..., bool] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention for a flat mixed batch.

    q: [num_tokens, n_heads, head_dim]; k, v: [num_tokens, n_kv_heads, head_dim], already
    written to the cache. ``decode_fn`` computes the decode group (same contract as
    ``decode_attention_torch``). ``prefill_fn(q_span, k_cache, v_cache, span, scale, out,
    window)``, if given, may compute a prefill span's attention from the cache into
    ``out[span]`` and return True; otherwise (False) torch's SDPA does. ``window``: the
    layer's sliding window (None: every query sees its whole context). Returns [num_tokens,
    n_heads, head_dim].
    """
    num_tokens, n_heads, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    nd = meta.num_decode_tokens
    if nd == num_tokens:
        return decode_fn(q, k_cache, v_cache, meta, scale, window)
    out = torch.empty(num_tokens, n_heads, hd, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = decode_fn(q[:nd], k_cache, v_cache, meta, scale, window)

    for span in meta.prefills:
        if prefill_fn is not None and prefill_fn(q[span.start:span.end], k_cache, v_cache,
                                                 span, scale, out, window):
            continue
        qs = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, n_heads, n, hd]
        if window is not None and span.context_len + span.end - span.start > window:
            o = _windowed_prefill(qs, k_cache, v_cache, span, scale, window, group > 1)
        elif span.context_len == 0:
            ks = k[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, n_kv, n, hd]
            vs = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
        else:
            total = span.context_len + (span.end - span.start)
            ks = k_cache[span.block_table].view(-1, n_kv, hd)[:total].transpose(0, 1).unsqueeze(0)
            vs = v_cache[span.block_table].view(-1, n_kv, hd)[:total].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale,
                                               enable_gqa=group > 1)
        out[span.start:span.end] = o[0].transpose(0, 1)
    return out


def _windowed_prefill(qs: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      span: PrefillSpan, scale: float, window: int,
                      gqa: bool) -> torch.Tensor:
    """SDPA of a prompt chunk (qs [1, n_heads, n, hd]) in a layer with a sliding window that
    some of its queries outgrow: the keys from the block holding the first query's first
    key on (the blocks before it may have gone back to the pool), each query masked to its
    window."""
    bs, n_kv, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    ctx, n = span.context_len, span.end - span.start
    key0 = max(0, ctx - window + 1) // bs * bs
    blocks = span.block_table[key0 // bs:]
    keys = ctx + n - key0
    ks = k_cache[blocks].view(-1, n_kv, hd)[:keys].transpose(0, 1).unsqueeze(0)
    vs = v_cache[blocks].view(-1, n_kv, hd)[:keys].transpose(0, 1).unsqueeze(0)
    q_pos = torch.arange(ctx, ctx + n, device=qs.device)[:, None]
    k_pos = torch.arange(key0, ctx + n, device=qs.device)[None, :]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                          enable_gqa=gqa)
