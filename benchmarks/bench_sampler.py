"""The sampler's cost for temperature, top-k, top-p and min-p, against the sort it replaced.

For each vocabulary x batch x sampling setting it times one step's draw for every row:

* ``kernel``: phasewise's sampler on CPU (``Sampler._sample_rows`` -> the kernels'
  ``sample_list``): each row's filters by radix selection on its weights' bits, no sort, and
  one draw from one uniform number (where the kernels load; else this column repeats
  ``topk``);
* ``topk``: the same filter and draw in torch's operations (``Sampler._sample_torch``, the
  GPU's path and the CPU's fallback): the largest logits from ``torch.topk`` (64, widened
  while a row's nucleus is wider), the inverse of each row's running sum;
* ``sort``: the sampler before these, kept here as the yardstick: the whole vocabulary
  sorted (``Sampler._probs``), then argmax(p / E) with E ~ Exp(1), one exponential a token.

Then the penalties (repetition 1.1, presence 0.5, frequency 0.5) over each row's context
of random tokens (``--contexts``, half prompt and half outputs): ``Sampler._apply_penalties``
in torch's operations (a sort of each row's distinct tokens, a gather, a bincount over the
vocabulary) against the kernels' (``apply_penalties``: a token at a time).

Last, logprobs (the sampled token's and the top 5): ``Sampler._logprobs`` by torch's
log-softmax of the batch and a ``topk`` a row, against the kernels' (``logprob_entries``: an
exp pass and an insertion pass a row).

The methods run interleaved, round after round (~0.2 s each a round), and the median round
counts. Logits are random normals times ``--scale`` (3 gives a nucleus of tens to hundreds
of tokens at top_p 0.95 and temperature 0.7; 0.1 a flat distribution whose nucleus is most
of the vocabulary, as a random-weight checkpoint gives). It prints milliseconds a step and
the ratios to ``sort`` (higher is faster).

    .venv/bin/python -m benchmarks.bench_sampler [--rounds 3] [--scale 3]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

from benchmarks import harness
from phasewise import SamplingParams
from phasewise.engine.request import Request
from phasewise.engine.sampler import Sampler

SETTINGS = {
    "temperature 0.7": {"temperature": 0.7},
    "top_p 0.95, t 0.7": {"temperature": 0.7, "top_p": 0.95},
    "top_k 50, t 0.7": {"temperature": 0.7, "top_k": 50},
    "top_k 40, top_p 0.9, min_p 0.05": {"temperature": 0.8, "top_k": 40, "top_p": 0.9,
                                        "min_p": 0.05},
}


def sort_and_exponentials(sampler: Sampler, reqs: list[Request],
                          logits: torch.Tensor) -> torch.Tensor:
    probs = sampler._probs(reqs, logits)
    noise = torch.empty_like(probs)
    for i in range(len(reqs)):
        noise[i].exponential_(generator=sampler.generator)
    return (probs / noise).argmax(dim=-1)


def interleaved_medians(methods: dict, rounds: int, seconds: float) -> list[float]:
    """Each method's median ms a call over ``rounds`` rounds, the methods by turns
    (``harness.interleaved_medians`` of ``harness.per_call_s``)."""
    calls = {m: partial(harness.per_call_s, fn, seconds) for m, fn in methods.items()}
    med = harness.interleaved_medians(calls, rounds, alternate=False)
    return [med[m] * 1e3 for m in methods]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--scale", type=float, default=3.0)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 2000],
                   help="tokens a row for the penalties")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.2, help="a method's time a round")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; logits N(0, 1) x "
          f"{args.scale}")
    sampler = Sampler(torch.Generator().manual_seed(0))
    print(f"{'vocab':>7} {'batch':>5}  {'setting':33} {'sort ms':>9} {'topk ms':>9} "
          f"{'x':>6} {'kernel ms':>9} {'x':>6} {'kept':>6}")
    for vocab in args.vocabs:
        for b in args.batches:
            logits = torch.randn(b, vocab, generator=torch.Generator().manual_seed(b)) \
                * args.scale
            for name, kw in SETTINGS.items():
                params = SamplingParams(**kw)
                reqs = [Request(f"r{i}", [1, 2], params, eos_token_ids=(0,), arrival_time=0.0)
                        for i in range(b)]
                u = sampler._uniforms(reqs, logits.device)
                methods = {"sort": partial(sort_and_exponentials, sampler, reqs, logits),
                           "topk": partial(sampler._sample_torch, reqs, logits, u),
                           "kernel": partial(sampler._sample_rows, reqs, logits)}
                sort_ms, topk_ms, kernel_ms = interleaved_medians(methods, args.rounds,
                                                                  args.seconds)
                _, probs = sampler._candidates(reqs, logits)
                kept = (probs > 0).sum(dim=-1).float().mean().item()
                print(f"{vocab:7d} {b:5d}  {name:33} {sort_ms:9.3f} {topk_ms:9.3f} "
                      f"{sort_ms / topk_ms:6.1f} {kernel_ms:9.3f} {sort_ms / kernel_ms:6.1f} "
                      f"{kept:6.0f}", flush=True)
    print(f"\n{'vocab':>7} {'batch':>5} {'context':>7}  penalties: {'torch ms':>9} "
          f"{'kernel ms':>9} {'x':>6}")
    pen = SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
    for vocab in args.vocabs:
        for b in args.batches:
            logits = torch.randn(b, vocab, generator=torch.Generator().manual_seed(b))
            for ctx in args.contexts:
                g = torch.Generator().manual_seed(ctx)
                reqs = []
                for i in range(b):
                    ids = torch.randint(0, vocab, (ctx,), generator=g).tolist()
                    r = Request(f"r{i}", ids[:ctx // 2], pen, eos_token_ids=(0,),
                                arrival_time=0.0)
                    for t in ids[ctx // 2:]:
                        r.append_output(t)
                    reqs.append(r)
                methods = {"torch": partial(Sampler._apply_penalties, logits, reqs,
                                            kernels=False),
                           "kernel": partial(Sampler._apply_penalties, logits, reqs)}
                torch_ms, kernel_ms = interleaved_medians(methods, args.rounds, args.seconds)
                print(f"{vocab:7d} {b:5d} {ctx:7d}  {'':10} {torch_ms:9.3f} {kernel_ms:9.3f} "
                      f"{torch_ms / kernel_ms:6.1f}", flush=True)
    print(f"\n{'vocab':>7} {'batch':>5}  logprobs (top 5): {'torch ms':>9} {'kernel ms':>9} "
          f"{'x':>6}")
    lp = SamplingParams(temperature=0, logprobs=5)
    for vocab in args.vocabs:
        for b in args.batches:
            logits = torch.randn(b, vocab, generator=torch.Generator().manual_seed(b)) * 3
            reqs = [Request(f"r{i}", [1], lp, eos_token_ids=(0,), arrival_time=0.0)
                    for i in range(b)]
            tokens = logits.argmax(dim=-1).tolist()
            methods = {"torch": partial(Sampler._logprobs, logits, reqs, tokens, kernels=False),
                       "kernel": partial(Sampler._logprobs, logits, reqs, tokens)}
            torch_ms, kernel_ms = interleaved_medians(methods, args.rounds, args.seconds)
            print(f"{vocab:7d} {b:5d}  {'':17} {torch_ms:9.3f} {kernel_ms:9.3f} "
                  f"{torch_ms / kernel_ms:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
