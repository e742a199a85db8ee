"""Speculative decoding (``--speculative ngram``): the proposer, the verification rules, and
greedy output identical to HF's with speculation on, on all four architectures, with prefix
caching, preemption, tiny step budgets and stop strings; sampled verification follows the
target distribution (a statistical bound that a wrong rule fails)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ARCHS, hf_greedy
from phasewise import LLM, SamplingParams
from phasewise.config import EngineConfig
from phasewise.engine.request import Request
from phasewise.engine.sampler import Sampler
from phasewise.engine.spec import DraftPolicy, NgramProposer, verify_greedy, verify_sampled

N_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)


# -- the proposer ---------------------------------------------------------------------------

def lookup_reference(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup by brute force: the longest suffix n-gram's latest earlier occurrence
    that a token follows; the tokens after it."""
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for j in range(end - n - 1, -1, -1):
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40),
       grow=st.lists(st.integers(0, 4), max_size=10), k=st.integers(1, 6))
def test_the_indexed_lookup_finds_what_a_full_scan_finds(tokens, grow, k):
    prop = NgramProposer()
    assert prop.propose("r", tokens, k) == lookup_reference(tokens, k)
    grown = tokens + grow  # the index grows with the request, never rescanning
    assert prop.propose("r", grown, k) == lookup_reference(grown, k)
    shorter = grown[:len(grown) // 2]  # shorter than what was indexed: rebuilt
    assert prop.propose("r", shorter, k) == lookup_reference(shorter, k)


def test_the_longest_match_wins_and_the_latest_occurrence_of_it():
    prop = NgramProposer()
    #         a  b  c  X   b  c  Y   a  b  c
    tokens = [1, 2, 3, 90, 2, 3, 91, 1, 2, 3]
    assert prop.propose("r", tokens, 2) == [90, 2]  # "1 2 3" last led to 90, "2 3" to 91
    assert prop.propose("r2", [5, 6, 7], 3) == []  # nothing repeats
    assert prop.propose("r2", [5, 6, 7], 0) == []
    prop.release("r")
    assert "r" not in prop._index


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([4, 5, 6, 7]):
        logits[row, tok] = 1.0
    assert verify_greedy(logits, [4, 5, 6]) == ([4, 5, 6, 7], 3)  # all kept, one bonus
    assert verify_greedy(logits, [4, 9, 6]) == ([4, 5], 1)  # the second is corrected
    assert verify_greedy(logits[:1], []) == ([4], 0)


# -- sampled verification follows the target distribution ------------------------------------

def total_variation(counts: torch.Tensor, p: torch.Tensor) -> float:
    return float((counts / counts.sum() - p).abs().sum() / 2)


def test_rejection_sampling_emits_the_target_distribution():
    """Two drafts against fixed target rows p0, p1, p2. Over N draws, the first emitted token
    must follow p0; given that it was the first draft, the second must follow p1; given both
    drafts, the third p2. N = 40000: each total-variation distance has a standard deviation
    near 0.003, so the bound 0.02 holds for the right rule, and a rule that keeps every draft
    (or one that resamples from p instead of the residual) lands far outside it."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.5, 0.2, 0.15, 0.1, 0.0],
                      [0.3, 0.1, 0.1, 0.4, 0.05, 0.05],
                      [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]])
    drafts = [1, 3]
    n = 40000
    first, second, third = torch.zeros(6), torch.zeros(6), torch.zeros(6)
    naive_first = torch.zeros(6)
    for _ in range(n):
        tokens, accepted = verify_sampled(p, drafts, g)
        assert tokens[:accepted] == drafts[:accepted] and len(tokens) == accepted + 1
        first[tokens[0]] += 1
        if accepted >= 1:
            second[tokens[1]] += 1
        if accepted == 2:
            third[tokens[2]] += 1
        # a wrong rule for contrast: on rejection, draw from p itself (the draft can come back)
        u = float(torch.rand((), generator=g))
        naive_first[drafts[0] if u < p[0, 1] else int(torch.multinomial(p[0], 1, generator=g))] += 1
    assert total_variation(first, p[0]) < 0.02
    assert total_variation(second, p[1]) < 0.02
    assert total_variation(third, p[2]) < 0.02
    assert total_variation(naive_first, p[0]) > 0.1  # the bound can fail
    # how often the drafts survive is p(d) per row
    assert abs(second.sum() / n - p[0, 1]) < 0.01
    assert abs(third.sum() / second.sum() - p[1, 3]) < 0.015


def test_the_samplers_verify_uses_the_requests_filtered_distribution():
    """Through ``Sampler.verify``: temperature and top-k shape the target. With top_k = 2 a
    draft outside the row's top two is always rejected, and the replacement is one of the
    top two, in their renormalised proportions."""
    params = SamplingParams(temperature=0.5, top_k=2, seed=3, max_tokens=8)
    req = Request("r", [1, 2], params, arrival_time=0.0)
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0, -1.0], [0.0, 0.0, 0.0, 3.0, 0.0]])
    req.spec_token_ids = [4]  # outside row 0's top two (tokens 1 and 2)
    counts = torch.zeros(5)
    for _ in range(4000):
        out, accepted = sampler.verify(logits, req)
        assert accepted == 0 and len(out.token_ids) == 1
        counts[out.token_ids[0]] += 1
    want = torch.softmax(torch.tensor([2.0, 1.5]) / 0.5, dim=0)
    assert counts[[0, 3, 4]].sum() == 0
    assert abs(counts[1] / 4000 - want[0]) < 0.03
    req.spec_token_ids = [1]  # the top token: kept with its probability, then row 1 decides
    kept = sum(sampler.verify(logits, req)[1] for _ in range(2000))
    assert abs(kept / 2000 - want[0]) < 0.04


# -- greedy output is unchanged, on the engine ----------------------------------------------

def repetitive_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random segment, so prompt lookup finds drafts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        seg = [rng.randrange(3, vocab) for _ in range(5 + 3 * i)]
        out.append(seg * 3 + seg[:2])
    return out


def spec_llm(path, **kw) -> LLM:
    """Speculation with every draft the proposer finds (no draft policy: it prices drafts by
    this machine's measured step times, and these tests want drafts in every step)."""
    llm = LLM(str(path), speculative="ngram", num_speculative_tokens=4, **kw)
    llm.engine.draft_policy = None
    return llm


# -- the draft policy: drafts only at batch sizes where they have paid ----------------------

def run_policy(pol: DraftPolicy, steps: int, speed: dict[int, float],
               seconds=lambda n: 1e-3 + 1e-4 * n) -> list[bool]:
    """Drive ``pol`` for ``steps`` steps whose batch size cycles through ``speed``'s keys;
    a plain step of n requests takes seconds(n), and a drafting one the same time for
    speed[n] times its tokens. Returns its choices."""
    sizes, out = list(speed), []
    for i in range(steps):
        n = sizes[i % len(sizes)]
        drafting = pol.begin_step(n)
        out.append(drafting)
        pol.observe_step(drafting, n, round(n * speed[n]) if drafting else n, seconds(n))
    return out


def test_a_cold_first_plain_step_does_not_set_the_plain_time():
    """A warm-up's first decode runs several times slower than the next: the plain time
    follows the warm steps, so drafting is not credited against the cold one."""
    pol = DraftPolicy(warmup=1)
    pol.observe_step(False, 1, 1, 2.5e-3)  # cold
    pol.observe_step(False, 1, 1, 1.0e-3)
    assert pol.plain_seconds(1) == pytest.approx(1.0e-3)
    pol.observe_step(False, 1, 1, 1.2e-3)  # warm noise is averaged, not followed
    assert pol.plain_seconds(1) == pytest.approx(0.8e-3 + 0.24e-3)
    pol.observe_step(True, 1, 2, 1.3e-3)  # two tokens in 1.3 ms against 1.04 ms plain
    assert pol.speedup(1) == pytest.approx(2 * 1.04e-3 / 1.3e-3)


def test_draft_policy_drafts_where_drafting_was_measured_faster():
    pol = DraftPolicy(warmup=3, check_every=8)
    assert pol.speedup(4) is None and pol.plain_seconds(4) is None
    speed = {1: 2.0, 32: 0.9}  # drafts double batch 1's speed and cost batch 32 a tenth
    choices = run_policy(pol, 400, speed)
    assert pol.speedup(1) == pytest.approx(2.0)
    assert pol.speedup(32) == pytest.approx(round(32 * 0.9) / 32)
    assert pol.speedup(40) == pol.speedup(32)  # one bucket per power of two
    assert pol.plain_seconds(32) == pytest.approx(1e-3 + 32e-4)
    assert pol.plain_seconds(30) == pol.plain_seconds(32)  # the nearest size measured
    assert pol.describe() == ("drafting / plain speed by decoding batch: 1: x2.00, drafts; "
                              "32-63: x0.91, no drafts")
    small, large = choices[0::2][20:], choices[1::2][20:]
    # mostly the better way, the other only in the one-step-in-check_every checks
    assert sum(small) / len(small) > 0.8
    assert 0 < sum(large) / len(large) < 0.2
    # a change is noticed: at batch 32 drafting now pays
    speed[32] = 2.0
    later = run_policy(pol, 600, speed)[1::2]
    assert sum(later[-100:]) / 100 > 0.8


def test_draft_policy_compares_drafting_with_plain_steps_of_the_same_batch():
    """Plain steps seen at 32-63 requests, drafting ones only at 32: a step's time grows
    with its batch, so only a plain step of 32 says what drafting at 32 saved. Drafting that
    emits 10% more per step in the same time is x1.1, and pays."""
    pol = DraftPolicy(warmup=1, check_every=10**9)
    for n in range(32, 64):
        pol.begin_step(n)
        pol.observe_step(False, n, n, 1e-3 + 1e-4 * n)
    for _ in range(5):
        pol.begin_step(32)
        pol.observe_step(True, 32, 35, 1e-3 + 1e-4 * 32)  # 35 tokens where plain gives 32
    assert pol.speedup(32) == pytest.approx(35 / 32)
    assert pol.begin_step(50)  # drafts: its tokens per second are below plain 63's, no matter


def test_draft_policy_warms_up_both_ways_and_refuses_bad_settings():
    pol = DraftPolicy(warmup=2)
    seen = []
    for _ in range(4):  # alternates until each way has been seen twice, drafting first
        d = pol.begin_step(8)
        seen.append(d)
        pol.observe_step(d, 8, 8, 0.01)
    assert seen == [True, False, True, False]
    for bad in ({"decay": 0.0}, {"warmup": 0}, {"check_every": 1}):
        with pytest.raises(ValueError, match="need"):
            DraftPolicy(**bad)


def test_the_engine_drafts_as_its_policy_says(hf_checkpoints):
    path, hf = hf_checkpoints["LlamaForCausalLM"]
    prompts = repetitive_prompts(hf.config.vocab_size, 3, seed=7)
    llm = LLM(str(path), speculative="ngram", num_speculative_tokens=4)
    eng = llm.engine
    assert isinstance(eng.draft_policy, DraftPolicy)
    for drafts_pay in (False, True):
        pol = DraftPolicy(check_every=10**9)
        for n in range(1, 4):  # it has seen drafting cost (or pay) x10 at sizes 1-3
            for drafting in (False, True) * 3:
                pol.begin_step(n)
                pol.observe_step(drafting, n, n * (10 if drafts_pay else 1), 1.0 if
                                 drafting == drafts_pay else 10.0)
        eng.draft_policy = pol
        n0 = len(llm.step_stats)
        outs = llm.generate(prompts, GREEDY)
        steps = [s for s in list(llm.step_stats)[n0:] if s.num_decode_tokens]
        assert any(s.num_spec_proposed for s in steps) == drafts_pay
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(hf, prompt, N_NEW)
    # it measured those steps: plain steps of 3 now take milliseconds, not the 10 s it was fed
    assert pol.plain_seconds(3) < 9.0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_with_speculation_is_hfs_greedy_output(hf_checkpoints, arch):
    path, hf = hf_checkpoints[arch]
    prompts = repetitive_prompts(hf.config.vocab_size, 3, seed=1)
    llm = spec_llm(path)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, N_NEW)
    stats = llm.engine.spec_stats
    assert stats.proposed > stats.accepted > 0  # drafts were kept, and some were rejected
    steps = [s for s in llm.step_stats if s.num_spec_proposed]
    assert steps and sum(s.num_spec_accepted for s in steps) == stats.accepted
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks  # nothing leaked


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_speculation_survives_preemption_and_tiny_budgets(hf_checkpoints, prefix_caching):
    path, hf = hf_checkpoints["LlamaForCausalLM"]
    prompts = repetitive_prompts(hf.config.vocab_size, 4, seed=2)
    # 21 blocks of 4 tokens for four requests of 49-76 tokens: they preempt each other; a
    # step budget of 7 cuts verifies short (and shares them with prompt chunks).
    llm = spec_llm(path, block_size=4, num_kv_blocks=21, max_model_len=80,
                   max_num_batched_tokens=7, enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert max(s.num_tokens for s in llm.step_stats) <= 7
    assert llm.engine.spec_stats.accepted > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, N_NEW)
    assert llm.engine.kv.num_free_blocks == 21


def test_prefix_cache_hits_and_stop_strings_end_where_they_would_without_speculation(
        hf_checkpoints):
    path, hf = hf_checkpoints["Qwen2ForCausalLM"]
    prompts = repetitive_prompts(hf.config.vocab_size, 3, seed=4)
    plain, spec = LLM(str(path), block_size=8), spec_llm(path, block_size=8)
    free_run = plain.generate(prompts, GREEDY)
    # stop strings cut from the middle of each free-running output, so a verify that emits
    # several tokens at once must stop inside them
    stops = []
    for out in free_run:
        text = out.text
        stops.append(text[len(text) // 2:len(text) // 2 + 3])
    for params in ([SamplingParams(temperature=0, max_tokens=N_NEW, stop=[s]) for s in stops]
                   + [SamplingParams(temperature=0, max_tokens=N_NEW, stop=[s],
                                     include_stop_str_in_output=True) for s in stops]):
        for llm in (plain, spec):
            llm.generate(prompts, params)  # twice: the second run hits the prefix cache
        a, b = plain.generate(prompts, params), spec.generate(prompts, params)
        for x, y in zip(a, b):
            assert (y.text, y.token_ids, y.finish_reason, y.stop_reason) == (
                x.text, x.token_ids, x.finish_reason, x.stop_reason)
    assert spec.engine.kv.stats.prefix_hits > 0
    assert spec.engine.spec_stats.accepted > 0
    assert all(o.finish_reason == "stop" for o in spec.generate(prompts, SamplingParams(
        temperature=0, max_tokens=N_NEW, stop=stops)))


def test_logprobs_and_max_tokens_with_speculation(hf_checkpoints):
    path, _ = hf_checkpoints["MistralForCausalLM"]
    prompts = repetitive_prompts(300, 2, seed=5)
    params = SamplingParams(temperature=0, max_tokens=11, logprobs=2, ignore_eos=True)
    a, b = LLM(str(path)).generate(prompts, params), spec_llm(path).generate(prompts, params)
    for x, y in zip(a, b):
        assert y.token_ids == x.token_ids and len(y.token_ids) == 11
        assert len(y.logprobs) == 11
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t] - ly[t]) < 1e-4 for t in lx)


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="speculative must be one of ngram"):
        EngineConfig(model="x", speculative="eagle")
    with pytest.raises(ValueError, match="needs speculative"):
        EngineConfig(model="x", num_speculative_tokens=3)
    with pytest.raises(ValueError, match=r"integer in 1\.\.16"):
        EngineConfig(model="x", speculative="ngram", num_speculative_tokens=0)
    assert EngineConfig(model="x", speculative="ngram").num_speculative_tokens == 4


