"""Server-sent events: the response class and the one stream builder that completions and
chat share (each endpoint only renders its choices)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import replace
from functools import partial
from typing import Any

from fastapi.responses import StreamingResponse

from phasewise.engine.backend import EngineError, EngineStopped, RequestGroup, merge_outputs
from phasewise.engine.outputs import RequestOutput
from phasewise.server import jsontext
from phasewise.server.errors import ApiError
from phasewise.server.openai_format import cached_prompt_tokens, timing, usage

log = logging.getLogger("phasewise.server")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# A choice chunk and whether it carries the choice's usage so far (continuous_usage_stats).
Rendered = list[tuple[dict[str, Any], bool]]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def stream_error(e: Exception) -> ApiError:
    """What a failure after the 200 began is called in the stream's error event."""
    if isinstance(e, EngineStopped):
        return ApiError(503, str(e), type="server_error", code="shutting_down")
    if isinstance(e, EngineError):
        return ApiError(e.status, str(e), type=e.type, code=e.code)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                    code="internal_error")


def error_event(e: Exception) -> str:
    # ASCII JSON: the error event itself always encodes, whatever text it quotes
    return f"data: {json.dumps(stream_error(e).body())}\n\n"


def error_then_done(e: Exception) -> str:
    """How a stream of chunks (completions, chat) ends after a failure."""
    return error_event(e) + DONE


Ending = Callable[[Exception], "str | bytes"]


async def _guarded(content: AsyncIterator[str | bytes], ending: Ending | None
                   ) -> AsyncIterator[bytes]:
    """``content`` encoded as UTF-8; any failure in it, or a chunk that does not encode,
    ends the body with ``ending(error)`` (the stream's own error event and end marker), so a
    stream whose 200 is already sent never ends empty or cut without saying why."""
    try:
        async for chunk in content:
            yield chunk.encode("utf-8") if isinstance(chunk, str) else chunk
    except Exception as e:  # noqa: BLE001 - reported in the stream and the log
        log.error("stream failed: %s: %s", type(e).__name__, e,
                  exc_info=not isinstance(e, (EngineError, EngineStopped)))
        if ending is not None:
            end = ending(e)
            yield end.encode("utf-8", "backslashreplace") if isinstance(end, str) else end
    finally:
        aclose = getattr(content, "aclose", None)
        if aclose is not None:
            await aclose()  # a generator suspended at a chunk that did not encode


class SSEResponse(StreamingResponse):
    """Server-sent events that stop (and abort their requests) as soon as the client goes:
    the stream races a listener for ``http.disconnect``. ``ending`` renders how the stream
    ends when its content fails (``_guarded``); None ends it without a word."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str | bytes], on_close: Callable[[], None],
                 ending: Ending | None = None) -> None:
        # No caching, and no buffering in proxies (nginx honours X-Accel-Buffering).
        super().__init__(_guarded(content, ending),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
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
                    log.error("stream failed: %s: %s", type(err).__name__, err)


class SharedPromptLogprobs:
    """A group whose prompts' logprobs only each prompt's first sample computed (index
    ``i - i % n``; ``share_prompt_logprobs``): another sample's outputs are held (merged)
    until its first sample's first output brings them, then go out with them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.logprobs: dict[int, list | None] = {}  # first sample -> its prompt's logprobs
        self.held: dict[int, RequestOutput] = {}  # another sample -> its output, waiting

    def ready(self, idx: int, out: RequestOutput) -> list[tuple[int, RequestOutput]]:
        """The outputs to render now, in order, with the prompt logprobs they carry."""
        lead = idx - idx % self.n
        if idx == lead:
            if idx in self.logprobs:
                return [(idx, out)]
            self.logprobs[idx] = out.prompt_logprobs  # None: it failed before its prompt
            now = [(idx, out)]
            for other in sorted(i for i in self.held if i - i % self.n == idx):
                now.append((other, self._with(self.held.pop(other), idx)))
            return now
        if lead in self.logprobs:
            return [(idx, self._with(out, lead))]
        held = self.held.get(idx)
        self.held[idx] = out if held is None else merge_outputs(held, out)
        return []

    def _with(self, out: RequestOutput, lead: int) -> RequestOutput:
        return replace(out, prompt_logprobs=self.logprobs[lead])


def share_prompt_logprobs(outs: list[RequestOutput], n: int) -> list[RequestOutput]:
    """A whole reply's outputs, each prompt's later samples given its first sample's prompt
    logprobs (``SharedPromptLogprobs``)."""
    return [out if i % n == 0 else replace(out, prompt_logprobs=outs[i - i % n].prompt_logprobs)
            for i, out in enumerate(outs)]


