"""Test-only switches of the CPU backend (kept out of its production signatures)."""

from __future__ import annotations

from phasewise.model.cpu.ops import CpuKernelOps


def op_by_op(ops: CpuKernelOps) -> CpuKernelOps:
    """``ops`` with the fused decode layer off: every step op by op (the reference the fused
    layer is compared with)."""
    ops.fused_decode = False
    return ops
