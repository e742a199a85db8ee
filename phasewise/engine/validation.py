"""Input checks shared by the engine and the server: the context length and token ids.

Torch-free and free of server imports, so the HTTP layer, the engine and the scheduler can all
raise the same errors with the same words. A ``ValidationError`` is a ``ValueError`` that says
which request field is at fault (``.param``), so the server can put it in its 400 reply.

The context rule: a request's prompt and outputs share ``max_model_len`` positions, and the
context must hold at least one output token, so a prompt has at most ``max_model_len - 1``
tokens and at most ``max_model_len - num_prompt_tokens`` outputs can follow it.
"""

from __future__ import annotations

from collections.abc import Iterable


class ValidationError(ValueError):
    """A request the engine can never serve. ``param`` names the field at fault
    (e.g. ``"prompt"``, ``"max_tokens"``), or is None when no single field is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *,
                  prompt_param: str = "prompt", max_tokens_param: str = "max_tokens",
                  min_max_tokens: int = 1, prompt_label: str | None = None) -> int:
    """The effective ``max_tokens`` of a request: ``max_tokens`` itself, or, when it is None,
    all the room the context leaves after the prompt.

    Raises ``ValidationError`` (``param=prompt_param``) for an empty prompt or one that leaves
    no room for an output token, and (``param=max_tokens_param``) for ``max_tokens`` below
    ``min_max_tokens`` (1; 0 where a request may only prefill) or beyond that room.
    ``prompt_label``: what the messages call the prompt (default ``prompt_param``).
    """
    n, limit = num_prompt_tokens, max_model_len
    what = prompt_label or prompt_param
    if n < 1:
        raise ValidationError(f"{prompt_param} is empty; it needs at least one token",
                              prompt_param)
    if n > limit:
        raise ValidationError(
            f"{what} has {n} tokens, more than max_model_len ({limit}); a prompt may "
            f"have at most {limit - 1} tokens, leaving room for one output token",
            prompt_param)
    if n == limit:
        raise ValidationError(
            f"{what} has {n} tokens, as many as max_model_len ({limit}); the context "
            f"must also hold at least one output token, so a prompt may have at most "
            f"{limit - 1} tokens", prompt_param)
    room = limit - n
    if max_tokens is None:
        return room
    if max_tokens < min_max_tokens:
        raise ValidationError(f"{max_tokens_param} must be an integer >= {min_max_tokens}, "
                              f"got {max_tokens}", max_tokens_param)
    if max_tokens > room:
        raise ValidationError(
            f"{max_tokens_param} is {max_tokens}, but max_model_len is {limit} tokens and "
            f"{'the prompt' if prompt_label is None else prompt_label} uses {n}: at most "
            f"{room} tokens can be generated", max_tokens_param)
    return max_tokens


def check_sequences(num_prompts: int, n: int, max_waiting: int | None) -> None:
    """A request may not ask for more sequences (prompts x n) than may ever wait at once:
    retrying could never help, so it is a ``ValidationError`` (``param`` ``n`` when n > 1,
    else ``prompt``), not an overload."""
    count = num_prompts * n
    if max_waiting is not None and count > max_waiting:
        raise ValidationError(
            f"this request asks for {count} sequences ({num_prompts} prompt(s) x n={n}), more "
            f"than the {max_waiting} that may wait at once; split it",
            "n" if n > 1 else "prompt")


_CHECK_SLICE = 65536


def is_count(v: object, most: int = 2**62) -> bool:
    """Whether ``v`` is a whole number in [0, ``most``] as JSON decodes one (a bool is not):
    a count, an index or a token id another process sent."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= most


def check_token_ids(ids: Iterable[object], vocab_size: int, param: str = "prompt") -> list[int]:
    """The ids as a list, after checking each is an integer in ``[0, vocab_size)`` and that
    there is at least one. Raises ``ValidationError`` with ``param``."""
    out = list(ids)
    if not out:
        raise ValidationError(f"{param} is empty; it needs at least one token id", param)
    # The common case is checked in C a slice at a time (a Python loop over a million ids
    # holds the GIL, which the engine's thread shares, ~4x longer; one C pass over them
    # would hold it at once for as long); the loop below names the first bad id.
    for i in range(0, len(out), _CHECK_SLICE):
        part = out[i:i + _CHECK_SLICE]
        if not (set(map(type, part)) == {int} and min(part) >= 0
                and max(part) < vocab_size):
            break
    else:
        return out  # type: ignore[return-value]
    for t in out:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValidationError(
                f"{param} must hold token ids: integers in [0, {vocab_size}); got {t!r}", param)
    return out  # type: ignore[return-value]
