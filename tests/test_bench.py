"""The benchmark client: workloads, summaries on hand-made timings, the client against a
scripted fake server, the CLI, and the HTML report."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_openai import FakeServer
from phasewise.bench.client import ClientConfig, run_workload
from phasewise.bench.prompts import make_prompts
from phasewise.bench.report import render
from phasewise.cli import main
from phasewise.perf.summary import (RequestResult, longest_stall, parse_slo, percentile,
                                    summarize, text_table)
from phasewise.perf.workload import (LengthDist, RequestSpec, arrival_times, build_workload,
                                     load_trace)


# -- workloads -----------------------------------------------------------------------------
def test_length_distributions_parse_and_sample():
    rng = random.Random(0)
    assert LengthDist.parse("128").sample(rng) == 128
    assert LengthDist.parse("fixed:7").sample(rng) == 7
    u = LengthDist.parse("uniform:10-20")
    assert {u.sample(rng) for _ in range(500)} == set(range(10, 21))
    n = LengthDist.parse("normal:100,30,max=120")
    xs = [n.sample(rng) for _ in range(2000)]
    assert min(xs) >= 1 and max(xs) == 120
    assert 85 < sum(xs) / len(xs) < 100  # the cap pulls the mean below 100
    for bad in ("", "uniform:20-10", "normal:5", "gauss:1,2", "0", "-3"):
        with pytest.raises(ValueError, match="length distribution|>= 1|LO <= HI"):
            LengthDist.parse(bad)


def test_workload_is_deterministic_and_mixes_the_stated_share_of_intruders():
    kw = dict(request_rate=2.0, intruder_fraction=0.05, intruder_len=LengthDist.parse("4000"))
    a = build_workload(200, LengthDist.parse("64"), LengthDist.parse("32"), seed=3, **kw)
    b = build_workload(200, LengthDist.parse("64"), LengthDist.parse("32"), seed=3, **kw)
    c = build_workload(200, LengthDist.parse("64"), LengthDist.parse("32"), seed=4, **kw)
    assert a == b and a != c
    intruders = [s for s in a if s.intruder]
    assert len(intruders) == 10 and all(s.prompt_len == 4000 for s in intruders)
    assert all(s.prompt_len == 64 for s in a if not s.intruder)


@settings(max_examples=25, deadline=None)
@given(rate=st.floats(0.1, 50), burstiness=st.floats(0.2, 5), seed=st.integers(0, 10**6))
def test_arrivals_start_at_zero_increase_and_average_one_over_rate(rate, burstiness, seed):
    times = arrival_times(4000, rate, burstiness, random.Random(seed))
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    mean_gap = times[-1] / (len(times) - 1)
    # Gamma gaps of mean 1/rate: the sample mean of 4000 lies well within 20% of it.
    assert abs(mean_gap * rate - 1) < 0.2


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused():
    assert arrival_times(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5
    for rate, burst in ((0, 1), (-1, 1), (1, 0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, burst, random.Random(0))


def test_trace_is_sorted_shifted_and_scaled(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 12.0, "prompt_len": 10, "output_len": 4}\n'
                    '{"timestamp": 10.0, "input_length": 30, "output_length": 2}\n\n'
                    '{"arrival": 11.0, "prompt": "hello", "output_len": 3}\n')
    specs = load_trace(path, time_scale=2.0)
    assert [(s.arrival, s.prompt_len, s.output_len, s.prompt) for s in specs] == [
        (0.0, 30, 2, None), (2.0, 0, 3, "hello"), (4.0, 10, 4, None)]
    path.write_text('{"arrival": 1, "output_len": 4}\n')
    with pytest.raises(ValueError, match="prompt_len or prompt"):
        load_trace(path)


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_a_trace_reads_the_same_whatever_its_line_breaks(tmp_path, eol):
    lines = ['{"arrival": 0, "prompt_len": 10, "output_len": 4}',
             '{"arrival": 1, "prompt": "a\\rb", "output_len": 3}', ""]
    path = tmp_path / "t.jsonl"
    path.write_bytes(eol.join(lines).encode())
    specs = load_trace(path)
    assert [(s.prompt_len, s.prompt) for s in specs] == [(10, None), (0, "a\rb")]
    path.write_bytes(eol.join([lines[0], "{oops"]).encode())
    with pytest.raises(ValueError, match=":2: "):  # the line number counts every break
        load_trace(path)


def test_prompts_have_exactly_the_stated_lengths():
    specs = [RequestSpec(i, 0.0, n, 4) for i, n in enumerate([1, 50, 300])]
    prompts = make_prompts(specs, list(range(100)), seed=1)
    assert [len(p) for p in prompts] == [1, 50, 300]
    assert all(all(0 <= t < 100 for t in p) for p in prompts)


# -- summaries on hand-made timings ----------------------------------------------------------
def _result(i, start, ttft, gaps, tokens=None, prompt_len=16, intruder=False):
    tokens = tokens or [1] * (len(gaps) + 1)
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(i, prompt_len, sum(tokens), intruder, start=start, ttft=ttft,
                         chunk_times=times, chunk_tokens=tokens, output_tokens=sum(tokens),
                         latency=times[-1], success=True)


def test_tokens_that_arrive_together_are_called_a_burst_not_a_fast_decode():
    from phasewise.perf.summary import BURST_GAP_S

    steady = [_result(0, 0.0, 0.1, [0.003] * 9)]
    out = summarize(steady, 1.0)
    assert out["burst_share"] == 0.0
    assert "bursts" not in text_table(out)
    # one 36 ms gap, then nine tokens 10 µs apart (as seen behind a busy router)
    bursty = [_result(0, 0.0, 0.1, [0.036] + [1e-5] * 9)]
    out = summarize(bursty, 1.0)
    assert out["burst_share"] == pytest.approx(0.9)
    (line,) = [ln for ln in text_table(out).splitlines() if "bursts" in ln]
    assert f"90% of the gaps between tokens were under {BURST_GAP_S * 1e3:g} ms" in line
    assert "measure their delivery, not the decode steps" in line
    assert summarize([], 1.0)["burst_share"] is None


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile(list(range(101)), 90) == 90
    assert math.isnan(percentile([], 50))


def test_summary_values_are_exact_for_known_timings():
    results = [
        _result(0, 0.0, 0.5, [0.1, 0.1, 0.1]),  # TPOT 0.1
        _result(1, 0.0, 1.5, [0.1, 0.3], tokens=[1, 2, 1]),  # 4 tokens: TPOT 0.4/3
        _result(2, 1.0, 0.25, [2.0, 0.1], prompt_len=16),  # the stall
        _result(3, 1.5, 2.5, [0.1], prompt_len=2000, intruder=True),  # waited through it
        RequestResult(4, 16, 8, False, start=2.0, error="HTTP 500: boom", latency=0.01),
    ]
    out = summarize(results, duration=5.0, slo={"ttft": 1000, "tpot": 200})
    assert out["completed"] == 4 and out["failed"] == 1
    assert out["total_output_tokens"] == 4 + 4 + 3 + 2
    assert out["request_throughput"] == pytest.approx(0.8)
    assert out["output_throughput"] == pytest.approx(13 / 5)
    assert out["median_ttft_ms"] == pytest.approx(1000.0)  # of 250, 500, 1500, 2500
    assert out["p99_ttft_ms"] == pytest.approx(1500 + 1000 * 0.97)  # rank 2.97 of 0..3
    tpots = [0.1, 0.4 / 3, 2.1 / 2, 0.1]
    assert out["mean_tpot_ms"] == pytest.approx(1e3 * sum(tpots) / 4)
    # ITLs: six of 0.1 s, 0.3 s and 2.0 s; p99 sits at rank 6.93 of 0..7.
    assert out["median_itl_ms"] == pytest.approx(100.0)
    assert out["p99_itl_ms"] == pytest.approx(300 + 1700 * 0.93)
    # Goodput: TTFT <= 1 s and TPOT <= 200 ms holds for request 0 only (1 is late to its
    # first token, 2 stalls, 3 waited 2.5 s, 4 failed).
    assert out["request_goodput"] == pytest.approx(1 / 5.0)
    stall = out["longest_stall"]
    assert stall["request"] == 2 and stall["itl_ms"] == pytest.approx(2000.0)
    assert stall["at_s"] == pytest.approx(1.25)
    assert stall["culprit"] == 3 and stall["culprit_intruder"] is True
    assert out["errors"][4] == "HTTP 500: boom"
    assert out["itls"][1] == pytest.approx([0.1, 0.3])


def test_slo_parsing():
    assert parse_slo(["ttft:2000", "tpot:200"]) == {"ttft": 2000.0, "tpot": 200.0}
    assert parse_slo(["ttft:2000,e2el:9000"]) == {"ttft": 2000.0, "e2el": 9000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["tpot:fast"]):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_longest_stall_without_gaps_is_none():
    assert longest_stall([_result(0, 0.0, 0.1, [])]) is None


# -- the client against a scripted server ---------------------------------------------------
@pytest.fixture(scope="module")
def fake():
    with FakeServer() as server:
        yield server


def test_a_hostile_servers_replies_fail_their_requests_and_never_the_run(fake, monkeypatch,
                                                                        capsys):
    """1e308 tokens, timings of strings and 1e308, a line that never ends (it took 3.9 GB
    in 25 s) and a stream that never starts (a 6-hour wait): each fails its own request or
    is dropped, the summary and its text table come out, and the run ends."""
    import fake_openai

    from phasewise.bench import client as client_mod
    from phasewise.bench.run import scrape_phasewise_metrics
    from phasewise.perf.summary import text_table

    monkeypatch.setattr(client_mod, "MAX_EVENT_LINE", 1 << 20)
    lens = [fake_openai.HOSTILE[k] for k in ("usage", "timings", "endless", "hang")] + [16]
    specs = [RequestSpec(i, 0.0, n, 5) for i, n in enumerate(lens)]
    cfg = ClientConfig(base_url=fake.url, timeout_s=3.0)
    results, duration = asyncio.run(run_workload(cfg, specs, [[7] * n for n in lens]))
    usage, timings, endless, hang, fine = results
    assert not usage.success and "1e+308, not a token count" in usage.error
    assert timings.success and timings.server_timing == {"index": 0, "decode_s": 0.2}
    assert not endless.success and "an event line longer than 1 MiB" in endless.error
    assert not hang.success and "no end within --request-timeout 3 s" in hang.error
    assert fine.success and fine.output_tokens == 5
    text_table(summarize(results, duration))  # no overflow, no type error
    # a /metrics that is not Prometheus text (or holds no finite figure): no split, a warning
    for text in ('phasewise:x{a="1" 2\n', "phasewise:num_requests_running NaN\n"):
        monkeypatch.setitem(fake_openai.METRICS, "text", text)
        assert scrape_phasewise_metrics(fake.url, {}) is None
        assert "could not be read as phasewise's" in capsys.readouterr().err


def test_client_measures_the_scripted_timings(fake):
    specs = [RequestSpec(i, 0.0, n, 5, intruder=n == 500)
             for i, n in enumerate([16, 17, 18, 500, 13])]
    prompts = [[1] * s.prompt_len for s in specs]
    cfg = ClientConfig(base_url=fake.url)
    results, duration = asyncio.run(run_workload(cfg, specs, prompts))
    ok = {r.prompt_len: r for r in results if r.success}
    assert set(ok) == {16, 17, 18, 500}
    failed = [r for r in results if not r.success]
    assert len(failed) == 1 and "500" in failed[0].error and "scripted" in failed[0].error
    # The server sleeps the scripted gaps, so a loaded machine can only lengthen them: each
    # measured gap is at least its scripted value (less timer slack) and, with generous
    # room for jitter, well below the next scripted value it could be confused with.
    def near(measured, scripted, room):
        return scripted - 0.01 <= measured <= scripted + room

    for n, r in ok.items():
        assert near(r.ttft, 0.9 if n == 500 else 0.25, 0.5), (n, r.ttft)
        assert r.output_tokens == 5
    assert ok[18].chunk_tokens == [1, 2, 1, 1]  # counted from usage, not from chunks
    assert near(ok[16].tpot, 0.05, 0.15), ok[16].tpot
    assert near(max(ok[17].itls), 0.6, 0.5), ok[17].itls
    out = summarize(results, duration, {"ttft": 600})
    assert out["completed"] == 4 and out["failed"] == 1
    assert out["request_goodput"] == pytest.approx(3 / duration)
    stall = out["longest_stall"]
    assert stall["request"] == 1 and stall["culprit"] == 3 and stall["culprit_intruder"]
    assert out["server_timings"][3]["queue_s"] == 0.5
    assert out["server_timings"][0] is None  # the fake sends timings for one script only


def test_cli_writes_a_vllm_style_result_and_sweeps(fake, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = main(["bench", "--base-url", fake.url, "--num-prompts", "4", "--input-len", "16",
               "--output-len", "5", "--request-rate", "inf", "--goodput", "ttft:600",
               "--result-file", str(out), "--label", "fake", "--disable-tqdm"])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in ("completed", "request_throughput", "output_throughput", "request_goodput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "p99_itl_ms", "ttfts", "itls", "input_lens", "output_lens", "errors"):
        assert key in r, key
    assert r["completed"] == 4 and r["input_lens"] == [16] * 4 and r["output_lens"] == [5] * 4
    assert r["label"] == "fake" and r["server_metrics"] is None  # not a phasewise server
    text = capsys.readouterr().out
    assert "Successful requests:" in text and "Longest stall:" in text

    rc = main(["bench", "--base-url", fake.url, "--num-prompts", "3", "--input-len", "16",
               "--output-len", "5", "--request-rate", "20", "inf", "--result-dir",
               str(tmp_path / "sweep"), "--save-result", "--disable-tqdm"])
    assert rc == 0
    files = sorted(p.name for p in (tmp_path / "sweep").iterdir())
    assert files == ["phasewise-bench-rate20.json", "phasewise-bench-rateinf.json"]
    assert "==== sweep ====" in capsys.readouterr().out


def test_cli_reports_failures_in_its_exit_code(fake, tmp_path, capsys):
    rc = main(["bench", "--base-url", fake.url, "--num-prompts", "2", "--input-len", "13",
               "--output-len", "5", "--disable-tqdm"])
    assert rc == 1
    assert "2 requests failed:\n  x2  HTTP 500: scripted failure\n" in capsys.readouterr().out
    assert main(["bench", "--base-url", fake.url, "--input-len", "nope"]) == 2


def test_cli_refuses_before_sending_what_the_servers_context_cannot_hold(fake, capsys):
    """/tokenize reports the server's max_model_len: intruders (or prompts) too long for it
    are refused by their flag before a request is sent."""
    argv = ["bench", "--base-url", fake.url, "--num-prompts", "6", "--input-len", "16",
            "--output-len", "5", "--disable-tqdm"]
    assert main([*argv, "--intruder-fraction", "0.5", "--intruder-len", "600"]) == 2
    err = capsys.readouterr().err
    assert "3 of the 6 requests would not fit the server's context of 512 tokens" in err
    assert "lower --intruder-len" in err
    assert main([*argv[:-3], "--output-len", "600", "--disable-tqdm"]) == 2
    assert "lower --input-len or --output-len" in capsys.readouterr().err


def test_cli_says_why_requests_failed_grouped_and_counted(fake, capsys, monkeypatch):
    # half the requests are intruders too long for the fake's 512-token context, which it
    # does not report (as a server whose /tokenize gives no max_model_len)
    import fake_openai

    monkeypatch.setitem(fake_openai.REPORT_CONTEXT, "on", False)
    rc = main(["bench", "--base-url", fake.url, "--num-prompts", "6", "--input-len", "16",
               "--output-len", "5", "--intruder-fraction", "0.5", "--intruder-len",
               "uniform:600-700", "--disable-tqdm"])
    assert rc == 1
    out = capsys.readouterr().out
    assert "Failed requests:                      3" in out and "3 requests failed:" in out
    why = [ln for ln in out.splitlines() if ln.startswith("  x")]
    assert len(why) == 1, out  # one reason, though each message has its own prompt length
    # (lengths drawn from 600-700, both ends included: the run's seed is fresh)
    assert re.match(r"  x3  HTTP 400: the prompt has (6\d\d|700) tokens", why[0]), why[0]
    assert "but this model's context is 512 tokens" in why[0]
    assert '{"error"' not in out  # the server's message, not its raw JSON body


def test_failure_reasons_group_messages_that_differ_only_in_numbers():
    from phasewise.bench.client import error_message
    from phasewise.perf.summary import failure_lines, failure_reasons

    errors = ["", "HTTP 400: prompt has 1030 tokens", "HTTP 500: boom", None,
              "HTTP 400: prompt has 1041 tokens", "HTTP 400: prompt has 1030 tokens"]
    assert failure_reasons(errors) == [("HTTP 400: prompt has 1030 tokens", 3, True),
                                       ("HTTP 500: boom", 1, False)]
    assert failure_lines({"errors": errors}) == [
        "4 requests failed:", "  x3  HTTP 400: prompt has 1030 tokens  (the numbers vary)",
        "  x1  HTTP 500: boom"]
    assert failure_lines({"errors": ["", None]}) == []
    assert failure_lines({"errors": ["x" * 300]}, width=10) == ["1 request failed:",
                                                                "  x1  xxxxxxxxx…"]
    assert error_message('{"error": {"message": "too long", "type": "x"}}') == "too long"
    assert error_message('{"detail": "Not Found"}') == "Not Found"
    # an HTML page (a server that is no OpenAI one): one line, its title or its text
    assert error_message("<html>bad gateway</html>") == \
        "an HTML page, not an OpenAI-compatible reply: bad gateway"
    page = ("<!DOCTYPE HTML>\n<html><head>\n<title>Error response</title>\n</head>\n<body>"
            "\n<h1>Error response</h1>\n<p>Error code: 501</p>\n</body></html>\n")
    assert error_message(page) == \
        "an HTML page, not an OpenAI-compatible reply: Error response"
    assert error_message("upstream\n  timed out\n") == "upstream timed out"


# -- the report ------------------------------------------------------------------------------
def test_report_holds_the_expected_series(tmp_path):
    results = [_result(0, 0.0, 0.5, [0.1, 0.1, 0.1]),
               _result(1, 0.2, 0.3, [0.1, 1.5, 0.1]),
               _result(2, 0.5, 1.2, [0.1], prompt_len=3000, intruder=True)]
    results[2].server_timing = {"queue_s": 0.8, "prefill_s": 0.4, "decode_s": 0.1}
    a = summarize(results, 3.0, {"ttft": 1000})
    a["label"] = "prefill-first"
    b = summarize(results[:1], 1.0, {"ttft": 1000})
    b["label"] = "chunked"
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = render([pa, pb], tmp_path / "r.html", stall_factor=5.0)
    page = out.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="phasewise-series">'
                                r"(.*?)</script>", page, re.S).group(1))
    sa, sb = data["series"]
    assert [sa["label"], sb["label"]] == ["prefill-first", "chunked"]
    assert sa["median_itl"] == pytest.approx(0.1)
    assert [(s["request"], round(s["gap"], 6)) for s in sa["stalls"]] == [(1, 1.5)]
    assert sa["stalls"][0]["at"] == pytest.approx(0.2 + 0.3 + 0.1)
    assert sb["stalls"] == []
    assert sa["ttft_sorted"] == pytest.approx([0.3, 0.5, 1.2])
    assert [r["intruder"] for r in sa["timeline"]] == [False, False, True]
    assert sa["timeline"][2]["first_token"] == pytest.approx(1.7)
    # The server's queue time splits waiting from prefill where the server sent it.
    assert sa["timeline"][2]["queue_end"] == pytest.approx(0.5 + 0.8)
    assert sa["timeline"][0]["queue_end"] is None
    assert sum(sa["tokens_per_s"]["values"]) == 4 + 4 + 2  # every token lands in a bin
    assert data["slo"] == {"ttft": 1000}
    pytest.importorskip("matplotlib")
    assert page.count("data:image/png;base64,") == 2 + 3  # 2 timelines, 2 CDFs, tokens/s


def test_a_run_whose_requests_all_failed_still_renders_quietly(tmp_path):
    """No TTFT or TPOT to draw: the charts say so, and matplotlib warns of no empty legend."""
    pytest.importorskip("matplotlib")
    failed = RequestResult(0, 16, 0, False, start=0.0, success=False, error="boom")
    a = summarize([failed], 1.0, {})
    a["label"] = "failed"
    (tmp_path / "a.json").write_text(json.dumps(a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        page = render([tmp_path / "a.json"], tmp_path / "r.html").read_text()
    assert page.count("data:image/png;base64,") == 4  # a timeline, 2 CDFs, tokens/s


def test_runs_under_one_label_are_told_apart_by_their_files(tmp_path):
    out = summarize([_result(0, 0.0, 0.5, [0.1])], 1.0)
    out["label"] = "phasewise-bench"  # bench's default, for every run not given --label
    for name in ("run.json", "again.json"):
        (tmp_path / name).write_text(json.dumps(out))
    other = dict(out, label="chunked")
    (tmp_path / "c.json").write_text(json.dumps(other))
    page = render([tmp_path / "run.json", tmp_path / "again.json", tmp_path / "c.json"],
                  tmp_path / "r.html").read_text()
    data = json.loads(re.search(r'<script type="application/json" id="phasewise-series">'
                                r"(.*?)</script>", page, re.S).group(1))
    assert [s["label"] for s in data["series"]] == [
        "phasewise-bench (run.json)", "phasewise-bench (again.json)", "chunked"]


def test_report_reads_vllm_results_and_refuses_other_json(tmp_path):
    vllm_like = {"ttfts": [0.2, 0.4], "itls": [[0.05, 0.05], [0.05]], "latencies": [0.3, 0.45],
                 "start_times": [0.0, 0.1], "output_lens": [3, 2], "completed": 2,
                 "request_throughput": 1.0, "output_throughput": 5.0}
    p = tmp_path / "vllm.json"
    p.write_text(json.dumps(vllm_like))
    page = render([p], tmp_path / "v.html").read_text()
    assert "vllm" in page
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="ttfts"):
        render([bad], tmp_path / "x.html")
    assert main(["bench", "report", str(bad), "-o", str(tmp_path / "y.html")]) == 2


def test_report_draws_latency_against_throughput_for_a_sweep(tmp_path):
    paths = []
    for rate, duration in ((1.0, 4.0), (4.0, 2.0)):
        r = summarize([_result(0, 0.0, 0.2 * rate, [0.1, 0.1]),
                       _result(1, 0.1, 0.3 * rate, [0.1])], duration)
        r.update(label="chunked", sweep=True, request_rate=rate)
        paths.append(tmp_path / f"chunked-rate{rate:g}.json")
        paths[-1].write_text(json.dumps(r))
    page = render(paths, tmp_path / "s.html").read_text()
    data = json.loads(re.search(r'id="phasewise-series">(.*?)</script>', page, re.S).group(1))
    assert [s["label"] for s in data["series"]] == ["chunked @ 1.0 req/s",
                                                    "chunked @ 4.0 req/s"]
    pts = data["sweeps"]["chunked"]
    assert [p["request_rate"] for p in pts] == [1.0, 4.0]
    assert [p["request_throughput"] for p in pts] == [0.5, 1.0]
    assert pts[1]["median_ttft_ms"] == pytest.approx(1e3 * (0.8 + 1.2) / 2)
    pytest.importorskip("matplotlib")
    assert page.count("data:image/png;base64,") == 2 + 2 + 1 + 1


def test_every_rate_of_a_sweep_gets_the_same_requests():
    kw = dict(intruder_fraction=0.1, intruder_len=LengthDist.parse("900"), seed=5)
    dists = (LengthDist.parse("uniform:10-99"), LengthDist.parse("normal:40,9"))
    slow = build_workload(50, *dists, request_rate=0.5, **kw)
    fast = build_workload(50, *dists, request_rate=math.inf, **kw)
    assert [(s.prompt_len, s.output_len, s.intruder) for s in slow] == \
        [(s.prompt_len, s.output_len, s.intruder) for s in fast]
    assert [s.arrival for s in slow] != [s.arrival for s in fast]


def test_ttft_split_averages_the_servers_timings_and_the_remote_parts_over_remote_ones():
    from phasewise.perf.summary import ttft_split

    timings = [
        {"queue_s": 0.010, "prefill_s": 0.100},  # prefilled locally
        {"queue_s": 0.030, "prefill_s": 0.300, "remote_prefill_s": 0.2,
         "kv_transfer_s": 0.05, "first_step_s": 0.01, "kv_bytes": 2_000_000},
        None,  # a server that sent no timings for this one
    ]
    split = ttft_split(timings)
    assert split["requests"] == 2 and split["remote"] == 1
    assert split["mean_queue_ms"] == pytest.approx(20.0)
    assert split["mean_prefill_ms"] == pytest.approx(200.0)
    assert split["mean_remote_prefill_ms"] == pytest.approx(200.0)
    assert split["mean_kv_transfer_ms"] == pytest.approx(50.0)
    assert split["mean_kv_bytes"] == 2_000_000
    assert ttft_split([None, None]) is None
    assert ttft_split([timings[0]])["mean_kv_transfer_ms"] is None
    # printed, kv_transfer_s is the hand-off (a chunked prompt's later chunks are in it)
    from phasewise.perf.summary import summarize, text_table

    out = summarize([], 1.0)
    out["ttft_split"] = split
    (line,) = [ln for ln in text_table(out).splitlines() if ln.startswith("TTFT split")]
    assert "remote_prefill 200.0  kv_handoff 50.0  first_step 10.0" in line
    assert "kv_transfer" not in line


def test_the_server_wide_line_says_when_the_server_counts_no_steps():
    """Behind a router (no engine of its own) the steps are not 0 but uncounted there."""
    from phasewise.bench.run import server_split, server_wide_line

    before = {"phasewise:engine_steps_total{kind=decode}": 5.0}
    after = {"phasewise:engine_steps_total{kind=decode}": 12.0,
             "phasewise:engine_steps_total{kind=mixed}": 2.0}
    assert server_wide_line(server_split(before, after), 3).endswith(
        "steps: 0 prefill, 7 decode, 2 mixed")
    router = server_split({}, {"phasewise:request_queue_time_seconds_count": 3.0,
                               "phasewise:request_queue_time_seconds_sum": 0.03})
    line = server_wide_line(router, 3)
    assert "queue 10" in line and line.endswith(
        "steps: none counted by this server (a router runs no engine: each worker's /metrics "
        "counts its own)")
    assert server_wide_line(router, 0).endswith("steps: 0 prefill, 0 decode, 0 mixed")


def test_a_cache_warning_needs_more_than_one_windows_chance_hit():
    """A synthetic run's prompts are corpus windows: one that starts where an earlier
    request's did is chance, not a repeated seed. The warning needs half the requests (and
    at least two) served in part from the cache, as well as a tenth of the tokens."""
    from phasewise.bench.run import cache_warning

    def out(cached, hits, completed=3):
        return {"cached_prompt_tokens": cached, "cached_of_prompt_tokens": 144,
                "requests_with_cache_hits": hits, "completed": completed, "seed": 12}

    assert cache_warning(out(16, 1), synthetic=True) is None  # one window by chance
    assert cache_warning(out(96, 3), synthetic=True).startswith(
        "warning: the server's prefix cache served 67% of the prompt tokens (3 requests)")
    assert cache_warning(out(96, 3), synthetic=False) is None  # a trace may share prefixes
    assert cache_warning(out(10, 3), synthetic=True) is None  # under a tenth
    assert cache_warning(out(60, 4, completed=10), synthetic=True) is None
    assert cache_warning(out(60, 5, completed=10), synthetic=True) is not None
