"""Tools (function calling) on ``/v1/chat/completions``: rendering the tools into the prompt,
constraining the output for ``tool_choice`` ``required`` or a named function, and parsing
tool calls out of the output into OpenAI's ``tool_calls`` (whole, or streamed as deltas).

- The checkpoint's chat template renders the tools when it knows how (it reads a ``tools``
  variable, as Qwen's, Llama 3's, Mistral's and Hermes' templates do). A template that never
  mentions ``tools`` gets them as a system message instead (``tools_message``), which asks
  for calls in the Hermes form below.
- ``auto``: the model may answer, or call tools in the Hermes form used by Qwen 2.5/3 and
  Hermes models, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per
  call); the blocks become ``tool_calls``, the text outside them the message's ``content``.
- ``required``: the output is constrained (structured output) to a JSON array of 1 or more
  calls, ``[{"name": <one of the tools>, "arguments": <its parameters' schema>}]`` (at most
  16, or 1 with ``parallel_tool_calls: false``), so the calls always parse.
- a named function: the output is constrained to that function's parameters schema; it is the
  call's ``arguments``.
- ``max_tokens`` cutting a forced call (``required`` or named) short: the call still comes
  back as a call, with finish reason ``length`` and the arguments' JSON text as far as it got
  (as OpenAI returns it), never as ``content``: a client loop must not take it for a final
  answer. Under ``required``, every call whose name is known (written whole, begun and
  matching one tool only, or the only tool there is) comes back; a call cut before its name
  can be told is left out, and the text is the content only when no call can be told at all.
- ``none``: the tools are neither rendered nor parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from typing import Any

from phasewise.engine.outputs import RequestOutput
from phasewise.server.openai_format import (ChatChoices, TokenText, chat_logprobs, finish_reason,
                                           stop_reason)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_PARALLEL_CALLS = 16  # calls in one reply under tool_choice required


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (any object when it gives none)."""
    return tool["function"].get("parameters") or ANY_OBJECT


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def tools_message(tools: list[dict[str, Any]]) -> str:
    """The tools as a system message, for a chat template that does not render them."""
    specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You may call the functions below. To call one, reply with "
            f'{OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CLOSE}, one '
            f"block per call.\nFunctions:\n{specs}")


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """What ``tool_choice: "required"`` constrains the output to."""
    one_of = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]}, "arguments": parameters(t)},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
            "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of}}


def _arguments(value: Any) -> str:
    """A call's ``arguments`` as OpenAI's API gives them: JSON text. A string the model wrote
    there is kept where it is a JSON object or array already, else encoded as a JSON string
    (a client parses every ``arguments`` with a strict JSON parser, and "5" is no number)."""
    if isinstance(value, str):
        try:  # kept only as a JSON object or array (strict: no NaN), what arguments are
            if isinstance(json.loads(value, parse_constant=_no_constant), (dict, list)):
                return value
        except (ValueError, RecursionError):
            pass
    return json.dumps(value, ensure_ascii=False)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_name(value: Any, names: Collection[str]) -> bool:
    """Whether ``value`` (a call's ``name`` as the model wrote it) names one of ``names``: a
    list or an object there names nothing (and cannot be looked up in a set)."""
    return isinstance(value, str) and value in names


def split_hermes(text: str, names: set[str]) -> tuple[str, list[dict[str, str]]]:
    """(the text outside the calls, calls) of an ``auto`` output: each ``<tool_call>`` block
    that holds a JSON object naming one of ``names`` is a call; a block that does not parse
    stays in the text. One pass over the text (a marker without its end ends the scan)."""
    calls, kept, pos, at = [], [], 0, 0
    while True:
        start = text.find(OPEN, at)
        if start == -1:
            break
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            break
        at = end + len(CLOSE)
        try:
            obj = json.loads(text[start + len(OPEN):end])
        except (ValueError, RecursionError):
            continue
        if not (isinstance(obj, dict) and _is_name(obj.get("name"), names)):
            continue
        kept.append(text[pos:start])
        pos = at
        calls.append({"name": obj["name"], "arguments": _arguments(obj.get("arguments", {}))})
    kept.append(text[pos:])
    return "".join(kept), calls


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[dict[str, str]]]:
    """(content, calls): ``split_hermes``'s text as a stream sends it (its leading
    whitespace kept; with calls, its trailing whitespace dropped), None when empty, so a
    whole reply's content is its stream's."""
    rest, calls = split_hermes(text, names)
    content = rest.rstrip() if calls else rest
    return (content or None), calls


