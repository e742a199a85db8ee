"""The OpenAI-compatible HTTP API over an ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

The server validates, tokenizes and renders chat templates; the engine thread schedules and
runs the model. Every error is an OpenAI-style body (``{"error": {"message", "type", "param",
"code"}}``) with a 4xx status that names the field at fault. A client that goes away, in a
stream or while waiting for a whole response, has its requests aborted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import phasewise
from phasewise.engine.async_engine import (AsyncEngine, EngineError, EngineOverloaded,
                                           EngineStopped, PromptSpec, RequestGroup)
from phasewise.engine.outputs import RequestOutput
from phasewise.engine.sampling_params import SamplingParams
from phasewise.server.metrics import PrometheusMetrics
from phasewise.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest)

log = logging.getLogger("phasewise.server")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP layer behaves. ``max_waiting_requests``: requests (choices) allowed to
    wait for the engine before new ones get 503; ``max_request_bytes``: body size limit."""

    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int = 256
    max_request_bytes: int = 8 * 2**20
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got "
                             f"{self.max_waiting_requests}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# -- transport guards (pure ASGI, so streaming and disconnects pass through untouched) -----
class Guard:
    """Body size limit, API key on ``/v1`` routes, refusal while draining, and JSON as the
    body type of every POST."""

    def __init__(self, app: Any, config: ServerConfig, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.config = config
        self.is_draining = is_draining

    async def _refuse(self, send: Send, err: ApiError) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        key = self.config.api_key
        if key is not None and path.startswith("/v1"):
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                await self._refuse(send, ApiError(
                    401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key"))
                return
        if self.is_draining() and scope.get("method") == "POST":
            await self._refuse(send, ApiError(
                503, "the server is shutting down and takes no new requests",
                type="server_error", code="shutting_down"))
            return
        if scope.get("method") == "POST" and headers.get("content-type", "").split(";")[0] in (
                "", "application/x-www-form-urlencoded", "text/plain"):
            # Every POST body of this API is JSON; take curl's default form type (and none at
            # all) as JSON rather than refusing a well-formed body over a header.
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", [])
                                if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        limit = self.config.max_request_bytes
        too_large = ApiError(413, f"request body exceeds the limit of {limit} bytes",
                             code="request_too_large")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > limit:
                await self._refuse(send, too_large)
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read the body here, up to the limit, then replay it.
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > limit:
                await self._refuse(send, too_large)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class SSEResponse(StreamingResponse):
    """Server-sent events that stop (and abort their requests) as soon as the client goes:
    the stream races a listener for ``http.disconnect``."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        # No caching, and no buffering in proxies (nginx honours X-Accel-Buffering).
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # runs the generator's finally if it is suspended
            self.on_close()  # aborts what is still running, even if the body never started
            if stream.done() and not stream.cancelled():
                err = stream.exception()
                if err is not None and not isinstance(err, OSError):
                    log.error("stream failed", exc_info=err)


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (its ``finally`` aborts the
    requests) and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself is cancelled: pass that on
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def _timing(index: int, out: RequestOutput) -> dict[str, Any]:
    """The engine's own split of a finished request's time (phasewise's extension, sent on the
    final usage chunk as ``timings``; other clients ignore it)."""
    m = out.metrics
    queue = prefill = decode = None
    if m.first_scheduled_time is not None:
        queue = m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            prefill = m.first_token_time - m.first_scheduled_time
            decode = m.token_times[-1] - m.first_token_time
    return {"index": index, "queue_s": queue, "prefill_s": prefill, "decode_s": decode,
            "cached_tokens": m.num_cached_tokens, "preemptions": m.num_preemptions}


def _error_event(e: Exception) -> str:
    err = ApiError(500, str(e), type="server_error",
                   code="shutting_down" if isinstance(e, EngineStopped) else "engine_error")
    return _sse(err.body())


class OpenAIServer:
    """Builds the FastAPI app around an engine; ``app`` is the ASGI entry point."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig,
                 metrics: PrometheusMetrics | None = None) -> None:
        self.engine = engine
        self.llm = engine.engine
        self.tokenizer = engine.engine.tokenizer
        self.config = config
        self.metrics = metrics
        self.draining = False
        self.created = int(time.time())
        self.fastapi = self._build()
        self.app = Guard(self.fastapi, config, lambda: self.draining)

    # -- helpers ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.config.served_model_name!r}", param="model",
                           code="model_not_found")

    def _check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"{param} is empty; give at least one token", param=param)
        vocab = self.llm.model_config.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"{param} holds token id {bad}, outside the vocabulary "
                           f"[0, {vocab})", param=param)

    def _output_budget(self, n_prompt: int, max_tokens: int | None, param: str,
                       limit_param: str) -> int:
        """max_tokens after checking prompt + output against the context length."""
        ctx = self.max_model_len
        if n_prompt >= ctx:
            raise ApiError(400, f"the prompt has {n_prompt} tokens, but this model's context "
                           f"is {ctx} tokens, which must also hold at least one output token",
                           param=param)
        room = ctx - n_prompt
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ApiError(400, f"{limit_param} is {max_tokens}, but this model's context is "
                           f"{ctx} tokens and the prompt uses {n_prompt}: at most {room} can "
                           f"be generated", param=limit_param)
        return max_tokens

    def _params(self, overrides: dict[str, Any]) -> SamplingParams:
        try:
            return self.llm.default_sampling_params(**overrides)
        except ValueError as e:
            first = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=first if first.isidentifier() else None) from e

    def _specs(self, prompts: list[tuple[list[int], str | None, int]], n: int,
               overrides: dict[str, Any]) -> list[PromptSpec]:
        """n samples of each (ids, text, max_tokens); seeded samples get seed, seed+1, ..."""
        specs = []
        for ids, text, max_tokens in prompts:
            for j in range(n):
                o = dict(overrides, max_tokens=max_tokens)
                if j and o.get("seed") is not None:
                    o["seed"] = o["seed"] + j
                specs.append(PromptSpec(ids, self._params(o), text))
        return specs

    async def _submit(self, specs: list[PromptSpec], request_id: str,
                      arrival: float) -> RequestGroup:
        try:
            return await self.engine.add(specs, request_id, arrival_time=arrival)
        except EngineOverloaded as e:
            raise ApiError(503, f"the server is overloaded: {e}", type="server_error",
                           code="overloaded",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from e
        except EngineStopped as e:
            raise ApiError(503, str(e), type="server_error", code="shutting_down") from e
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from e

    def _render_chat(self, messages: list[Any], add_generation_prompt: bool,
                     continue_final: bool = False, kwargs: dict[str, Any] | None = None) -> str:
        msgs = []
        for i, m in enumerate(messages):
            d: dict[str, Any] = {"role": m.role, "content": m.text(i)}
            if m.name is not None:
                d["name"] = m.name
            msgs.append(d)
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except ApiError:
            raise
        except Exception as e:  # template errors (raise_exception, bad roles, ...)
            raise ApiError(400, f"the chat template could not render these messages: {e}",
                           param="messages") from e
        if continue_final:
            last = msgs[-1]["content"]
            cut = text.rfind(last) if last else -1
            if cut != -1:
                text = text[:cut + len(last)]
        return text

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, token_ids: list[int], entries: list[dict[int, float]],
                             offset: int) -> dict[str, Any]:
        tokens, lps, tops, offsets = [], [], [], []
        pos = offset
        for tok, entry in zip(token_ids, entries):
            text = self._token_text(tok)
            tokens.append(text)
            lps.append(entry.get(tok))
            ranked = sorted(((lp, t) for t, lp in entry.items()), reverse=True)
            # The top-N and the sampled token (OpenAI: "up to logprobs + 1" entries).
            tops.append({self._token_text(t): lp for lp, t in ranked})
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]],
                       top_n: int) -> dict[str, Any]:
        content = []
        for tok, entry in zip(token_ids, entries):
            text = self._token_text(tok)
            ranked = sorted(((lp, t) for t, lp in entry.items()), reverse=True)[:top_n]
            content.append({
                "token": text, "logprob": entry.get(tok), "bytes": list(text.encode()),
                "top_logprobs": [{"token": self._token_text(t), "logprob": lp,
                                  "bytes": list(self._token_text(t).encode())}
                                 for lp, t in ranked]})
        return {"content": content}

    # -- the app ---------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            self.engine.start(asyncio.get_running_loop())
            try:
                yield
            finally:
                await asyncio.to_thread(self.engine.shutdown)

        app = FastAPI(title="phasewise", version=phasewise.__version__, lifespan=lifespan,
                      docs_url=None, redoc_url=None)

        @app.exception_handler(ApiError)
        async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
            return error_response(exc)

        @app.exception_handler(RequestValidationError)
        async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            return error_response(self._validation_error(exc))

        @app.exception_handler(StarletteHTTPException)
        async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return error_response(ApiError(exc.status_code, f"{exc.detail}: {request.method} "
                                           f"{request.url.path}", code=code))

        @app.exception_handler(Exception)
        async def on_bug(request: Request, exc: Exception) -> JSONResponse:
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                           type="server_error"))

        @app.get("/health")
        async def health() -> Response:
            if not self.engine.is_alive:
                return error_response(ApiError(503, "the engine thread is not running",
                                               type="server_error"))
            if self.draining:  # load balancers stop sending here while streams finish
                return error_response(ApiError(503, "the server is draining",
                                               type="server_error", code="shutting_down"))
            return JSONResponse({"status": "ok"})

        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"version": phasewise.__version__}

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.metrics is None:
                raise ApiError(404, "metrics are disabled on this server")
            return Response(generate_latest(self.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{
                "id": self.config.served_model_name, "object": "model",
                "created": self.created, "owned_by": "phasewise", "root": str(self.llm.config.model),
                "max_model_len": self.max_model_len}]}

        @app.post("/tokenize")
        async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
            self._check_model(body.model)
            if body.messages is not None:
                text = self._render_chat(body.messages, body.add_generation_prompt)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.tokenizer.encode(body.prompt or "", body.add_special_tokens)
            return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

        @app.post("/detokenize")
        async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
            self._check_model(body.model)
            if body.tokens:
                self._check_ids(body.tokens, "tokens")
            return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._chat(body, request)

        return app

    def _validation_error(self, exc: RequestValidationError) -> ApiError:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        kind = first.get("type", "")
        if kind == "json_invalid":
            return ApiError(400, f"the request body is not valid JSON: "
                            f"{first.get('ctx', {}).get('error', first.get('msg'))}")
        if kind in ("model_attributes_type", "dict_type") and not loc:
            return ApiError(400, "the request body must be a JSON object")
        msg = str(first.get("msg", "invalid request"))
        if kind == "missing" and loc:
            return ApiError(400, f"{'.'.join(loc)} is required", param=".".join(loc))
        if loc and loc[0] in _UNION_FIELDS and len(errors) > 1:
            return ApiError(400, f"{loc[0]} must be {_UNION_FIELDS[loc[0]]}", param=loc[0])
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        # Union types report one error per alternative: name the field once.
        param = ".".join(x for x in loc if not _is_type_tag(x)) or None
        if param is None:  # a check across fields: its message starts with the field's name
            head = msg.split(" ", 1)[0]
            param = head if head in _FIELD_NAMES else None
        if param and kind != "value_error":
            given = first.get("input")
            shown = json.dumps(given)[:80] if _jsonable(given) else repr(given)[:80]
            msg = f"{param}: {msg} (got {shown})"
        return ApiError(400, msg, param=param)

    # -- completions -----------------------------------------------------------------------
    async def _completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        raw_prompts = body.prompt_list()
        if not raw_prompts:
            raise ApiError(400, "prompt is empty; give a string or token ids", param="prompt")
        prompts = []
        for i, p in enumerate(raw_prompts):
            param = "prompt" if len(raw_prompts) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                if not p:
                    raise ApiError(400, f"{param} is an empty string", param=param)
                ids, text = self.tokenizer.encode(p), p
            else:
                ids, text = list(p), None
            self._check_ids(ids, param)
            max_tokens = self._output_budget(len(ids), body.max_tokens, param, "max_tokens")
            prompts.append((ids, text, max_tokens))
        overrides = body.sampling_overrides()
        if body.logprobs is not None:
            overrides["logprobs"] = body.logprobs
        specs = self._specs(prompts, body.n, overrides)
        rid = f"cmpl-{uuid.uuid4().hex}"
        group = await self._submit(specs, rid, arrival)
        prompt_tokens = sum(len(ids) for ids, _, _ in prompts)
        if body.stream:
            offsets = [0] * len(specs)

            def render(idx: int, out: RequestOutput) -> list[tuple[dict[str, Any], bool]]:
                lp = None
                if body.logprobs is not None and out.delta_token_ids:
                    k = len(out.delta_token_ids)
                    lp = self._completion_logprobs(out.delta_token_ids,
                                                   (out.logprobs or [])[-k:], offsets[idx])
                offsets[idx] += len(out.delta_text)
                if not (out.delta_text or lp or out.finished):
                    return []  # bytes of an unfinished character: nothing to show
                return [({"index": idx, "text": out.delta_text, "logprobs": lp,
                          "finish_reason": _finish_reason(out)}, True)]

            return self._stream(body, group, specs, rid, "text_completion", prompt_tokens,
                                render)

        created = int(time.time())
        model = self.config.served_model_name

        finals = await self._collect(request, group)
        choices = []
        for idx, out in enumerate(finals):
            lp = None
            if body.logprobs is not None:
                lp = self._completion_logprobs(out.token_ids, out.logprobs or [], 0)
            choices.append({"index": idx, "text": out.text, "logprobs": lp,
                            "finish_reason": _finish_reason(out)})
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices,
            "usage": _usage(prompt_tokens, sum(len(o.token_ids) for o in finals))})

    def _stream(self, body: Any, group: RequestGroup, specs: list[PromptSpec], rid: str,
                obj: str, prompt_tokens: int,
                render: Callable[[int, RequestOutput], list[tuple[dict[str, Any], bool]]]
                ) -> SSEResponse:
        """SSE for a group: the choices ``render`` makes of each output (those marked True
        carry the choice's usage so far, with continuous_usage_stats), then, with
        include_usage, the usage chunk with the engine's per-choice ``timings``, then
        ``[DONE]``. An engine failure ends the stream with an error event."""
        created = int(time.time())
        model = self.config.served_model_name

        def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> dict:
            out: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                   "model": model, "choices": choices}
            if body.include_usage:
                out["usage"] = usage
            return out

        async def events() -> AsyncIterator[str]:
            completion_tokens = 0
            timings: dict[int, dict[str, Any]] = {}
            try:
                async for idx, out in group:
                    if out.finished:
                        completion_tokens += len(out.token_ids)
                        timings[idx] = _timing(idx, out)
                    running = (_usage(len(specs[idx].token_ids), len(out.token_ids))
                               if body.continuous_usage else None)
                    for choice, counted in render(idx, out):
                        yield _sse(chunk([choice], running if counted else None))
                if body.include_usage:
                    yield _sse(dict(chunk([], _usage(prompt_tokens, completion_tokens)),
                                    timings=[timings[i] for i in sorted(timings)]))
            except (EngineError, EngineStopped) as e:
                yield _error_event(e)
            finally:
                group.close()
            yield "data: [DONE]\n\n"

        return SSEResponse(events(), group.close)

    async def _collect(self, request: Request, group: RequestGroup) -> list[RequestOutput]:
        """Wait for every request of the group to finish (aborting them if the client
        leaves first); the final outputs in group order."""
        finals: list[RequestOutput | None] = [None] * len(group.request_ids)

        async def run() -> None:
            try:
                async for idx, out in group:
                    if out.finished:
                        finals[idx] = out
            finally:
                group.close()

        try:
            await _unless_disconnected(request, run())
        except (EngineError, EngineStopped) as e:
            raise ApiError(500 if isinstance(e, EngineError) else 503, str(e),
                           type="server_error") from e
        except ClientGone as e:  # nobody is listening; the status is for the access log
            raise ApiError(499, "the client disconnected", code="client_disconnected") from e
        return [f for f in finals if f is not None]

    # -- chat ------------------------------------------------------------------------------
    async def _chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._check_model(body.model)
        text = self._render_chat(body.messages, body.add_generation_prompt,
                                 body.continue_final_message, body.chat_template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._check_ids(ids, "messages")
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = self._output_budget(len(ids), body.output_limit, "messages", limit_param)
        overrides = body.sampling_overrides()
        top_n = body.num_logprobs
        if top_n is not None:
            overrides["logprobs"] = top_n
        specs = self._specs([(ids, text, max_tokens)], body.n, overrides)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        group = await self._submit(specs, rid, arrival)
        if body.stream:
            started = [False] * len(specs)

            def render(idx: int, out: RequestOutput) -> list[tuple[dict[str, Any], bool]]:
                chunks: list[tuple[dict[str, Any], bool]] = []
                if not started[idx]:  # the role first, as OpenAI streams it
                    started[idx] = True
                    chunks.append(({"index": idx, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}, False))
                lp = None
                if top_n is not None and out.delta_token_ids:
                    k = len(out.delta_token_ids)
                    lp = self._chat_logprobs(out.delta_token_ids, (out.logprobs or [])[-k:],
                                             top_n)
                if out.delta_text or lp or out.finished:
                    delta = {"content": out.delta_text} if out.delta_text else {}
                    chunks.append(({"index": idx, "delta": delta, "logprobs": lp,
                                    "finish_reason": _finish_reason(out)}, True))
                return chunks

            return self._stream(body, group, specs, rid, "chat.completion.chunk", len(ids),
                                render)

        created = int(time.time())
        model = self.config.served_model_name

        finals = await self._collect(request, group)
        choices = []
        for idx, out in enumerate(finals):
            lp = None
            if top_n is not None:
                lp = self._chat_logprobs(out.token_ids, out.logprobs or [], top_n)
            choices.append({"index": idx, "message": {"role": "assistant", "content": out.text},
                            "logprobs": lp, "finish_reason": _finish_reason(out)})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices,
            "usage": _usage(len(ids), sum(len(o.token_ids) for o in finals))})


_FIELD_NAMES = frozenset(name for model in (CompletionRequest, ChatCompletionRequest,
                                            TokenizeRequest, DetokenizeRequest)
                         for name in model.model_fields)

_UNION_FIELDS = {
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


def _is_type_tag(part: str) -> bool:
    """pydantic's union branch labels in an error location (``str``, ``list[int]``, ...)."""
    return part in ("str", "int", "float", "bool") or "[" in part or part.startswith(
        ("function-", "constrained-"))


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
