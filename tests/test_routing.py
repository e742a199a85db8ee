"""Cache-aware routing: the router's index of who holds which prompt blocks, the workers'
reports that keep it true, and the policies that read it (exact, with fake workers)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.cache.kv_events import KVEvents
from phasewise.cache.manager import KVCacheManager
from phasewise.disagg.prefix_index import WorkerBlocks, block_hashes, rank

BS = 4


class CacheRequest:
    """What KVCacheManager reads of a request."""

    def __init__(self, rid, tokens):
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_computed_tokens = 0


def test_the_router_hashes_a_prompt_as_the_workers_cache_does():
    kv = KVCacheManager(32, BS, True)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks
    req = CacheRequest("a", prompt)
    assert kv.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_blocks(req)
    ev = kv.pool.events.since(None, None)
    stored = {bytes.fromhex(h) for h in ev["held"]}
    mine = block_hashes(prompt, BS)
    # A worker never serves a prompt's last token from cache: (18 - 1) // 4 = 4 blocks.
    assert len(mine) == 4
    assert set(mine) <= stored


def test_a_workers_events_carry_stores_and_evictions_in_order_and_reset_when_behind():
    ev = KVEvents(capacity=4)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    first = ev.since(None, None)  # a new reader: everything held (nothing yet)
    assert first["held"] == [] and first["next"] == 0
    ev.stored(a)
    ev.stored(b)
    ev.evicted(a)
    got = ev.since(0, first["epoch"])
    assert got["events"] == [["s", a.hex()], ["s", b.hex()], ["e", a.hex()]]
    assert got["next"] == 3
    for _ in range(4):  # the log holds 4: a reader at 3 is still in reach, one at 0 is not
        ev.stored(c)
    assert "events" in ev.since(3, first["epoch"])
    behind = ev.since(0, first["epoch"])
    assert set(behind["held"]) == {b.hex(), c.hex()}
    # another incarnation of the worker (a restart): its epoch differs, so a full reset
    assert "held" in ev.since(3, "not-this-one")
    assert "held" in ev.since(99, first["epoch"])  # a sequence it never had


def test_the_index_follows_the_reports_and_forgets_evicted_blocks():
    wb = WorkerBlocks()
    h = block_hashes(list(range(40)), BS)
    wb.enter(h[:5])  # routed there: it will hold them
    assert wb.held(h) == 5
    wb.report({"epoch": "e1", "next": 2, "events": [["e", h[2].hex()], ["s", h[7].hex()]]})
    assert wb.held(h) == 2  # the chain breaks at the evicted block
    assert (wb.epoch, wb.next) == ("e1", 2)
    wb.report({"epoch": "e2", "next": 0, "held": [x.hex() for x in h[:3]]})
    assert wb.held(h) == 3 and len(wb.blocks) == 3


def _load_reply(**snapshot_over):
    snap = {"num_running": 1, "num_waiting": 0, "kv_usage": 0.5, "num_free_blocks": 5,
            "num_blocks": 10, "num_preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}
    return {"role": "both", "alive": True, "draining": False, "open_groups": 1,
            "snapshot": {**snap, **snapshot_over}}


@pytest.mark.parametrize("over,field", [
    ({"num_running": "x"}, "num_running"), ({"num_waiting": -10 ** 18}, "num_waiting"),
    ({"num_waiting": 10 ** 400}, "num_waiting"), ({"kv_usage": float("nan")}, "kv_usage"),
    ({"kv_usage": 7}, "kv_usage"), ({"num_blocks": True}, "num_blocks")])
def test_a_workers_load_reply_is_checked_field_by_field(over, field):
    """A worker's /load with num_running "x" made every request through the router a 500
    and cut the streams on its other workers; a huge or negative count skewed routing and
    broke /metrics. Each is refused, naming the field (the worker is then down)."""
    import json

    from phasewise.disagg.router import _read_load

    load = _read_load(json.dumps(_load_reply()).encode(), None)
    assert (load.snapshot.num_running, load.open_groups, load.draining, load.down, load.kv,
            load.instance) == (1, 1, False, None, None, None)
    for instance, want in (("3fa9c2", "3fa9c2"), ("x" * 65, None), ("a b", None), (7, None)):
        got = _read_load(json.dumps({**_load_reply(), "instance": instance}).encode(), None)
        assert got.instance == want, instance
    with pytest.raises(ValueError, match=f"snapshot's {field} is"):
        _read_load(json.dumps(_load_reply(**over)).encode(), None)
    with pytest.raises(ValueError, match="draining and alive"):
        _read_load(json.dumps({**_load_reply(), "alive": "yes"}).encode(), None)


def test_a_k_v_report_past_what_the_index_keeps_is_cut_to_its_newest():
    from phasewise.disagg.prefix_index import parse_report

    h = [bytes([i % 256, i // 256]) * 16 for i in range(5000)]
    held = parse_report({"epoch": "e", "next": 1, "held": [x.hex() for x in h]}, 100)
    assert list(held.held) == h[-100:]  # the newest the index would keep
    events = [["s", x.hex()] for x in h]
    many = parse_report({"epoch": "e", "next": 1, "events": events}, 100)
    assert many.held == {} and [b for _, b in many.events] == h[-(2 * 100 + 1024):]
    wb = WorkerBlocks(capacity=100)
    wb.enter(h[:3])
    wb.apply(many)
    assert list(wb.blocks) == h[-100:] and h[0] not in wb.blocks
    for bad in ({"epoch": "", "next": 1, "held": []}, {"epoch": "e", "next": -1, "held": []},
                {"epoch": "e", "next": 1, "events": [["x", "00"]]},
                {"epoch": "e", "next": 1, "held": ["zz"]}, [1, 2]):
        with pytest.raises(ValueError):
            parse_report(bad, 100)


def test_requests_sharing_a_prefix_go_to_the_worker_that_holds_it_unless_load_outweighs_it():
    blocks = 10
    # Worker 1 holds the whole prompt; both equally loaded: worker 1, whatever the turn.
    for turn in range(4):
        assert rank("prefix", [2, 2], [0, 10], blocks, turn)[0] == 1
    # Worker 1 busier: overlap 3 x 1.0 against load 2 x 1.0 for the lighter: still 1.
    assert rank("prefix", [1, 5], [0, 10], blocks, 0)[0] == 1
    # Holding only 3 of 10 blocks does not outweigh being the busiest (3 x 0.3 < 2).
    assert rank("prefix", [1, 5], [0, 3], blocks, 0)[0] == 0
    # The weights are the operator's: load alone.
    assert rank("prefix", [1, 5], [0, 10], blocks, 0, prefix_weight=0.0)[0] == 0
    # No full block (a short prompt): the lighter one, ties in turn.
    assert rank("prefix", [3, 1], [0, 0], 0, 0)[0] == 1
    assert {rank("prefix", [1, 1], [0, 0], 0, t)[0] for t in range(2)} == {0, 1}


def test_least_load_and_round_robin_ignore_the_cache():
    assert rank("least-load", [4, 1, 3], [9, 0, 0], 9, 0) == [1, 2, 0]
    assert [rank("round-robin", [0, 9, 9], [0, 0, 0], 0, t)[0] for t in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="least-load"):
        rank("random", [0], [0], 0, 0)


@settings(max_examples=80, deadline=None)
@given(loads=st.lists(st.integers(0, 50), min_size=1, max_size=6),
       frac=st.lists(st.integers(0, 8), min_size=6, max_size=6), turn=st.integers(0, 100))
def test_prefix_ranking_is_a_permutation_and_a_full_hit_at_the_lowest_load_wins(
        loads, frac, turn):
    held = frac[:len(loads)]
    order = rank("prefix", loads, held, 8, turn)
    assert sorted(order) == list(range(len(loads)))
    best = [i for i in range(len(loads)) if held[i] == 8 and loads[i] == min(loads)]
    if best:
        assert order[0] in best


# -- the router, with real workers ---------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two --role both workers behind two routers: one routing by prefix, one in turn."""
    from conftest import build_hf_checkpoint
    from serving import start_server

    tmp = tmp_path_factory.mktemp("routing")
    model = tmp / "model"
    build_hf_checkpoint(model, "LlamaForCausalLM", seed=5, max_position_embeddings=512)
    procs = []
    try:
        for name in ("w0", "w1"):
            procs.append(start_server(model, tmp / f"{name}.log", "--role", "both",
                                      "--log-interval", "0", "--block-size", str(BS)))
        workers = [p.url for p in procs]
        for policy in ("prefix", "round-robin"):
            procs.append(start_server(model, tmp / f"router-{policy}.log", "--decode", *workers,
                                      "--routing", policy, command="router"))
        yield workers, {"prefix": procs[2], "round-robin": procs[3]}, tmp
    finally:
        for p in reversed(procs):
            p.stop()


