"""Request bodies of the OpenAI-compatible API (pydantic).

Types are strict (a boolean is not a number, a string is not an integer; an integral float
such as ``3793.0`` is an integer, as JSON Schema defines it). Every number has explicit
bounds here, so that no value a request can carry reaches the engine unbounded, and a 400
names the field. Strings must be valid Unicode (a lone surrogate such as ``"\\ud800"`` is
refused): typed strings by their own validator, and every key and string inside a free-form
field (a tool's parameters, a schema, ``metadata``, ``chat_template_kwargs``: any field whose
type admits ``Any`` or a ``dict``) by one walk of the field (``_Checked``), whose 400 names the
path down to the key or item (``tools.0.function.parameters.properties.<key>``). Unknown
fields are ignored, as OpenAI clients and benchmark tools send extras.
Fields phasewise cannot honour are refused with a message that says so, rather than silently
ignored.
"""

from __future__ import annotations

import functools
import json
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (AfterValidator, AllowInfNan, BaseModel, BeforeValidator, ConfigDict,
                      Field, PrivateAttr, Strict, WithJsonSchema, model_validator)

from phasewise.engine.sampling_params import (MAX_INT32, MAX_LOGPROBS, MAX_SEED,
                                              MAX_STOP_STRINGS, MIN_REPETITION_PENALTY,
                                              MIN_SEED)
from phasewise.engine.slo import SLO_MS_MAX, SLO_MS_MIN
from phasewise.engine.structured import TooDeep, spec_json
from phasewise.server.errors import ApiError, field_error, nested_field_error

MAX_N = 16  # choices per prompt


def _integral(x: Any) -> Any:
    """JSON Schema's integer includes numbers with a zero fraction (``3793.0``)."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


def _valid_unicode(s: str) -> str:
    """Refuse lone surrogates (JSON allows ``"\\ud800"``; no tokenizer takes it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the string holds an invalid Unicode character (a lone surrogate "
                         f"at position {e.start}); send valid UTF-8 text") from None
    return s


def Int(ge: int, le: int) -> Any:  # noqa: N802 - used as a type
    """A strict integer in [ge, le] (the bounds inside, so the JSON schema shows them)."""
    return Annotated[int, Strict(), Field(ge=ge, le=le), BeforeValidator(_integral)]


# finite: NaN and Infinity (Python's JSON reads both) are refused as such, not as a bound
# they would fail to compare with ("less than or equal to 100 (got NaN)")
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict(), AfterValidator(_valid_unicode)]
TokenId = Int(0, MAX_INT32)  # the served document narrows it to the vocabulary
Text1 = Annotated[str, Strict(), Field(min_length=1), AfterValidator(_valid_unicode)]


def refused(schema: dict[str, Any], typ: Any) -> Any:
    """A field phasewise refuses unless it is empty or off: documented as only those values
    (``schema``), checked in a model validator whose message says it is unsupported."""
    return Annotated[typ, WithJsonSchema(schema)]


# Errors of rules that join several fields (or a field and the model's context): a request
# can match the documented schema field by field and still break one of them.
COMBINATION = "invalid_combination"
CONTEXT = "context_length_exceeded"
TEMPLATE = "chat_template_error"
# A structured output's schema, regex or grammar that does not parse or compile (a rule on
# a field's content that its JSON schema cannot state).
GRAMMAR = "invalid_grammar"
RULES_ACROSS_FIELDS = (COMBINATION, CONTEXT, TEMPLATE, GRAMMAR)
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _admits_free_form(annotation: Any) -> bool:
    """Whether a field's type lets a client send strings that no typed validator checks:
    ``Any`` anywhere in it, or a ``dict`` (whose keys are plain strings)."""
    stack = [annotation]
    while stack:
        t = stack.pop()
        if t is Any or t is dict or get_origin(t) is dict:
            return True
        origin = get_origin(t)
        if origin is Annotated:
            stack.append(get_args(t)[0])
        elif origin in (Union, types.UnionType, list, tuple, set, frozenset):
            stack.extend(get_args(t))
    return False


