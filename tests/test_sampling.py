"""Sampling parameters: validation, seeds, filters, penalties, stops and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise import LLM, SamplingParams
from phasewise.engine.request import Request
from phasewise.engine.sampler import Sampler, greedy_token_list, greedy_tokens, inverse_cdf
from phasewise.model.cpu import kernels as cpu_kernels

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None,
                                   reason="phasewise's CPU kernels are unavailable")


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, "temperature must be a number in [0, 100]"),
    ("top_p", 0.0, "top_p must be a number in (0, 1]"),
    ("top_p", 1.5, "top_p must be a number in (0, 1]"),
    ("top_k", -2, "top_k must be an integer >= 1, or 0 / -1 to disable"),
    ("min_p", 1.1, "min_p must be a number in [0, 1]"),
    ("max_tokens", -1, "max_tokens must be an integer >= 0 (at most"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a number in [0.01, 10]"),
    ("repetition_penalty", 1e-300, "repetition_penalty must be a number in [0.01, 10]"),
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be a number in [-2, 2]"),
    ("logprobs", 21, "logprobs must be an integer in [0, 20] or None"),
    ("seed", 1.5, "seed must be an integer or None"),
    ("stop", [""], "stop must be non-empty strings"),
    ("stop_token_ids", [-1], "stop_token_ids must be non-negative integers"),
    ("temperature", float("nan"), "temperature must be"),
])
def test_invalid_values_name_the_field_and_range(field, value, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert message in str(err.value)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(3\)"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_same_seed_same_output_whatever_else_is_batched(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate("def main():", p)[0].token_ids
    noisy = SamplingParams(temperature=1.3, max_tokens=25, ignore_eos=True)
    batch = llm.generate(["x = 1", "def main():", "import os", "def main():"],
                         [noisy, p, noisy, p])
    assert batch[1].token_ids == alone and batch[3].token_ids == alone
    other = llm.generate("def main():", SamplingParams(temperature=1.0, seed=99, max_tokens=20,
                                                       ignore_eos=True))[0].token_ids
    assert other != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate("class A:", SamplingParams(temperature=0, max_tokens=16,
                                                     ignore_eos=True))[0]
    k1 = llm.generate("class A:", SamplingParams(temperature=0.8, top_k=1, max_tokens=16,
                                                 ignore_eos=True, seed=3))[0]
    assert k1.token_ids == greedy.token_ids


def _req(params: SamplingParams, prompt=(1, 2), outputs=(), eos=(0,)) -> Request:
    r = Request("r", list(prompt), params, eos_token_ids=eos, arrival_time=0.0)
    for t in outputs:
        r.append_output(t)
    return r


def _draws(params: SamplingParams, logits: torch.Tensor, n: int = 300, **kw) -> set[int]:
    sampler = Sampler(torch.Generator().manual_seed(0))
    r = _req(params, **kw)
    return {sampler(logits[None].clone(), [r]).token_ids[0] for _ in range(n)}


def test_top_k_top_p_and_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03]))
    assert _draws(SamplingParams(top_k=2), logits) == {0, 1}
    assert _draws(SamplingParams(top_p=0.65), logits) == {0, 1}  # 0.4 < 0.65 <= 0.7
    assert _draws(SamplingParams(top_p=0.75), logits) == {0, 1, 2}
    assert _draws(SamplingParams(min_p=0.45), logits) == {0, 1, 2}  # p >= 0.18
    assert _draws(SamplingParams(), logits) == {0, 1, 2, 3, 4}


def _full(cand, probs, vocab):
    if cand is None:
        return probs
    return torch.zeros(probs.shape[0], vocab).scatter_add(1, cand, probs)


def test_rows_that_finish_in_different_passes_keep_token_zero():
    """A peaked row (tokens 0 and 1 share it) finishes in the first, narrow pass and is
    padded with id 0 at probability 0 when a flat row needs a wider one: token 0 keeps its
    half in the whole-vocabulary distribution, and draws reach it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5000, generator=g) * 0.01
    logits[0, :2] = 12.0
    reqs = [_req(SamplingParams(top_p=0.9))] * 2
    probs = Sampler._vocab_probs(reqs, logits)
    assert probs[0, 0] == pytest.approx(0.5, abs=1e-3)
    assert torch.allclose(probs, Sampler._probs(reqs, logits), atol=1e-6)
    sampler = Sampler(torch.Generator().manual_seed(0))
    toks = [sampler._sample_torch(reqs, logits, torch.tensor([u, 0.5]))[0]
            for u in (0.1, 0.3, 0.45, 0.7)]
    assert toks == [0, 0, 0, 1]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(vocab=st.sampled_from([7, 100, 2000, 5000]), rows=st.integers(1, 4),
       seed=st.integers(0, 2**16), scale=st.sampled_from([0.002, 0.3, 3.0, 30.0]),
       top_k=st.sampled_from([0, 1, 3, 70, 1500, 10 ** 6]),
       top_p=st.sampled_from([1.0, 0.999, 0.9, 0.5, 1e-3]),
       min_p=st.sampled_from([0.0, 0.05]), temperature=st.sampled_from([0.3, 1.0, 2.5]))
