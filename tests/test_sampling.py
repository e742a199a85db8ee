"""Sampling parameters: validation, seeds, filters, penalties, stops and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise import LLM, SamplingParams
from phasewise.engine.request import Request
from phasewise.engine.sampler import Sampler, greedy_token_list, greedy_tokens
from phasewise.model import cpu_kernels


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, "temperature must be a number in [0, 100]"),
    ("top_p", 0.0, "top_p must be a number in (0, 1]"),
    ("top_p", 1.5, "top_p must be a number in (0, 1]"),
    ("top_k", -2, "top_k must be an integer >= 1, or 0 / -1 to disable"),
    ("min_p", 1.1, "min_p must be a number in [0, 1]"),
    ("max_tokens", -1, "max_tokens must be an integer >= 0 or None"),
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
