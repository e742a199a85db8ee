"""A remote prefill over real pyzmq sockets on 127.0.0.1: a decode engine and a prefill engine,
each on its own engine thread, joined by the K/V port (HMAC handshake, checksummed frames).
Greedy output equals co-located serving's, and every fault ends in a complete, correct
output computed on the decode side."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from conftest import collect
from faults import FaultInjector

from phasewise import EngineConfig, SamplingParams
from phasewise.disagg.wire import HandshakeError
from phasewise.disagg.worker import DecodeSide, PrefillSide
from phasewise.engine.async_engine import AsyncEngine, PromptSpec
from phasewise.engine.engine import LLMEngine

SECRET = b"test-secret-of-enough-bytes-0123"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = [(5 * i + 2) % 250 + 1 for i in range(41)]


def async_engine(path, **kw) -> AsyncEngine:
    return AsyncEngine(LLMEngine(EngineConfig(model=str(path), **kw)))


def colocated(path, prompt, **kw) -> list[int]:
    eng = LLMEngine(EngineConfig(model=str(path), **kw))
    eng.add_request(prompt, GREEDY, request_id="r")
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                return out.token_ids
    raise AssertionError("no output")




def _wait_for_peer(decode: DecodeSide) -> None:
    deadline = time.monotonic() + 30
    while decode._prefill_peer()[0] is None:
        assert time.monotonic() < deadline, "the prefill worker never connected"
        time.sleep(0.01)


@contextlib.asynccontextmanager
async def connected(path):
    """A decode side and a prefill side joined over 127.0.0.1; both stopped afterwards."""
    decode_engine = async_engine(path)
    decode_engine.start()
    decode = DecodeSide(decode_engine, secret=SECRET)
    prefill = PrefillSide(async_engine(path), decode.endpoint, secret=SECRET)
    prefill.start()
    try:
        _wait_for_peer(decode)
        yield decode_engine, decode, prefill
    finally:
        prefill.close()
        decode.close()
        await asyncio.to_thread(decode_engine.shutdown)


def serve_through(path, prompts, *, prefill_kw=None, decode_kw=None, faults=None,
                  before=None, side_kw=None):
    """Start both sides, send ``prompts``, return (token ids per prompt, decode side's
    counters, the decode engine)."""
    decode_engine = async_engine(path, **(decode_kw or {}))

    async def main():
        decode_engine.start()
        decode = DecodeSide(decode_engine, secret=SECRET, heartbeat_deadline=2.0,
                            **(side_kw or {}))
        prefill = PrefillSide(async_engine(path, **(prefill_kw or {})), decode.endpoint,
                              secret=SECRET, frame_hook=faults, heartbeat_interval=0.2)
        prefill.start()  # on a loop of its own, on a thread
        try:
            _wait_for_peer(decode)
            if before is not None:
                before(decode, prefill)
            groups = [await decode.add([PromptSpec(p, GREEDY)], f"r{i}")
                      for i, p in enumerate(prompts)]
            # Bounded: a hand-off that hangs fails the test instead of the whole run.
            outs = [(await asyncio.wait_for(collect(g), 120))[0].token_ids for g in groups]
            return outs, decode.server.counters()
        finally:
            prefill.close()
            decode.close()
            await asyncio.to_thread(decode_engine.shutdown)

    outs, counters = asyncio.run(main())
    counters = dict(counters, **{f"remote.{k}": v
                                  for k, v in decode_engine.remote_outcomes.items()})
    return outs, counters, decode_engine.engine


def test_remote_prefill_over_sockets_matches_colocated(llama_dir):
    prompts = [PROMPT, PROMPT[3:], list(reversed(PROMPT))]
    # The prefill worker computes each whole prompt in one step, as the co-located engine.
    outs, counters, eng = serve_through(llama_dir, prompts)
    for got, prompt in zip(outs, prompts):
        assert got == colocated(llama_dir, prompt)
    assert counters["frames.ok"] == 3 and counters["peers.accepted"] == 1
    assert counters["remote.done"] == 3 and len([k for k in counters if "remote." in k]) == 1
    assert not any(counters[k] for k in ("frames.stale", "frames.foreign", "frames.duplicate",
                                          "frames.out_of_range", "frames.mismatch"))
    assert eng.kv.usage == 0 and not eng.scheduler.remote


def test_chunks_of_concurrent_prompts_each_land_once(llama_dir):
    """Three prompts share the prefill worker's 16-token steps, so their chunks end inside
    blocks: every block still travels once and lands."""
    prompts = [PROMPT, PROMPT[3:], list(reversed(PROMPT))]
    outs, counters, eng = serve_through(llama_dir, prompts,
                                        prefill_kw={"max_num_batched_tokens": 16})
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert counters["frames.duplicate"] == 0 and counters["frames.mismatch"] == 0
    assert 3 <= counters["frames.ok"] <= 9  # 9 blocks, one or more to a frame
    assert counters["remote.done"] == 3  # all decoded on from remote K/V: no fallback
    assert eng.kv.usage == 0


def test_a_chunk_over_the_frame_limit_goes_as_frames_of_whole_blocks(llama_dir):
    """The decode side takes frames of one block at most (its limit never goes lower): the
    prefill worker splits each whole-prompt chunk, and the output is co-located serving's."""
    prompts = [PROMPT, list(reversed(PROMPT))]
    outs, counters, eng = serve_through(llama_dir, prompts, side_kw={"max_frame_bytes": 1})
    for got, prompt in zip(outs, prompts):
        assert got == colocated(llama_dir, prompt)
    assert counters["frames.ok"] == 6  # 3 blocks a prompt, one to a frame
    assert counters["remote.done"] == 2 and eng.kv.usage == 0


