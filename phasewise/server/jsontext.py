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
"""

from __future__ import annotations

import json
from typing import Any

SLICE = 64  # items of a long list encoded per call (a reply's long lists hold small items)
DEPTH = 5  # levels walked in Python: a reply's logprobs lists sit at depth 3 or 4
_encode = json.JSONEncoder(ensure_ascii=False).encode  # (json.dumps's, made once)


def dumps(obj: Any) -> str:
    """``json.dumps(obj, ensure_ascii=False)``, in pieces (see the module)."""
    out: list[str] = []
    _write(obj, out, 0)
    return "".join(out)


def _write(obj: Any, out: list[str], depth: int) -> None:
    if isinstance(obj, (list, tuple)) and len(obj) > SLICE:
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
            _write(v, out, depth + 1)
        out.append("}")
    elif isinstance(obj, (list, tuple)) and obj:
        out.append("[")
        for i, v in enumerate(obj):
            out.append(", " if i else "")
            _write(v, out, depth + 1)
        out.append("]")
    else:  # a scalar, an empty container, or a dict with keys json converts itself
        out.append(_encode(obj))
