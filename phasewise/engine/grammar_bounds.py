"""Bounds on a structured output's grammar, checked in Python before llguidance sees it.

llguidance compiles a grammar by native recursion: a chain of schema ``$ref``s or Lark rules
deep enough overflows the thread's stack and kills the process (about 5 KiB of stack per
level of a ``$ref`` chain, 2 KiB per rule of a Lark chain). A regular expression's repetition
counts multiply into lexer states: ``(a{1000}){1000}`` takes seconds for its first token mask,
hundreds of milliseconds for every later one, and hundreds of MB. So before any native code
runs, ``check_bounds`` measures what drives those costs and refuses, naming the request's
field, what is over a limit:

* a JSON schema's optional properties in one object, which llguidance's parser tracks
  side by side after the object's ``{``.
* a JSON schema's **depth**: the subschemas along the longest chain from the root, following
  local ``$ref``s. Recursive schemas are allowed (llguidance compiles a cycle as a recursive
  rule): each cycle counts as many levels as the subschemas on it, an upper bound on how deep
  any walk through it recurses before it repeats. Also its number of subschemas.
* a Lark grammar's rule-reference depth, counted the same way, its number of rules, its
  size; the JSON schemas (``%json``) and regular expressions inside it.
* a regular expression's **expanded size**: its atoms with every bounded repetition unrolled
  (``a{1000}`` is 1000, ``(ab|c){10}`` is 30; ``*``, ``+`` and ``?`` count once), and its
  group nesting.

What the limits let through compiles on the 8 MiB stack of the server's checking child
(``grammar_check``; tests/test_grammar_limits.py compiles grammars at the limits, deep and
wide, on that stack), and the server itself compiles on 8 times that. They are loose for real
schemas: OpenAI's own structured outputs allow 10 levels of object nesting and 5,000
properties.

Every walk here is iterative with work linear in the input, so a hostile spec costs at most
what it took to parse its JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

from phasewise.engine.validation import ValidationError

MAX_SCHEMA_DEPTH = 128  # subschemas along any chain from the root, $refs followed
MAX_SCHEMA_NODES = 20_000  # subschemas in one schema
# Optional properties of one object. llguidance's parser keeps about four items per optional
# property in the row that follows an object's "{" and refuses a row of more than 2,000
# (its default max_items_in_row), so a wider object compiles and then fails at its first
# token; refused here instead, with a remedy.
MAX_OPTIONAL_PROPERTIES = 400
MAX_RULE_DEPTH = 128  # Lark rules along any chain of references
MAX_RULES = 2_000
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_REGEX_SIZE = 10_000  # atoms with bounded repetitions unrolled
MAX_REGEX_NESTING = 64  # groups inside groups

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class _Bad(Exception):
    """One bound broken: the message, without the field's name."""


def check_bounds(spec: dict[str, Any], param: str) -> None:
    """Raise ``ValidationError`` naming ``param`` if the parsed ``structured_output`` spec
    (``phasewise.engine.structured.parse_spec``) is over a bound."""
    problem = bounds_problem(spec)
    if problem is not None:
        raise ValidationError(f"{param}: {problem}", param)


def bounds_problem(spec: dict[str, Any]) -> str | None:
    """What bound the parsed spec breaks, or None."""
    kind = spec["type"]
    try:
        if kind == "json_schema":
            schema_bounds(spec["schema"])
        elif kind == "regex":
            regex_bounds(spec["pattern"])
        elif kind == "lark":
            lark_bounds(spec["grammar"])
        elif kind == "choice":
            for c in spec["choices"]:
                if len(c) > MAX_GRAMMAR_CHARS:
                    raise _Bad(f"a choice has {len(c)} characters; the limit is "
                               f"{MAX_GRAMMAR_CHARS}")
    except _Bad as e:
        return str(e)
    return None


