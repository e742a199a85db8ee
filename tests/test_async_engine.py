"""AsyncEngine: the engine on its own thread, driven from asyncio."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from conftest import collect

from phasewise import EngineConfig, LLM, SamplingParams
from phasewise.engine.async_engine import (AsyncEngine, EngineError, EngineOverloaded,
                                           EngineStopped, PromptSpec)
from phasewise.engine.backend import EngineUnavailable
from phasewise.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Recorder:
    def __init__(self):
        self.finished = []

    def on_step(self, step, outputs, finished, snapshot):
        self.finished += [f.finish_reason for f in finished]




def test_groups_match_the_offline_engine_and_a_failed_step_fails_only_its_requests(llama_dir):
    ids = [[3, 17, 42, 9], [8, 8, 100]]
    want = [o.token_ids for o in LLM(str(llama_dir)).generate(ids, GREEDY)]
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    rec = Recorder()
    ae = AsyncEngine(engine, max_waiting=4, observers=[rec])

    async def main():
        ae.start()
        try:
            group = await ae.add([PromptSpec(i, GREEDY) for i in ids], "g")
            outs = await collect(group)
            assert [outs[i].token_ids for i in range(2)] == want

            real_step = engine.step
            calls = {"n": 0}

            def failing_step():
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("injected")
                return real_step()

            engine.step = failing_step
            group = await ae.add([PromptSpec(ids[0], GREEDY)], "bad")
            with pytest.raises(EngineError, match="injected"):
                await collect(group)
            engine.step = real_step
            # The engine keeps serving, and the failed request left nothing behind.
            group = await ae.add([PromptSpec(ids[1], GREEDY)], "after")
            assert (await collect(group))[0].token_ids == want[1]
            assert engine.kv.usage == 0 and not engine.requests

            with pytest.raises(ValueError, match="sequences"):
                await ae.add([PromptSpec(ids[0], GREEDY)] * 5, "too-many")
            with pytest.raises(ValueError, match="prompt"):
                await ae.add([PromptSpec([], GREEDY)], "empty")
            assert ae.num_open_groups == 0
        finally:
            await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineStopped):
            await ae.add([PromptSpec(ids[0], GREEDY)], "late")

    asyncio.run(main())
    assert rec.finished.count("length") == 3 and rec.finished.count("abort") == 1


def test_waiting_limit_refuses_with_overloaded(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=1))
    ae = AsyncEngine(engine, max_waiting=1)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        ae.start()
        try:
            running = await ae.add([PromptSpec([5, 6, 7], long)], "a")
            await running.__anext__()  # it runs: the only sequence slot is taken
            queued = await ae.add([PromptSpec([5, 6], GREEDY)], "b")
            with pytest.raises(EngineOverloaded):
                await ae.add([PromptSpec([5], GREEDY)], "c")
            running.close()  # abort: frees the slot for the queued one
            assert len((await collect(queued))[0].token_ids) == 6
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_a_request_whose_sampling_fails_fails_alone(llama_dir):
    """A sampling failure tied to one request's settings ends that request with an error;
    the others in the same step go on, token for token as they would have. A forward pass
    that fails fails only the requests of that step, not those still waiting."""
    ids = [[3, 17, 42, 9], [8, 8, 100], [5, 6, 7]]
    want = [o.token_ids for o in LLM(str(llama_dir)).generate(ids, GREEDY)]
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=2))
    poison = SamplingParams(temperature=0.7, top_k=7, max_tokens=6, ignore_eos=True)
    real_sample_rows = engine.sampler._sample_rows

    def sample_rows(requests, logits):
        if any(r.params.top_k == 7 for r in requests):
            raise RuntimeError("this request's settings break the sampler")
        return real_sample_rows(requests, logits)

    engine.sampler._sample_rows = sample_rows
    ae = AsyncEngine(engine)

    async def main():
        ae.start()
        try:
            good = await ae.add([PromptSpec(ids[0], GREEDY)], "good")
            bad = await ae.add([PromptSpec(ids[1], poison)], "bad")
            with pytest.raises(EngineError, match="settings break the sampler"):
                await collect(bad)
            assert (await collect(good))[0].token_ids == want[0]

            assert engine.kv.usage == 0 and not engine.requests
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_a_failed_forward_pass_fails_only_the_requests_of_its_step(llama_dir):
    ids = [[3, 17, 42, 9], [5, 6, 7]]
    want = LLM(str(llama_dir)).generate(ids[1], GREEDY)[0].token_ids
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=1))
    real_execute = engine.runner.execute
    failed = []

    def execute(batch, tables):
        # Once the second request waits behind the first, the step (holding only the
        # first) fails.
        if not failed and "queued" in engine.requests:
            failed.append([r.request_id for r in batch.requests])
            raise RuntimeError("forward pass broke")
        return real_execute(batch, tables)

    engine.runner.execute = execute
    ae = AsyncEngine(engine)
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def main():
        ae.start()
        try:
            first = await ae.add([PromptSpec(ids[0], long)], "first")
            await first.__anext__()  # it runs and holds the only sequence slot
            queued = await ae.add([PromptSpec(ids[1], GREEDY)], "queued")
            with pytest.raises(EngineError, match="forward pass broke"):
                await collect(first)
            assert (await collect(queued))[0].token_ids == want
            assert failed == [["first"]]
            assert engine.kv.usage == 0 and not engine.requests
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_an_add_never_waits_forever_when_the_engine_thread_dies(llama_dir):
    """The engine thread dies while handling a batch of commands: every add it took off the
    queue gets an error, not an endless wait."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    ae = AsyncEngine(engine)
    real_add = engine.add_request

    def dying_add(*a, **kw):
        raise SystemExit("the engine thread is going down")  # not an Exception: kills it

    async def main():
        ae.start()
        try:
            engine.add_request = dying_add
            with pytest.raises(EngineError, match="engine thread failed"):
                await asyncio.wait_for(ae.add([PromptSpec([1, 2], GREEDY)], "x"), 30)
            await asyncio.to_thread(ae._thread.join, 30)  # it ends right after answering
            assert not ae.is_alive
            with pytest.raises(EngineStopped):
                await ae.add([PromptSpec([1, 2], GREEDY)], "y")
        finally:
            engine.add_request = real_add
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def _hanging(step):
    """A step that hangs until released: (it, set once it is entered, its release)."""
    entered, release = threading.Event(), threading.Event()

    def hanging_step():
        entered.set()
        release.wait(60)
        return step()

    return hanging_step, entered, release


