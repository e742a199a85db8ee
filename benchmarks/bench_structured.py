"""What structured output costs a decode step: time per output token (TPOT) of requests
constrained to a JSON schema against free ones, on the bundled model, and the grammar's own
time per token (the mask and advancing the matcher, timed around the two calls) as a share
of TPOT. Target: the mask costs at most 10% of TPOT.

Rounds interleave the two kinds (this VM drifts by 10-30% within minutes); TPOT is each
request's (last token time - first token time) / (tokens - 1), so prefill and the grammar's
compile (before the first token) are outside it. Batch 1 and batch 8. The share is the direct
measure; the TPOT ratio also carries that a constrained request may end early (its
grammar's end), which shortens its context and, in a batch, leaves later steps fewer rows.

    python -m benchmarks.bench_structured [--rounds 6] [--tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.harness import machine_info, machine_line  # noqa: E402

from phasewise import LLM, SamplingParams  # noqa: E402
from phasewise.engine import structured  # noqa: E402
from phasewise.engine.structured import spec_json  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "admin": {"type": "boolean"},
    "roles": {"type": "array", "items": {"enum": ["read", "write", "owner"]}},
    "note": {"type": "string"}}, "required": ["name", "age", "admin", "roles", "note"],
    "additionalProperties": False}
PROMPTS = ["def load_user(path):", "class Config:", "import json\n", "def parse(text):",
           "# settings\n", "def main():", "class User:", "x = {"]


class GrammarClock:
    """Wall time spent in Matcher.apply and Matcher.accept, and how many tokens."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0
        self._apply, self._accept = structured.Matcher.apply, structured.Matcher.accept
        clock = self

        def apply(m, row):
            t = time.perf_counter()
            clock._apply(m, row)
            clock.seconds += time.perf_counter() - t
            clock.tokens += 1

        def accept(m, token):
            t = time.perf_counter()
            ok = clock._accept(m, token)
            clock.seconds += time.perf_counter() - t
            return ok

        structured.Matcher.apply, structured.Matcher.accept = apply, accept

    def reset(self) -> None:
        self.seconds, self.tokens = 0.0, 0


def tpot(out) -> float | None:
    t = out.metrics.token_times
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 2 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args()
    print(machine_line(machine_info()))
    llm = LLM()  # the bundled model
    clock = GrammarClock()
    spec = spec_json("json_schema", SCHEMA)
    print(f"bundled model, {a.tokens} tokens at most, {a.rounds} interleaved rounds; "
          f"schema: an object of 5 fields (strings, an integer, a boolean, an enum array)")
    print(f"{'batch':>5} | {'free TPOT':>10} {'constrained':>12} {'ratio':>7} | "
          f"{'grammar/token':>13} {'share of TPOT':>14} | constrained finished by stop")
    for batch in (1, 8):
        def params(constrained: bool, r: int) -> list[SamplingParams]:
            return [SamplingParams(max_tokens=a.tokens, seed=1000 * r + i, ignore_eos=True,
                                   structured_output=spec if constrained else None)
                    for i in range(batch)]

        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        llm.generate(prompts, params(True, -1))  # warm: kernels, the grammar's tokenizer
        llm.generate(prompts, params(False, -1))
        free, cons, g_s, g_n, stops, total = [], [], 0.0, 0, 0, 0
        for r in range(a.rounds):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                clock.reset()
                outs = llm.generate(prompts, params(constrained, r))
                vals = [v for v in (tpot(o) for o in outs) if v is not None]
                (cons if constrained else free).append(statistics.median(vals))
                if constrained:
                    g_s += clock.seconds
                    g_n += clock.tokens
                    stops += sum(o.finish_reason == "stop" for o in outs)
                    total += len(outs)
        f, c = statistics.median(free), statistics.median(cons)
        per = g_s / max(1, g_n)
        # per token of one request; in a batch-b step the grammar runs b times, once a row
        share = per * batch / c
        print(f"{batch:5d} | {f * 1e3:8.2f}ms {c * 1e3:10.2f}ms x{c / f:5.2f} | "
              f"{per * 1e6:10.1f}us {share:13.1%} | {stops}/{total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
