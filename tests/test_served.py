"""The simulator against what the server really does: the served profile (a probe through a
live server), the P/D hand-off at the decode engine's step boundary, and TPOT's two modes."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.engine.step_cost import Chunk
from phasewise.perf.served import Phase, Served, ServedCostModel, fit_served, prefill_chunks
from phasewise.perf.simulate import Deployment, EngineSpec, simulate
from phasewise.perf.summary import modes
from phasewise.perf.workload import RequestSpec


class LinearCost:
    """0.1 s a step + 0.01 s a token (prompt or decode) + 0.001 s per position of context
    a decode reads: different prices for chunks and decodes, easy to follow by hand."""

    source = "test"
    kv_bytes_per_token = 1000.0

    def step_time(self, chunks=(), decodes=()):
        return 0.1 + 0.01 * (sum(c.tokens for c in chunks) + len(decodes)) \
            + 0.001 * sum(decodes)


ENGINE = EngineSpec(num_kv_blocks=64, max_num_batched_tokens=6, max_model_len=64,
                    block_size=4)


# -- the P/D hand-off ----------------------------------------------------------------------------
def test_pd_first_token_waits_for_the_decode_engines_step_boundary():
    # r0 (5 tokens, under the threshold) prefills and decodes on the decode worker; r1 (12
    # tokens) prefills remotely in two chunks of 6 (0 -> 0.16 -> 0.32) and lands at 0.32,
    # inside one of r0's decode steps: the decode engine takes it in at that step's end, as
    # the real one reads its commands between steps.
    pd = Deployment("pd", threshold=8, handoff_s=0.0)
    r0_alone = simulate(LinearCost(), ENGINE, pd, [RequestSpec(0, 0.0, 5, 20)])
    ends = r0_alone["chunk_times"][0]  # r0's token times: its steps' ends
    k = next(i for i, t in enumerate(ends) if t > 0.32)
    assert ends[k - 1] < 0.32 < ends[k]
    r = simulate(LinearCost(), ENGINE, pd, [RequestSpec(0, 0.0, 5, 20),
                                            RequestSpec(1, 0.0, 12, 3)])
    assert r["simulated"]["remote_prefills"] == 1
    assert r["ttfts"][1] == pytest.approx(ends[k])
    # Alone on the decode worker (nothing running there), it lands at once.
    alone = simulate(LinearCost(), ENGINE, pd, [RequestSpec(1, 0.0, 12, 3)])
    assert alone["ttfts"][0] == pytest.approx(0.32)


# -- the served profile --------------------------------------------------------------------------
def test_served_cost_prices_chunks_and_decodes_at_their_own_scales_plus_the_gaps():
    s = Served(prefill_scale=2.0, decode_scale=1.5, step_s=0.003, sample_s=0.002)
    cm = ServedCostModel(LinearCost(), s)
    chunk = Chunk(4, 0, samples=False)
    dec = LinearCost().step_time((), [10, 20])  # 0.1 + 0.02 + 0.03
    both = LinearCost().step_time([chunk], [10, 20])
    # The chunk's marginal cost at x2, the decodes' step at x1.5, one gap, two samples.
    assert cm.step_time([chunk], [10, 20]) == pytest.approx(
        2.0 * (both - dec) + 1.5 * dec + 0.003 + 2 * 0.002)
    assert cm.step_time([Chunk(4, 0)]) == pytest.approx(2.0 * 0.14 + 0.003 + 0.002)
    assert cm.kv_bytes_per_token == 1000.0 and "served: prefill x2.000" in cm.source


def test_a_request_sent_to_a_busy_engine_pays_the_busy_arrival_cost():
    cm = ServedCostModel(LinearCost(), Served(request_s=0.01, request_busy_s=0.05))
    # r0 alone: its engine is idle when it is sent. r1 is sent at 0.05, mid-step of r0's
    # prefill (0.01 -> 0.15): it reaches the engine 0.05 later, at 0.10, still mid-step.
    r = simulate(cm, ENGINE, Deployment(), [RequestSpec(0, 0.0, 5, 2),
                                            RequestSpec(1, 0.05, 4, 2)])
    idle = simulate(ServedCostModel(LinearCost(), Served(request_s=0.01)), ENGINE,
                    Deployment(), [RequestSpec(0, 0.0, 5, 2)])
    assert r["ttfts"][0] == pytest.approx(idle["ttfts"][0])
    assert r["server_timings"][1]["queue_s"] == pytest.approx(0.16 - 0.05)
    # A busy cost left unmeasured is the idle one.
    assert ServedCostModel(LinearCost(), Served(request_s=0.01)).request_busy_s == 0.01


def test_a_request_to_an_engine_idle_for_a_while_pays_the_wake_up():
    cm = ServedCostModel(LinearCost(), Served(request_s=0.01, wake_s=0.03))
    assert cm.wake(0.1) == 0 and cm.wake(5.0) == pytest.approx(0.03)  # one figure: flat
    # r0 finds the engine never used (idle for ever); r1 is sent 0.1 s after r0's last
    # step, r2 long after r1's.
    first = simulate(cm, ENGINE, Deployment(), [RequestSpec(0, 0.0, 4, 2)])
    end = first["latencies"][0]
    specs = [RequestSpec(0, 0.0, 4, 2), RequestSpec(1, end + 0.1, 4, 2),
             RequestSpec(2, end + 0.1 + 5.0, 4, 2)]
    r = simulate(cm, ENGINE, Deployment(), specs)
    plain = simulate(LinearCost(), ENGINE, Deployment(), specs)
    assert r["ttfts"][0] == pytest.approx(plain["ttfts"][0] + 0.01 + 0.03)
    assert r["ttfts"][1] == pytest.approx(plain["ttfts"][1] + 0.01)
    assert r["ttfts"][2] == pytest.approx(plain["ttfts"][2] + 0.01 + 0.03)


def test_the_wake_up_cost_goes_as_the_log_of_the_idle_time_between_and_beyond_the_probes():
    s = Served(wake_s=0.02, wake_long_s=0.06, wake_idle_s=(1.0, 4.0))
    assert s.wake_at(0.2) == 0.0
    assert s.wake_at(1.0) == pytest.approx(0.02)
    assert s.wake_at(2.0) == pytest.approx(0.04)  # half way in log
    assert s.wake_at(4.0) == pytest.approx(0.06)
    assert s.wake_at(0.7) == pytest.approx(0.02)  # from WAKE_AFTER_S to the short wait
    assert s.wake_at(16.0) == pytest.approx(0.06)  # beyond the long wait: as measured there
    with pytest.raises(ValueError, match="idle waits"):
        Served(wake_idle_s=(4.0, 1.0))
    # a longer idle measured cheaper is the probes' noise: the short one's cost throughout,
    # and the description says so
    noisy = Served(wake_s=0.0151, wake_long_s=0.0016, wake_idle_s=(1.0, 12.0))
    assert noisy.wake_at(1.0) == noisy.wake_at(6.0) == noisy.wake_at(30.0) == \
        pytest.approx(0.0151)
    assert ("+15.1 ms more at an engine idle 1 s, +1.6 ms idle 12 s (the longer idle "
            "measured cheaper: the probes' noise, not the idle; charged as 15.1 ms from 1 s "
            "on)") in noisy.describe()
    assert "measured cheaper" not in s.describe()


def test_a_served_request_reaches_its_engine_request_s_after_the_client_sent_it():
    cm = ServedCostModel(LinearCost(), Served(request_s=0.05))
    r = simulate(cm, ENGINE, Deployment(), [RequestSpec(0, 1.0, 4, 2)])
    plain = simulate(LinearCost(), ENGINE, Deployment(), [RequestSpec(0, 1.0, 4, 2)])
    assert r["ttfts"][0] == pytest.approx(plain["ttfts"][0] + 0.05)
    assert r["start_times"][0] == pytest.approx(1.0)  # from the client's send


@pytest.mark.parametrize("field,value", [("prefill_scale", 500.0), ("decode_scale", 0.001)])
def test_a_probe_that_contradicts_the_profile_is_refused_with_the_reason(field, value):
    with pytest.raises(ValueError, match="does not describe this server's model"):
        Served(**{field: value})


def test_a_probe_far_from_the_profile_is_applied_and_doubted():
    assert Served(prefill_scale=1.3, decode_scale=0.8).doubt() is None
    far = Served(prefill_scale=5.0)
    assert "prefill x5.00" in far.doubt() and "WARNING" in far.describe()


def _phases(cm, p_scale, d_scale, step_s, sample_s, request_s, batch=4):
    """What a server with these served costs would show the probe, exactly."""
    def decode_phase(b, plen=128, out=48):
        step = d_scale * cm.step_time((), [plen + out // 2] * b)
        n = out - 1
        return Phase(b, plen, (0.1,) * b, (step + step_s + sample_s * b,) * 5, 1, 0.05,
                     n, n * step, out)

    chunks = prefill_chunks(512, 2)
    pre = p_scale * sum(cm.step_time([c]) for c in chunks)
    ttft = request_s + pre + 2 * (step_s + sample_s)
    prefill = Phase(1, 512, (ttft,), (), 2, pre, 0, 0.0, 1)
    return decode_phase(1), decode_phase(batch), prefill


def test_the_busy_and_idle_phases_give_their_arrival_costs():
    cm = LinearCost()
    lone, batched, prefill = _phases(cm, 1.2, 1.5, 0.001, 0.0005, 0.01)
    busy = Phase(1, 512, (0.9,), (), 0, 0.0, 0, 0.0, 1, outside=(0.04, 0.05, 0.06))
    # where the server timed the lone requests, their outside time is request_s
    prefill = Phase(**{**prefill.__dict__, "outside": (0.012,)})
    woken = Phase(1, 512, (prefill.ttfts[0] + 0.025,), (), 2, 0.0, 0, 0.0, 1)
    woken_long = Phase(1, 512, (prefill.ttfts[0] + 0.08,), (), 2, 0.0, 0, 0.0, 1)
    s = fit_served(cm, lone, batched, prefill, busy=busy, woken=woken, woken_long=woken_long)
    assert s.wake_s == pytest.approx(0.025) and s.wake_long_s == pytest.approx(0.08)
    assert "at an engine idle" in s.describe()
    assert s.request_busy_s == pytest.approx(0.05)
    assert s.request_s == pytest.approx(0.012)
    assert "arriving at a busy engine" in s.describe()


@settings(max_examples=40, deadline=None)
@given(p=st.floats(0.5, 3.0), d=st.floats(0.5, 3.0), step=st.floats(0, 0.01),
       sample=st.floats(0, 0.005), req=st.floats(0, 0.05))
def test_the_fit_recovers_what_the_server_costs(p, d, step, sample, req):
    cm = LinearCost()
    s = fit_served(cm, *_phases(cm, p, d, step, sample, req))
    assert s.prefill_scale == pytest.approx(p)
    assert s.decode_scale == pytest.approx(d)
    assert s.step_s == pytest.approx(step, abs=1e-9)
    assert s.sample_s == pytest.approx(sample, abs=1e-9)
    assert s.request_s == pytest.approx(req, abs=1e-9)


def test_prefill_chunks_cover_the_prompt_in_the_servers_step_count():
    chunks = prefill_chunks(600, 3)
    assert [(c.tokens, c.context, c.samples) for c in chunks] == [
        (200, 0, False), (200, 200, False), (200, 400, True)]
    assert sum(c.tokens for c in prefill_chunks(513, 3)) == 513


def test_the_probe_reads_a_phasewise_metrics_page():
    from prometheus_client import CollectorRegistry, generate_latest

    from phasewise.bench.probe import read_steps
    from phasewise.server.metrics import PrometheusMetrics

    m = PrometheusMetrics("m", CollectorRegistry())
    m.step_time["decode"].observe(0.02)
    m.step_time["decode"].observe(0.03)
    m.step_time["prefill"].observe(0.5)
    m.running.set(2)
    got = read_steps(generate_latest(m.registry).decode())
    assert got["decode"][0] == 2 and got["decode"][1] == pytest.approx(0.05)
    assert got["prefill"] == (1, pytest.approx(0.5))
    assert got["phasewise:num_requests_running"][0] == 2


class FlatCost:
    """Every step 2 ms: tiny steps on a CPU take 1-10 ms, so the probe's scales are in range."""

    source = "flat"
    kv_bytes_per_token = 64.0

    def step_time(self, chunks=(), decodes=()):
        return 0.002


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from phasewise.model.tiny import make_tiny_checkpoint
    from tests.serving import start_server

    root = tmp_path_factory.mktemp("served")
    model = make_tiny_checkpoint(root / "m", num_layers=2)
    s = start_server(model, root / "server.log", "--log-interval", "0")
    yield model, s
    s.stop()