def test_candidates_are_the_sorted_filter(vocab, rows, seed, scale, top_k, top_p, min_p,
                                          temperature):
    """The filter that keeps only the largest logits (``topk``, widened while a nucleus is
    wider) gives the distribution of the one that sorts the whole vocabulary, for flat
    logits (nuclei of thousands of tokens), peaked ones, and each filter alone or together;
    rows of one batch with settings of their own. (Both sum the mass in fp32 in different
    orders, so a top_p within rounding of a token's running mass, as 0.9999 over a long
    tail of tiny probabilities can be, may keep that one token in one and not the other:
    3 of 6,000 random cases with 0.9999, none of 6,000 with these values.)"""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    reqs = [_req(SamplingParams(temperature=temperature * (1 + i / 4), top_k=top_k,
                                top_p=top_p if i % 2 == 0 else 1.0, min_p=min_p))
            for i in range(rows)]
    want = Sampler._probs(reqs, logits)
    cand, probs = Sampler._candidates(reqs, logits)
    got = _full(cand, probs, vocab)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-4)
    # the same in the whole vocabulary's places, rows that filter apart from rows that don't
    assert torch.allclose(Sampler._vocab_probs(reqs, logits), want, atol=2e-6, rtol=1e-4)
    assert torch.allclose(got.sum(-1), torch.ones(rows), atol=1e-5)


@needs_kernels
@settings(max_examples=40, deadline=None, derandomize=True)
@given(vocab=st.sampled_from([5, 9, 300, 1500]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.01, 0.5, 3.0, 30.0]), top_k=st.sampled_from([0, 1, 3, 40, 1000]),
       top_p=st.sampled_from([1.0, 0.999, 0.9, 0.3]), min_p=st.sampled_from([0.0, 0.02, 0.5]),
       temperature=st.sampled_from([0.2, 1.0, 3.0]), masked=st.booleans())
