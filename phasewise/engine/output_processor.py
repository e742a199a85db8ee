"""From sampled tokens to what a caller sees: each request's text, detokenized as its tokens
arrive, its stop strings, and the ``RequestOutput`` of every step that gave it tokens.

``LLMEngine`` holds one ``OutputProcessor``: ``add`` when a request is admitted, ``emit``
after each step that gave it tokens (or ``output`` for one that failed alone), ``remove``
once it is forgotten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from phasewise.engine.finish import find_stop_string
from phasewise.engine.outputs import RequestOutput
from phasewise.engine.request import Request, RequestStatus
from phasewise.engine.sampling_params import SamplingParams
from phasewise.model.tokenizer import TextStream, Tokenizer


class TextState:
    """Incremental text of one request, with stop-string matching.

    Stop strings (rule 6 of ``phasewise.engine.finish``) are matched on the decoded text, so
    they are found across token boundaries.
    While a request runs, the last ``max_stop_len - 1`` characters are held back from deltas,
    so a partial stop string never reaches the client.
    """

    def __init__(self, stream: TextStream, params: SamplingParams) -> None:
        self.stream = stream
        self.params = params
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0
        self.num_tokens = 0  # outputs added (min_tokens holds stop strings back until then)
        self.held = 0  # the text of the first min_tokens outputs: no stop string ends in it

    def add_token(self, token_id: int) -> str | None:
        """Append a token's text; return the stop string it completed, if any."""
        self.num_tokens += 1
        piece = self.stream.step(token_id)
        if not piece or self.num_tokens <= self.params.min_tokens:
            if piece:
                self.text += piece
                self.held = len(self.text)
            return None
        old_len = len(self.text)
        self.text += piece
        if not self.params.stop:
            return None
        start = max(0, old_len - self.params.max_stop_len + 1)
        hit = find_stop_string(self.text, start, self.params.stop, self.held)
        if hit is None:
            return None
        pos, s = hit
        self.text = self.text[:pos + (len(s) if self.params.include_stop_str_in_output else 0)]
        return s

    def take_delta(self, finished: bool) -> str:
        if finished:  # bytes of a character the output was cut in: shown as a full decode
            self.text += self.stream.flush()  # shows them
        hold = 0 if finished else max(0, self.params.max_stop_len - 1)
        limit = max(self.sent_chars, len(self.text) - hold)
        delta = self.text[self.sent_chars:limit]
        self.sent_chars = limit
        return delta


class OutputProcessor:
    """The text state of every live request, keyed by request id (see the module)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[str, TextState] = {}

    def add(self, req: Request) -> None:
        self._text[req.request_id] = TextState(self.tokenizer.decode_stream(
            req.prompt_token_ids, req.params.skip_special_tokens), req.params)

    def stop_in(self, req: Request, tokens: Sequence[int]) -> tuple[int, str] | None:
        """``(i, stop)``: the first of ``tokens``, as ``req``'s outputs, whose text completes
        one of its stop strings, as a running request's would be found; None if none does."""
        if not req.params.stop:
            return None
        state = TextState(self.tokenizer.decode_stream(
            req.prompt_token_ids, req.params.skip_special_tokens), req.params)
        for i, token in enumerate(tokens):
            stop = state.add_token(token)
            if stop is not None:
                return i, stop
        return None

    def resume(self, req: Request, n: int) -> None:
        """The request's first ``n`` outputs were streamed by another engine: take their text
        as already sent, as that engine's ``TextState`` had it after its last output (the
        same tokens through the same decoder give the same text; the stop-string hold-back
        keeps the same tail unsent), so the deltas from here on continue its stream."""
        state = self._text[req.request_id]
        for i, token in enumerate(req.output_token_ids[:n], start=1):
            state.text += state.stream.step(token)
            if i <= req.params.min_tokens:
                state.held = len(state.text)
        state.num_tokens = state.sent_tokens = n
        state.take_delta(False)

    def remove(self, request_id: str) -> None:
        self._text.pop(request_id, None)

    def emit(self, req: Request, new_tokens: int,
             finish: Callable[[Request, RequestStatus], Any]) -> RequestOutput:
        """The output of a request that just got ``new_tokens`` tokens (more than one after
        a verify): their text, stop strings checked token by token (a stop string ends the
        request at the token that completes it, and the tokens after it are dropped; a
        request still running is ended by ``finish(req, FINISHED_STOPPED)``, the scheduler's
        ``finish_request``)."""
        state = self._text[req.request_id]
        tokens = req.output_token_ids[req.num_output_tokens - new_tokens:]
        # A stop token's text is not shown (unless asked for); a grammar's last token is the
        # output's end and is shown, unless it is itself a stop token (EOS).
        ended_by_token = (req.finished and req.status is RequestStatus.FINISHED_STOPPED
                          and (not req.output_complete or bool(tokens) and (
                              tokens[-1] in req.eos_token_ids
                              or tokens[-1] in req.params.stop_token_ids)))
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            if last and ended_by_token and not req.params.include_stop_str_in_output:
                break
            stop = state.add_token(token)
            if stop is None:
                continue
            if last and req.finished:
                # the token ended it already (a length keeps its reason); one that ended it
                # with no reason of its own (its grammar complete) names the stop string
                # that cut its text
                if req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason is None:
                    req.stop_reason = stop
                continue
            req.truncate_outputs(req.num_output_tokens - (len(tokens) - 1 - i))
            req.stop_reason = stop
            if req.finished:  # the token cut off had ended it (length): the stop string did
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                finish(req, RequestStatus.FINISHED_STOPPED)
            break
        return self.output(req)

    def output(self, req: Request) -> RequestOutput:
        """The request's output now: everything so far, and what changed since the last."""
        state = self._text[req.request_id]
        delta_tokens = req.output_token_ids[state.sent_tokens:]
        state.sent_tokens = req.num_output_tokens
        delta_text = state.take_delta(req.finished)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids, text=state.text[:state.sent_chars],
            token_ids=list(req.output_token_ids), delta_text=delta_text,
            delta_token_ids=list(delta_tokens), finished=req.finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            metrics=req.metrics, prompt_logprobs=req.prompt_logprobs,
        )
