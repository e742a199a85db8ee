"""The simulator (the real scheduler in virtual time), the step cost model and its fit, the
planner, and the results the field knows that a simulation must reproduce."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.engine.slo import SLO
from phasewise.engine.step_cost import Chunk
from phasewise.perf.calibrate import GridPoint, grid
from phasewise.perf.costmodel import CostModel, Knot, StepMix, fit, nnls
from phasewise.perf.hardware import LINKS, Link, lookup_accelerator
from phasewise.perf.models import lookup_model
from phasewise.perf.plan import Workload, attainment, goodput, search, size
from phasewise.perf.simulate import Deployment, EngineSpec, kv_blocks_for, simulate
from phasewise.perf.workload import LengthDist, RequestSpec, build_workload


class LinearCost:
    """Step time 0.1 s + 0.01 s per token: easy to follow by hand."""

    source = "test"
    kv_bytes_per_token = 1000.0

    def step_time(self, chunks=(), decodes=()):
        return 0.1 + 0.01 * (sum(c.tokens for c in chunks) + len(decodes))


def spec(i, arrival, prompt, out):
    return RequestSpec(i, arrival, prompt, out)


ENGINE = EngineSpec(num_kv_blocks=64, max_num_batched_tokens=6, max_model_len=64,
                    block_size=4)


# -- the simulator, followed by hand ------------------------------------------------------------
def test_one_request_timeline_is_the_schedulers():
    # A 10-token prompt under a 6-token budget: chunks of 6 and 4, then two decodes.
    r = simulate(LinearCost(), ENGINE, Deployment(), [spec(0, 0.0, 10, 3)])
    assert r["completed"] == 1
    assert r["ttfts"][0] == pytest.approx(0.16 + 0.14)
    assert r["itls"][0] == pytest.approx([0.11, 0.11])
    assert r["latencies"][0] == pytest.approx(0.52)
    w = r["simulated"]["workers"][0]
    assert w["steps"] == {"prefill": 2, "decode": 2, "mixed": 0}
    assert w["busy_s"] == pytest.approx(0.52)


def test_a_long_run_tells_its_progress_and_ends_as_a_silent_one(monkeypatch):
    """A run of minutes says how far it is (simulate prints it to stderr); being told does
    not change the result: the run is in virtual time."""
    from phasewise.perf import simulate as sim

    specs = [spec(i, i * 0.01, 8, 40) for i in range(200)]
    quiet = simulate(LinearCost(), ENGINE, Deployment(), specs)
    monkeypatch.setattr(sim, "PROGRESS_EVERY_S", 0.0)
    notes: list[str] = []
    told = simulate(LinearCost(), ENGINE, Deployment(), specs, progress=notes.append)
    assert notes and all(n.startswith("simulating: ") and " of 200 requests finished" in n
                         for n in notes), notes
    assert told["ttfts"] == quiet["ttfts"] and told["itls"] == quiet["itls"]


def test_a_request_arriving_mid_step_waits_for_the_next_step():
    # The first prompt's step runs 0 -> 0.15; the second arrives at 0.05 and is scheduled
    # at 0.15, beside the first one's decode.
    r = simulate(LinearCost(), ENGINE, Deployment(), [spec(0, 0.0, 5, 2), spec(1, 0.05, 4, 2)])
    assert r["server_timings"][1]["queue_s"] == pytest.approx(0.10)
    # Step 2 holds request 0's decode (1) and request 1's prompt, cut to the budget left (5).
    assert r["ttfts"][1] == pytest.approx(0.10 + 0.1 + 0.01 * 5)


def test_pd_first_token_lands_with_the_last_kv_byte():
    link = Link("t", "test link", 1e6, "test", 0.01)  # 1 MB/s, 10 ms
    r = simulate(LinearCost(), ENGINE, Deployment("pd", link=link, handoff_s=0.0),
                 [spec(0, 0.0, 10, 3)])
    # Prefill worker: chunk 6 (0 -> 0.16, its 6 kB on the link until 0.166), chunk 4
    # (0.16 -> 0.30, 4 kB sent 0.30 -> 0.304, + 10 ms): the first token is back at 0.314.
    assert r["ttfts"][0] == pytest.approx(0.314)
    assert r["itls"][0] == pytest.approx([0.11, 0.11])  # decode-only steps on the decode side
    sim = r["simulated"]
    dec, pre = sim["workers"]
    assert (dec["role"], pre["role"]) == ("decode", "prefill")
    assert dec["steps"] == {"prefill": 0, "decode": 2, "mixed": 0}
    assert pre["steps"]["prefill"] == 2
    assert sim["remote_prefills"] == 1
    assert sim["mean_transfer_wait_ms"] == pytest.approx(14.0)
    # The fixed hand-off cost comes on top of the bytes, once per remote prefill.
    r = simulate(LinearCost(), ENGINE, Deployment("pd", link=link, handoff_s=0.02),
                 [spec(0, 0.0, 10, 3)])
    assert r["ttfts"][0] == pytest.approx(0.334)


def test_pd_threshold_keeps_short_prompts_on_the_decode_worker():
    r = simulate(LinearCost(), ENGINE, Deployment("pd", threshold=8),
                 [spec(0, 0.0, 5, 2), spec(1, 0.0, 12, 2)])
    sim = r["simulated"]
    assert sim["remote_prefills"] == 1
    assert sim["local_prefills"] == {"short_prompt": 1}
    assert r["completed"] == 2


def test_a_small_pool_preempts_and_every_request_still_finishes():
    small = EngineSpec(num_kv_blocks=12, max_num_batched_tokens=16, max_model_len=40,
                       block_size=4)
    specs = [spec(i, 0.0, 12, 20) for i in range(4)]
    r = simulate(LinearCost(), small, Deployment(), specs)
    assert r["completed"] == 4
    assert r["simulated"]["workers"][0]["preemptions"] > 0
    assert all(n == 20 for n in r["output_lens"])


def test_replicas_share_the_requests_by_load():
    specs = [spec(i, 0.0, 4, 4) for i in range(6)]
    r = simulate(LinearCost(), ENGINE, Deployment(replicas=3), specs)
    served = [w["steps"]["prefill"] + w["steps"]["mixed"] for w in r["simulated"]["workers"]]
    assert r["completed"] == 6 and all(s > 0 for s in served)


def test_slo_admission_refuses_what_the_queue_would_make_late_and_only_with_targets():
    # Each 10-token prompt takes 2 steps (0.16 + 0.14 s) alone; ten at once queue up.
    specs = [spec(i, 0.0, 10, 3) for i in range(10)]
    slo = {"ttft": 700.0, "tpot": 1000.0}
    free = simulate(LinearCost(), ENGINE, Deployment(), specs, slo)
    assert free["completed"] == 10  # no admission: all served, the late ones late
    assert max(free["ttfts"]) > 0.7
    gated = simulate(LinearCost(), ENGINE, Deployment(admission=SLO(ttft_s=0.7)), specs, slo)
    adm = gated["simulated"]["admission"]
    assert 0 < adm["refused"] < 10 and adm["by_reason"] == {"slo_ttft": adm["refused"]}
    assert adm["admitted"] == 10 - adm["refused"] == gated["completed"]
    assert adm["admitted_met_slo"] == 1.0  # every admitted one met its TTFT target
    assert all(t <= 0.7 for t in gated["ttfts"] if t is not None)
    # the first ones are admitted (nothing ahead of them), later ones refused
    refused = [e for e in gated["errors"] if e]
    assert all("refused at admission (slo_ttft)" in e for e in refused)
    assert gated["request_goodput"] >= free["request_goodput"] * 0.999


def test_a_failed_replicas_requests_finish_on_the_other_after_one_prefill_each():
    # Two replicas, two requests (one each); replica 0 dies at 0.5 s, mid-decode.
    specs = [spec(0, 0.0, 5, 8), spec(1, 0.0, 5, 8)]
    whole = simulate(LinearCost(), ENGINE, Deployment(replicas=2), specs)
    r = simulate(LinearCost(), ENGINE, Deployment(replicas=2, fail_at=0.5), specs)
    assert r["simulated"]["migrated"] == 1 and r["completed"] == 2
    assert r["output_lens"] == [8, 8]  # every token once: the moved one goes on where it was
    # the moved request's stream pauses for its recompute: its longest gap grows beyond any
    # of the unbroken run's, by at least a step of its prompt and outputs so far
    gap = max(max(itl) for itl in r["itls"])
    assert gap > max(max(itl) for itl in whole["itls"]) + 0.1
    with pytest.raises(ValueError, match="at least 2 replicas"):
        Deployment(replicas=1, fail_at=1.0)
    with pytest.raises(ValueError, match="routing must be one of"):
        Deployment(routing="random")


def test_round_robin_ignores_load():
    # the first request is long; under least-load the third goes to the idle replica,
    # under round-robin back to the busy one
    specs = [spec(0, 0.0, 4, 30), spec(1, 0.01, 4, 1), spec(2, 0.5, 4, 1)]
    def where(routing):
        r = simulate(LinearCost(), ENGINE, Deployment(replicas=2, routing=routing), specs)
        return [w["steps"]["prefill"] + w["steps"]["mixed"] for w in r["simulated"]["workers"]]
    assert where("round-robin") != where("least-load")


def test_a_prompt_longer_than_the_context_fails_alone():
    r = simulate(LinearCost(), ENGINE, Deployment(), [spec(0, 0.0, 100, 2), spec(1, 0.0, 4, 2)])
    assert r["failed"] == 1 and r["completed"] == 1


def test_same_seed_same_run():
    cm = CostModel(lookup_model("qwen2.5-0.5b"), lookup_accelerator("l4"))
    eng = EngineSpec(num_kv_blocks=2000, max_num_batched_tokens=512)
    specs = build_workload(40, LengthDist.parse("uniform:16-300"), LengthDist.parse("16"),
                           request_rate=30.0, seed=4)
    a = simulate(cm, eng, Deployment(), specs)
    b = simulate(cm, eng, Deployment(), specs)
    assert a["ttfts"] == b["ttfts"] and a["itls"] == b["itls"]


def test_deployment_and_engine_specs_name_bad_values():
    with pytest.raises(ValueError, match="mode must be one of colocated, pd"):
        Deployment("both")
    with pytest.raises(ValueError, match="decode must be an integer >= 1"):
        Deployment("pd", decode=0)
    with pytest.raises(ValueError, match="prefill must be <= 1024"):
        Deployment("pd", prefill=10**8)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineSpec(num_kv_blocks=0)


# -- the engine's K/V pool: sized as phasewise serve sizes it ------------------------------------
def _tiny_folder(tmp_path, dtype="bfloat16"):
    from phasewise.model.tiny import tiny_config

    # 2 layers x 2 KV heads x head dim 16: 128 elements a token, K and V
    cfg = tiny_config(vocab_size=64, max_position_embeddings=1024, dtype=dtype)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("accel,flags", [
    ("cpu", []),  # the 1 GiB default, capped at what 128 sequences of 1024 tokens use
    ("cpu", ["--max-num-seqs", "2"]),
    ("cpu", ["--kv-cache-memory", "1MiB"]),  # lowers the default context to fit
    ("l4", ["--kv-cache-memory", "20MiB", "--max-model-len", "512"]),
    ("l4", ["--dtype", "fp32", "--block-size", "32"]),  # no budget: what the weights leave
])
def test_the_simulators_pool_is_the_one_the_engine_sizes(tmp_path, accel, flags):
    import dataclasses

    import torch

    from phasewise.cli import parse_args
    from phasewise.config import EngineConfig
    from phasewise.engine.kv_sizing import KVPlan
    from phasewise.engine.model_runner import ModelRunner
    from phasewise.model.config import ModelConfig
    from phasewise.perf.commands import engine_spec
    from phasewise.perf.models import ModelShape

    folder = str(_tiny_folder(tmp_path))
    a = parse_args(["simulate", "--model", folder, *flags])
    machine = lookup_accelerator("l4")
    if accel == "cpu":
        machine = dataclasses.replace(machine, key="cpu-test")
    cm = CostModel(ModelShape.from_path(folder), machine, a.dtype)
    eng = engine_spec(cm, a, folder)

    mc = ModelConfig.from_file(folder)
    config = EngineConfig(model=folder, max_model_len=a.max_model_len, block_size=a.block_size,
                          kv_cache_memory=a.kv_cache_memory, max_num_seqs=a.max_num_seqs)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    plan = KVPlan.plan(config, mc, ModelRunner.bytes_per_block(mc, a.block_size, dtype),
                       "cpu" if accel == "cpu" else "cuda")
    if plan.num_blocks is None:  # as if CUDA reported free what the weights leave
        plan = plan.on_free(int(machine.mem_bytes - cm.shape.total_params * cm.wbytes), config,
                            mc)
    assert (eng.num_kv_blocks, eng.max_model_len) == (plan.num_blocks, plan.max_model_len)
    assert f"{eng.num_kv_blocks} blocks of {a.block_size} tokens" in eng.kv_source
    assert "as phasewise serve sizes it" in eng.kv_source


def test_the_simulators_pool_is_capped_as_the_engines_is_and_says_where_it_comes_from(
        tmp_path, capsys, monkeypatch):
    import dataclasses

    from phasewise.cli import main
    from phasewise.perf import commands

    folder = str(_tiny_folder(tmp_path))
    # The default CPU pool (1 GiB of 4 KiB bf16 blocks: 262144) is capped, as the engine caps
    # it, at what 128 sequences of 1024 tokens use: 128 x 64 blocks + 1.
    machine = dataclasses.replace(lookup_accelerator("l4"), key="cpu-test")
    monkeypatch.setattr(commands, "cost_model", lambda model, gpu, profile, dtype: CostModel(
        commands.model_shape(model), machine, dtype))
    rc = main(["simulate", "--model", folder, "--num-prompts", "2", "--input-len", "16",
               "--output-len", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "8193 K/V blocks of 16" in out
    assert ("K/V pool: 8193 blocks of 16 tokens, 4 KiB a block (0.03 GiB) from 1.00 GiB, "
            "the engine's default on a CPU, capped at what 128 sequences of 1024 tokens "
            "could use") in out
    # An explicit context the pool cannot hold is refused, as phasewise serve refuses it.
    rc = main(["simulate", "--model", folder, "--kv-cache-memory", "64KiB",
               "--max-model-len", "1000", "--num-prompts", "2"])
    assert rc == 2 and "too few for --max-model-len 1000" in capsys.readouterr().err


def test_an_estimated_gpu_pool_says_it_is_an_estimate():
    import argparse

    from phasewise.perf.commands import engine_spec

    a = argparse.Namespace(block_size=16, max_model_len=None, kv_cache_memory=None,
                           max_num_seqs=128, max_num_batched_tokens=None, policy="chunked",
                           no_prefix_caching=False)
    eng = engine_spec(CostModel(lookup_model("llama-3.1-8b"), lookup_accelerator("h100-sxm")), a,
                      "llama-3.1-8b")
    assert "an estimate" in eng.kv_source and "--kv-cache-memory sizes it exactly" in eng.kv_source


def test_the_printed_kv_of_remote_prefills_is_a_mean():
    from phasewise.perf.summary import text_table

    specs = [spec(0, 0.0, 10, 2), spec(1, 0.0, 30, 2)]
    r = simulate(LinearCost(), ENGINE, Deployment("pd", handoff_s=0.0), specs)
    text = text_table(r)
    assert "2 of 2 prefilled remotely, a mean 0.02 MB of K/V a request" in text  # (10+30)/2 KB
    assert "K/V each" not in text


# -- the cost model and its fit ------------------------------------------------------------------
SHAPE = lookup_model("qwen2.5-0.5b")
CPU = lookup_accelerator("l4")  # any figures: the fit is checked against a known model


def truth() -> CostModel:
    knots = [Knot(r, "bf16", u) for r, u in
             ((1, 1.3), (2, 1.5), (4, 2.0), (8, 2.2), (16, 2.0), (32, 1.8), (64, 1.9),
              (128, 2.0), (256, 1.9), (512, 1.8))]
    return CostModel(SHAPE, CPU, "bf16", knots, overhead_s=2e-3, per_seq_s=3e-4,
                     attn_prefill_inv_eff=2.5, kv_prefill_inv_eff=4.0, kv_decode_inv_eff=6.0)


def test_the_fit_recovers_a_known_model_and_predicts_steps_it_never_saw():
    t = truth()
    pts = grid(4096 + 544, 544)
    steps = [(p.mix(), t.step_time(p.mix().chunks, p.mix().decodes)) for p in pts]
    got = fit(SHAPE, CPU, "bf16", steps, lambda rows: "bf16")
    assert got.fit_report["max_abs_rel_err"] < 1e-6
    assert got.overhead_s == pytest.approx(2e-3, rel=1e-3)
    assert got.kv_decode_inv_eff == pytest.approx(6.0, rel=1e-3)
    for p in (GridPoint(3, 300), GridPoint(24, 3000), GridPoint(0, 0, 200, 1500),
              GridPoint(12, 1500, 200, 1500), GridPoint(20, 200, 160, 200)):
        m = p.mix()
        assert got.step_time(m.chunks, m.decodes) == pytest.approx(
            t.step_time(m.chunks, m.decodes), rel=1e-3)


def test_the_fit_wants_enough_points_and_positive_times():
    with pytest.raises(ValueError, match="at least 4"):
        fit(SHAPE, CPU, "bf16", [(StepMix((), [10]), 0.1)])
    with pytest.raises(ValueError, match="> 0"):
        fit(SHAPE, CPU, "bf16", [(StepMix((), [10 + i]), 0.0) for i in range(5)])


def test_a_profile_round_trips():
    t = truth()
    back = CostModel.from_dict(SHAPE, CPU, json.loads(json.dumps(t.to_dict())))
    for mix in (StepMix((), [100] * 5), StepMix([Chunk(64, 10)], [300])):
        assert back.step_time(mix.chunks, mix.decodes) == t.step_time(mix.chunks, mix.decodes)


def test_assumed_model_is_the_fused_roofline_at_its_efficiencies():
    cm = CostModel(SHAPE, CPU)  # no knots: assumed MFU / MBU
    batch = [512] * 8
    weights = cm.body_bytes + cm.head_bytes
    kv = sum(batch) * cm.kv_bytes_per_token
    expect = cm.overhead_s + 8 * cm.per_seq_s + (weights + kv) / (CPU.mem_bandwidth * cm.mbu)
    assert cm.step_time((), batch) == pytest.approx(expect)  # decode: memory-bound
    # A long prompt chunk is compute-bound: time grows with its tokens.
    assert cm.step_time([Chunk(4096)]) > 3 * cm.step_time([Chunk(1024)])


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_nnls_meets_its_optimality_conditions(m, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(m + n, n))
    b = rng.normal(size=m + n)
    x = nnls(a, b)
    g = a.T @ (a @ x - b)  # gradient of half the squared residual
    assert (x >= 0).all()
    assert np.allclose(g[x > 1e-9], 0, atol=1e-6)  # free coordinates: stationary
    assert (g[x <= 1e-9] >= -1e-6).all()  # bound ones: the gradient pushes them below 0
    free = np.linalg.lstsq(a, b, rcond=None)[0]
    if (free > 0).all():
        assert np.allclose(x, free, atol=1e-6)


# -- what the field found, reproduced in simulation ----------------------------------------------
def engine_for(cm: CostModel, **kw) -> EngineSpec:
    free = cm.accel.mem_bytes * 0.9 - cm.body_bytes - cm.head_bytes
    return EngineSpec(num_kv_blocks=kv_blocks_for(cm, free, 16), max_model_len=8192, **kw)


def test_sarathi_chunked_prefill_beats_prefill_first_on_p99_itl_at_equal_throughput():
    cm = CostModel(lookup_model("llama-3.1-8b"), lookup_accelerator("a100-80gb"))
    specs = build_workload(200, LengthDist.parse("uniform:1024-3072"), LengthDist.parse("128"),
                           request_rate=2.0, seed=1)
    chunked = simulate(cm, engine_for(cm, max_num_batched_tokens=512), Deployment(), specs)
    first = simulate(cm, engine_for(cm, policy="prefill-first"), Deployment(), specs)
    assert chunked["completed"] == first["completed"] == 200
    assert chunked["output_throughput"] == pytest.approx(first["output_throughput"], rel=0.05)
    assert chunked["p99_itl_ms"] < 0.5 * first["p99_itl_ms"]


def _workload(input_len: str, output_len: str, seed: int, window: float = 20.0,
              cap: int = 2000) -> Workload:
    """Enough requests that each rate holds for ``window`` seconds: fewer would measure how a
    burst drains, not a sustained rate (a short burst flatters whichever deployment has more
    workers to spread it over)."""
    return Workload(lambda r: build_workload(int(min(max(120, r * window), cap)),
                                             LengthDist.parse(input_len),
                                             LengthDist.parse(output_len), request_rate=r,
                                             seed=seed))


def test_distserve_pd_wins_goodput_per_accelerator_with_long_prompts_and_tight_slos():
    # Long prompts, TTFT and TPOT tight together: chunked co-location must trade one for the
    # other at every budget; a prefill-heavy P/D ratio meets both.
    cm = CostModel(lookup_model("llama-3.1-8b"), lookup_accelerator("a100-80gb"))
    wl = _workload("uniform:2048-4096", "256", seed=2)
    slo = {"ttft": 500.0, "tpot": 18.0}
    # (Budgets above 512 do worse still: their prompt chunks stretch TPOT further.)
    best_colocated = max(goodput(cm, engine_for(cm, max_num_batched_tokens=b), Deployment(),
                                 wl, slo, start=0.5, iters=5)[0] for b in (256, 512))
    pd, _ = goodput(cm, engine_for(cm, max_num_batched_tokens=2048),
                    Deployment("pd", prefill=2, decode=1, link=LINKS["ib-ndr"]), wl, slo,
                    start=0.5, iters=5)
    assert best_colocated > 0
    assert pd / 3 > 1.15 * best_colocated


def test_llm_d_pd_does_not_pay_for_a_small_model_with_short_requests():
    cm = CostModel(lookup_model("qwen2.5-1.5b"), lookup_accelerator("l4"))
    wl = _workload("uniform:64-256", "uniform:32-96", seed=3, window=6.0)
    slo = {"ttft": 150.0, "tpot": 25.0}
    eng = engine_for(cm, max_num_batched_tokens=512)
    colocated, _ = goodput(cm, eng, Deployment(), wl, slo, start=32, iters=3)
    assert colocated > 0
    for p, d in ((1, 1), (1, 3)):
        pd, _ = goodput(cm, eng, Deployment("pd", prefill=p, decode=d, link=LINKS["25gbe"]),
                        wl, slo, start=32, iters=3)
        assert pd / (p + d) < colocated


# -- the planner -----------------------------------------------------------------------------------
def test_plan_ranks_by_goodput_per_accelerator_gives_reasons_and_sizes_the_winner():
    cm = CostModel(lookup_model("llama-3.1-8b"), lookup_accelerator("h100-sxm"))
    wl = _workload("uniform:256-1024", "64", seed=5, window=3.0, cap=200)
    wl.rate = 12.0
    slo = {"ttft": 400.0, "tpot": 25.0}
    cands = search(cm, engine_for(cm), wl, slo, budgets=(512, 2048), policies=("chunked",),
                   ratios=((1, 1),), thresholds=(0,), link=LINKS["ib-ndr"], start=8.0)
    assert len(cands) == 3
    per = [c.per_accelerator for c in cands]
    assert per == sorted(per, reverse=True) and per[0] > 0
    for c in cands:
        assert "bound (missed at" in c.verdict and "miss TTFT" in c.verdict
        assert attainment(c.at_goodput, slo) >= 0.9
    sized = size(cands[0], wl, cm, slo)
    assert sized is not None and sized.units >= math.ceil(12.0 / cands[0].goodput)
    assert sized.attainment >= 0.9
    assert sized.deployment.accelerators == sized.units * cands[0].accelerators


def test_a_prefill_first_candidate_is_not_labelled_with_a_budget_it_ignores():
    """prefill-first steps take whole prompts (the scheduler raises its budget to the
    context), so the plan names no budget for it; chunked keeps its own."""
    from dataclasses import replace

    from phasewise.perf.plan import Candidate

    spec = replace(ENGINE, max_num_batched_tokens=16)
    pf = Candidate(Deployment("colocated"), replace(spec, policy="prefill-first"))
    assert pf.engine.scheduler_config().max_num_batched_tokens == spec.max_model_len != 16
    assert "16" not in pf.label() and "whole prompts" in pf.label()
    assert Candidate(Deployment("colocated"), spec).label().endswith("budget 16")


def test_plan_cli_writes_manifests_that_validate(tmp_path, capsys):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    import yaml

    from phasewise.cli import main

    out = tmp_path / "k8s"
    rc = main(["plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--link", "25gbe",
               "--input-len", "uniform:64-256", "--output-len", "32", "--num-prompts", "40",
               "--request-rate", "3", "--goodput", "ttft:1000", "tpot:100", "--budgets", "128",
               "512",
               "--ratios", "1:1", "--thresholds", "0", "--window", "5", "--max-model-len",
               "2048", "--k8s-out", str(out), "--api-key-secret", "serving-keys"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "rank" in text and "best:" in text and "unit(s)" in text
    (written,) = out.glob("*.yaml")
    assert "create secret generic serving-keys --from-literal=api-key=" in written.read_text()
    docs = [d for d in yaml.safe_load_all(written.read_text()) if d]
    for d in (d for d in docs if d["kind"] == "Deployment"):  # every pod takes the key
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert {"name": "PHASEWISE_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": "serving-keys", "key": "api-key"}}} in c["env"]
    # The winner's own settings reach the engines' flags.
    best = text.split("best: ", 1)[1].split(":", 1)[0]
    budget = best.rsplit("budget ", 1)[1]
    args = next(d for d in docs if d["kind"] == "ConfigMap"
                and "PHASEWISE_ENGINE_ARGS" in d.get("data", {}))["data"]["PHASEWISE_ENGINE_ARGS"]
    assert f"--max-num-batched-tokens {budget}" in args
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap"} <= kinds
    for d in docs:
        kubernetes_validate.validate(d, "1.30.0", strict=True)


def test_simulate_cli_writes_a_result_the_report_reads(tmp_path, capsys):
    from phasewise.bench.report import load_result, render
    from phasewise.cli import main

    res = tmp_path / "sim.json"
    rc = main(["simulate", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--num-prompts",
               "50", "--request-rate", "5", "--input-len", "uniform:100-900", "--output-len",
               "32", "--goodput", "ttft:500", "tpot:50", "--result-file", str(res),
               "--mode", "pd", "--link", "100gbe"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "P/D 1P:1D" in text and "remote prefills 50, local 0 (none)" in text
    r = load_result(res)
    assert r["completed"] == 50 and r["simulated"]["deployment"].startswith("P/D")
    assert render([res], tmp_path / "report.html").exists()


def test_an_instant_kv_link_is_named_where_pd_is_ranked_on_it(capsys):
    """plan with no --link ranked P/D over a free K/V hand-off without a word; 'instant' is
    now a value --link takes and lists, and plan says when its P/D rows assume it."""
    from phasewise.cli import main

    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--input-len",
            "uniform:64-256", "--output-len", "16", "--num-prompts", "20", "--request-rate",
            "2", "--goodput", "ttft:1000", "tpot:100", "--budgets", "256", "--ratios", "1:1",
            "--thresholds", "0", "--window", "5", "--max-model-len", "2048"]
    main(argv)
    assert "P/D rows move K/V over an instant link (--link instant, the default)" in \
        capsys.readouterr().out
    main([*argv, "--link", "25gbe"])
    assert "instant link" not in capsys.readouterr().out
    rc = main(["simulate", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--num-prompts",
               "8", "--output-len", "4", "--mode", "pd", "--link", "instant"])
    assert rc == 0 and "K/V link instant" in capsys.readouterr().out
    assert main(["simulate", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--mode", "pd",
                 "--link", "bogus"]) == 2
    assert "unknown link 'bogus'; choose instant or one of nvlink3" in capsys.readouterr().err


def test_simulate_cli_names_what_is_missing(tmp_path, capsys, monkeypatch):
    from phasewise.cli import main

    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))  # no phasewise measure file
    rc = main(["simulate", "--model", "qwen2.5-0.5b", "--num-prompts", "5"])
    err = capsys.readouterr().err
    assert rc == 2 and "phasewise measure" in err
    rc = main(["simulate", "--model", "qwen2.5-0.5b", "--gpu", "nope", "--num-prompts", "5"])
    assert rc == 2 and "unknown accelerator 'nope'" in capsys.readouterr().err
    rc = main(["plan", "--model", "qwen2.5-0.5b", "--gpu", "l4", "--goodput", "ttft:100"])
    assert rc == 2 and "both SLOs" in capsys.readouterr().err
    bad = tmp_path / "profile.json"
    bad.write_text('{"version": 1, "shape": {}}')
    rc = main(["simulate", "--model", "qwen2.5-0.5b", "--profile", str(bad)])
    assert rc == 2 and "damaged profile" in capsys.readouterr().err
    rc = main(["simulate", "--model", "qwen2.5-0.5b", "--gpu", "l4", "--block-size", "0"])
    assert rc == 2 and "--block-size must be >= 1" in capsys.readouterr().err


def test_simulate_plan_and_manifests_run_without_torch():
    import subprocess
    import sys

    script = r"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from phasewise.perf.workload import LengthDist, build_workload
from phasewise.perf.costmodel import CostModel
from phasewise.perf.hardware import lookup_accelerator
from phasewise.perf.k8s import DeploySpec, manifests
from phasewise.perf.models import lookup_model
from phasewise.perf.plan import Workload, goodput
from phasewise.perf.simulate import Deployment, EngineSpec, simulate
import phasewise.perf.commands, phasewise.perf.calibrate
cm = CostModel(lookup_model("qwen2.5-0.5b"), lookup_accelerator("l4"))
specs = build_workload(20, LengthDist.parse("64"), LengthDist.parse("8"), request_rate=50.0)
r = simulate(cm, EngineSpec(num_kv_blocks=500), Deployment("pd"), specs)
assert r["completed"] == 20, r
assert manifests(DeploySpec(model_path="/models/x", mode="pd", decode=2))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_quick_grid_is_small_and_short_contexts_are_spread():
    quick = grid(4096 + 160, 160, quick=True)
    assert len(quick) <= 16
    assert {p.decode_context for p in quick if p.decodes} <= {128, 512}
    short = grid(256, 544)  # the bundled model's context
    ctx = {p.decode_context for p in short if p.decodes}
    assert len(ctx) >= 3 and max(ctx) < 256
    assert all(p.chunk_context + p.chunk < 256 for p in short)


def test_pd_timings_carry_each_remote_prefills_kv_bytes():
    specs = [spec(i, 0.01 * i, 30, 2) for i in range(3)]
    r = simulate(LinearCost(), ENGINE, Deployment("pd", handoff_s=0.0), specs)
    assert r["completed"] == 3
    kv = [t["kv_bytes"] for t in r["server_timings"]]
    assert kv == [30 * LinearCost.kv_bytes_per_token] * 3  # each prompt's K/V, once
    assert r["ttft_split"]["remote"] == 3  # the bench's own split sees them as remote


def test_a_latent_attention_pool_holds_its_latents_and_a_window_its_windows():
    """The simulated engine's pool is sized from the shape's own K/V bytes (a latent per
    token for multi-head latent attention, not per-head keys and values) and, where every
    layer is windowed, gives back the blocks behind the window (its spec carries it)."""
    import argparse
    from dataclasses import replace

    from phasewise.perf.commands import engine_spec

    a = argparse.Namespace(block_size=16, max_model_len=None, kv_cache_memory="1GiB",
                           max_num_seqs=128, max_num_batched_tokens=None, policy="chunked",
                           no_prefix_caching=False)
    v3 = lookup_model("DeepSeek-V3")
    small = replace(v3, num_layers=4, num_experts=8, dense_layers=1, name="mla")
    eng = engine_spec(CostModel(small, lookup_accelerator("h200")), a, None)
    assert eng.num_kv_blocks == 2**30 // (4 * (512 + 64) * 2 * 16)
    mistral = engine_spec(CostModel(lookup_model("Mistral-7B-v0.1"),
                                    lookup_accelerator("h100-sxm")), a, "Mistral-7B-v0.1")
    assert mistral.kv_window == 4096
    assert engine_spec(CostModel(lookup_model("gemma-2-9b"), lookup_accelerator("h100-sxm")),
                       a, "gemma-2-9b").kv_window is None  # half its layers read everything


def test_a_trace_line_that_means_nothing_is_refused_by_its_line(tmp_path):
    from phasewise.perf.workload import load_trace

    for text, match in (('{"arrival": NaN, "prompt_len": 5, "output_len": 3}\n', "finite"),
                        ("[1, 2]\n", "got a list"),
                        ('{"arrival": 0, "prompt_len": 5}\n', "no output_len"),
                        ("\n", "holds no request"),
                        ('{"prompt_len": 1e999, "output_len": 3}\n', "whole number"),
                        ('{"prompt_len": 7.9, "output_len": 3}\n', "whole number"),
                        ('{"prompt_len": "abc", "output_len": 3}\n', "t.jsonl:1: .*whole"),
                        ('{"prompt": 5, "output_len": 3}\n', "prompt must be text")):
        path = tmp_path / "t.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_trace(path)
    path.write_text('{"arrival": 2, "prompt_len": 5, "output_len": "3"}\n'  # digits: a count
                    '{"arrival": 1.5, "prompt": "hi", "output_len": 1}\n')
    specs = load_trace(path, time_scale=2.0)
    assert [(s.arrival, s.output_len) for s in specs] == [(0.0, 1), (1.0, 3)]


def test_simulate_refuses_weights_the_machine_cannot_hold_and_says_when_none_finished(
        capsys):
    from phasewise.cli import main

    base = ["simulate", "--num-prompts", "4", "--request-rate", "5", "--output-len", "4"]
    # 93 GB of bf16 weights on the 24 GB CPU of the catalog's smallest card
    assert main([*base, "--model", "Mixtral-8x7B-v0.1", "--gpu", "l4",
                 "--input-len", "64"]) == 2
    assert "do not fit in" in capsys.readouterr().err
    # every prompt longer than the context: refused before the run, as bench refuses it
    assert main([*base, "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--max-model-len",
                 "512", "--input-len", "4096"]) == 2
    assert "would not fit the engine's context of 512 tokens" in capsys.readouterr().err
    # a run where no request finished: no latency to summarise, and no nan printed
    from phasewise.perf.summary import summarize, text_table

    out = text_table(summarize([], 1.0))
    assert "TTFT (ms):" in out and "none (no request gave one)" in out and "nan" not in out


@pytest.mark.parametrize("flags,match", [
    (["--cpus", "0"], "--cpus: "),
    (["--name", "BAD_NAME!"], "--name: "),
    (["--namespace", "Bad_NS"], "--namespace: "),
    (["--model-path", "rel/path"], "--model-path: "),
    (["--api-key-secret", "My Keys"], "--api-key-secret: "),
])
def test_plan_refuses_a_manifest_flag_before_its_search(flags, match, capsys, monkeypatch):
    """A manifest flag the manifests would refuse is refused by its name before the search
    (minutes on a real workload), not after it."""
    from phasewise.cli import main
    from phasewise.perf import plan

    monkeypatch.setattr(plan, "search", lambda *a, **k: pytest.fail("searched"))
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--num-prompts", "4",
            "--goodput", "ttft:200", "tpot:10", *flags]
    assert main([*argv, "--k8s-out", "k8s-never-written"]) == 2
    assert match in capsys.readouterr().err
    # without --k8s-out no manifest is written: the flag would be ignored, so it is refused
    assert main(argv) == 2
    assert f"{flags[0]} shapes the Kubernetes manifests, which plan writes only with " \
        "--k8s-out DIR" in capsys.readouterr().err


@pytest.mark.parametrize("flags,named", [
    (["--ratios", "1:1"], "--ratios"),
    (["--thresholds", "0", "--link", "25gbe"], "--thresholds, --link"),
    (["--prefill-queue-limit", "4"], "--prefill-queue-limit"),
    (["--link", ""], "--link"),  # an empty value is given, not a fallback to none
])
def test_plan_refuses_a_pd_flag_that_no_pd_would_ignore(flags, named, capsys, monkeypatch):
    from phasewise.cli import main
    from phasewise.perf import plan

    monkeypatch.setattr(plan, "search", lambda *a, **k: pytest.fail("searched"))
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--num-prompts", "4",
            "--goodput", "ttft:200", "tpot:10", "--no-pd", *flags]
    assert main(argv) == 2
    assert f"--no-pd searches co-located deployments only: {named} would be ignored" in \
        capsys.readouterr().err


def test_a_normal_length_below_one_token_is_refused():
    """normal:0,0 drew every length as 1 (clamped): outputs with no decode, TPOT nan."""
    from phasewise.perf.workload import LengthDist

    for bad in ("normal:0,0", "normal:5,2,max=0"):
        with pytest.raises(ValueError, match=">= 1"):
            LengthDist.parse(bad)
    assert LengthDist.parse("normal:5,2,max=9").max == 9


def test_a_failure_due_after_the_run_has_ended_fails_nothing():
    """--fail-at past the last token: the summary says nothing failed, not that replica 0
    failed with nothing moved."""
    from phasewise.perf.workload import LengthDist

    cm = CostModel(lookup_model("llama-3.1-8b"), lookup_accelerator("h100-sxm"))
    specs = build_workload(6, LengthDist.parse("64"), LengthDist.parse("8"), request_rate=5.0,
                           seed=1)
    eng = EngineSpec(block_size=16, max_num_batched_tokens=256, max_num_seqs=8,
                     max_model_len=512, num_kv_blocks=256)
    late = simulate(cm, eng, Deployment(replicas=2, fail_at=1e9), specs)
    assert "migrated" not in late["simulated"] and late["completed"] == 6
    early = simulate(cm, eng, Deployment(replicas=2, fail_at=0.0), specs)
    assert "migrated" in early["simulated"] and early["completed"] == 6


def test_cpu_local_prices_fp32_weights_at_the_fp32_peak(tmp_path, monkeypatch):
    """Without a profile, cpu-local rates bf16 weights at its faster peak (many CPUs have no
    bf16 arithmetic, and the engine's kernels pick the faster path), but fp32 weights run fp32
    arithmetic: priced at the fp32 peak, as the roofline prices them."""
    import json

    from phasewise.perf.commands import cost_model

    (tmp_path / "machine.json").write_text(json.dumps({"cpu-local": {
        "name": "test CPU", "peak_flops": {"fp32": 1e11, "bf16": 4e11},
        "mem_bytes": 2**34, "mem_bandwidth": 3e10}}))
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path))
    from phasewise.engine.step_cost import Chunk

    chunks = [Chunk(512, 0, True)]
    bf16 = cost_model("llama-3.1-8b", "cpu-local", None, "bf16")
    for name in ("fp32", "float32", "FP32"):  # the dtype as any of its spellings
        fp32 = cost_model("llama-3.1-8b", "cpu-local", None, name)
        assert fp32.step_time(chunks, []) > 3 * bf16.step_time(chunks, []), name


@pytest.mark.parametrize("prefill_busy,decode_busy,bound", [
    (0.17, 1.0, "decode-bound"), (0.98, 0.4, "prefill-bound")])
def test_a_ttft_verdict_names_the_role_whose_queue_held_the_prompts(prefill_busy, decode_busy,
                                                                  bound):
    """P/D 1:3 with its decode workers saturated and its prefill worker idle: the late
    prompts waited behind decode, and the verdict says so (it said prefill-bound)."""
    from phasewise.perf.plan import Candidate, verdict

    late = {"queue_s": 0.6, "prefill_s": 0.05}
    above = {"ttfts": [0.9, 0.8, 0.05], "latencies": [1.0, 0.9, 0.2], "output_lens": [4] * 3,
             "server_timings": [late, late, {}], "request_rate": 5.0, "p90_tpot_ms": 10.0,
             "simulated": {"workers": [
                 {"role": "prefill", "utilization": prefill_busy, "steps": {}, "preemptions": 0},
                 *[{"role": "decode", "utilization": decode_busy, "steps": {},
                    "preemptions": 0}] * 3]}}
    c = Candidate(Deployment("pd", prefill=1, decode=3), ENGINE, goodput=4.0, above=above)
    text = verdict(c, {"ttft": 500.0, "tpot": 50.0})
    assert text.startswith(f"{bound} (missed at 5 req/s): the late prompts waited 600 ms")
    assert f"decode {decode_busy:.0%} busy" in text and "2 of 3 miss TTFT" in text


@pytest.mark.parametrize("queue_s,prefill_s,decode_busy,start", [
    # saturated decode workers stretch a late prompt's first token whichever time is larger
    (0.336, 0.341, 0.99, "decode-bound (missed at 5 req/s): the late prompts waited 336 ms "
                         "for their first step behind the busy decode workers, then took 341 ms"),
    # decode not saturated, prefill the larger: the prompts' own prefill, by the docs' name
    (0.1, 0.4, 0.6, "prefill-bound (missed at 5 req/s): the late prompts' own prefill took 400 ms "
                    "(after 100 ms of waiting) against a TTFT SLO of 500 ms")])
def test_a_late_prompts_own_prefill_is_put_down_to_a_saturated_role(queue_s, prefill_s,
                                                                     decode_busy, start):
    from phasewise.perf.plan import Candidate, verdict

    late = {"queue_s": queue_s, "prefill_s": prefill_s}
    above = {"ttfts": [0.9, 0.8], "latencies": [1.0, 0.9], "output_lens": [4] * 2,
             "server_timings": [late, late], "request_rate": 5.0, "p90_tpot_ms": 10.0,
             "simulated": {"workers": [
                 {"role": "prefill", "utilization": 0.52, "steps": {}, "preemptions": 0},
                 {"role": "decode", "utilization": decode_busy, "steps": {},
                  "preemptions": 0}]}}
    c = Candidate(Deployment("pd", prefill=1, decode=1), ENGINE, goodput=4.0, above=above)
    text = verdict(c, {"ttft": 500.0, "tpot": 50.0})
    assert text.startswith(start), text
    assert "prompt-bound" not in text


def test_a_low_rate_is_sized_on_the_fewest_accelerators_not_the_best_ratio():
    """plan sized 10 req/s as one P/D unit of 2 accelerators (the most goodput per
    accelerator) while one co-located engine met 35 req/s alone. The deployment is the
    one whose units for the rate take the fewest accelerators; at a high rate that is the
    best per accelerator again, and ties go to it."""
    from phasewise.perf.plan import Candidate, cheapest_for, units_for
    from phasewise.perf.simulate import Deployment, EngineSpec

    eng = EngineSpec(num_kv_blocks=1024)
    pd = Candidate(Deployment("pd", prefill=1, decode=1), eng, goodput=80.0)  # 40 a card
    co = Candidate(Deployment("colocated"), eng, goodput=35.0)  # 35 a card
    cands = sorted([co, pd], key=lambda c: -c.per_accelerator)
    assert cands[0] is pd
    assert cheapest_for(cands, 10.0) is co and units_for(co, 10.0) == 1
    assert cheapest_for(cands, 70.0) is pd  # 2 accelerators either way: the better ratio
    assert cheapest_for(cands, 400.0) is pd  # 10 against 12
    assert cheapest_for(cands, None) is None
    assert cheapest_for([Candidate(Deployment("colocated"), eng, goodput=0.0)], 5.0) is None
