"""Tier 1: the scheduler with hand-made runner outputs, without a model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.cache.manager import KVCacheManager
from phasewise.engine.request import Request, RequestStatus
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig


def make(budget=16, seqs=8, max_len=64, blocks=64, block_size=4, policy="chunked",
         prefix=True) -> Scheduler:
    kv = KVCacheManager(blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                     max_model_len=max_len, policy=policy), kv,
                     clock=lambda: 0.0)


def req(rid: str, n_prompt: int, max_tokens: int = 4, first: int = 1000) -> Request:
    return Request(rid, list(range(first, first + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)


def step(s: Scheduler, token: int = 7) -> ScheduledBatch:
    """Schedule one step and feed back a fake sampled token for each finished chunk."""
    batch = s.schedule()
    sampled = {r.request_id: [token] for r, n in zip(batch.requests, batch.num_tokens)
               if r.num_computed_tokens + n == r.num_tokens}
    s.update(batch, sampled)
    return batch


def plan(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(batch.requests, batch.num_tokens)]


def test_long_prompt_is_chunked_under_the_budget():
    s = make(budget=16)
    s.add_request(req("a", 40))
    sizes = []
    while not any(r.num_output_tokens for r in s.running):
        b = step(s)
        sizes.append(b.total_tokens)
        assert b.num_decode_tokens == 0
    assert sizes == [16, 16, 8]
    assert s.running[0].num_computed_tokens == 40


def test_decodes_run_first_and_prompt_chunks_fill_the_rest():
    s = make(budget=10)
    s.add_request(req("a", 3, max_tokens=10))
    s.add_request(req("b", 3, max_tokens=10))
    b = step(s)
    assert plan(b) == [("a", 3), ("b", 3)]
    s.add_request(req("c", 30))
    b = step(s)
    # two decode tokens first, then 8 tokens of c's prompt
    assert plan(b) == [("a", 1), ("b", 1), ("c", 8)]
    assert (b.num_decode_tokens, b.num_prefill_tokens) == (2, 8)
    b = step(s)
    assert plan(b) == [("a", 1), ("b", 1), ("c", 8)]


def test_sequence_cap_limits_admission():
    s = make(budget=100, seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4))
    b = step(s)
    assert [r.request_id for r in b.requests] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_prefill_first_stalls_decodes_while_prompts_wait():
    s = make(budget=64, max_len=64, policy="prefill-first")
    s.add_request(req("a", 4, max_tokens=10))
    step(s)
    s.add_request(req("b", 30, first=5000))
    b = step(s)
    assert plan(b) == [("b", 30)]  # the whole prompt, and no decode for a
    assert b.num_decode_tokens == 0
    b = step(s)
    assert sorted(plan(b)) == [("a", 1), ("b", 1)]


def test_prefill_first_needs_a_budget_for_whole_prompts():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=64, policy="prefill-first")


def test_finished_requests_leave_and_free_blocks():
    s = make(budget=32)
    s.add_request(req("a", 5, max_tokens=3))
    for _ in range(3):
        step(s)
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_prefix_hit_skips_cached_tokens():
    s = make(budget=64, block_size=4)
    s.add_request(req("a", 12, max_tokens=2))
    step(s)
    s.add_request(req("b", 14, max_tokens=2))  # same first 12 tokens
    b = step(s)
    # a decodes one token; b reuses a's three full blocks and computes its last 2 tokens.
    assert plan(b) == [("a", 1), ("b", 2)]
    assert s.kv.stats.prefix_hits == 12


def test_preemption_picks_the_latest_admitted_and_requeues_it_first():
    s = make(budget=64, blocks=6, block_size=4, max_len=24, prefix=False)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, max_tokens=12, first=2000))
    s.add_request(req("c", 4, max_tokens=12, first=3000))
    step(s)  # a: 3 blocks (8 + room), b: 2 blocks... pool fills as they decode
    preempted = []
    for _ in range(12):
        b = step(s)
        preempted += [r.request_id for r in b.preempted]
        if preempted:
            break
    assert preempted and preempted[0] == "c"
    victim = s.waiting[0]
    assert victim.request_id == "c"
    assert victim.status is RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert victim.metrics.num_preemptions == 1


def test_preempted_request_recomputes_prompt_and_outputs_then_finishes():
    s = make(budget=64, blocks=5, block_size=4, max_len=20, prefix=False)
    s.add_request(req("a", 6, max_tokens=10))
    s.add_request(req("b", 6, max_tokens=10, first=2000))
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    recompute_sizes = []
    for i in range(60):
        if not s.has_unfinished():
            break
        batch = s.schedule()
        sampled = {}
        for r, n in zip(batch.requests, batch.num_tokens):
            if r.request_id == "b" and r.metrics.num_preemptions and r.num_computed_tokens == 0:
                recompute_sizes.append(n)
            if r.num_computed_tokens + n == r.num_tokens:
                sampled[r.request_id] = [10 + i]
        for r, _ in s.update(batch, sampled):
            outputs[r.request_id].append(r.output_token_ids[-1])
    assert not s.has_unfinished()
    assert len(outputs["a"]) == 10 and len(outputs["b"]) == 10
    # b was preempted and recomputed its prompt plus the outputs it had.
    assert recompute_sizes and recompute_sizes[0] > 6


def test_prompt_longer_than_max_model_len_is_rejected_at_admission():
    s = make(max_len=16)
    with pytest.raises(ValueError, match="more than max_model_len"):
        s.add_request(req("a", 17))
    assert not s.has_unfinished()


def test_prompt_that_fills_max_model_len_is_rejected_naming_the_prompt():
    from phasewise.engine.validation import ValidationError

    s = make(max_len=16)
    with pytest.raises(ValidationError, match="16 tokens, as many as max_model_len") as e:
        s.add_request(req("a", 16))
    assert e.value.param == "prompt"
    s.add_request(req("b", 15, max_tokens=8))  # one output token fits
    while s.has_unfinished():
        step(s)
    assert s.running == [] and s.kv.num_free_blocks == s.kv.num_blocks


def test_prompt_larger_than_the_pool_is_rejected():
    s = make(max_len=100, blocks=4, block_size=4)
    with pytest.raises(ValueError, match="whole KV cache holds 16"):
        s.add_request(req("a", 16))


def test_empty_prompt_is_rejected():
    s = make()
    with pytest.raises(ValueError, match="empty"):
        s.add_request(req("a", 0))


def test_max_model_len_ends_generation_with_length():
    s = make(max_len=8)
    r = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=None, ignore_eos=True),
                arrival_time=0.0)
    s.add_request(r)
    while s.has_unfinished():
        step(s)
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert r.num_tokens == 8


def test_eos_stops_unless_ignored_and_min_tokens_defers_it():
    s = make()
    r = Request("a", [1, 2], SamplingParams(max_tokens=5, min_tokens=2), eos_token_ids=(7,),
                arrival_time=0.0)
    s.add_request(r)
    step(s, token=7)  # first output is eos but min_tokens=2 keeps it going
    assert not r.finished
    step(s, token=7)
    assert not r.finished
    step(s, token=7)
    assert r.status is RequestStatus.FINISHED_STOPPED


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    outs=st.integers(1, 6),
    budget=st.integers(1, 48),
    blocks=st.integers(11, 40),
    policy=st.sampled_from(["chunked", "prefill-first"]),
)
def test_every_request_finishes_within_budget_and_caps(prompts, outs, budget, blocks, policy):
    """Any mix of prompts finishes; no step breaks the budget, the cap or the batch layout."""
    max_len = 48
    if policy == "prefill-first":
        budget = max(budget, max_len)
    s = make(budget=budget, seqs=4, max_len=max_len, blocks=blocks, block_size=4,
             policy=policy)
    reqs = [req(f"r{i}", n, max_tokens=outs, first=100 * i) for i, n in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    for _ in range(2000):
        if not s.has_unfinished():
            break
        b = step(s)
        assert b.total_tokens <= budget
        assert len(s.running) <= 4
        ones = [n == 1 for n in b.num_tokens]
        assert ones == sorted(ones, reverse=True)  # single-token chunks lead the batch
        if policy == "prefill-first" and b.num_prefill_tokens:
            assert b.num_decode_tokens == 0
    assert not s.has_unfinished()
    # each gets its outputs, or stops at the length the pool can hold (blocks * 4 - 1 may be
    # under max_len: then a request alone in the pool finishes instead of preempting itself)
    assert s.max_len == min(max_len, blocks * 4 - 1)
    assert all(r.num_output_tokens == min(outs, s.max_len - r.num_prompt_tokens) for r in reqs)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_finish_rules_apply_in_their_documented_order():
    from phasewise.engine.finish import masked_tokens, token_finish

    stop, length = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
    p = SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=(5,))
    eos = (9,)
    # min_tokens: the first output cannot stop by token (and the sampler masks 5 and 9 for it)
    assert token_finish(p, eos, 5, num_output_tokens=1, num_tokens=4, max_len=64) is None
    assert masked_tokens(p, eos, 0) == {5, 9} and masked_tokens(p, eos, 1) == set()
    # a stop token id gives its id as the reason; EOS gives none
    assert token_finish(p, eos, 5, 2, 5, 64) == (stop, 5)
    assert token_finish(p, eos, 9, 2, 5, 64) == (stop, None)
    # a stop token on the last allowed output is still a stop, not a length
    assert token_finish(p, eos, 5, 3, 6, 64) == (stop, 5)
    assert token_finish(p, eos, 4, 3, 6, 64) == (length, None)
    # ignore_eos: EOS is an ordinary token (and not masked)
    q = SamplingParams(max_tokens=None, min_tokens=1, ignore_eos=True)
    assert token_finish(q, eos, 9, 2, 5, 64) is None
    assert masked_tokens(q, eos, 0) == set()
    # the context length ends a request with no max_tokens
    assert token_finish(q, eos, 4, 2, 64, 64) == (length, None)


def test_stop_strings_find_the_earliest_match_after_the_search_start():
    from phasewise.engine.finish import find_stop_string

    assert find_stop_string("a END b STOP", 0, ("STOP", "END")) == (2, "END")
    assert find_stop_string("a END b STOP", 3, ("STOP", "END")) == (8, "STOP")
    assert find_stop_string("abc", 0, ("x",)) is None


def test_min_tokens_holds_stop_strings_back_as_it_holds_stop_tokens():
    """min_tokens 10 with a stop string finished after 1 token: the docs said no stop before
    that many tokens, and vLLM's min_tokens holds stop strings back too. An output among the
    first min_tokens that completes a stop string goes on; a later one stops."""
    from phasewise.engine.output_processor import TextState

    class Pieces:  # a token's text: token i is "ab"[i]
        def step(self, token_id):
            return "ab"[token_id]

    # "ab" is completed by outputs 2, 4 and 6; outputs up to min_tokens cannot stop
    for min_tokens, first_stop in ((0, 2), (1, 2), (2, 4), (3, 4), (4, 6)):
        state = TextState(Pieces(), SamplingParams(stop=["ab"], min_tokens=min_tokens))
        n = next(i for i in range(1, 7) if state.add_token(i % 2 == 0) is not None)
        assert n == first_stop, min_tokens
        assert state.text == "ab" * (n // 2 - 1)  # cut before the stop string, as ever
    # a shorter stop string that ended within the first min_tokens outputs is not found
    # by a later output's search (the window of the longest stop string reaches back)
    class Letters:
        def step(self, token_id):
            return "xby"[token_id]

    state = TextState(Letters(), SamplingParams(stop=["b", "abc"], min_tokens=2))
    assert [state.add_token(t) for t in (0, 1, 2)] == [None, None, None]
    assert state.text == "xby" and state.add_token(1) == "b" and state.text == "xby"


# -- speculative drafts take only what is left -----------------------------------------------

def draft_step(s: Scheduler, drafts: int, accept_all: bool = True) -> ScheduledBatch:
    """Give every decoding request ``drafts`` fake drafts, schedule, and feed back what a
    verify would emit (all drafts accepted and one more, or none accepted)."""
    for r in s.running:
        if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1:
            r.spec_token_ids = [5] * drafts
    batch = s.schedule()
    sampled = {}
    for r, n in zip(batch.requests, batch.num_tokens):
        if r.spec_token_ids:
            sampled[r.request_id] = r.spec_token_ids + [6] if accept_all else [6]
        elif r.num_computed_tokens + n == r.num_tokens:
            sampled[r.request_id] = [7]
    s.update(batch, sampled)
    return batch


def test_drafts_never_starve_a_decode_or_keep_a_prompt_out():
    s = make(budget=64, seqs=32, max_len=128, blocks=400)
    reqs = [req(f"r{i}", 6, max_tokens=40, first=100 * i + 1000) for i in range(20)]
    for r in reqs:
        s.add_request(r)
    for _ in range(6):
        batch = draft_step(s, 4)
        assert batch.total_tokens <= 64
        decoding = [r for r in s.running if r.num_output_tokens]
        # every request that was decoding got its token in this step
        assert all(r in batch.requests for r in decoding if r.num_output_tokens > 1)
    assert all(r.num_output_tokens > 0 for r in reqs)  # every prompt was admitted and ran


def test_drafts_take_only_free_blocks_and_never_preempt():
    for drafts in (0, 3):
        s = make(budget=32, seqs=8, max_len=64, blocks=6, block_size=4)
        for i, rid in enumerate("abc"):
            s.add_request(req(rid, 7, max_tokens=2, first=1000 + 100 * i))
        while s.has_unfinished():
            batch = draft_step(s, drafts)
            assert not batch.preempted, f"drafts={drafts} preempted {batch.preempted}"
        assert s.num_preemptions == 0 and s.kv.num_free_blocks == 6


def test_a_verify_registers_the_true_chain_in_the_prefix_cache():
    s = make(budget=32, block_size=4)
    a = req("a", 9, max_tokens=10)
    s.add_request(a)
    draft_step(s, 0)  # the prefill: one output
    draft_step(s, 3)  # a verify that keeps all 3 drafts and adds one: 9 + 5 tokens
    assert a.num_output_tokens == 5 and a.num_computed_tokens == 13
    tokens = list(a.all_token_ids)
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)
    b = Request("b", tokens + [9], SamplingParams(max_tokens=1), arrival_time=0.0)
    assert s.kv.get_computed_blocks(b).num_tokens == 12  # all three full blocks are found


def _grouped(rid: str, group: str | None, n_prompt: int = 3, max_tokens: int = 50,
             first: int = 1000) -> Request:
    r = req(rid, n_prompt, max_tokens, first)
    r.group = group
    return r


@pytest.mark.parametrize("policy", ["chunked", "prefill-first"])
def test_a_request_of_many_sequences_cannot_keep_a_newcomer_from_every_seat(policy):
    """16 prompts x n=16 (256 sequences) took all 128 seats and kept another client's
    request from its first token for a whole generation, twice over: now the newcomer gets
    a seat within two steps, the big request gives up one (by preemption) for it, and
    sequences of one group each are still admitted in arrival order."""
    s = make(budget=64, seqs=8, blocks=256, policy=policy)
    for i in range(12):
        s.add_request(_grouped(f"big-{i}", "big", first=1000 + 10 * i))
    step(s)
    assert len(s.running) == 8 and all(r.group == "big" for r in s.running)
    s.add_request(_grouped("new", None, first=2000))
    preempted = []
    for _ in range(2):
        preempted += [r.request_id for r in step(s).preempted]
        if any(r.request_id == "new" for r in s.running):
            break
    assert any(r.request_id == "new" for r in s.running)
    assert preempted == ["big-7"]  # the group's latest admitted, once
    assert [r.request_id for r in s.waiting][0] == "big-7"  # and first of its group again


def test_fair_admission_keeps_arrival_order_between_single_requests():
    s = make(budget=64, seqs=2, blocks=256)
    for name in ("a", "b", "c", "d"):
        s.add_request(_grouped(name, None, max_tokens=2, first=ord(name) * 10))
    admitted = []
    while s.has_unfinished():
        for r in step(s).requests:
            if r.request_id not in admitted:
                admitted.append(r.request_id)
    assert admitted == ["a", "b", "c", "d"]
    assert s.num_preemptions == 0


@pytest.mark.parametrize("seqs", [1, 2])
def test_requests_of_one_sequence_never_preempt_each_other_for_a_seat(seqs):
    """Under one seat a newcomer preempting the running request would be preempted by the
    next, and none would finish: single requests wait their turn."""
    s = make(budget=64, seqs=seqs, blocks=256)
    for name in ("a", "b", "c"):
        s.add_request(_grouped(name, None, max_tokens=5, first=ord(name) * 10))
    while s.has_unfinished():
        assert not step(s).preempted
    assert s.num_preemptions == 0


def test_a_group_at_half_the_seats_or_less_keeps_them():
    s = make(budget=64, seqs=8, blocks=256)
    for i in range(4):
        s.add_request(_grouped(f"g-{i}", "g", first=1000 + 10 * i))
    for i in range(4):
        s.add_request(_grouped(f"h-{i}", "h", first=3000 + 10 * i))
    step(s)
    s.add_request(_grouped("new", None, first=5000))
    for _ in range(3):
        assert not step(s).preempted  # no group holds more than half: it waits its turn


# -- parked requests (a reader that stopped reading: RequestGroup parks them) ----------------

def test_a_parked_request_runs_nothing_until_released_and_never_trips_the_safety_net():
    s = make(budget=16, seqs=4)
    for rid, first in (("a", 1000), ("b", 2000)):
        s.add_request(req(rid, 4, max_tokens=20, first=first))
    step(s)
    a, b = s.running
    a.parked = True
    for _ in range(3):
        assert plan(step(s)) == [("b", 1)]
    b.parked = True  # everything parked: an empty step, no preemption
    batch = step(s)
    assert batch.requests == [] and batch.preempted == [] and len(s.running) == 2
    a.parked = b.parked = False
    assert sorted(plan(step(s))) == [("a", 1), ("b", 1)]


def parked_pair(s: Scheduler, prompt: int) -> Scheduler:
    """``s`` running two requests of ``prompt`` tokens, "a" then "b", both parked."""
    s.add_request(req("a", prompt, max_tokens=20))
    s.add_request(req("b", prompt, max_tokens=20, first=2000))
    step(s)
    for r in s.running:
        r.parked = True
    return s


def test_a_parked_request_gives_its_seat_and_its_blocks_to_a_waiting_one():
    """Seats: two parked requests hold every seat; a newcomer takes the latest one's, and
    the parked one waits, never readmitted while parked. Blocks: requests that fill the
    pool while parked give them up to a newcomer that needs them."""
    s = parked_pair(make(budget=16, seqs=2), 4)
    s.add_request(req("c", 4, max_tokens=2, first=3000))
    preempted = step(s).preempted
    assert [r.request_id for r in preempted] == ["b"]
    assert plan(step(s)) == [("c", 4)]  # b stays waiting, parked
    while any(r.request_id == "c" for r in s.running):
        assert all(r.request_id != "b" for r in step(s).requests)
    s.waiting[0].parked = False
    step(s)
    assert any(r.request_id == "b" for r in s.running)

    s = parked_pair(make(budget=32, seqs=8, blocks=8, block_size=4, max_len=32,
                         prefix=False), 12)
    s.add_request(req("c", 12, max_tokens=2, first=3000))  # needs blocks the parked hold
    batch = step(s)
    assert [r.request_id for r in batch.preempted] == ["b"] and ("c", 12) in plan(batch)


def test_prefill_first_takes_a_parked_requests_blocks_for_a_whole_prompt():
    """Under prefill-first a waiting prompt found no blocks while a parked request held them,
    and waited as long as its client did not read."""
    s = parked_pair(make(budget=32, seqs=8, blocks=8, block_size=4, max_len=32,
                         policy="prefill-first", prefix=False), 12)
    s.add_request(req("c", 12, max_tokens=2, first=3000))
    batch = step(s)
    assert [r.request_id for r in batch.preempted] == ["b"] and plan(batch) == [("c", 12)]
