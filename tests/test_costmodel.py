"""The step cost model's fit and what it prints: no impossible figure leaves it as a measurement.

Every case is synthetic: step times come from a known ``CostModel`` (with seeded noise where
the case needs it) and go through ``fit``; nothing is timed."""

from __future__ import annotations

import json
import random
import re

import pytest

from phasewise.perf.calibrate import grid
from phasewise.perf.costmodel import CostModel, Knot, fit
from phasewise.perf.hardware import Accelerator
from phasewise.perf.models import lookup_model

SHAPE = lookup_model("qwen2.5-0.5b")
# A CPU as `phasewise measure` writes it: an fp32 peak from a noisy quick measurement.
CPU = Accelerator("cpu-local", "test CPU", {"fp32": 360e9, "bf16": 2.28e12}, 25e9, 36e9, None,
                  "measured by phasewise measure on 2026-12-06 18:47",
                  measured={"spread": {"fp32": [312e9, 360e9],
                                       "mem_bandwidth": [34.7e9, 36e9]}})
POINTS = grid(4096 + 544, 544)


def truth(attn: float = 2.5, per_seq: float = 3e-4, overhead: float = 2e-3) -> CostModel:
    knots = [Knot(r, "fp32", u) for r, u in
             ((1, 1.3), (2, 1.5), (4, 2.0), (8, 2.2), (16, 2.0), (32, 1.8), (64, 1.9),
              (128, 2.0), (256, 1.9), (512, 1.8))]
    return CostModel(SHAPE, CPU, "bf16", knots, overhead_s=overhead, per_seq_s=per_seq,
                     attn_prefill_inv_eff=attn, kv_prefill_inv_eff=4.0, kv_decode_inv_eff=6.0)


def fitted(t: CostModel, noise: float = 0.0, seed: int = 0) -> CostModel:
    rng = random.Random(seed)
    steps = [(p.mix(), t.step_time(p.mix().chunks, p.mix().decodes) * (1 + rng.gauss(0, noise)))
             for p in POINTS]
    return fit(SHAPE, CPU, "bf16", steps, lambda rows: "fp32")


def assert_nothing_impossible(lines: list[str]) -> None:
    """No roofline fraction above 100% without its reason, no coefficient printed as 0."""
    for line in lines:
        for pct in re.findall(r"(\d+)% of roofline", line):
            if int(pct) > 100:
                assert "not trusted" in line, line
        assert not re.search(r"(?<![\d.])0 (ms|µs)\b", line), line


def test_a_term_faster_than_its_rated_peak_is_printed_as_not_trusted():
    # The steps' prompt attention runs 1.27x faster than the peak it is rated at (the peak
    # was measured too low): no bounded fit matches the steps, so the fit keeps the figure
    # for predicting, and prints it with why it cannot be a measurement.
    cm = fitted(truth(attn=1 / 1.27))
    lines = cm.describe()
    assert_nothing_impossible(lines)
    (attn,) = [ln for ln in lines if "prompt attention arithmetic" in ln]
    assert "127% of roofline: faster than the peak it is rated at (360 GFLOP/s fp32" in attn
    assert "312-360 GFLOP/s" in attn and "not trusted" in attn
    assert cm.fit_report["max_abs_rel_err"] < 1e-6  # the predictions stay right
    json.dumps(cm.to_dict())  # the report still goes into a profile


def test_a_term_the_fit_pushes_past_its_roofline_is_held_at_it():
    # The attention runs exactly at its roofline; 3% noise lets an unbounded fit put it at
    # 107% (the term absorbing others' noise). The bound costs no accuracy, so it holds.
    cm = fitted(truth(attn=1.0), noise=0.03, seed=0)
    assert cm.attn_prefill_inv_eff == 1.0
    assert cm.fit_report["held_at_roofline"]["attn_prefill"] > 1.0
    for u in (cm.attn_prefill_inv_eff, cm.kv_prefill_inv_eff, cm.kv_decode_inv_eff):
        assert u >= 1.0
    lines = cm.describe()
    assert_nothing_impossible(lines)
    (attn,) = [ln for ln in lines if "prompt attention arithmetic" in ln]
    assert attn.startswith("  prompt attention arithmetic: held at 100% of roofline, its bound")
    assert "the fit put it at 107%" in attn and "not trusted" in attn


def test_coefficients_the_fit_drove_to_zero_print_as_not_resolved():
    # No fixed cost per step or per sequence in the steps: the fit lands both at 0.
    cm = fitted(truth(per_seq=0.0, overhead=0.0))
    assert cm.overhead_s == 0.0 and cm.per_seq_s == 0.0
    lines = cm.describe()
    assert_nothing_impossible(lines)
    unresolved = [ln for ln in lines if "not resolved by these measurements" in ln]
    assert len(unresolved) == 2
    assert unresolved[0].startswith("  per step") and unresolved[1].startswith("  per sequence")
    assert "over 82 steps at a median error of 0.0%" in unresolved[1]


