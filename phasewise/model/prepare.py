"""Preparing a model to run: ``prepare_model`` loads the weights and sets up what computes its
forward pass on this device (the CPU kernels and their plan, or the Triton kernels on CUDA, or
torch's operations), with the words that say which. An engine calls it once and runs what it
returns; nothing here knows of requests or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from phasewise.model.config import ModelConfig
from phasewise.model.cpu.backend import CpuBackend, prepare_cpu_backend
from phasewise.model.cpu.linear import LinearDispatch
from phasewise.model.loader import load_model
from phasewise.model.transformer import CausalLM


@dataclass
class PreparedModel:
    """A loaded model ready to run: ``module`` (its ``ops`` installed), the CPU backend where
    phasewise's CPU kernels run it (else None), and ``gpu_kernels``, what runs on CUDA in
    words (``generate`` reports it)."""

    module: CausalLM
    cpu_backend: CpuBackend | None
    gpu_kernels: str = "torch operations"

    @property
    def linear_plan(self) -> LinearDispatch | None:
        """The CPU kernel plan's linear dispatch, or None without the CPU kernels."""
        return self.cpu_backend.linear if self.cpu_backend else None

    @property
    def panels_reason(self) -> str:
        """Why the decoder projections stay in rows ("" where they are packed into panels)."""
        return self.cpu_backend.panels_reason if self.cpu_backend else "not the CPU kernels"


def resolve_device(device: str) -> torch.device:
    """The device a config's ``device`` names ("auto": CUDA where torch sees one). A CUDA
    device with an index becomes torch's current device: Triton launches and graph capture
    follow the current device, not the tensors'."""
    if device == "auto":
        resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    else:
        resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is not None:
        torch.cuda.set_device(resolved)
    return resolved


def prepare_model(config: Any, model_dir: Path, model_config: ModelConfig, dtype: torch.dtype,
                  device: torch.device, max_positions: int,
                  progress: Any = None) -> PreparedModel:
    """Load the checkpoint in ``model_dir`` (``config``: an ``EngineConfig``; its
    quantization, load format, seed, kernels and kernel plan apply) and install the ops that
    run it: the CPU kernels (``phasewise.model.cpu.backend``: the kernel plan, pinned,
    stored by ``phasewise tune``, or ruled; never timed here), or on CUDA with kernels
    "auto" the Triton kernels where Triton imports. Quantization runs on the CPU only."""
    if config.quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization {config.quantization} runs on CPU only; got "
                         f"device {device}")
    model = load_model(model_dir, model_config, dtype=dtype, device=device,
                       max_positions=max_positions, progress=progress,
                       quantization=config.quantization, load_format=config.load_format,
                       seed=config.seed)
    prepared = PreparedModel(model, prepare_cpu_backend(model, config, dtype, device))
    if config.kernels == "auto" and device.type == "cuda":
        try:  # fused norm, RoPE, SiLU and paged decode attention (Triton ships with torch)
            from phasewise.model.triton_ops import TritonOps
        except ImportError as e:
            prepared.gpu_kernels = f"torch operations (no Triton: {e})"
        else:
            model.ops = TritonOps()
            prepared.gpu_kernels = "Triton kernels between the matrix products, cuBLAS GEMMs"
    return prepared