@functools.cache
def free_form_fields(cls: type[BaseModel]) -> tuple[tuple[str, str], ...]:
    """(attribute, the name a client sends) of each field of a model class whose value
    ``_Checked`` walks (computed once a class)."""
    return tuple((name, f.alias or name) for name, f in cls.model_fields.items()
                 if _admits_free_form(f.annotation))


def _shown_key(key: str) -> str:
    """A key as a path element that always encodes (a lone surrogate as ``\\ud800``)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def check_free_form(value: Any, name: str) -> None:
    """Raise ``nested_field_error`` naming the path (from the field ``name``) of the first key
    or string inside ``value`` that is not valid Unicode. Iterative, one visit per node: the
    work is linear in the request body, which the server's body-size limit bounds."""
    # (node, parent entry, its key or index): paths are only built for the one error
    stack: list[tuple[Any, Any, Any]] = [(value, None, name)]

    def path(entry: tuple[Any, Any, Any] | None) -> str:
        parts = []
        while entry is not None:
            key = entry[2]
            parts.append(_shown_key(key) if isinstance(key, str) else str(key))
            entry = entry[1]
        return ".".join(reversed(parts))

    while stack:
        entry = stack.pop()
        node = entry[0]
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise nested_field_error(path(entry), _surrogate("string", e)) from None
        elif isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise nested_field_error(path((None, entry, k)),
                                                 _surrogate("key", e)) from None
                stack.append((v, entry, k))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, entry, i) for i, v in enumerate(node))


def _surrogate(what: str, e: UnicodeEncodeError) -> str:
    return (f"the {what} holds an invalid Unicode character (a lone surrogate at position "
            f"{e.start}); send valid UTF-8 text")


class _Checked(BaseModel):
    """Every request model: its free-form fields are walked for invalid Unicode once the
    fields themselves validated (before any other model validator reads them: a parent's
    after-validators run first), so that no such string reaches a tokenizer, a template or a
    JSON encoder as a 500."""

    @model_validator(mode="after")
    def _check_free_form(self) -> Any:
        for name, sent_as in free_form_fields(type(self)):
            value = getattr(self, name)
            if value is not None:
                check_free_form(value, sent_as)
        return self


class _Body(_Checked):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's extension: usage on every chunk


# The fields that constrain the output (structured output), in the order they are read.
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs")


def constraint(param: str, kind: str, value: Any = None) -> tuple[str, str]:
    """(param, the ``structured_output`` text) for a model validator: a schema that arrives as
    JSON text is parsed first, and one that is not a JSON object, or that is nested too deeply
    to write, is an error naming ``param``."""
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise field_error(param, f"{param} is not valid JSON: {e}", GRAMMAR)
    if kind == "json_schema" and not isinstance(value, dict):
        raise field_error(param, f"{param} must be a JSON schema object", GRAMMAR)
    try:
        return param, spec_json(kind, value)
    except TooDeep as e:
        raise field_error(param, f"{param}: {e}", GRAMMAR)


