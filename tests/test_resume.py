"""A request resumed on another engine with the outputs it had streamed (what a router's
migration sends, ``LLMEngine.add_request(resume=...)``) goes on as if it had never moved:
the same tokens, text, logprobs and finish, greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from phasewise.config import EngineConfig
from phasewise.engine.engine import LLMEngine
from phasewise.engine.sampler import Sampler
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.validation import ValidationError


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str,
         resume: list[int] | None = None) -> list:
    engine.add_request(prompt, params, request_id=rid, resume=resume or ())
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.fixture(scope="module")
def engines(llama_dir):
    # two engines, as two workers: the second never saw the request before
    return (LLMEngine(EngineConfig(model=str(llama_dir))),
            LLMEngine(EngineConfig(model=str(llama_dir))))


PROMPT = [5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, logprobs=1,
                   ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, seed=7, repetition_penalty=1.3,
                   frequency_penalty=0.5, min_tokens=20),
], ids=["greedy", "seeded", "penalties"])
@pytest.mark.parametrize("cut", [1, 9])
def test_resume_continues_the_unbroken_run(engines, params, cut):
    a, b = engines
    whole = _run(a, PROMPT, params, f"whole-{cut}")
    ids = whole[-1].token_ids
    assert len(ids) > cut
    text_before = "".join(o.delta_text for o in whole[:cut])
    ids_before = [t for o in whole[:cut] for t in o.delta_token_ids]
    assert ids_before == ids[:cut]

    rest = _run(b, PROMPT, params, f"moved-{cut}", resume=ids[:cut])
    # the resumed run streams only what follows, and the two halves make the whole
    assert [t for o in rest for t in o.delta_token_ids] == ids[cut:]
    assert rest[-1].token_ids == ids
    assert text_before + "".join(o.delta_text for o in rest) == whole[-1].text
    assert rest[-1].finish_reason == whole[-1].finish_reason
    if params.logprobs is not None:
        tail = rest[-1].logprobs[cut:]
        want = whole[-1].logprobs[cut:]
        assert [sorted(d) for d in tail] == [sorted(d) for d in want]
        for got, exp in zip(tail, want):
            for t in exp:
                assert got[t] == pytest.approx(exp[t], abs=1e-3)


def test_resume_holds_back_a_partial_stop_string(engines):
    """The text after the cut starts where the first engine's stream stopped sending: with
    stop strings that engine held back a tail, and the resumed one sends it."""
    a, b = engines
    probe = _run(a, PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                 "probe")[-1]
    # a stop string that never matches, but makes each engine hold back 5 characters
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                            stop=["\x00never"])
    whole = _run(a, PROMPT, params, "stop-whole")
    assert whole[-1].text == probe.text
    cut = 6
    sent = "".join(o.delta_text for o in whole[:cut])
    rest = _run(b, PROMPT, params, "stop-moved", resume=probe.token_ids[:cut])
    assert sent + "".join(o.delta_text for o in rest) == probe.text


def test_resume_that_could_not_have_been_outputs_is_refused(engines):
    a, _ = engines
    vocab = a.model_config.vocab_size
    with pytest.raises(ValidationError, match="resume") as e:
        a.add_request(PROMPT, SamplingParams(max_tokens=4), request_id="r1",
                      resume=[1, 2, 3, 4])
    assert e.value.param == "resume"
    with pytest.raises(ValidationError, match=r"resume must hold token ids: integers"):
        a.add_request(PROMPT, SamplingParams(max_tokens=8), request_id="r2", resume=[vocab])
    with pytest.raises(ValidationError, match="context length"):
        a.add_request(PROMPT, SamplingParams(max_tokens=None), request_id="r3",
                      resume=[1] * (a.scheduler.max_len - len(PROMPT)))
    # an end of sequence or a stop token before the end: the request had finished there
    # (the internal API took [0, 1, 2, 0] and went on)
    eos = a.tokenizer.eos_token_id
    with pytest.raises(ValidationError, match=r"resume token 1 .* would have ended"):
        a.add_request(PROMPT, SamplingParams(max_tokens=8), request_id="r4",
                      resume=[5, eos, 6])
    with pytest.raises(ValidationError, match=r"resume token 0 .* would have ended"):
        a.add_request(PROMPT, SamplingParams(max_tokens=8, stop_token_ids=[7]),
                      request_id="r5", resume=[7])
    with pytest.raises(ValidationError, match=r"resume token 0 .* min_tokens holds back"):
        a.add_request(PROMPT, SamplingParams(max_tokens=8, min_tokens=2), request_id="r6",
                      resume=[eos])
    # a stop string the resumed text completes, or a grammar its last token completes
    text_ids = a.tokenizer.encode(" the cat sat", add_special_tokens=False)
    with pytest.raises(ValidationError, match=r"completes the stop string 'cat'"):
        a.add_request(PROMPT, SamplingParams(max_tokens=20, stop=["cat"]), request_id="r8",
                      resume=text_ids)
    from phasewise.engine.structured import spec_json
    params = SamplingParams(max_tokens=20, temperature=0,
                            structured_output=spec_json("regex", "the"))
    whole = _run(a, PROMPT, params, "r9")[-1]
    assert whole.finish_reason == "stop"
    with pytest.raises(ValidationError, match="completes the request's structured output"):
        a.add_request(PROMPT, params, request_id="r10", resume=whole.token_ids)
    assert not a.requests and not a.has_unfinished_requests()
    # with ignore_eos an EOS is an output like any other
    a.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), request_id="r7",
                  resume=[eos, 5])
    a.abort_request("r7")
    while a.has_unfinished_requests():
        a.step()


@pytest.mark.parametrize("n", [0, 1, 7, 33, 1000])
def test_skip_draws_is_n_single_draws(n):
    """A resumed seeded request's generator stands where n single draws leave it."""
    params = SamplingParams(temperature=1.0, seed=99)

    class R:
        request_id = "x"

    R.params = params
    one, many = Sampler(torch.Generator()), Sampler(torch.Generator())
    cpu = torch.device("cpu")
    for _ in range(n):
        torch.rand(1, generator=one._generator(R, cpu))
    many.skip_draws(R, cpu, n)
    assert torch.equal(torch.rand(4, generator=one._generator(R, cpu)),
                       torch.rand(4, generator=many._generator(R, cpu)))
