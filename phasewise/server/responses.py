"""``POST /v1/responses``: OpenAI's Responses API over the same engine path as chat.

What it takes: ``input`` (a string, or a list of messages: ``role`` system / developer / user /
assistant, ``content`` a string or ``input_text`` / ``output_text`` parts), ``instructions``
(a system message first), ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``,
``text.format`` (``text``, ``json_object``, ``json_schema``: structured output), ``store``
(nothing is stored either way), ``metadata`` (echoed), ``user``, and phasewise's sampling
extras (``seed``, ``top_k``, ``min_p``, ``stop``, penalties, ``ignore_eos``...). What it
refuses with a 400 naming the field: ``previous_response_id`` and ``conversation`` (no
response is stored), ``tools`` (use chat completions), ``background``, ``reasoning``,
``prompt`` (stored prompts), ``include``, ``top_logprobs``, and input items other than
messages with text (images, files, function calls and their outputs).

A streamed response sends OpenAI's events, each ``event: <type>`` and ``data: <json>`` with
a ``sequence_number``: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per text piece, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed``
(or ``response.incomplete`` when ``max_output_tokens`` cut it), with ``usage``
(``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens``,
``total_tokens``). A failure once the stream began (the engine failed or shut down, or any
other error) ends it with an ``error`` event (``code``, ``message``) and a
``response.failed`` event whose response has ``status: "failed"`` and ``error``; nothing
follows them (a Responses stream has no ``[DONE]``). ``created_at`` and ``completed_at`` are
integer Unix times, as OpenAI sends them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import (AfterValidator, Field, PrivateAttr, Strict, field_validator,
                      model_validator)

from phasewise.engine.backend import EngineError, EngineStopped, RequestGroup
from phasewise.engine.outputs import RequestOutput
from phasewise.engine.sampling_params import MAX_INT32
from phasewise.server import jsontext
from phasewise.server.admission import check_messages
from phasewise.server.errors import field_error
from phasewise.server.guard import access_record
from phasewise.server.protocol import (COMBINATION, Bool, Float, Int, JsonSchemaFormat, Str,
                                       Text1, _Body, _Sampling, _valid_unicode, constraint,
                                       refused)
from phasewise.server.sse import SSEResponse, stream_error

# Fields of the Responses API that phasewise does not serve, and why.
REFUSED = {
    "previous_response_id": "phasewise stores no responses; send the whole conversation as "
                            "input",
    "conversation": "phasewise stores no conversations; send the whole conversation as input",
    "tools": "tools are not supported on /v1/responses; use /v1/chat/completions, which "
             "takes them",
    "background": "background responses are not supported; use stream instead",
    "reasoning": "reasoning options are not supported (the models served do not reason)",
    "prompt": "stored prompts are not supported; send the prompt as input",
    "include": "include is not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
}
_EMPTY_STR = {"type": "string", "maxLength": 0, "description": "not supported"}
_EMPTY_LIST = {"type": "array", "maxItems": 0, "description": "not supported"}
_EMPTY_OBJ = {"type": "object", "maxProperties": 0, "description": "not supported"}
_FALSE = {"type": "boolean", "enum": [False], "description": "not supported"}


class TextFormat(JsonSchemaFormat):
    """``text.format``: the json_schema fields sit beside ``type`` (the Responses shape)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextOptions(_Body):
    format: TextFormat | None = None


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: Str


