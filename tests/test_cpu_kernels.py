"""Tier 2: the hand-written CPU linear kernel and the dispatch against fp32 references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasewise.model import cpu_kernels
from phasewise.model.linear import LinearDispatch, Upcast

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None,
                                   reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason}")


def reference(x, w, b):
    y = x.float() @ w.float().T
    return y + b.float() if b is not None else y


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 11), n=st.integers(1, 37), k=st.integers(1, 70), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_fp32_reference(m, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = cpu_kernels.linear_bf16(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = reference(x, w, b)
    # Exact fp32 accumulation then one bf16 rounding: within one bf16 ulp of the reference,
    # give or take fp32 summation order.
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-4 * k)


@needs_kernels
def test_kernel_handles_leading_dims_and_strided_input():
    x = torch.randn(2, 3, 64).bfloat16()[:, :, :48]  # non-contiguous view
    w = torch.randn(24, 48).bfloat16()
    y = cpu_kernels.linear_bf16(x, w)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y.float(), reference(x.reshape(-1, 48), w, None).view(2, 3, 24),
                               rtol=2**-7, atol=5e-3)


@pytest.mark.parametrize("kernel_max,large", [(0, "torch"), (0, "upcast"), (8, "upcast")])
def test_every_dispatch_plan_computes_the_same_function(kernel_max, large):
    if kernel_max and cpu_kernels.load() is None:
        pytest.skip("CPU kernels unavailable")
    d = LinearDispatch(kernel_max_rows=kernel_max, large=large)
    w = torch.randn(40, 32).bfloat16()
    b = torch.randn(40).bfloat16()
    for rows in (1, 5, 8, 9, 30):
        x = torch.randn(rows, 32).bfloat16()
        torch.testing.assert_close(d(x, w, b).float(), reference(x, w, b), rtol=2**-7, atol=5e-3)


def test_upcast_reuses_its_scratch():
    up = Upcast()
    w_big, w_small = torch.randn(16, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    up(torch.randn(3, 8).bfloat16(), w_big, None)
    ptr = up._scratch.data_ptr()
    y = up(torch.randn(3, 8).bfloat16(), w_small, None)
    assert up._scratch.data_ptr() == ptr and y.shape == (3, 4)


def test_calibration_yields_a_valid_plan():
    d = LinearDispatch.calibrate(torch.randn(256, 128).bfloat16(), large_rows=32,
                                 kernel_rows=(4, 8))
    assert d.large in ("torch", "upcast")
    assert d.kernel_max_rows in (0, 1, 4, 8)
    assert d.timings and d.timings["torch"][32] > 0
    with pytest.raises(ValueError, match="large must be 'torch' or 'upcast'"):
        LinearDispatch(kernel_max_rows=0, large="magic")
