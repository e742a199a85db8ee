"""Request bodies parsed and validated where their size cannot hold the event loop.

Parsing JSON and validating it with pydantic hold the GIL: one 8 MiB body of 280,000 empty
chat messages took the loop for over a second, and every other stream stalled as long. So:

* a body of at most ``INLINE_BYTES`` is validated on the loop (pydantic's ``validate_json``:
  a few milliseconds at most);
* a larger one goes to a child process (``python -m phasewise.server.bodies``), which
  validates it and sends back the model pickled in pieces: the model with its top-level
  lists left empty, then each list's items in runs of about ``PIECE_BYTES`` pickled. A
  worker thread of the server loads the runs one at a time and puts the lists back, so
  between any two the event loop gets the GIL (Python hands it over every
  ``sys.getswitchinterval()`` seconds): a body at the size limit holds the loop for about
  the switch interval or one run's load, whichever is longer (a run is about a millisecond
  of loading; one item larger than a run is a run of its own). Runs rather than single
  items because the GIL is the engine's too: loading a million token ids one at a time took
  0.6 s of it, in runs 10-40 ms (``benchmarks/bench_event_loop.py``).

An invalid body is answered by the child with pydantic's errors, which become the same 400
as FastAPI's own validation gives (``errors.validation_error``). A valid one the served model
could never take (more messages than its context has tokens, a prompt longer than its
context: ``admission.precheck``) is refused there too, with the route's own error, so the
server's process never builds a huge body it would only refuse after walking it. ``parse`` is what routes
call, in place of FastAPI's body parameters; ``request_body`` documents the body in the
OpenAPI document as FastAPI would have.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle
import queue
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

from phasewise.server.admission import Limits, precheck
from phasewise.server.child import Child, ChildDied, ChildTimeout, serve
from phasewise.server.errors import ApiError

INLINE_BYTES = 16 * 1024
PIECE_BYTES = 64 * 1024
_EMPTY = [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]


def _body_types() -> dict[str, Any]:
    """The body types by name (imported late: the child imports only what it parses)."""
    from phasewise.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                           DetokenizeRequest, TokenizeRequest)
    from phasewise.server.internal import RelayRequest
    from phasewise.server.responses import ResponsesRequest

    return {"CompletionRequest": CompletionRequest,
            "ChatCompletionRequest": ChatCompletionRequest,
            "ResponsesRequest": ResponsesRequest, "TokenizeRequest": TokenizeRequest,
            "DetokenizeRequest": DetokenizeRequest, "RelayRequest": RelayRequest}


_adapters: dict[str, TypeAdapter] = {}


def _adapter(name: str) -> TypeAdapter:
    adapter = _adapters.get(name)
    if adapter is None:
        adapter = _adapters[name] = TypeAdapter(_body_types()[name])
    return adapter


def _invalid(errors: list[dict[str, Any]]) -> RequestValidationError:
    """pydantic's errors as FastAPI reports a body's (their location under "body")."""
    return RequestValidationError([{**e, "loc": ("body", *e.get("loc", ()))} for e in errors])


def validate(name: str, raw: bytes) -> Any:
    """The body of type ``name`` from JSON ``raw``, on this thread. Parsed by ``json`` as
    FastAPI parses a body (pydantic's own parser refuses a lone surrogate's escape as bad
    JSON, where this server names the field that holds it), then validated."""
    if not raw.strip():
        raise RequestValidationError(_EMPTY)
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": e.msg}}]) from None
    except (RecursionError, UnicodeDecodeError, ValueError) as e:
        # (ValueError: an integer of more digits than Python converts to int,
        # sys.get_int_max_str_digits(); no field takes such a number)
        why = ("nested too deeply" if isinstance(e, RecursionError) else "not UTF-8"
               if isinstance(e, UnicodeDecodeError) else
               f"a number with more than {sys.get_int_max_str_digits()} digits")
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": why}}]) from None
    try:
        return _adapter(name).validate_python(data)
    except PydanticValidationError as e:
        raise _invalid(e.errors(include_url=False)) from None


# -- the child: validate, then cut the model into pieces ------------------------------------
def _pieces(model: Any) -> tuple[dict[str, Any], list[bytes]]:
    """(layout, frames): the model pickled with each of its top-level lists emptied, then
    each list's items cut into runs of about ``PIECE_BYTES`` pickled, each run pickled as
    one list (an item larger than that is a run of its own); the layout says how many
    frames each list has."""
    if not isinstance(model, BaseModel):
        return {"lists": []}, [pickle.dumps(model, pickle.HIGHEST_PROTOCOL)]
    lists = [(name, value) for name, value in model.__dict__.items()
             if isinstance(value, list) and len(value) > 1]
    skeleton = model.model_copy(update={name: [] for name, _ in lists})
    frames = [pickle.dumps(skeleton, pickle.HIGHEST_PROTOCOL)]
    layout: list[list[Any]] = []
    for name, value in lists:
        runs: list[tuple[int, int]] = []
        start, size = 0, 0
        for i, item in enumerate(value):
            item_size = len(pickle.dumps(item, pickle.HIGHEST_PROTOCOL))
            if item_size >= PIECE_BYTES and i > start:  # a large item goes alone
                runs.append((start, i))
                start, size = i, 0
            size += item_size
            if size >= PIECE_BYTES:
                runs.append((start, i + 1))
                start, size = i + 1, 0
        if start < len(value):
            runs.append((start, len(value)))
        frames += [pickle.dumps(value[a:b], pickle.HIGHEST_PROTOCOL) for a, b in runs]
        layout.append([name, len(runs)])
    return {"lists": layout}, frames


def _trim(x: Any, room: int = 200) -> Any:
    """``x`` cut to about ``room`` characters of JSON, keeping its start: an error's message
    quotes only the start of the value it got (``errors._shown``)."""
    if isinstance(x, str):
        return x[:room]
    if isinstance(x, (list, dict)):
        items = list(x.items()) if isinstance(x, dict) else list(x)
        out, used = [], 0
        for item in items:
            if used >= room:
                break
            item = (item[0], _trim(item[1], room - used)) if isinstance(x, dict) \
                else _trim(item, room - used)
            out.append(item)
            used += len(json.dumps(item, default=str))
        return dict(out) if isinstance(x, dict) else out
    return x if isinstance(x, (int, float, bool, type(None))) else str(x)[:room]


def _handle(frame: bytes) -> list[bytes]:
    name, _, raw = frame.partition(b"\0")
    try:
        model = validate(name.decode(), raw)
        limits = _state.get("limits")
        if limits is not None:
            precheck(name.decode(), model, limits)
    except RequestValidationError as e:
        errors = [{k: _trim(v) if k == "input" else v for k, v in err.items()
                   if k in ("type", "loc", "msg", "ctx", "input")} for err in e.errors()]
        for err in errors:  # the context's values as text (an exception may be among them)
            if "ctx" in err:
                err["ctx"] = {k: v if isinstance(v, (str, int, float, bool, type(None)))
                              else str(v) for k, v in err["ctx"].items()}
            err["loc"] = list(err["loc"])[1:]  # "body" is put back by the parent
        return [json.dumps({"errors": errors}).encode()]
    except ApiError as e:
        return [json.dumps({"api_error": {"status": e.status, "message": e.message,
                                          "param": e.param, "code": e.code}}).encode()]
    except Exception as e:  # a bug, not the body's fault: answered, and the child lives on
        return [json.dumps({"api_error": {
            "status": 500, "message": f"validating the body failed: {type(e).__name__}: {e}",
            "param": None, "code": None, "type": "server_error"}}).encode()]
    layout, pieces = _pieces(model)
    return [json.dumps(layout).encode(), *pieces]


_state: dict[str, Any] = {}


def _setup(frame: bytes) -> None:
    limits = json.loads(frame)
    if limits:
        _state["limits"] = Limits(**limits)
    _body_types()  # imported once, before the first body


# -- the parent ------------------------------------------------------------------------------
class BodyParser:
    """See the module. ``limits``: the served model's (``admission.precheck`` refuses in the
    child a large body it could never serve); ``processes``: children validating large
    bodies at once."""

    def __init__(self, limits: Limits | None = None, processes: int = 1,
                 timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._idle: queue.Queue[Child] = queue.Queue()
        setup = json.dumps(dataclasses.asdict(limits) if limits else {}).encode()
        for _ in range(processes):
            self._idle.put(Child("phasewise.server.bodies", setup))
        self._children = list(self._idle.queue)
        self._pool = ThreadPoolExecutor(processes, thread_name_prefix="phasewise-body")
        self._closed = False
        self.offloaded = 0

    async def parse(self, name: str, raw: bytes) -> Any:
        """The body of type ``name`` (``CompletionRequest``, ...) from JSON ``raw``; raises
        ``RequestValidationError`` (a 400 naming the field) or ``ApiError``."""
        if len(raw) <= INLINE_BYTES:
            return validate(name, raw)
        self.offloaded += 1
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self._offload, name, raw)

    def _offload(self, name: str, raw: bytes) -> Any:
        child = self._idle.get()
        try:
            if self._closed:
                raise ApiError(503, "the server is shutting down", type="server_error",
                               code="shutting_down")
            try:
                frames = child.ask(name.encode() + b"\0" + raw, self.timeout_s)
            except ChildTimeout:
                raise ApiError(400, f"the request body took more than {self.timeout_s:g} s "
                               "to validate; send a smaller one", code="request_too_large"
                               ) from None
            except ChildDied as e:
                raise ApiError(500, f"the request body's validation failed ({e})",
                               type="server_error") from None
        finally:
            self._idle.put(child)
        return _assemble(frames)

    def close(self) -> None:
        self._closed = True
        for child in self._children:
            child.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _assemble(frames: list[bytes]) -> Any:
    """The model from the child's frames, one run of items per load, so that the event loop
    may take the GIL between any two (see the module)."""
    layout = json.loads(frames[0])
    if "errors" in layout:
        raise _invalid(layout["errors"])
    if "api_error" in layout:
        e = layout["api_error"]
        raise ApiError(e["status"], e["message"], param=e["param"], code=e["code"],
                       type=e.get("type", "invalid_request_error"))
    model = pickle.loads(frames[1])  # noqa: S301 - our own child's pickle of a model
    i = 2
    for name, count in layout["lists"]:
        items: list[Any] = []
        for frame in frames[i:i + count]:
            items += pickle.loads(frame)  # noqa: S301 - as above
        i += count
        model.__dict__[name] = items  # the child validated the list as a whole
    return model


def request_body(name: str, union: list[str] | None = None) -> dict[str, Any]:
    """``openapi_extra`` documenting a route's JSON body as FastAPI does for a body
    parameter of that model (``union``: the models a union body may be)."""
    if union:
        schema: dict[str, Any] = {"anyOf": [{"$ref": f"#/components/schemas/{m}"}
                                            for m in union], "title": "Body"}
    else:
        schema = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"content": {"application/json": {"schema": schema}},
                            "required": True}}


def component_schemas() -> dict[str, Any]:
    """The body models' JSON schemas, as OpenAPI components (and the models they use)."""
    from pydantic.json_schema import models_json_schema

    models = []
    for name, t in _body_types().items():
        if name == "RelayRequest":  # phasewise's own, left out of the document
            continue
        for m in getattr(t, "__args__", (t,)):
            models.append((m, "validation"))
    _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    return defs.get("$defs", {})


if __name__ == "__main__":
    serve(_handle, _setup)