class InputMessage(_Body):
    """An input item: a message with text (no other item type is served)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Str | Annotated[list[InputText], Field(min_length=1)]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponsesRequest(_Sampling):
    input: Text1 | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: Str | None = None
    n: Int(1, 1) = 1  # a response has one output
    max_output_tokens: Int(1, MAX_INT32) | None = None
    max_tokens: Int(1, MAX_INT32) | None = None  # (chat's name; max_output_tokens wins)
    text: TextOptions | None = None
    store: Any = None
    # OpenAI's bounds: 16 pairs, keys of up to 64 characters (_metadata_keys: a key left a
    # plain str, so the free-form walk names one holding a lone surrogate), values of up to
    # 512 (it is echoed in every response event)
    metadata: Annotated[dict[str, Annotated[str, Strict(), Field(max_length=512),
                                            AfterValidator(_valid_unicode)]],
                        Field(max_length=16)] | None = None
    top_p: Float | None = Field(None, gt=0, le=1)
    # Documented as only their empty/off values; anything else is refused with the reason.
    previous_response_id: refused(_EMPTY_STR, Str) | None = None
    conversation: refused(_EMPTY_STR, Str | dict[str, Any]) | None = None
    tools: refused(_EMPTY_LIST, list[Any]) | None = None
    background: refused(_FALSE, Bool) | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_keys(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key in v or {}:
            if len(key) > 64:
                raise ValueError(f"a metadata key may have at most 64 characters; one has "
                                 f"{len(key)}")
        return v
    reasoning: refused(_EMPTY_OBJ, dict[str, Any]) | None = None
    prompt: refused(_EMPTY_OBJ, dict[str, Any]) | None = None
    include: refused(_EMPTY_LIST, list[Any]) | None = None
    top_logprobs: refused({"type": "integer", "enum": [0], "description": "not supported"},
                          Int(0, 20)) | None = None
    tool_choice: Literal["none", "auto"] | None = None
    _text_spec: tuple[str, str] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        for name, why in REFUSED.items():
            value = getattr(self, name)
            if isinstance(value, dict) and all(v is None for v in value.values()):
                continue  # {"effort": null}: no option asked for
            if value not in (None, False, [], {}, "", 0):
                raise field_error(name, f"{name}: {why}")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            if self._structured is not None:
                raise field_error("text.format", f"text.format and {self._structured[0]} each "
                                  "constrain the output; send one of them", COMBINATION)
            if fmt.type == "json_object":
                self._text_spec = constraint("text.format", "json_object")
            elif fmt.schema_ is None:
                raise field_error("text.format.schema", "a text.format of type json_schema "
                                  "needs a schema", COMBINATION)
            else:
                self._text_spec = constraint("text.format.schema", "json_schema", fmt.schema_)
        return self

    @property
    def structured_spec(self) -> tuple[str, str] | None:
        return self._text_spec or self._structured

    @property
    def output_limit(self) -> int | None:
        return self.max_output_tokens if self.max_output_tokens is not None \
            else self.max_tokens

    def messages(self) -> list[dict[str, str]]:
        """The conversation as chat messages (instructions first)."""
        msgs = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*msgs, {"role": "user", "content": self.input}]
        return [*msgs, *({"role": m.role, "content": m.text} for m in self.input)]


class ResponseBuilder:
    """The response object and its stream of events, for one request."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body = body
        self.model = model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seq = 0

    def response(self, status: str, text: str | None = None, out: RequestOutput | None = None,
                 input_tokens: int = 0) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format else None
        output = [] if text is None else [self.item(status, text)]
        r: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None, "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": False, "temperature": body.temperature,
            "top_p": body.top_p, "tool_choice": "none", "tools": [], "store": False,
            "text": {"format": ({"type": "text"} if fmt is None else
                                fmt.model_dump(by_alias=True, exclude_none=True))},
            "usage": None}
        if out is not None:
            n = len(out.token_ids)
            r["usage"] = {"input_tokens": input_tokens,
                          "input_tokens_details": {"cached_tokens":
                                                   out.metrics.num_cached_tokens,
                                                   "cache_write_tokens": 0},
                          "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": input_tokens + n}
            if status == "completed":
                r["completed_at"] = int(time.time())
            else:
                r["incomplete_details"] = {"reason": "max_output_tokens"}
        return r

    def item(self, status: str, text: str | None) -> dict[str, Any]:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [] if text is None else [self.part(text)]}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, *, ascii_only: bool = False, **fields: Any) -> bytes:
        """One event, encoded here: an event that does not encode raises before it takes a
        sequence number, so the error event that ends the stream takes it instead."""
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        data = (f"event: {kind}\ndata: "
                f"{json.dumps(payload, ensure_ascii=ascii_only)}\n\n").encode("utf-8")
        self.seq += 1
        return data

    def failed(self, e: Exception) -> bytes:
        """The stream's end after a failure: ``error``, then ``response.failed`` (ASCII JSON,
        so that they always encode)."""
        err = stream_error(e)
        failed = self.response("failed")
        failed["error"] = {"code": "server_error" if err.status >= 500 else err.code,
                           "message": err.message}
        return (self.event("error", ascii_only=True, code=err.code, message=err.message,
                           param=None)
                + self.event("response.failed", ascii_only=True, response=failed))

    @staticmethod
    def status_of(out: RequestOutput) -> str:
        return "incomplete" if out.finish_reason == "length" else "completed"

    async def events(self, group: RequestGroup, input_tokens: int,
                     on_token: Callable[[RequestOutput], None]) -> AsyncIterator[bytes]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        yield self.event("response.output_item.added", output_index=0,
                         item=self.item("in_progress", None))
        yield self.event("response.content_part.added", part=self.part(""), **where)
        try:
            async for _, out in group:
                on_token(out)
                if out.delta_text:
                    yield self.event("response.output_text.delta", delta=out.delta_text,
                                     logprobs=[], **where)
                if out.finished:
                    status = self.status_of(out)
                    yield self.event("response.output_text.done", text=out.text, logprobs=[],
                                     **where)
                    yield self.event("response.content_part.done", part=self.part(out.text),
                                     **where)
                    yield self.event("response.output_item.done", output_index=0,
                                     item=self.item(status, out.text))
                    kind = "response.completed" if status == "completed" else \
                        "response.incomplete"
                    yield self.event(kind, response=self.response(status, out.text, out,
                                                                  input_tokens))
        except (EngineError, EngineStopped) as e:
            yield self.failed(e)
        finally:
            group.close()


