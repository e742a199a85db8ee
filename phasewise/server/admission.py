"""The checks that size a request against the served model before any tokenizing: how many
sequences it asks for, how long its texts and token-id prompts are, how many messages it
holds. ``Routes`` runs them on every request; ``bodies`` runs ``precheck`` in its child
process on a large body as soon as it is validated, so that a body the model could never
serve (280,000 chat messages, a million token ids) is refused there, and the server's own
process never builds, walks or templates it (work that would hold the GIL for as long).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from phasewise.engine.validation import ValidationError, check_context, check_sequences
from phasewise.server.errors import ApiError
from phasewise.server.protocol import COMBINATION, CONTEXT


@dataclass(frozen=True)
class Limits:
    """What the served model takes: its context, the characters a prompt of that context can
    hold in any tokenization, and the sequences that may wait."""

    max_model_len: int
    max_prompt_chars: int
    max_waiting: int


def check_chars(n_chars: int, param: str, limits: Limits, label: str | None = None) -> None:
    """Refuse, before tokenizing, a text too long to fit the context in any tokenization
    (``label``: what the message calls it, default the field ``param``)."""
    if n_chars > limits.max_prompt_chars:
        raise ApiError(400, f"{label or param} has {n_chars} characters; this model's context of "
                       f"{limits.max_model_len} tokens cannot hold more than about "
                       f"{limits.max_prompt_chars} characters, so it was not tokenized",
                       param=param, code=CONTEXT)


def check_free_form(body: Any, limits: Limits) -> None:
    """Refuse a chat request's ``tools`` or ``chat_template_kwargs`` whose JSON is longer than
    any prompt of this model's context: whatever ``tool_choice`` says, a definition that
    large could never be rendered into a prompt, and only building and walking it would be
    left (work that holds the GIL)."""
    for param, value in (("tools", body.tool_dicts if body.tools else None),
                         ("chat_template_kwargs", body.chat_template_kwargs)):
        if not value:
            continue
        n = len(json.dumps(value, ensure_ascii=False, default=str))
        if n > limits.max_prompt_chars:
            raise ApiError(400, f"{param} holds {n} characters of JSON; this model's context "
                           f"of {limits.max_model_len} tokens cannot hold more than about "
                           f"{limits.max_prompt_chars} characters of a prompt, so they were "
                           "not rendered", param=param, code=CONTEXT)


def check_messages(count: int, param: str, limits: Limits) -> None:
    """Refuse a conversation of more messages than the context has tokens (a chat template
    gives each message at least one)."""
    if count > limits.max_model_len:
        raise ApiError(400, f"{param} holds {count} messages; this model's context of "
                       f"{limits.max_model_len} tokens cannot hold them (each takes at least "
                       "one token of the chat template), so they were not rendered",
                       param=param, code=CONTEXT)


def check_sequence_count(num_prompts: int, n: int, limits: Limits) -> None:
    """A request may not ask for more sequences than may wait."""
    try:
        check_sequences(num_prompts, n, limits.max_waiting)
    except ValidationError as e:
        raise ApiError(400, str(e), param=e.param, code=COMBINATION) from e


def check_budget(n_prompt: int, max_tokens: int | None, param: str, limit_param: str,
                 limits: Limits, min_max_tokens: int = 1, label: str | None = None) -> int:
    """The request's effective ``max_tokens`` (``check_context``), or a 400 naming a field
    (``label``: what the message calls the prompt, default the field)."""
    try:
        return check_context(n_prompt, max_tokens, limits.max_model_len,
                             prompt_param=param, max_tokens_param=limit_param,
                             min_max_tokens=min_max_tokens, prompt_label=label)
    except ValidationError as e:
        raise ApiError(400, str(e), param=e.param, code=CONTEXT) from e


def _text_of(content: Any) -> int:
    """Characters of a message's content: a string, or text parts (others count 0 here; the
    route refuses them)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text", "")) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def precheck(name: str, body: Any, limits: Limits) -> None:
    """The checks above that a validated body of type ``name`` can be put to before it is
    tokenized: each a lower bound of what the route checks, so nothing the route would serve
    is refused here, and what is refused gets the route's own error."""
    if name == "CompletionRequest":
        prompts = body.prompt_list()
        check_sequence_count(len(prompts), body.n, limits)
        for i, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                check_chars(len(p), param, limits)
            else:  # (the default max_tokens is capped at the room left: the route's rule)
                sent = body.max_tokens if "max_tokens" in body.model_fields_set else None
                check_budget(len(p), sent, param, "max_tokens", limits, min_max_tokens=0)
    elif name in ("ChatCompletionRequest", "TokenizeRequest"):
        messages = getattr(body, "messages", None)
        if name == "ChatCompletionRequest":
            check_sequence_count(1, body.n, limits)
            check_free_form(body, limits)
        if messages is not None:
            check_messages(len(messages), "messages", limits)
            if name == "ChatCompletionRequest":
                check_chars(sum(_text_of(m.content) for m in messages), "messages", limits)
    elif name == "ResponsesRequest":
        if isinstance(body.input, str):
            check_chars(len(body.input), "input", limits)
        else:
            check_messages(len(body.input), "input", limits)
    elif name == "RelayRequest":
        check_sequence_count(len(body.specs), 1, limits)
        for i, s in enumerate(body.specs):
            if s.token_ids is not None and len(s.token_ids) >= limits.max_model_len:
                check_budget(len(s.token_ids), None, f"specs.{i}.token_ids",
                             f"specs.{i}.params.max_tokens", limits, min_max_tokens=0)
