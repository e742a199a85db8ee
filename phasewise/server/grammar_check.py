"""A structured output's grammar is checked in a child process before a server admits it.

llguidance compiles grammars in native code. ``grammar_bounds`` refuses what is known to
overflow its stack or blow up its lexer, but a process that runs a stranger's grammar must
survive what no bound foresaw. So each check runs in a child process (``python -m
phasewise.server.grammar_check``): it compiles the grammar on an 8 MiB stack (the server
compiles on 64 MiB, ``structured.COMPILE_STACK_BYTES``, so what passes here cannot overflow
there), computes its first mask, then walks ``WALK_STEPS`` tokens it allows, timing each
mask, under a memory cap (``RLIMIT_AS``). What it reports decides the request:

* a crash (a signal) or the memory cap: a 400 that says so; the child is replaced;
* no answer within ``timeout_s``: a 400, and the child is killed (a slow grammar holds no
  thread past its limit);
* a mask slower than ``structured.FIRST_MASK_LIMIT_S`` / ``STEP_LIMIT_S``, or more than
  ``max_grammar_bytes`` of memory: a 400;
* otherwise the memory it took, which the engine's grammar cache counts it at.

Fairness: ``processes`` children check in parallel, each driven by one thread of this
process; a client (an address) has one check at a time, its others wait their turn, so
one client's slow grammars delay only itself; more than ``max_waiting`` checks waiting is a
503. A grammar that passed is remembered (its hash), and so is not checked again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import queue
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phasewise.engine import structured
from phasewise.engine.grammar_bounds import bounds_problem
from phasewise.engine.validation import ValidationError
from phasewise.server.child import Child, ChildDied, ChildTimeout, serve

log = logging.getLogger("phasewise.server")

WALK_STEPS = 16
CHILD_STACK_BYTES = 8 * 2**20
MAX_GRAMMAR_BYTES = 64 * 2**20


class Overloaded(Exception):
    """Too many grammar checks wait already."""


# -- the child ------------------------------------------------------------------------------
def _walk(tok: Any, limits: Any, text: str, vocab: int, max_bytes: int,
          bounds: bool = True) -> list[Any]:
    """Compile ``text``, its first mask and ``WALK_STEPS`` more: ["ok", bytes] or
    ["bad", message]. ``bounds``: check ``grammar_bounds`` first (off only in the tests
    that need a grammar to crash the compiler)."""
    import ctypes
    import random

    import llguidance as llg

    spec = structured.parse_spec(text)
    problem = bounds_problem(spec) if bounds else None
    if problem is not None:
        return ["bad", problem]
    grammar = structured.grammar_of(spec)
    before = structured._rss_bytes()
    m = llg.LLMatcher(tok, grammar, log_level=0, limits=limits)
    if m.is_error():
        return ["bad", f"the {spec['type'].replace('_', ' ')} does not compile: "
                f"{structured._short(m.get_error())}"]
    words = (vocab + 31) // 32
    bits = (ctypes.c_uint32 * words)()
    rng = random.Random(hashlib.sha256(text.encode()).digest())
    for step in range(WALK_STEPS + 1):
        t = time.thread_time()
        m.unsafe_compute_mask_ptr(ctypes.addressof(bits), words * 4)
        took = time.thread_time() - t
        if m.is_error():
            return ["bad", f"the grammar cannot start: {structured._short(m.get_error())}"
                    if step == 0 else f"the grammar fails after {step} tokens: "
                    f"{structured._short(m.get_error())}"]
        limit = structured.FIRST_MASK_LIMIT_S if step == 0 else structured.STEP_LIMIT_S
        if took > limit:
            return ["bad", f"the grammar took {took * 1e3:.0f} ms to compute "
                    f"{'its first' if step == 0 else 'one'} token's mask; the limit is "
                    f"{limit * 1e3:.0f} ms; simplify it (large repetition counts are the "
                    "usual cause)"]
        if m.is_stopped():
            break
        live = [i for i in range(words) if bits[i]]
        if not live:
            break
        w = rng.choice(live)
        allowed = [32 * w + j for j in range(32) if bits[w] >> j & 1]
        if not m.consume_token(rng.choice(allowed)):
            # a token its own mask allowed: the parser gave up (a limit), not the grammar
            return ["bad", f"the grammar fails after {step + 1} tokens: "
                    f"{structured._short(m.get_error() or 'a token its mask allowed')}"]
    used = max(0, structured._rss_bytes() - before)
    if used > max_bytes:
        return ["bad", f"the grammar takes {used / 2**20:.0f} MB of memory to compile and "
                f"start; the limit is {max_bytes / 2**20:.0f} MB; simplify it"]
    return ["ok", used]


_state: dict[str, Any] = {}


def _setup(frame: bytes) -> None:
    """The tokenizer and the caps; from here on, the memory cap counts: what the tokenizer
    and the interpreter hold is the child's own, the rest is a grammar's."""
    import resource

    import llguidance as llg

    setup = json.loads(frame)
    _state["tok"] = llg.LLTokenizer(setup.pop("tokenizer"), n_vocab=setup["vocab"],
                                    eos_token=setup["eos"] or None)
    _state["limits"] = llg.LLParserLimits(**structured.LIMITS)
    _state["setup"] = setup
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * 4096
    cap = size + setup["memory"]
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    threading.stack_size(CHILD_STACK_BYTES)


def _handle(frame: bytes) -> list[bytes]:
    """One grammar, checked on a thread of ``CHILD_STACK_BYTES``."""
    setup = _state["setup"]
    text = json.loads(frame)
    answer: list[Any] = ["bad", "the check did not run"]

    def run() -> None:
        nonlocal answer
        try:
            answer = _walk(_state["tok"], _state["limits"], text, setup["vocab"],
                           setup["max_bytes"], setup["bounds"])
        except ValidationError as e:
            answer = ["bad", str(e)]
        except MemoryError:
            answer = ["memory"]
        except Exception as e:  # noqa: BLE001 - reported to the parent, which says 400
            answer = ["bad", f"{type(e).__name__}: {structured._short(str(e))}"]

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return [json.dumps(answer).encode()]


# -- the parent -----------------------------------------------------------------------------
@dataclass
class _Job:
    text: str
    param: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    passed: int | None  # its memory, if it passed a check before (then only warm runs)


class GrammarChecker:
    """See the module. ``warm(text, param, cost_bytes)``: run after a grammar passes, on the
    same thread (one with ``COMPILE_STACK_BYTES`` of stack): the engine's compiler compiles
    it so that its cache holds it (it may raise ``ValidationError``); ``is_warm(text)``:
    whether that cache holds it still."""

    def __init__(self, tokenizer_json: str, eos_token_ids: tuple[int, ...], vocab_size: int,
                 *, processes: int = 2, timeout_s: float = 5.0,
                 memory_bytes: int = 1024 * 2**20, max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
                 max_waiting: int = 64, remember: int = 1024,
                 warm: Callable[[str, str, int], None] | None = None,
                 is_warm: Callable[[str], bool] | None = None, bounds: bool = True) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.setup = {"tokenizer": tokenizer_json, "vocab": vocab_size,
                      "eos": list(eos_token_ids), "memory": memory_bytes,
                      "max_bytes": max_grammar_bytes, "bounds": bounds}
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self.warm = warm
        self.is_warm = is_warm
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        setup = json.dumps(self.setup).encode()
        # few malloc arenas: each reserves address space, which the memory cap counts
        self._children = [Child("phasewise.server.grammar_check", setup,
                                env={"MALLOC_ARENA_MAX": "2"}) for _ in range(processes)]
        self._threads: list[threading.Thread] = []
        self._passed: OrderedDict[bytes, int] = OrderedDict()  # hash -> bytes, LRU
        self._remember = remember
        self._lock = threading.Lock()
        # a client's one check at a time: its lock and how many of its checks hold or wait
        self._turns: dict[str, list[Any]] = {}
        self._waiting = 0
        self._closed = False
        self.counts = {"passed": 0, "refused": 0, "crashed": 0, "timed_out": 0}

    def _start(self) -> None:
        with self._lock:
            if self._threads or self._closed:
                return
            for i, child in enumerate(self._children):
                self._threads.append(structured.compile_thread(
                    lambda c=child: self._serve(c), f"phasewise-grammar-{i}"))

    async def check(self, text: str, param: str, client: str | None = None) -> int:
        """Check ``text`` (a ``structured_output``) as the engine would run it; returns the
        memory it takes. Raises ``ValidationError`` naming ``param``, or ``Overloaded``."""
        key = hashlib.sha256(text.encode()).digest()
        with self._lock:
            passed = self._passed.get(key)
            if passed is not None:
                self._passed.move_to_end(key)
        if passed is not None and (self.warm is None or
                                   (self.is_warm is not None and self.is_warm(text))):
            return passed
        if self._waiting >= self.max_waiting:
            raise Overloaded(f"{self._waiting} structured-output checks are waiting")
        self._start()
        self._waiting += 1
        turn = None
        if client is not None:
            turn = self._turns.setdefault(client, [asyncio.Lock(), 0])
            turn[1] += 1
        try:
            if turn is not None:
                await turn[0].acquire()
            try:
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._jobs.put(_Job(text, param, loop, future, passed))
                answer = await future
            finally:
                if turn is not None:
                    turn[0].release()
        finally:
            self._waiting -= 1
            if turn is not None:
                turn[1] -= 1
                if turn[1] == 0:
                    self._turns.pop(client, None)
        kind = answer[0]
        if kind == "ok":
            with self._lock:
                self._passed[key] = answer[1]
                self._passed.move_to_end(key)
                while len(self._passed) > self._remember:
                    self._passed.popitem(last=False)
            return answer[1]
        if kind == "error":  # the warm compile's, which names the field already
            raise ValidationError(answer[1], param)
        raise ValidationError(f"{param}: {answer[1]}", param)

    def _serve(self, child: Child) -> None:
        """One thread: runs jobs on its child, one at a time."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.future.done():  # its client left
                continue
            try:
                answer = (["ok", job.passed] if job.passed is not None
                          else self._run(child, job.text))
                if answer[0] == "ok" and self.warm is not None:
                    self.warm(job.text, job.param, answer[1])
            except ValidationError as e:
                answer = ["error", str(e)]
            except Exception as e:  # noqa: BLE001 - a check never takes the server down
                log.exception("grammar check failed")
                answer = ["bad", f"the check failed: {type(e).__name__}"]
            self.counts["passed" if answer[0] == "ok" else "refused"] += 1
            try:
                job.loop.call_soon_threadsafe(_resolve, job.future, answer)
            except RuntimeError:  # the loop closed: the server is stopping
                pass

    def _run(self, child: Child, text: str) -> list[Any]:
        if self._closed:
            return ["bad", "the server is shutting down"]
        try:
            frames = child.ask(json.dumps(text).encode(), self.timeout_s)
        except ChildTimeout:  # still at work at its limit: it was killed
            self.counts["timed_out"] += 1
            return ["bad", f"the grammar takes more than {self.timeout_s:g} s to compile and "
                    "start; simplify it (large repetition counts in a pattern are the usual "
                    "cause)"]
        except ChildDied as e:
            if self._closed:
                return ["bad", "the server is shutting down"]
            self.counts["crashed"] += 1
            log.warning("a structured output's grammar ended its checker process (%s); the "
                        "request is refused and the checker restarted", e)
            if e.code in (-signal.SIGABRT, -signal.SIGKILL):
                return ["bad", "the grammar's compiler ran out of the memory a request may "
                        f"use ({self.setup['memory'] / 2**20:.0f} MB) and stopped; simplify it"]
            return ["bad", f"the grammar crashed its compiler ({e}); simplify it (deep "
                    "nesting or a very large schema are the usual causes)"]
        answer = json.loads(frames[0])
        if answer[0] == "memory":
            child.kill()
            return ["bad", "the grammar needs more memory to compile than a request may use "
                    f"({self.setup['memory'] / 2**20:.0f} MB); simplify it"]
        return answer

    def close(self) -> None:
        """Stop the children (a check under way ends as refused) and the threads."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for child in self._children:
            proc = child.proc
            if proc is not None and proc.poll() is None:
                proc.kill()  # a thread reading its answer sees it end
        for t in threads:
            t.join(timeout=2)
        for child in self._children:
            child.kill()


def _resolve(future: asyncio.Future, answer: list[Any]) -> None:
    if not future.done():
        future.set_result(answer)


if __name__ == "__main__":
    serve(_handle, _setup)
