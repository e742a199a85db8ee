"""``Tokenizer.encode`` and ``decode`` take the GIL-releasing batch calls of the tokenizers
library (``encode_batch_fast``, ``decode_batch``) so that a long text does not hold the
engine's thread; they give the same ids and text as the plain calls."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

import phasewise
from phasewise.model.tokenizer import Tokenizer

BUNDLED = Path(phasewise.__file__).parent / "assets" / "stdlib-coder"
TOK = Tokenizer(BUNDLED)
PLAIN = HFTokenizer.from_file(str(BUNDLED / "tokenizer.json"))


def _same(text: str) -> None:
    for special in (True, False):
        want = PLAIN.encode(text, add_special_tokens=special).ids
        if (special and TOK.add_bos_token and TOK.bos_token_id is not None
                and (not want or want[0] != TOK.bos_token_id)):
            want = [TOK.bos_token_id, *want]
        assert TOK.encode(text, add_special_tokens=special) == want, text[:80]


def test_encode_and_decode_match_the_plain_calls_on_long_and_odd_text():
    for text in ("", "def f(x):\n    return x\n" * 400, "naïve 字 🙂 \t\r\n" * 50,
                 "x = 1\n" * 5000):
        _same(text)
        ids = PLAIN.encode(text).ids
        assert TOK.decode(ids, skip_special_tokens=False) == PLAIN.decode(
            ids, skip_special_tokens=False)  # more than 256 ids: decode_batch


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=300))
def test_encode_matches_the_plain_call_on_any_text(text):
    _same(text)


def test_a_prompt_cut_mid_character_outputs_that_character_once():
    """Token ids cut one byte into an emoji: the stream, seeded with the prompt's U+FFFD,
    gave '\ufffd😀😀' for the output that completed it. The character that the prompt
    began and the outputs finished is output once; and a whole prompt is unchanged."""
    ids = TOK.encode("s = '\U0001f600\U0001f600'", add_special_tokens=False)
    full = TOK.decode(ids)
    for cut in range(1, 6):
        prompt, outs = ids[:-cut], ids[-cut:]
        stream = TOK.decode_stream(prompt, True)
        text = "".join(stream.step(t) for t in outs) + stream.flush()
        head = TOK.decode(prompt)
        assert text == full[len(head.rstrip("\ufffd")):], cut
        assert text.count("\U0001f600") <= 1 and "\ufffd" not in text, cut
