"""The internal API a router calls on the workers behind it (``phasewise.disagg.router``).

Every route here is behind ``--api-key`` like ``/v1/*`` (``guard``) and left out of the
OpenAPI document: it is phasewise's own, not OpenAI's.

* ``GET /internal/v1/info``: what a router must share with this worker (the checkpoint's
  ``config.json`` and ``tokenizer.json`` hashes), its limits (``BackendInfo``), its sampling
  defaults and its role.
* ``GET /internal/v1/load``: the engine's latest snapshot, for routing by load; with
  ``kv_epoch`` (and ``kv_since``), what its prefix cache stored and evicted since then
  (``phasewise.cache.kv_events``), for routing by cached prefix.
* ``POST /internal/v1/generate``: a group of already tokenized prompts with their sampling
  parameters; the reply streams one JSON line per output (``phasewise.engine.relay``). The
  same checks as ``/v1/*`` apply (token ids, context, every parameter); closing the
  connection aborts the group. The parameters are checked as ``SamplingParams`` checks them
  (a flag must be a JSON boolean); a 400 names the parameter (``specs.0.params.ignore_eos``).
  A failure after the reply began ends it with an ``{"error": ...}`` line. A spec's
  ``resume`` (a router migrating the request here, with ``moved``: it is not judged by this
  worker's SLO targets again) holds the outputs another worker streamed; this one goes on
  from them. The client's SLO targets come as ``slo_ttft_ms``/``slo_tpot_ms`` (a refusal
  is a 429 the router takes to the next worker). When this server starts to drain, each
  open stream of a router that asked (``handover``) gets a ``{"notice": "handover"}`` line
  (``phasewise.engine.relay``) and runs on until its router moves it or it ends.
* ``POST /internal/v1/abort``: abort requests of a relay group by id, with the group's
  ``abort_key``: the secret its router sent with ``/internal/v1/generate``. Only that group's
  requests can be aborted so: never a ``/v1`` client's, whose ids another client may learn
  (the dashboard shows them), nor another router's.
* ``POST /internal/v1/park``: park (``"parked": true``) or release requests of a relay group
  by id, with its ``abort_key``: the router's client fell behind on them (the router reads on
  and merges, so the worker cannot see it; ``RequestGroup``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from phasewise.engine.backend import (EngineError, EngineStopped, GrammarFailed, PromptSpec,
                                      RequestGroup, ServingBackend)
from phasewise.engine.relay import (MEDIA_TYPE, checkpoint_identity, encode_error,
                                    encode_notice, encode_output, param_defaults,
                                    params_from_wire)
from phasewise.engine.slo import SLO, SLO_MS_MAX, SLO_MS_MIN
from phasewise.engine.validation import ValidationError
from phasewise.server.errors import ApiError
from phasewise.server.guard import access_record
from phasewise.server.openai_format import timing
from phasewise.server.protocol import Float, Str, _Checked
from phasewise.server.routes import Routes
from phasewise.server.sse import SSEResponse

# A router's request ids: the ones its own routes make (``cmpl-<hex>``, ``chatcmpl-<hex>``).
_ID_PATTERN = r"^[A-Za-z0-9._:-]+$"


class RelaySpec(_Checked):
    """One request: its prompt's ``token_ids``, or ``same_as``: the index of an earlier spec
    whose prompt it shares (n samples of one prompt cross the wire once)."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int] | None = Field(default=None, min_length=1)
    same_as: int | None = Field(default=None, ge=0)
    params: dict[str, Any]
    # params as the fields that differ from an earlier spec's (n samples of one request
    # differ in their seeds at most; a schema crosses once, not once per sample)
    params_from: int | None = Field(default=None, ge=0)
    prompt: Str | None = None
    resume: list[int] | None = None


class RelayRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200, pattern=_ID_PATTERN)
    specs: list[RelaySpec] = Field(min_length=1)
    # the client's SLO targets, as the router admitted them (this worker's own apply where
    # none is given); a refusal is a 429 the router takes to the next worker
    slo_ttft_ms: Float | None = Field(None, ge=SLO_MS_MIN, le=SLO_MS_MAX)
    slo_tpot_ms: Float | None = Field(None, ge=SLO_MS_MIN, le=SLO_MS_MAX)
    # a stream the router moved here from another worker: admitted already
    moved: bool = False
    # the router moves a stream on a drain notice (an older one would not read the line)
    handover: bool = False
    # the secret /internal/v1/abort must show to abort this group's requests (none: they
    # cannot be aborted by id, only by closing this stream)
    abort_key: str | None = Field(None, min_length=16, max_length=128,
                                  pattern=r"^[A-Za-z0-9_-]+$")


