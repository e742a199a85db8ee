"""The OpenAI-compatible HTTP API over a ``ServingBackend``: the app's assembly.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``
(``responses``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``,
``GET /version``, ``GET /openapi.json``; ``/dashboard`` (the live page, ``dashboard``); and
``/internal/v1/*``, which a router calls (``internal``).

The jobs live in their own modules: ``guard`` (API key, draining, body size; the access log),
``protocol`` (request bodies and their bounds), ``errors`` (``ApiError`` and the 400s that name
the field), ``routes`` (the handlers), ``openai_format`` (response shapes) and ``sse``
(streaming). The server talks only to the ``ServingBackend`` protocol
(``phasewise.engine.backend``): never to ``LLMEngine``, its scheduler or its KV manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.encoders import jsonable_encoder
from fastapi.openapi.models import OpenAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import phasewise
from phasewise.engine.backend import ServingBackend
from phasewise.engine.slo import SLO, check_slo_ms
from phasewise.server.bodies import component_schemas, request_body
from phasewise.server.dashboard import add_dashboard_routes
from phasewise.server.dashboard.hub import Hub
from phasewise.server.errors import ApiError, error_response, validation_error
from phasewise.server.guard import AccessLog, Guard
from phasewise.server.limits import ClientContext, accept_error_handler
from phasewise.server.internal import add_internal_routes
from phasewise.server.metrics import PrometheusMetrics, RefusalCollector
from phasewise.server.protocol import ErrorBody
from phasewise.server import responses as responses_api
from phasewise.server.routes import Routes

log = logging.getLogger("phasewise.server")


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP layer behaves. ``max_waiting_requests``: requests (choices) allowed to
    wait for the engine before new ones get 503; ``max_request_bytes``: body size limit;
    ``access_log``: one log line per request."""

    served_model_name: str
    api_key: str | None = None
    # the fleet's own key for /internal/* (a router and its workers; --internal-key-file)
    internal_key: str | None = None
    max_waiting_requests: int = 256
    max_request_bytes: int = 8 * 2**20
    retry_after_s: int = 1
    access_log: bool = True
    role: str = "both"  # what /internal/v1/info tells a router
    # Admission by SLO (phasewise.engine.slo): targets for requests that give none
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got "
                             f"{self.max_waiting_requests}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            if getattr(self, name) is not None:
                check_slo_ms(getattr(self, name), "--" + name.replace("_", "-"))


_ERROR = {"model": ErrorBody}
_JSON_OR_SSE = {"content": {"application/json": {"schema": {"type": "object"}},
                            # each event: a JSON chunk in "data", then "[DONE]"
                            "text/event-stream": {"schema": {
                                "type": "object", "required": ["data"],
                                "properties": {"data": {"type": "string"}}}}},
                "description": "a JSON body, or server-sent events with \"stream\": true"}
_POST_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "invalid request: error.param names the field"},
    401: {**_ERROR, "description": "missing or invalid API key (with --api-key)"},
    404: {**_ERROR, "description": "unknown model"},
    413: {**_ERROR, "description": "request body too large"},
    500: {**_ERROR, "description": "engine failure"},
    429: {**_ERROR, "description": "refused at admission: the server predicts the request "
          "would miss its SLO target (Retry-After)"},
    503: {**_ERROR, "description": "overloaded (Retry-After) or shutting down"},
}


