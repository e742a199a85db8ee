"""The bundled model's quality on held-out standard-library files, beside a baseline
checkpoint: what issue 16 asks of a new bundled model.

The held-out files are the ones ``scripts/train_default_model.py`` keeps out of training
(every 50th file of its sorted listing of this Python's standard library). For each model:

* **held-out loss**: mean negative log-likelihood (nats per token) of every held-out file as
  the training sees it (``<|bos|>`` file ``<|eos|>``, one stream), in non-overlapping windows
  of the shorter context of the two models (so both are scored on the same tokens with the
  same amount of context); with different tokenizers the two losses are on different
  tokens, and nats per byte (the same bytes) is the figure to compare;
* **function heads**: the first ``--heads`` functions of the held-out files (top-level
  functions and methods, in file order, that have a docstring), each cut to its signature
  and its docstring's first line (methods dedented), and completed from there (the model
  closes the docstring or goes on with it) at the checkpoint's
  own default sampling (``generation_config.json``; seeded), with all the tokens the context
  leaves (``--max-tokens``, 1024 at most: many stdlib functions run past 200 tokens, and a
  completion cut off by its budget seldom parses), cut where the function ends (the first
  non-empty line back at the ``def``'s indentation, or the end of the text), and counted as
  parsing if ``ast.parse`` takes head + completion; the table also counts the completions
  still inside their function when their budget ran out (unfinished);
* **greedy repetition**: the same heads completed greedily; the longest run of one non-empty
  line repeated back to back, over all heads (the issue: never more than 3 in a row), and
  how many heads repeat a line more than 3 times (looping);
* **decode at batch 1**: tok/s of a greedy 128-token decode after a held-out prompt, beside
  the bandwidth roofline of its steps (weights + K/V bytes over the read bandwidth measured
  just before): a larger model is more bandwidth-bound.

    .venv/bin/python -m benchmarks.bench_model_quality [--model DIR] [--baseline DIR]
        [--heads 30] [--max-tokens 1024] [--seed 0] [--record]

``--record`` writes the model's figures into its ``training.json`` ("quality") and rewrites
its model card from it (``scripts/train_default_model.py --rewrite-card``).

``--model`` defaults to the bundled model; ``--baseline`` to
``benchmarks/.checkpoints/stdlib-coder-4m``, the 4.2 M-parameter model this work replaces,
extracted from git (commit 54d8b37) when absent. Needs the ``train`` extra
(transformers) for the loss.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import subprocess
import sysconfig
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
from benchmarks.bench_engine import read_gbps  # noqa: E402
from benchmarks.harness import machine_info, machine_line  # noqa: E402

BASELINE = HERE / ".checkpoints" / "stdlib-coder-4m"
BASELINE_REV = "54d8b37"
BASELINE_FILES = ("config.json", "generation_config.json", "model.safetensors",
                  "tokenizer.json", "tokenizer_config.json")


def held_out_files() -> list[Path]:
    from scripts.train_default_model import HOLDOUT_EVERY, corpus_files

    files = corpus_files(Path(sysconfig.get_paths()["stdlib"]))
    return files[::HOLDOUT_EVERY]


def ensure_baseline(path: Path) -> Path:
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    for name in BASELINE_FILES:
        blob = subprocess.run(["git", "-C", str(REPO), "show",
                               f"{BASELINE_REV}:phasewise/assets/stdlib-coder/{name}"],
                              capture_output=True, check=True).stdout
        (path / name).write_bytes(blob)
    return path


def context_of(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])


def held_out_loss(model: Path, texts: list[str], window: int) -> tuple[float, float]:
    """(nats per token, nats per byte) over the held-out stream in windows of ``window``."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    cfg = json.loads((model / "config.json").read_text())
    bos, eos = cfg.get("bos_token_id", 0), cfg.get("eos_token_id", 1)
    ids: list[int] = []
    for t in texts:
        ids += [bos] + tok.encode(t, add_special_tokens=False).ids + [eos]
    lm = LlamaForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[i:i + window + 1])
            if len(chunk) < 2:
                break
            logits = lm(chunk[None, :-1]).logits[0]
            nll = torch.nn.functional.cross_entropy(logits.float(), chunk[1:], reduction="sum")
            total, count = total + float(nll), count + len(chunk) - 1
    n_bytes = sum(len(t.encode()) for t in texts)
    return total / count, total / n_bytes


def cut_function(head: str, completion: str) -> str:
    """head + completion up to the function's end: the first non-empty line at or left of
    the def's indentation (column 0: heads are dedented) after the head."""
    text = head + completion
    out = []
    for i, line in enumerate(text.split("\n")):
        if i >= head.count("\n") + 1 and line.strip() and not line[0].isspace():
            break
        out.append(line)
    return "\n".join(out)


def parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def longest_repeat(text: str) -> int:
    best = run = 0
    prev = None
    for line in text.split("\n"):
        if not line.strip():
            continue
        run = run + 1 if line == prev else 1
        prev = line
        best = max(best, run)
    return best


def completions(llm, heads: list[str], params, room: int) -> list:
    """Every head completed from the end of its docstring's first line (the model closes the
    docstring or continues it), all in one continuously batched run, each with the token
    budget its context leaves (at most ``params.max_tokens``): a stdlib function runs to
    hundreds of tokens, and one cut off by the budget before its end seldom parses."""
    import dataclasses

    tok = llm.tokenizer
    each = [dataclasses.replace(
        params, max_tokens=max(1, min(params.max_tokens, room - len(tok.encode(h)) - 1)))
        for h in heads]
    return llm.generate(heads, each)


