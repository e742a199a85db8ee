"""The decode role's side of a remote prefill (P/D disaggregation): a request whose prompt a
prefill worker computes is admitted with its blocks reserved (``admit``), the K/V the prefill
worker sends is written into them (``load``), and the first token it sampled hands the request
over to decoding (``finish``); ``fail`` computes here whatever did not arrive.

The prefill role needs nothing of this: it runs the request with
``LLMEngine.add_request(..., export_kv_from=...)`` and ``max_tokens=1``, with a ``kv_sink``
that ships each chunk's blocks (``phasewise.engine.connector``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from phasewise.cache.manager import KVCacheManager
from phasewise.engine.connector import PushConnector
from phasewise.engine.request import Request, RequestStatus
from phasewise.engine.sampler import Sampler
from phasewise.engine.scheduler import Scheduler
from phasewise.engine.structured import GrammarCompiler


class RemotePrefills:
    """The requests of an engine (``requests``, shared with it, which ``register`` adds to)
    that wait for K/V from a prefill worker, and what happens to them until they decode."""

    def __init__(self, requests: dict[str, Request], register: Callable[[Request], None],
                 scheduler: Scheduler, kv: KVCacheManager, connector: PushConnector,
                 sampler: Sampler, device: torch.device, vocab_size: int,
                 grammars: Callable[[], GrammarCompiler]) -> None:
        self.requests = requests
        self.register = register
        self.scheduler = scheduler
        self.kv = kv
        self.connector = connector
        self.sampler = sampler
        self.device = device
        self.vocab_size = vocab_size
        self.grammars = grammars  # structured output's compiler, built when first asked for

    def admit(self, req: Request) -> int | None:
        """Reserve ``req``'s blocks; returns the number of prompt tokens the prefix cache
        already holds (the prefill worker sends K/V from there on, or under a sliding window
        from its first decode's window on if that is later), or None when there is no room
        now (nothing is kept then)."""
        hit = self.scheduler.reserve_remote(req)
        if hit is None:
            return None
        self.register(req)
        # under a sliding window, K/V arrives only from the block holding the first key its
        # first decode reads (the prefill worker skips the same blocks: LLMEngine.add_request)
        behind = self.kv.dead_blocks(req.num_prompt_tokens) * self.kv.block_size
        self.connector.after_alloc(req.request_id, req.num_prompt_tokens, max(hit, behind))
        return hit

    def waiting(self, request_id: str) -> Request:
        """The request, which must be waiting for remote K/V; else ValueError."""
        req = self.requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        return req

    def load(self, request_id: str, first_token: int, data: torch.Tensor) -> None:
        """Write K/V sent by the prefill worker: ``data`` ([layers, 2, n, block_size, kv, hd])
        holds the blocks that start at prompt token ``first_token`` (a block boundary).
        Blocks before the local prefix-cache hit are never overwritten."""
        self.waiting(request_id)
        self.connector.start_load(request_id, first_token, data,
                                  self.kv.block_table(request_id))

    def complete(self, request_id: str) -> bool:
        """Whether every block of the request's prompt has arrived."""
        self.waiting(request_id)
        return self.connector.load_complete(request_id)

    def finish(self, request_id: str, token: int,
               logprobs: dict[int, float] | None = None) -> Request:
        """The prefill worker's first sampled token: the request joins the running ones (its
        next step is a decode). Returns the request, its token recorded."""
        req = self.waiting(request_id)
        vocab = self.vocab_size
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"the first token {token!r} of request {request_id!r} is not an id "
                             f"in [0, {vocab})")
        if not self.complete(request_id):
            raise ValueError(f"request {request_id!r} has K/V for "
                             f"{self.connector.loaded_tokens(request_id)} of its "
                             f"{req.num_prompt_tokens} prompt tokens; it cannot decode")
        if req.grammar is not None and not req.grammar.accept(token):
            # a fresh matcher for the local prefill that the caller falls back to
            req.grammar = self.grammars().compile(req.params.structured_output)
            raise ValueError(f"the first token {token} of request {request_id!r} is not one "
                             f"its structured output allows")
        self.connector.end_load(request_id)
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(dict(logprobs))
        self.sampler.skip_draw(req, self.device)
        self.scheduler.remote_prefill_done(req, token)
        return req

    def fail(self, request_id: str) -> int:
        """The remote prefill will not finish: compute the rest of the prompt here. Returns
        the prompt tokens kept (their K/V arrived)."""
        req = self.waiting(request_id)
        kept = self.connector.loaded_tokens(request_id)
        self.connector.end_load(request_id)
        self.scheduler.remote_prefill_failed(req, kept)
        return req.num_computed_tokens