class OpenAIServer:
    """Builds the FastAPI app around a backend; ``app`` is the ASGI entry point."""

    def __init__(self, backend: ServingBackend, config: ServerConfig,
                 metrics: PrometheusMetrics | None = None, dashboard: Hub | None = None,
                 trace_lookup: Any = None) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.dashboard = dashboard
        self.trace_lookup = trace_lookup
        self.draining = False
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.routes = Routes(backend, config.served_model_name,
                             retry_after_s=config.retry_after_s,
                             default_slo=SLO.from_ms(config.slo_ttft_ms, config.slo_tpot_ms))
        if metrics is not None:
            metrics.registry.register(RefusalCollector(self.routes.refused,
                                                       config.served_model_name))
        self.fastapi = self._build()
        guarded = Guard(self.fastapi, api_key=config.api_key,
                        max_request_bytes=config.max_request_bytes,
                        is_draining=lambda: self.draining, internal_key=config.internal_key)
        self.access_log = AccessLog(guarded, enabled=config.access_log)
        self.app: Any = ClientContext(self.access_log)

    @property
    def max_model_len(self) -> int:
        return self.backend.info.max_model_len

    # -- shutdown --------------------------------------------------------------------------
    def begin_drain(self) -> None:
        """Refuse new requests; running ones go on, and a router's are offered to it for
        hand-over to another worker (any thread)."""
        self.draining = True
        self.backend.stop_accepting()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._hand_over)
            if self.dashboard is not None:
                self.loop.call_soon_threadsafe(self.dashboard.close)  # its pages' streams end

    def end_open_streams(self, grace_s: float) -> None:
        """The grace period is over: every request still open ends now, its stream with an
        error event that names the shutdown, then ``[DONE]``."""
        n = self.backend.num_open_groups
        if n:
            log.warning("shutdown: the %.0f s grace period ran out; ending %d open "
                        "request(s) with an error", grace_s, n)
        self.backend.abort_all(f"the server is shutting down: the {grace_s:.0f} s grace "
                               "period ended before this response finished")

    # -- the app ---------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        routes = self.routes

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            self.loop = asyncio.get_running_loop()
            self.loop.set_exception_handler(accept_error_handler(log))
            self.backend.start(self.loop)
            try:
                yield
            finally:
                await asyncio.to_thread(self.backend.shutdown)
                routes.close()

        app = FastAPI(title="phasewise", version=phasewise.__version__, lifespan=lifespan,
                      docs_url=None, redoc_url=None,
                      description="OpenAI-compatible API of phasewise. Every error is "
                      "{\"error\": {\"message\", \"type\", \"param\", \"code\"}}.")

        @app.exception_handler(ApiError)
        async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
            return error_response(exc)

        @app.exception_handler(RequestValidationError)
        async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            return error_response(validation_error(exc))

        @app.exception_handler(StarletteHTTPException)
        async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return error_response(ApiError(exc.status_code, f"{exc.detail}: {request.method} "
                                           f"{request.url.path}", code=code,
                                           headers=dict(exc.headers or {})))

        @app.exception_handler(Exception)
        async def on_bug(request: Request, exc: Exception) -> JSONResponse:
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                           type="server_error"))

        @app.api_route("/health", methods=["GET", "HEAD"], response_model=None, responses={
            200: {"content": {"application/json": {"schema": {"type": "object"}}}},
            503: {**_ERROR, "description": "the engine is down or stuck in one step, or the "
                  "server is draining"}})
        async def health() -> Response:
            if not self.backend.is_alive:
                return error_response(ApiError(503, self.backend.down_reason,
                                               type="server_error"))
            if self.draining:  # load balancers stop sending here while streams finish
                return error_response(ApiError(503, "the server is draining",
                                               type="server_error", code="shutting_down"))
            detail = getattr(self.backend, "health_detail", None)
            return JSONResponse({"status": "ok", **(detail() if detail else {})})

        @app.api_route("/health/engine", methods=["GET", "HEAD"], response_model=None,
                       responses={
                           200: {"content": {"application/json": {"schema": {
                               "type": "object"}}}},
                           404: {**_ERROR, "description": "no engine runs in this process "
                                 "(a router)"},
                           503: {**_ERROR, "description": "this process's engine is down or "
                                 "stuck in one step"}})
        async def engine_health() -> Response:
            """This process's own engine only (a liveness probe's question: would a restart
            help?): unlike ``/health``, not whether other processes (a prefill worker's decode
            workers) answer, and not draining."""
            check = getattr(self.backend, "engine_health", None)
            if check is None:
                return error_response(ApiError(404, "no engine runs in this process (a "
                                               "router); /health says whether its workers "
                                               "answer", code="unsupported_endpoint"))
            why = check()
            if why is not None:
                return error_response(ApiError(503, why, type="server_error"))
            return JSONResponse({"status": "ok"})

        @app.get("/version", response_model=None)
        async def version() -> dict[str, str]:
            return {"version": phasewise.__version__}

        @app.get("/metrics", response_model=None, response_class=Response, responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                  "description": "Prometheus text exposition format"},
            404: {**_ERROR, "description": "metrics are disabled"}})
        async def metrics() -> Response:
            if self.metrics is None:
                raise ApiError(404, "metrics are disabled on this server")
            return Response(generate_latest(self.metrics.registry),
                            media_type=CONTENT_TYPE_LATEST)

        def model_card() -> dict[str, Any]:
            return {"id": self.config.served_model_name, "object": "model",
                    "created": self.created, "owned_by": "phasewise",
                    "root": self.backend.info.model_path, "max_model_len": self.max_model_len}

        @app.get("/v1/models", response_model=None, responses={401: _POST_ERRORS[401]})
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [model_card()]}

        @app.get("/v1/models/{model_id:path}", response_model=None,
                 responses={401: _POST_ERRORS[401], 404: _POST_ERRORS[404]})
        async def model(model_id: str) -> dict[str, Any]:
            routes.check_model(model_id)
            return model_card()

        @app.get("/tokenizer_info", response_model=None, responses={401: _POST_ERRORS[401]})
        async def tokenizer_info() -> dict[str, Any]:
            """vLLM's route: what a client needs to tokenize and template as this server does
            (lm-eval's remote tokenizer reads it, then calls /tokenize and /detokenize)."""
            return routes.tokenizer_info()

        # Each body is parsed and validated by routes.body (``bodies``: a large one in a child
        # process, never on the event loop); the OpenAPI document describes it as FastAPI
        # would a body parameter.
        @app.post("/tokenize", response_model=None, responses=_POST_ERRORS,
                  openapi_extra=request_body("TokenizeRequest",
                                             ["TokenizePrompt", "TokenizeChat"]))
        async def tokenize(request: Request) -> Response:
            return await routes.tokenize(await routes.body("TokenizeRequest", request),
                                         request)

        @app.post("/detokenize", response_model=None, responses=_POST_ERRORS,
                  openapi_extra=request_body("DetokenizeRequest"))
        async def detokenize(request: Request) -> Response:
            return await routes.detokenize(await routes.body("DetokenizeRequest", request),
                                           request)

        @app.post("/v1/completions", response_model=None,
                  responses={200: _JSON_OR_SSE, **_POST_ERRORS},
                  openapi_extra=request_body("CompletionRequest"))
        async def completions(request: Request) -> Response:
            return await routes.completions(await routes.body("CompletionRequest", request),
                                            request)

        @app.post("/v1/chat/completions", response_model=None,
                  responses={200: _JSON_OR_SSE, **_POST_ERRORS},
                  openapi_extra=request_body("ChatCompletionRequest"))
        async def chat(request: Request) -> Response:
            return await routes.chat(await routes.body("ChatCompletionRequest", request),
                                     request)

        @app.post("/v1/responses", response_model=None,
                  responses={200: _JSON_OR_SSE, **_POST_ERRORS},
                  openapi_extra=request_body("ResponsesRequest"))
        async def responses(request: Request) -> Response:
            return await responses_api.create(
                routes, await routes.body("ResponsesRequest", request), request)

        @app.api_route("/v1/responses/{response_id:path}", methods=["GET", "DELETE"],
                       response_model=None, responses={401: _POST_ERRORS[401], 404: {
                           **_ERROR, "description": "no response is stored"}})
        async def stored_response(response_id: str) -> Response:
            """Not served: phasewise stores no responses (``store`` is ignored), so there is
            none to fetch, cancel or delete: always a 404 that says so."""
            shown = response_id[:64] + ("..." if len(response_id) > 64 else "")
            raise ApiError(404, f"no response {shown!r} is stored: phasewise stores no "
                           "responses (store is ignored); send the whole conversation as "
                           "input instead", code="not_found")

        @app.post("/v1/embeddings", response_model=None, responses={
            401: _POST_ERRORS[401],
            404: {**_ERROR, "description": "not served: phasewise serves text generation "
                  "only (error.code unsupported_endpoint)"}})
        async def embeddings() -> Response:
            """Not served: phasewise serves text generation only. Always a 404 whose
            ``error.code`` is ``unsupported_endpoint`` (a client error, which OpenAI's SDKs
            do not retry), never a server error."""
            raise ApiError(404, "embeddings are not served: phasewise serves text generation "
                           "only (/v1/completions, /v1/chat/completions, /v1/responses); use "
                           "an embedding model's server for /v1/embeddings",
                           code="unsupported_endpoint")

        if self.dashboard is not None:
            add_dashboard_routes(app, self.dashboard, routes, api_key=self.config.api_key,
                                 trace_lookup=self.trace_lookup)

        # (a router's streams from here are offered for hand-over when draining begins)
        self._hand_over = add_internal_routes(
            app, self.backend, routes, role=self.config.role,
            served_model_name=self.config.served_model_name,
            is_draining=lambda: self.draining)

        def openapi() -> dict[str, Any]:
            """FastAPI documents a 422 for every body; this server answers 400 instead."""
            if app.openapi_schema is None:
                schema = get_openapi(title=app.title, version=app.version,
                                     description=app.description, routes=app.routes)
                for ops in schema.get("paths", {}).values():
                    for op in ops.values():
                        op.get("responses", {}).pop("422", None)
                comps = schema.setdefault("components", {}).setdefault("schemas", {})
                for name, body in component_schemas().items():
                    comps.setdefault(name, body)
                # as get_openapi writes its own: through the OpenAPI model, nulls dropped
                schema = jsonable_encoder(OpenAPI(**schema), by_alias=True, exclude_none=True)
                comps = schema["components"]["schemas"]
                comps.pop("HTTPValidationError", None)
                comps.pop("ValidationError", None)
                self._narrow_to_model(comps)
                app.openapi_schema = schema
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]
        return app

    def _narrow_to_model(self, comps: dict[str, Any]) -> None:
        """The document describes this server: token ids (a prompt's, stop_token_ids) below
        its vocabulary size, token lists no longer than its context."""
        info = self.backend.info

        def narrow(ids_schema: dict[str, Any]) -> None:
            ids_schema.setdefault("items", {})["maximum"] = info.vocab_size - 1
            ids_schema["maxItems"] = info.max_model_len - 1

        for alt in comps["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
            if alt.get("type") == "array":
                items = alt.get("items", {})
                narrow(items if items.get("type") == "array" else alt)
        comps["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = \
            info.vocab_size - 1
        for comp in comps.values():  # every request's stop_token_ids: ids of this vocabulary
            stop = comp.get("properties", {}).get("stop_token_ids")
            for alt in (stop or {}).get("anyOf", [stop] if stop else []):
                if alt.get("type") == "array":
                    alt.setdefault("items", {})["maximum"] = info.vocab_size - 1