def test_a_per_sequence_cost_lost_in_noise_is_not_resolved():
    # 1 µs per sequence under 3% noise: too small to separate; the fit drives it to 0.
    cm = fitted(truth(per_seq=1e-6), noise=0.03, seed=1)
    assert cm.per_seq_s == 0.0 and "per_seq" in cm.fit_report["at_bound"]
    lines = cm.describe()
    assert_nothing_impossible(lines)
    assert any(ln.startswith("  per step ") and ln.endswith(" ms") for ln in lines)
    (seq,) = [ln for ln in lines if ln.startswith("  per sequence")]
    assert "not resolved by these measurements" in seq and "median error of 1.8%" in seq


def test_only_the_curves_points_at_measured_row_counts_are_printed():
    # A grid without steps of 2, 32 or 64 rows: the curve's points there are free between
    # their neighbours' steps, so they are named as not shown rather than printed.
    t = truth()
    steps = [(p.mix(), t.step_time(p.mix().chunks, p.mix().decodes)) for p in POINTS
             if not {p.mix().rows, p.mix().samples} & {2, 32, 64}]
    cm = fit(SHAPE, CPU, "bf16", steps, lambda rows: "fp32")
    assert {2, 32, 64} <= {k.rows for k in cm.knots}
    assert not {2, 32, 64} & set(cm.fit_report["rows_measured"])
    (line,) = [ln for ln in cm.describe() if ln.startswith("  matmuls reach")]
    assert "at 1 rows" in line and "at 16 rows" in line and "at 128 rows" in line
    assert not re.search(r"at (2|32|64) rows", line)
    assert line.endswith("(the curve's points at 2, 32, 64 rows lie between the measured "
                         "steps' rows: not shown)")
    # a profile fitted before rows were recorded prints every point, as it did
    d = cm.to_dict()
    del d["fit"]["rows_measured"]
    (old,) = [ln for ln in CostModel.from_dict(SHAPE, CPU, d).describe()
              if ln.startswith("  matmuls reach")]
    assert "at 32 rows" in old and "not shown" not in old


def test_a_stored_profile_with_impossible_figures_says_so():
    # A profile fitted before the bounds: its figures are printed with their reasons.
    d = truth(attn=0.79, per_seq=0.0).to_dict()
    d["fit"] = {"points": 82, "median_abs_rel_err": 0.02, "max_abs_rel_err": 0.1}
    d["kv_prefill_inv_eff"] = 0.5
    lines = CostModel.from_dict(SHAPE, CPU, json.loads(json.dumps(d))).describe()
    assert_nothing_impossible(lines)
    assert any("127% of roofline: faster than" in ln for ln in lines)
    (kv,) = [ln for ln in lines if "prompt context K/V reads" in ln]
    assert "200% of roofline" in kv and "(36 GB/s" in kv and "not trusted" in kv
    assert any(ln.startswith("  per sequence: not resolved") for ln in lines)


def test_a_profile_calibrated_under_load_or_fitted_badly_warns_where_it_is_used():
    """calibrate on a busy machine stored step times 20x a quiet run's, and simulate and
    plan then priced every step from them without a word."""
    from phasewise.perf.calibrate import FIT_DOUBT, note_conditions
    from phasewise.perf.contention import Contention

    quiet = fitted(truth(attn=1.3))
    note_conditions(quiet, Contention(30.0, 0.05, 0.0))
    assert quiet.fit_report["conditions"] == {"others": 0.05, "steal": 0.0, "window_s": 30.0}
    assert "unstable" not in quiet.fit_report
    assert not any("WARNING" in ln for ln in quiet.describe())
    busy = fitted(truth(attn=1.3))
    note_conditions(busy, Contention(30.0, 0.6, 0.0))
    # the reason survives the profile's file, and every describe() leads with it
    stored = CostModel.from_dict(SHAPE, CPU, json.loads(json.dumps(busy.to_dict())))
    (warn,) = [ln for ln in stored.describe() if "WARNING" in ln]
    assert stored.describe()[1] == warn
    assert "other processes used 60% of this machine's CPU time over 30.0 s" in warn
    assert "run 'phasewise calibrate' again on a quiet machine" in warn
    # and under the figures, where readers look, simulate and plan repeat it
    from phasewise.perf.commands import doubt_line

    assert "from a profile that is not trusted" in doubt_line(stored)
    assert doubt_line(quiet) is None
    rough = fitted(truth(attn=1.3))
    rough.fit_report.update(median_abs_rel_err=FIT_DOUBT * 2, max_abs_rel_err=0.9)
    note_conditions(rough, None)  # no /proc: the fit's error alone
    assert "misses the measured steps by a median 30% (worst 90%)" in \
        rough.fit_report["unstable"]


