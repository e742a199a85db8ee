"""A structured output's grammar cannot take a server down or hold it: bounds checked before
llguidance sees a grammar (deep ``$ref`` and rule chains, huge regex repetitions), the check
in a child process that a crash, a memory blow-up or a slow compile ends alone, one check at
a time per client, a compiled-grammar cache bounded in bytes, and a per-token limit on each
request's mask in the engine."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

import phasewise
from phasewise import LLM, SamplingParams
from phasewise.engine import grammar_bounds as gb
from phasewise.engine import structured
from phasewise.engine.structured import GrammarCompiler, spec_json
from phasewise.engine.validation import ValidationError
from phasewise.server.grammar_check import CHILD_STACK_BYTES, GrammarChecker

TOKENIZER = (Path(phasewise.__file__).parent / "assets" / "stdlib-coder" /
             "tokenizer.json").read_text()
VOCAB = 4096


def ref_chain(levels: int) -> dict:
    """The hostile client's schema: ``levels`` objects, each one's property a $ref to the
    next."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["a"]} for i in range(levels)}
    defs[f"d{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(rules: int) -> str:
    return "\n".join(["start: r0"] + [f'r{i}: "t{i}" r{i + 1}?' for i in range(rules)]
                     + [f'r{rules}: "end"'])


def cycle(size: int) -> dict:
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{(i + 1) % size}"}, {"type": "null"}]}
            for i in range(size)}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def problem(kind: str, value) -> str | None:
    return gb.bounds_problem(structured.parse_spec(spec_json(kind, value)))


# -- the bounds -----------------------------------------------------------------------------
def test_the_hostile_clients_grammars_are_over_a_bound():
    assert "nests 2002 subschemas" in problem("json_schema", ref_chain(1000))
    assert "2802 rules" in problem("lark", rule_chain(2800))
    assert "unrolls to more than" in problem("regex", "(a{1000}){1000}")
    assert "nests more than" in problem("regex", "(" * 70 + "a" + ")" * 70)
    # a pattern inside a schema and a regex or schema inside a Lark grammar are bounded too
    assert "the pattern" in problem("json_schema", {"type": "string",
                                                    "pattern": "(a{1000}){1000}"})
    assert "regex" in problem("lark", "start: /(a{100}){101}/")
    assert "%json" in problem("lark", 'start: j\nj: %json ' + str(ref_chain(100))
                              .replace("'", '"'))


