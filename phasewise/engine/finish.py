"""When a request stops: every finish rule, in the order it is applied. Torch-free.

After each sampled token (the scheduler calls ``token_finish`` with the token already
appended), the first rule that holds ends the request:

1. ``min_tokens``: the first ``min_tokens`` outputs cannot end it by token or stop string.
   The sampler masks the stop token ids and (unless ``ignore_eos``) the EOS ids for them
   (``masked_tokens``); rules 2, 3 and 6 skip them (a stop string one of them completed is
   not looked for again, as vLLM's ``min_tokens`` does).
2. ``stop_token_ids``: the token is one of them -> ``stop``, ``stop_reason`` = the token.
3. EOS: the token is one of the model's EOS ids and ``ignore_eos`` is off -> ``stop``,
   ``stop_reason`` None.
4. ``max_tokens``: the request has that many outputs -> ``length``.
5. context length: prompt plus outputs reach the scheduler's ``max_len`` (``max_model_len``,
   or less when the whole KV pool holds fewer tokens) -> ``length``.
6. stop strings: the engine appends the token's text (``output_processor.TextState``) and
   looks for a stop string that the new text completed (``find_stop_string``; found across
   token boundaries) -> ``stop``, ``stop_reason`` = the string, the text cut before it (or
   after it with ``include_stop_str_in_output``). A token that ended the request under rule
   2 or 3 adds no text (unless ``include_stop_str_in_output``); one that ended it under 4 or
   5 does, and a stop string it completes still cuts the text, but the finish reason stays
   ``length``.
"""

from __future__ import annotations

from collections.abc import Sequence

from phasewise.engine.request import RequestStatus
from phasewise.engine.sampling_params import SamplingParams


def masked_tokens(params: SamplingParams, eos_token_ids: Sequence[int],
                  num_output_tokens: int) -> set[int]:
    """Token ids the sampler must not draw for the next output (rule 1): the stop token ids
    and EOS ids while fewer than ``min_tokens`` outputs exist, else none."""
    if num_output_tokens >= params.min_tokens:
        return set()
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return ids


def token_finish(params: SamplingParams, eos_token_ids: Sequence[int], token: int,
                 num_output_tokens: int, num_tokens: int, max_len: int
                 ) -> tuple[RequestStatus, int | None] | None:
    """Rules 1-5 for the token just appended: ``(status, stop_reason)``, or None to go on.

    ``num_output_tokens`` and ``num_tokens`` (prompt + outputs) count ``token`` already."""
    if num_output_tokens > params.min_tokens:
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if not params.ignore_eos and token in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def find_stop_string(text: str, search_from: int, stops: Sequence[str],
                     ends_after: int = 0) -> tuple[int, str] | None:
    """Rule 6: the earliest stop string in ``text`` that starts at or after ``search_from``
    and ends after ``ends_after`` (text that ``min_tokens`` held no stop in), as
    ``(position, string)``; ties at one position go to the string listed first."""
    hit: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(search_from, ends_after - len(s) + 1))
        if pos != -1 and (hit is None or pos < hit[0]):
            hit = (pos, s)
    return hit
