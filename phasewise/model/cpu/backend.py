"""The one door to the CPU backend: ``prepare_cpu_backend`` turns a loaded model and its
``EngineConfig`` into the ops its forward pass runs, the kernel plan they follow, and the
words that say so. ``phasewise.model.prepare`` calls it once, after loading the weights; it
times nothing (the plan is pinned, stored by ``phasewise tune``, or ruled from the CPU's
flags: ``phasewise.model.cpu.plan``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from phasewise.model.cpu import kernels
from phasewise.model.cpu.capabilities import capabilities
from phasewise.model.cpu.linear import LinearDispatch
from phasewise.model.cpu.ops import CpuKernelOps
from phasewise.model.cpu.plan import (INT8_ROWS_MAX, INT8_TILE_ROWS_MAX, KernelPlan, PlanKey,
                                      Runtime, resolve, stream_prefetch_rule)
from phasewise.model.linear_types import PanelLinear


@dataclass
class CpuBackend:
    """What ``prepare_cpu_backend`` set up: ``ops`` (installed as ``model.ops``), the
    ``plan`` and the ``linear`` dispatch built from it, why the projections stay in rows
    (``panels_reason``; "" where they are packed into panels), whether the LM head is in
    panels, and what runs here (``runtime``)."""

    ops: CpuKernelOps
    plan: KernelPlan
    linear: LinearDispatch
    panels_reason: str
    head_panels: bool
    runtime: Runtime

    def describe(self) -> str:
        """How the linear layers run, in words (``generate``'s ``[kernels]`` line)."""
        if self.plan.key.quantization == "int8":  # the int8 kernels' own split, not the plan's
            above = ("AMX tiles above, the weights widened to bf16 as they come"
                     if self.runtime.amx else
                     f"the AVX2 register tiles to {INT8_TILE_ROWS_MAX} rows, the packed GEMM "
                     "above, the weights widened to fp32 (fp32 arithmetic)")
            return f"int8 weights: the int8 streams for <= {INT8_ROWS_MAX} rows, {above}"
        if self.head_panels:
            return ("decoder projections and the LM head packed into panels (AVX512_BF16 dot "
                    "products at every row count)")
        if not self.panels_reason:
            return ("decoder projections packed into panels (AVX512_BF16 dot products at "
                    f"every row count); the LM head: {self.linear.describe()}")
        return self.linear.describe()

    def kernels_line(self) -> str:
        """The whole ``[kernels]`` line: the layers, the AMX / AVX512_BF16 kernels, the
        streams' prefetch."""
        k = kernels.KERNELS
        amx = "AMX tiles" if k.amx else f"no AMX ({k.amx_reason})"
        if not k.amx:  # the dot-product kernels stand in for the tiles where they can run
            amx += ("; AVX512_BF16 dot products" if k.avx512bf16
                    else f"; no AVX512_BF16 kernels ({k.avx512bf16_reason})")
        return (f"{self.describe()}; {amx}; weight streams prefetch {k.stream_prefetch} "
                f"bytes ahead ({k.stream_prefetch_reason})")

    def plan_line(self) -> str:
        """Where the plan came from (``generate``'s and ``serve``'s ``[plan]`` line)."""
        return self.plan.source


def _panels_reason(plan: KernelPlan, runtime: Runtime) -> str:
    """Why a plan without panels keeps the projections in rows."""
    if not runtime.avx512bf16:
        return "no AVX512_BF16 kernels"
    if not plan.key.panels_fit():
        return plan.key.panels_misfit()
    if plan.origin == "rule":
        return "AMX tiles read the rows"
    return f"the {plan.origin} plan keeps the rows"


def release_freed_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``). Packing
    weights into panels and the int8 conversion free transient copies that glibc keeps (its
    mmap threshold rises with the first large block freed, so later large blocks come from
    the heap and stay resident); trimmed before the KV pool is sized, they are not counted
    in the served process's resident memory. True where the C library has ``malloc_trim``
    (glibc), else False (nothing done)."""
    try:
        libc = ctypes.CDLL(None)  # TypeError on Windows, which has no such library handle
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def prepare_cpu_backend(model: nn.Module, config: Any, dtype: torch.dtype,
                        device: torch.device) -> CpuBackend | None:
    """Install phasewise's CPU kernels as ``model.ops`` where they apply (``config.kernels``
    auto, a bf16 model on the CPU): resolve the kernel plan (``config.kernel_plan`` pinned,
    else the stored one, else the rule), set the weight streams' prefetch, pack the
    projections into panels where the plan says, then hand the packing's transient copies
    back to the system (``release_freed_heap``, before the KV pool is sized). None where they
    do not apply (then a ``kernel_plan`` given is an error: nothing would follow it)."""
    if config.kernels != "auto" or device.type != "cpu" or dtype != torch.bfloat16:
        if config.kernel_plan is not None:
            runs = (f"kernels {config.kernels!r}" if config.kernels != "auto"
                    else f"{str(dtype).removeprefix('torch.')} on {device}")
            raise ValueError(f"kernel_plan applies to phasewise's CPU kernels (kernels 'auto', "
                             f"a bfloat16 model on the CPU); this engine runs {runs}")
        return None
    caps = capabilities()
    runtime = Runtime.here()
    key = PlanKey.of(caps, model.cfg, dtype, config.quantization, torch.get_num_threads())
    plan = resolve(key, runtime, caps, pinned=config.kernel_plan)
    linear = plan.linear.dispatch()
    ops = CpuKernelOps(linear)
    if runtime.kernels:
        why = (stream_prefetch_rule(caps)[1] if plan.origin == "rule"
               else f"the {plan.origin} plan")
        kernels.KERNELS.set_stream_prefetch(plan.stream_prefetch, why)
    reason = ops.pack_panels(model) if plan.panels else _panels_reason(plan, runtime)
    model.ops = ops
    head_panels = isinstance(model.lm_head_module, PanelLinear)
    release_freed_heap()
    return CpuBackend(ops, plan, linear, reason, head_panels, runtime)
