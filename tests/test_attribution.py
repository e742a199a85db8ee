"""Per-step roofline attribution: an engine step's predicted FLOPs, bytes and time, and the
metrics built on them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phasewise import LLM, SamplingParams
from phasewise.engine.outputs import StepStats
from phasewise.perf.attribution import StepCostModel, stored_peaks
from phasewise.perf.hardware import ACCELERATORS
from phasewise.perf.models import ModelShape
from phasewise.engine.step_cost import Chunk
from phasewise.perf.roofline import Roofline

PEAKS = {"name": "test machine", "peak_flops": {"fp32": 2.0e11, "bf16": 1.0e11},
         "mem_bytes": 8e9, "mem_bandwidth": 1.0e10}


def _write_machine(dir_, entry=PEAKS):
    (dir_ / "machine.json").write_text(json.dumps({"cpu-local": entry}))


def _run_mixed_steps(llm: LLM) -> list[StepStats]:
    """A 10-token prompt alone, then its decodes beside a 40-token prompt's chunks."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request(list(range(3, 13)), params)
    eng.step()
    eng.add_request(list(range(50, 90)), params)
    eng.step()
    eng.step()
    return list(eng.step_stats)[-3:]


def test_engine_steps_are_priced_for_their_exact_mix(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))  # no stored peaks
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=32)
    steps = _run_mixed_steps(llm)
    roof = Roofline(ModelShape.from_path(llama_dir), ACCELERATORS["h100-sxm"], "fp32")
    want = [roof.mixed([Chunk(10, 0)]),  # the whole prompt, which samples
            roof.mixed([Chunk(31, 0, samples=False)], [11]),  # decode + 31 of 40
            roof.mixed([Chunk(9, 31)], [12])]  # decode + the last 9, which sample
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == \
        [(10, 0), (31, 1), (9, 1)]
    for s, w in zip(steps, want):
        assert s.predicted_flops == pytest.approx(w.flops, rel=1e-12)
        assert s.predicted_bytes == pytest.approx(w.bytes, rel=1e-12)
        assert s.predicted_s is None  # nothing stored, and nothing measured at start-up
    # the first step by hand: 2 FLOPs per linear weight per token, causal attention over
    # positions 1..10, one LM-head row; bytes: all weights, the K/V written, activations
    m = ModelShape.from_path(llama_dir)
    flops = (10 * 2 * m.active_linear_params + 4 * m.num_layers * m.num_heads * m.head_dim * 55
             + 2 * m.vocab_size * m.hidden_size)
    nbytes = 4 * (m.total_params + 10 * m.kv_bytes_per_token(1)
                  + 10 * m.num_layers * m.act_elems_per_token())
    assert steps[0].predicted_flops == flops and steps[0].predicted_bytes == nbytes
    assert not (tmp_path / "machine.json").exists()