def test_a_dropped_or_corrupted_frame_is_recomputed_on_the_decode_side(llama_dir):
    """The injector counts frames per request. A corrupted first frame (the whole prompt)
    lands nothing: the decode side computes the prompt. A dropped second frame of three
    keeps the first block and computes the rest, in the same 16-token chunks as the
    co-located run it is compared with."""
    corrupt = FaultInjector({0: "corrupt"})
    outs, counters, eng = serve_through(llama_dir, [PROMPT], faults=corrupt)
    assert outs == [colocated(llama_dir, PROMPT)]
    assert corrupt.applied["corrupt"] == 1 and counters.get("frames.ok", 0) == 0
    assert counters["remote.incomplete"] == 1 and eng.kv.usage == 0

    kw = {"max_num_batched_tokens": 16}
    drop = FaultInjector({1: "drop"})
    outs, counters, eng = serve_through(llama_dir, [PROMPT], faults=drop, prefill_kw=kw,
                                        decode_kw=kw)
    assert outs == [colocated(llama_dir, PROMPT, **kw)]
    assert drop.applied["drop"] == 1 and counters["frames.ok"] == 2
    assert counters["remote.incomplete"] == 1 and eng.kv.usage == 0
    assert eng.requests == {} and not eng.scheduler.remote


def test_a_prefill_worker_that_goes_away_leaves_a_complete_stream(llama_dir):
    """The prefill worker closes before the request comes: the decode side prefills locally
    (no live peer). One that hangs mid-attempt and falls silent is reported lost by its
    missing heartbeats, and the attempt is computed on the decode side."""
    def close_first(decode, prefill):
        prefill.close()
        deadline = time.monotonic() + 30
        while decode.num_live_peers:  # its Bye has landed: no live peer is left
            assert time.monotonic() < deadline
            time.sleep(0.01)

    outs, counters, eng = serve_through(llama_dir, [PROMPT], before=close_first)
    assert outs == [colocated(llama_dir, PROMPT)]
    assert not any(k.startswith("remote.") for k in counters) and eng.kv.usage == 0

    faults = FaultInjector()

    def hang(decode, prefill):
        async def never(req, link):  # takes the request, computes nothing, says nothing
            faults.mute_heartbeats()
        prefill._serve = never

    outs, counters, eng = serve_through(llama_dir, [PROMPT], faults=faults, before=hang)
    assert outs == [colocated(llama_dir, PROMPT)]
    assert counters["remote.failed"] == 1 and eng.kv.usage == 0