def _complete(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 2,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _routed(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == "phasewise:router_requests_routed_total":
                out[s.labels["url"]] = s.value
            elif s.name.startswith("phasewise:router_prompt_blocks"):
                out[s.labels["kind"]] = s.value
            elif s.name == "phasewise:router_worker_indexed_blocks":
                out["indexed " + s.labels["url"]] = s.value
    return out


def test_a_shared_prefix_follows_its_cache_by_prefix_and_not_in_turn(fleet):
    import time

    workers, routers, _ = fleet
    shared = [20 + (i * 7) % 200 for i in range(64)]  # 16 full blocks
    got = {}
    for k, (policy, router) in enumerate(routers.items()):
        head = [250 - k] + shared  # each router its own prefix: no cache shared between them
        _complete(router.url, head + [5, 6, 7])
        second = _complete(router.url, head + [8, 9, 10])
        got[policy] = (second["usage"].get("prompt_tokens_details") or {}).get(
            "cached_tokens", 0), _routed(router.url)
    cached, m = got["prefix"]
    # Both went to one worker, and the second found the first's blocks there.
    assert sorted(m[w] for w in workers if w in m) == [2.0] and cached >= 60
    assert m["expected_hit"] == 16 and m["routed"] == 32
    cached, m = got["round-robin"]
    assert [m.get(w) for w in workers] == [1.0, 1.0] and cached == 0
    # The workers' reports reach the index: the holder's blocks, as the poll tells them.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = _routed(routers["prefix"].url)
        if max(m.get("indexed " + w, 0) for w in workers) >= 16:
            break
        time.sleep(0.2)
    assert max(m.get("indexed " + w, 0) for w in workers) >= 16


def test_the_access_log_says_where_a_request_went_and_the_hit_it_expected(fleet):
    import re
    import time

    workers, routers, tmp = fleet
    ids = [30 + i for i in range(40)]
    _complete(routers["prefix"].url, ids)
    _complete(routers["prefix"].url, ids + [1])
    time.sleep(0.3)  # the line is written once the response has ended
    lines = (tmp / "router-prefix.log").read_text().splitlines()
    hits = [re.search(r"worker=(\S+) prefix expected_hit=(\d+)/(\d+)blocks", line)
            for line in lines if "/v1/completions" in line]
    hits = [h for h in hits if h]
    # 41 tokens: (41 - 1) // 4 = 10 blocks; the first prompt entered 9, and the worker's
    # report (once polled) adds the tenth, which its generated tokens completed.
    assert hits[-1].group(3) == "10" and hits[-1].group(2) in ("9", "10")
    assert hits[-1].group(1) in workers and hits[-1].group(1) == hits[-2].group(1)


def test_routing_flags_are_checked_at_start(tmp_path):
    from phasewise.disagg.router import Router, RouterConfigError

    with pytest.raises(RouterConfigError, match="--routing must be one of"):
        Router(["http://127.0.0.1:1"], model_dir=tmp_path, routing="random")
    with pytest.raises(RouterConfigError, match="--load-weight must be in"):
        Router(["http://127.0.0.1:1"], model_dir=tmp_path, load_weight=-1)