class JsonSchemaFormat(_Body):
    name: Annotated[str, Strict(), Field(min_length=1, max_length=64)] = "response"
    description: Str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: Bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise field_error("response_format.json_schema", "a response_format of type "
                              "json_schema needs json_schema: {name, schema, strict}",
                              COMBINATION)
        return self


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    json_: dict[str, Any] | Str | None = Field(None, alias="json")
    regex: Text1 | None = None
    choice: Annotated[list[Text1], Field(min_length=1, max_length=256)] | None = None
    grammar: Text1 | None = None
    json_object: Bool | None = None

    def spec(self) -> tuple[str, str]:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if k == "json" else k) not in (None, False)]
        if len(given) != 1:
            raise field_error("structured_outputs", "structured_outputs takes exactly one of "
                              "json, regex, choice, grammar, json_object; got "
                              f"{given or 'none'}", COMBINATION)
        kind, param = given[0], f"structured_outputs.{given[0]}"
        if kind == "json":
            return constraint(param, "json_schema", self.json_)
        if kind == "json_object":
            return constraint(param, "json_object")
        if kind == "grammar":
            return constraint(param, "lark", self.grammar)
        return constraint(param, kind, getattr(self, kind))


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: Str | None = None
    n: Int(1, MAX_N) = 1
    max_tokens: Int(1, MAX_INT32) | None = None
    temperature: Float | None = Field(None, ge=0, le=100)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int(-1, MAX_INT32) | None = None
    min_p: Float | None = Field(None, ge=0, le=1)
    seed: Int(MIN_SEED, MAX_SEED) | None = None
    stop: Text1 | Annotated[list[Text1], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_STRINGS * 4)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10)
    ignore_eos: Bool = False
    min_tokens: Int(0, MAX_INT32) = 0
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    # Admission by SLO (phasewise.engine.slo): refused at once (429) if the server predicts
    # it would miss them; also as the x-slo-ttft-ms / x-slo-tpot-ms headers.
    slo_ttft_ms: Float | None = Field(None, ge=SLO_MS_MIN, le=SLO_MS_MAX)
    slo_tpot_ms: Float | None = Field(None, ge=SLO_MS_MIN, le=SLO_MS_MAX)
    logit_bias: refused({"type": "object", "maxProperties": 0,
                         "description": "not supported: omit it or send {}"},
                        dict[str, Float]) | None = None
    # Structured output (phasewise.engine.structured): OpenAI's response_format, or one of
    # vLLM's fields; at most one of them.
    response_format: ResponseFormat | None = None
    guided_json: Str | dict[str, Any] | None = None
    guided_regex: Text1 | None = None
    guided_choice: Annotated[list[Text1], Field(min_length=1, max_length=256)] | None = None
    guided_grammar: Text1 | None = None
    structured_outputs: StructuredOutputs | None = None
    _structured: tuple[str, str] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_common(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options",
                              "stream_options is only allowed when stream is true", COMBINATION)
        if self.logit_bias:
            raise field_error("logit_bias", "logit_bias is not supported by phasewise; omit it")
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise field_error(given[1], f"{' and '.join(given)} each constrain the output; "
                              "send at most one of them", COMBINATION)
        self._structured = self._structured_spec()
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise field_error("min_tokens", f"min_tokens ({self.min_tokens}) must be <= "
                              f"max_tokens ({self.max_tokens})", COMBINATION)
        return self

    @property
    def structured_spec(self) -> tuple[str, str] | None:
        """(the field that asked, ``SamplingParams.structured_output``) or None."""
        return self._structured

    def _structured_spec(self) -> tuple[str, str] | None:
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return constraint("response_format", "json_object")
        if rf is not None and rf.type == "json_schema":
            return constraint("response_format.json_schema.schema", "json_schema",
                              rf.json_schema.schema_)
        for param, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                            ("guided_choice", "choice"), ("guided_grammar", "lark")):
            if getattr(self, param) is not None:
                return constraint(param, kind, getattr(self, param))
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        return None

    def sampling_overrides(self) -> dict[str, Any]:
        """SamplingParams fields the client set (the rest come from the checkpoint)."""
        out: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.stop is not None:
            out["stop"] = self.stop
        if self.stop_token_ids:
            out["stop_token_ids"] = tuple(self.stop_token_ids)
        out.update(ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                   skip_special_tokens=self.skip_special_tokens,
                   include_stop_str_in_output=self.include_stop_str_in_output)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: (Text1 | TokenIds | Annotated[list[Text1], Field(min_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1)])
    # OpenAI's (and vLLM's) default; 0 only scores the prompt (with echo or prompt_logprobs)
    max_tokens: Int(0, MAX_INT32) | None = 16
    logprobs: Int(0, MAX_LOGPROBS) | None = None
    # The prompt in front of the completion's text; with logprobs, the prompt tokens' too
    # (the first one's null), as lm-eval's loglikelihood tasks read them.
    echo: Bool = False
    # vLLM's extension: each prompt token's logprob and the top N, in the choice's
    # "prompt_logprobs" (the first entry null).
    prompt_logprobs: Int(0, MAX_LOGPROBS) | None = None
    best_of: Int(1, MAX_N) | None = None
    suffix: refused({"type": "string", "maxLength": 0, "description": "not supported"},
                    Str) | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise field_error("suffix", "suffix is not supported by phasewise; omit it")
        if self.best_of is not None and self.best_of != self.n:
            raise field_error("best_of", f"best_of must equal n ({self.n}) when given; "
                              "phasewise returns every sample it draws", COMBINATION)
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: Str


