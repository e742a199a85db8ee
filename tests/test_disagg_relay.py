"""The internal relay a router uses (``/internal/v1/*``, ``phasewise.engine.relay``), in process:
a worker's output lines rebuild the same outputs the engine made; bad relay input is a 400
naming the field; the routes are behind --api-key; the decode role routes around a busy
prefill worker and counts why it prefilled locally."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import httpx
import pytest

from phasewise import LLM, SamplingParams
from phasewise.config import EngineConfig
from phasewise.engine.async_engine import AsyncEngine
from phasewise.engine.outputs import RequestOutput
from phasewise.engine.relay import (OutputAssembler, RelayError, encode_output, param_defaults,
                                    params_from_wire, params_to_wire)
from phasewise.engine.request import RequestMetrics
from phasewise.server.app import OpenAIServer, ServerConfig


def _out(i: int, text: str, ids: list[int], lps, finished: bool) -> RequestOutput:
    return RequestOutput(f"r-{i}", None, [1, 2], text, ids, text, ids, finished,
                         "length" if finished else None, None, lps, RequestMetrics(0.0))


def test_output_lines_rebuild_text_ids_logprobs_and_the_workers_timing():
    asm = OutputAssembler(["g-0", "g-1"], [[1, 2], [3]], ["ab", None], arrival_time=0.0,
                          clock=iter([1.0, 2.0, 3.0, 4.0]).__next__)
    asm.admitted()
    lines = [encode_output(1, _out(1, "x", [5], [{5: -0.5, 6: -1.0}], False), None),
             encode_output(0, _out(0, "é", [7, 8], None, False), None),
             encode_output(1, _out(1, "yz", [9], [{9: -0.25}], True), {"queue_s": 0.5,
                                                                       "cached_tokens": 16})]
    outs = [asm.feed(line) for line in lines]
    assert [o.request_id for o in outs] == ["g-1", "g-0", "g-1"]
    last = outs[2]
    assert last.finished and last.finish_reason == "length"
    assert last.text == "xyz" and last.token_ids == [5, 9] and last.delta_token_ids == [9]
    assert last.logprobs == [{5: -0.5, 6: -1.0}, {9: -0.25}]
    # The router's clock: first token at its first line, every token at its line's time.
    assert last.metrics.first_token_time == 2.0 and last.metrics.token_times == [2.0, 4.0]
    assert last.metrics.worker_timing == {"queue_s": 0.5, "cached_tokens": 16}
    assert last.metrics.num_cached_tokens == 16
    assert outs[1].text == "é" and outs[1].prompt == "ab" and not outs[1].finished
    # A finished request takes no more lines; garbage is refused, not guessed at.
    for bad in (lines[2], b"{}", b"not json", b'{"i": 9, "text": "", "ids": [], "lp": null}',
                b'{"i": 0, "text": 3, "ids": [], "lp": null}',
                b'{"i": 0, "text": "", "ids": ["a"], "lp": null}'):
        with pytest.raises(RelayError):
            asm.feed(bad)


def test_an_output_keeps_its_own_tokens_and_logprobs_when_later_lines_arrive():
    """A stream's reader takes each output's delta from the end of its lists, often after
    the next lines were fed: an output's lists are its own, as an engine's are."""
    asm = OutputAssembler(["g"], [[1, 2]], [None], arrival_time=0.0)
    first = asm.feed(encode_output(0, _out(0, "a", [5], [{5: -0.5}], False), None))
    asm.feed(encode_output(0, _out(0, "b", [6], [{6: -0.25}], False), None))
    assert first.token_ids == [5] and first.logprobs == [{5: -0.5}]
    assert first.logprobs[-len(first.delta_token_ids):] == [{5: -0.5}]


@pytest.mark.parametrize("line", [
    {"i": 0, "text": "x", "ids": [999999], "lp": None},  # past the vocabulary
    {"i": 0, "text": "x", "ids": [-7], "lp": None},
    {"i": 0, "text": "x", "ids": [10 ** 30], "lp": None},
    {"i": 0, "text": "x", "ids": [True], "lp": None},
    {"i": 0, "text": "x", "ids": [5], "lp": [[[999999, -0.5]]]},
    {"i": 0, "text": "x", "ids": [5], "lp": [[[5, "nan"]]]},
    {"i": 0, "text": "", "ids": [], "lp": None, "fin": "length",
     "timing": {"cached_tokens": 1e400}},
    {"i": 0, "text": "", "ids": [], "lp": None, "fin": "length",
     "timing": {"kv_bytes": "lots"}},
])
def test_a_line_with_a_token_or_figure_no_worker_sends_is_refused(line):
    """A foreign worker's id 10**30 or -7 reached the tokenizer (a 500 and a traceback),
    999999 streamed as "", and a timing of 1e400 failed the relay with an OverflowError."""
    asm = OutputAssembler(["g"], [[1, 2]], [None], arrival_time=0.0, vocab_size=512)
    with pytest.raises(RelayError):
        asm.feed(json.dumps(line).replace("1e+400", "1e400"))
    ok = asm.feed(json.dumps({"i": 0, "text": "a", "ids": [5], "lp": [[[5, -0.5],
                                                                        [7, float("-inf")]]]}))
    assert ok.token_ids == [5]  # a -inf logprob (a token the filters ruled out) is one


def test_text_a_workers_tokens_could_not_decode_to_is_refused():
    """A foreign worker's 15 MB text deltas grew a 40-token reply to 555 MB in the router,
    and a lone surrogate became a 500: both are an unusable line now, and text as long as
    the tokens' entries allow still passes."""
    asm = OutputAssembler(["g"], [[1, 2]], [None], arrival_time=0.0, vocab_size=512,
                          max_token_chars=10)
    with pytest.raises(RelayError, match="lone|surrogate|UnicodeEncodeError"):
        asm.feed(json.dumps({"i": 0, "text": "\ud800", "ids": [5], "lp": None}))
    ok = asm.feed(json.dumps({"i": 0, "text": "é" * (11 * 2 + 64), "ids": [5, 6],
                              "lp": None}))
    assert len(ok.text) == 86
    with pytest.raises(RelayError, match="more than their 97 could decode to"):
        asm.feed(json.dumps({"i": 0, "text": "x" * 12, "ids": [7], "lp": None}))
    free = OutputAssembler(["g"], [[1]], [None], arrival_time=0.0)  # no bound given
    assert free.feed(json.dumps({"i": 0, "text": "x" * 5000, "ids": [5], "lp": None}))