def test_a_peer_without_the_secret_is_refused(llama_dir):
    decode_engine = async_engine(llama_dir)

    async def main():
        decode_engine.start()
        decode = DecodeSide(decode_engine, secret=SECRET)
        try:
            with pytest.raises(HandshakeError) as err:
                PrefillSide(async_engine(llama_dir), decode.endpoint,
                            secret=b"not-the-secret-but-long-enough!!")
            # zmq's CURVE handshake fails (the keys derive from the secret)
            assert err.value.field == "security" and "secret" in err.value.reason
            assert decode._prefill_peer() == (None, "no_prefill_worker")
            deadline = time.monotonic() + 10  # the port counts it on its own thread
            while decode.server.counters().get("unauthenticated.curve", 0) < 1:
                assert time.monotonic() < deadline, decode.server.counters()
                await asyncio.sleep(0.01)
        finally:
            decode.close()
            await asyncio.to_thread(decode_engine.shutdown)

    asyncio.run(main())


def test_a_client_abort_during_a_remote_prefill_leaves_both_pools_empty(llama_dir):
    """The client goes away right after its request went to the prefill worker: the decode
    side frees its reservation and tells the prefill worker, which stops; whatever was
    already in flight is dropped. Afterwards neither engine holds a block or a request."""
    decode_engine = async_engine(llama_dir)
    prefill_engine = async_engine(llama_dir, max_num_batched_tokens=16)

    async def main():
        decode_engine.start()
        decode = DecodeSide(decode_engine, secret=SECRET)
        prefill = PrefillSide(prefill_engine, decode.endpoint, secret=SECRET)
        prefill.start()
        try:
            _wait_for_peer(decode)
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            groups = [await decode.add([PromptSpec(PROMPT[i:], long)], f"a{i}")
                      for i in range(4)]
            for g in groups:
                g.close()  # the clients hang up
            deadline = time.monotonic() + 30
            while (decode_engine.engine.requests or prefill_engine.engine.requests
                   or decode._attempts):
                assert time.monotonic() < deadline, "something was left behind"
                await asyncio.sleep(0.02)
            assert decode_engine.engine.kv.usage == 0
            assert not decode_engine.engine.scheduler.remote
        finally:
            prefill.close()
            decode.close()
            await asyncio.to_thread(decode_engine.shutdown)
        assert prefill_engine.engine.kv.usage == 0

    asyncio.run(main())


def test_an_odd_first_token_message_is_computed_locally_not_hung(llama_dir):
    """A prefill worker whose FirstToken carries log-probabilities keyed by something that is
    not a token id: the decode side does not stall (its event thread goes on) and computes
    the prompt itself."""
    from phasewise.disagg.wire import FirstToken

    def odd(decode, prefill):
        send = prefill.client.send

        def patched(msg):
            if isinstance(msg, FirstToken):
                msg = FirstToken(msg.request_id, msg.epoch, msg.token_id, {"not-an-id": -1.0})
            send(msg)
        prefill.client.send = patched

    outs, counters, eng = serve_through(llama_dir, [PROMPT, PROMPT[1:]], before=odd)
    assert outs == [colocated(llama_dir, PROMPT), colocated(llama_dir, PROMPT[1:])]
    assert counters["remote.failed"] == 2 and eng.kv.usage == 0


def test_the_shortest_prefill_queue_is_chosen_and_a_busy_one_is_skipped(llama_dir):
    """Heartbeats carry each prefill worker's queue; the decode side also counts what it sent
    and has not heard back from. At the limit it prefills locally, saying why."""
    from phasewise.disagg.transport import PeerInfo

    decode_engine = async_engine(llama_dir)
    decode = DecodeSide(decode_engine, secret=SECRET, queue_limit=3)
    try:
        peers = {"a": PeerInfo("a", "pa", "prefill", "alive", 2),
                 "b": PeerInfo("b", "pb", "prefill", "alive", 1),
                 "c": PeerInfo("c", "pc", "prefill", "lost", 0)}
        decode.server.peers = lambda: peers
        assert decode._prefill_peer() == ("b", None)  # "c" has the shortest, but is lost
        decode._attempts.update({"r1": ("b", 1), "r2": ("b", 1)})  # sent, not yet heard of
        assert decode._prefill_peer() == ("a", None)
        peers["a"] = PeerInfo("a", "pa", "prefill", "alive", 3)
        decode._attempts["r3"] = ("b", 1)
        assert decode._prefill_peer() == (None, "prefill_busy")

        async def main():
            decode_engine.start()
            try:
                group = await decode.add([PromptSpec(PROMPT, GREEDY)], "busy")
                return (await asyncio.wait_for(collect(group), 60))[0].token_ids
            finally:
                await asyncio.to_thread(decode_engine.shutdown)

        assert asyncio.run(main()) == colocated(llama_dir, PROMPT)
        assert decode.local_prefills["prefill_busy"] == 1
        assert decode.num_attempts == 3  # the planted ones: nothing was sent
    finally:
        decode.close()