@pytest.mark.parametrize("kind, value", [
    ("json_schema", ref_chain(63)),  # 128 subschemas deep, the limit
    ("json_schema", {"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}),  # a recursive tree: its cycle counts once
    ("json_schema", {"type": "object", "properties": {
        f"f{i}": {"type": "string"} for i in range(5000)},
        "required": [f"f{i}" for i in range(4600)]}),  # wide is not deep; 400 optional
    ("regex", "(a{100}){100}"),
    ("regex", r"\d{3}-\d{4}|[A-Z][a-z]{0,30}"),
    ("lark", rule_chain(126)),
    ("lark", 'start: expr\nexpr: term ("+" term)*\nterm: NUMBER | "(" expr ")"\n'
     'NUMBER: /[0-9]+/'),
])
def test_ordinary_and_at_the_limit_grammars_pass_the_bounds(kind, value):
    assert problem(kind, value) is None


def test_an_object_of_more_optional_properties_than_the_parser_tracks_is_refused():
    limit = gb.MAX_OPTIONAL_PROPERTIES
    assert problem("json_schema", wide(limit, False)) is None
    msg = problem("json_schema", wide(limit + 1, False))
    assert f"{limit + 1} optional properties" in msg and "required" in msg
    # required ones do not count; a malformed "required" list is not a crash
    assert problem("json_schema", wide(limit * 10, True)) is None
    bad = {**wide(limit + 1, False), "required": [{"x": 1}, 3]}
    assert "optional properties" in problem("json_schema", bad)


def test_a_cycle_counts_each_subschema_on_it():
    assert problem("json_schema", cycle(60)) is None
    assert "nests" in problem("json_schema", cycle(70))


def wide(n: int, required: bool) -> dict:
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, **({"required": list(props)}
                                                      if required else {})}


@pytest.mark.parametrize("kind, value", [("json_schema", ref_chain(63)),
                                         ("json_schema", cycle(63)),
                                         ("lark", rule_chain(126)),
                                         # llguidance recurses by a schema's width too
                                         ("json_schema", wide(gb.MAX_SCHEMA_NODES - 1, True)),
                                         ("json_schema", wide(16_000, True)),
                                         ("json_schema", {**wide(16_000, False), "required": [
                                             f"p{i}" for i in range(
                                                 16_000 - gb.MAX_OPTIONAL_PROPERTIES)]})],
                         ids=["deep", "cycle", "rules", "widest", "wide", "optional"])
def test_grammars_at_the_bounds_compile_on_the_checking_childs_stack(kind, value):
    """What the bounds let through compiles (and starts) on the checking child's stack, or
    is refused by llguidance's own limits (an error, not a crash), but never overflows it: the server's compiling
    threads have 8 times that, so the native recursion cannot overflow them."""
    compiler = GrammarCompiler(TOKENIZER, (1,), VOCAB)
    compiler.tokenizer  # noqa: B018 - built on this thread, not the small one
    result: list = []

    def run() -> None:
        try:
            m = compiler.compile(spec_json(kind, value))
        except ValidationError as e:  # llguidance's own limits ("schema too large")
            result.append(str(e))
            return
        m.fill()
        result.append(m.error)

    old = threading.stack_size(CHILD_STACK_BYTES)
    try:
        t = threading.Thread(target=run)
        t.start()
    finally:
        threading.stack_size(old)
    t.join()
    # (this process is alive to check: an overflow would have ended it)
    assert len(result) == 1 and (result[0] is None or "compile" in result[0]), result


def test_compiling_refuses_what_is_over_a_bound_before_llguidance_sees_it():
    compiler = GrammarCompiler(TOKENIZER, (1,), VOCAB)
    with pytest.raises(ValidationError) as e:
        compiler.compile(spec_json("json_schema", ref_chain(1000)), "response_format")
    assert e.value.param == "response_format" and "nests" in str(e.value)
    assert compiler._tok is None  # not even the tokenizer was built


# -- the cache --------------------------------------------------------------------------------
def test_compiled_grammars_are_kept_within_a_byte_budget():
    compiler = GrammarCompiler(TOKENIZER, (1,), VOCAB, cache_bytes=4 * 2**20)
    specs = [spec_json("regex", f"[a-z]{{{n}}}x") for n in range(1, 13)]
    for s in specs:
        compiler.compile(s, cost_bytes=2**20)
        assert compiler.cached_bytes <= compiler.cache_bytes
    assert compiler.cached_bytes == 4 * 2**20
    assert [s for s in specs if compiler.cached(s)] == specs[-4:]  # the oldest went first
    compiler.compile(specs[-4])  # a use moves it to the back of the line
    compiler.compile(spec_json("regex", "b+"), cost_bytes=2**20)
    assert compiler.cached(specs[-4]) and not compiler.cached(specs[-3])


# -- the engine: a per-token limit on each request's mask --------------------------------------
def test_a_request_whose_mask_is_over_the_step_limit_ends_alone(hf_checkpoints, monkeypatch):
    llm = LLM(str(hf_checkpoints["LlamaForCausalLM"][0]), dtype="float32")
    monkeypatch.setattr(structured, "STEP_LIMIT_S", -1.0)  # every mask after the first is over
    monkeypatch.setattr(structured, "FIRST_MASK_LIMIT_S", 10.0)
    constrained, free = llm.generate(["x", "y"], [
        SamplingParams(max_tokens=8, structured_output=spec_json("regex", "[a-z]{8}")),
        SamplingParams(max_tokens=8, ignore_eos=True)])
    assert constrained.error is not None and "mask" in constrained.error
    assert len(constrained.token_ids) == 1  # the first mask was within its own limit
    assert free.error is None and len(free.token_ids) == 8


def test_grammars_that_would_more_than_double_a_shared_step_end_costliest_first():
    from types import SimpleNamespace

    from phasewise.engine.sampler import HEAVY_MASK_S, grammars_over_budget

    def req(rid, cost, group=None):
        grammar = None if cost is None else SimpleNamespace(last_fill_s=cost)
        return SimpleNamespace(request_id=rid, grammar=grammar, group=group)

    heavy = [req(f"h{i}", 0.004 + i * 0.001, group="attacker") for i in range(4)]
    other = req("v", None, group="victim")
    cheap = [req(f"c{i}", HEAVY_MASK_S / 2, group="victim") for i in range(3)]
    ended = grammars_over_budget([*heavy, other, *cheap], 0.006, groups=2)
    # 4+5+6+7 ms of heavy masks and 1.5 ms of cheap ones against 6 ms: the three costliest go
    assert sorted(ended) == ["h1", "h2", "h3"]
    assert "took 7.0 ms of CPU time for one token's mask" in ended["h3"]
    assert "this step's grammars 24 ms together" in ended["h3"]
    assert "longer than the step's forward pass (6 ms)" in ended["h3"]
    # a cheap mask is never ended, however many there are
    assert grammars_over_budget([req(f"c{i}", 0.0009, group=i) for i in range(100)],
                                0.005, groups=100) == {}
    # a step that holds one client request alone slows no one else
    assert grammars_over_budget(heavy, 0.005, groups=1) == {}
    assert grammars_over_budget([heavy[0], other], 0.005, groups=2) == {}  # within budget
    # the offline API's requests (no group) are one caller's
    from phasewise.engine.sampler import step_groups

    assert step_groups([req("a", 0.01), req("b", 0.01)]) == 1
    assert step_groups([req("a", 0.01), req("b", 0.01, group=7)]) == 2


def test_a_grammar_that_would_double_shared_steps_ends_and_the_others_go_on(
        hf_checkpoints, monkeypatch):
    from phasewise.engine import sampler
    from phasewise.engine.request_builder import RequestBuilder

    llm = LLM(str(hf_checkpoints["LlamaForCausalLM"][0]), dtype="float32",
              max_num_batched_tokens=32)
    fill = structured.Matcher.fill
    build = RequestBuilder.build
    clients = [True]

    def one_client_each(self, *a, **k):  # as a server's requests are: each its own group
        req = build(self, *a, **k)
        if clients[0]:
            req.group = req.request_id
        return req

    def costly_fill(self):  # every mask after the first as if it took 20 ms of CPU
        bits = fill(self)
        if self.fills > 1:
            self.last_fill_s = 0.02
        return bits

    from phasewise.engine import engine as engine_module

    step = engine_module.sample_step

    def instant_forward(sampler_, ran, groups=1, forward_s=None):
        # the budget is the floor (10 ms) whatever the forward pass took: on a busy machine
        # a measured forward pass may outlast the 20 ms masks
        return step(sampler_, ran, groups, 0.0)

    monkeypatch.setattr(structured.Matcher, "fill", costly_fill)
    monkeypatch.setattr(sampler, "GRAMMAR_STEP_FLOOR_S", 0.01)
    monkeypatch.setattr(engine_module, "sample_step", instant_forward)
    monkeypatch.setattr(RequestBuilder, "build", one_client_each)
    grammar = SamplingParams(max_tokens=8, structured_output=spec_json("regex", "[a-z]{8}"))
    free = SamplingParams(max_tokens=8, ignore_eos=True)
    constrained, other = llm.generate(["x", "y"], [grammar, free])
    assert constrained.error is not None and "may at most double" in constrained.error
    assert constrained.error_code == "invalid_grammar"
    assert other.error is None and len(other.token_ids) == 8
    # another client's prompt, still in chunks that sample nothing, is held up too
    constrained, other = llm.generate(["x", [5] * 300], [grammar, free])
    assert constrained.error is not None and len(constrained.token_ids) < 8
    assert other.error is None and len(other.token_ids) == 8
    # alone, it slows no other request's steps: it runs to its end
    (alone,) = llm.generate(["x"], grammar)
    assert alone.error is None and alone.finish_reason == "stop" and len(alone.text) == 8
    # one caller's batch (the offline API's requests, no group) is one client: none ends
    clients[0] = False
    outs = llm.generate(["x", "y", "z"], grammar)
    assert all(o.error is None and len(o.text) == 8 for o in outs)


# -- the check in a child process --------------------------------------------------------------
def _check(checker: GrammarChecker, text: str, client: str | None = "a") -> int | str:
    async def go():
        try:
            return await checker.check(text, "guided_regex", client)
        except ValidationError as e:
            return str(e)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def unbounded():
    """A checker whose child skips the bounds: how a grammar no bound foresaw behaves."""
    checker = GrammarChecker(TOKENIZER, (1,), VOCAB, timeout_s=120.0, bounds=False,
                             memory_bytes=128 * 2**20, processes=2)
    yield checker
    checker.close()


def test_a_grammar_that_crashes_the_compiler_is_a_400_and_the_checker_goes_on(unbounded):
    answer = _check(unbounded, spec_json("json_schema", ref_chain(3000)))
    # the recursion overflows the child's stack, or, where its pages come first, its
    # memory cap: either way the child dies and the request is refused
    assert ("crashed its compiler (signal SIGSEGV)" in answer
            or "ran out of the memory a request may use" in answer), answer
    assert isinstance(_check(unbounded, spec_json("json_object")), int)


def test_a_grammar_over_the_memory_cap_is_a_400(unbounded):
    answer = _check(unbounded, spec_json("regex", "(a{1000}){1000}"))
    assert "memory" in answer, answer
    assert isinstance(_check(unbounded, spec_json("regex", "[0-9]+")), int)


def test_a_slow_check_holds_only_its_own_client():
    """Client A sends a grammar whose check outlasts the limit, then another; client B
    sends an ordinary one meanwhile: B's answer comes first and passes, A's are refused
    (the slow one killed at its limit), and an invalid pattern is refused at once, not
    after a wait."""
    checker = GrammarChecker(TOKENIZER, (1,), VOCAB, timeout_s=0.5, bounds=False,
                             memory_bytes=2**31, processes=2)
    order: list[str] = []

    async def one(name: str, text: str, client: str):
        try:
            await checker.check(text, "guided_regex", client)
            order.append(f"{name} ok")
        except ValidationError as e:
            order.append(f"{name} refused: {e}")

    async def main():
        await one("warm-up", spec_json("regex", "x"), "c")  # both children started
        await one("warm-up", spec_json("regex", "y"), "d")
        await asyncio.gather(one("A1", spec_json("regex", "(b{1000}){1000}"), "A"),
                             one("A2", spec_json("regex", "(c{1000}){1000}"), "A"),
                             one("B", spec_json("json_object"), "B"),
                             one("B-bad", spec_json("regex", r"(a)\1"), "B2"))

    try:
        asyncio.run(main())
    finally:
        checker.close()
    done = [o.split(" ")[0] for o in order[2:]]
    assert set(done[:2]) == {"B", "B-bad"}, order
    assert order[2:][done.index("B")] == "B ok"
    assert "backreferences" in order[2:][done.index("B-bad")]
    for name in ("A1", "A2"):
        text = order[2:][done.index(name)]
        assert "more than 0.5 s" in text or "ms to compute" in text, text
    assert checker.counts["timed_out"] + checker.counts["refused"] >= 2


def test_a_grammar_that_passed_is_not_checked_again():
    checker = GrammarChecker(TOKENIZER, (1,), VOCAB, processes=1)
    try:
        text = spec_json("regex", "[a-z]+@[a-z]+")
        assert isinstance(_check(checker, text), int)
        checker._children[0].proc.kill()  # a second check would need the child
        assert isinstance(_check(checker, text), int)
        assert checker.counts["passed"] == 1
    finally:
        checker.close()


def test_compile_aside_fills_the_cache_from_a_thread_of_its_own_and_never_raises():
    """A prefill worker compiles a relayed request's grammar aside before the engine thread
    meets it (compiled there, it would hold every other prompt's step)."""
    compiler = GrammarCompiler(TOKENIZER, (1,), VOCAB)
    threads: list[str] = []
    real = compiler.compile

    def spy(text: str, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(text, *args, **kwargs)

    compiler.compile = spy  # type: ignore[method-assign]
    text = spec_json("regex", "[a-z]{1,8}")
    asyncio.run(structured.compile_aside(compiler, text))
    assert compiler.cached(text) and threads == ["phasewise-grammar-aside"]
    asyncio.run(structured.compile_aside(compiler, text))  # cached: not compiled again
    assert threads == ["phasewise-grammar-aside"]
    bad = spec_json("regex", "(")
    asyncio.run(structured.compile_aside(compiler, bad))  # left for the engine to refuse
    assert not compiler.cached(bad)
