"""The CPU kernel plan: the rule, the plan files, and engine starts that time nothing.

No test here times anything: plans are written by hand (as ``phasewise tune`` writes them) and
every engine start runs with the calibration made to fail if it were called.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phasewise import LLM, SamplingParams
from phasewise.config import EngineConfig
from phasewise.model.attention import AttentionMetadata
from phasewise.model.config import ModelConfig
from phasewise.model.cpu import kernels
from phasewise.model.cpu.capabilities import capabilities, read_capabilities
from phasewise.model.cpu.linear import LARGE_METHODS as LINEAR_METHODS
from phasewise.model.cpu.linear import LinearDispatch
from phasewise.model.cpu.plan import (
    ALL_ROWS,
    LARGE_METHODS,
    LinearSpec,
    PlanError,
    PlanKey,
    Runtime,
    StoredPlan,
    plans_dir,
    read_plan_file,
    resolve,
    rule,
    write_plan_file,
)

needs_kernels = pytest.mark.skipif(kernels.load() is None,
                                   reason=f"CPU kernels unavailable: {kernels.KERNELS.reason}")

INTEL = read_capabilities("vendor_id : GenuineIntel\nmodel name : Xeon\nflags : avx2 fma "
                          "avx512f avx512bw avx512vl avx512dq avx512_bf16 amx_tile amx_bf16\n",
                          "x86_64", 2)
AMD = read_capabilities("vendor_id : AuthenticAMD\nmodel name : EPYC\nflags : avx2 fma "
                        "avx512f avx512bw avx512vl avx512dq avx512_bf16\n", "x86_64", 2)
ZEN2 = read_capabilities("vendor_id : AuthenticAMD\nmodel name : EPYC 7B12\nflags : avx2 fma\n",
                         "x86_64", 2)
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 320, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512,
          "tie_word_embeddings": True}
SHAPE = ModelConfig.from_dict(CONFIG)


def key_for(caps, cfg=SHAPE, quantization=None, threads=2):
    return PlanKey.of(caps, cfg, "bfloat16", quantization, threads)


# -- the rule ------------------------------------------------------------------------------

def test_the_rule_picks_from_what_runs_and_the_models_shape():
    """AMX: the streams to 2 rows, AMX above, rows kept; AVX512_BF16 without AMX: panels (the
    head too where its vocabulary is a multiple of 16: the linear plan then idle), the
    streams / avx512bf16 tier / torch for what stays in rows (int8); AVX2: the kernel to 128
    rows, the packed GEMM above; no library: torch or the fp32 upcast. Intel prefetches
    2 KiB ahead, others 256 bytes."""
    amx = rule(key_for(INTEL), Runtime(True, True, True), INTEL)
    assert amx[:3] == (False, LinearSpec(2, "amx"), 2048)
    rows = LinearSpec(3, "torch", mid="avx512bf16", mid_max_rows=32)
    assert rule(key_for(AMD), Runtime(True, True, False), AMD)[:3] == (
        True, LinearSpec(0, "torch"), 256)
    odd_vocab = ModelConfig.from_dict({**CONFIG, "vocab_size": 300})  # the head in rows
    assert rule(key_for(AMD, odd_vocab), Runtime(True, True, False), AMD)[:2] == (True, rows)
    panels, linear, _, why = rule(key_for(AMD, quantization="int8"), Runtime(True, True, False),
                                  AMD)
    assert (panels, linear) == (False, rows) and "int8 weights" in why
    assert rule(key_for(ZEN2), Runtime(True, False, False), ZEN2)[:3] == (
        False, LinearSpec(128, "gemm"), 256)
    assert rule(key_for(AMD), Runtime(False, False, False), AMD)[1] == LinearSpec(0, "torch")
    assert rule(key_for(ZEN2), Runtime(False, False, False), ZEN2)[1] == LinearSpec(0, "upcast")
    # the torch-free plan names the methods linear.py runs
    assert LARGE_METHODS == LINEAR_METHODS


def test_a_spec_names_each_projections_method_by_row_range():
    spec = LinearSpec(3, "torch", mid="avx512bf16", mid_max_rows=32)
    assert spec.ranges((64, 96)) == [(1, 3, "kernel"), (4, 32, "avx512bf16"),
                                     (33, ALL_ROWS, "torch")]
    amx = LinearSpec(2, "amx", prompt_by_shape=((896, 4864, "torch"),))
    assert amx.ranges((896, 4864)) == [(1, 2, "kernel"), (3, 255, "amx"), (256, ALL_ROWS, "torch")]
    assert amx.ranges((896, 896)) == [(1, 2, "kernel"), (3, ALL_ROWS, "amx")]
    assert LinearSpec(ALL_ROWS, "gemm").ranges((8, 8)) == [(1, ALL_ROWS, "kernel")]
    # the spec is the dispatch's: the same method at every row count
    d = spec.dispatch()
    assert all(d.method(r) == m for lo, hi, m in spec.ranges((64, 96))
               for r in (lo, min(hi, 5000)))
    assert LinearSpec.of(d) == spec
    key = key_for(AMD)
    from phasewise.model.cpu.plan import KernelPlan

    table = KernelPlan(key, True, LinearSpec(0, "torch"), 256, "rule", "").table(
        Runtime(True, True, False))
    assert "qkv_proj [128, 64]: panels 1+" in table and "lm_head [320, 64]: panels 1+" in table
    int8 = KernelPlan(key_for(AMD, quantization="int8"), False, spec, 256, "rule", "")
    assert "down_proj [64, 96]: int8-streams 1-6, int8-avx2-tiles 7-128, int8-gemm 129+" in \
        int8.table(Runtime(True, True, False))


# -- plan files ----------------------------------------------------------------------------

def stored(key, linear=LinearSpec(3, "torch", mid="avx512bf16", mid_max_rows=32), panels=False,
           prefetch=256):
    return StoredPlan(key=key, panels=panels, linear=linear, stream_prefetch=prefetch,
                      created="2025-01-02T03:04:05Z", measured={"rounds": 0})


def test_a_plan_file_and_a_cost_profile_name_one_cpu_by_one_family():
    """Stored plans and calibrate's profiles both carry the CPU's kernel family in their
    file names: the same CPU must read the same there, and a CPU with AVX-512F but not the
    BF16 dot products is named for the AVX2 kernels it runs."""
    from phasewise.perf.calibrate import machine_slug

    skylake = read_capabilities("vendor_id : GenuineIntel\nmodel name : Xeon Gold\nflags : "
                                "avx2 fma avx512f avx512bw avx512vl avx512dq\n", "x86_64", 2)
    for caps, family in ((INTEL, "amx"), (AMD, "avx512bf16"), (ZEN2, "avx2"),
                         (skylake, "avx2")):
        plan_name = key_for(caps).file_name()
        slug = machine_slug({"cpu": caps.model_name, "isa": list(caps.isa), "threads": 2})
        assert plan_name.endswith(f"-{family}-2t.json"), plan_name
        assert slug.endswith(f"-{family}-2t") and slug in plan_name, (slug, plan_name)


def test_a_plan_file_round_trips_and_a_malformed_one_is_refused_by_name(tmp_path):
    key = key_for(AMD)
    path = write_plan_file(stored(key), tmp_path / "p.json")
    assert read_plan_file(path) == stored(key)
    good = json.loads(path.read_text())

    def refused(mutate, *words):
        data = json.loads(json.dumps(good))
        mutate(data)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(data))
        with pytest.raises(PlanError) as e:
            read_plan_file(bad)
        for w in (str(bad), *words):
            assert w in str(e.value), str(e.value)

    refused(lambda d: d.update(format="x"), "not a kernel plan")
    refused(lambda d: d.update(version=9), "version must be 1")
    refused(lambda d: d["plan"]["linear"].update(large="dp"),
            "large must be one of torch, upcast, gemm, amx, avx512bf16; got 'dp'")
    refused(lambda d: d["plan"]["linear"].update(large="gemm"), "mid must be null or one of")
    refused(lambda d: d["plan"]["linear"].update(kernel_max_rows=-1), "kernel_max_rows")
    refused(lambda d: d["plan"]["linear"].pop("mid_max_rows"), "mid_max_rows is missing")
    refused(lambda d: d["plan"].update(panels="yes"), "panels must be true or false")
    refused(lambda d: d["plan"].update(stream_prefetch=100), "multiple of 64")
    refused(lambda d: d["key"].pop("threads"), "must be an object with")
    refused(lambda d: d["plan"]["linear"].update(
        prompt_by_shape=[{"n": 64, "k": 96, "method": "gemm"}]), "the method for shape 96 -> 64")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(PlanError, match="not JSON"):
        read_plan_file(tmp_path / "junk.json")


def test_a_stored_plan_for_another_cpu_or_shape_is_ignored_and_a_pinned_one_refused(tmp_path):
    here = key_for(AMD)
    runs = Runtime(True, True, False)
    for other, field in ((key_for(INTEL), "cpu: the plan's 'Xeon', here 'EPYC'"),
                         (key_for(AMD, threads=4), "threads: the plan's 4, here 2"),
                         (key_for(AMD, quantization="int8"), "quantization")):
        path = write_plan_file(stored(other), tmp_path / here.file_name())
        plan = resolve(here, runs, AMD, directory=tmp_path)
        assert plan.origin == "rule" and "stored plan ignored" in plan.source
        assert field in plan.source and str(path) in plan.source
        with pytest.raises(PlanError, match="made for another machine or model"):
            resolve(here, runs, AMD, pinned=path)
    # a plan naming kernels that cannot run here: the AMX tiles on this AMD
    path = write_plan_file(stored(here, LinearSpec(2, "amx")), tmp_path / here.file_name())
    plan = resolve(here, runs, AMD, directory=tmp_path)
    assert plan.origin == "rule" and "amx (needs the AMX kernels)" in plan.source
    # a sound one is used, and says so
    path = write_plan_file(stored(here), tmp_path / here.file_name())
    plan = resolve(here, runs, AMD, directory=tmp_path)
    assert plan.origin == "stored" and plan.linear == stored(here).linear
    assert plan.source == f"stored plan {path} (tuned 2025-01-02 03:04:05 UTC)"
    assert resolve(here, runs, AMD, pinned=path).source.startswith(f"pinned plan {path}")
    # none: the rule, and where tune would store one
    empty = resolve(here, runs, AMD, directory=tmp_path / "none")
    assert empty.origin == "rule" and "no stored plan" in empty.source


# -- engine starts -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    from conftest import build_hf_checkpoint

    path = tmp_path_factory.mktemp("plan-model")
    build_hf_checkpoint(path, "Qwen2ForCausalLM", dtype=torch.bfloat16, seed=7)
    return path


@pytest.fixture
def no_timing(monkeypatch, tmp_path):
    """A fresh cache folder (no stored plans but this test's), and a calibration that fails
    if an engine start calls it."""
    monkeypatch.setenv("PHASEWISE_CACHE_DIR", str(tmp_path / "cache"))

    def timed(*a, **k):
        raise AssertionError("an engine start timed the linear methods")

    monkeypatch.setattr(LinearDispatch, "calibrate", classmethod(timed))
    monkeypatch.setattr(LinearDispatch, "calibrate_prompt_shape", timed)
    monkeypatch.setattr(LinearDispatch, "_calibrate_mid", staticmethod(timed))


def store_for(model_dir: Path, spec: LinearSpec, panels: bool = False) -> Path:
    """A plan for ``model_dir`` on this machine, where engine starts look for it."""
    key = PlanKey.of(capabilities(), ModelConfig.from_file(model_dir), "bfloat16", None,
                     torch.get_num_threads())
    return write_plan_file(stored(key, spec, panels=panels), plans_dir() / key.file_name())


def rows_spec() -> LinearSpec:
    """A plan that runs every method this machine has for weights in rows, by row count."""
    if kernels.amx_available():
        return LinearSpec(2, "amx")
    if kernels.avx512bf16_available():
        return LinearSpec(3, "torch", mid="avx512bf16", mid_max_rows=32)
    return LinearSpec(16, "gemm")


def prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The engine's model's logits over ``ids`` as one prompt (fresh caches)."""
    model = llm.engine.model
    cfg = model.cfg
    n, bs = len(ids), 16
    nb = -(-n // bs)
    kv = [(torch.zeros(nb, bs, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16),
           torch.zeros(nb, bs, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16))
          for _ in range(cfg.num_layers)]
    meta = AttentionMetadata.build(chunk_lens=[n], context_lens=[0],
                                   block_tables=[list(range(nb))], block_size=bs,
                                   device=torch.device("cpu"))
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))