@pytest.mark.parametrize("attn", [2.5, 1.3])
def test_a_plausible_fit_prints_its_figures_plainly(attn):
    cm = fitted(truth(attn=attn))
    lines = cm.describe()
    assert_nothing_impossible(lines)
    assert lines[1] == "  per step 2 ms + 300 µs per sequence"
    assert f"prompt attention arithmetic: {1 / attn:.0%} of roofline" in "\n".join(lines)
    assert "not trusted" not in "\n".join(lines) and "not resolved" not in "\n".join(lines)


def test_an_moe_steps_cost_reads_only_the_experts_its_rows_route_to():
    """The simulator's cost model prices an MoE step's weight traffic as the roofline does:
    a decode of one sequence reads 2 of Mixtral's 8 experts a layer, a large batch all 8."""
    from phasewise.engine.step_cost import Chunk
    from phasewise.perf.hardware import lookup_accelerator
    from phasewise.perf.roofline import Roofline

    m = lookup_model("Mixtral-8x7B-v0.1")
    acc = lookup_accelerator("h200")
    cm = CostModel(m, acc, "bf16", overhead_s=0.0, per_seq_s=0.0)
    r = Roofline(m, acc, mfu=cm.mfu, mbu=cm.mbu)
    # (within 3%: the roofline also counts the embedding table and activations as read)
    for batch in (1, 2, 8, 64):
        want = r.decode(batch, 0).time
        assert cm.step_time([], [1] * batch) == pytest.approx(want, rel=0.03), batch
    one, many = cm.step_time([], [1]), cm.step_time([], [1] * 64)
    assert many / one > 3  # all 8 experts against 2: the weights' time, nearly 4x
    assert cm.step_time([Chunk(512, 0)]) == pytest.approx(r.prefill(512).time, rel=0.03)
    dense = CostModel(lookup_model("Mistral-7B-v0.1"), acc, "bf16", overhead_s=0.0,
                      per_seq_s=0.0)
    assert dense.step_time([], [1] * 8) == pytest.approx(dense.step_time([], [1]), rel=0.01)


def test_a_windowed_models_decode_cost_stops_growing_at_its_window():
    """Mistral-7B-v0.1 (a 4096-position window on every layer): the simulator prices a decode
    at 16k of context as one at 4k, where a model without the window pays for all of it."""
    from phasewise.perf.hardware import lookup_accelerator
    from phasewise.perf.models import ModelShape

    m = lookup_model("Mistral-7B-v0.1")
    acc = lookup_accelerator("h100-sxm")
    cm = CostModel(m, acc, "bf16", overhead_s=0.0, per_seq_s=0.0)
    assert cm.step_time([], [16384] * 32) == pytest.approx(cm.step_time([], [4097] * 32))
    full = CostModel(ModelShape(**{**m.__dict__, "sliding_window": None, "window_layers": 0}),
                     acc, "bf16", overhead_s=0.0, per_seq_s=0.0)
    assert full.step_time([], [16384] * 32) > 2 * full.step_time([], [4097] * 32)


def test_a_profile_calibrated_at_another_thread_count_is_found_and_named(tmp_path,
                                                                         monkeypatch):
    """calibrate --threads N keeps its profile under N threads' name; simulate and plan,
    which look for the cores' one, take it where it is the only one, and say so."""
    from phasewise.perf.calibrate import PROFILE_VERSION, machine_id, machine_slug, profile_path
    from phasewise.perf.commands import cost_model

    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    here = profile_path("qwen2.5-0.5b")
    odd = machine_id(threads=machine_id()["threads"] + 7)
    path = profile_path("qwen2.5-0.5b", machine_slug(odd))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({
        "version": PROFILE_VERSION, "shape": SHAPE.__dict__, "machine": odd,
        "accelerator": {"key": "cpu-local", "name": CPU.name, "peak_flops": CPU.peak_flops,
                        "mem_bytes": CPU.mem_bytes, "mem_bandwidth": CPU.mem_bandwidth},
        "cost_model": truth().to_dict()}))
    assert not here.exists()
    cm = cost_model("qwen2.5-0.5b", "cpu-local", None)
    assert cm.knots and f"(from {path.name}, calibrated at another thread count" in cm.source
    second = path.with_name(path.name.replace(f"-{odd['threads']}t", "-99t"))
    second.write_text(path.read_text())
    from phasewise.perf import hardware

    monkeypatch.setattr(hardware, "lookup_accelerator", lambda g: CPU)  # (no machine file)
    cm = cost_model("qwen2.5-0.5b", "cpu-local", None)
    assert not cm.knots and "calibrated at other thread counts" in cm.source
    assert path.name in cm.source and second.name in cm.source
