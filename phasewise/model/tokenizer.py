"""Tokenizer, chat template and generation defaults read from a checkpoint folder.

Uses the ``tokenizers`` library on ``tokenizer.json``; special tokens and the chat template
come from ``tokenizer_config.json`` (or ``chat_template.jinja``), and end-of-sequence ids and
default sampling settings from ``generation_config.json``.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir}: phasewise needs the fast-tokenizer file "
                "(tokenizer.json) beside the weights"
            )
        self._tok = HFTokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        if (model_dir / "tokenizer_config.json").exists():
            with open(model_dir / "tokenizer_config.json") as f:
                cfg = json.load(f)
        self.config = cfg
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self._compiled_template: Any = None
        self._max_token_chars: int | None = None
        self._special_ids: frozenset[int] | None = None

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (for libraries that read it, such as
        the grammar library of structured output)."""
        return self._tok.to_str()

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (BOS, EOS, chat markers: added tokens marked
        special), which ``decode`` skips by default."""
        if self._special_ids is None:
            self._special_ids = frozenset(
                i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        return self._special_ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters (a byte-level BPE token: bytes). A text
        of C characters (or bytes) takes at least C / max_token_chars tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self._tok.get_vocab()), default=1)
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while the Rust tokenizer runs (encode does not), so a
        # long text tokenized on a worker thread does not stall the event loop's or the
        # engine's thread; its _fast form keeps no offsets, whose building and freeing (with
        # the GIL held) took longer than the ids (the same ids: tests/test_tokenizer.py).
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        ids = encode([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > 256:  # decode_batch releases the GIL, as encode_batch does
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def decode_stream(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> TextStream:
        return TextStream(self._tok, prompt_ids, skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template (jinja2, sandboxed)."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json "
                             "chat_template or chat_template.jinja)")
        if self._compiled_template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(f"chat template error: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )


class TextStream:
    """Turns sampled token ids into text pieces as soon as they form valid UTF-8.

    Decoding is seeded with the prompt so that the first output token's leading space (and
    similar context-dependent rendering) comes out as it would in a full decode.
    """

    def __init__(self, tok: HFTokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self._tok = tok
        self._skip = skip_special_tokens
        seed = list(prompt_ids[-8:])
        # A prompt that ends part-way through a character (token ids cut mid-emoji): the
        # stream is seeded with its complete text and then takes the character's first
        # bytes as it takes outputs, so that the output completing it shows that character
        # once, not the seed's U+FFFD and the character again.
        # (a character is at most 4 bytes: its first 1-3 are what may hang over; where no
        # cut within them leaves whole text, the bytes are stray and seeded as they are)
        cut = next((c for c in range(len(seed), max(0, len(seed) - 3) - 1, -1)
                    if not tok.decode(seed[:c], skip_special_tokens=skip_special_tokens)
                    .endswith("\ufffd")), len(seed))
        self._stream = DecodeStream(ids=seed[:cut], skip_special_tokens=skip_special_tokens)
        for t in seed[cut:]:  # the prompt's own bytes: never output
            self._stream.step(tok, t)
        self._pending: list[int] = []  # tokens since the last piece: bytes of a character

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._tok, token_id) or ""
        if piece:
            self._pending.clear()
        else:
            self._pending.append(token_id)
        return piece

    def flush(self) -> str:
        """At the output's end, the text of tokens still waiting to form a character (an
        output cut mid-character): their bytes as a full decode shows them, replacement
        characters, rather than nothing."""
        if not self._pending:
            return ""
        text = self._tok.decode(self._pending, skip_special_tokens=self._skip)
        self._pending.clear()
        return text


def load_generation_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)
