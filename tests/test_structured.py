"""Structured output (``SamplingParams.structured_output``, llguidance): sampled output from a
random-weight model always parses and validates against the schema (hypothesis over
schemas), and regexes, choices, Lark grammars and any-JSON-object constrain it too; the
grammar's end ends the request; greedy decoding under a grammar picks the best allowed
token; constrained requests batch with free ones and survive preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phasewise import LLM, SamplingParams
from phasewise.engine.structured import spec_json
from phasewise.engine.validation import ValidationError


@pytest.fixture(scope="module")
def llm(hf_checkpoints):
    return LLM(str(hf_checkpoints["Qwen2ForCausalLM"][0]), dtype="float32", max_num_seqs=16)


# Schemas whose every instance is short: bounded strings, integers, arrays and nesting, so
# that a random model's output ends well inside max_tokens.
leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo,
                                         "maximum": lo + 100}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=4,
             unique=True).map(lambda v: {"enum": v}),
)


def objects(children):
    return st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=6), children,
                           min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


schemas = st.recursive(
    leaf, lambda inner: st.one_of(
        objects(inner),
        inner.map(lambda item: {"type": "array", "items": item, "maxItems": 3})),
    max_leaves=6).map(lambda s: s if s.get("type") == "object" else
                      {"type": "object", "properties": {"v": s}, "required": ["v"],
                       "additionalProperties": False})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_sampled_output_always_validates_against_the_schema(llm, schema, seed):
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=seed,
                            structured_output=spec_json("json_schema", schema))
    out = llm.generate(["def f(x):"], params)[0]
    assert out.finish_reason == "stop", out.text  # the grammar's end ended it
    jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_lark_and_any_object(llm):
    cases = [
        (spec_json("regex", r"[a-c]{2,5}-[0-9]{3}"),
         lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", t)),
        (spec_json("choice", ["alpha", "beta gamma", "δ"]),
         lambda t: t in ("alpha", "beta gamma", "δ")),
        (spec_json("lark", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", t)),
    ]
    for spec, ok in cases:
        outs = llm.generate(["x = "] * 4, [SamplingParams(max_tokens=64, temperature=1.0,
                                                          seed=s, structured_output=spec)
                                           for s in range(4)])
        for o in outs:
            assert o.finish_reason == "stop" and ok(o.text), (spec, o.text)
    # json_object: any object; cut short by max_tokens it need not parse, so only a
    # finished one is checked (a random model's objects rarely close: each of its tokens
    # is checked against the grammar all the same)
    outs = llm.generate(["x = "] * 4, [SamplingParams(
        max_tokens=40, temperature=1.0, seed=s, structured_output=spec_json("json_object"))
        for s in range(4)])
    for o in outs:
        assert o.text.startswith("{")
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)


def test_greedy_under_a_grammar_takes_the_best_allowed_token(hf_checkpoints):
    path, hf = hf_checkpoints["LlamaForCausalLM"]
    llm = LLM(str(path), dtype="float32")
    choices = [f"{a}{b}" for a in "abcdef" for b in "xyz"]
    out = llm.generate(["def f(x):"], SamplingParams(
        max_tokens=8, temperature=0.0, structured_output=spec_json("choice", choices)))[0]
    tok = llm.tokenizer
    prompt = tok.encode("def f(x):")
    # the reference: HF's logits, restricted step by step to tokens that keep a choice
    # reachable (the same rule the grammar applies)
    ids, text = list(prompt), ""
    while text not in choices:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        ok = [t for t in range(len(logits))
              if any(c.startswith(text + tok.decode([t], skip_special_tokens=False))
                     and tok.decode([t], skip_special_tokens=False) for c in choices)]
        best = max(ok, key=lambda t: float(logits[t]))
        ids.append(best)
        text += tok.decode([best], skip_special_tokens=False)
    assert out.text == text and out.finish_reason == "stop"


def test_constrained_and_free_requests_batch_and_survive_preemption(hf_checkpoints):
    path, _ = hf_checkpoints["LlamaForCausalLM"]
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=20, max_model_len=64,
              max_num_batched_tokens=8)
    # at most 5 items: 32 characters, within the 40 tokens whatever the seeds draw
    schema = {"type": "object", "properties": {"k": {"type": "array", "maxItems": 5,
                                                     "items": {"enum": ["ab", "cd"]}}},
              "required": ["k"], "additionalProperties": False}
    spec = spec_json("json_schema", schema)
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                             structured_output=spec if i % 2 == 0 else None,
                             ignore_eos=i % 2 == 1) for i in range(6)]
    outs = llm.generate(["def f(x):", "class A:", "import os", "x = 1", "y", "z"], params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for i, o in enumerate(outs):
        if i % 2 == 0:
            assert o.finish_reason == "stop"
            jsonschema.validate(json.loads(o.text), schema)
        else:
            assert len(o.token_ids) == 40
    assert llm.engine.kv.num_free_blocks == 20


def test_bad_constraints_name_the_field(llm):
    for bad in ("{", '{"type": "xml"}', '{"type": "regex"}', '{"type": "choice", "choices": []}',
                '{"type": "json_schema", "schema": 3}'):
        with pytest.raises(ValidationError, match="structured_output"):
            SamplingParams(structured_output=bad)
    with pytest.raises(ValidationError, match="does not compile"):
        llm.generate(["x"], SamplingParams(structured_output=spec_json("regex", "(")))
    # an integer JSON allows but the grammar compiler cannot read: said so, with the way out
    with pytest.raises(ValidationError, match=r"the integer 1000000000000000000\d*\.\.\., "
                       "outside the 64-bit range"):
        SamplingParams(structured_output=spec_json("json_schema", {
            "type": "object", "properties": {"a": {"type": "integer", "maximum": 10**30}}}))
    assert not llm.engine.has_unfinished_requests()


def test_the_eos_that_ends_a_grammar_is_not_text(llm):
    """A grammar that may end (a regex of optional letters) ends at EOS: its text is not
    the output's, even with skip_special_tokens off."""
    eos = llm.tokenizer.eos_token
    outs = llm.generate(["x"] * 6, [SamplingParams(
        max_tokens=8, temperature=1.0, seed=s, skip_special_tokens=False,
        structured_output=spec_json("regex", "[a-z]{0,3}")) for s in range(6)])
    for o in outs:
        assert eos not in o.text and re.fullmatch("[a-z]{0,3}", o.text), o.text


