"""Peaks measured beside a busy process per core are stored as unstable, with the load named,
and a verdict within their noise says "either bound".

One busy loop per core this process may use takes, by the scheduler's fair share, about half
of the CPUs' time from a measurement running as many threads as there are cores: far above
``BUSY_SHARE``, whatever else the machine runs (other load only adds to it). So every figure
of a quick measurement made beside them is unstable and its reason names other processes'
share; nothing here times anything.
"""

from __future__ import annotations

import pytest

from benchmarks.harness import BUNDLED_MODEL, cpu_hogs
from phasewise.perf.contention import BUSY_SHARE, CpuSample


@pytest.fixture(scope="module")
def hogged_entry():
    """A quick CPU measurement (read bandwidth, fp32 matmul) beside one busy process per
    core, each started by PID and stopped by PID however the measurement ends."""
    if CpuSample.now() is None:
        pytest.skip("no Linux /proc: the load cannot be read here")
    from phasewise.perf.measure import measure_device

    said: list[str] = []
    with cpu_hogs() as hogs:
        assert all(p.poll() is None for p in hogs)
        entry = measure_device("cpu", said.append, quick=True, dtypes=("fp32",))
    assert all(p.poll() is not None for p in hogs)  # stopped, by PID
    return entry, said


def test_every_figure_measured_beside_a_busy_process_per_core_is_unstable(hogged_entry):
    entry, said = hogged_entry
    m = entry["measured"]
    assert m["conditions"]["others"] >= BUSY_SHARE
    figures = {"mem_bandwidth", *entry["peak_flops"]}
    assert figures == {"mem_bandwidth", "fp32"}
    assert set(m["unstable"]) == figures
    for name, why in m["unstable"].items():
        assert "other processes used" in why, (name, why)
    # and the measurement said so as it stored them
    assert sum("is unstable" in line and "other processes used" in line for line in said) \
        == len(figures)


def test_a_verdict_within_the_noise_of_the_hogged_peaks_says_either_bound(hogged_entry):
    """A prompt just long enough to be compute-bound at the hogged peaks is within their
    noise (at least 1 / (1 - others' share)): "either bound"; the same peaks stored stable
    give the plain verdict."""
    from phasewise.perf.explain import compute_bound_prompt_len, explain_generation, noise_factor
    from phasewise.perf.hardware import accelerator_from_entry
    from phasewise.perf.models import ModelShape
    from phasewise.perf.roofline import Roofline

    entry, _ = hogged_entry
    noisy = accelerator_from_entry("cpu-local", entry)
    stable = accelerator_from_entry("cpu-local", {**entry, "measured": {}})
    shape = ModelShape.from_path(BUNDLED_MODEL)
    limit = 1 << 16
    n = compute_bound_prompt_len(Roofline(shape, noisy, "bf16", compute_dtype="fp32"), limit)
    assert n is not None
    noise = noise_factor(noisy, "fp32")
    assert noise is not None and noise >= 1 / (1 - BUSY_SHARE)

    def bound_line(accel) -> str:
        lines = explain_generation(shape, accel, "bf16", "fp32", "fp32", [n], 0.05, 0, 0.0,
                                   limit)
        return next(line for line in lines if "on this machine" in line)

    hedged = bound_line(noisy)
    assert "prefill was compute-bound by" in hedged
    assert "within the noise of this machine's unstable peaks" in hedged
    assert "either bound" in hedged
    plain = bound_line(stable)
    assert "prefill was compute-bound" in plain and "either bound" not in plain


def test_the_servers_stats_line_names_contention_and_offers_fewer_threads(monkeypatch,
                                                                         caplog):
    """serve's periodic line: where other processes took the CPUs over the interval, it says
    so, and with several engine threads it warns (at most once a minute) that fewer may run
    faster. Samples are made up: other processes' share is exact, nothing is timed."""
    import logging

    from phasewise.engine.backend import EngineSnapshot
    from phasewise.server import metrics

    samples = iter([CpuSample(0.0, 0, 0, 0, 0),
                    CpuSample(5.0, 700, 1000, 0, 100),  # others: 700 - 100 of 1000 ticks
                    CpuSample(10.0, 1400, 2000, 0, 200),
                    CpuSample(15.0, 1450, 3000, 0, 250)])  # others: nothing
    monkeypatch.setattr(metrics.CpuSample, "now", classmethod(lambda cls: next(samples)))
    threads = [2]
    log = metrics.StatLogger(5.0, threads=lambda: threads[0])
    snap = EngineSnapshot(1, 0, 0.1, 90, 100, 0, 0, 0)
    log.on_step(None, [], [], snap)
    with caplog.at_level(logging.INFO, logger="phasewise.stats"):
        first = log.flush()
        second = log.flush()
        quiet = log.flush()
    assert "other processes used 60% of this machine's CPU time" in first
    assert first.endswith("--threads 1 may run faster while this lasts")
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO", "INFO"]  # once a minute
    assert "--threads 1" in second
    assert "other processes" not in quiet
