"""The offline workloads every engine runs, shared by bench_engine.py and the peer scripts.

Standard library only: the peer scripts import it from other engines' virtual environments.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# name -> (requests, prompt tokens, output tokens)
WORKLOADS: dict[str, tuple[int, int, int]] = {
    "prefill512_s": (1, 512, 1),
    "b1_prefill128_s": (1, 128, 1),
    "b1_total_s": (1, 128, 128),
    "b8_total_s": (8, 128, 64),
    "b32_total_s": (32, 128, 64),
}
WARMUP = (1, 16, 4)


def prompts(n: int, length: int, salt: int) -> list[list[int]]:
    """Distinct token-id prompts (no prefix sharing between requests or repetitions)."""
    return [[100 + (salt * 7919 + i * 131 + j * 17) % 30000 for j in range(length)]
            for i in range(n)]


def best_generate_time(generate: Callable[[list[list[int]], int], object], n: int,
                       length: int, out: int, reps: int) -> float:
    """Best wall time of ``generate(prompts, max_new_tokens)`` over ``reps`` repetitions,
    each with fresh prompts."""
    best = float("inf")
    for r in range(reps):
        ps = prompts(n, length, salt=r + 1 + 10 * n + length)
        t = time.perf_counter()
        generate(ps, out)
        best = min(best, time.perf_counter() - t)
    return best