# -- the longest chain through a graph that may hold cycles ---------------------------------
def _longest_chain(nodes: list[Any], edges: Callable[[int], Iterator[int]]) -> int:
    """The number of nodes on the longest chain from node 0, where every strongly connected
    component (a cycle and what it reaches back to) counts as its size: an upper bound on the
    depth a depth-first walk that stops at a node it is already inside can reach. Iterative
    Tarjan, then the longest path over the components' DAG."""
    n = len(nodes)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    sizes: list[int] = []
    counter = 0
    work: list[tuple[int, Iterator[int]]] = []

    def visit(v: int) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack[v] = True
        work.append((v, edges(v)))

    visit(0)
    while work:
        v, it = work[-1]
        for w in it:
            if index[w] < 0:
                visit(w)
                break
            if on_stack[w]:
                low[v] = min(low[v], index[w])
        else:
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                size = 0
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = len(sizes)
                    size += 1
                    if w == v:
                        break
                sizes.append(size)
    # Tarjan numbers components in reverse topological order: a component's successors
    # all have smaller numbers, so one pass upward finds each one's longest chain.
    best = [0] * len(sizes)
    succ: list[set[int]] = [set() for _ in sizes]
    for v in range(n):
        if comp[v] < 0:
            continue
        for w in edges(v):
            if comp[w] != comp[v]:
                succ[comp[v]].add(comp[w])
    for c in range(len(sizes)):
        best[c] = sizes[c] + max((best[d] for d in succ[c]), default=0)
    return best[comp[0]] if n else 0


# -- JSON schemas ---------------------------------------------------------------------------
def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#`` or ``#/a/b``) names, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(node: dict[str, Any]) -> Iterator[Any]:
    for key in _ONE:
        value = node.get(key)
        if isinstance(value, (dict, bool)):
            yield value
    for key in _LIST:
        value = node.get(key)
        if isinstance(value, list):
            yield from value
    for key in _MAP:
        value = node.get(key)
        if isinstance(value, dict):
            yield from value.values()
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        yield from (v for v in deps.values() if isinstance(v, dict))


def schema_bounds(schema: Any) -> None:
    """Depth (``$ref``s followed) and size of a JSON schema; the regexes of its patterns."""
    if not isinstance(schema, dict):
        return
    ids: dict[int, int] = {}
    nodes: list[dict[str, Any]] = []
    out: list[list[int]] = []

    def node_id(node: dict[str, Any]) -> int:
        i = ids.get(id(node))
        if i is None:
            if len(nodes) >= MAX_SCHEMA_NODES:
                raise _Bad(f"the schema has more than {MAX_SCHEMA_NODES} subschemas")
            i = ids[id(node)] = len(nodes)
            nodes.append(node)
            out.append([])
            todo.append(i)
        return i

    todo: list[int] = []
    node_id(schema)
    while todo:
        i = todo.pop()
        node = nodes[i]
        targets = [c for c in _children(node) if isinstance(c, dict)]
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _pointer(schema, ref)
            if isinstance(target, dict):
                targets.append(target)
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > MAX_OPTIONAL_PROPERTIES:
            required = node.get("required")
            wanted = ({r for r in required if isinstance(r, str)}
                      if isinstance(required, list) else set())
            optional = sum(1 for name in props if name not in wanted)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise _Bad(f"an object has {optional} optional properties; the limit is "
                           f"{MAX_OPTIONAL_PROPERTIES} (list more of them in \"required\", or "
                           "split the object)")
        for pattern in (node.get("pattern"),):
            if isinstance(pattern, str):
                try:
                    regex_bounds(pattern)
                except _Bad as e:
                    raise _Bad(f"the pattern {pattern[:60]!r}: {e}") from None
        for key in ("patternProperties",):
            value = node.get(key)
            if isinstance(value, dict):
                for pattern in value:
                    regex_bounds(pattern)
        out[i] = [node_id(t) for t in targets]
    depth = _longest_chain(nodes, lambda v: iter(out[v]))
    if depth > MAX_SCHEMA_DEPTH:
        raise _Bad(f"the schema nests {depth} subschemas deep (following $ref, a cycle "
                   f"counting each subschema on it once); the limit is {MAX_SCHEMA_DEPTH}")


# -- regular expressions --------------------------------------------------------------------
_COUNT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")


