"""Admission by SLO: the forecast's arithmetic, the step clock that learns a step's cost from
the engine's own steps, and the server's refusal (429, Retry-After, a count by reason) of the
request that would miss its target, with a stubbed step cost; requests without a target are
never refused by it; hostile targets are clear 400s."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.config import EngineConfig
from phasewise.engine.async_engine import AsyncEngine
from phasewise.engine.slo import (SLO, Forecast, QueueState, StepClock, check_slo_ms,
                                  forecast, judge)
from phasewise.server.app import OpenAIServer, ServerConfig
from phasewise.server.metrics import PrometheusMetrics


def linear(a: float, b: float, c: float):
    return lambda p, d: a + b * p + c * d


def test_ttft_is_the_prompt_work_ahead_at_the_budget_left_by_the_decodes():
    # 4 decoding, 2 prompts ahead with 600 tokens left; budget 256, so 256 - (4 + 1) = 251
    # tokens of prompt a step; 600 + 200 own = 800 tokens: 3 full steps and 47 tokens
    q = QueueState(decodes=4, prefills=2, prefill_tokens=600, seated=6, finishing=(50,),
                   budget=256, max_seqs=16)
    cost = linear(0.01, 0.0001, 0.001)
    fc = forecast(q, 200, 1, cost)
    assert fc.ttft_s == pytest.approx(3 * cost(251, 5) + cost(47, 5))
    # its decode steps batch every running and waiting request and itself
    assert fc.tpot_s == pytest.approx(cost(0, 7))
    # ... and carry the prompt tokens recent steps carried (prompts that arrive meanwhile),
    # no more than the budget leaves
    assert forecast(q, 200, 1, cost, interference=100.4).tpot_s == pytest.approx(cost(100, 7))
    assert forecast(q, 200, 1, cost, interference=1e9).tpot_s == pytest.approx(cost(249, 7))


def test_with_every_seat_taken_the_wait_for_one_comes_first():
    q = QueueState(decodes=2, prefills=0, prefill_tokens=0, seated=2, finishing=(30, 70),
                   budget=64, max_seqs=2)
    cost = linear(0.02, 0.0, 0.0)
    fc = forecast(q, 10, 1, cost)
    assert fc.ttft_s == pytest.approx(30 * 0.02 + 0.02)
    # two short of a seat (a group of two): the second to finish frees the last one
    assert forecast(q, 10, 2, cost).ttft_s == pytest.approx(70 * 0.02 + 0.02)
    # decodes fill the whole budget: no prompt can ever be computed
    full = QueueState(decodes=64, prefills=0, prefill_tokens=0, seated=64, finishing=(5,),
                      budget=64, max_seqs=128)
    assert math.isinf(forecast(full, 10, 1, cost).ttft_s)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 64), st.integers(0, 8), st.integers(0, 5000), st.integers(1, 4000),
       st.integers(1, 4))
def test_more_work_ahead_never_forecasts_sooner(decodes, prefills, ahead, own, n):
    cost = linear(0.005, 0.00002, 0.0004)
    base = QueueState(decodes, prefills, ahead, decodes + prefills, (10,), 512, 256)
    more = QueueState(decodes, prefills, ahead + 300, decodes + prefills, (10,), 512, 256)
    a, b = forecast(base, own, n, cost), forecast(more, own, n, cost)
    assert b.ttft_s >= a.ttft_s >= 0


def test_judge_refuses_only_a_target_the_forecast_exceeds():
    fc = Forecast(ttft_s=2.5, tpot_s=0.05)
    assert judge(SLO(), fc) is None  # no target: never refused
    assert judge(SLO(ttft_s=3.0, tpot_s=0.06), fc, margin=0) is None
    r = judge(SLO(ttft_s=1.0), fc, margin=0)
    assert r.reason == "slo_ttft" and r.retry_after_s == 2 and "2500 ms" in r.message
    assert judge(SLO(tpot_s=0.04), fc, margin=0).reason == "slo_tpot"
    # the default margin: a forecast must leave a fifth of the target unused
    assert judge(SLO(ttft_s=3.2, tpot_s=0.0625), fc) is None
    assert judge(SLO(ttft_s=3.0), fc).reason == "slo_ttft"
    # a forecast far out (a seat freed only when a long request ends) sends the client
    # away for a minute at most
    assert judge(SLO(ttft_s=1.0), Forecast(ttft_s=5000.0, tpot_s=0.0)).retry_after_s == 60
    # a forecast the clock cannot make yet refuses nothing
    assert judge(SLO(ttft_s=0.001, tpot_s=0.001), Forecast(None, None)) is None


def _step(start, dur, prefill, decode, predicted=None):
    return SimpleNamespace(start_time=start, duration_s=dur, num_prefill_tokens=prefill,
                           num_decode_tokens=decode, predicted_s=predicted)


def test_the_clock_fits_the_steps_periods_and_scales_a_priced_model():
    clock = StepClock()
    assert clock.cost(100, 4) is None  # nothing seen: nothing said
    t = 0.0
    truth = linear(0.004, 0.0002, 0.001)
    for i in range(40):
        p, d = (64 * (i % 3), 1 + i % 5)
        period = truth(p, d)
        # the engine loop's own time between steps belongs to the period
        clock.observe(_step(t, period - 0.001, p, d, predicted=period / 2))
        t += period
    assert clock.cost(100, 4) == pytest.approx(truth(100, 4), rel=1e-6)
    # priced: the model's prediction times the live ratio of periods to predictions (2)
    assert clock.cost(100, 4, lambda p, d: 0.01) == pytest.approx(0.02)
    # an idle gap after a step is not its period
    clock2 = StepClock()
    for i in range(20):
        clock2.observe(_step(i * 10.0, 0.05, 32 * (i % 2), 2))
    assert clock2.cost(0, 2) == pytest.approx(0.05, rel=0.05)
    # the prompt tokens a new request's decode steps will share: those of the last second's
    # steps; an engine idle since a burst expects none (else a burst would refuse forever)
    assert clock2.prompt_share(now=190.5) == pytest.approx(32)  # the step at 190 s
    assert clock2.prompt_share(now=10_000.0) == 0.0
    # a decode worker whose prompts a prefill worker computes: decode steps only, priced;
    # a step with prompt tokens it has never seen, not
    clock3 = StepClock()
    for i in range(20):
        clock3.observe(_step(i * 0.01, 0.01, 0, 1 + i % 4))
    assert clock3.cost(0, 3) is not None and clock3.cost(16, 3) is None


@pytest.mark.parametrize("bad", [0, -1, 0.5, 3_600_001, math.nan, math.inf, True, "5"])
def test_targets_out_of_range_are_refused_with_the_range(bad):
    with pytest.raises(ValueError, match=r"milliseconds in \[1, 3.6e\+06\]"):
        check_slo_ms(bad, "--slo-ttft-ms")


# -- through the server, with a stubbed step cost ----------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from conftest import build_hf_checkpoint

    path = tmp_path_factory.mktemp("slo") / "m"
    build_hf_checkpoint(path, "LlamaForCausalLM", seed=5, max_position_embeddings=256)
    return path


def test_the_server_refuses_what_would_miss_and_serves_the_rest(model):
    metrics = PrometheusMetrics("m")
    engine = AsyncEngine.from_config(EngineConfig(model=str(model)), observers=[metrics])
    # every step costs 0.1 s + 1 ms a prompt token: a 10-token prompt's TTFT is ~0.11 s
    engine.engine.step_clock.cost = lambda p, d, predicted=None: 0.1 + 0.001 * p
    server = OpenAIServer(engine, ServerConfig(served_model_name="m", slo_tpot_ms=5000),
                          metrics)
    body = {"prompt": "def f(x):", "max_tokens": 3}

    async def run():
        engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s",
                                     timeout=60) as c:
            miss = await c.post("/v1/completions", json={**body, "slo_ttft_ms": 50})
            assert miss.status_code == 429, miss.text
            err = miss.json()["error"]
            assert err["code"] == "slo_ttft" and "its target of 50 ms" in err["message"]
            assert int(miss.headers["retry-after"]) >= 1
            # the same as a header; a target it meets is served
            assert (await c.post("/v1/completions", json=body,
                                 headers={"x-slo-ttft-ms": "50"})).status_code == 429
            ok = await c.post("/v1/completions", json={**body, "slo_ttft_ms": 2000})
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["completion_tokens"] == 3
            # a request's own TPOT target replaces the server's (5 s, met)
            chat = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "slo_tpot_ms": 50})
            assert chat.status_code == 429 and chat.json()["error"]["code"] == "slo_tpot"
            metrics = (await c.get("/metrics")).text
            assert 'phasewise:requests_refused_total{model_name="m",reason="slo_ttft"} 2.0' \
                in metrics
            assert 'reason="slo_tpot"} 1.0' in metrics
            # /v1/responses takes the fields as the other routes do (it had ignored them)
            resp = await c.post("/v1/responses", json={
                "input": "hi", "max_output_tokens": 2, "slo_ttft_ms": 50})
            assert resp.status_code == 429, resp.text
            assert resp.json()["error"]["code"] == "slo_ttft"
            # hostile targets: clear 400s naming the field or header, nothing else changes
            for extra, headers, param in (
                    ({"slo_ttft_ms": 0}, {}, "slo_ttft_ms"),
                    ({"slo_tpot_ms": "fast"}, {}, "slo_tpot_ms"),
                    ({}, {"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms"),
                    ({}, {"x-slo-ttft-ms": "1" * (1 << 20)}, "x-slo-ttft-ms"),
                    ({}, {"x-slo-tpot-ms": "inf"}, "x-slo-tpot-ms"),
                    ({}, {"x-slo-ttft-ms": "2_000"}, "x-slo-ttft-ms"),  # float() reads it
                    ({}, [("x-slo-ttft-ms", "2000"), ("x-slo-ttft-ms", "-1")], "x-slo-ttft-ms"),
                    ({"slo_ttft_ms": 100}, {"x-slo-ttft-ms": "100"}, "slo_ttft_ms")):
                r = await c.post("/v1/completions", json={**body, **extra}, headers=headers)
                assert r.status_code == 400, (extra, r.text[:300])
                assert r.json()["error"]["param"] == param, r.text[:300]
            assert (await c.post("/v1/completions", json={**body, "slo_ttft_ms": 2000})
                    ).status_code == 200
            assert (await c.post("/v1/completions", json=body, headers={
                "x-slo-ttft-ms": " 2.5e3 "})).status_code == 200
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_requests_without_a_target_are_never_refused(model):
    engine = AsyncEngine.from_config(EngineConfig(model=str(model)))
    engine.engine.step_clock.cost = lambda p, d, predicted=None: 1e6  # hopeless
    server = OpenAIServer(engine, ServerConfig(served_model_name="m"))

    async def run():
        engine.start(asyncio.get_running_loop())
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s",
                                     timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": "x" * (i + 1), "max_tokens": 2}) for i in range(4)))
            assert [r.status_code for r in rs] == [200] * 4
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_parked_requests_are_no_load_in_a_groups_forecast():
    """Eight unread n=16 streams, parked, made every request with x-slo-ttft-ms a 429 while
    one without a target got its first token in 40 ms: a parked request runs nothing and
    gives its seat up first, so the forecast leaves it out."""
    from phasewise.cache.manager import KVCacheManager
    from phasewise.engine.request import Request
    from phasewise.engine.sampling_params import SamplingParams
    from phasewise.engine.scheduler import Scheduler, SchedulerConfig
    from phasewise.engine.slo import group_forecast

    def forecast_beside(hogs: int, parked: bool):
        kv = KVCacheManager(256, 4)
        s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                      max_model_len=128), kv, clock=lambda: 0.0)
        for i in range(hogs):
            s.add_request(Request(f"h{i}", list(range(100 * i, 100 * i + 8)),
                                  SamplingParams(max_tokens=50, ignore_eos=True),
                                  arrival_time=0.0))
        s.schedule()
        for r in s.running:
            r.parked = parked
        new = Request("new", [7, 8, 9], SamplingParams(max_tokens=4), arrival_time=0.0)
        s.add_request(new)
        return group_forecast(s, kv, [new], linear(0.01, 0.0001, 0.001))

    busy, parked, alone = (forecast_beside(4, False), forecast_beside(4, True),
                           forecast_beside(0, False))
    assert parked.ttft_s < busy.ttft_s
    assert parked.ttft_s == pytest.approx(alone.ttft_s)