def test_the_probe_through_a_live_server(tiny_server):
    from phasewise.bench.probe import probe
    from phasewise.perf.models import ModelShape

    model, s = tiny_server
    served, phases = probe(s.url, FlatCost(), ModelShape.from_path(model).vocab_size, batch=2,
                           prompt_len=32, output_len=8, prefill_len=64, repeats=1, seed=1,
                           idle_s=(0.2, 0.4))
    lone, batched, prefill, busy, woken, woken_long = phases
    assert woken.prefill_steps >= 1 and woken_long.prefill_steps >= 1
    assert served.wake_s is not None and served.wake_idle_s == (0.2, 0.4)
    assert len(busy.outside) == 1  # the server timed it
    # Every step the probe caused is in its phase's diff of /metrics, and no other.
    assert lone.prefill_steps >= 1 and lone.decode_steps >= 1
    assert batched.decode_steps >= 1 and len(batched.ttfts) == 2
    assert prefill.prefill_steps >= 1 and prefill.decode_steps == 0  # one token: no decode
    assert len(lone.lockstep_itls) >= 1
    assert served.step_s >= 0 and served.request_s >= 0
    assert served.decode_scale == pytest.approx(
        statistics.median([lone.decode_sum_s / lone.decode_steps / 0.002,
                           batched.decode_sum_s / batched.decode_steps / 0.002]))
    assert "probed through" in served.source