def regex_bounds(pattern: str) -> None:
    """Expanded size and group nesting of a regular expression (the syntax llguidance's
    regex parser takes: escapes, classes, groups, alternation, ``*+?`` and ``{m,n}``)."""
    if len(pattern) > MAX_GRAMMAR_CHARS:
        raise _Bad(f"the regex has {len(pattern)} characters; the limit is "
                   f"{MAX_GRAMMAR_CHARS}")
    # One frame per open group: (size of its finished alternatives, size of the current
    # sequence, size of the last atom of that sequence).
    frames: list[list[int]] = [[0, 0, 0]]
    i, n = 0, len(pattern)

    def atom(size: int) -> None:
        f = frames[-1]
        f[1] += size
        f[2] = size

    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            atom(1)
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            atom(1)
            continue
        if c == "(":
            frames.append([0, 0, 0])
            if len(frames) - 1 > MAX_REGEX_NESTING:
                raise _Bad(f"the regex nests more than {MAX_REGEX_NESTING} groups")
            i += 1
            if pattern.startswith("?", i):  # (?:...), (?P<name>...), (?i) and the like
                m = re.compile(r"\?(?:P?<[^>]*>|[A-Za-z-]*:?)").match(pattern, i)
                i = m.end() if m else i + 1
            continue
        if c == ")":
            if len(frames) == 1:
                i += 1
                continue
            f = frames.pop()
            atom(f[0] + f[1])
            i += 1
            continue
        if c == "|":
            f = frames[-1]
            f[0] += f[1]
            f[1] = f[2] = 0
            i += 1
            continue
        if c in "*+?":
            i += 1
            continue
        if c == "{":
            m = _COUNT.match(pattern, i)
            if m and (m.group(1) or m.group(3)):
                low = int(m.group(1) or 0)
                high = int(m.group(3)) if m.group(3) else low
                times = max(low, high, 1)
                f = frames[-1]
                # the last atom is now repeated: its size becomes size x times
                f[1] += f[2] * (times - 1)
                f[2] *= times
                if f[1] > MAX_REGEX_SIZE:
                    break
                i = m.end()
                continue
        atom(1)
        i += 1
    total = 0
    for f in frames:
        total += f[0] + f[1]
    if total > MAX_REGEX_SIZE:
        raise _Bad(f"the regex unrolls to more than {MAX_REGEX_SIZE} atoms (every bounded "
                   f"repetition such as {{1000}} multiplies what it repeats); simplify it")


# -- Lark grammars --------------------------------------------------------------------------
_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*:", re.M)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"i?')
_REGEX = re.compile(r"/(?:[^/\\\n]|\\.)+/[imsulx]*")


def _lark_pieces(text: str) -> Iterator[tuple[str, str]]:
    """(kind, text) for each piece of a Lark grammar: name, string, regex, json (a %json
    block's object), or other."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if c == '"':
            m = _STRING.match(text, i)
            if m:
                yield "string", m.group()
                i = m.end()
                continue
        if c == "/":
            m = _REGEX.match(text, i)
            if m:
                yield "regex", m.group()[1:m.group().rindex("/")]
                i = m.end()
                continue
        if text.startswith("%json", i):
            j = text.find("{", i)
            if j >= 0:
                try:
                    value, end = json.JSONDecoder().raw_decode(text, j)
                except (ValueError, RecursionError):
                    raise _Bad("a %json block is not a valid JSON object") from None
                yield "json", value  # type: ignore[misc]
                i = end
                continue
        m = _NAME.match(text, i)
        if m:
            yield "name", m.group()
            i = m.end()
            continue
        yield "other", c
        i += 1


def lark_bounds(text: str) -> None:
    """Size, rules, rule-reference depth of a Lark grammar, and the schemas and regexes in
    it."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _Bad(f"the grammar has {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}")
    starts = [(m.start(), m.group(1)) for m in _RULE.finditer(text)]
    if len(starts) > MAX_RULES:
        raise _Bad(f"the grammar has {len(starts)} rules; the limit is {MAX_RULES}")
    names = {name: k for k, (_, name) in enumerate(starts)}
    refs: list[set[int]] = [set() for _ in starts]
    # A graph node per rule, plus node 0 for the grammar's entry (start, or the first rule).
    bodies = [(s, starts[k + 1][0] if k + 1 < len(starts) else len(text), name)
              for k, (s, name) in enumerate(starts)]
    for k, (s, e, name) in enumerate(bodies):
        body = text[s:e].split(":", 1)[1] if ":" in text[s:e] else ""
        for kind, piece in _lark_pieces(body):
            if kind == "name" and piece in names:
                refs[k].add(names[piece])
            elif kind == "regex":
                try:
                    regex_bounds(piece)
                except _Bad as e2:
                    raise _Bad(f"rule {name}'s regex /{piece[:60]}/: {e2}") from None
            elif kind == "json":
                try:
                    schema_bounds(piece)
                except _Bad as e2:
                    raise _Bad(f"rule {name}'s %json schema: {e2}") from None
    if not starts:
        return
    entry = names.get("start", 0)
    nodes = list(range(len(starts)))
    order = [entry] + [k for k in nodes if k != entry]
    pos = {k: j for j, k in enumerate(order)}
    depth = _longest_chain(order, lambda v: (pos[w] for w in refs[order[v]]))
    if depth > MAX_RULE_DEPTH:
        raise _Bad(f"the grammar's rules reference each other {depth} deep (a cycle counting "
                   f"each rule on it once); the limit is {MAX_RULE_DEPTH}")