def start(model_dir: Path, **kw) -> tuple[str, LinearSpec, torch.Tensor, list]:
    """One engine start: its plan line, its linear spec, a 40-token prompt's logits, and a
    greedy batch's tokens and logprobs (decode steps through the fused layer)."""
    llm = LLM(str(model_dir), dtype="bfloat16", device="cpu", **kw)
    backend = llm.engine.cpu_backend
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 290, (40,), generator=g).tolist()
    logits = prompt_logits(llm, ids)
    outs = llm.generate([ids[:9], ids[:5], ids[:17]],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                       logprobs=3))
    return (backend.plan_line(), LinearSpec.of(backend.linear), logits,
            [(o.token_ids, o.logprobs) for o in outs])


@needs_kernels
def test_two_starts_with_the_same_stored_plan_give_the_same_plan_and_bits(bf16_dir, no_timing):
    path = store_for(bf16_dir, rows_spec())
    a, b = start(bf16_dir), start(bf16_dir)
    assert a[0] == b[0] == f"stored plan {path} (tuned 2025-01-02 03:04:05 UTC)"
    assert a[1] == b[1] == rows_spec()
    assert torch.equal(a[2], b[2])  # the logits, bit for bit
    assert a[3] == b[3]


@needs_kernels
def test_a_start_beside_a_cpu_hog_picks_the_plan_a_quiet_start_picks(bf16_dir, no_timing):
    """With nothing timed at start, a machine kept busy (a spinning process per core) gets
    the quiet machine's plan: from the rule, and from a stored plan."""
    def hogged():
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(max(1, capabilities().cores))]
        try:
            return start(bf16_dir)
        finally:
            for p in hogs:
                p.kill()
                p.wait()

    for stored_plan in (False, True):
        if stored_plan:
            store_for(bf16_dir, rows_spec())
        quiet, busy = start(bf16_dir), hogged()
        assert quiet[0] == busy[0] and quiet[1] == busy[1]
        assert torch.equal(quiet[2], busy[2]) and quiet[3] == busy[3]


