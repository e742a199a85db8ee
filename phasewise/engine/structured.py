"""Structured output: decoding constrained to a JSON schema, any JSON object, a regular
expression, a choice of strings or a Lark grammar, with llguidance.

A request carries its constraint as ``SamplingParams.structured_output``: the JSON text of
one of ``{"type": "json_schema", "schema": {...}}``, ``{"type": "json_object"}``,
``{"type": "regex", "pattern": "..."}``, ``{"type": "choice", "choices": [...]}`` or
``{"type": "lark", "grammar": "..."}`` (text, so that the parameters stay hashable and cross a
router's relay and a prefill worker's wire unchanged). ``GrammarCompiler`` turns it into a
``Matcher`` per request: before each sampled token the matcher's mask sets every token the
grammar does not allow next to -inf (after penalties, before temperature and top-k/top-p, so
greedy and sampled decoding both stay inside the grammar), and the sampled token advances it.
When the grammar can take nothing more, the request ends with finish reason ``stop``; it may
also end earlier by ``eos`` where the grammar accepts the text so far, or by ``max_tokens``
(then the text is cut short and need not parse).

Why llguidance: it compiles a JSON schema one to two orders of magnitude faster than
outlines-core (a compile sits in front of the request's first token) and computes masks at
a similar per-token cost, flat in the vocabulary's size (``benchmarks/bench_grammar.py``;
figures in benchmarks/RESULTS.md, "Structured output"); its wheel has no dependencies.
xgrammar was not taken: its wheel pulls triton into a CPU install.

Limits. ``grammar_bounds.check_bounds`` refuses, before llguidance sees it, a grammar whose
native compile could overflow the stack (deep ``$ref`` or rule chains) or whose regexes unroll
into huge lexers. Compiling and each token's mask are bounded by parser limits tighter than
llguidance's defaults (``LIMITS``: a few milliseconds of lexer work at the start and per
token, no precomputation of large lexemes, short errors). A matcher records the CPU time of
its last mask (``Matcher.last_fill_s``); the engine ends a request whose mask takes longer
than ``STEP_LIMIT_S`` (``FIRST_MASK_LIMIT_S`` for its first), and, where a step's masks
together take longer than its forward pass while it holds other clients' requests, the
costliest (``phasewise.engine.sampler.grammars_over_budget``), so grammars slow the steps
they share at most about twofold. A server checks each grammar in a separate process first
(``phasewise.server.grammar_check``), so that a crash or a memory blow-up there is a 400,
then compiles it here and computes its first mask on a worker thread (``warm``), so the
engine's copy starts warm. Compiled grammars are kept while they fit ``CACHE_BYTES`` (each
counted at what its compile and first masks cost in memory) and each request gets a copy,
so n samples of one request compile once; an evicted one is freed and its memory handed back
to the system. llguidance reads the tokenizer from ``tokenizer.json`` (byte-level and other
BPE vocabularies).
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
import time
from collections import OrderedDict
from typing import Any

from phasewise.engine.grammar_bounds import check_bounds
from phasewise.engine.validation import ValidationError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_CHOICES = 256
# Compiled grammars kept, in bytes of memory (each counted at least MIN_COST_BYTES).
CACHE_BYTES = 256 * 2**20
MIN_COST_BYTES = 64 * 2**10
# One token's mask, in CPU seconds of the thread computing it (so a thread that waits for a
# core is not charged): llguidance takes tens of microseconds for a typical grammar, and a
# limit 1,000 times that ends only pathological ones. The first mask of a matcher does the
# lexer's start-up work.
STEP_LIMIT_S = 0.05
FIRST_MASK_LIMIT_S = 1.0
# Threads that compile grammars: llguidance recurses natively (by nesting and by the number of
# a schema's properties), and what grammar_bounds lets through compiles within the checker
# child's 8 MiB (grammar_check.CHILD_STACK_BYTES); these threads get 8 times that, whatever
# the platform's default (address space only: pages are touched as the recursion goes).
COMPILE_STACK_BYTES = 64 * 2**20
# llguidance's limits (its defaults: 1M initial and 200k per-step lexer fuel, 50k Earley items
# a step, 250k lexer states, large lexemes precomputed, verbose errors)
LIMITS = dict(initial_lexer_fuel=200_000, step_lexer_fuel=100_000, step_max_items=20_000,
              max_lexer_states=50_000, max_grammar_size=200_000,
              precompute_large_lexemes=False, verbose_errors=False)
MAX_ERROR_CHARS = 400


class TooDeep(ValueError):
    """A schema nested too deeply to write as JSON."""


def spec_json(kind: str, value: Any = None) -> str:
    """The ``structured_output`` text of one constraint (checked by ``parse_spec``)."""
    spec: dict[str, Any] = {"type": kind}
    if kind == "json_schema":
        spec["schema"] = value
    elif kind == "regex":
        spec["pattern"] = value
    elif kind == "choice":
        spec["choices"] = list(value)
    elif kind == "lark":
        spec["grammar"] = value
    try:
        # keys in the order given: a schema's properties are written in that order
        return json.dumps(spec, ensure_ascii=False)
    except RecursionError:
        raise TooDeep("the schema is nested too deeply") from None


@functools.lru_cache(maxsize=64)
def _shape_checked(text: str) -> str | None:
    """What is wrong with the shape of a ``structured_output`` text, or None: remembered,
    since each of a request's n samples checks the same (possibly large) text."""
    try:
        parse_spec(text, "")
    except ValidationError as e:
        return str(e).removeprefix(": ")
    return None