# A chunk whose output holds this many tokens and logprob entries is rendered off the event
# loop: a reader that stopped reading gets its outputs merged (RequestGroup), and one merge
# of 16 choices x 11k tokens x 20 logprobs took 1.5 s to render, every stream on the server
# waiting; a normal step's chunk (a token and its logprobs) stays on the loop.
OFF_LOOP_ENTRIES = 2048


def render_cost(out: RequestOutput) -> int:
    """The tokens and logprob entries a chunk of ``out``'s delta renders."""
    n = len(out.delta_token_ids)
    width = len(out.logprobs[-1]) if n and out.logprobs else 0
    return n * (1 + width)


def whole_cost(out: RequestOutput) -> int:
    """The tokens and logprob entries a whole reply's choice of ``out`` renders."""
    width = len(out.logprobs[-1]) if out.token_ids and out.logprobs else 0
    prompt = out.prompt_logprobs or ()
    prompt_width = max((len(e) for e in prompt[:2] if e), default=0)
    return len(out.token_ids) * (1 + width) + len(prompt) * (1 + prompt_width)


def stream_group(*, group: RequestGroup, rid: str, obj: str, model: str,
                 prompt_lens: list[int], prompt_tokens: int, include_usage: bool,
                 continuous_usage: bool,
                 render: Callable[[int, RequestOutput], Rendered],
                 on_token: Callable[[RequestOutput], None] | None = None,
                 n: int = 1, shared_prompt_logprobs: bool = False,
                 pool: Executor | None = None) -> SSEResponse:
    """SSE for a group (``prompt_lens``: each request's; ``prompt_tokens``: the usage
    total, each prompt counted once however many samples (``n``, next to each other) it
    has): the choices ``render`` makes of each output (those marked True carry the choice's
    usage so far, with continuous_usage_stats), then, with include_usage, the usage chunk
    (``prompt_tokens_details.cached_tokens`` included) with the engine's per-choice
    ``timings``, then ``[DONE]``. An engine failure, the end of a shutdown's grace period,
    or any other failure once the 200 is sent ends the stream with an error event that says
    so, then ``[DONE]``. ``shared_prompt_logprobs``: only each prompt's first sample computed
    its prompt logprobs (``share_prompt_logprobs``); the others' outputs wait for it and
    carry its logprobs.

    A large chunk (a prompt's logprobs, a lagging reader's merged outputs) is built on
    ``pool`` (default: asyncio's), its JSON written in pieces (``jsontext``) and each long
    list shared between the samples written once: building it holds the GIL, which the
    engine's thread needs between its kernels, so the fewer threads do it at once and the
    shorter each holds it, the less every other stream waits."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], use: dict | None = None) -> dict:
        out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                               "choices": choices}
        if include_usage:
            out["usage"] = use
        return out

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        cached = [0] * len(prompt_lens)
        timings: dict[int, dict[str, Any]] = {}
        rendered_first: set[int] = set()
        share = SharedPromptLogprobs(n) if shared_prompt_logprobs else None
        memo: jsontext.Memo = {}  # (the samples' shared prompt logprobs, written once)
        loop = asyncio.get_running_loop()
        try:
            async for idx, out in group:
                if on_token is not None:
                    on_token(out)
                cached[idx] = out.metrics.num_cached_tokens
                if out.finished:
                    completion_tokens += len(out.token_ids)
                    timings[idx] = timing(idx, out)
                for idx, out in (share.ready(idx, out) if share else [(idx, out)]):
                    running = (usage(prompt_lens[idx], len(out.token_ids), cached[idx])
                               if continuous_usage else None)

                    def lines(idx: int = idx, out: RequestOutput = out,
                              running: dict | None = running, large: bool = False
                              ) -> list[str]:
                        return [f"data: {jsontext.dumps(payload, memo)}\n\n" if large
                                else sse(payload) for payload in (
                                    chunk([choice], running if counted else None)
                                    for choice, counted in render(idx, out))]

                    first = out.prompt_logprobs is not None and idx not in rendered_first
                    large = (whole_cost(out) if first else render_cost(out)) >= OFF_LOOP_ENTRIES
                    if first or large:
                        # the first chunk carries the whole prompt's logprobs, and a lagging
                        # reader's merged output many tokens': a worker builds those, the
                        # large ones on ``pool`` (one at a time), the others on asyncio's
                        if first:
                            rendered_first.add(idx)
                        for line in await loop.run_in_executor(
                                pool if large else None, partial(lines, large=large)):
                            yield line
                    else:
                        for line in lines():
                            yield line
            if include_usage:
                yield sse(dict(chunk([], usage(prompt_tokens, completion_tokens,
                                               cached_prompt_tokens(cached, n))),
                               timings=[timings[i] for i in sorted(timings)]))
        except (EngineError, EngineStopped) as e:
            yield error_event(e)
        finally:
            group.close()
        yield DONE

    return SSEResponse(events(), group.close, error_then_done)
