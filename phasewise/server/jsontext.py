"""A reply's JSON text written in pieces, so that encoding a large one does not hold the GIL.

``json.dumps`` encodes a whole object in one C call, during which no other thread runs: a
non-streamed completion of 16 choices with 20 logprobs per token is tens of MB and held the
event loop (and the engine's thread) for over a second. ``dumps`` gives the same text, but
walks the reply's first few levels itself (the choices, each choice, its logprobs) and
encodes a long list a slice at a time, so that Python hands the GIL over (every
``sys.getswitchinterval()``) between any two pieces. Below ``DEPTH`` levels a value is
encoded in one call unless it is a long list: a reply's bulk is its long lists (tokens,
their entries), and walking their small parts in Python would cost more than it saves. It
is meant for a worker thread.

``memo`` (one per reply or stream): a ``Shared`` list met again, the same object, is written
as the text it gave the first time, and a ``Joined`` list as its two parts' texts. The
samples of one prompt share its prompt logprobs (``sse.SharedPromptLogprobs``) and its
echoed entries (joined with each sample's own), so each is encoded once per reply, not once
per sample. Only ``Shared`` lists are kept: a memo holds nothing that cannot recur, so a
long stream's memo does not grow with its chunks.
"""

from __future__ import annotations

import json
from typing import Any

# id of a Shared list -> (the list, its text); holding the list keeps its id from being reused
Memo = dict[int, tuple[Any, str]]


class Shared(list):
    """A list that several of one reply's chunks hold, the same object (a prompt's logprobs,
    which its samples share): a list to anything else, written once per memo by ``dumps``."""

SLICE = 64  # items of a long list encoded per call (a reply's long lists hold small items)
DEPTH = 5  # levels walked in Python: a reply's logprobs lists sit at depth 3 or 4
_encode = json.JSONEncoder(ensure_ascii=False).encode  # (json.dumps's, made once)


class Joined(list):
    """A list that is two lists one after the other (an echoed prompt's logprobs, then a
    completion's): a list to anything else, written as its parts' texts where ``dumps`` has
    a memo, so that a part shared between replies is encoded once."""

    def __init__(self, head: list[Any], tail: list[Any]) -> None:
        super().__init__(head)
        self.extend(tail)
        self.parts = (head, tail)


def dumps(obj: Any, memo: Memo | None = None) -> str:
    """``json.dumps(obj, ensure_ascii=False)``, in pieces (see the module)."""
    out: list[str] = []
    _write(obj, out, 0, memo)
    return "".join(out)


def _write(obj: Any, out: list[str], depth: int, memo: Memo | None = None) -> None:
    if memo is not None and isinstance(obj, Joined) and obj:
        inner = []
        for part in obj.parts:
            text: list[str] = []
            _write(part, text, depth, memo)
            if part:
                inner.append("".join(text)[1:-1])  # (its items, without its brackets)
        out.append("[" + ", ".join(inner) + "]")
    elif memo is not None and isinstance(obj, Shared) and obj:
        seen = memo.get(id(obj))
        if seen is None or seen[0] is not obj:
            text: list[str] = []
            _write(list(obj), text, depth, None)
            seen = memo[id(obj)] = (obj, "".join(text))
        out.append(seen[1])
    elif isinstance(obj, (list, tuple)) and len(obj) > SLICE:
        out.append("[")
        for i in range(0, len(obj), SLICE):
            out.append(", " if i else "")
            out.append(_encode(list(obj[i:i + SLICE]))[1:-1])
        out.append("]")
    elif depth >= DEPTH:
        out.append(_encode(obj))
    elif isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        out.append("{")
        for i, (k, v) in enumerate(obj.items()):
            out.append(", " if i else "")
            out.append(_encode(k))
            out.append(": ")
            _write(v, out, depth + 1, memo)
        out.append("}")
    elif isinstance(obj, (list, tuple)) and obj:
        out.append("[")
        for i, v in enumerate(obj):
            out.append(", " if i else "")
            _write(v, out, depth + 1, memo)
        out.append("]")
    else:  # a scalar, an empty container, or a dict with keys json converts itself
        out.append(_encode(obj))
