"""Decode steps replayed from captured CUDA graphs.

A decode step of a large model launches hundreds of small kernels (about 35 per layer here);
at batch 1 the GPU finishes each faster than Python can launch the next, so an eager step
runs at the host's pace, not the memory's. A CUDA graph records one step's launches once and
replays them with a single call.

A graph fixes its tensors' shapes and addresses, so this runner keeps *static* input buffers
and captures one graph per (batch bucket, block-table width bucket):

* the batch is padded up to the next of ``BATCH_BUCKETS``; a padded row reads token 0 at
  position 0, writes its K/V to the runner's *scratch block* (a block the KV manager never
  hands out) and attends to that one slot, so it touches no request's cache;
* the block tables are padded up to the next power of two of blocks (at least
  ``MIN_TABLE_BLOCKS``) with the scratch block; the attention mask, built inside the graph
  from ``seq_lens``, hides every key past a row's length.

Rows are what ``ModelRunner`` lays out for a decode-only step: one per decode request, or
``1 + drafts`` per speculative verify (each a decode row attending to the rows before it).
Graphs are captured lazily, the first time a bucket is met (tens of milliseconds each), and
share one memory pool; a replay's logits are copied out before the next replay can reuse the
pool's memory.

On CPU (``capture=False``) the same padded, static-buffer step runs eagerly: tests use this
to check the padding against the unpadded path without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from phasewise.model.attention import AttentionMetadata
from phasewise.model.transformer import CausalLM

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
CUDA_GRAPH_MAX_BATCH = BATCH_BUCKETS[-1]
MIN_TABLE_BLOCKS = 16
# Padded keys a graph's attention may gather in all (batch bucket x table width x block
# size) where the decode attention copies each row's padded context (torch's; not the Triton
# kernel's, which walks the block tables): beyond this a graph would move more K/V than the
# step's real context warrants, so such steps run eagerly.
MAX_GRAPH_KEYS = 1 << 18


def batch_bucket(n: int) -> int | None:
    """The smallest bucket holding ``n`` rows, or None past the largest."""
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return None


def table_bucket(blocks: int) -> int:
    """Block-table width for a step whose longest row needs ``blocks`` blocks."""
    width = MIN_TABLE_BLOCKS
    while width < blocks:
        width *= 2
    return width


class DecodeGraphs:
    """Static buffers and captured graphs for decode-only steps of one model and KV cache."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                 block_size: int, max_blocks: int, scratch_block: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_width = table_bucket(max_blocks)
        self.scratch_block = scratch_block
        self.device = device
        self.capture = capture
        self.max_batch = b = CUDA_GRAPH_MAX_BATCH
        # Every input in one buffer, so a step's inputs cross to the device in one copy:
        # [ids | positions | slots | seq_lens] (b each), then the block table of the step's
        # (rows, width) bucket as a contiguous [rows, width] (each graph holds its own view).
        self.packed = torch.zeros(4 * b + b * self.max_width, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = (
            self.packed[i * b:(i + 1) * b] for i in range(4))
        self.key_pos = torch.arange(self.max_width * block_size, device=device)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served by a graph (or, without capture, by the padded path)

    def bucket(self, num_rows: int, blocks: int) -> tuple[int, int] | None:
        """(batch, width) of the graph a step of ``num_rows`` rows whose longest row needs
        ``blocks`` blocks would run, or None when it should run eagerly."""
        b = batch_bucket(num_rows)
        if b is None or blocks > self.max_width:
            return None
        width = table_bucket(blocks)
        padded_keys = b * width * self.block_size
        if self.model.ops.decode_attention_gathers and padded_keys > MAX_GRAPH_KEYS:
            return None
        return b, width

    def step(self, input_ids: list[int], positions: list[int], slots: list[int],
             tables: list[list[int]]) -> torch.Tensor | None:
        """Logits ([len(input_ids), vocab] fp32) of a decode-only step, or None when no
        graph bucket takes it (the caller then runs it eagerly).

        Row ``i`` holds token ``input_ids[i]`` at ``positions[i]``, writes its K/V to slot
        ``slots[i]`` and attends to the first ``positions[i] + 1`` tokens of ``tables[i]``.
        """
        bs = self.block_size
        seq_lens = [p + 1 for p in positions]
        blocks = max(-(-s // bs) for s in seq_lens)
        key = self.bucket(len(input_ids), blocks)
        if key is None:
            return None
        b, width = key
        n = len(input_ids)
        scratch = self.scratch_block
        pad = b - n
        big = self.max_batch
        flat = (input_ids + [0] * (big - n) + positions + [0] * (big - n)
                + slots + [scratch * bs] * (big - n) + seq_lens + [1] * (big - n))
        for t, s in zip(tables, seq_lens):
            used = -(-s // bs)
            flat += t[:used]
            flat += [scratch] * (width - used)
        flat += [scratch] * (width * pad)
        self.packed[:len(flat)].copy_(torch.tensor(flat, dtype=torch.long), non_blocking=True)
        self.replays += 1
        if not self.capture:
            return self._forward(b, width)[:n]
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(b, width)
        graph, logits = entry
        graph.replay()
        return logits[:n].clone()  # the pool's memory is another graph's on the next replay

    def _forward(self, b: int, width: int) -> torch.Tensor:
        """One padded step on the static buffers: logits [b, vocab] fp32."""
        seq_lens = self.seq_lens[:b]
        keys = self.key_pos[:width * self.block_size]
        tables = self.packed[4 * self.max_batch:4 * self.max_batch + b * width].view(b, width)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], num_decode_tokens=b,
            decode_block_tables=tables,
            decode_mask=(keys[None, :] < seq_lens[:, None])[:, None, None, :],
            decode_seq_lens=seq_lens, prefills=[])
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    def _capture(self, b: int, width: int) -> tuple[Any, torch.Tensor]:
        """Warm up on a side stream (as torch requires before capture), then record. The
        warm-up runs write the current step's K/V to its slots: the same values the replay
        writes, so they change nothing."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(b, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads (P/D transport, the event loop) may touch
        # CUDA while this engine thread captures; only this thread's calls must be capturable
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(b, width)
        return graph, logits