def test_a_stop_string_the_grammars_last_token_completes_is_the_stop_reason(llm):
    """A grammar's final token that completes a stop string: the text was cut before it,
    the finish 'stop', and stop_reason None, as if the grammar alone had ended it."""
    out = llm.generate(["x"], SamplingParams(
        max_tokens=8, temperature=0, stop=["}"],
        structured_output=spec_json("regex", "ab}")))[0]
    assert out.text == "ab" and out.finish_reason == "stop" and out.stop_reason == "}"


def test_n_samples_of_one_grammar_compile_once(llm):
    spec = spec_json("choice", ["north", "south"])
    llm.generate(["x"] * 4, SamplingParams(max_tokens=4, structured_output=spec))
    first = llm.engine.grammars._compiled[spec]
    llm.generate(["y"] * 4, SamplingParams(max_tokens=4, structured_output=spec))
    assert llm.engine.grammars._compiled[spec] is first


def test_a_grammar_the_parser_gives_up_on_fails_its_request_alone_as_invalid_grammar(llm):
    """A grammar within every bound whose parser hits a limit at its first token (a Lark
    rule of 2,100 alternatives: llguidance keeps one item per alternative in that row, and
    refuses rows of more than 2,000) ends that request with the grammar's error, coded as
    the client's (``invalid_grammar``, a 400), while a request beside it finishes."""
    from phasewise.engine.backend import GrammarFailed, request_error
    from phasewise.server.sse import stream_error

    wide = "start: " + " | ".join(f'"w{i}"' for i in range(2100))
    engine = llm.engine
    engine.add_request("x", SamplingParams(max_tokens=4, structured_output=spec_json(
        "lark", wide)), request_id="wide")
    engine.add_request("x", SamplingParams(max_tokens=4, ignore_eos=True), request_id="free")
    outs = {}
    for _ in range(50):
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    assert outs["wide"].error_code == GrammarFailed.code, outs["wide"]
    assert "items" in outs["wide"].error, outs["wide"].error
    assert outs["free"].error is None and len(outs["free"].token_ids) == 4
    err = stream_error(request_error(outs["wide"].error, outs["wide"].error_code))
    assert (err.status, err.code) == (400, "invalid_grammar")
    err = stream_error(request_error("boom", None))
    assert (err.status, err.code) == (500, "engine_error")


def test_a_grammar_that_matches_no_text_fails_as_the_server_refuses_it(llm):
    """``start: start`` can match nothing; its first mask fails (the server's check refuses it
    with a 400). In-process it ends its request with the same reason instead of finishing
    an empty output with 'stop' as if it had matched."""
    out = llm.generate(["x"], SamplingParams(max_tokens=4, structured_output=spec_json(
        "lark", "start: start")))[0]
    assert out.finish_reason == "abort" and out.token_ids == [], out
    assert out.error_code == "invalid_grammar"
    assert "the grammar cannot start" in out.error and "never reach text" in out.error