def test_num_threads_is_bounded_by_the_cores():
    from phasewise.config import usable_cores

    cores = usable_cores()
    for bad in (0, cores + 1, True, 1.0, "2", None.__class__):
        with pytest.raises(ValueError, match=f"num_threads must be an integer from 1 to "
                                             f"{cores} \\(the cores this process may run on\\)"):
            EngineConfig(model="m", num_threads=bad)
    assert EngineConfig(model="m", num_threads=cores).num_threads == cores
    assert EngineConfig(model="m").num_threads is None


@needs_kernels
def test_num_threads_sets_the_threads_and_the_plan_for_that_count(bf16_dir, no_timing):
    """``num_threads`` (``--threads``) is the process's thread count from the engine's start,
    and the plan is found for that count: one stored for another count is not followed."""
    from phasewise.config import usable_cores

    if usable_cores() < 2:
        pytest.skip("one core: no other thread count to run")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        path = store_for(bf16_dir, rows_spec())  # for 2 threads
        assert start(bf16_dir)[0].startswith(f"stored plan {path}")
        llm = LLM(str(bf16_dir), dtype="bfloat16", device="cpu", num_threads=1)
        assert torch.get_num_threads() == 1
        assert llm.engine.cpu_backend.plan.key.threads == 1
        line = llm.engine.cpu_backend.plan_line()
        assert line.startswith("rule from") and "-1t.json; phasewise tune stores one" in line
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_a_stored_plan_may_keep_the_rows_where_the_rule_packs_panels(bf16_dir, no_timing):
    """(What PHASEWISE_PANELS=0 did.) The plan's panels false: every weight stays in rows."""
    if not kernels.avx512bf16_available():
        pytest.skip("the rule packs no panels here")
    store_for(bf16_dir, rows_spec(), panels=False)
    llm = LLM(str(bf16_dir), dtype="bfloat16", device="cpu")
    assert llm.engine.panels_reason == "the stored plan keeps the rows"
    assert llm.engine.model.layers[0].qkv_proj.weight.dtype == torch.bfloat16
    assert not llm.engine.model.ops.panels
    assert llm.engine.cpu_backend.describe() == rows_spec().dispatch().describe()