def check_spec(text: str, param: str = "structured_output") -> None:
    """``parse_spec``'s verdict on ``text`` without building the spec again for a text seen
    lately; raises ``ValidationError`` naming ``param``."""
    problem = _shape_checked(text)
    if problem is not None:
        raise ValidationError(f"{param}: {problem}", param)


def parse_spec(text: str, param: str = "structured_output") -> dict[str, Any]:
    """Parse and shape-check a ``structured_output`` text; raises ``ValidationError``."""
    def bad(msg: str) -> ValidationError:
        return ValidationError(f"{param}: {msg}", param)

    try:
        spec = json.loads(text)
    except (TypeError, ValueError) as e:
        raise bad(f"not valid JSON ({e})") from None
    except RecursionError:
        raise bad("nested too deeply") from None
    if not isinstance(spec, dict) or spec.get("type") not in KINDS:
        raise bad(f"must be an object whose type is one of {', '.join(KINDS)}")
    kind = spec["type"]
    if kind == "json_schema" and not isinstance(spec.get("schema"), (dict, bool)):
        raise bad("a json_schema needs a schema that is a JSON object")
    if kind == "json_schema":
        big = _wide_integer(spec["schema"])
        if big is not None:
            shown = str(big) if len(str(big)) <= 24 else str(big)[:20] + "..."
            raise bad(f"the schema holds the integer {shown}, outside the 64-bit range the "
                      f"grammar compiler reads ({-2**63} to {2**64 - 1}); write it as a "
                      "number (1e30) or leave the bound out")
    if kind == "regex" and not (isinstance(spec.get("pattern"), str) and spec["pattern"]):
        raise bad("a regex needs a non-empty pattern string")
    if kind == "choice":
        choices = spec.get("choices")
        if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choices)):
            raise bad(f"a choice needs 1-{MAX_CHOICES} non-empty strings")
    if kind == "lark" and not (isinstance(spec.get("grammar"), str) and spec["grammar"]):
        raise bad("a lark grammar needs a non-empty grammar string")
    return spec


def _wide_integer(schema: Any) -> int | None:
    """An integer anywhere in ``schema`` (a key's value or a list's item) outside the 64-bit
    range (JSON allows any; llguidance's reader does not), or None. Iterative."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if isinstance(node, int):
            if not -2**63 <= node < 2**64:
                return node
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def _short_error(message: str) -> str:
    """llguidance's message, its markup and spacing dropped, a known cause explained."""
    text = " ".join(message.replace("<non-verbose/>", "").split())
    if "NoExtensionBias" in text:
        text += (" (no token can begin any text the grammar matches: a rule may never reach "
                 "text, as in 'start: start')")
    return text


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency; only a broken install lacks it
        raise ValidationError("structured output needs the llguidance package "
                              f"(pip install llguidance): {e}", "structured_output") from e
    return llguidance