def test_a_step_that_does_not_end_makes_the_engine_stuck_until_it_ends(llama_dir):
    """A step that hangs (a kernel, a machine swapping): past ``step_timeout_s`` the engine
    is not alive, its reason names the step, and a new request is refused at once instead
    of waiting behind it. Once the step ends, the request it held finishes as it would
    have, and the engine takes requests again. Waiting for work is no step: an idle engine
    stays alive however short the timeout."""
    ids = [3, 17, 42, 9]
    want = LLM(str(llama_dir)).generate([ids], GREEDY)[0].token_ids
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    ae = AsyncEngine(engine, step_timeout_s=0.2)
    real_step = engine.step
    hanging_step, entered, release = _hanging(real_step)

    async def until(condition):
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def main():
        ae.start()
        try:
            for _ in range(40):  # idle rounds wait up to 0.5 s each for a command
                assert ae.is_alive and not ae.stuck
                await asyncio.sleep(0.05)
            engine.step = hanging_step
            held = await ae.add([PromptSpec(ids, GREEDY)], "held")
            await asyncio.to_thread(entered.wait, 30)
            await until(lambda: not ae.is_alive)
            assert ae.stuck and not ae.is_alive
            assert "in one step for" in ae.down_reason and "--step-timeout" in ae.down_reason
            with pytest.raises(EngineUnavailable, match="in one step for"):
                await ae.add([PromptSpec(ids, GREEDY)], "refused")
            engine.step = real_step
            release.set()
            assert (await collect(held))[0].token_ids == want
            await until(lambda: ae.is_alive)
            assert ae.is_alive and not ae.stuck
            after = await ae.add([PromptSpec(ids, GREEDY)], "after")
            assert (await collect(after))[0].token_ids == want
        finally:
            engine.step = real_step
            release.set()
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_a_stuck_engine_answers_503_on_health_and_to_new_requests(llama_dir):
    """Over HTTP: /health says the engine is stuck and why (a liveness probe restarts it),
    a new request gets 503 with Retry-After and code "unavailable" rather than a wait of
    unknown length, and the stream the step held carries on once it ends."""
    from fastapi.testclient import TestClient

    from phasewise.server.app import OpenAIServer, ServerConfig

    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    server = OpenAIServer(AsyncEngine(engine, step_timeout_s=0.2),
                          ServerConfig(served_model_name="m"))
    real_step = engine.step
    hanging_step, entered, release = _hanging(real_step)

    body = {"prompt": [3, 17, 42, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with TestClient(server.app) as tc:
        want = tc.post("/v1/completions", json=body).json()["choices"][0]["text"]
        engine.step = hanging_step
        held: dict = {}
        thread = threading.Thread(target=lambda: held.update(
            r=tc.post("/v1/completions", json=body)))
        thread.start()
        try:
            assert entered.wait(30)
            for _ in range(300):
                health = tc.get("/health")
                if health.status_code == 503:
                    break
                time.sleep(0.02)
            assert health.status_code == 503, health.text
            assert "in one step for" in health.json()["error"]["message"]
            engine_health = tc.get("/health/engine")  # (a liveness probe's question)
            assert engine_health.status_code == 503
            assert "in one step for" in engine_health.json()["error"]["message"]
            refused = tc.post("/v1/completions", json=body)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "unavailable"
            assert "in one step for" in refused.json()["error"]["message"]
            assert refused.headers["retry-after"] == "1"
        finally:
            engine.step = real_step
            release.set()
            thread.join(60)
        assert held["r"].status_code == 200
        assert held["r"].json()["choices"][0]["text"] == want
        assert tc.get("/health").status_code == 200
        assert tc.get("/health/engine").json() == {"status": "ok"}


def test_a_step_timeout_must_be_positive(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step_timeout_s must be in"):
            AsyncEngine(engine, step_timeout_s=bad)
    assert AsyncEngine(engine, step_timeout_s=None).step_timeout_s is None


def test_a_newcomer_gets_its_first_token_while_a_big_group_holds_the_seats(llama_dir):
    """One request of many sequences within every limit took all the seats, and another
    client waited for its first token until whole generations of it ended. Its sequences
    form one group: the newcomer's first token comes while most of the group is still
    running, and every sequence still ends as it would alone."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4))
    ae = AsyncEngine(engine, max_waiting=64)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = LLM(str(llama_dir)).generate([[5, 6, 7]], long)[0].token_ids

    async def main():
        ae.start()
        try:
            big = await ae.add([PromptSpec([5, 6, 7], long)] * 12, "big")
            first = await big.__anext__()  # the group runs
            assert first is not None
            small = await ae.add([PromptSpec([9, 10], GREEDY)], "small")
            await small.__anext__()  # its first token
            left = sum(1 for r in engine.requests.values() if r.group is not None)
            assert left >= 8  # FCFS would have run two-thirds of the group first
            assert len((await collect(small))[0].token_ids) == 6
            outs = await collect(big)
            assert all(outs[i].token_ids == want for i in range(12))
            assert engine.kv.usage == 0 and not engine.requests
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_an_id_reused_right_after_its_abort_gets_none_of_the_old_outputs(llama_dir):
    """A router moving a stream back to a worker reuses its request id: outputs of the
    aborted request still on their way to the event loop landed in the new group (21
    tokens for max_tokens 20, one repeated)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = LLM(str(llama_dir)).generate([[5, 6, 7]], params)[0].token_ids
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    ae = AsyncEngine(engine, max_waiting=8)

    async def main():
        ae.start()
        try:
            for trial in range(5):
                old = await ae.add([PromptSpec([5, 6, 7], params)], f"x{trial}")
                got: list[int] = []
                while len(got) < 2:
                    _, out = await old.__anext__()
                    got = list(out.token_ids)
                old.close()  # the relay is gone; the same id comes straight back
                since = time.monotonic()
                new = await ae.add([PromptSpec([5, 6, 7], params, resume=tuple(got))],
                                   f"x{trial}")
                outs = [out async for _, out in new]
                # every output is the new request's (an old one arrived before it)
                assert all(o.metrics.arrival_time >= since for o in outs), trial
                assert list(outs[-1].token_ids) == want, trial
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


def test_a_reader_that_falls_behind_finds_a_bounded_number_of_outputs():
    """A stream whose client stopped reading: past MERGE_AFTER waiting outputs of a request,
    its later ones merge into the latest not yet taken (deltas joined, the rest the
    latest), so what waits stays bounded however long the output grows; a reader a few
    steps behind still gets one output per step; never merged across a notice or an
    error."""
    from phasewise.engine.backend import RequestGroup
    from phasewise.engine.outputs import RequestOutput
    from phasewise.engine.request import RequestMetrics

    k = RequestGroup.MERGE_AFTER

    def out(rid, n, finished=False):
        ids = list(range(n))
        return RequestOutput(rid, None, [1], "x" * n, ids, "x", [n - 1], finished,
                             "length" if finished else None, None, [{i: -0.5} for i in ids],
                             RequestMetrics(0.0))

    async def run():
        group = RequestGroup(["a", "b"], abort=lambda ids: None, on_close=lambda ids: None)
        for n in range(1, 201):  # 200 steps of both, nothing read
            group._put(out("a", n))
            group._put(out("b", n, finished=n == 200))
        assert group._queue.qsize() == 2 * k
        got = [await group.__anext__() for _ in range(2 * k)]
        a = [o for i, o in got if i == 0]
        b = [o for i, o in got if i == 1]
        assert [o.delta_token_ids for o in a[:-1]] == [[n] for n in range(k - 1)]
        assert a[-1].delta_token_ids == list(range(k - 1, 200))  # the rest, merged
        assert a[-1].delta_text == "x" * (200 - k + 1) and len(a[-1].logprobs) == 200
        assert b[-1].finished and b[-1].finish_reason == "length"
        assert sum(len(o.delta_token_ids) for o in b) == 200
        # a few steps behind: one output each
        for n in range(201, 204):
            group._put(out("a", n))
        assert [(await group.__anext__())[1].delta_token_ids for _ in range(3)] == [
            [200], [201], [202]]
        # never across a notice or an error
        for n in range(204, 204 + k):
            group._put(out("a", n))
        group.notify("handover")
        group._put(out("a", 204 + k))
        got = [await group.__anext__() for _ in range(k + 2)]
        assert [i for i, _ in got] == [0] * k + [-1, 0]
        assert got[-1][1].delta_token_ids == [203 + k]
        group._put(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            await group.__anext__()

    asyncio.run(run())


def test_a_group_nobody_reads_is_parked_and_gives_its_seats_to_one_that_is_read(llama_dir):
    """Eight n=16 streams nobody read held every seat of a server for a minute, and another
    client's request waited 77 s for its first token. A request whose outputs start to merge
    (its reader is MERGE_AFTER behind) is parked: it runs no tokens and gives up its seat to
    a waiting request; once its reader has taken everything, it runs on to the same output
    an unbroken run gives."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4))
    ae = AsyncEngine(engine)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    want = LLM(str(llama_dir)).generate([[3, 17, 42, 9]], long)[0].token_ids

    async def main():
        ae.start()
        try:
            hog = await ae.add([PromptSpec([3, 17, 42, 9], long)] * 4, "hog")  # every seat
            while not hog._parked:  # (nobody reads it)
                await asyncio.sleep(0.01)
            while ae.snapshot.num_parked < 1:  # (published after the park lands)
                await asyncio.sleep(0.01)
            victim = await ae.add([PromptSpec([8, 8, 100], GREEDY)], "victim")
            got = await collect(victim)
            assert len(got[0].token_ids) == GREEDY.max_tokens
            behind = [len(r.output_token_ids) for r in engine.requests.values()
                      if r.request_id.startswith("hog")]
            assert behind and max(behind) < long.max_tokens  # served while the hog stood
            outs = await collect(hog)  # now read: it runs on to its end
            assert all(outs[i].token_ids == want for i in range(4))
            assert not hog._parked and ae.snapshot.num_parked == 0
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())