def unfinished(head: str, out) -> bool:
    """Cut off by its token budget before the function ended."""
    text = head + out.text
    return out.finish_reason == "length" and cut_function(head, out.text) == text


def decode_b1(llm, prompt: str) -> tuple[float, float]:
    """(tok/s of a greedy 128-token decode after ``prompt``, its bandwidth roofline tok/s)."""
    from phasewise import SamplingParams

    n0 = len(llm.step_stats)
    bw = read_gbps(reps=2) * 1e9
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    steps = [s for s in list(llm.step_stats)[n0:]
             if s.num_decode_tokens == 1 and not s.num_prefill_tokens]
    s = statistics.median(x.duration_s for x in steps)
    ctx = len(llm.tokenizer.encode(prompt)) + 64
    pred = llm.engine.cost_model.predict([], [ctx])
    return 1 / s, bw / pred.bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: the bundled model)")
    ap.add_argument("--baseline", default=str(BASELINE))
    ap.add_argument("--heads", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="most tokens per completion (also cut to what the context leaves)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true",
                    help="write the model's figures into its training.json (\"quality\") "
                    "and rewrite its model card from it")
    args = ap.parse_args()
    from phasewise import LLM
    from phasewise.config import BUNDLED_MODEL

    models = {"baseline": ensure_baseline(Path(args.baseline)),
              "model": Path(args.model or BUNDLED_MODEL)}
    print(machine_line(machine_info()))
    files = held_out_files()
    texts = [f.read_text(encoding="utf-8") for f in files]
    window = min(context_of(m) for m in models.values())
    from scripts.train_default_model import function_heads

    heads = function_heads(files, args.heads)
    print(f"{len(files)} held-out files ({sum(len(t.encode()) for t in texts) / 1e6:.2f} MB), "
          f"loss windows of {window} tokens; {len(heads)} function heads")
    rows = {}
    for name, path in models.items():
        per_token, per_byte = held_out_loss(path, texts, window)
        llm = LLM(str(path), enable_prefix_caching=False)
        room = llm.engine.max_model_len
        sampled_params = llm.engine.default_sampling_params(max_tokens=args.max_tokens,
                                                            seed=args.seed)
        outs = completions(llm, heads, sampled_params, room)
        sampled = [o.text for o in outs]
        ok = sum(parses(cut_function(h, c)) for h, c in zip(heads, sampled))
        cut_off = sum(unfinished(h, o) for h, o in zip(heads, outs))
        greedy_params = llm.engine.default_sampling_params(max_tokens=args.max_tokens,
                                                           temperature=0.0)
        greedy = [o.text for o in completions(llm, heads, greedy_params, room)]
        repeats = [longest_repeat(cut_function(h, c)) for h, c in zip(heads, greedy)]
        rep, looping = max(repeats), sum(r > 3 for r in repeats)
        tok_s, roof = decode_b1(llm, heads[0])
        # from the config: a packed weight (panels, int32) holds two values an element
        params = llm.engine.model_config.num_params
        rows[name] = {"per_token": per_token, "per_byte": per_byte, "parse": ok / len(heads),
                      "unfinished": cut_off,
                      "repeat": rep, "looping": looping, "tok_s": tok_s, "roof": roof,
                      "params": params,
                      "ctx": room, "sample": cut_function(heads[0], sampled[0])}
        print(f"  {name}: {path} ({params / 1e6:.1f} M parameters, context {room})",
              flush=True)
        del llm
    b, m = rows["baseline"], rows["model"]
    print(f"\n{'':9} | {'loss/token':>10} | {'loss/byte':>9} | {'parses':>6} | "
          f"{'unfinished':>10} | {'greedy repeat':>13} | {'looping':>7} | {'decode b1':>10} | "
          f"{'of roofline':>11}")
    for name, r in rows.items():
        print(f"{name:9} | {r['per_token']:10.3f} | {r['per_byte']:9.3f} | {r['parse']:6.0%} | "
              f"{r['unfinished']:10d} | {r['repeat']:13d} | {r['looping']:7d} | "
              f"{r['tok_s']:6.1f} t/s | {r['tok_s'] / r['roof']:11.0%}")
    print(f"model / baseline held-out loss: x{m['per_token'] / b['per_token']:.3f} per token, "
          f"x{m['per_byte'] / b['per_byte']:.3f} per byte (target <= x0.75); parse rate "
          f"{m['parse']:.0%} (target >= 50%); longest greedy repeat {m['repeat']} "
          f"(target <= 3), {m['looping']} of {len(heads)} heads repeat a line more than 3 times")
    vocab = json.loads((models["model"] / "config.json").read_text())["vocab_size"]
    print(f"uniform guess: {math.log(vocab):.2f} nats/token")
    print(f"\nfirst head, sampled ({models['model'].name}):\n{m['sample']}")
    if args.record:
        record(models["model"], m, b, len(heads))


def record(model: Path, m: dict, b: dict, heads: int) -> None:
    """Store the model's figures as its training.json's "quality" and rewrite its card."""
    from scripts.train_default_model import cpu_name, rewrite_card

    path = model / "training.json"
    info = json.loads(path.read_text())
    info["quality"] = {"parse_rate": m["parse"], "heads": heads, "unfinished": m["unfinished"],
                       "greedy_longest_repeat": m["repeat"], "greedy_looping": m["looping"],
                       "loss_vs_baseline": round(m["per_token"] / b["per_token"], 3),
                       "baseline": f"the {b['params'] / 1e6:.1f} M-parameter model it replaced",
                       "cpu": cpu_name()}
    path.write_text(json.dumps(info, indent=1) + "\n")
    rewrite_card(model)
    print(f"recorded in {path} and its README.md")


if __name__ == "__main__":
    main()