def test_a_relay_numbers_its_own_specs_and_the_assembler_maps_them():
    """A migration resends only a group's unfinished requests: the relay's spec 0 is the
    group's request 1."""
    asm = OutputAssembler(["g-0", "g-1"], [[1], [1]], [None, None], arrival_time=0.0)
    out = asm.feed(encode_output(0, _out(0, "x", [7], None, False), None), index=[1])
    assert out.request_id == "g-1" and asm.ids == [[], [7]]
    with pytest.raises(RelayError):  # outside the relay's own numbering
        asm.feed(encode_output(1, _out(1, "x", [7], None, False), None), index=[1])


def test_usage_counts_the_prompts_cache_hits_where_it_was_first_served():
    """A worker that resumes a moved request counts cache hits over the prompt and the
    tokens it was resumed with (here 4 of 3 + 1): usage keeps the first worker's count of
    the prompt's own, and a count past what the worker was sent is refused."""
    def line(ids, cached, fin=False, timing=None):
        out = _out(0, "x", ids, None, fin)
        out.metrics.num_cached_tokens = cached
        return encode_output(0, out, timing, first=True)

    asm = OutputAssembler(["g"], [[1, 2, 3]], [None], arrival_time=0.0)
    assert asm.feed(line([5], 2)).metrics.num_cached_tokens == 2  # worker A, then it died
    last = asm.feed(line([6], 4, fin=True, timing={"cached_tokens": 4}), index=[0])
    assert last.metrics.num_cached_tokens == 2 and last.token_ids == [5, 6]
    assert last.metrics.worker_timing == {"cached_tokens": 2}  # timings agree with usage
    fresh = OutputAssembler(["g"], [[1, 2, 3]], [None], arrival_time=0.0)
    with pytest.raises(RelayError, match="cached prompt count of 4"):
        fresh.feed(line([5], 4))