class AbortRelay(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_ids: list[str] = Field(min_length=1, max_length=4096)
    abort_key: str = Field(min_length=16, max_length=128)


class ParkRelay(AbortRelay):
    parked: bool


class NDJSONResponse(SSEResponse):
    """The relay stream: one JSON line per output, aborted as soon as the router goes."""

    media_type = MEDIA_TYPE


def add_internal_routes(app: FastAPI, backend: ServingBackend, routes: Routes, *,
                        role: str, served_model_name: str,
                        is_draining: Any) -> Callable[[], None]:
    """Add the routes; returns what to call (on the event loop) when draining begins: it
    tells every open relay stream that it may be handed over."""
    identity = checkpoint_identity(Path(backend.info.model_path))
    # this process's own: a router that sees it change knows the worker restarted, perhaps
    # with another checkpoint or other limits, and checks it again before routing to it
    instance = secrets.token_hex(8)
    relays: set[RequestGroup] = set()  # the groups whose streams are open now
    abort_keys: dict[str, str] = {}  # open relay requests' ids -> their group's abort_key

    def handover() -> None:
        for group in list(relays):
            group.notify("handover")

    @app.get("/internal/v1/info", include_in_schema=False)
    async def info() -> dict[str, Any]:
        return {"role": role, "served_model_name": served_model_name,
                "info": dataclasses.asdict(backend.info),
                # the tokens a prefix-cache block holds: a router hashes prompts alike
                "kv_block_size": getattr(backend, "block_size", None),
                # the window every layer shares: a hit needs only the blocks it reads
                "kv_window": getattr(backend, "kv_window", None),
                "defaults": param_defaults(backend.default_sampling_params()),
                "instance": instance, **identity}

    @app.get("/internal/v1/load", include_in_schema=False)
    async def load(kv_since: int | None = Query(None, ge=0, le=2**62),
                   kv_epoch: str | None = Query(None, max_length=64)) -> Any:
        alive = backend.is_alive
        out = {"role": role, "instance": instance, "alive": alive,
               "draining": bool(is_draining()),
               "open_groups": backend.num_open_groups,
               "snapshot": dataclasses.asdict(backend.snapshot)}
        if not alive:  # why, for the router's /health and log
            out["down_reason"] = backend.down_reason
        events = getattr(backend, "kv_events", None)
        if kv_epoch is None or events is None:
            return out

        def answer() -> bytes:
            # What the prefix cache stored and evicted since the caller's last look (a
            # router's index of who holds what); everything it holds where that is older:
            # as many hashes as the pool has blocks, so built off the event loop.
            out["kv_events"] = events(kv_since, kv_epoch)
            return json.dumps(out).encode()

        return Response(await asyncio.to_thread(answer), media_type="application/json")

    @app.post("/internal/v1/abort", include_in_schema=False)
    async def abort(body: AbortRelay) -> dict[str, Any]:
        mine = [rid for rid in dict.fromkeys(body.request_ids)
                if rid in abort_keys and hmac.compare_digest(abort_keys[rid].encode(),
                                                             body.abort_key.encode())]
        backend.abort(mine)
        return {"aborted": len(mine)}

    @app.post("/internal/v1/park", include_in_schema=False)
    async def park(body: ParkRelay) -> dict[str, Any]:
        """The router's client fell behind on (or caught up with) these requests of its
        relay group (``RequestGroup`` parks them on the router, which reads on): park them
        here, or run them on. Like an abort, only with the group's ``abort_key``."""
        mine = [rid for rid in dict.fromkeys(body.request_ids)
                if rid in abort_keys and hmac.compare_digest(abort_keys[rid].encode(),
                                                             body.abort_key.encode())]
        if mine:
            backend.park(mine, body.parked)
        return {"parked" if body.parked else "released": len(mine)}

    def check(body: RelayRequest) -> list[PromptSpec]:
        """On a worker thread: a body of n long prompts is work the size of the request."""
        routes._check_sequences(len(body.specs), 1)
        specs: list[PromptSpec] = []
        wires: list[dict[str, Any]] = []  # each spec's whole parameters, as sent or rebuilt
        for i, s in enumerate(body.specs):
            where = f"specs.{i}"
            wire = s.params
            if s.params_from is not None:
                if s.params_from >= i:
                    raise ApiError(400, f"{where}.params_from must name an earlier spec "
                                   f"(< {i})", param=f"{where}.params_from")
                wire = {**wires[s.params_from], **s.params}
            wires.append(wire)
            if (s.token_ids is None) == (s.same_as is None):
                raise ApiError(400, f"{where}: give exactly one of token_ids or same_as",
                               param=where)
            if s.token_ids is not None:
                ids = routes._ids(s.token_ids, f"{where}.token_ids")
            elif s.same_as < i:
                ids = specs[s.same_as].token_ids
            else:
                raise ApiError(400, f"{where}.same_as must name an earlier spec (< {i})",
                               param=f"{where}.same_as")
            try:
                params = params_from_wire(wire)
            except (ValueError, TypeError) as e:
                param = f"{where}.params"
                if isinstance(e, ValidationError) and e.param:
                    param = f"{param}.{e.param}"
                raise ApiError(400, f"{param}: {e}", param=param) from e
            if params.stop_token_ids:  # as /v1 checks them: ids of this vocabulary
                routes._ids(list(params.stop_token_ids), f"{where}.params.stop_token_ids")
            routes._budget(len(ids), params.max_tokens, f"{where}.token_ids",
                           f"{where}.params.max_tokens", min_max_tokens=0)
            resume = (tuple(routes._ids(s.resume, f"{where}.resume")) if s.resume
                      else ())  # the engine checks they could have been its outputs
            specs.append(PromptSpec(ids, params, s.prompt, resume=resume))
        return specs

    @app.post("/internal/v1/generate", include_in_schema=False, response_model=None)
    async def generate(request: Request) -> Response:
        arrival = time.monotonic()
        body = await routes.body("RelayRequest", request)
        specs = await routes._off_loop(check, body)
        for i, s in enumerate(specs):  # checked as this worker's engine will run it
            if s.params.structured_output is not None and \
                    s.params.structured_output not in (x.params.structured_output
                                                       for x in specs[:i]):
                # every relayed request comes from the router, which gave each client its
                # share of the checks already
                await routes._constrain({}, f"specs.{i}.params.structured_output",
                                        s.params.structured_output, per_client=False)
        rec = access_record(request.scope)
        rec.request_id = body.request_id
        rec.prompt_tokens = sum(len(s.token_ids) for s in specs)
        slo = SLO.from_ms(body.slo_ttft_ms, body.slo_tpot_ms).over(
            None if body.moved else routes.default_slo)
        group = await routes._submit(specs, body.request_id, arrival,
                                     slo if slo.any else None)
        if body.abort_key is not None:
            for rid in group.request_ids:
                abort_keys[rid] = body.abort_key

        produced: dict[int, int] = {}
        if body.handover:
            relays.add(group)
            if is_draining():  # began while this one was admitted: it missed the notice
                group.notify("handover")

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for idx, out in group:
                    if idx < 0:  # a notice for the router (see handover)
                        yield encode_notice(str(out))
                        continue
                    first = idx not in produced
                    produced[idx] = len(out.token_ids)
                    rec.output_tokens = sum(produced.values())
                    if rec.ttft_s is None and out.metrics.ttft is not None:
                        rec.ttft_s = out.metrics.ttft
                    yield encode_output(idx, out, timing(idx, out) if out.finished else None,
                                        first=first)
            except EngineStopped as e:
                yield encode_error("stopped", str(e))
            except GrammarFailed as e:
                yield encode_error("grammar", str(e))
            except EngineError as e:
                yield encode_error("engine", str(e))
            finally:
                close()

        def close() -> None:
            relays.discard(group)
            for rid in group.request_ids:
                abort_keys.pop(rid, None)
            group.close()

        return NDJSONResponse(lines(), close, lambda e: encode_error(
            "engine", f"internal error: {type(e).__name__}: {e}"))

    return handover