def test_simulate_served_prices_steps_as_the_live_server_runs_them(tiny_server, tmp_path,
                                                                   capsys, monkeypatch):
    import json

    from phasewise.cli import main

    model, s = tiny_server
    # This machine as a hand-written measurement (a fresh machine has none; measuring it
    # is not what this test is about).
    (tmp_path / "machine.json").write_text(json.dumps({"cpu-local": {
        "name": "test CPU", "peak_flops": {"fp32": 1e11, "bf16": 1e11}, "mem_bytes": 8e9,
        "mem_bandwidth": 1e10}}))
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    args = ["simulate", "--model", str(model), "--num-prompts", "6", "--input-len", "16",
            "--output-len", "4", "--request-rate", "5"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--served", s.url, "--served-rounds", "1", "--served-idle", "0.2",
                 "0.4"]) == 0
    out = capsys.readouterr().out
    assert "served: prefill x" not in plain
    assert "served: prefill x" in out and "probed through " + s.url in out
    # with no profile the scales fit the assumed efficiencies: a note says so, and no
    # warning asks whether a profile that does not exist is this server's
    assert "the assumed efficiencies' step times" in out
    assert "NOTE: no calibrated profile for this model on this machine" in out
    assert "WARNING" not in out
    assert main([*args, "--served", "http://127.0.0.1:9", "--served-rounds", "1",
                 "--served-idle", "0.1", "0.2"]) == 2  # nothing listens there
    assert "connect" in capsys.readouterr().err.lower()