def test_stored_peaks_give_a_predicted_time(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    _write_machine(tmp_path)
    llm = LLM(str(llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=32)
    for s in _run_mixed_steps(llm):
        t = max(s.predicted_flops / 2.0e11, s.predicted_bytes / 1.0e10)
        assert s.predicted_s == pytest.approx(t, rel=1e-12)


def test_a_dtype_without_a_stored_peak_gets_no_time(tmp_path):
    _write_machine(tmp_path, {**PEAKS, "peak_flops": {"bf16": 1e11}})
    accel = stored_peaks("cpu", tmp_path / "machine.json")
    assert accel is not None
    shape = ModelShape("toy", hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=4, intermediate_size=16, vocab_size=10)
    per_rows = StepCostModel(shape, "bf16", accel, lambda rows: "fp32" if rows < 4 else "bf16")
    small, large = per_rows.predict([], [5]), per_rows.predict([Chunk(8, 0)], [])
    assert small.seconds is None and small.compute_dtype == "fp32" and small.flops > 0
    roof = Roofline(shape, accel, "bf16")
    assert large.compute_dtype == "bf16"
    assert large.seconds == pytest.approx(roof.prefill(8).time)


def test_the_start_up_note_says_when_the_stored_peaks_are_unstable(tmp_path):
    shape = ModelShape("toy", hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=4, intermediate_size=16, vocab_size=10)
    _write_machine(tmp_path, PEAKS)
    steady = StepCostModel(shape, "bf16", stored_peaks("cpu", tmp_path / "machine.json"))
    assert "UNSTABLE" not in steady.note(256)
    _write_machine(tmp_path, {**PEAKS, "measured": {"unstable": {
        "bf16": "measured while other processes used 60% of this machine's CPU time"}}})
    shaky = StepCostModel(shape, "bf16", stored_peaks("cpu", tmp_path / "machine.json"))
    note = shaky.note(256)
    assert "UNSTABLE: bf16 (measured while other processes used 60%" in note
    assert "run 'phasewise measure' on a quiet machine" in note


@pytest.mark.parametrize("content", [None, "not json", json.dumps({"cpu-local": {"name": 1}}),
                                     json.dumps({"cpu-local": {**PEAKS, "mem_bandwidth": None}})])
def test_missing_or_damaged_machine_files_mean_no_peaks(tmp_path, content):
    path = tmp_path / "machine.json"
    if content is not None:
        path.write_text(content)
    assert stored_peaks("cpu", path) is None


def test_attribution_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import phasewise.perf.attribution\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _snapshot():
    from phasewise.engine.async_engine import EngineSnapshot

    return EngineSnapshot(num_running=1, num_waiting=0, kv_usage=0.5, num_free_blocks=4,
                          num_blocks=8, num_preemptions=0, prefix_queries=0, prefix_hits=0)


def _step(**over) -> StepStats:
    kw = dict(index=1, start_time=0.0, duration_s=0.02, num_prefill_tokens=30,
              num_decode_tokens=2, num_requests=3, num_running=3, num_waiting=0,
              kv_usage=0.5, num_preempted=0, predicted_flops=4e9, predicted_bytes=6e7,
              predicted_s=0.005)
    kw.update(over)
    return StepStats(**kw)


def _sample(reg, name: str, **labels) -> float | None:
    return reg.get_sample_value(name, {"model_name": "m", **labels})


def test_metrics_export_achieved_rates_and_time_over_roofline():
    from phasewise.server.metrics import PrometheusMetrics

    pm = PrometheusMetrics("m")
    reg = pm.registry
    pm.on_step(_step(), [], [], _snapshot())
    bw = "phasewise:step_achieved_bandwidth_bytes_per_second"
    fl = "phasewise:step_achieved_flops_per_second"
    ratio = "phasewise:step_time_over_roofline"
    pred = "phasewise:step_predicted_seconds"
    assert _sample(reg, bw + "_sum") == pytest.approx(6e7 / 0.02)  # 3e9 B/s
    assert _sample(reg, fl + "_sum") == pytest.approx(4e9 / 0.02)  # 2e11 FLOP/s
    assert _sample(reg, ratio + "_sum") == pytest.approx(4.0)
    assert _sample(reg, pred + "_sum") == pytest.approx(0.005)
    assert _sample(reg, ratio + "_bucket", le="3.0") == 0
    assert _sample(reg, ratio + "_bucket", le="5.0") == 1
    assert _sample(reg, bw + "_bucket", le="1e+09") == 0
    assert _sample(reg, bw + "_bucket", le="3e+09") == 1
    # no stored peaks: rates still observed, no ratio and no predicted time
    pm.on_step(_step(predicted_s=None), [], [], _snapshot())
    assert _sample(reg, bw + "_count") == 2 and _sample(reg, fl + "_count") == 2
    assert _sample(reg, ratio + "_count") == 1 and _sample(reg, pred + "_count") == 1
    # a step built without predictions (another engine) is skipped, not an error
    pm.on_step(_step(predicted_flops=None, predicted_bytes=None, predicted_s=None), [], [],
               _snapshot())
    assert _sample(reg, bw + "_count") == 2


def test_each_step_is_rated_at_the_arithmetic_its_rows_run_in():
    from types import SimpleNamespace

    from phasewise.perf.attribution import engine_compute_dtype, engine_weight_dtype

    class Plan:  # the calibrated CPU plan: the kernel (fp32 math) up to 16 rows, torch above
        def compute_dtype(self, rows):
            return "fp32" if rows <= 16 else "bf16"

    cpu, cuda = SimpleNamespace(type="cpu"), SimpleNamespace(type="cuda")
    bf16 = engine_compute_dtype(SimpleNamespace(dtype="torch.bfloat16", device=cpu,
                                                linear_plan=Plan()))
    assert (bf16(1), bf16(16), bf16(17)) == ("fp32", "fp32", "bf16")
    fp16 = engine_compute_dtype(SimpleNamespace(dtype="torch.float16", device=cpu,
                                                linear_plan=None))
    assert fp16(1) == "fp32"  # CPU fp16 is rated against fp32
    gpu = engine_compute_dtype(SimpleNamespace(dtype="torch.float16", device=cuda,
                                               linear_plan=None))
    assert gpu(1000) == "fp16"
    # int8 weights are widened to fp32 by the AVX2 paths, whatever the bf16 plan says; on a
    # CPU with AMX, more rows than the int8 streams take widen to bf16 for the tiles
    from phasewise.model.cpu import kernels as cpu_kernels

    int8 = SimpleNamespace(dtype="torch.bfloat16", device=cpu, linear_plan=Plan(),
                           config=SimpleNamespace(quantization="int8"))
    assert engine_weight_dtype(int8) == "int8"
    assert engine_weight_dtype(SimpleNamespace(dtype="torch.float16", device=cuda)) == "fp16"
    above = "bf16" if cpu_kernels.amx_available() else "fp32"
    rows = cpu_kernels.INT8_ROWS_MAX
    assert [engine_compute_dtype(int8)(r) for r in (1, rows, rows + 1, 4096)] == [
        "fp32", "fp32", above, above]


def test_the_start_up_note_names_the_thread_count_to_measure_at():
    """serve --threads N reads peaks measured at N threads; its note says to measure at N
    (a plain measure would store the cores' count again)."""
    import torch

    from phasewise.config import usable_cores

    shape = ModelShape("small", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=64, intermediate_size=768, vocab_size=4096,
                       tie_word_embeddings=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(usable_cores())
        assert "run 'phasewise measure' and restart" in StepCostModel(
            shape, "bf16", None).note(64)
        if usable_cores() > 1:
            torch.set_num_threads(1)
            assert "run 'phasewise measure --threads 1' and restart" in StepCostModel(
                shape, "bf16", None).note(64)
    finally:
        torch.set_num_threads(before)
