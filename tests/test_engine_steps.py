"""Each engine step's record of its forward pass (``StepStats.forward_s``) beside its whole
duration, on a tiny random checkpoint: measured on every kind of step the runner takes
(prompt chunks, the last chunk, decodes, the decode graphs' padded path, prompt logprobs),
within the step, and the host's share what is left, as /metrics counts it. Nothing here
asserts a speed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import padded

from phasewise import LLM, SamplingParams
from phasewise.engine.engine import LLMEngine
from phasewise.engine.model_runner import RunnerOutput
from phasewise.model.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), vocab_size=300,
                                hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2,
                                intermediate_size=64)


def _check(steps) -> None:
    for s in steps:
        assert s.forward_s is not None, s
        assert 0.0 < s.forward_s <= s.duration_s, s
        assert s.host_s == pytest.approx(s.duration_s - s.forward_s) and s.host_s >= 0.0


def test_every_step_records_its_forward_pass_within_its_duration(tiny_dir):
    llm = LLM(str(tiny_dir), max_num_batched_tokens=32)
    before = len(llm.step_stats)
    prompt = list(range(3, 83))  # 80 tokens, budget 32: chunks of 32, 32 (sample nothing), 16
    llm.generate(prompt, GREEDY)
    steps = llm.step_stats[before:]
    assert [s.num_prefill_tokens for s in steps] == [32, 32, 16, 0, 0, 0]
    _check(steps)
    # prompt logprobs: the runner scores the prompt after the forward pass, outside it
    before = len(llm.step_stats)
    llm.generate(list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=2,
                                                    ignore_eos=True, prompt_logprobs=2))
    _check(llm.step_stats[before:])


def test_decode_graph_steps_record_their_forward_pass(tiny_dir):
    llm = padded(LLM(str(tiny_dir), dtype="float32", max_model_len=256))
    before = llm.engine.runner.graphs.replays
    llm.generate(list(range(3, 13)), GREEDY)
    assert llm.engine.runner.graphs.replays - before == 3  # the decodes took the graphs' path
    _check(llm.step_stats)


def test_off_cpu_the_forward_pass_runs_to_where_sampling_reads_it():
    """Off the CPU the kernels' end is seen only where the step reads their results (no
    synchronisation is added): the window runs from the forward pass's start to that read,
    and a step that samples nothing has no such read, so its forward time is not known."""
    ran = RunnerOutput([object()], torch.zeros(1, 4), [1], forward_start=10.0,
                       forward_end=10.25)
    off_cpu = SimpleNamespace(device=torch.device("cuda"))
    on_cpu = SimpleNamespace(device=torch.device("cpu"))
    assert LLMEngine._forward_s(on_cpu, ran, 11.0) == pytest.approx(0.25)
    assert LLMEngine._forward_s(off_cpu, ran, 11.0) == pytest.approx(1.0)
    nothing_sampled = RunnerOutput([], torch.zeros(0, 4), [], 10.0, 10.25)
    assert LLMEngine._forward_s(off_cpu, nothing_sampled, 11.0) is None
    assert LLMEngine._forward_s(on_cpu, nothing_sampled, 11.0) == pytest.approx(0.25)


def test_metrics_count_each_timed_steps_host_time_by_its_mix():
    from prometheus_client import CollectorRegistry

    from phasewise.engine.backend import EngineSnapshot
    from phasewise.engine.outputs import StepStats
    from phasewise.server.metrics import PrometheusMetrics

    reg = CollectorRegistry()
    metrics = PrometheusMetrics("m", reg)
    snap = EngineSnapshot(1, 0, 0.1, 90, 100, 0, 0, 0)

    def step(prefill: int, decode: int, forward: float | None) -> StepStats:
        return StepStats(index=1, start_time=0.0, duration_s=0.005, num_prefill_tokens=prefill,
                         num_decode_tokens=decode, num_requests=1, num_running=1,
                         num_waiting=0, kv_usage=0.1, num_preempted=0, forward_s=forward)

    for s in (step(0, 1, 0.004), step(0, 1, 0.0045), step(8, 0, 0.003), step(0, 1, None)):
        metrics.on_step(s, [], [], snap)

    def value(name: str, kind: str) -> float | None:
        return reg.get_sample_value(f"phasewise:step_host_seconds_{name}",
                                    {"model_name": "m", "kind": kind})

    assert value("count", "decode") == 2  # the unmeasured step is left out
    assert value("sum", "decode") == pytest.approx(0.001 + 0.0005)
    assert value("count", "prefill") == 1 and value("sum", "prefill") == pytest.approx(0.002)
    assert value("count", "mixed") == 0