def test_kernel_draws_follow_the_sorted_filter(vocab, seed, scale, top_k, top_p, min_p,
                                               temperature, masked):
    """The CPU kernel's draws (radix selection, no sort) at 2,000 evenly spread uniform
    numbers: each token's share is the sorted filter's probability to within one draw, so
    the support and every probability match (a grammar's -inf logits in some rows)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * scale
    if masked:
        logits[torch.randperm(vocab, generator=g)[:vocab // 2]] = float("-inf")
    req = _req(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    want = Sampler._probs([req], logits[None])[0]
    n = 2000
    u = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).tolist()
    got = cpu_kernels.sample_list(logits[None].expand(n, -1).contiguous(), [temperature] * n,
                                  [top_k if top_k < vocab else 0] * n,
                                  [top_p if top_p < 1 else float("inf")] * n, [min_p] * n, u)
    counts = torch.bincount(torch.tensor(got), minlength=vocab).double()
    assert ((counts - n * want.double()).abs() <= 1.01 + n * 1e-5).all()
    assert (counts[want == 0] == 0).all()


@needs_kernels
def test_kernel_refuses_rows_with_nothing_to_draw():
    ok = torch.tensor([[0.0, 1.0, 2.0]])
    for bad in (torch.full((1, 3), float("-inf")), torch.tensor([[0.0, float("inf"), 1.0]])):
        got = cpu_kernels.sample_list(torch.cat([ok, bad]), [1.0] * 2, [0] * 2,
                                      [float("inf")] * 2, [0.0] * 2, [0.5] * 2)
        assert got[1] == -1 and got[0] in (0, 1, 2)
    # a top_p that rounds to 0 in fp32 keeps the largest, as the sort does
    assert cpu_kernels.sample_list(ok, [1.0], [0], [1e-50], [0.0], [0.99]) == [2]
    # NaN logits weigh nothing; u at the top of [0, 1) still draws a kept token
    row = torch.tensor([[float("nan"), 1.0, 3.0, float("-inf"), 2.0]])
    assert cpu_kernels.sample_list(row, [1.0], [0], [float("inf")], [0.0],
                                   [1.0 - 2.0 ** -24]) == [4]
    assert cpu_kernels.sample_list(row, [1.0], [2], [float("inf")], [0.0], [0.0]) == [2]


def test_wide_nuclei_widen_the_candidates():
    """A nucleus past the first 64 candidates, and one past 1024, still comes out whole."""
    g = torch.Generator().manual_seed(1)
    for scale, top_p, wider_than in ((1.0, 0.9, 64), (0.01, 0.99, 1024)):
        logits = torch.randn(1, 20000, generator=g) * scale
        reqs = [_req(SamplingParams(top_p=top_p))]
        cand, probs = Sampler._candidates(reqs, logits)
        kept = int((probs > 0).sum())
        assert kept > wider_than
        assert torch.allclose(_full(cand, probs, 20000), Sampler._probs(reqs, logits), atol=1e-6)


def test_inverse_cdf_draws_only_weighted_positions():
    w = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0, 0.0],
                      [0.3, 0.7, 0.0, 0.0, 0.0, 0.0, 0.0]])
    below_one = torch.tensor(1.0 - 2.0 ** -24)
    assert inverse_cdf(w, torch.zeros(2)).tolist() == [1, 0]
    assert inverse_cdf(w, torch.full((2,), below_one)).tolist() == [4, 1]
    assert inverse_cdf(w, torch.tensor([0.6, 0.29])).tolist() == [3, 0]
    assert inverse_cdf(w, torch.tensor([0.76, 0.31])).tolist() == [4, 1]
    # u = 1 lands on the total: still the last weighted position, not the zeros after it
    assert inverse_cdf(w, torch.ones(2)).tolist() == [4, 1]
    w = torch.tensor([[0.1] * 10 + [0.0] * 5])  # an fp32 total that is not 1
    for u in (below_one, torch.tensor(1.0)):
        assert inverse_cdf(w, u[None]).item() == 9


@pytest.mark.parametrize("path", ["torch", "rows"])
def test_draws_follow_the_distribution(path):
    """20,000 draws of one seeded sampler against the filtered distribution: each token's
    share within 0.015 of its probability, and nothing outside the support; in torch's
    operations and by ``_sample_rows`` (on CPU, the kernels where they load)."""
    logits = torch.log(torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04]))[None]
    sampler = Sampler(torch.Generator().manual_seed(5))
    for params in (SamplingParams(), SamplingParams(top_p=0.75, temperature=0.8),
                   SamplingParams(top_k=3, min_p=0.5)):
        reqs = [_req(params)] * 20000
        rows = logits.expand(20000, -1).contiguous()
        if path == "torch":
            toks = sampler._sample_torch(reqs, rows, sampler._uniforms(reqs, rows.device))
        else:
            toks = sampler._sample_rows(reqs, rows)
        share = torch.bincount(torch.tensor(toks), minlength=6).float() / 20000
        want = Sampler._probs([reqs[0]], logits)[0]
        assert ((share - want).abs() <= 0.015).all()
        assert (share[want == 0] == 0).all()


@pytest.mark.parametrize("path", ["torch", "rows"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_k=2),
                                    SamplingParams(top_p=0.5, min_p=0.1)])
def test_rows_with_nothing_to_draw_take_their_argmax(path, params):
    """Logits all -inf (a grammar that allows nothing) or with +inf: no distribution to draw
    from, so the row takes its argmax (the first -inf, the +inf), and the rows beside it
    draw as usual."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0],
                           [float("-inf")] * 4,
                           [0.0, float("inf"), 1.0, float("inf")]])
    sampler = Sampler(torch.Generator().manual_seed(0))
    reqs = [_req(params)] * 3
    if path == "torch":
        toks = sampler._sample_torch(reqs, logits, sampler._uniforms(reqs, logits.device))
    else:
        toks = sampler._sample_rows(reqs, logits)
    assert toks[1:] == [0, 1] and 0 <= toks[0] < 4