def test_a_stuck_prefill_worker_reports_a_queue_no_decode_worker_waits_on():
    """Its engine stuck in one step, a prefill worker's heartbeats (another thread) go on:
    they report a queue past any decode worker's limit, so prompts are prefilled there
    instead of waiting --remote-prefill-timeout on it."""
    from types import SimpleNamespace

    from phasewise.disagg.worker import STUCK_QUEUE
    from phasewise.engine.backend import EngineSnapshot

    snap = EngineSnapshot(2, 3, 0.0, 0, 0, 0, 0, 0)
    side = SimpleNamespace(backend=SimpleNamespace(snapshot=snap, stuck=False))
    assert PrefillSide._queue_len(side) == 5
    side.backend.stuck = True
    assert PrefillSide._queue_len(side) == STUCK_QUEUE > 1_000_000  # the limit's bound
    with pytest.raises(ValueError, match="--prefill-queue-limit must be in 1..1000000"):
        from phasewise.launch.serve import build_server

        build_server(EngineConfig(model="/nonexistent"), role="decode",
                     kv_bind="tcp://127.0.0.1:0", prefill_queue_limit=STUCK_QUEUE)


def test_a_prefill_worker_that_never_answers_is_timed_out_per_request(llama_dir):
    """Alive (its heartbeats go on) but its first token never comes: after the decode side's
    per-request deadline the prompt is computed there."""
    decode_engine = async_engine(llama_dir)

    async def main():
        decode_engine.start()
        decode = DecodeSide(decode_engine, secret=SECRET, request_timeout=1.0)
        prefill = PrefillSide(async_engine(llama_dir), decode.endpoint, secret=SECRET,
                              heartbeat_interval=0.2)
        real_send = prefill.client.send
        # The first token (and Done) are lost on the way; frames still flow.
        prefill.client.send = lambda msg: None if type(msg).__name__ == "FirstToken" \
            else real_send(msg)
        prefill.start()
        try:
            _wait_for_peer(decode)
            group = await decode.add([PromptSpec(PROMPT, GREEDY)], "late")
            out = (await asyncio.wait_for(collect(group), 60))[0]
            assert decode.failures["timeout"] == 1 and sum(decode.failures.values()) == 1
            return out.token_ids, dict(decode_engine.remote_outcomes)
        finally:
            prefill.close()
            decode.close()
            await asyncio.to_thread(decode_engine.shutdown)

    ids, outcomes = asyncio.run(main())
    assert ids == colocated(llama_dir, PROMPT)
    assert outcomes.get("failed") == 1 and not outcomes.get("done")


def test_n_samples_of_one_prompt_each_hand_off_and_match_colocated(llama_dir):
    """A group of three samples of one prompt (n=3) and a second prompt: each sample is its
    own remote prefill (the later ones find the first's blocks in the decode side's prefix
    cache once they are in), and every output equals co-located serving's."""
    other = PROMPT[:20] + [7, 8, 9]

    async def main():
        async with connected(llama_dir) as (decode_engine, decode, _):
            group = await decode.add([PromptSpec(PROMPT, GREEDY)] * 3
                                     + [PromptSpec(other, GREEDY)], "n3")
            outs = await asyncio.wait_for(collect(group), 60)
            return [outs[i].token_ids for i in range(4)], decode_engine

    got, decode_engine = asyncio.run(main())
    want = colocated(llama_dir, PROMPT)
    assert got[:3] == [want] * 3 and got[3] == colocated(llama_dir, other)
    assert decode_engine.remote_outcomes.get("done", 0) >= 1
    assert not decode_engine.remote_outcomes.get("failed")


