"""OpenAI response shapes: usage, finish reasons, logprobs, and the choices of completions
and chat completions, streamed (a delta) or whole. Pure functions of engine outputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phasewise.engine.outputs import RequestOutput
from phasewise.server.jsontext import Joined, Shared


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; with ``cached_tokens`` (the prompt tokens the prefix cache served),
    ``prompt_tokens_details.cached_tokens`` too."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": min(cached_tokens, prompt_tokens)}
    return out


def cached_prompt_tokens(cached: list[int], n: int) -> int:
    """The prompt tokens the prefix cache served, counted as ``prompt_tokens`` counts the
    prompt: once per prompt however many samples it has. ``cached``: each request's
    ``metrics.num_cached_tokens``, the ``n`` samples of a prompt next to each other; a
    prompt counts what its samples had in common from before this request (the fewest: its
    later samples may hit blocks the first one just wrote)."""
    n = max(1, n)
    return sum(min(cached[i:i + n]) for i in range(0, len(cached), n))


def finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def stop_reason(out: RequestOutput) -> dict[str, Any]:
    """vLLM's ``stop_reason`` on a finished choice: the stop string or stop token id that
    ended it (None: EOS, a length, or an abort); nothing on an unfinished chunk."""
    return {"stop_reason": out.stop_reason} if out.finished else {}


def timing(index: int, out: RequestOutput) -> dict[str, Any]:
    """The engine's own split of a finished request's time (phasewise's extension, sent on the
    final usage chunk as ``timings``; other clients ignore it).

    ``queue_s`` (arrival to first scheduled), ``prefill_s`` (to the first token) and
    ``decode_s`` (first to last token). A prompt a prefill worker computed (the decode role)
    splits its prefill further: ``remote_prefill_s`` (request sent to the first K/V frame),
    ``kv_transfer_s`` (first frame to the first token back), ``first_step_s`` (first token
    back to its emission here), with ``kv_bytes`` and ``kv_frames``. Behind a router the
    entry is the worker's, with the router's own ``router_ttft_s``."""
    m = out.metrics
    if m.worker_timing is not None:
        return {**m.worker_timing, "index": index, "router_ttft_s": m.ttft}
    queue = prefill = decode = None
    if m.first_scheduled_time is not None:
        queue = m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            prefill = m.first_token_time - m.first_scheduled_time
            decode = m.token_times[-1] - m.first_token_time
    entry = {"index": index, "queue_s": queue, "prefill_s": prefill, "decode_s": decode,
             "cached_tokens": m.num_cached_tokens, "preemptions": m.num_preemptions}
    r = m.remote
    if r is not None:
        landed = r.first_kv if r.first_kv is not None else r.done
        entry.update(remote_prefill_s=landed - r.sent, kv_transfer_s=r.done - landed,
                     first_step_s=(None if m.first_token_time is None
                                   else max(0.0, m.first_token_time - r.done)),
                     kv_bytes=r.kv_bytes, kv_frames=r.kv_frames)
    return entry


TokenText = Callable[[int], str]


def completion_logprobs(token_text: TokenText, token_ids: list[int],
                        entries: list[dict[int, float] | None], offsets: list[int],
                        top_n: int | None = None) -> dict[str, Any]:
    """The legacy layout, each token at its ``text_offset`` in ``offsets`` (``text_offsets``).
    An entry of None (an echoed prompt's first token) is a null logprob and null top entries;
    ``top_n`` keeps that many of an entry's others (an entry may carry more, when
    prompt_logprobs asked for more than logprobs)."""
    tokens, lps, tops = [], [], []
    for tok, entry in zip(token_ids, entries):
        tokens.append(token_text(tok))
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(entry.get(tok))
        ranked = sorted(((lp, t) for t, lp in entry.items()), reverse=True)
        if top_n is not None and len(ranked) > top_n:
            ranked = [(lp, t) for i, (lp, t) in enumerate(ranked) if i < top_n or t == tok]
        # The top-N and the sampled token (OpenAI: "up to logprobs + 1" entries).
        tops.append({token_text(t): lp for lp, t in ranked})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": list(offsets)}


Decode = Callable[[list[int]], str]
# UTF-8 holds a character in at most 4 bytes: byte tokens pending longer are not one
MAX_CHAR_TOKENS = 4


def text_offsets(token_text: TokenText, decode: Decode, token_ids: list[int], pos: int,
                 pending: list[int] | None = None,
                 hidden: frozenset[int] = frozenset()) -> tuple[list[int], int, list[int]]:
    """Each token's ``text_offset``: where its characters begin in the text. A token that
    decodes alone to part of a character (a byte token: U+FFFD) waits for the tokens that
    complete it, and each of them is at that character's start (counting each token's own
    text would give every byte of an emoji a character, and shift every later offset). A
    token's offset depends only on the tokens up to it, never revised by later ones, so a
    stream's chunks give the offsets a whole reply gives. ``pending``: tokens of a character
    an earlier call left incomplete; ``hidden``: tokens the text leaves out (special tokens
    under ``skip_special_tokens``), which take no room. Returns the offsets, the position
    after the complete characters, and the tokens still pending."""
    offsets: list[int] = []
    pend = list(pending or ())
    for tok in token_ids:
        if tok in hidden:
            offsets.append(pos)
            continue
        pend.append(tok)
        text = token_text(tok) if len(pend) == 1 else decode(pend)
        if text.endswith("\ufffd"):
            split = 0
            if len(text) > 1 and len(pend) > 1:
                # complete characters (stray bytes) before the one still incomplete: past
                # them, so that the cap counts from where that character starts (the
                # longest such prefix: a lead byte alone decodes as one too)
                split = next((i for i in range(len(pend) - 1, 0, -1)
                              if decode(pend[:i]) == text[:-1]), 0)
                if split:
                    pos += len(text) - 1
                    pend = pend[split:]
            if split or len(pend) < MAX_CHAR_TOKENS:
                offsets.append(pos)
                continue
            # as many bytes as a character has, and still none: stray, taken as they are
        # complete: this token stands where the text stops agreeing with what the tokens
        # before it decode to (the character's start, or past a stray byte before it)
        head = decode(pend[:-1]) if len(pend) > 1 else ""
        offsets.append(pos + next((i for i, (a, b) in enumerate(zip(head, text)) if a != b),
                                  min(len(head), len(text))))
        pos += len(text)
        pend = []
    return offsets, pos, pend


def _shared(built: Any) -> Any:
    """What ``CompletionChoices._once`` built, its lists marked ``Shared`` (its samples'
    chunks hold the same ones: jsontext writes them once per reply)."""
    if isinstance(built, list):
        return Shared(built)
    if isinstance(built, dict):
        return {k: Shared(v) if isinstance(v, list) else v for k, v in built.items()}
    return built


def _joined(head: dict[str, Any] | None, tail: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two legacy logprobs layouts one after the other (an echoed prompt's, then the
    completion's); either may be None."""
    if head is None or tail is None:
        return tail if head is None else head
    # (the head's lists are shared by a prompt's samples: jsontext writes them once)
    return {k: Joined(head[k], tail[k]) for k in head}


