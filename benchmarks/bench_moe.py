"""Mixture-of-experts decode on the CPU: does a step read only its experts, as fast as a
dense model of the same active size reads its weights, and how does it compare with HF
transformers on the same checkpoint?

Two random-weight bf16 checkpoints of the same attention and the same bytes a batch-1 decode
step must read: ``moe`` (Qwen3-MoE-shaped: 32 experts of width 512, 4 a token, 8 layers of
hidden 1024) and ``dense`` (Qwen3-shaped, its MLP 4 x 512 wide: what one token's experts
are). Each is run by phasewise (``LLM``, greedy, one prompt, batch 1) and by HF transformers
(``generate``, greedy), the four runs interleaved over ``--rounds`` rounds; a run's figure
is its median decode step (phasewise: the engine's own step times; HF: total time over the
tokens, its prefill subtracted).

Per model: decode ms a step (of --batch tokens) for both engines and their ratio, the weight bytes a step read
(the roofline's count, with the experts phasewise measured the step read:
``StepStats.experts_read``), and those bytes over the step time: the effective bandwidth.
The MoE model's effective bandwidth over the dense model's, in the same run, says whether
decode reads its experts as efficiently as a dense model reads its MLP (1.0: as well): on
one machine, the ratio of the two steps' fractions of the roofline. On CPU both run their
whole decode stack in one fused C call (a sparse layer routing and streaming its experts
there).

    python -m benchmarks.bench_moe [--rounds 3] [--tokens 64] [--batch 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import log, machine_info, machine_line

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 8, 1024, 16, 4, 64
EXPERTS, TOP_K, EXPERT_WIDTH = 32, 4, 512


def build(root: Path) -> dict[str, Path]:
    from phasewise.model.tiny import make_tiny_checkpoint

    common = dict(hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                  num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16", vocab_size=512)
    return {
        "moe": make_tiny_checkpoint(root / "moe", architecture="Qwen3MoeForCausalLM",
                                    intermediate_size=2 * EXPERT_WIDTH, num_experts=EXPERTS,
                                    num_experts_per_tok=TOP_K,
                                    moe_intermediate_size=EXPERT_WIDTH, **common),
        "dense": make_tiny_checkpoint(root / "dense", architecture="Qwen3ForCausalLM",
                                      intermediate_size=TOP_K * EXPERT_WIDTH, **common),
    }


def run_phasewise(llm, prompts: list[list[int]], tokens: int) -> tuple[float, float | None]:
    """Median decode step (s) of all the prompts decoding together, and the experts such a
    step read (per sparse layer)."""
    from phasewise import SamplingParams

    llm.engine.step_stats.clear()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    decodes = [s for s in llm.engine.step_stats if s.num_decode_tokens == len(prompts) and
               not s.num_prefill_tokens]
    experts = [s.experts_read for s in decodes if s.experts_read is not None]
    return (statistics.median(s.duration_s for s in decodes),
            statistics.mean(experts) if experts else None)


def run_hf(model, prompts: list[list[int]], tokens: int) -> float:
    import torch

    ids = torch.tensor(prompts)  # one length: no padding
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    one = gen(1)  # the prefill and the first token
    return (gen(tokens) - one) / (tokens - 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1,
                    help="prompts decoding together (the fused C stack takes up to 6 rows; "
                    "more run layer by layer)")
    a = ap.parse_args(argv)
    if not 1 <= a.batch <= 64:
        ap.error(f"--batch must be in 1..64, got {a.batch}")
    import torch
    import transformers

    from phasewise import LLM
    from phasewise.perf.models import ModelShape

    m = machine_info()
    print(machine_line(m), file=sys.stderr)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp))
        shapes = {k: ModelShape.from_path(p) for k, p in paths.items()}
        llms = {k: LLM(str(p), dtype="bfloat16") for k, p in paths.items()}
        hfs = {k: transformers.AutoModelForCausalLM.from_pretrained(
            str(p), dtype=torch.bfloat16).eval() for k, p in paths.items()}
        prompts = [[10 + (i + j) % 400 for j in range(32)] for i in range(a.batch)]
        got: dict[str, dict[str, list[float]]] = {k: {"pw": [], "hf": [], "experts": []}
                                                  for k in paths}
        for r in range(a.rounds):
            for k in paths:
                step, experts = run_phasewise(llms[k], prompts, a.tokens)
                got[k]["pw"].append(step)
                if experts is not None:
                    got[k]["experts"].append(experts)
                got[k]["hf"].append(run_hf(hfs[k], prompts, a.tokens))
                log(f"round {r + 1}: {k}: phasewise {step * 1e3:.2f} ms/step, HF "
                    f"{got[k]['hf'][-1] * 1e3:.2f} ms/step")
    print(f"\n{machine_line(m)}")
    print(f"models: {LAYERS} layers, hidden {HIDDEN}, {HEADS}/{KV_HEADS} heads; moe: "
          f"{EXPERTS} experts of {EXPERT_WIDTH}, {TOP_K} a token; dense: MLP "
          f"{TOP_K * EXPERT_WIDTH} wide; bf16; batch {a.batch}, {a.tokens} tokens, median of "
          f"{a.rounds} interleaved rounds (a shared machine: figures move 5-30%)")
    bw = {}
    print(f"{'model':<6} {'phasewise':>12} {'HF':>12} {'HF/pw':>7} {'experts':>8} "
          f"{'bytes/step':>11} {'GB/s (pw)':>10}")
    for k in ("moe", "dense"):
        pw, hf = statistics.median(got[k]["pw"]), statistics.median(got[k]["hf"])
        s = shapes[k]
        experts = statistics.mean(got[k]["experts"]) if got[k]["experts"] else None
        params = (s.total_params - s.idle_expert_params(experts) if experts is not None
                  else s.total_params)
        nbytes = 2 * (params - s.embedding_params)  # the embedding table is gathered, not read
        bw[k] = nbytes / pw
        print(f"{k:<6} {pw * 1e3:>9.2f} ms {hf * 1e3:>9.2f} ms {hf / pw:>6.2f}x "
              f"{'-' if experts is None else f'{experts:.2f}':>8} {nbytes / 1e6:>8.1f} MB "
              f"{bw[k] / 1e9:>10.2f}")
    print(f"moe / dense effective bandwidth: {bw['moe'] / bw['dense']:.2f} (1.0: the MoE "
          "step reads its experts as efficiently as the dense step its MLP)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