def test_a_prefill_worker_connects_again_to_a_restarted_decode_worker(llama_dir):
    """The decode worker restarts on the same K/V port: the new one does not know the old
    session and answers no heartbeat, so the prefill worker, silent-for past its deadline,
    hand-shakes again (its /health says why meanwhile) and serves the new decode worker."""
    prefill = None

    async def serve_one(decode_engine, decode, prompt):
        group = await decode.add([PromptSpec(prompt, GREEDY)], f"r{len(prompt)}")
        return (await asyncio.wait_for(collect(group), 60))[0].token_ids

    async def main():
        nonlocal prefill
        first_engine = async_engine(llama_dir)
        first_engine.start()
        first = DecodeSide(first_engine, secret=SECRET)
        endpoint = first.endpoint
        prefill = PrefillSide(async_engine(llama_dir), endpoint, secret=SECRET,
                              heartbeat_interval=0.1, server_deadline=1.0)
        prefill.start()
        try:
            _wait_for_peer(first)
            assert await serve_one(first_engine, first, PROMPT) == colocated(llama_dir, PROMPT)
            assert first_engine.remote_outcomes == {"done": 1}
        finally:
            first.close()
            await asyncio.to_thread(first_engine.shutdown)
        deadline = time.monotonic() + 30
        while prefill.is_alive:  # silent past its deadline: it says so
            assert time.monotonic() < deadline, "the prefill worker never noticed"
            await asyncio.sleep(0.05)
        assert "no answer from the decode workers' K/V ports" in prefill.down_reason
        assert prefill.engine_health() is None  # its own engine is well: no restart helps
        second_engine = async_engine(llama_dir)
        second_engine.start()
        second = DecodeSide(second_engine, secret=SECRET, bind=endpoint)
        try:
            _wait_for_peer(second)
            other = PROMPT[:30]
            assert await serve_one(second_engine, second, other) == colocated(llama_dir,
                                                                              other)
            assert second_engine.remote_outcomes == {"done": 1}
            assert prefill.reconnects >= 1 and prefill.is_alive
        finally:
            prefill.close()
            second.close()
            await asyncio.to_thread(second_engine.shutdown)

    asyncio.run(main())


def test_one_prefill_worker_serves_two_decode_workers(llama_dir):
    """--kv-connect A B: one prefill worker prefills for two decode workers, each prompt's
    K/V going back to the decode worker that asked."""
    engines = [async_engine(llama_dir), async_engine(llama_dir)]
    prompts = [PROMPT, PROMPT[5:]]

    async def main():
        for e in engines:
            e.start()
        decodes = [DecodeSide(e, secret=SECRET) for e in engines]
        prefill = PrefillSide(async_engine(llama_dir), [d.endpoint for d in decodes],
                              secret=SECRET)
        prefill.start()
        try:
            for d in decodes:
                _wait_for_peer(d)
            groups = [await d.add([PromptSpec(p, GREEDY)], f"from-{i}")
                      for i, (d, p) in enumerate(zip(decodes, prompts))]
            return [(await asyncio.wait_for(collect(g), 60))[0].token_ids for g in groups]
        finally:
            prefill.close()
            for d, e in zip(decodes, engines):
                d.close()
                await asyncio.to_thread(e.shutdown)

    got = asyncio.run(main())
    assert got == [colocated(llama_dir, p) for p in prompts]
    assert [e.remote_outcomes for e in engines] == [{"done": 1}, {"done": 1}]


def test_a_prefill_request_that_cannot_be_sent_is_computed_locally(llama_dir):
    """The chosen prefill worker went away between the choice and the send (the send
    raises): the request is computed here, the caller gets its group, nothing leaks."""
    def gone(peer, msg):
        raise KeyError(f"no live KV peer {peer!r}")

    async def main():
        async with connected(llama_dir) as (decode_engine, decode, _):
            decode.server.request_prefill = gone
            group = await decode.add([PromptSpec(PROMPT, GREEDY)], "gone")
            ids = (await asyncio.wait_for(collect(group), 60))[0].token_ids
            assert decode.failures["send_failed"] == 1
            return ids, decode.num_attempts, decode_engine

    ids, attempts, decode_engine = asyncio.run(main())
    open_groups = decode_engine.num_open_groups
    assert ids == colocated(llama_dir, PROMPT)
    assert attempts == 0 and open_groups == 0
    assert decode_engine.remote_outcomes == {"failed": 1}