FunctionName = Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
MAX_TOOLS = 128


class CalledFunction(_Body):
    name: FunctionName
    arguments: Str = "{}"  # the JSON text of the arguments, as OpenAI sends it


class ToolCall(_Body):
    """A call an earlier assistant message made (sent back with the tool's result)."""

    id: Str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class FunctionDef(_Body):
    name: FunctionName
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None  # calls under tool_choice required/named always follow it


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | refused({"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}},
        "description": "text parts only"}, list[dict[str, Any]]) | None = None
    name: Str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Str | None = None

    def text(self, index: int) -> str:
        """The message's text; content parts must all be text parts of valid Unicode."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            param = f"messages.{index}.content.{j}"
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{param} has type {part.get('type')!r}; phasewise serves "
                               "text models and takes only parts of type 'text' with a string "
                               "'text'", param=param)
            try:
                pieces.append(_valid_unicode(part["text"]))
            except ValueError as e:
                raise ApiError(400, f"{param}.text: {e}", param=f"{param}.text") from None
        return "".join(pieces)


# The template variables the server sets itself, and the request field that sets each (None:
# the tokenizer's own): chat_template_kwargs may not set them too.
TEMPLATE_RESERVED = {"messages": "messages", "add_generation_prompt": "add_generation_prompt",
                     "tools": "tools", "bos_token": None, "eos_token": None}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int(1, MAX_INT32) | None = None
    logprobs: Bool = False
    top_logprobs: Int(0, MAX_LOGPROBS) | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs needs logprobs set to true",
                              COMBINATION)
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error("tools", "tools must have distinct function names",
                              COMBINATION)
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise field_error("tool_choice", "tool_choice needs tools", COMBINATION)
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise field_error("tool_choice.function.name", f"tool_choice names "
                              f"{choice.function.name!r}, which is not among the tools "
                              f"({', '.join(names)})", COMBINATION)
        if self.tool_mode in ("required", "named") and self._structured is not None:
            raise field_error("tool_choice", f"tool_choice {self.tool_mode} constrains the "
                              f"output, and so does {self._structured[0]}; send one of them",
                              COMBINATION)
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error("continue_final_message", "continue_final_message and "
                              "add_generation_prompt cannot both be true", COMBINATION)
        for key in self.chat_template_kwargs or {}:
            if key in TEMPLATE_RESERVED:
                field = TEMPLATE_RESERVED[key]
                how = (f"send it as the request's {field} field" if field else
                       "the checkpoint's tokenizer sets it")
                raise field_error(f"chat_template_kwargs.{key}", f"chat_template_kwargs may "
                                  f"not set {key}: the server passes it to the template "
                                  f"itself ({how}); reserved: "
                                  f"{', '.join(TEMPLATE_RESERVED)}", COMBINATION)
        limit = self.output_limit
        if limit is not None and self.min_tokens > limit:
            name = "max_completion_tokens" if self.max_completion_tokens is not None \
                else "max_tokens"
            raise field_error("min_tokens", f"min_tokens ({self.min_tokens}) must be <= "
                              f"{name} ({limit})", COMBINATION)
        return self

    @property
    def tool_mode(self) -> str:
        """none (no tools, or tool_choice none), auto (the default with tools), required,
        or named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class _TokenizeBase(_Checked):
    # Unknown fields are refused here: with both prompt and messages the request matches
    # neither form, as the documented schema says.
    model_config = ConfigDict(extra="forbid")

    model: Str | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class TokenizePrompt(_TokenizeBase):
    prompt: Str


class TokenizeChat(_TokenizeBase):
    messages: list[ChatMessage] = Field(min_length=1)


TokenizeRequest = TokenizePrompt | TokenizeChat


class DetokenizeRequest(_Body):
    model: Str | None = None
    tokens: list[TokenId]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error the API sends (4xx and 5xx)."""

    error: ErrorDetail