# -- what it reports ------------------------------------------------------------------------

def test_metrics_count_drafts_and_every_gap_of_a_multi_token_output():
    from dataclasses import replace

    from phasewise.engine.backend import EngineSnapshot
    from phasewise.engine.outputs import RequestOutput
    from phasewise.engine.request import RequestMetrics
    from phasewise.server.metrics import PrometheusMetrics

    pm = PrometheusMetrics("m")
    snap = EngineSnapshot(1, 0, 0.1, 9, 10, 0, 0, 0, spec_verifies=2, spec_proposed=8,
                          spec_accepted=5, spec_emitted=7)
    m = RequestMetrics(arrival_time=0.0, first_token_time=1.0, token_times=[1.0, 1.5, 1.5, 1.5])
    out = RequestOutput(request_id="a", prompt=None, prompt_token_ids=[1], text="", token_ids=[
        4, 5, 6, 7], delta_text="", delta_token_ids=[5, 6, 7], finished=False,
        finish_reason=None, stop_reason=None, logprobs=None, metrics=m)
    pm.on_step(None, [out], [], snap)
    pm.on_step(None, [], [], replace(snap, spec_verifies=3, spec_proposed=12, spec_accepted=6,
                                     spec_emitted=9))

    def value(name):
        return pm.registry.get_sample_value("phasewise:" + name, {"model_name": "m"})

    assert value("spec_decode_num_drafts_total") == 3
    assert value("spec_decode_num_draft_tokens_total") == 12
    assert value("spec_decode_num_accepted_tokens_total") == 6
    assert value("spec_decode_num_emitted_tokens_total") == 9
    assert value("generation_tokens_total") == 3
    assert value("inter_token_latency_seconds_count") == 3  # 0.5 s, then two gaps of 0


def test_generate_reports_acceptance_and_tokens_per_weight_read(llama_dir, capsys):
    from phasewise.cli import main

    prompt = " ".join(["def add(a, b): return a + b"] * 4)
    assert main(["generate", "--model", str(llama_dir), prompt, "--max-tokens", "24",
                 "--temperature", "0", "--speculative", "ngram", "--num-speculative-tokens",
                 "3", "--no-roofline"]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("[speculative]"))
    assert "draft tokens proposed" in line and "tokens per weight read" in line
    per_read = float(line.split(":")[-1].split()[0])
    assert 1.0 <= per_read <= 4.0
    policy = [ln for ln in err.splitlines() if ln.startswith("[speculative] ")
              and ("by decoding batch" in ln or "no decode-only step" in ln)]
    assert len(policy) == 1
    assert main(["generate", "--model", str(llama_dir), "x", "--num-speculative-tokens",
                 "3"]) == 2
    assert "--num-speculative-tokens needs speculative" in capsys.readouterr().err
