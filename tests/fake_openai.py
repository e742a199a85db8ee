"""A small OpenAI-compatible server whose token timing is scripted, for testing the bench
client. Runs uvicorn on 127.0.0.1 (free port) in a thread of the test process.

The script is chosen by the prompt's length (prompts are token ids):

* every request: first chunk after ``ttft`` seconds, then one chunk per ``gaps`` entry;
  each chunk carries ``tokens`` tokens (usage on every chunk, as continuous_usage_stats);
* ``SCRIPTS`` maps prompt length -> (ttft, gaps, tokens per chunk); other lengths use
  the default script; prompt length 13 answers HTTP 500;
* a prompt that, with its ``max_tokens``, exceeds ``CONTEXT_LEN`` answers 400 with an
  OpenAI-style error body, as phasewise's server words it;
* a hostile server's replies (``HOSTILE``): length 21 reports 1e308 completion tokens, 22
  sends timings of strings and 1e308, 23 a line past any bound, 24 headers and then
  nothing; ``/metrics`` answers ``METRICS["text"]`` when it is set.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn

DEFAULT = (0.25, [0.05, 0.05, 0.05, 0.05], [1, 1, 1, 1, 1])
SCRIPTS = {
    17: (0.25, [0.05, 0.60, 0.05, 0.05], [1, 1, 1, 1, 1]),  # a stall of 600 ms
    18: (0.25, [0.05, 0.05, 0.05], [1, 2, 1, 1]),  # one chunk carries two tokens
    500: (0.90, [0.05, 0.05, 0.05, 0.05], [1, 1, 1, 1, 1]),  # a long prompt: slow TTFT
}
ERROR_LEN = 13
CONTEXT_LEN = 512
# whether /tokenize says max_model_len (phasewise and vLLM do; a test may turn it off)
REPORT_CONTEXT = {"on": True}
HOSTILE = {"usage": 21, "timings": 22, "endless": 23, "hang": 24}
METRICS: dict[str, str | None] = {"text": None}


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    path = scope["path"]

    async def reply(status, payload, ctype=b"application/json"):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": data})

    if path == "/tokenize":
        text = json.loads(body)["prompt"]
        await reply(200, {"tokens": [ord(c) % 1000 for c in text[::3]], "count": 0,
                          **({"max_model_len": CONTEXT_LEN} if REPORT_CONTEXT["on"] else {})})
        return
    if path == "/metrics" and METRICS["text"] is not None:
        await reply(200, METRICS["text"].encode(), b"text/plain")
        return
    if path != "/v1/completions":
        await reply(404, {"error": {"message": "not found"}})
        return
    req = json.loads(body)
    n = len(req["prompt"])
    if n == ERROR_LEN:
        await reply(500, {"error": {"message": "scripted failure"}})
        return
    if n + int(req.get("max_tokens") or 16) > CONTEXT_LEN:
        await reply(400, {"error": {
            "message": f"the prompt has {n} tokens, but this model's context is {CONTEXT_LEN} "
                       "tokens, which must also hold the output",
            "type": "invalid_request_error", "param": "prompt", "code": None}})
        return
    ttft, gaps, tokens = SCRIPTS.get(n, DEFAULT)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    if n == HOSTILE["hang"]:
        await asyncio.sleep(3600)
    if n == HOSTILE["endless"]:
        # one line past any client's bound (2 MiB: the test bounds lines at 1 MiB), then
        # the end (sends after the client has gone are dropped: no loop may outlive it)
        for _ in range(32):
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + b"x" * 65536})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b""})
        return
    t0 = time.monotonic()
    due = ttft
    done = 0
    for k, ntok in enumerate(tokens):
        await asyncio.sleep(max(0.0, due - (time.monotonic() - t0)))
        done += ntok
        chunk = {"choices": [{"index": 0, "text": "x" * ntok,
                              "finish_reason": "length" if k == len(tokens) - 1 else None}],
                 "usage": {"prompt_tokens": n, "completion_tokens": done}}
        await send({"type": "http.response.body", "more_body": True,
                    "body": f"data: {json.dumps(chunk)}\n\n".encode()})
        if k < len(gaps):
            due += gaps[k]
    final = {"choices": [], "usage": {"prompt_tokens": n, "completion_tokens":
                                      1e308 if n == HOSTILE["usage"] else done}}
    if n == HOSTILE["timings"]:
        final["timings"] = [{"index": 0, "queue_s": "lots", "prefill_s": 1e308,
                             "decode_s": 0.2}]
    if n == 500:  # as a phasewise server would: the engine's own split
        final["timings"] = [{"index": 0, "queue_s": 0.5, "prefill_s": 0.4, "decode_s": 0.2}]
    await send({"type": "http.response.body", "more_body": True,
                "body": f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode()})
    await send({"type": "http.response.body", "body": b""})


class FakeServer:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on",
                                                    # The hostile "hang" stream never ends
                                                    # by itself: shutdown cuts it.
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
