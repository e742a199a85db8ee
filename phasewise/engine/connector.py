"""The KV connector: how K/V computed elsewhere enters this engine's pool, and how K/V computed
here leaves it. Modelled on vLLM v1's KV connector (a scheduler side and a worker side);
phasewise's own ``PushConnector`` implements it for "decode reserves, prefill pushes"
(``docs/pd.md``). ``LLMEngine`` holds one and calls it; the transport (sockets, frames, peers:
``phasewise.disagg.transport`` and ``worker``, a room above this one) talks to the engine
through ``AsyncEngine``'s commands. Like ``phasewise.disagg.wire``, this module imports neither
torch nor pyzmq (tensors are duck-typed).

The two sides, and the vLLM v1 call each one answers:

Scheduler side (the engine calls it around admission and each step):

* ``external_tokens(rid)``: how many prompt tokens will arrive from outside
  (``get_num_new_matched_tokens``);
* ``after_alloc(rid, num_prompt_tokens, num_cached)``: the state once the scheduler reserved
  the request's blocks (``update_state_after_alloc``);
* ``step_exports(requests, num_tokens)``: the per-step metadata, which blocks each exporting
  request's chunk fills this step (``build_connector_meta``);
* ``request_finished(rid)``: whether the blocks must outlive the request. Pushing never needs
  it (``request_finished``'s delay-free flag is always False): once sent, a prefill worker's
  blocks are ordinary evictable prefix-cache blocks.

Worker side (the engine calls it with K/V that arrived, and after each forward pass):

* ``start_load(rid, first_token, data, block_table)``: write arrived blocks into the pool
  (``start_load_kv``). A request waiting for remote K/V is never scheduled
  (``RequestStatus.WAITING_FOR_REMOTE_KV``) until ``load_complete``, so there is no
  per-layer wait (``wait_for_layer_load``): loads are whole blocks of every layer;
* ``save(exports, block_tables)``: after the forward pass, hand the blocks it wrote to the sink
  (``save_kv_layer`` for all layers at once, then ``wait_for_save``: the sink copies);
* ``load_complete(rid)``: whether every block of the prompt is in (``get_finished``'s
  receiving side; the sending side is the sink's business);
* ``loaded_tokens(rid)`` and ``missing_blocks(rid)``: the leading prompt tokens whose K/V
  is in, and which blocks never came (``get_block_ids_with_load_errors``): a failed
  hand-off keeps the first and recomputes the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Export:
    """Blocks ``first_block .. last_block - 1`` of a request now hold its prompt's K/V for
    tokens ``first_token .. end - 1``."""

    request_id: str
    first_token: int
    end: int
    first_block: int
    last_block: int


class BlockIO(Protocol):
    """What a connector needs of the model runner: read and write whole blocks."""

    def read_blocks(self, block_ids: Sequence[int]) -> Any: ...

    def write_blocks(self, block_ids: Sequence[int], data: Any) -> None: ...


@dataclass
class _Incoming:
    num_prompt_tokens: int
    num_cached: int
    loaded: int  # leading prompt tokens whose K/V is in
    blocks: set[int]  # block indices received


class PushConnector:
    """Decode reserves, prefill pushes (see the module).

    The decode role: ``after_alloc`` then ``start_load`` per arrived frame. The prefill role:
    ``export(rid, from_token)`` then, each step, ``step_exports`` and ``save``, which calls
    ``sink(request_id, first_token, end, data)``: each block once, when it is full or holds
    the end of the prompt."""

    def __init__(self, io: BlockIO, block_size: int) -> None:
        self.io = io
        self.block_size = block_size
        self.sink: Callable[[str, int, int, Any], None] | None = None
        self._exports: dict[str, int] = {}  # id -> first prompt token not yet sent
        self._incoming: dict[str, _Incoming] = {}

    # -- scheduler side --------------------------------------------------------------------
    def after_alloc(self, request_id: str, num_prompt_tokens: int, num_cached: int) -> None:
        self._incoming[request_id] = _Incoming(num_prompt_tokens, num_cached, num_cached,
                                               set())

    def external_tokens(self, request_id: str) -> int:
        inc = self._incoming[request_id]
        return inc.num_prompt_tokens - inc.num_cached

    def export(self, request_id: str, from_token: int) -> None:
        if from_token < 0 or from_token % self.block_size:
            raise ValueError(f"export_kv_from must be a multiple of the block size "
                             f"({self.block_size}), got {from_token}")
        self._exports[request_id] = from_token

    @property
    def exporting(self) -> bool:
        return bool(self._exports)

    def step_exports(self, requests: Sequence[Any], num_tokens: Sequence[int]) -> list[Export]:
        """Before the step's counts advance: the blocks each exporting request's chunk
        fills. A partly filled block waits until it is full, or holds the prompt's end."""
        bs = self.block_size
        out = []
        for req, n in zip(requests, num_tokens):
            start = self._exports.get(req.request_id)
            if start is None:
                continue
            end = min(req.num_computed_tokens + n, req.num_prompt_tokens)
            if end < req.num_prompt_tokens:
                end = (end // bs) * bs
            if end <= start:
                continue
            out.append(Export(req.request_id, start, end, start // bs, -(-end // bs)))
            if end == req.num_prompt_tokens:
                del self._exports[req.request_id]
            else:
                self._exports[req.request_id] = end
        return out

    def end_load(self, request_id: str) -> None:
        """The hand-off is over (decoding on, or computing the rest here)."""
        self._incoming.pop(request_id, None)

    def request_finished(self, request_id: str) -> bool:
        """Forget the request; True would ask the engine to keep its blocks (never here)."""
        self._exports.pop(request_id, None)
        self._incoming.pop(request_id, None)
        return False

    # -- worker side -----------------------------------------------------------------------
    def start_load(self, request_id: str, first_token: int, data: Any,
                   block_table: Sequence[int]) -> None:
        """Write arrived K/V (``data``: [layers, 2, n, block_size, kv heads, head dim]) for the
        blocks from prompt token ``first_token`` on. Blocks before the local prefix-cache
        hit, or past the prompt, are refused (ValueError), never written."""
        inc = self._incoming.get(request_id)
        if inc is None:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        bs = self.block_size
        if first_token % bs:
            raise ValueError(f"first_token {first_token} is not a multiple of the block size "
                             f"{bs}")
        n = data.shape[2] if data.dim() == 6 else -1
        first_block = first_token // bs
        last_block = -(-inc.num_prompt_tokens // bs)  # blocks the prompt occupies
        if n < 1 or first_token < inc.num_cached or first_block + n > last_block:
            raise ValueError(f"KV blocks {first_block}..{first_block + n - 1} are outside "
                             f"the prompt's blocks {inc.num_cached // bs}..{last_block - 1} "
                             f"of request {request_id!r}")
        self.io.write_blocks(block_table[first_block:first_block + n], data)
        inc.blocks.update(range(first_block, first_block + n))
        while inc.loaded < inc.num_prompt_tokens and inc.loaded // bs in inc.blocks:
            inc.loaded = min(inc.num_prompt_tokens, (inc.loaded // bs + 1) * bs)

    def save(self, exports: Sequence[Export], block_tables: dict[str, Sequence[int]]) -> None:
        """After the forward pass wrote them: each export's blocks to the sink."""
        if self.sink is None:
            return
        for e in exports:
            table = block_tables[e.request_id]
            self.sink(e.request_id, e.first_token, e.end,
                      self.io.read_blocks(table[e.first_block:e.last_block]))

    def load_complete(self, request_id: str) -> bool:
        inc = self._incoming[request_id]
        return inc.loaded >= inc.num_prompt_tokens

    def loaded_tokens(self, request_id: str) -> int:
        return self._incoming[request_id].loaded

    def missing_blocks(self, request_id: str) -> list[int]:
        """The prompt's block indices (past the local hit) that have not arrived."""
        inc = self._incoming[request_id]
        bs = self.block_size
        return [b for b in range(inc.num_cached // bs, -(-inc.num_prompt_tokens // bs))
                if b not in inc.blocks]
