"""``make-tiny``: a random-weight checkpoint to try things on."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from phasewise.cli.args import Command


def add_commands(command: Command) -> None:
    from phasewise.model.config import SUPPORTED_ARCHITECTURES

    t = command("make-tiny", "write a tiny random-weight checkpoint (HF layout)",
                cmd_make_tiny)
    t.add_argument("out",
                   help="folder to write the checkpoint into")
    t.add_argument("--arch", default="LlamaForCausalLM", choices=list(SUPPORTED_ARCHITECTURES),
                   help="the architecture (the config.json's architectures)")
    t.add_argument("--vocab-size", type=int, default=512,
                   help="vocabulary size (300-65536)")
    t.add_argument("--hidden-size", type=int, default=64,
                   help="hidden size (8-4096, a multiple of 8)")
    t.add_argument("--layers", type=int, default=2,
                   help="decoder layers (1-64)")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights")
    t.add_argument("--force", action="store_true",
                   help="write into a folder that already holds files (overwriting them)")
    t.add_argument("--sliding-window", type=int, default=None, metavar="N",
                   help="attend to the last N positions only, in every layer (default: the "
                   "whole context)")


def _check_tiny_size(a: argparse.Namespace, window: dict[str, Any]) -> int:
    """The weights' bytes make-tiny would write; refused where this machine's memory or the
    folder's disk could not take them (the tensors and their serialised copy are both held
    while writing)."""
    import shutil

    from phasewise.engine.kv_sizing import host_memory_available
    from phasewise.model.tiny import tiny_config
    from phasewise.perf.models import ModelShape

    cfg = tiny_config(a.arch, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                      num_layers=a.layers, **window)
    size = int(ModelShape.from_hf_config(cfg, name=a.arch, source="make-tiny").total_params) * 4
    avail = host_memory_available()
    if avail is not None and 2 * size > avail:
        raise ValueError(f"--hidden-size {a.hidden_size} and --layers {a.layers} make "
                         f"{size / 2**30:.1f} GiB of float32 weights, which take about "
                         f"{2 * size / 2**30:.1f} GiB of memory to write; this machine has "
                         f"{avail / 2**30:.1f} GiB available: choose a smaller size")
    there = Path(a.out).resolve()
    while not there.exists():
        there = there.parent
    free = shutil.disk_usage(there).free
    if size > free:
        raise ValueError(f"{a.out}: {size / 2**30:.1f} GiB of weights, more than the "
                         f"{free / 2**30:.1f} GiB free on its disk")
    return size


def cmd_make_tiny(a: argparse.Namespace) -> int:
    from phasewise.model.tiny import make_tiny_checkpoint

    t = time.monotonic()
    # A random checkpoint to try things on: 4 heads of hidden/4 (RoPE pairs: a multiple of
    # 8), a byte-level tokenizer's 256 bytes and specials at least, and small enough to
    # write in seconds; anything else is refused by its flag rather than written broken.
    if not 0 <= a.seed <= 2**53 - 1:
        raise ValueError(f"--seed must be an integer in [0, 2^53-1], got {a.seed}")
    for flag, value, lo, hi, step in (("--hidden-size", a.hidden_size, 8, 4096, 8),
                                      ("--layers", a.layers, 1, 64, 1),
                                      ("--vocab-size", a.vocab_size, 300, 65536, 1)):
        if not lo <= value <= hi or value % step:
            also = f", a multiple of {step}" if step > 1 else ""
            raise ValueError(f"{flag} must be in {lo}..{hi}{also}; got {value}")
    if not a.out.strip():
        raise ValueError("make-tiny needs a folder to write into, got an empty path")
    if Path(a.out).exists() and not Path(a.out).is_dir():
        raise ValueError(f"{a.out} is a file; make-tiny writes a checkpoint folder")
    from phasewise.files import check_output

    check_output(a.out, "make-tiny's folder", folder=True)  # (under a file, or unwritable)
    held = sorted(p.name for p in Path(a.out).glob("*")) if Path(a.out).is_dir() else []
    if held and not a.force:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ValueError(f"{a.out} is not empty ({shown}): make-tiny would overwrite a "
                         "checkpoint's files there; choose a new folder, or --force")
    window: dict[str, Any] = {}
    if a.sliding_window is not None:
        if a.sliding_window < 1:
            raise ValueError(f"--sliding-window must be >= 1, got {a.sliding_window}")
        if a.arch == "LlamaForCausalLM":
            raise ValueError("--sliding-window: Llama attends to the whole context; choose "
                             "--arch MistralForCausalLM, MixtralForCausalLM or a Qwen one")
        window = {"sliding_window": a.sliding_window}
        if a.arch.startswith("Qwen"):  # Qwen: enabled, and named on every layer
            window.update(use_sliding_window=True, max_window_layers=0,
                          layer_types=["sliding_attention"] * a.layers)
    size = _check_tiny_size(a, window)
    if size > 64 * 2**20:  # seconds or more: say what is coming (the bundled model: 30 MB)
        print(f"writing {size / 2**30:.2f} GiB of float32 weights to {a.out} ...",
              file=sys.stderr)
    path = make_tiny_checkpoint(a.out, architecture=a.arch, vocab_size=a.vocab_size,
                                hidden_size=a.hidden_size, num_layers=a.layers, seed=a.seed,
                                **window)
    print(f"wrote a random-weight {a.arch} checkpoint to {path} ({size / 2**20:.0f} MiB, "
          f"{time.monotonic() - t:.1f}s)", file=sys.stderr)
    return 0

