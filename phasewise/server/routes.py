"""The request handlers behind each route: validate, tokenize (off the event loop), submit to
the ``ServingBackend``, and answer through one response builder shared by completions and
chat (a stream, or one JSON body once every choice has finished)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from fastapi.responses import Response

from phasewise.engine.backend import (EngineError, EngineOverloaded, EngineStopped,
                                      EngineUnavailable, PromptSpec, RequestGroup,
                                      SLORefused,
                                      ServingBackend)
from phasewise.engine.outputs import RequestOutput
from phasewise.engine.slo import SLO, SLO_MS_MAX, SLO_MS_MIN, check_slo_ms
from phasewise.engine.sampling_params import SamplingParams, wrap_seed
from phasewise.engine.structured import spec_json
from phasewise.server import jsontext
from phasewise.server import tools as tools_mod
from phasewise.engine.validation import ValidationError, check_token_ids
from phasewise.server import admission
from phasewise.server.bodies import BodyParser
from phasewise.server.errors import ApiError
from phasewise.server.grammar_check import GrammarChecker, Overloaded
from phasewise.server.guard import access_record
from phasewise.server.limits import CLIENT
from phasewise.server.openai_format import (ChatChoices, CompletionChoices,
                                            cached_prompt_tokens, usage)
from phasewise.server.protocol import (COMBINATION, GRAMMAR, TEMPLATE,
                                       ChatCompletionRequest,
                                       CompletionRequest,
                                       DetokenizeRequest, TokenizeChat, TokenizeRequest)
from phasewise.server.sse import (OFF_LOOP_ENTRIES, share_prompt_logprobs, stream_group,
                                  whole_cost)

T = TypeVar("T")
# /tokenize and /detokenize requests up to this many characters (a quarter as many token
# ids) run in a pool apart from larger ones.
TOKENIZE_SMALL_CHARS = 16_384
GRAMMAR_CHECK_S = 5.0  # a structured output's check (compile, first masks), at most
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# A text longer than this many characters per context token cannot fit, whatever it holds:
# a token covers at most ``max_token_chars`` characters. The factor 2 leaves room for
# normalizers that compose characters (NFC/NFKC) before tokenizing.
_CHAR_MARGIN = 2


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _ints_json(ids: list[int], piece: int = 16_384) -> str:
    """The JSON array of ``ids``, written a piece at a time: one ``json.dumps`` of millions
    of ids is a single call that holds the GIL (0.34 s for 4M), the pieces let other threads
    (the event loop's, the engine's) in between."""
    return "[" + ",".join([",".join(map(str, ids[i:i + piece]))
                           for i in range(0, len(ids), piece)]) + "]"


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


class Routes:
    """Handlers for one backend. ``served_model_name`` is the name clients must send."""

    def __init__(self, backend: ServingBackend, served_model_name: str, *,
                 retry_after_s: int = 1, tokenizer_threads: int = 2,
                 default_slo: SLO | None = None) -> None:
        self.backend = backend
        self.retry_after_s = retry_after_s
        # Admission by SLO: the server's targets (--slo-ttft-ms/--slo-tpot-ms), which a
        # request's own replace; and the requests refused for them, by reason.
        self.default_slo = default_slo if default_slo is not None and default_slo.any else None
        self.refused: dict[str, int] = {"slo_ttft": 0, "slo_tpot": 0}
        self.tokenizer = backend.tokenizer
        self.served_model_name = served_model_name
        info = backend.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.max_prompt_chars = (info.max_model_len * self.tokenizer.max_token_chars
                                 * _CHAR_MARGIN)
        # Tokenizing and chat templating run here, never on the event loop. /tokenize and
        # /detokenize (not bounded by the context length) get pools of their own, so a huge
        # one cannot hold up the prompts of generation requests; and a large one goes to a
        # pool apart from small ones, so it holds up only other large ones.
        self.cpu = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="phasewise-tok")
        self.cpu_tools = ThreadPoolExecutor(1, thread_name_prefix="phasewise-tokenize")
        self.cpu_tools_large = ThreadPoolExecutor(1, thread_name_prefix="phasewise-tokenize-l")
        # Large replies (logprobs of long prompts, of many choices) are built one at a time:
        # building one holds the GIL, which the engine thread needs between its kernels, and
        # each more thread doing so at once lengthens every stream's gaps
        # (benchmarks/bench_fairness.py --scoring measures them).
        self.render = ThreadPoolExecutor(1, thread_name_prefix="phasewise-render")
        self._texts: dict[int, str] = {}  # token id -> its text (bounded by the vocabulary)
        self._grammar_checker: GrammarChecker | None = None  # structured output's
        self.max_waiting = info.max_waiting
        self.limits = admission.Limits(self.max_model_len, self.max_prompt_chars,
                                       self.max_waiting)
        self.bodies = BodyParser(self.limits)

    async def body(self, name: str, request: Request) -> Any:
        """The request's body as the model ``name`` (``bodies.BodyParser``: validated off the
        event loop when it is large)."""
        try:
            raw = await request.body()
        except ClientDisconnect:  # it left (or --timeout-body closed it) mid-body
            raise ApiError(499, "the client disconnected before its body arrived",
                           code="client_disconnected") from None
        return await self.bodies.parse(name, raw)

    def close(self) -> None:
        self.cpu.shutdown(wait=False, cancel_futures=True)
        self.cpu_tools.shutdown(wait=False, cancel_futures=True)
        self.cpu_tools_large.shutdown(wait=False, cancel_futures=True)
        self.render.shutdown(wait=False, cancel_futures=True)
        if self._grammar_checker is not None:
            self._grammar_checker.close()
        self.bodies.close()

    async def _off_loop(self, fn: Callable[..., T], *args: Any,
                        pool: ThreadPoolExecutor | None = None) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool or self.cpu, fn, *args)

    # -- checks ----------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", param="model", code="model_not_found")

    def _check_chars(self, n_chars: int, param: str, label: str | None = None) -> None:
        admission.check_chars(n_chars, param, self.limits, label)

    def _check_sequences(self, num_prompts: int, n: int) -> None:
        admission.check_sequence_count(num_prompts, n, self.limits)

    @staticmethod
    def _invalid(e: ValidationError, param: str | None = None,
                 code: str | None = None) -> ApiError:
        return ApiError(400, str(e), param=param or e.param, code=code)

    def _ids(self, ids: list[int], param: str) -> list[int]:
        try:
            return check_token_ids(ids, self.vocab_size, param)
        except ValidationError as e:
            raise self._invalid(e) from e

    def _budget(self, n_prompt: int, max_tokens: int | None, param: str,
                limit_param: str, min_max_tokens: int = 1, label: str | None = None) -> int:
        return admission.check_budget(n_prompt, max_tokens, param, limit_param, self.limits,
                                      min_max_tokens, label)

    def _checker(self) -> GrammarChecker:
        """Structured output's checks (``grammar_check``), built on first use. A grammar
        that passes is compiled by the engine's compiler when the engine is in this process
        (so the engine's copy starts warm); a router's workers check it again with theirs."""
        if self._grammar_checker is None:
            compiler = getattr(self.backend, "grammars", None)
            if compiler is not None:
                eos = tuple(compiler.eos)
                warm = compiler.check
                is_warm = compiler.cached
            else:
                eos_id = self.tokenizer.eos_token_id
                eos = () if eos_id is None else (eos_id,)
                warm = is_warm = None
            self._grammar_checker = GrammarChecker(
                self.tokenizer.to_json(), eos, self.vocab_size, timeout_s=GRAMMAR_CHECK_S,
                warm=warm, is_warm=is_warm)
        return self._grammar_checker

    async def _structured(self, body: Any, overrides: dict[str, Any]) -> None:
        """Put the request's structured output (if any) in ``overrides``, once it compiles."""
        spec = body.structured_spec
        if spec is not None:
            await self._constrain(overrides, *spec)

    async def _constrain(self, overrides: dict[str, Any], param: str, spec: str, *,
                         per_client: bool = True) -> None:
        """Check a structured output (``grammar_check``: in a child process, within
        ``GRAMMAR_CHECK_S`` of its own time; a client's checks one at a time unless
        ``per_client`` is False) and put it in ``overrides``; a 400 naming ``param`` if it
        does not pass."""
        client = CLIENT.get() if per_client else None
        try:
            await self._checker().check(spec, param, client)
        except ValidationError as e:
            raise self._invalid(e, param, code=GRAMMAR) from e
        except Overloaded as e:
            raise ApiError(503, f"the server is overloaded: {e}", type="server_error",
                           code="overloaded",
                           headers={"Retry-After": str(self.retry_after_s)}) from e
        overrides["structured_output"] = spec

    def _params(self, overrides: dict[str, Any]) -> SamplingParams:
        try:
            return self.backend.default_sampling_params(**overrides)
        except ValidationError as e:
            raise self._invalid(e) from e

    def _specs(self, prompts: list[tuple[list[int], str | None, int]], n: int,
               overrides: dict[str, Any]) -> list[PromptSpec]:
        """n samples of each (ids, text, max_tokens); seeded samples get seed, seed+1, ..."""
        stop_ids = overrides.get("stop_token_ids")
        if stop_ids:  # an id past the vocabulary could never be sampled: a mistake to name
            self._ids(list(stop_ids), "stop_token_ids")
        specs = []
        for ids, text, max_tokens in prompts:
            if overrides.get("min_tokens", 0) > max_tokens:  # max_tokens: after the context
                raise ApiError(400, f"min_tokens ({overrides['min_tokens']}) must be <= the "
                               f"{max_tokens} tokens this request may generate (its token "
                               "limit, at most the room its prompt leaves in the context)",
                               param="min_tokens", code=COMBINATION)
            for j in range(n):
                o = dict(overrides, max_tokens=max_tokens)
                if j and o.get("seed") is not None:
                    o["seed"] = wrap_seed(o["seed"] + j)
                if j:  # one prompt's logprobs are the same for every sample: computed once
                    o.pop("prompt_logprobs", None)  # (sse.SharedPromptLogprobs shares them)
                specs.append(PromptSpec(ids, self._params(o), text))
        return specs

    def slo(self, request: Request, body: Any = None) -> SLO | None:
        """The request's SLO targets: its ``slo_ttft_ms``/``slo_tpot_ms`` fields or its
        ``x-slo-ttft-ms``/``x-slo-tpot-ms`` headers (not both), each over the server's."""
        got: dict[str, float | None] = {}
        for name in ("ttft", "tpot"):
            field, header = f"slo_{name}_ms", f"x-slo-{name}-ms"
            value = getattr(body, field, None)
            given = request.headers.getlist(header)
            if len(given) > 1:  # (a proxy in front might read another copy than this)
                raise ApiError(400, f"the {header} header was given {len(given)} times; send "
                               "it once", param=header, code=COMBINATION)
            raw = given[0] if given else None
            if raw is not None:
                if value is not None:
                    raise ApiError(400, f"{field} was given both as a field and as the "
                                   f"{header} header; send one of them", param=field,
                                   code=COMBINATION)
                try:  # a JSON number, as the field takes (float() would read "1_000", "nan")
                    number = (float(raw) if len(raw) <= 64 and _JSON_NUMBER.fullmatch(raw.strip())
                              else math.nan)
                    value = check_slo_ms(number, header)
                except ValueError:
                    raise ApiError(400, f"the {header} header must be a number of "
                                   f"milliseconds in [{SLO_MS_MIN:g}, {SLO_MS_MAX:g}]; got "
                                   f"{raw[:40]!r}", param=header) from None
            got[name] = value
        mine = SLO.from_ms(got["ttft"], got["tpot"]).over(self.default_slo)
        return mine if mine.any else None

    async def _submit(self, specs: list[PromptSpec], rid: str, arrival: float,
                      slo: SLO | None = None) -> RequestGroup:
        if slo is not None:
            specs = [dataclasses.replace(s, slo=slo) for s in specs]
        try:
            return await self.backend.add(specs, rid, arrival_time=arrival)
        except SLORefused as e:
            self.refused[e.reason] = self.refused.get(e.reason, 0) + 1
            raise ApiError(429, str(e), type="rate_limit_error", code=e.reason,
                           headers={"Retry-After": str(e.retry_after_s)}) from e
        except EngineOverloaded as e:
            raise ApiError(503, f"the server is overloaded: {e}", type="server_error",
                           code="overloaded", headers={"Retry-After": str(self.retry_after_s)}) from e
        except EngineStopped as e:
            raise ApiError(503, str(e), type="server_error", code="shutting_down") from e
        except EngineUnavailable as e:
            raise ApiError(503, str(e), type="server_error", code="unavailable",
                           headers={"Retry-After": str(self.retry_after_s)}) from e
        except EngineError as e:
            raise ApiError(e.status, str(e), type=e.type, code=e.code) from e
        except ValidationError as e:
            raise self._invalid(e, e.param or "prompt") from e
        except ValueError as e:  # more sequences than may ever wait at once
            raise ApiError(400, str(e), code=COMBINATION) from e

    def _token_text(self, token_id: int) -> str:
        """A token's own text, for logprobs (cached: a logprobs reply asks for the same few
        thousand ids many times over)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id],
                                                                 skip_special_tokens=False)
        return text

    def _decode_ids(self, token_ids: list[int]) -> str:
        """Several tokens' text at once: the bytes of one character, for ``text_offset``."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    # -- chat templating -------------------------------------------------------------------
    def _messages(self, messages: list[Any]) -> list[dict[str, Any]]:
        msgs = []
        for i, m in enumerate(messages):
            d: dict[str, Any] = {"role": m.role, "content": m.text(i)}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                # Templates read a call's arguments as an object (transformers' convention);
                # OpenAI sends their JSON text.
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            msgs.append(d)
        return msgs

    def _render(self, msgs: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final: bool, kwargs: dict[str, Any] | None) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except Exception as e:  # template errors (raise_exception, bad roles, ...)
            # Keyword arguments that clash with the template's own names fail as TypeError.
            param = "chat_template_kwargs" if kwargs and isinstance(e, TypeError) \
                else "messages"
            raise ApiError(400, f"the chat template could not render these messages: {e}",
                           param=param, code=TEMPLATE) from e
        if continue_final:
            last = msgs[-1]["content"]
            cut = text.rfind(last) if last else -1
            if cut != -1:
                text = text[:cut + len(last)]
        return text

    def _chat_ids(self, msgs: list[dict[str, Any]], add_generation_prompt: bool,
                  continue_final: bool, kwargs: dict[str, Any] | None) -> tuple[str, list[int]]:
        """On a worker thread: render the template and tokenize it (the template places any
        BOS itself)."""
        text = self._render(msgs, add_generation_prompt, continue_final, kwargs)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    # -- the routes ------------------------------------------------------------------------
    def tokenizer_info(self) -> dict[str, Any]:
        tok = self.tokenizer
        return {"tokenizer_class": tok.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
                "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.pad_token, "add_bos_token": tok.add_bos_token,
                "chat_template": tok.chat_template, "model_max_length": self.max_model_len,
                "vocab_size": self.vocab_size}

    async def tokenize(self, body: TokenizeRequest, request: Request) -> Response:
        self.check_model(body.model)
        msgs = self._messages(body.messages) if isinstance(body, TokenizeChat) else None

        def work() -> tuple[int, bytes]:  # on /tokenize's worker, the reply's JSON too
            if msgs is not None:
                _, ids = self._chat_ids(msgs, body.add_generation_prompt, False, None)
            else:
                ids = self.tokenizer.encode(body.prompt, body.add_special_tokens)
            head = json.dumps({"count": len(ids), "max_model_len": self.max_model_len})
            return len(ids), f"{head[:-1]}, \"tokens\": {_ints_json(ids)}}}".encode()

        size = (len(body.prompt) if msgs is None else
                sum(len(m["content"]) for m in msgs))
        pool = self.cpu_tools if size <= TOKENIZE_SMALL_CHARS else self.cpu_tools_large
        count, reply = await self._off_loop(work, pool=pool)
        access_record(request.scope).prompt_tokens = count
        return Response(reply, media_type="application/json")

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        self.check_model(body.model)

        def work() -> bytes:
            if body.tokens:
                self._ids(body.tokens, "tokens")
            text = self.tokenizer.decode(body.tokens, skip_special_tokens=False)
            return json.dumps({"prompt": text}, ensure_ascii=False).encode()

        pool = (self.cpu_tools if len(body.tokens) <= TOKENIZE_SMALL_CHARS // 4
                else self.cpu_tools_large)
        return Response(await self._off_loop(work, pool=pool),
                        media_type="application/json")

    async def completions(self, body: CompletionRequest, request: Request,
                          id_prefix: str = "cmpl-") -> Response:
        """``id_prefix``: the response id's (the dashboard's playground marks its own)."""
        arrival = time.monotonic()
        self.check_model(body.model)
        raw = body.prompt_list()
        self._check_sequences(len(raw), body.n)
        prompts = []
        echoed: list[str] = []
        for i, p in enumerate(raw):
            param = "prompt" if len(raw) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                self._check_chars(len(p), param)
                ids, text = await self._off_loop(self.tokenizer.encode, p), p
            else:
                ids, text = list(p), None
            if "max_tokens" in body.model_fields_set:
                max_tokens = self._budget(len(ids), body.max_tokens, param, "max_tokens",
                                          min_max_tokens=0)
            else:  # the default (16) never refuses a prompt: it is capped at the room left
                max_tokens = min(body.max_tokens, self._budget(len(ids), None, param,
                                                               "max_tokens"))
            self._ids(ids, param)
            prompts.append((ids, text, max_tokens))
            if body.echo:  # a token-id prompt echoes as its decoded text
                echoed += [text if text is not None else await self._off_loop(
                    self.tokenizer.decode, ids, False)] * body.n
        overrides = body.sampling_overrides()
        if body.logprobs is not None:
            overrides["logprobs"] = body.logprobs
        # Prompt tokens' logprobs: for echo with logprobs, and for vLLM's prompt_logprobs
        # (the larger top N of the two; each view keeps its own).
        wanted = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs)
                  if n is not None]
        if wanted:
            overrides["prompt_logprobs"] = max(wanted)
        await self._structured(body, overrides)
        specs = self._specs(prompts, body.n, overrides)
        rid = f"{id_prefix}{uuid.uuid4().hex}"
        choices = CompletionChoices(self._token_text, self._decode_ids, len(specs),
                                    body.logprobs, echo=body.echo,
                                    prompt_texts=echoed or None,
                                    prompt_logprobs=body.prompt_logprobs,
                                    special_ids=self.tokenizer.special_ids,
                                    hidden=self.tokenizer.special_ids
                                    if body.skip_special_tokens else frozenset())
        return await self._respond(request, body, specs, rid, choices, arrival)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        self._check_sequences(1, body.n)
        admission.check_messages(len(body.messages), "messages", self.limits)
        admission.check_free_form(body, self.limits)
        msgs = self._messages(body.messages)
        mode = body.tool_mode
        kwargs = dict(body.chat_template_kwargs or {})
        tools = body.tool_dicts if mode != "none" else []
        msg_chars = sum(len(m["content"]) + len(m.get("name") or "")
                        + len(json.dumps(m.get("tool_calls") or "")) for m in msgs)
        tool_chars = len(json.dumps(tools, ensure_ascii=False)) if tools else 0
        if tools:
            if tools_mod.template_renders_tools(self.tokenizer.chat_template):
                kwargs["tools"] = tools
            else:  # a template that knows no tools: they become a system message
                msgs = [{"role": "system", "content": tools_mod.tools_message(tools)}, *msgs]
        # the prompt is the messages with the tools rendered in: a refusal names the field
        # that holds most of it, and says both are in it
        param = "tools" if tool_chars > msg_chars else "messages"
        label = "the prompt the messages and tools render to" if tools else None
        self._check_chars(msg_chars + tool_chars, param,
                          "the messages and tools" if tools else None)
        text, ids = await self._off_loop(self._chat_ids, msgs, body.add_generation_prompt,
                                         body.continue_final_message, kwargs or None)
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = self._budget(len(ids), body.output_limit, param, limit_param,
                                  label=label)
        self._ids(ids, param)
        overrides = body.sampling_overrides()
        if body.num_logprobs is not None:
            overrides["logprobs"] = body.num_logprobs
        await self._structured(body, overrides)
        names = {t["function"]["name"] for t in tools}
        function = None
        if mode == "required":
            await self._constrain(overrides, "tools", spec_json(
                "json_schema", tools_mod.required_schema(tools, body.parallel_tool_calls)))
        elif mode == "named":
            function = body.tool_choice.function.name
            tool = next(t for t in tools if t["function"]["name"] == function)
            await self._constrain(overrides, "tools", spec_json(
                "json_schema", tools_mod.parameters(tool)))
        specs = self._specs([(ids, text, max_tokens)], body.n, overrides)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if mode == "none":
            choices: ChatChoices = ChatChoices(self._token_text, len(specs), body.num_logprobs)
        else:
            choices = tools_mod.ToolChatChoices(self._token_text, len(specs),
                                                body.num_logprobs, mode=mode, names=names,
                                                function=function)
        return await self._respond(request, body, specs, rid, choices, arrival)

    # -- the one response builder ----------------------------------------------------------
    async def _respond(self, request: Request, body: Any, specs: list[PromptSpec], rid: str,
                       choices: CompletionChoices | ChatChoices, arrival: float) -> Response:
        rec = access_record(request.scope)
        rec.request_id = rid
        rec.prompt_tokens = sum(len(s.token_ids) for s in specs[::max(1, body.n)])
        group = await self._submit(specs, rid, arrival, self.slo(request, body))
        rec.route = lambda: group.routing  # behind a router: where it went
        prompt_lens = [len(s.token_ids) for s in specs]
        produced: dict[str, int] = {}

        def on_token(out: RequestOutput) -> None:
            produced[out.request_id] = len(out.token_ids)
            rec.output_tokens = sum(produced.values())
            if rec.ttft_s is None and out.metrics.ttft is not None:
                rec.ttft_s = out.metrics.ttft

        model = self.served_model_name
        # prompt logprobs computed by each prompt's first sample only (_specs)
        shared = body.n > 1 and specs[0].params.prompt_logprobs is not None
        if body.stream:
            return stream_group(group=group, rid=rid, obj=choices.stream_object, model=model,
                                prompt_lens=prompt_lens, prompt_tokens=rec.prompt_tokens,
                                include_usage=body.include_usage,
                                continuous_usage=body.continuous_usage, render=choices.delta,
                                n=body.n, shared_prompt_logprobs=shared,
                                on_token=on_token, pool=self.render)
        created = int(time.time())
        finals = await self._collect(request, group, on_token)
        if shared:
            finals = share_prompt_logprobs(finals, body.n)

        def render() -> bytes:  # on a worker: a reply with logprobs of many choices is big
            return jsontext.dumps({
                "id": rid, "object": choices.object, "created": created, "model": model,
                "choices": [choices.whole(i, out) for i, out in enumerate(finals)],
                "usage": usage(rec.prompt_tokens, sum(len(o.token_ids) for o in finals),
                               cached_prompt_tokens([o.metrics.num_cached_tokens
                                                     for o in finals], body.n))},
                {}).encode()

        large = sum(map(whole_cost, finals)) >= OFF_LOOP_ENTRIES
        return Response(await self._off_loop(render, pool=self.render if large else None),
                        media_type="application/json")

    async def _collect(self, request: Request, group: RequestGroup,
                       on_token: Callable[[RequestOutput], None]) -> list[RequestOutput]:
        """Wait for every request of the group to finish (aborting them if the client
        leaves first); the final outputs in group order."""
        finals: list[RequestOutput | None] = [None] * len(group.request_ids)

        async def run() -> None:
            try:
                async for idx, out in group:
                    on_token(out)
                    if out.finished:
                        finals[idx] = out
            finally:
                group.close()

        try:
            await _unless_disconnected(request, run())
        except EngineError as e:
            raise ApiError(e.status, str(e), type=e.type, code=e.code) from e
        except EngineStopped as e:
            raise ApiError(503, str(e), type="server_error", code="shutting_down") from e
        except ClientGone as e:  # nobody is listening; the status is for the access log
            raise ApiError(499, "the client disconnected", code="client_disconnected") from e
        return [f for f in finals if f is not None]