@needs_kernels
def test_kernel_plan_pins_a_file_and_a_bad_one_is_refused_by_name(bf16_dir, no_timing,
                                                                  tmp_path):
    key = PlanKey.of(capabilities(), ModelConfig.from_file(bf16_dir), "bfloat16", None,
                     torch.get_num_threads())
    good = write_plan_file(stored(key, rows_spec()), tmp_path / "mine.json")
    llm = LLM(str(bf16_dir), dtype="bfloat16", device="cpu", kernel_plan=str(good))
    assert llm.engine.cpu_backend.plan.origin == "pinned"
    assert llm.engine.cpu_backend.plan_line().startswith(f"pinned plan {good}")
    assert LinearSpec.of(llm.engine.linear_plan) == rows_spec()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EngineConfig(model=str(bf16_dir), kernel_plan=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not a kernel plan"):
        LLM(str(bf16_dir), dtype="bfloat16", device="cpu", kernel_plan=str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="needs kernels 'auto'"):
        EngineConfig(model=str(bf16_dir), kernels="torch", kernel_plan=str(good))
    with pytest.raises(ValueError, match="kernel_plan must be the path"):
        EngineConfig(model=str(bf16_dir), kernel_plan=3)
    other = PlanKey.of(capabilities(), SHAPE, "bfloat16", None, torch.get_num_threads())
    wrong = write_plan_file(stored(other, rows_spec()), tmp_path / "other.json")
    with pytest.raises(ValueError, match="model vocab_size: the plan.s 320, here 300"):
        LLM(str(bf16_dir), dtype="bfloat16", device="cpu", kernel_plan=str(wrong))
    with pytest.raises(ValueError, match="applies to phasewise's CPU kernels"):
        LLM(str(bf16_dir), dtype="float32", device="cpu", kernel_plan=str(good))


def test_the_cli_refuses_a_bad_kernel_plan_before_loading(tmp_path, capsys, llama_dir):
    from phasewise.cli import main

    (tmp_path / "bad.json").write_text('{"format": "phasewise-kernel-plan", "version": 1}')
    assert main(["generate", "hi", "--model", str(llama_dir), "--kernel-plan",
                 str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "phasewise: error: kernel plan" in err and "plan must be an object" in err
