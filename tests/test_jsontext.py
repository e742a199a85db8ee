"""``jsontext.dumps`` gives ``json.dumps``'s text, written in pieces (a large reply's encoding
must not hold the GIL in one call: ``phasewise.server.jsontext``)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.server import jsontext

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=200)
                   | st.dictionaries(st.text(max_size=6), inner, max_size=5)
                   | st.dictionaries(st.integers(0, 9), inner, max_size=3)),
    max_leaves=600)


@settings(max_examples=300, deadline=None)
@given(values)
def test_pieces_give_json_dumps_text(obj):
    assert jsontext.dumps(obj) == json.dumps(obj, ensure_ascii=False)


def test_a_long_list_is_encoded_a_slice_at_a_time(monkeypatch):
    """A reply's long logprobs list: no single call encodes more than a slice of it, and
    the reply's small parts are not encoded value by value (each call is worth its cost)."""
    sizes: list[int] = []
    real = jsontext._encode

    def counting(obj):
        sizes.append(len(obj) if isinstance(obj, list) else 1)
        return real(obj)

    monkeypatch.setattr(jsontext, "_encode", counting)
    entries = [{"token": f"t{i}", "logprob": -0.5, "top": [{"t": "a", "lp": -1.0}] * 20}
               for i in range(5000)]
    text = jsontext.dumps({"choices": [{"logprobs": {"content": entries}}] * 3})
    monkeypatch.undo()
    assert json.loads(text)["choices"][2]["logprobs"]["content"][4999]["token"] == "t4999"
    assert max(sizes) == jsontext.SLICE
    assert len(sizes) < 3 * (5000 // jsontext.SLICE + 1) + 20


@settings(max_examples=200, deadline=None)
@given(st.lists(values, min_size=1, max_size=4), st.lists(st.integers(0, 3), max_size=6),
       st.lists(scalars, max_size=100))
def test_a_memo_and_joined_lists_give_json_dumps_text(parts, picks, tail):
    """Shared lists (the same object in several places, as a prompt's samples share its
    logprobs) and ``Joined`` lists are written as json.dumps writes them, in one reply
    and across replies that share a memo."""
    long = [jsontext.Shared(range(jsontext.SLICE + 7)),
            *[jsontext.Shared([p] * (jsontext.SLICE + 1)) for p in parts], [1, 2]]
    shared = [long[i % len(long)] for i in picks]
    reply = {"choices": [{"a": s, "b": jsontext.Joined(s, tail)} for s in shared],
             "same": long[0], "again": long[0], "empty": jsontext.Joined([], [])}
    memo: jsontext.Memo = {}
    for _ in range(2):
        assert jsontext.dumps(reply, memo) == json.dumps(reply, ensure_ascii=False)
    assert jsontext.dumps(reply) == json.dumps(reply, ensure_ascii=False)


def test_a_list_shared_by_choices_is_encoded_once(monkeypatch):
    calls: list[int] = []
    real = jsontext._encode

    def counting(obj):
        calls.append(1)
        return real(obj)

    entries = jsontext.Shared({"t": f"t{i}", "lp": -0.5} for i in range(10 * jsontext.SLICE))
    reply = {"choices": [{"logprobs": jsontext.Joined(entries, [{"t": "x", "lp": -1.0}])}
                         for _ in range(16)]}
    monkeypatch.setattr(jsontext, "_encode", counting)
    text = jsontext.dumps(reply, {})
    monkeypatch.undo()
    assert text == json.dumps(reply, ensure_ascii=False)
    assert len(calls) < 10 + 16 * 8  # its 10 slices once, then each choice's few pieces


def test_a_memo_keeps_only_the_lists_that_recur():
    """A stream's memo lives as long as the stream: a slow reader's merged chunks (long
    lists that never recur) had all been kept in it, text and objects, until the end."""
    memo: jsontext.Memo = {}
    shared = jsontext.Shared(range(200))
    for k in range(50):
        chunk = {"choices": [{"index": k, "logprobs": list(range(k, k + 500)),
                              "prompt": shared}]}
        assert jsontext.dumps(chunk, memo) == json.dumps(chunk, ensure_ascii=False)
    assert list(memo) == [id(shared)]