# -- TPOT's two modes ----------------------------------------------------------------------------
def test_two_clusters_of_tpot_are_reported_as_two_modes():
    vals = [0.020 + 0.0005 * i for i in range(14)] + [0.060 + 0.001 * i for i in range(6)]
    m = modes(vals)
    assert m is not None
    assert m["high_share"] == pytest.approx(0.3)
    assert 20 < m["low_ms"] < 27 and 60 < m["high_ms"] < 66
    assert m["gap_ms"][0] < 27 < 60 < m["gap_ms"][1] + 1e-9


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.02, 0.0259), min_size=8, max_size=60))
def test_values_within_less_than_the_gap_have_one_mode(vals):
    assert modes(vals) is None


def test_a_few_requests_are_not_two_modes():
    """bench called 8 requests split 4 and 4 'two modes': so few show a gap by chance."""
    assert modes([0.020] * 4 + [0.060] * 4) is None
    assert modes([0.020] * 16 + [0.060] * 4) is None  # 4 are too few to be a mode
    assert modes([0.020] * 15 + [0.060] * 5) is not None


def test_a_few_outliers_are_not_a_mode():
    vals = [0.020 + 0.0002 * i for i in range(18)] + [0.2, 0.3]  # 10%: under the share
    assert modes(vals) is None
