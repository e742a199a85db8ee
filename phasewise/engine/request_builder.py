"""Turning what a caller gives an engine (a prompt as text or token ids, sampling settings, an
id, an arrival time) into a ``Request``: the prompt tokenized or checked, the defaults of the
checkpoint's ``generation_config.json`` applied, an id given where none was, a structured
output's grammar compiled. Nothing is queued or registered here."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container

from phasewise.engine.generation import GenerationDefaults
from phasewise.engine.request import Request
from phasewise.engine.sampling_params import SamplingParams
from phasewise.engine.structured import GrammarCompiler
from phasewise.engine.validation import ValidationError, check_token_ids
from phasewise.model.tokenizer import Tokenizer


class RequestBuilder:
    """``in_use``: the ids an engine holds now (a new request may not take one);
    ``clock``: the engine's clock, which stamps a request's arrival when none is given;
    ``eos_token_ids``: those new requests stop at (the checkpoint's, unless replaced)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, defaults: GenerationDefaults,
                 in_use: Container[str], clock: Callable[[], float]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.defaults = defaults
        self.in_use = in_use
        self.clock = clock
        self.eos_token_ids = defaults.eos_token_ids
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model's tokenizer and logits width."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.eos_token_ids,
                                             self.vocab_size)
        return self._grammars

    def build(self, prompt: str | list[int], params: SamplingParams | None,
              request_id: str | None, arrival_time: float | None) -> Request:
        """A new request; ValueError (``phasewise.engine.validation.ValidationError`` where a
        field is at fault) for a prompt or an id it cannot take."""
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams or None, got "
                            f"{type(params).__name__}")
        params = params or self.defaults.sampling_params()
        if isinstance(prompt, str):
            text: str | None = prompt
            try:
                prompt.encode("utf-8")  # a lone surrogate: no tokenizer takes it
            except UnicodeEncodeError as e:
                raise ValidationError(f"prompt holds an invalid Unicode character (a lone "
                                      f"surrogate at position {e.start})", "prompt") from None
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text = None
            ids = check_token_ids(prompt, self.vocab_size, "prompt")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if params.stop_token_ids:  # an id past the vocabulary could never be sampled
            check_token_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.in_use:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, eos_token_ids=self.eos_token_ids, prompt=text,
                      arrival_time=self.clock() if arrival_time is None else arrival_time)
        if params.structured_output is not None:
            req.grammar = self.grammars.compile(params.structured_output)
        return req
