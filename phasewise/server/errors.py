"""Errors of the HTTP API: ``ApiError``, its OpenAI-style body, and the translation of
request-validation failures into a 400 that names the field.

The field at fault is always carried explicitly: pydantic's error location for field checks,
the ``param`` in a ``FieldError``'s context for checks across fields, ``ValidationError.param``
from the engine. It is never parsed out of a message's text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import PydanticCustomError


class ApiError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: an error body always encodes, whatever
    text (a lone surrogate a client sent, in a path or a message) it quotes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(err: ApiError) -> JSONResponse:
    return _AsciiJSON(err.body(), status_code=err.status, headers=err.headers)


FIELD_ERROR = "phasewise_field"


def field_error(param: str | None, message: str,
                code: str | None = None) -> PydanticCustomError:
    """For a model validator: an error that names ``param`` (a dotted field path) and, for
    a rule across fields, its ``code``."""
    # pydantic fills only {param} and {code} placeholders; other braces stay as written.
    return PydanticCustomError(FIELD_ERROR, message, {"param": param, "code": code})


def nested_field_error(param: str, message: str) -> PydanticCustomError:
    """For a model validator: an error whose ``param`` is a path inside the model (its field,
    then keys and indices), wherever the model sits in the request; the 400 names the whole
    path, the model's own location first."""
    return PydanticCustomError(FIELD_ERROR, message, {"param": param, "code": None,
                                                      "nested": True})


# Union types report one error per alternative; say once what the field may be instead.
UNION_FIELDS = {
    "prompt": "a non-empty string, a list of token ids, a list of strings or a list of "
              "token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
    # /v1/responses
    "input": "a non-empty string, or a non-empty list of messages ({\"role\": system, "
             "developer, user or assistant, \"content\": a string or a list of input_text / "
             "output_text parts}); images, files and function-call items are not served",
}


# Request bodies that are a union of models: each model's name -> the fields that tell the
# forms apart (exactly one of them must be given).
BODY_UNIONS = {"TokenizePrompt": ("prompt", "messages"), "TokenizeChat": ("prompt", "messages")}


def _form_only(e: Any, keys: tuple[str, ...]) -> bool:
    """An error of a union branch that only says the body has another form's key field or
    lacks its own."""
    loc = [str(x) for x in e.get("loc", ())]
    return len(loc) == 3 and loc[2] in keys and e.get("type") in ("missing",
                                                                  "extra_forbidden")


def _element(x: Any) -> str:
    """An error location's element as text that always encodes (a key holding a lone
    surrogate shows it as ``\\ud800``)."""
    return str(x).encode("utf-8", "backslashreplace").decode("utf-8")


def _branch_model(part: str) -> str:
    """``function-after[<validator>(), TokenizeChat]`` (a union branch whose model has a
    validator) -> ``TokenizeChat``; any other part as it is."""
    m = re.fullmatch(r"function-[a-z]+\[.*, (\w+)\]", part)
    return m.group(1) if m else part


def _is_type_tag(part: str) -> bool:
    """pydantic's union branch labels in an error location (``str``, ``list[int]``, ...)."""
    return part in ("str", "int", "float", "bool") or "[" in part or part.startswith(
        ("function-", "constrained-", "function-before", "function-after"))


def _message(e: Any) -> str:
    """An error's message in our words where pydantic's would puzzle."""
    if e.get("type") == "string_unicode":  # pydantic's own check of a lone surrogate
        got = e.get("input")
        at = next((i for i, c in enumerate(got) if "\ud800" <= c <= "\udfff"), None) \
            if isinstance(got, str) else None
        where = "" if at is None else f" at position {at}"
        return (f"the string holds an invalid Unicode character (a lone surrogate{where}); "
                "send valid UTF-8 text")
    return str(e.get("msg", "invalid request")).removeprefix("Value error, ")


def _shown(x: Any) -> str:
    try:
        return json.dumps(x)[:80]
    except (TypeError, ValueError):
        return repr(x)[:80]


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first of pydantic's errors as a 400 naming the field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [_element(x) for x in first.get("loc", ()) if x != "body"]
    kind = first.get("type", "")
    ctx = first.get("ctx") or {}
    if kind == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: "
                        f"{ctx.get('error', first.get('msg'))}")
    body_types = ("model_attributes_type", "dict_type", "model_type")
    if loc:  # a union branch's label names its model (wrapped by the model's validators)
        loc[0] = _branch_model(loc[0])
    if (kind in body_types and not loc) or (loc and loc[0] in BODY_UNIONS and len(loc) == 1
                                            and all(e.get("type") in body_types
                                                    for e in errors)):
        return ApiError(400, "the request body must be a JSON object")
    if kind == "missing" and not loc:
        return ApiError(400, "the request body is empty; send a JSON object")
    if loc and loc[0] in BODY_UNIONS:
        # A body that is one of several models (/tokenize: a prompt or messages): drop the
        # errors that only say which form it is not, and report what is left.
        keys = BODY_UNIONS[loc[0]]
        rest = [e for e in errors if not _form_only(e, keys)]
        if not rest:
            return ApiError(400, f"give exactly one of {' or '.join(keys)}")
        errors, first = rest, rest[0]
        loc = [_element(x) for x in first.get("loc", ())[2:]]
        kind = first.get("type", "")
        ctx = first.get("ctx") or {}
    msg = _message(first)
    if kind == FIELD_ERROR and ctx.get("nested"):
        param = ".".join([x for x in loc if not _is_type_tag(x)] + [ctx["param"]])
        return ApiError(400, f"{param}: {msg}", param=param)
    if kind == FIELD_ERROR:
        return ApiError(400, msg, param=ctx.get("param"), code=ctx.get("code"))
    if kind == "missing" and loc:
        return ApiError(400, f"{'.'.join(loc)} is required", param=".".join(loc))
    path = [x for x in loc if not _is_type_tag(x)]
    if path and path[0] in UNION_FIELDS and len(errors) > 1:
        # A check of ours in the branch that matched the type (a lone surrogate, ...) says
        # more than the list of the types the field may have.
        ours = next((e for e in errors if e.get("type") in ("value_error", "string_unicode")),
                    None)
        if ours is not None:
            return ApiError(400, f"{path[0]}: {_message(ours)}", param=path[0])
        # A bound or length broken in the branch whose type matched (an id out of range, too
        # many stop strings) says more than the types the field may have.
        branches: dict[str, list[Any]] = {}
        for e in errors:
            tag = next((str(x) for x in e.get("loc", ()) if _is_type_tag(str(x))), "")
            branches.setdefault(tag, []).append(e)
        closest = [errs for errs in sorted(branches.values(), key=len)
                   if not any(str(e.get("type", "")).endswith("_type") for e in errs)]
        limit = closest[0][0] if closest else None
        if limit is not None:
            where = ".".join(str(x) for x in limit.get("loc", ()) if x != "body"
                             and not _is_type_tag(str(x)))
            return ApiError(400, f"{where}: {limit.get('msg')} (got "
                            f"{_shown(limit.get('input'))})", param=path[0])
        return ApiError(400, f"{path[0]} must be {UNION_FIELDS[path[0]]} "
                        f"(got {_shown(first.get('input'))})", param=path[0])
    param = ".".join(path) or None
    if param:
        msg = f"{param}: {msg} (got {_shown(first.get('input'))})"
    return ApiError(400, msg, param=param)
