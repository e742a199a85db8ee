"""Prompts of exact token lengths, made of the server's own tokens.

A corpus of real text (this Python's standard library sources, on every machine) is turned
into token ids once, by the server's ``/tokenize`` route or by a ``tokenizer.json`` given on
the command line; each prompt is then a window of the requested length at a seeded random
offset. Sent as token ids, the prompt's length is exactly what the workload says, and
distinct offsets keep prompts from sharing prefixes by accident.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import httpx

from phasewise.perf.workload import RequestSpec

CORPUS_FILES = ("textwrap.py", "argparse.py", "typing.py", "inspect.py", "dataclasses.py",
                "pathlib.py", "functools.py", "collections/__init__.py")
_CHUNK_CHARS = 20_000  # /tokenize is called per piece, keeping bodies small


def corpus_text(max_chars: int = 400_000) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for name in CORPUS_FILES:
        path = root / name
        if path.exists():
            text = path.read_text(errors="replace")
            parts.append(text)
            total += len(text)
            if total >= max_chars:
                break
    if not parts:
        raise RuntimeError(f"no standard-library sources found under {root} for the corpus")
    return "\n".join(parts)[:max_chars]


def tokens_from_file(tokenizer_json: str | Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return tok.encode(text, add_special_tokens=False).ids


def tokens_from_server(base_url: str, text: str, headers: dict[str, str] | None = None,
                       model: str | None = None) -> tuple[list[int], int | None]:
    """``text``'s token ids by the server's ``/tokenize``, and the context it reports
    (``max_model_len``, as phasewise and vLLM give it; None where it gives none)."""
    ids: list[int] = []
    context: int | None = None
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers or {}, timeout=120) as c:
        for i in range(0, len(text), _CHUNK_CHARS):
            body: dict = {"prompt": text[i:i + _CHUNK_CHARS], "add_special_tokens": False}
            if model:
                body["model"] = model
            try:
                r = c.post("/tokenize", json=body)
            except httpx.TransportError as e:
                raise ConnectionError(f"cannot reach {base_url} ({type(e).__name__}: {e}); "
                                      "is the server running there?") from e
            if r.status_code != 200:
                raise ValueError(
                    f"{base_url}/tokenize answered {r.status_code} ({r.text[:200]}); give the "
                    "model's tokenizer.json with --tokenizer instead")
            reply = r.json()
            ids.extend(reply["tokens"])
            got = reply.get("max_model_len")
            if isinstance(got, int) and not isinstance(got, bool) and got > 0:
                context = got
    return ids, context


def make_prompts(specs: Sequence[RequestSpec], corpus_ids: Sequence[int],
                 seed: int = 0) -> list[list[int] | str]:
    """One prompt per spec: its text when the trace gave one, else ``prompt_len`` token ids
    cut from the corpus at a random offset (the corpus repeats when a prompt is longer)."""
    if not corpus_ids:
        raise ValueError("the corpus gave no tokens")
    rng = random.Random(seed + 7919)
    n = len(corpus_ids)
    out: list[list[int] | str] = []
    for spec in specs:
        if spec.prompt is not None:
            out.append(spec.prompt)
            continue
        start = rng.randrange(n)
        ids = [corpus_ids[(start + k) % n] for k in range(spec.prompt_len)]
        out.append(ids)
    return out
