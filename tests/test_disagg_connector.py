"""``PushConnector``, the engine's KV connector, alone: which blocks each step exports, which
arrived blocks it writes or refuses, and what a failed hand-off keeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from phasewise.engine.connector import PushConnector

BS = 4


class Pool:
    """Blocks as a tensor [layers=1, 2, blocks, BS, 1, 1]: what the runner's read/write do."""

    def __init__(self, n: int) -> None:
        self.kv = torch.zeros(1, 2, n, BS, 1, 1)

    def read_blocks(self, ids):
        return self.kv[:, :, list(ids)].clone()

    def write_blocks(self, ids, data):
        self.kv[:, :, list(ids)] = data


def req(rid: str, prompt: int, computed: int):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt,
                           num_computed_tokens=computed)


def test_each_block_is_exported_once_when_full_or_at_the_prompts_end():
    pool = Pool(8)
    pool.kv[:, :, :, :, 0, 0] = torch.arange(8.0).view(1, 1, 8, 1)
    c = PushConnector(pool, BS)
    sent = []
    c.sink = lambda rid, first, end, data: sent.append((rid, first, end,
                                                        data[0, 0, :, 0, 0, 0].tolist()))
    c.export("a", 4)  # the first block was cached on the decode side
    table = {"a": [7, 6, 5, 4]}
    # A chunk of 6 tokens (0..5): block 1 holds 4..5 only, so nothing is sent yet.
    assert c.step_exports([req("a", 14, 0)], [6]) == []
    # The next chunk fills to 10: block 1 (4..7) is full; block 2 (8..9) waits.
    plan = c.step_exports([req("a", 14, 6)], [4])
    c.save(plan, table)
    assert sent == [("a", 4, 8, [6.0])]
    # The last chunk ends the prompt: blocks 2 and 3, the partial last one included.
    c.save(c.step_exports([req("a", 14, 10)], [4]), table)
    assert sent[-1] == ("a", 8, 14, [5.0, 4.0])
    assert not c.exporting and c.request_finished("a") is False
    with pytest.raises(ValueError, match="multiple of the block size"):
        c.export("b", 3)


def test_arrived_blocks_land_in_order_and_foreign_ranges_are_refused():
    pool = Pool(6)
    c = PushConnector(pool, BS)
    c.after_alloc("r", num_prompt_tokens=13, num_cached=4)  # blocks 1..3 come from outside
    assert c.external_tokens("r") == 9
    table = [0, 1, 2, 3]
    ones = torch.ones(1, 2, 1, BS, 1, 1)
    c.start_load("r", 8, 2 * ones, table)  # block 2 before block 1: not yet a prefix
    assert c.loaded_tokens("r") == 4 and c.missing_blocks("r") == [1, 3]
    c.start_load("r", 4, ones, table)
    assert c.loaded_tokens("r") == 12 and not c.load_complete("r")
    for first, n in ((0, 1), (12, 2), (16, 1)):  # the cached block, past the prompt
        with pytest.raises(ValueError, match="outside the prompt's blocks"):
            c.start_load("r", first, torch.ones(1, 2, n, BS, 1, 1), table)
    with pytest.raises(ValueError, match="multiple of the block size"):
        c.start_load("r", 5, ones, table)
    assert pool.kv[0, 0, 0].sum() == 0  # the cached block was never written
    c.start_load("r", 12, 3 * ones, table)
    assert c.load_complete("r") and c.missing_blocks("r") == []
    assert pool.kv[0, 0, 1:4, 0, 0, 0].tolist() == [1.0, 2.0, 3.0]
    c.end_load("r")
    with pytest.raises(ValueError, match="not waiting for remote KV"):
        c.start_load("r", 4, ones, table)