def test_prompt_logprobs_cross_on_a_requests_first_line():
    out = _out(0, "x", [5], None, True)
    out.prompt_logprobs = [None, {2: -0.75, 9: -0.5}]
    first = encode_output(0, out, None, first=True)
    assert json.loads(encode_output(0, out, None))  # later lines leave them out
    assert "plp" not in json.loads(encode_output(0, out, None))
    asm = OutputAssembler(["g"], [[1, 2]], [None], arrival_time=0.0)
    assert asm.feed(first).prompt_logprobs == [None, {2: -0.75, 9: -0.5}]


def test_sampling_params_cross_the_wire_unchanged():
    p = SamplingParams(temperature=0.7, top_k=5, stop=["\n\n", "x"], seed=3, max_tokens=9,
                       logprobs=2, prompt_logprobs=1)
    assert params_from_wire(json.loads(json.dumps(params_to_wire(p)))) == p
    assert param_defaults(SamplingParams()) == {}
    assert param_defaults(p)["top_k"] == 5
    with pytest.raises(ValueError, match="unknown sampling parameters.*bogus"):
        params_from_wire({"bogus": 1})


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from conftest import build_hf_checkpoint

    path = tmp_path_factory.mktemp("relay") / "m"
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=5, max_position_embeddings=128)
    return path


def _serve(path, **config):
    engine = AsyncEngine.from_config(EngineConfig(model=str(path)))
    return engine, OpenAIServer(engine, ServerConfig(served_model_name="m", **config))


