"""Which grammar library constrained decoding should use on this CPU: llguidance against
outlines-core, by what each costs per generated token (computing the allowed-token mask and
advancing the matcher) and per request (compiling the schema), on this machine's tokenizers.

For each tokenizer (the bundled model's 4,096-token one and the reference checkpoint's
32,000-token one) and each JSON schema, the script draws a valid document token by token,
each step picking a random allowed token (seeded), with both libraries fed the same tokens:
that is the work a decode step adds for a constrained request. It prints the median and p90
per-token time of each, the compile time, and their ratio. xgrammar is not measured: its
wheel pulls triton (hundreds of MB) into a CPU install.

    python -m benchmarks.bench_grammar [--tokens 200]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from benchmarks.harness import machine_info, machine_line

ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = {"bundled (4096)": ROOT / "phasewise" / "assets" / "stdlib-coder",
              "reference (32000)": ROOT / "benchmarks" / ".checkpoints"
              / "qwen2-0.5b-shape-random"}
SCHEMAS = {
    "object": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 5}}, "required": ["name", "age", "tags"],
        "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer"}, "ok": {"type": "boolean"},
        "items": {"type": "array", "maxItems": 6, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 10}, "qty": {"type": "number"},
            "kind": {"enum": ["a", "b", "c"]}}, "required": ["sku", "qty", "kind"],
            "additionalProperties": False}}}, "required": ["id", "ok", "items"],
        "additionalProperties": False},
}


def byte_vocab(tok_json: dict, vocab_size: int) -> dict[bytes, list[int]]:
    """Token id -> its bytes, for a byte-level BPE (GPT-2's printable byte alphabet)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    out: dict[bytes, list[int]] = {}
    special = {t["id"] for t in tok_json.get("added_tokens", [])}
    for s, i in tok_json["model"]["vocab"].items():
        if i in special or i >= vocab_size:
            continue
        out.setdefault(bytes(dec[ch] for ch in s), []).append(i)
    return out


class LLG:
    name = "llguidance"

    def __init__(self, path: Path, eos: int) -> None:
        import llguidance
        import llguidance.torch as lt

        self.lt = lt
        self.tok = llguidance.LLTokenizer((path / "tokenizer.json").read_text(),
                                          eos_token=eos)
        self.mask = lt.allocate_token_bitmask(1, self.tok.vocab_size)

    def compile(self, schema: dict) -> None:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        self.m = llguidance.LLMatcher(self.tok, grammar)
        assert not self.m.is_error(), self.m.get_error()

    def allowed(self) -> list[int]:
        import torch

        self.lt.fill_next_token_bitmask(self.m, self.mask, 0)
        bits = self.mask[0]
        ids = torch.arange(bits.numel() * 32)
        words = bits[ids // 32]
        return ids[((words >> (ids % 32)) & 1).bool()].tolist()

    def step(self) -> None:  # what a decode step adds: the mask
        self.lt.fill_next_token_bitmask(self.m, self.mask, 0)

    def advance(self, t: int) -> None:
        assert self.m.consume_token(t), self.m.get_error()

    def done(self) -> bool:
        return self.m.is_stopped() or self.m.is_accepting()


class Outlines:
    name = "outlines-core"

    def __init__(self, path: Path, eos: int) -> None:
        from outlines_core import Vocabulary

        tj = json.loads((path / "tokenizer.json").read_text())
        size = max(tj["model"]["vocab"].values()) + 1
        self.vocab = Vocabulary(eos, byte_vocab(tj, size))

    def compile(self, schema: dict) -> None:
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema), r"[ ]?")
        self.g = Guide(Index(regex, self.vocab))

    def allowed(self) -> list[int]:
        return list(self.g.get_tokens())

    def step(self) -> None:
        self.g.get_tokens()

    def advance(self, t: int) -> None:
        self.g.advance(t)

    def done(self) -> bool:
        return self.g.is_finished()


def run(libs, schema: dict, tokens: int, seed: int) -> dict[str, dict]:
    """One document drawn through the masks' intersection; both timed on the same tokens."""
    rng = random.Random(seed)
    out = {lib.name: {"step": [], "compile": 0.0} for lib in libs}
    for lib in libs:
        t0 = time.perf_counter()
        lib.compile(schema)
        out[lib.name]["compile"] = time.perf_counter() - t0
    eos = libs[0].tok.eos_token
    for _ in range(tokens):
        # tokens both grammars allow (their JSON whitespace and escapes differ slightly)
        allowed = set(libs[0].allowed())
        for lib in libs[1:]:
            allowed &= set(lib.allowed())
        choices = sorted(allowed - {eos})
        if not choices:
            break
        tok = rng.choice(choices)
        for lib in libs:
            t0 = time.perf_counter()
            lib.step()
            lib.advance(tok)
            out[lib.name]["step"].append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=200, help="tokens per document at most")
    ap.add_argument("--docs", type=int, default=5, help="documents per schema")
    a = ap.parse_args()
    print(machine_line(machine_info()))
    import importlib.metadata as md

    try:
        print("llguidance", md.version("llguidance"), "| outlines-core",
              md.version("outlines_core"))
    except md.PackageNotFoundError as e:
        print(f"{e.name} is not installed: pip install llguidance outlines-core")
        return 2
    print(f"{'tokenizer':>18} {'schema':>7} | {'library':>13} {'compile':>9} "
          f"{'mean/token':>11} {'median':>9} {'p90':>9} | outlines/llguidance (mean)")
    for tname, path in TOKENIZERS.items():
        if not (path / "tokenizer.json").exists():
            print(f"{tname}: no tokenizer at {path} "
                  "(python -m benchmarks.make_reference_checkpoint)")
            continue
        from phasewise.model.tokenizer import Tokenizer

        eos = Tokenizer(path).eos_token_id or 0
        libs = [LLG(path, eos), Outlines(path, eos)]
        for sname, schema in SCHEMAS.items():
            steps = {lib.name: [] for lib in libs}
            comp = {lib.name: [] for lib in libs}
            for d in range(a.docs):
                r = run(libs, schema, a.tokens, seed=d)
                for lib in libs:
                    steps[lib.name] += r[lib.name]["step"]
                    comp[lib.name].append(r[lib.name]["compile"])
            mean = {}
            for lib in libs:
                s = sorted(steps[lib.name])
                mean[lib.name] = statistics.fmean(s)
                print(f"{tname:>18} {sname:>7} | {lib.name:>13} "
                      f"{statistics.median(comp[lib.name]) * 1e3:7.1f}ms "
                      f"{mean[lib.name] * 1e6:9.1f}us {statistics.median(s) * 1e6:7.1f}us "
                      f"{s[int(0.9 * (len(s) - 1))] * 1e6:7.1f}us"
                      + (f" | x{mean['outlines-core'] / mean['llguidance']:.2f}"
                         if lib.name == "outlines-core" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