@pytest.mark.parametrize("path", ["torch", "rows"])
def test_a_seeded_rows_token_does_not_depend_on_its_neighbours(path):
    """The same seeded row beside neighbours that filter differently (or cannot be drawn
    from) draws the same tokens: every path draws in vocabulary order."""
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, 300, generator=g) * 2
    seeded = SamplingParams(temperature=0.9, seed=123)
    got = []
    for other in (SamplingParams(top_k=50), SamplingParams(top_p=1e-50), SamplingParams(),
                  None):
        sampler = Sampler(torch.Generator().manual_seed(0))
        r = _req(seeded)
        toks = []
        for _ in range(5):
            reqs, logits = [r], row
            if other is not None:
                reqs = [r, _req(other)]
                nothing = torch.full((1, 300), float("-inf"))
                logits = torch.cat([row, nothing if other.top_p < 1e-40 else row])
            if path == "torch":
                toks.append(sampler._sample_torch(reqs, logits,
                                                  sampler._uniforms(reqs, logits.device))[0])
            else:
                toks.append(sampler._sample_rows(reqs, logits)[0])
        got.append(toks)
    assert all(t == got[0] for t in got)


def test_temperature_sharpens_the_distribution():
    sampler = Sampler(torch.Generator().manual_seed(0))
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    counts = {}
    for t in (0.2, 1.0):
        r = _req(SamplingParams(temperature=t))
        toks = [sampler(logits[None].clone(), [r]).token_ids[0] for _ in range(600)]
        counts[t] = toks.count(0) / len(toks)
    assert counts[0.2] > 0.9 and 0.4 < counts[1.0] < 0.6


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = _req(SamplingParams(repetition_penalty=2.0), prompt=(0,), outputs=(1,))
    out = Sampler._apply_penalties(logits, [seen])
    assert out[0].tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied
    pf = _req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), outputs=(2, 2, 3))
    out = Sampler._apply_penalties(logits, [pf])
    assert out[0].tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]
    assert logits[0].tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is left alone


@needs_kernels
@settings(max_examples=120, deadline=None, derandomize=True)
@given(vocab=st.sampled_from([3, 50, 700]), seed=st.integers(0, 2**16),
       rows=st.integers(1, 5), repetition=st.sampled_from([1.0, 0.5, 1.3, 10.0]),
       presence=st.sampled_from([0.0, 0.7, 0.2, -2.0]),
       frequency=st.sampled_from([0.0, 0.25, 0.1, 0.3, 1.1, -1.5]),
       min_tokens=st.sampled_from([0, 100]))