def grammar_of(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a parsed spec."""
    llg = _llguidance()
    m = llg.LLMatcher
    kind = spec["type"]
    # Compact JSON: no whitespace between tokens, so a small model cannot spend its
    # max_tokens on blank space inside an object.
    opts = {"whitespace_flexible": False}
    if kind == "json_schema":
        return m.grammar_from_json_schema(spec["schema"], defaults=opts)
    if kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=opts)
    if kind == "regex":
        return m.grammar_from_regex(spec["pattern"])
    if kind == "choice":
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c)
                                                          for c in spec["choices"]))
    return m.grammar_from_lark(spec["grammar"])


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._bits: Any = None  # int32 bitmask, allocated on first use
        self._done = bool(matcher.is_stopped())
        self.fills = 0
        self.last_fill_s = 0.0  # CPU time of the last mask

    def fill(self) -> Any:
        """The grammar's bitmask of the next token (int32 words; bit j of word i is token
        32 i + j), computed into one buffer per request."""
        if self._bits is None:
            import torch

            self._bits = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32)
            self._ptr = self._bits.data_ptr()
            self._nbytes = self._bits.numel() * 4
        t = time.thread_time()
        self._m.unsafe_compute_mask_ptr(self._ptr, self._nbytes)
        self.last_fill_s = time.thread_time() - t
        self.fills += 1
        return self._bits

    @property
    def too_slow(self) -> str | None:
        """Why this request must end, if its last mask took longer than a grammar may hold
        a step (``STEP_LIMIT_S``; ``FIRST_MASK_LIMIT_S`` for the first)."""
        limit = FIRST_MASK_LIMIT_S if self.fills <= 1 else STEP_LIMIT_S
        if self.last_fill_s <= limit:
            return None
        return (f"its structured output's grammar took {self.last_fill_s * 1e3:.0f} ms of CPU "
                f"time to compute one token's mask, over the limit of {limit * 1e3:.0f} ms "
                "(a grammar may not slow every other request's steps); simplify it")

    def apply(self, row: Any) -> None:
        """Set ``row`` (one request's fp32 logits) to -inf wherever the grammar does not
        allow that token next (and past the vocabulary the grammar knows)."""
        bits = self.fill()
        if row.device.type == "cpu" and row.is_contiguous():
            from phasewise.model.cpu.kernels import mask_logits

            if mask_logits(row, bits):
                return
        banned = self.banned(bits).to(row.device)
        width = min(banned.numel(), row.numel())
        row[:width].masked_fill_(banned[:width], float("-inf"))
        row[width:] = float("-inf")

    def banned(self, bits: Any = None) -> Any:
        """A bool tensor [vocab_size] (CPU): True where the grammar does not allow that token
        next (``bits``: the bitmask just filled, else it is filled now)."""
        import numpy as np
        import torch

        bits = self.fill() if bits is None else bits
        flat = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")
        return torch.from_numpy(flat[:self.vocab_size] == 0)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar refused it (a bug: the mask
        allowed only what it accepts)."""
        ok = bool(self._m.consume_token(token))
        self._done = bool(self._m.is_stopped())
        return ok

    @property
    def done(self) -> bool:
        """The grammar can take nothing more: the output is complete."""
        return self._done

    @property
    def error(self) -> str | None:
        return _short(self._m.get_error()) if self._m.is_error() else None


def _short(message: str) -> str:
    message = _short_error(message)
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."


def _rss_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


def _give_back_memory() -> None:
    """Hand freed heap pages back to the system (glibc keeps them otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_stack_lock = threading.Lock()


def compile_thread(target: Any, name: str) -> threading.Thread:
    """A (not yet started) thread with ``COMPILE_STACK_BYTES`` of stack: where grammars may
    be compiled (llguidance recurses natively)."""
    with _stack_lock:  # stack_size is process-wide: set it for this one thread's creation
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    return thread


async def compile_aside(compiler: GrammarCompiler, text: str) -> None:
    """Compile ``text`` into ``compiler``'s cache on a thread of its own (``compile_thread``)
    and wait for it without blocking the event loop, so that the engine thread finds it
    compiled: a grammar compiled on the engine thread holds every request's step for as
    long as it takes. A grammar that does not compile is left for the engine to refuse
    with the request (its error then names the request's field)."""
    import asyncio

    if compiler.cached(text):
        return
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            compiler.compile(text)
        except Exception:  # noqa: BLE001 - the engine compiles it again and reports it
            pass
        finally:
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

    compile_thread(run, "phasewise-grammar-aside")
    await done


class GrammarCompiler:
    """Compiles constraints against one tokenizer (``tokenizer_json``: the text of its
    ``tokenizer.json``) and vocabulary (the model's logits width, which may exceed the
    tokenizer's). ``cache_bytes``: the memory compiled grammars may keep."""

    def __init__(self, tokenizer_json: str, eos_token_ids: tuple[int, ...],
                 vocab_size: int, cache_bytes: int = CACHE_BYTES) -> None:
        self.tokenizer_json = tokenizer_json
        self.eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self._tok: Any = None
        self._limits: Any = None
        # spec text -> (a fresh matcher to copy from, its cost in bytes), oldest use first
        self._compiled: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.cached_bytes = 0
        # the engine thread and a server's worker thread may share one compiler
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        if self._tok is None:
            llg = _llguidance()
            self._tok = llg.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                        eos_token=self.eos or None)
        return self._tok

    def cached(self, text: str) -> bool:
        with self._lock:
            return text in self._compiled

    def compile(self, text: str, param: str = "structured_output",
                cost_bytes: int | None = None) -> Matcher:
        """A matcher for ``text`` (a ``structured_output``); raises ``ValidationError``
        naming ``param`` for a constraint that does not parse, is over a bound
        (``grammar_bounds``) or does not compile. ``cost_bytes``: the memory it is known
        to take when a server's check measured it (that check applied the bounds, so they
        are not walked again here, holding the GIL); else what the compile took here."""
        with self._lock:
            entry = self._compiled.get(text)
            if entry is not None:
                self._compiled.move_to_end(text)
        if entry is not None:
            return Matcher(entry[0].deep_copy(), self.vocab_size)
        spec = parse_spec(text, param)
        if cost_bytes is None:
            check_bounds(spec, param)
        llg = _llguidance()
        if self._limits is None:
            self._limits = llg.LLParserLimits(**LIMITS)
        try:
            grammar = grammar_of(spec)
        except (ValueError, TypeError, RecursionError) as e:
            raise ValidationError(f"{param}: {_short(str(e) or type(e).__name__)}",
                                  param) from None
        before = _rss_bytes()
        template = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise ValidationError(f"{param}: the {spec['type'].replace('_', ' ')} does "
                                  f"not compile: {_short(template.get_error())}", param)
        if cost_bytes is None:
            cost_bytes = _rss_bytes() - before
        self._keep(text, template, max(MIN_COST_BYTES, cost_bytes))
        return Matcher(template.deep_copy(), self.vocab_size)

    def _keep(self, text: str, template: Any, cost: int) -> None:
        freed = 0
        with self._lock:
            old = self._compiled.pop(text, None)
            if old is not None:
                self.cached_bytes -= old[1]
            self._compiled[text] = (template, cost)
            self.cached_bytes += cost
            while self.cached_bytes > self.cache_bytes and len(self._compiled) > 1:
                _, (_, c) = self._compiled.popitem(last=False)
                self.cached_bytes -= c
                freed += c
        if freed >= 16 * 2**20:
            _give_back_memory()

    def forget(self, text: str) -> None:
        with self._lock:
            old = self._compiled.pop(text, None)
            if old is not None:
                self.cached_bytes -= old[1]

    def check(self, text: str, param: str = "structured_output",
              cost_bytes: int | None = None) -> None:
        """Compile ``text`` and compute its first mask (the lexer's first work, which a
        pathological grammar makes expensive or fails), as the engine will; raises
        ``ValidationError`` naming ``param``."""
        m = self.compile(text, param, cost_bytes)
        m.fill()  # errors land in m.error
        if m.error is not None:
            self.forget(text)
            raise ValidationError(f"{param}: the grammar cannot start: {m.error}", param)
