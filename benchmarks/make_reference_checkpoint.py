"""Build the reference checkpoint for speed work (see docs/benchmarks.md).

A random-weight bf16 model with Qwen2-0.5B's shape and a 32,000-token vocabulary: 24 layers,
hidden 896, intermediate 4864, 14 heads, 2 KV heads, tied embeddings, rope_theta 1e6, about
387 M parameters (0.77 GB). Random weights change nothing about speed.

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the Python
standard library's sources; the model is written with transformers' ``save_pretrained``.
Deterministic (fixed seed, sorted inputs); downloads nothing.

    python -m benchmarks.make_reference_checkpoint [OUT_DIR]

Needs transformers (the test extra).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / ".checkpoints" / "qwen2-0.5b-shape-random"
# (benchmarks.harness.REFERENCE_MODEL is the same folder; harness.reference_checkpoint()
# builds it here when absent)


def build(out: Path) -> Path:
    import torch
    import transformers

    from phasewise.model.tiny import stdlib_text, train_tokenizer

    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        print(f"reference checkpoint already at {out}", file=sys.stderr)
        return out
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out, stdlib_text(max_bytes=8_000_000), vocab_size=32000)
    print(f"tokenizer: {vocab} tokens ({time.monotonic() - t0:.0f}s)", file=sys.stderr)
    cfg = transformers.Qwen2Config(
        vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    print(f"model: {n / 1e6:.0f} M parameters written to {out} "
          f"({time.monotonic() - t0:.0f}s)", file=sys.stderr)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT,
                    help=f"the folder to write (default: {DEFAULT_OUT})")
    build(ap.parse_args().out)