def test_penalties_kernel_gives_the_torch_bits(vocab, seed, rows, repetition, presence,
                                               frequency, min_tokens):
    """The kernels' penalties against torch's, bit for bit: repeated tokens in prompt and
    outputs, ids past the vocabulary, outputs empty or not, rows without penalties between
    rows with them, the min_tokens mask on top."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, 0] = 0.0  # neither divided nor multiplied into anything but itself
    reqs = []
    for i in range(rows):
        prompt = torch.randint(0, vocab + 3, (int(torch.randint(1, 40, (1,), generator=g)),),
                               generator=g).tolist()
        outputs = torch.randint(0, vocab + 3, (int(torch.randint(0, 30, (1,), generator=g)),),
                                generator=g).tolist()
        plain = i % 3 == 1  # no penalties: the kernel must leave its row alone
        params = SamplingParams(repetition_penalty=1.0 if plain else repetition,
                                presence_penalty=0.0 if plain else presence,
                                frequency_penalty=0.0 if plain else frequency,
                                min_tokens=min_tokens if i % 2 else 0, max_tokens=200)
        reqs.append(_req(params, prompt=prompt, outputs=outputs))
    want = Sampler._apply_penalties(logits, reqs, kernels=False)
    got = Sampler._apply_penalties(logits, reqs)
    assert torch.equal(got, want)


@needs_kernels
@settings(max_examples=40, deadline=None, derandomize=True)
@given(vocab=st.sampled_from([1, 7, 300, 5000]), seed=st.integers(0, 2**16),
       rows=st.integers(1, 4), n=st.sampled_from([0, 1, 5, 20]), masked=st.booleans(),
       scale=st.sampled_from([0.1, 3.0, 60.0]))
def test_logprobs_kernel_gives_torchs_entries(vocab, seed, rows, n, masked, scale):
    """The kernels' logprobs against torch's log-softmax and topk: the same token ids (the
    sampled one and the top n, fewer where the vocabulary is smaller; among -inf ones, as
    many, whichever they are) and log-probs within fp32 rounding; rows that ask for none
    left out."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * scale
    if masked and vocab > 1:
        logits[:, torch.randperm(vocab, generator=g)[:vocab // 2]] = float("-inf")
    reqs = [_req(SamplingParams(logprobs=None if i % 3 == 2 else min(n, 20)))
            for i in range(rows)]
    tokens = [int(torch.randint(0, vocab, (1,), generator=g)) for _ in range(rows)]
    want = Sampler._logprobs(logits, reqs, tokens, kernels=False)
    got = Sampler._logprobs(logits, reqs, tokens)
    for w, o, r, tok in zip(want, got, reqs, tokens):
        assert (w is None) == (o is None)
        if w is None:
            continue
        assert tok in o and min(r.params.logprobs, vocab) <= len(o) <= r.params.logprobs + 1
        finite = {t: v for t, v in w.items() if v > float("-inf")}
        assert {t for t, v in o.items() if v > float("-inf")} == set(finite)
        for t, v in finite.items():
            assert o[t] == pytest.approx(v, rel=1e-5, abs=1e-5)


@needs_kernels
def test_penalties_kernel_rounds_the_product_as_torch_does():
    """freq * count rounded before presence is added (no fused multiply-add): with these
    inexact products a fused kernel gave other bits for 9 values of 16 settings."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 3
    outputs = [3] + [5] * 2 + [7] * 3 + [9] * 5 + [11] * 7 + [13] * 9 + list(range(20, 60))
    for f in (0.1, 0.3, 0.7, 1.1):
        for p in (0.2, 0.5, 0.7, 1.3):
            r = _req(SamplingParams(frequency_penalty=f, presence_penalty=p), outputs=outputs)
            assert torch.equal(Sampler._apply_penalties(logits, [r]),
                               Sampler._apply_penalties(logits, [r], kernels=False))


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 0.0, 4.0, 1.0]])
    r = _req(SamplingParams(min_tokens=2, stop_token_ids=[2], temperature=0), eos=(0,))
    out = Sampler._apply_penalties(logits, [r])
    assert math.isinf(out[0, 0]) and math.isinf(out[0, 2])
    assert Sampler(torch.Generator())(logits, [r]).token_ids == [3]
    r.append_output(3)
    r.append_output(3)
    assert Sampler(torch.Generator())(logits, [r]).token_ids == [0]


def test_logprobs_report_top_n_and_the_sampled_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = sampler(logits, [_req(SamplingParams(temperature=0, logprobs=2))])
    ref = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0] == pytest.approx({0: ref[0].item(), 1: ref[1].item()})
    out = sampler(logits, [_req(SamplingParams(temperature=0, logprobs=0))])
    assert list(out.logprobs[0]) == [0]


def test_stop_string_across_tokens_is_cut_and_never_streamed(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("def f(x):", base)[0].text
    assert len(full) > 12
    stop = full[5:9]  # very likely spans a token boundary; at least it is mid-text
    first = full.find(stop)
    out = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True, stop=[stop]))[0]
    assert out.text == full[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    streamed = "".join(o.delta_text for o in llm.stream(
        "def f(x):", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                    stop=[stop])))
    assert streamed == full[:first]
    kept = llm.generate("def f(x):", SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True))[0]
    assert kept.text == full[:first + len(stop)]


def test_stop_token_ids_and_eos(llm):
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    toks = llm.generate("import", base)[0].token_ids
    target = toks[4]
    out = llm.generate("import", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                stop_token_ids=[target]))[0]
    assert out.token_ids == toks[:toks.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # Make that token the end-of-sequence id: generation stops there unless ignore_eos.
    engine = llm.engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = (target,)
    try:
        stopped = llm.generate("import", SamplingParams(temperature=0, max_tokens=20))[0]
        ignored = llm.generate("import", base)[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.token_ids == toks[:toks.index(target) + 1]
    assert stopped.finish_reason == "stop"
    assert ignored.token_ids == toks and ignored.finish_reason == "length"


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       special=st.sampled_from(["none", "nan", "inf", "-inf", "all -inf", "many nan"]))
def test_greedy_tokens_is_argmax_with_ties_nans_and_infinities(rows, vocab, seed, special):
    # the sampler's greedy rows take the kernels' argmax on a CPU (torch.max(dim).indices
    # without them): each must pick what argmax picks, the first maximum, a NaN counting as
    # the maximum; widths 1-300 cover the kernel's four 8-lane accumulators, the whole
    # vectors and the values left after them, and rows shorter than 32
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (rows, vocab), generator=g).float()  # many ties
    pick = torch.rand(rows, vocab, generator=g)
    if special == "nan":
        x[pick < 0.02] = float("nan")
    elif special == "inf":
        x[pick < 0.02] = float("inf")
    elif special == "-inf":
        x[pick < 0.02] = float("-inf")
    elif special == "all -inf":
        x[:] = float("-inf")
    elif special == "many nan":
        x[pick < 0.4] = float("nan")
    want = x.argmax(dim=-1)
    assert torch.equal(greedy_tokens(x), want)
    assert greedy_token_list(x) == want.tolist()  # the sampler's all-greedy batches
    assert torch.equal(torch.max(x, dim=-1).indices, want)  # the fallback
    if cpu_kernels.load() is not None:
        assert torch.equal(cpu_kernels.argmax_rows(x), want)
        assert cpu_kernels.argmax_list(x) == want.tolist()
        # rows of a wider tensor are not contiguous (but for one row): greedy_tokens falls
        # back to torch, same picks
        wide = torch.cat([x, x], dim=1)[:, :vocab]
        assert (cpu_kernels.argmax_rows(wide) is None) == (rows > 1)
        assert (cpu_kernels.argmax_list(wide) is None) == (rows > 1)
        assert torch.equal(greedy_tokens(wide), want)
        assert greedy_token_list(wide) == want.tolist()