def parse_required(text: str) -> list[dict[str, str]] | None:
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list):
        return None
    return [{"name": i["name"], "arguments": _arguments(i.get("arguments", {}))}
            for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)]


def _members(text: str, start: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The members of the JSON object that opens at ``text[start]`` (``{``), which may be
    cut short: ([(key, value start, value end or None when cut)], the index after its
    ``}`` or None when cut). One pass; a key cut short is left out."""
    members: list[tuple[str, int, int | None]] = []
    depth, i, n = 0, start, len(text)
    key: str | None = None
    key_start: int | None = None
    value_start: int | None = None
    in_string = escaped = False
    while i < n:
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and key_start is not None:  # a key of this object ends
                    try:
                        key = json.loads(text[key_start:i + 1])
                    except ValueError:
                        key = None
                    key_start = None
        elif c == '"':
            in_string = True
            if depth == 1 and value_start is None:
                key_start = i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                if key is not None and value_start is not None:
                    members.append((key, value_start, i))
                return members, i + 1
        elif depth == 1 and c == ":" and key is not None:
            value_start = i + 1
        elif depth == 1 and c == "," and value_start is not None:
            if key is not None:
                members.append((key, value_start, i))
            key = value_start = None
        i += 1
    if key is not None and value_start is not None:
        members.append((key, value_start, None))
    return members, None


def _name_of(value: str, cut: bool, names: list[str]) -> str | None:
    """A call's function name from its (maybe cut) JSON string: whole, or the one tool
    whose name begins with what was written."""
    value = value.strip()
    try:
        name = json.loads(value)
    except ValueError:
        name = None
    if isinstance(name, str) or not cut:
        return name if name in names else None
    begun = [x for x in names if x.startswith(value.removeprefix('"'))]
    return begun[0] if len(begun) == 1 else None


def truncated_calls(text: str, names: list[str]) -> list[dict[str, str]]:
    """The calls of a ``required`` output that ``max_tokens`` cut short (a prefix of a JSON
    array of ``{"name", "arguments"}`` objects, in any key order): each call whose name is
    known, with its arguments' JSON text as far as it got. One pass over the text."""
    calls: list[dict[str, str]] = []
    pos = text.find("[")
    if pos == -1:
        return calls
    pos += 1
    while pos < len(text):
        start = text.find("{", pos)
        if start == -1:
            break
        members, end = _members(text, start)
        found = {k: (text[a:b] if b is not None else text[a:], b is None)
                 for k, a, b in members}
        name = None
        if "name" in found:
            name = _name_of(found["name"][0], found["name"][1], names)
        elif end is None and len(names) == 1:  # its name is still to come: the only tool
            name = names[0]
        if name is not None:
            args = found.get("arguments", ("", True))[0].strip()
            calls.append({"name": name, "arguments": args})
        if end is None:
            break
        pos = end
    return calls


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` could begin a ``<tool_call>`` marker."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolChatChoices(ChatChoices):
    """Chat choices of a request with tools: ``mode`` is ``auto``, ``required`` or
    ``named`` (``function``: its name). Streams content (``auto``, until a tool-call marker
    begins) and, once the output is finished, each call as OpenAI streams them: a delta with
    its index, id, type and name (empty arguments), then one with its arguments."""

    def __init__(self, token_text: TokenText, num_choices: int, top_n: int | None, *,
                 mode: str, names: set[str], function: str | None = None) -> None:
        super().__init__(token_text, num_choices, top_n)
        self.mode = mode
        self.names = names
        self.function = function
        self.sent = [0] * num_choices  # content characters streamed, per choice
        # logprobs of tokens whose text is held back (a call may be starting): they go out
        # with the next chunk that carries text, or with the last, so a stream's logprobs
        # are the whole reply's, in order
        self.pending: list[list[dict[str, Any]]] = [[] for _ in range(num_choices)]

    def _calls(self, out: RequestOutput) -> tuple[str | None, list[dict[str, str]] | None]:
        """(content, calls) of a finished output; calls None when there are none."""
        text = out.text
        if self.mode == "auto":
            content, calls = parse_hermes(text, self.names)
            return content, calls or None
        if out.finish_reason == "length":  # cut short: the calls as far as they got
            if self.mode == "named":
                return None, [{"name": self.function, "arguments": text}]
            calls = truncated_calls(text, sorted(self.names))
            return (None, calls) if calls else (text or None, None)
        if self.mode == "named":
            try:  # a stop string can cut the constrained arguments short
                json.loads(text)
            except (ValueError, RecursionError):
                return text or None, None
            return None, [{"name": self.function, "arguments": text}]
        calls = parse_required(text)
        return (None, calls) if calls else (text or None, None)

    @staticmethod
    def _finish(out: RequestOutput, calls: list[dict[str, str]] | None) -> str | None:
        reason = finish_reason(out)
        return "tool_calls" if calls and reason == "stop" else reason

    def delta(self, idx: int, out: RequestOutput) -> list[tuple[dict[str, Any], bool]]:
        def chunk(delta: dict[str, Any], counted: bool, finish: str | None = None,
                  logprobs: bool = False) -> tuple[dict[str, Any], bool]:
            lp = None
            if logprobs and self.pending[idx]:
                lp, self.pending[idx] = {"content": self.pending[idx]}, []
            return ({"index": idx, "delta": delta, "logprobs": lp,
                     "finish_reason": finish}, counted)

        chunks: list[tuple[dict[str, Any], bool]] = []
        if not self.started[idx]:
            self.started[idx] = True
            chunks.append(chunk({"role": "assistant", "content": ""}, False))
        if self.top_n is not None and out.delta_token_ids:
            k = len(out.delta_token_ids)
            self.pending[idx] += chat_logprobs(self.token_text, out.delta_token_ids,
                                               (out.logprobs or [])[-k:], self.top_n)["content"]
        if not out.finished:  # content streams (auto) until a tool call may begin
            if self.mode == "auto":
                text = out.text
                cut = text.find(OPEN)
                safe = cut if cut != -1 else len(text) - _held_back(text)
                # trailing whitespace waits too: before a call it is dropped, so what
                # streams never depends on where a delta happened to end
                safe = len(text[:safe].rstrip())
                if safe > self.sent[idx]:
                    chunks.append(chunk({"content": text[self.sent[idx]:safe]}, True,
                                        logprobs=True))
                    self.sent[idx] = safe
            return chunks
        if self.mode == "auto":  # the text outside the calls not streamed yet
            outside, found = split_hermes(out.text, self.names)
            calls = found or None
            rest = outside[self.sent[idx]:]  # (it starts with what was streamed)
            rest = rest.rstrip() if calls else rest
        else:
            content, calls = self._calls(out)
            rest = content or ""
        if rest:
            chunks.append(chunk({"content": rest}, False, logprobs=True))
        for k, call in enumerate(calls or []):
            chunks.append(chunk({"tool_calls": [{
                "index": k, "id": call_id(), "type": "function",
                "function": {"name": call["name"], "arguments": ""}}]}, False))
            chunks.append(chunk({"tool_calls": [{
                "index": k, "function": {"arguments": call["arguments"]}}]}, False))
        last = chunk({}, True, self._finish(out, calls), logprobs=True)
        last[0].update(stop_reason(out))
        chunks.append(last)
        return chunks

    def whole(self, idx: int, out: RequestOutput) -> dict[str, Any]:
        choice = super().whole(idx, out)
        content, calls = self._calls(out)
        choice["message"]["content"] = content
        if calls:
            choice["message"]["tool_calls"] = [
                {"id": call_id(), "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        choice["finish_reason"] = self._finish(out, calls)
        return choice