def vllm_prompt_logprobs(token_text: TokenText, entries: list[dict[int, float] | None],
                         top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt position, null for the first, else
    {token id: {"logprob", "decoded_token"}} for the prompt token and the top ``top_n``."""
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        items = list(entry.items())
        own, rest = items[:1], sorted(items[1:], key=lambda kv: -kv[1])[:top_n]
        out.append({str(t): {"logprob": lp, "decoded_token": token_text(t)}
                    for t, lp in own + rest})
    return out


def chat_logprobs(token_text: TokenText, token_ids: list[int],
                  entries: list[dict[int, float]], top_n: int) -> dict[str, Any]:
    content = []
    for tok, entry in zip(token_ids, entries):
        text = token_text(tok)
        ranked = sorted(((lp, t) for t, lp in entry.items()), reverse=True)[:top_n]
        content.append({
            "token": text, "logprob": entry.get(tok), "bytes": list(text.encode()),
            "top_logprobs": [{"token": token_text(t), "logprob": lp,
                              "bytes": list(token_text(t).encode())} for lp, t in ranked]})
    return {"content": content}


class CompletionChoices:
    """Choices of ``/v1/completions``: ``text`` and the legacy logprobs layout. With
    ``echo``, each choice starts with its prompt (``prompt_texts``, one per choice) and, with
    logprobs, the prompt tokens' entries; ``prompt_logprobs`` adds vLLM's per-choice field."""

    stream_object = "text_completion"
    object = "text_completion"

    def __init__(self, token_text: TokenText, decode: Decode, num_choices: int,
                 logprobs: int | None, *, echo: bool = False,
                 prompt_texts: list[str] | None = None, prompt_logprobs: int | None = None,
                 special_ids: frozenset[int] = frozenset(),
                 hidden: frozenset[int] = frozenset()) -> None:
        self.token_text = token_text
        self.decode = decode  # several tokens' text at once: offsets over byte tokens
        self.hidden = hidden  # output tokens the text leaves out (skip_special_tokens)
        self.pending: list[list[int]] = [[] for _ in range(num_choices)]
        self.special_ids = special_ids
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_texts = prompt_texts or [""] * num_choices
        self.prompt_logprobs = prompt_logprobs
        self.offsets = [0] * num_choices  # characters sent so far, per choice
        self.started = [False] * num_choices
        # A prompt's entries built once for all its samples, which share its prompt logprobs
        # (one list: sse.SharedPromptLogprobs): id -> (that list, what was built of it)
        self._built: dict[tuple[int, str, str], tuple[Any, Any]] = {}

    def _once(self, entries: Any, kind: str, head: str, build: Callable[[], Any]) -> Any:
        """``build()``, made once per prompt logprobs list (and echoed head)."""
        if entries is None:
            return build()
        key = (id(entries), kind, head)
        got = self._built.get(key)
        if got is None or got[0] is not entries:
            got = self._built[key] = (entries, _shared(build()))
        return got[1]

    def _echoed(self, idx: int, out: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text and (with logprobs) its tokens' entries, from offset 0. Each
        ``text_offset`` points into the echoed text: a special token the tokenizer added
        (a BOS before a text prompt) has no text there, so it takes none."""
        head = self.prompt_texts[idx]
        return head, self._once(out.prompt_logprobs, "echo", head,
                                lambda: self._echo_entries(head, out))

    def _echo_entries(self, head: str, out: RequestOutput) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        ids = out.prompt_token_ids
        pos, offsets, pending = 0, [], []
        for tok in ids:
            if tok in self.special_ids and not head.startswith(self.token_text(tok), pos):
                offsets.append(pos)
                continue
            (off,), pos, pending = text_offsets(self.token_text, self.decode, [tok], pos,
                                                pending)
            offsets.append(off)
        return completion_logprobs(self.token_text, ids, out.prompt_logprobs or [None] * len(ids),
                                   offsets, self.logprobs)

    def _extra(self, out: RequestOutput) -> dict[str, Any]:
        if self.prompt_logprobs is None:
            return {}
        top = self.prompt_logprobs
        return {"prompt_logprobs": self._once(out.prompt_logprobs, "vllm", "", lambda: (
            vllm_prompt_logprobs(self.token_text, out.prompt_logprobs or [], top)))}

    def delta(self, idx: int, out: RequestOutput) -> list[tuple[dict[str, Any], bool]]:
        first = not self.started[idx]
        self.started[idx] = True
        text, lp, extra = out.delta_text, None, {}
        head_lp = None
        if first:
            extra = self._extra(out)
            if self.echo:
                head, head_lp = self._echoed(idx, out)
                text = head + text
                if head_lp is not None:
                    self.offsets[idx] = len(head)
        if self.logprobs is not None and out.delta_token_ids:
            k = len(out.delta_token_ids)
            # Offsets follow the tokens' texts, as in the whole reply (the text itself may
            # lag: a stop string holds characters back, a split character waits).
            offsets, self.offsets[idx], self.pending[idx] = text_offsets(
                self.token_text, self.decode, out.delta_token_ids, self.offsets[idx],
                self.pending[idx], self.hidden)
            lp = completion_logprobs(self.token_text, out.delta_token_ids,
                                     (out.logprobs or [])[-k:], offsets)
        lp = _joined(head_lp, lp)
        if not (text or lp or out.finished or extra):
            return []  # bytes of an unfinished character: nothing to show
        return [({"index": idx, "text": text, "logprobs": lp,
                  "finish_reason": finish_reason(out), **stop_reason(out), **extra}, True)]

    def whole(self, idx: int, out: RequestOutput) -> dict[str, Any]:
        text, lp = out.text, None
        head, head_lp = self._echoed(idx, out) if self.echo else ("", None)
        if self.logprobs is not None:
            offsets = text_offsets(self.token_text, self.decode, out.token_ids, len(head),
                                   hidden=self.hidden)[0]
            lp = _joined(head_lp, completion_logprobs(self.token_text, out.token_ids,
                                                      out.logprobs or [], offsets))
        return {"index": idx, "text": head + text, "logprobs": lp,
                "finish_reason": finish_reason(out), **stop_reason(out), **self._extra(out)}


class ChatChoices:
    """Choices of ``/v1/chat/completions``: the assistant's message (streamed: the role
    first, then content deltas) and the chat logprobs layout."""

    stream_object = "chat.completion.chunk"
    object = "chat.completion"

    def __init__(self, token_text: TokenText, num_choices: int, top_n: int | None) -> None:
        self.token_text = token_text
        self.top_n = top_n
        self.started = [False] * num_choices

    def delta(self, idx: int, out: RequestOutput) -> list[tuple[dict[str, Any], bool]]:
        chunks: list[tuple[dict[str, Any], bool]] = []
        if not self.started[idx]:  # the role first, as OpenAI streams it
            self.started[idx] = True
            chunks.append(({"index": idx, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}, False))
        lp = None
        if self.top_n is not None and out.delta_token_ids:
            k = len(out.delta_token_ids)
            lp = chat_logprobs(self.token_text, out.delta_token_ids,
                               (out.logprobs or [])[-k:], self.top_n)
        if out.delta_text or lp or out.finished:
            delta = {"content": out.delta_text} if out.delta_text else {}
            chunks.append(({"index": idx, "delta": delta, "logprobs": lp,
                            "finish_reason": finish_reason(out), **stop_reason(out)}, True))
        return chunks

    def whole(self, idx: int, out: RequestOutput) -> dict[str, Any]:
        lp = None
        if self.top_n is not None:
            lp = chat_logprobs(self.token_text, out.token_ids, out.logprobs or [], self.top_n)
        return {"index": idx, "message": {"role": "assistant", "content": out.text},
                "logprobs": lp, "finish_reason": finish_reason(out), **stop_reason(out)}
