"""Turn a ``ScheduledBatch`` into tensors, run the model, return logits for sampled rows."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from phasewise.engine.cuda_graphs import DecodeGraphs
from phasewise.engine.kv_sizing import block_bytes
from phasewise.engine.request import Request
from phasewise.engine.scheduler import ScheduledBatch, is_decode
from phasewise.model.attention import AttentionMetadata
from phasewise.model.config import ModelConfig
from phasewise.model.transformer import CausalLM

# Prompt logprobs are computed this many positions at a time: [rows, vocab] logits at once,
# never [prompt_len, vocab].
PROMPT_LOGPROB_ROWS = 64


@dataclass
class RunnerOutput:
    requests: list[Request]  # the requests whose chunk reached their last token, in row order
    logits: torch.Tensor  # [sum(rows), vocab] fp32
    rows: list[int]  # logits rows per request: 1, or 1 + its drafts for a verify
    # time.monotonic() just before the model's first call and when it has returned the
    # sampled rows' logits (before any prompt logprobs). The batch's layout and its
    # AttentionMetadata come before the start; a graph step's copy of its inputs into the
    # graphs' buffers falls inside. On CPU every op has finished when the call returns, so
    # forward_end - forward_start is the forward pass's wall time; on CUDA the kernels may
    # still be running then (LLMEngine._forward_s says where their end is seen).
    forward_start: float = 0.0
    forward_end: float = 0.0

    def spans(self) -> list[tuple[Request, int, int]]:
        """Each request with its first logits row and its number of rows."""
        out, row = [], 0
        for req, n in zip(self.requests, self.rows):
            out.append((req, row, n))
            row += n
        return out


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, decode_graphs: str | None = None,
                 max_model_len: int | None = None) -> None:
        """``decode_graphs``: ``"cuda"`` replays decode-only steps from captured CUDA graphs
        (``phasewise.engine.cuda_graphs``); ``"padded"`` runs those steps through the same
        padded static buffers without capture (any device; tests check the padding with
        it); None runs every step eagerly. Either needs ``max_model_len``."""
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        # One allocation for the whole cache: [layers, 2 (k, v), blocks, block_size, kv, hd].
        # Zeroed so that padded (masked) reads never meet NaN garbage. With decode graphs, one
        # block more than the KV manager's: their padded rows' scratch block.
        scratch = 1 if decode_graphs else 0
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks + scratch, block_size, cfg.num_kv_heads,
            cfg.head_dim, dtype=dtype, device=device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1])
                          for i in range(cfg.num_layers)]
        self.graphs: DecodeGraphs | None = None
        if decode_graphs is not None:
            if decode_graphs not in ("cuda", "padded") or max_model_len is None:
                raise ValueError(f"decode_graphs must be 'cuda' or 'padded' with a "
                                 f"max_model_len, or None; got {decode_graphs!r}")
            self.graphs = DecodeGraphs(
                model, self.kv_caches, block_size=block_size,
                max_blocks=-(-max_model_len // block_size), scratch_block=num_blocks,
                device=device, capture=decode_graphs == "cuda")

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks' K/V: [layers, 2, len(block_ids), block_size, kv, hd]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self.kv_cache.index_select(2, idx)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite these blocks' K/V with ``data`` (the layout ``read_blocks`` returns)."""
        want = (*self.kv_cache.shape[:2], len(block_ids), *self.kv_cache.shape[3:])
        if tuple(data.shape) != want:
            raise ValueError(f"KV data has shape {tuple(data.shape)}; these {len(block_ids)} "
                             f"blocks need {want}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, idx, data.to(self.device, self.kv_cache.dtype))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return block_bytes(cfg, block_size, torch.empty((), dtype=dtype).element_size())

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> RunnerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        chunk_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        rows_per_req: list[int] = []
        # (request, its first flat row to score, that row's position, rows): prompt chunks
        # whose positions need their logprobs
        scored: list[tuple[Request, int, int, int]] = []
        for req, n, table in zip(batch.requests, batch.num_tokens, block_tables):
            start = req.num_computed_tokens
            if req.spec_token_ids and is_decode(req, n):
                # A verify: the last sampled token and its drafts, laid out as n decode rows
                # of this request, row j attending to the context and the rows before it
                # (every row's K/V is written before any row attends), so the decode kernels
                # run it; each row's logits say what follows it.
                input_ids += [req.all_token_ids[start], *req.spec_token_ids]
                positions += range(start, start + n)
                chunk_lens += [1] * n
                context_lens += range(start, start + n)
                tables += [table] * n
                sample_rows += range(len(input_ids) - n, len(input_ids))
                sample_reqs.append(req)
                rows_per_req.append(n)
                continue
            if req.needs_prompt_logprobs:
                # Row j (position start + j) scores the prompt token after it (the next
                # chunk's first, for the last row), if not scored yet (a recompute after
                # preemption skips those).
                first = max(start, len(req.prompt_logprobs) - 1)
                last = min(start + n, req.num_prompt_tokens - 1)
                if last > first:
                    scored.append((req, len(input_ids) + first - start, first, last - first))
            input_ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            chunk_lens.append(n)
            context_lens.append(start)
            tables.append(table)
            if start + n == req.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(req)
                rows_per_req.append(1)
        if (self.graphs is not None and not scored and len(sample_rows) == len(input_ids)
                and all(n == 1 for n in chunk_lens)):
            # Decode-only, every row sampled (so rows are in sampling order): a graph's step.
            bs = self.block_size
            slots = [tables[i][p // bs] * bs + p % bs for i, p in enumerate(positions)]
            start = time.monotonic()
            logits = self.graphs.step(input_ids, positions, slots, tables)
            if logits is not None:
                return RunnerOutput(sample_reqs, logits, rows_per_req, start, time.monotonic())
        dev = self.device
        meta = AttentionMetadata.build(
            chunk_lens=chunk_lens, context_lens=context_lens, block_tables=tables,
            block_size=self.block_size, device=dev,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        start = time.monotonic()
        if not scored and len(sample_rows) == len(input_ids):  # every row, in order
            logits = self.model.forward_logits(ids_t, pos_t, self.kv_caches, meta)
            return RunnerOutput(sample_reqs, logits, rows_per_req, start, time.monotonic())
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)  # [T, hidden]
        if len(sample_rows) == hidden.shape[0]:  # every row, in order (a decode-only step)
            logits = self.model.compute_logits(hidden)  # [S, vocab]
        else:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
            logits = self.model.compute_logits(hidden[rows])  # [S, vocab]
        end = time.monotonic()
        for req, row, pos, n in scored:
            self._prompt_logprobs(req, hidden[row:row + n], pos)
        return RunnerOutput(sample_reqs, logits, rows_per_req, start, end)

    def _prompt_logprobs(self, req: Request, hidden: torch.Tensor, pos: int) -> None:
        """Append to ``req.prompt_logprobs`` the entries of the positions ``pos ..`` whose
        hidden states are ``hidden`` (each scores the prompt token after it), in blocks of
        PROMPT_LOGPROB_ROWS rows."""
        top_n = req.params.prompt_logprobs
        n = hidden.shape[0]
        prompt = req.prompt_token_ids
        for b in range(0, n, PROMPT_LOGPROB_ROWS):
            k = min(PROMPT_LOGPROB_ROWS, n - b)
            logits = self.model.compute_logits(hidden[b:b + k]).float()
            lp = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(prompt[pos + b + 1:pos + b + 1 + k], device=lp.device)
            own = lp.gather(1, targets[:, None])[:, 0].tolist()
            tops = torch.topk(lp, top_n) if top_n else None
            for j, (t, v) in enumerate(zip(targets.tolist(), own)):
                entry = {t: v}
                if tops is not None:
                    entry.update(zip(tops.indices[j].tolist(), tops.values[j].tolist()))
                req.prompt_logprobs.append(entry)
