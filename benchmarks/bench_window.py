"""Sliding-window decode on the CPU: do a windowed model's decode steps stop slowing down, and
its K/V pool stop filling, once the context passes the window?

Two random-weight bf16 checkpoints that differ only in their attention's reach: ``window``
(Mistral-shaped, every layer attending to its last ``--window`` positions) and ``full`` (the
same config without a window). Each is run by phasewise at batch 1: a prompt of each
``--contexts`` length, then ``--tokens`` greedy tokens; a run's figure is its median decode
step (the engine's own step times). The two models are run by turns, the contexts in each
round, over ``--rounds`` rounds.

Per context: each model's decode step, their ratio, and the ratio the bytes predict (decode is
memory-bound: the weights and the K/V a step reads, from the roofline's model of the shape:
``ModelShape.attended``), and the most K/V blocks the request held while it decoded
(``kv_usage`` of the pool: the windowed model gives back the blocks behind its window).

    python -m benchmarks.bench_window [--contexts 1024,4096,12288] [--window 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import log, machine_info, machine_line

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 1024, 8, 8, 128, 2816


def build(root: Path, window: int, max_len: int) -> dict[str, Path]:
    from phasewise.model.tiny import make_tiny_checkpoint

    common = dict(architecture="MistralForCausalLM", hidden_size=HIDDEN, num_layers=LAYERS,
                  num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                  intermediate_size=INTER, dtype="bfloat16", vocab_size=512,
                  max_position_embeddings=max_len)
    return {"window": make_tiny_checkpoint(root / "window", sliding_window=window, **common),
            "full": make_tiny_checkpoint(root / "full", sliding_window=None, **common)}


def run(llm, prompt: list[int], tokens: int) -> tuple[float, float]:
    """Median decode step (s), and the most of the pool its decode steps held."""
    from phasewise import SamplingParams

    llm.engine.step_stats.clear()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    decodes = [s for s in llm.engine.step_stats if s.num_decode_tokens
               and not s.num_prefill_tokens]
    return (statistics.median(s.duration_s for s in decodes),
            max(s.kv_usage for s in decodes))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,12288")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.contexts.split(",")]
    from phasewise import LLM
    from phasewise.perf.models import ModelShape

    m = machine_info()
    print(machine_line(m), file=sys.stderr)
    max_len = max(contexts) + a.tokens + 1
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp), a.window, max_len)
        shapes = {k: ModelShape.from_path(p) for k, p in paths.items()}
        llms = {k: LLM(str(p), dtype="bfloat16", max_model_len=max_len,
                       enable_prefix_caching=False) for k, p in paths.items()}
        for r in range(a.rounds):
            for ctx in contexts:
                prompt = [3 + (7 * i) % 500 for i in range(ctx)]
                for k in paths:
                    got.setdefault((k, ctx), []).append(run(llms[k], prompt, a.tokens))
                    step = got[(k, ctx)][-1][0]
                    log(f"round {r + 1}: {k} at {ctx}: {step * 1e3:.2f} ms/token")
        blocks = {k: llm.engine.kv.num_blocks for k, llm in llms.items()}
    print(f"\n{machine_line(m)}")
    print(f"models: {LAYERS} layers, hidden {HIDDEN}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, "
          f"MLP {INTER}; window: every layer's last {a.window} positions, full: no window; "
          f"bf16; batch 1, {a.tokens} tokens, median of {a.rounds} rounds (a shared machine: "
          "figures move 5-30%)")
    w, f = shapes["window"], shapes["full"]
    weights = 2 * (w.total_params - w.embedding_params)  # the embedding table is gathered
    kvpt = w.kv_bytes_per_token(2)
    print(f"{'context':>8} {'window':>10} {'full':>10} {'full/window':>12} "
          f"{'bytes predict':>14} {'K/V held (window)':>18} {'K/V held (full)':>16}")
    for ctx in contexts:
        n = ctx + a.tokens // 2  # the median decode's context
        tw = statistics.median(s for s, _ in got[("window", ctx)])
        tf = statistics.median(s for s, _ in got[("full", ctx)])
        predicted = (weights + kvpt * f.attended(n)) / (weights + kvpt * w.attended(n))
        held = {k: got[(k, ctx)][-1][1] * blocks[k] for k in paths}
        print(f"{ctx:>8} {tw * 1e3:>7.2f} ms {tf * 1e3:>7.2f} ms {tf / tw:>11.2f}x "
              f"{predicted:>13.2f}x {held['window']:>12.0f} blocks {held['full']:>10.0f} blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