async def create(routes: Any, body: ResponsesRequest, request: Request) -> Response:
    """The route's handler (``routes``: the server's ``Routes``)."""
    arrival = time.monotonic()
    routes.check_model(body.model)
    if not isinstance(body.input, str):
        check_messages(len(body.input), "input", routes.limits)
    msgs = body.messages()
    routes._check_chars(sum(len(m["content"]) for m in msgs), "input")
    text, ids = await routes._off_loop(routes._chat_ids, msgs, True, False, None)
    max_tokens = routes._budget(len(ids), body.output_limit, "input",
                                "max_output_tokens" if body.max_output_tokens is not None
                                else "max_tokens")
    routes._ids(ids, "input")
    overrides = body.sampling_overrides()
    spec = body.structured_spec
    if spec is not None:
        await routes._constrain(overrides, *spec)
    specs = routes._specs([(ids, text, max_tokens)], 1, overrides)
    builder = ResponseBuilder(body, routes.served_model_name)
    rec = access_record(request.scope)
    rec.request_id = builder.id
    rec.prompt_tokens = len(ids)
    group = await routes._submit(specs, builder.id, arrival, routes.slo(request, body))

    def on_token(out: RequestOutput) -> None:
        rec.output_tokens = len(out.token_ids)
        if rec.ttft_s is None and out.metrics.ttft is not None:
            rec.ttft_s = out.metrics.ttft

    if body.stream:
        return SSEResponse(builder.events(group, len(ids), on_token), group.close,
                           builder.failed)
    (final,) = await routes._collect(request, group, on_token)
    status = builder.status_of(final)
    reply = builder.response(status, final.text, final, len(ids))
    return Response(await routes._off_loop(lambda: jsontext.dumps(reply).encode()),
                    media_type="application/json")

