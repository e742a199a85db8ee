"""Fused GPU kernels (Triton) for the steps between a layer's matrix products.

``TorchOps`` spends about 40 kernels per decoder layer: RMSNorm alone is a cast, a norm, a
cast and a product; RoPE a negation, a concatenation and three products; the decode
attention a gather of each row's padded context and ten more. Each does little at decode's
few rows yet costs the GPU microseconds, and the gathers grow with the batch: on an 8B model
on an H200, inside CUDA graphs, these kernels took a batch-64 step from 15.7 to 9.5 ms and a
batch-8 step from 8.0 to 6.3 ms (batch 1: 6.4 to 6.0 ms, where the matrix products dominate).

``TritonOps`` runs each such step as one kernel:

* ``add_rms_norm``: residual add and RMSNorm of a row (fp32 inside);
* ``rope``: q and k heads rotated in one pass over any strides;
* ``silu_mul``: the SwiGLU gate;
* ``decode_attention``: each decode row and KV head walks its own block table in the paged
  cache (no gather copy), the KV head's query heads together, with an online softmax.

Where torch rounds to the model's dtype between operations (the residual sum, the normalised
row before its gain, RoPE's two products and sum, SiLU before the product) these kernels round
at the same points, so on the GPU they give torch's bf16 bits but for the fp32 reduction
order of the norm (Triton's interpreter truncates its casts to bf16, so the tests allow it a
unit or two in the last place). Attention keeps its scores and probabilities in fp32 (torch's path rounds them to the
model's dtype), so it is the more exact of the two.

Triton is imported here only: the engine loads this module on CUDA alone. Tests run these
kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``) where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phasewise.model.attention import AttentionMetadata
from phasewise.model.ops import RopeTables, TorchOps


@triton.jit
def _add_rms_norm_kernel(delta_ptr, hidden_ptr, weight_ptr, normed_ptr, sum_ptr, n_cols,
                         stride_d, stride_h, stride_n, stride_s, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 in a long prompt
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(hidden_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        s = (h + d).to(sum_ptr.dtype.element_ty)  # the residual stream, rounded as torch's add
        tl.store(sum_ptr + row * stride_s + cols, s, mask=mask)
        h = s.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (h * rstd).to(normed_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * stride_n + cols, (w * normed).to(normed_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, stride_xt, stride_xh, stride_ct,
                 stride_st, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    hm = heads[:, None] < n_heads
    d = tl.arange(0, HALF)[None, :]
    src = x_ptr + t * stride_xt + heads[:, None] * stride_xh + d
    x1 = tl.load(src, mask=hm, other=0.0).to(tl.float32)  # [BLOCK_H, HALF]
    x2 = tl.load(src + HALF, mask=hm, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)  # [1, HALF]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    # torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
    lo = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
    hi = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    dst = out_ptr + (t * n_heads + heads[:, None]) * (2 * HALF) + d
    tl.store(dst, lo.to(ty), mask=hm)
    tl.store(dst + HALF, hi.to(ty), mask=hm)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t * stride_g passes 2**31 past ~75k rows of an 8B
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gate_up_ptr + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + t * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    silu = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (silu * u).to(ty), mask=mask)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh, stride_bt, scale, group,
                         GROUP_P: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # decode row
    kvh = tl.program_id(1)  # KV head
    n_heads = tl.num_programs(1) * group
    g = tl.arange(0, GROUP_P)
    gm = g[:, None] < group
    d = tl.arange(0, HD)[None, :]
    heads = kvh * group + g[:, None]
    q = tl.load(q_ptr + r * stride_qt + heads * stride_qh + d, mask=gm, other=0.0)
    q = q.to(tl.float32) * scale  # [GROUP_P, HD]
    seq_len = tl.load(seq_lens_ptr + r)
    offs = tl.arange(0, BS)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HD], tl.float32)
    j = 0
    while j * BS < seq_len:  # a while loop: Triton's interpreter takes no tensor range bound
        blk = tl.load(tables_ptr + r * stride_bt + j)
        k = tl.load(k_ptr + blk * stride_kb + offs[:, None] * stride_ks + kvh * stride_kh + d)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [GROUP_P, BS]
        scores = tl.where((j * BS + offs)[None, :] < seq_len, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk * stride_vb + offs[:, None] * stride_vs + kvh * stride_vh + d)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m = m_new
        j += 1
    out = acc / total[:, None]
    tl.store(out_ptr + (r * n_heads + heads) * HD + d, out.to(out_ptr.dtype.element_ty),
             mask=gm)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonOps(TorchOps):
    """``TorchOps`` with the steps between matrix products as single Triton kernels (see the
    module's docstring). Shapes a kernel does not take (a head size or block size that is
    not a power of two) fall back to torch's operations."""

    decode_attention_gathers = False  # it walks the block tables: no padded context copied

    def add_rms_norm(self, delta: torch.Tensor | None, hidden: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.dim() != 2 or hidden.stride(-1) != 1 or (
                delta is not None and delta.stride(-1) != 1):
            return super().add_rms_norm(delta, hidden, weight, eps)
        rows, cols = hidden.shape
        normed = torch.empty((rows, cols), dtype=hidden.dtype, device=hidden.device)
        out = hidden if delta is None else torch.empty_like(normed)
        if rows:
            _add_rms_norm_kernel[(rows,)](
                delta if delta is not None else hidden, hidden, weight, normed, out, cols,
                (delta if delta is not None else hidden).stride(0), hidden.stride(0),
                normed.stride(0), out.stride(0), eps, HAS_DELTA=delta is not None,
                BLOCK=triton.next_power_of_2(cols))
        return normed, out

    def rope(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        cos, sin = tables  # [T, 1, hd] each
        t, heads, hd = x.shape
        if not _pow2(hd) or hd < 2 or x.stride(-1) != 1 or cos.stride(-1) != 1:
            return super().rope(x, tables)
        out = torch.empty((t, heads, hd), dtype=x.dtype, device=x.device)
        if t:
            _rope_kernel[(t,)](x, cos, sin, out, heads, x.stride(0), x.stride(1),
                               cos.stride(0), sin.stride(0), HALF=hd // 2,
                               BLOCK_H=triton.next_power_of_2(heads))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            return super().silu_mul(gate_up)
        t, two_i = gate_up.shape
        inter = two_i // 2
        out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
        block = 1024
        if t:
            _silu_mul_kernel[(t, triton.cdiv(inter, block))](
                gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block)
        return out

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd, n_heads, hd = q.shape
        _, bs, n_kv, _ = k_cache.shape
        tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
        if (tables is None or seq_lens is None or not _pow2(hd) or not _pow2(bs)
                or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
                or tables.stride(-1) != 1):
            return super().decode_attention(q, k_cache, v_cache, meta, scale)
        group = n_heads // n_kv
        out = torch.empty((nd, n_heads, hd), dtype=q.dtype, device=q.device)
        _paged_decode_kernel[(nd, n_kv)](
            q, k_cache, v_cache, out, tables, seq_lens, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), tables.stride(0), scale, group,
            GROUP_P=triton.next_power_of_2(group), HD=hd, BS=bs)
        return out
