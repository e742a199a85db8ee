"""The bundled model (stdlib-coder) on phasewise and on HF transformers.

Same weights, same machine, same run, greedy, EOS ignored. Workloads:

* prefill: one 200-token prompt of stdlib source, 1 output token (time to first token);
* decode at batch 1: a 16-token prompt + 128 tokens; the decode rate excludes the prefill
  (the same prompt with 1 output token is timed and subtracted);
* batch 8: eight 32-token prompts + 64 tokens each (output tokens/s).

Engines: phasewise with the checkpoint's bf16 weights (its CPU kernels, the default) and in
fp32; transformers (``generate``, static batch) in fp32, its usual CPU choice, and bf16.
Each figure is the best of ``--reps`` repetitions, engines interleaved. Prints figures and
ratios against transformers; at this size both engines are far from the machine's roofline
(see ``phasewise generate``), so the ratios measure per-step overhead more than kernels.

    .venv/bin/python -m benchmarks.bench_default_model [--reps 3] [--skip-hf-bf16]
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch


def stdlib_ids(tokenizer, n: int, length: int, offset: int = 0) -> list[list[int]]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [ids[offset + i * length: offset + (i + 1) * length] for i in range(n)]


class Phasewise:
    def __init__(self, dtype: str) -> None:
        from phasewise import LLM, SamplingParams

        self.name = f"phasewise {dtype}"
        self.llm = LLM(dtype=dtype, enable_prefix_caching=False)
        self.SamplingParams = SamplingParams

    def run(self, prompts: list[list[int]], out: int) -> None:
        self.llm.generate(prompts, self.SamplingParams(temperature=0.0, max_tokens=out,
                                                       ignore_eos=True))


class HF:
    def __init__(self, dtype: str) -> None:
        from transformers import LlamaForCausalLM

        from phasewise.config import BUNDLED_MODEL

        self.name = f"transformers {dtype}"
        self.model = LlamaForCausalLM.from_pretrained(str(BUNDLED_MODEL)).to(
            getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype])).eval()

    def run(self, prompts: list[list[int]], out: int) -> None:
        with torch.no_grad():
            self.model.generate(torch.tensor(prompts), attention_mask=torch.ones(
                len(prompts), len(prompts[0]), dtype=torch.long), max_new_tokens=out,
                min_new_tokens=out, do_sample=False, pad_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-hf-bf16", action="store_true",
                    help="leave out transformers in bf16 (slow on CPUs without bf16 units)")
    a = ap.parse_args()

    from phasewise.config import BUNDLED_MODEL
    from phasewise.model.tokenizer import Tokenizer

    tok = Tokenizer(BUNDLED_MODEL)
    work = {
        "prefill 200 (ms)": (stdlib_ids(tok, 1, 200), 1),
        "b1 prefill 16": (stdlib_ids(tok, 1, 16, 300), 1),
        "b1 16+128": (stdlib_ids(tok, 1, 16, 300), 129),
        "b8 32+64": (stdlib_ids(tok, 8, 32, 400), 64),
    }
    engines = [Phasewise("bfloat16"), Phasewise("float32"), HF("fp32")]
    if not a.skip_hf_bf16:
        engines.append(HF("bf16"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{a.reps} repetitions, best kept", flush=True)
    best = {(e.name, w): float("inf") for e in engines for w in work}
    for e in engines:  # warm-up
        e.run(stdlib_ids(tok, 1, 8), 4)
    for rep in range(a.reps):
        for e in engines:
            for w, (prompts, out) in work.items():
                t = time.perf_counter()
                e.run(prompts, out)
                best[e.name, w] = min(best[e.name, w], time.perf_counter() - t)
        print(f"repetition {rep + 1}/{a.reps} done", flush=True)

    rows = {}
    for e in engines:
        decode_s = best[e.name, "b1 16+128"] - best[e.name, "b1 prefill 16"]
        rows[e.name] = {
            "prefill 200 tokens, ms": best[e.name, "prefill 200 (ms)"] * 1e3,
            "decode b1, tok/s": 128 / decode_s,
            "batch 8, output tok/s": 8 * 64 / best[e.name, "b8 32+64"],
        }
    ref = rows["transformers fp32"]
    width = max(len(n) for n in rows) + 2
    print("\n" + " " * width + "".join(f"{m:>26s}" for m in ref))
    for name, r in rows.items():
        cells = []
        for metric, value in r.items():
            ratio = ref[metric] / value if "ms" in metric else value / ref[metric]
            cells.append(f"{value:>17.1f} (x{ratio:.2f})")
        print(f"{name:{width}s}" + "".join(cells))
    print("ratios: against transformers fp32, same run; > 1 means faster")

if __name__ == "__main__":
    main()
