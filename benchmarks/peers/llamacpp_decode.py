"""Batch-1 decode and 512-token prefill on llama.cpp (llama-cpp-python), per GGUF weight type.

Runs in the virtual environment that llamacpp_setup.sh builds, never the project's:

    /tmp/llamacpp-venv/bin/python -m benchmarks.peers.llamacpp_decode MODEL_DIR \
        [--types q8_0,bf16] [--threads 2] [--reps 3] [--quick]

For each type, the HF checkpoint in MODEL_DIR is converted once with llama.cpp's own
convert_hf_to_gguf.py (``--outtype TYPE``; the one in the unpacked sdist, found under
VENV/src or given with --converter) to MODEL_DIR/gguf/model-TYPE.gguf and reused after.
It is loaded with ``Llama(n_ctx=1024, n_batch=512, n_threads=THREADS)`` and timed:

- ``b1_decode_tok_s``: a 128-token prompt (``workloads.prompts(1, 128, salt)``, token ids, no
  tokenizer) is evaluated untimed, then 128 tokens are decoded greedily one ``eval`` at a time
  (argmax of the last logits; EOS is not special, so exactly 128 are decoded). Only the 128
  decode steps are timed, argmax included; the best of the repetitions is reported.
- ``prefill512_s``: one ``eval`` of a 512-token prompt on a reset context, best of the reps.
- ``gguf_bytes``: the size of the GGUF file.

Each repetition uses fresh prompts. A short warm-up run precedes the timings. The last line
is ``RESULT {json}`` keyed by type, after the llama.cpp version and the build's system info.

The tokenizer: the converter identifies a BPE tokenizer's pre-tokenizer by hashing how it
splits a fixed text, and refuses hashes it does not know ("BPE pre-tokenizer was not
recognized"), as with this checkpoint's own byte-level BPE. Its pre-tokenizer is plain
``ByteLevel(use_regex=True)``, i.e. GPT-2's split regex, which llama.cpp calls ``gpt-2``; so the
converter is run in-process with its ``get_vocab_base_pre`` wrapped to fall back to "gpt-2"
when (and only when) the hash is unknown (llama.cpp then tokenizes text exactly as the HF
tokenizer does); the converter file itself is not modified. The timings use token ids, so
they do not depend on the tokenizer either way.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import runpy
import sys
import time
import types
from pathlib import Path

import numpy as np

from benchmarks.workloads import prompts

FALLBACK_PRE_TOKENIZER = "gpt-2"


def find_converter() -> Path:
    found = sorted(Path(sys.prefix, "src").glob("llama_cpp_python-*/vendor/llama.cpp/"
                                               "convert_hf_to_gguf.py"))
    if not found:
        sys.exit(f"no convert_hf_to_gguf.py under {sys.prefix}/src: run llamacpp_setup.sh "
                 "or pass --converter")
    return found[-1]


def load_package(folder: Path, name: str) -> None:
    """Make ``import name`` find the package ``folder/name`` (llama.cpp's ``conversion``, which
    is no installed package; its ``gguf`` is, by llamacpp_setup.sh), by registering it in
    ``sys.modules`` with that folder as its path; nothing is added to the import path."""
    if name in sys.modules:
        return
    init = folder / name / "__init__.py"
    if init.exists():
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(folder / name)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:  # a namespace package: its submodules are found through __path__
        module = types.ModuleType(name)
        module.__path__ = [str(folder / name)]
        sys.modules[name] = module


def convert(converter: Path, model_dir: Path, out: Path, outtype: str) -> None:
    """Run convert_hf_to_gguf.py in this process, with the pre-tokenizer fallback."""
    load_package(converter.parent, "conversion")  # beside the converter, not installed
    from conversion.base import TextModel

    if not getattr(TextModel.get_vocab_base_pre, "fallback", False):
        recognise = TextModel.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                return recognise(self, tokenizer)
            except NotImplementedError:
                print(f"pre-tokenizer not recognised: writing {FALLBACK_PRE_TOKENIZER!r}",
                      file=sys.stderr)
                return FALLBACK_PRE_TOKENIZER

        get_vocab_base_pre.fallback = True
        TextModel.get_vocab_base_pre = get_vocab_base_pre

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    argv = sys.argv
    sys.argv = [str(converter), str(model_dir), "--outtype", outtype, "--outfile", str(partial)]
    try:
        runpy.run_path(str(converter), run_name="__main__")
    finally:
        sys.argv = argv
    partial.rename(out)


def bench(llm, n_vocab: int, reps: int) -> dict[str, float]:
    import llama_cpp

    def greedy() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    def decode(prompt: list[int], n: int) -> float:
        llm.reset()
        llm.eval(prompt)
        token = greedy()
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([token])
            token = greedy()
        return time.perf_counter() - t

    def prefill(prompt: list[int]) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - t

    decode(prompts(1, 16, salt=0)[0], 4)  # warm-up
    prefill(prompts(1, 512, salt=0)[0])
    # salts as workloads.best_generate_time gives a single request of that length
    best_decode = min(decode(prompts(1, 128, salt=r + 11 + 128)[0], 128) for r in range(reps))
    best_prefill = min(prefill(prompts(1, 512, salt=r + 11 + 512)[0]) for r in range(reps))
    return {"b1_decode_tok_s": 128 / best_decode, "prefill512_s": best_prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--types", default="q8_0,bf16", help="GGUF outtypes, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repetition")
    ap.add_argument("--converter", type=Path, help="path of convert_hf_to_gguf.py")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="load without llama.cpp's extra buffer types (its weight repacking and "
                    "AMX backend): on a 2-core AMX Xeon the 0.3.36 build crashed (SIGSEGV) at "
                    "the first eval of the reference checkpoint with them")
    args = ap.parse_args()
    reps = 1 if args.quick else args.reps

    import llama_cpp

    if args.no_extra_bufts:  # Llama() takes its model params from the bindings' function
        bindings = llama_cpp.llama_cpp
        default_params = bindings.llama_model_default_params

        def without_extra_bufts():
            params = default_params()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_bufts
        print("extra buffer types: off")

    print(f"llama_cpp {llama_cpp.__version__}")
    print(llama_cpp.llama_print_system_info().decode())
    results: dict[str, dict[str, float]] = {}
    for outtype in args.types.split(","):
        gguf = args.model_dir / "gguf" / f"model-{outtype}.gguf"
        if not gguf.exists():
            t = time.perf_counter()
            convert(args.converter or find_converter(), args.model_dir, gguf, outtype)
            print(f"converted {gguf} in {time.perf_counter() - t:.0f} s")
        llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_batch=512, n_threads=args.threads,
                              n_threads_batch=args.threads, verbose=False)
        results[outtype] = bench(llm, llm.n_vocab(), reps)
        results[outtype]["gguf_bytes"] = gguf.stat().st_size
        del llm
        r = results[outtype]
        print(f"{outtype:>6}: decode {r['b1_decode_tok_s']:7.1f} tok/s (batch 1, "
              f"128 steps after 128), prefill 512 {r['prefill512_s']:.3f} s "
              f"({512 / r['prefill512_s']:.0f} tok/s), {r['gguf_bytes'] / 2**20:.0f} MiB, "
              f"{args.threads} threads, best of {reps}", flush=True)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
