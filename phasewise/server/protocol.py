"""Request bodies of the OpenAI-compatible API (pydantic) and the error body.

Types are strict (a boolean is not a number, a string is not an integer), ranges are checked
here so that a 400 names the field, and unknown fields are ignored, as OpenAI clients and
benchmark tools send extras. Fields phasewise cannot honour are refused with a message that
says so, rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from phasewise.engine.sampling_params import MAX_LOGPROBS

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]

MAX_N = 16  # choices per prompt


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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's extension: usage on every chunk


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: Str | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=100)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0, le=1)
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    repetition_penalty: Float | None = Field(None, gt=0, le=10)
    ignore_eos: Bool = False
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    logit_bias: dict[str, Float] | None = None

    @model_validator(mode="after")
    def _check_common(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by phasewise; omit it")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError(f"stop takes at most 16 strings, got {len(stops)}")
        return self

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


TokenIds = list[Annotated[Int, Field(ge=0)]]


class CompletionRequest(_Sampling):
    prompt: Str | TokenIds | list[Str] | list[TokenIds]
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's (and vLLM's) default here
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    best_of: Int | None = Field(None, ge=1)
    suffix: Str | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by phasewise; omit it or set it to false")
        if self.suffix:
            raise ValueError("suffix is not supported by phasewise; omit it")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when given; phasewise returns "
                             "every sample it draws")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: Str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[dict[str, Any]] | None = None
    name: Str | None = None

    def text(self, index: int) -> str:
        """The message's text; content parts must all be text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{index}].content[{j}] has type "
                               f"{part.get('type')!r}; phasewise serves text models and takes "
                               "only parts of type 'text' with a string 'text'",
                               param=f"messages.{index}.content.{j}")
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.tools:
            raise ValueError("tools (function calling) are not supported by phasewise")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format must be {'type': 'text'}; structured output "
                             "is not supported by phasewise")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_Body):
    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: Str | None = None
    tokens: TokenIds