def test_internal_generate_streams_what_the_engine_makes_and_checks_its_input(worker):
    engine, server = _serve(worker, api_key="k")
    ids = LLM(str(worker)).tokenizer.encode("def f(x):")
    want = LLM(str(worker)).generate(ids, SamplingParams(temperature=0, max_tokens=6,
                                                         ignore_eos=True, logprobs=1))[0]
    auth = {"Authorization": "Bearer k"}

    async def run():
        engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
            # Behind --api-key, like /v1.
            assert (await c.get("/internal/v1/info")).status_code == 401
            info = (await c.get("/internal/v1/info", headers=auth)).json()
            assert info["role"] == "both" and info["info"]["max_model_len"] == 128
            assert len(info["config_sha256"]) == 64
            params = params_to_wire(SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True, logprobs=1))
            r = await c.post("/internal/v1/generate", headers=auth, json={
                "request_id": "cmpl-1", "specs": [{"token_ids": ids, "params": params}]})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("application/x-ndjson")
            asm = OutputAssembler(["cmpl-1"], [ids], [None], 0.0)
            outs = [asm.feed(line) for line in r.text.splitlines()]
            assert outs[-1].finished and outs[-1].token_ids == want.token_ids
            assert outs[-1].text == want.text
            assert [max(d, key=d.get) for d in outs[-1].logprobs] == want.token_ids
            assert outs[-1].metrics.worker_timing["prefill_s"] >= 0
            # Each bad input: a 400 naming the field.
            bad = [({"request_id": "a b", "specs": [{"token_ids": ids, "params": {}}]},
                    "request_id"),
                   ({"request_id": "x", "specs": [{"token_ids": [10 ** 6], "params": {}}]},
                    "specs.0.token_ids"),
                   ({"request_id": "x", "specs": [{"token_ids": ids,
                                                  "params": {"top_k": "many"}}]},
                    "specs.0.params.top_k"),
                   ({"request_id": "x", "specs": [{"token_ids": ids,
                                                  "params": {"ignore_eos": "no"}}]},
                    "specs.0.params.ignore_eos"),
                   ({"request_id": "x", "specs": [{"token_ids": ids,
                                                  "params": {"max_tokens": 10 ** 4}}]},
                    "specs.0.params.max_tokens"),
                   ({"request_id": "x", "specs": [{"token_ids": ids, "params": {},
                                                  "extra": 1}]}, "specs.0.extra"),
                   # a stop id past the vocabulary, refused as /v1 refuses it
                   ({"request_id": "x", "specs": [{"token_ids": ids, "params": {
                       "stop_token_ids": [10 ** 9]}}]}, "specs.0.params.stop_token_ids")]
            for body, param in bad:
                r = await c.post("/internal/v1/generate", headers=auth, json=body)
                assert r.status_code == 400, (body, r.text)
                assert r.json()["error"]["param"] == param, r.json()
            # n samples of one prompt: its ids cross once, the others point at it.
            r = await c.post("/internal/v1/generate", headers=auth, json={
                "request_id": "cmpl-2", "specs": [{"token_ids": ids, "params": params},
                                                  {"same_as": 0, "params": params}]})
            asm = OutputAssembler(["cmpl-2-0", "cmpl-2-1"], [ids, ids], [None, None], 0.0)
            finals = [o for o in map(asm.feed, r.text.splitlines()) if o.finished]
            assert [o.token_ids for o in finals] == [want.token_ids] * 2
            # ... and their parameters once: the others send what differs (a seed)
            seeded = params_to_wire(SamplingParams(temperature=1.0, max_tokens=6,
                                                   ignore_eos=True, seed=3))
            r = await c.post("/internal/v1/generate", headers=auth, json={
                "request_id": "cmpl-3", "specs": [
                    {"token_ids": ids, "params": seeded},
                    {"same_as": 0, "params_from": 0, "params": {"seed": 3}},
                    {"same_as": 0, "params_from": 0, "params": {"seed": 4}}]})
            asm = OutputAssembler([f"cmpl-3-{i}" for i in range(3)], [ids] * 3, [None] * 3,
                                  0.0)
            finals = {o.request_id: o.token_ids for o in map(asm.feed, r.text.splitlines())
                      if o.finished}
            assert finals["cmpl-3-0"] == finals["cmpl-3-1"]  # the same seed: the same draw
            r = await c.post("/internal/v1/generate", headers=auth, json={
                "request_id": "x", "specs": [{"token_ids": ids, "params_from": 0,
                                              "params": {}}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "specs.0.params_from"
            for specs, param in (([{"same_as": 0, "params": params}], "specs.0.same_as"),
                                 ([{"token_ids": ids, "same_as": 0, "params": params}],
                                  "specs.0")):
                r = await c.post("/internal/v1/generate", headers=auth,
                                 json={"request_id": "x", "specs": specs})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            load = (await c.get("/internal/v1/load", headers=auth)).json()
            assert load["alive"] and load["snapshot"]["num_running"] == 0
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_only_a_relay_groups_own_key_aborts_it_and_never_a_v1_clients_request(worker):
    """/internal/v1/abort took any id: a client that learnt another's (the dashboard shows
    them) froze that client's stream with no end. Now it aborts a relay group's requests,
    and only with the key the group's router sent."""
    engine, server = _serve(worker)
    ids = LLM(str(worker)).tokenizer.encode("def f(x):")
    long = params_to_wire(SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))

    async def running(prefix: str) -> list[str]:
        for _ in range(2000):
            got = [r for r in list(engine.engine.requests) if r.startswith(prefix)]
            if got:
                return got
            await asyncio.sleep(0.005)
        raise AssertionError(f"no request {prefix}* ran")

    async def run():
        engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w",
                                     timeout=120) as c:
            victim = asyncio.ensure_future(c.post("/v1/completions", json={
                "prompt": ids, "max_tokens": 100, "ignore_eos": True, "temperature": 0}))
            (rid,) = await running("cmpl-")
            r = await c.post("/internal/v1/abort", json={"request_ids": [rid],
                                                        "abort_key": "x" * 32})
            assert r.status_code == 200 and r.json() == {"aborted": 0}
            r = await c.post("/internal/v1/abort", json={"request_ids": [rid]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "abort_key"
            done = (await victim).json()
            assert done["choices"][0]["finish_reason"] == "length"
            assert done["usage"]["completion_tokens"] == 100  # it ran to its end

            key = "k" * 32
            relay = asyncio.ensure_future(c.post("/internal/v1/generate", json={
                "request_id": "relay-1", "abort_key": key,
                "specs": [{"token_ids": ids, "params": long}]}))
            (rid,) = await running("relay-1")
            r = await c.post("/internal/v1/abort", json={"request_ids": [rid],
                                                        "abort_key": "y" * 32})
            assert r.json() == {"aborted": 0} and rid in engine.engine.requests
            r = await c.post("/internal/v1/abort", json={"request_ids": [rid, rid],
                                                        "abort_key": key})
            assert r.json() == {"aborted": 1}
            for _ in range(2000):
                if rid not in engine.engine.requests:
                    break
                await asyncio.sleep(0.005)
            assert rid not in engine.engine.requests
            relay.cancel()  # the router that asked closes the stream itself
            with contextlib.suppress(asyncio.CancelledError):
                await relay
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_a_groups_samples_send_their_parameters_once():
    """n=16 samples with a 600 KB schema made a 9.6 MB relay body, past the worker's 8 MiB:
    the samples after the first send only what differs from it."""
    from phasewise.disagg.router import _wire_specs
    from phasewise.engine.backend import PromptSpec
    from phasewise.engine.relay import params_from_wire

    ids = [5, 6, 7]
    big = SamplingParams(temperature=1.0, max_tokens=4, stop=["x" * 50000])
    specs = [PromptSpec(ids, dataclasses.replace(big, seed=10 + j)) for j in range(16)]
    wire = _wire_specs(specs, range(16))
    assert len(json.dumps(wire)) < 2 * 50000  # the long stop string crossed once
    assert wire[0]["params"]["seed"] == 10 and "params_from" not in wire[0]
    assert all(w["params_from"] == 0 and w["params"] == {"seed": 10 + k}
               for k, w in enumerate(wire[1:], 1))
    rebuilt = [params_from_wire({**wire[0]["params"], **w["params"]}) for w in wire]
    assert rebuilt == [s.params for s in specs]


def test_the_router_names_a_workers_400_as_its_client_named_the_field():
    from phasewise.disagg.router import _client_param

    assert _client_param("specs.3.params.max_tokens") == "max_tokens"
    assert _client_param("specs.0.token_ids") == "prompt"
    assert _client_param("request_id") == "request_id" and _client_param(None) is None



def test_a_router_parks_a_relay_groups_requests_on_the_worker_with_its_key(worker):
    """Behind the router the decode worker never parked: the router reads on and merges, so
    the worker saw no reader fall behind, and eight unread streams held its seats (66.7 s to
    another client's first token). The router's group now tells the worker, with the
    group's key; any other key parks nothing."""
    import threading

    engine, server = _serve(worker)
    ids = LLM(str(worker)).tokenizer.encode("def f(x):")
    long = params_to_wire(SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    gate = threading.Event()  # the engine's steps wait on it: the park lands first
    step = engine.engine.step

    def gated_step():
        gate.wait()
        return step()

    engine.engine.step = gated_step

    async def until(cond):
        for _ in range(4000):
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("never happened")

    async def run():
        engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w",
                                     timeout=120) as c:
            key = "k" * 32
            relay = asyncio.ensure_future(c.post("/internal/v1/generate", json={
                "request_id": "relay-1", "abort_key": key,
                "specs": [{"token_ids": ids, "params": long}]}))
            await until(lambda: any(r.startswith("relay-1") for r in engine.engine.requests))
            (rid,) = [r for r in engine.engine.requests if r.startswith("relay-1")]
            req = engine.engine.requests[rid]
            r = await c.post("/internal/v1/park", json={"request_ids": [rid],
                                                       "abort_key": "y" * 32, "parked": True})
            assert r.json() == {"parked": 0}
            r = await c.post("/internal/v1/park", json={"request_ids": [rid],
                                                       "abort_key": key, "parked": True})
            assert r.json() == {"parked": 1}
            gate.set()
            await until(lambda: req.parked and engine.engine.stalled)  # nothing it may run
            assert req.num_output_tokens <= 1 and not req.finished
            r = await c.post("/internal/v1/park", json={"request_ids": [rid],
                                                       "abort_key": key, "parked": False})
            assert r.json() == {"released": 1}
            done = await relay  # runs on to its end
            assert done.status_code == 200 and '"fin": "length"' in done.text
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_the_routers_group_tells_the_worker_to_park_in_order_with_the_relays_names(worker):
    """A client behind on request 1 of a group relayed as its spec 0 (after a move): the
    router posts park for the relay's own name, with the group's key, then the release;
    posts go one at a time, so a release never overtakes its park, and a park released
    before it went out sends nothing."""
    from phasewise.disagg.fleet import Worker
    from phasewise.disagg.router import Router, _Relay, _relay_ids, _Stream
    from phasewise.engine.backend import RequestGroup

    router = Router(["http://127.0.0.1:9"], model_dir=worker)
    posts = []

    class Client:
        async def post(self, url, json):
            posts.append((url, json))
            await asyncio.sleep(0.01)  # a park still in flight when the release is asked

    async def run():
        router._loop, router._client = asyncio.get_running_loop(), Client()
        w = Worker("http://w:1", "decode")
        relay = _Relay(w, None, None, index=[1])  # type: ignore[arg-type]
        stream = _Stream("cmpl-x", [], [], relay, abort_key="k" * 32)
        group = RequestGroup(["cmpl-x-0", "cmpl-x-1"], router.abort, router._closed,
                             park=router.park)
        for rid in group.request_ids:
            router._groups[rid] = (group, None, stream)
        router.park(["cmpl-x-1"], True)
        router.park(["cmpl-x-1"], False)  # before anything went out: nothing is sent
        while router._background:
            await asyncio.gather(*router._background)
        assert posts == []
        router.park(["cmpl-x-1"], True)
        await asyncio.sleep(0.001)  # its post in flight
        router.park(["cmpl-x-1"], False)
        router.park(["cmpl-x-0"], True)  # not on this relay: nothing to send for it
        while router._background:
            await asyncio.gather(*router._background)

    asyncio.run(run())
    name = _relay_ids("cmpl-x", 1)[0]
    assert posts[0] == ("http://w:1/internal/v1/park",
                        {"request_ids": [name], "abort_key": "k" * 32, "parked": True})
    assert [p[1]["parked"] for p in posts] == [True, False]


def test_a_moved_stream_is_parked_again_on_its_new_worker(worker):
    """A client that stopped reading a stream whose worker then died: the new worker ran
    its requests to the end unparked (the router had sent the park to the old one only).
    A move posts the parked set to the new worker, also when a park to the old one was
    still in flight."""
    from phasewise.disagg.fleet import Worker
    from phasewise.disagg.router import Router, _Relay, _Stream
    from phasewise.engine.backend import RequestGroup

    router = Router(["http://127.0.0.1:9"], model_dir=worker)
    posts = []

    class Client:
        async def post(self, url, json):
            posts.append((url, json["parked"]))
            await asyncio.sleep(0.01)

    async def run():
        router._loop, router._client = asyncio.get_running_loop(), Client()
        old, new = (_Relay(Worker(u, "decode"), None, None, index=[0])  # type: ignore
                    for u in ("http://a:1", "http://b:1"))
        stream = _Stream("cmpl-y", [], [], old, abort_key="k" * 32)
        group = RequestGroup(["cmpl-y-0"], router.abort, router._closed, park=router.park)
        router._groups["cmpl-y-0"] = (group, None, stream)
        router.park(["cmpl-y-0"], True)
        await asyncio.sleep(0.001)  # the park to A in flight as the stream moves
        stream.relay = new
        router._repark(stream)
        while router._background:
            await asyncio.gather(*router._background)
        assert stream.parked_sent == {0}
        stream.parked.clear()
        router._repark(stream)  # a move with nothing parked sends nothing
        while router._background:
            await asyncio.gather(*router._background)

    asyncio.run(run())
    assert posts == [("http://a:1/internal/v1/park", True),
                     ("http://b:1/internal/v1/park", True)]



def test_the_routers_counters_never_count_a_workers_lifetime_twice(worker):
    """A worker that missed one poll (marked down) dropped out of the router's summed
    snapshot, and back in it added its whole lifetime's prefix lookups to the counter
    again. The router counts what each worker's counters grew by, and a restart (a counter
    that went down) as all new."""
    import dataclasses as dc

    from phasewise.disagg.router import _EMPTY, Router

    router = Router(["http://a:1", "http://b:1"], model_dir=worker)
    a, b = router.decode
    a.up = b.up = True

    def poll(w, queries):
        w.snapshot = dc.replace(_EMPTY, prefix_queries=queries, num_running=1)
        router._count(w.url, w.snapshot)

    poll(a, 100_000)
    poll(b, 10)
    assert router.snapshot.prefix_queries == 100_010
    a.up = False  # one missed poll
    assert router.snapshot.prefix_queries == 100_010  # the counter does not fall
    assert router.snapshot.num_running == 1  # the moment's gauges are the workers up
    a.up = True
    poll(a, 100_050)
    assert router.snapshot.prefix_queries == 100_060  # grew by 50, not by 100,050
    poll(b, 3)  # b restarted: its 3 are new
    assert router.snapshot.prefix_queries == 100_063
