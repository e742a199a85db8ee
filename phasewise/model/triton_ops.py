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
  cache (no gather copy), the KV head's query heads together, with an online softmax. Where
  the rows and KV heads make fewer programs than a wave of the GPU's multiprocessors (batch 1
  of an 8B model: 8 programs on an H200's 132), each row's blocks are split among several
  programs (``decode_splits``), and a second kernel combines their partial sums (the
  flash-decoding scheme): one program walking a row's blocks one after another waits on each
  block's loads in turn.

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
def _group_query(q_ptr, r, kvh, group, stride_qt, stride_qh, scale,
                 GROUP_P: tl.constexpr, HD: tl.constexpr):
    """Decode row ``r``'s query heads that share KV head ``kvh``, scaled, in fp32 ([GROUP_P,
    HD], rows past ``group`` zero), with the index tensors the caller stores by: the group's
    lanes ``g``, their mask ``gm``, the dims ``d`` and the heads' ids ``heads``."""
    g = tl.arange(0, GROUP_P)
    gm = g[:, None] < group
    d = tl.arange(0, HD)[None, :]
    heads = kvh * group + g[:, None]
    q = tl.load(q_ptr + r * stride_qt + heads * stride_qh + d, mask=gm, other=0.0)
    return g, gm, d, heads, q.to(tl.float32) * scale


@triton.jit
def _attend_blocks(q, k_ptr, v_ptr, tables_ptr, r, kvh, d, first_key, seq_len, j, stop,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                   GROUP_P: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr):
    """Row ``r``'s blocks ``[j, stop)`` of its table for KV head ``kvh`` against the
    KV head's query heads ``q`` ([GROUP_P, HD], scaled): the online softmax's running max,
    weight total and unnormalised sum ([GROUP_P], [GROUP_P], [GROUP_P, HD]); keys before
    ``first_key`` (a sliding window's start) or at or past ``seq_len`` masked. -inf, 0 and 0
    where the range is empty."""
    offs = tl.arange(0, BS)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HD], tl.float32)
    while j < stop:  # a while loop: Triton's interpreter takes no tensor range bound
        blk = tl.load(tables_ptr + r * stride_bt + j)
        k = tl.load(k_ptr + blk * stride_kb + offs[:, None] * stride_ks + kvh * stride_kh + d)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [GROUP_P, BS]
        pos = (j * BS + offs)[None, :]
        scores = tl.where((pos < seq_len) & (pos >= first_key), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk * stride_vb + offs[:, None] * stride_vs + kvh * stride_vh + d)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m = m_new
        j += 1
    return m, total, acc


@triton.jit
def _window_start(seq_len, window):
    """The first key a row of ``seq_len`` keys attends to: 0, or in a layer with a sliding
    ``window`` (> 0) the first of its last ``window``."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh, stride_bt, scale, group, window,
                         GROUP_P: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # decode row
    kvh = tl.program_id(1)  # KV head
    n_heads = tl.num_programs(1) * group
    _, gm, d, heads, q = _group_query(q_ptr, r, kvh, group, stride_qt, stride_qh, scale,
                                      GROUP_P, HD)
    seq_len = tl.load(seq_lens_ptr + r)
    first_key = _window_start(seq_len, window)  # int64, as the loop's block counter
    _, total, acc = _attend_blocks(q, k_ptr, v_ptr, tables_ptr, r, kvh, d, first_key, seq_len,
                                   first_key // BS, (seq_len + BS - 1) // BS, stride_kb,
                                   stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                   stride_bt, GROUP_P, HD, BS)
    out = acc / total[:, None]
    tl.store(out_ptr + (r * n_heads + heads) * HD + d, out.to(out_ptr.dtype.element_ty),
             mask=gm)


@triton.jit
def _paged_decode_split_kernel(q_ptr, k_ptr, v_ptr, acc_ptr, ml_ptr, tables_ptr, seq_lens_ptr,
                               stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                               stride_vb, stride_vs, stride_vh, stride_bt, scale, group, window,
                               GROUP_P: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr):
    """One split of a row's blocks for one KV head: ``_attend_blocks`` over blocks
    ``[first + s * per, first + (s + 1) * per)`` of the row's blocks from the one holding its
    first key (``_window_start``) to ``ceil(seq_len / BS)``, with ``per`` the
    even share of the ``num_programs(2)`` splits, read from the row's length on the device
    (so a captured graph's splits follow each replay's lengths). It writes the split's
    unnormalised sums ``acc`` [rows, heads, splits, HD] and its max and weight total ``ml``
    [rows, heads, splits, 2]; a split past the row's blocks writes -inf and 0."""
    r = tl.program_id(0).to(tl.int64)  # decode row
    kvh = tl.program_id(1)  # KV head
    s = tl.program_id(2)  # split
    n_split = tl.num_programs(2)
    n_heads = tl.num_programs(1) * group
    g, gm, d, heads, q = _group_query(q_ptr, r, kvh, group, stride_qt, stride_qh, scale,
                                      GROUP_P, HD)
    seq_len = tl.load(seq_lens_ptr + r)
    first_key = _window_start(seq_len, window)
    first = first_key // BS
    n_blk = (seq_len + BS - 1) // BS
    per = (n_blk - first + n_split - 1) // n_split
    start = first + s * per
    m, total, acc = _attend_blocks(q, k_ptr, v_ptr, tables_ptr, r, kvh, d, first_key, seq_len,
                                   start, tl.minimum(start + per, n_blk), stride_kb, stride_ks,
                                   stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                                   GROUP_P, HD, BS)
    part = (r * n_heads + heads) * n_split + s  # [GROUP_P, 1]
    tl.store(acc_ptr + part * HD + d, acc, mask=gm)
    hm = g < group
    row = (r * n_heads + kvh * group + g) * n_split + s
    tl.store(ml_ptr + row * 2, m, mask=hm)
    tl.store(ml_ptr + row * 2 + 1, total, mask=hm)


@triton.jit
def _paged_decode_combine_kernel(acc_ptr, ml_ptr, out_ptr, n_split,
                                 SPLIT_P: tl.constexpr, HD: tl.constexpr):
    """One (row, head): the splits' sums rescaled to their common max and divided by the
    rescaled weight total, as one online softmax over all the row's keys would have left them.
    Split 0 always holds the row's first key, so the common max is finite."""
    rh = tl.program_id(0).to(tl.int64)  # row * heads + head
    sp = tl.arange(0, SPLIT_P)
    sm = sp < n_split
    m = tl.load(ml_ptr + (rh * n_split + sp) * 2, mask=sm, other=float("-inf"))
    total = tl.load(ml_ptr + (rh * n_split + sp) * 2 + 1, mask=sm, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(sm & (m > float("-inf")), tl.exp(m - m_all), 0.0)  # [SPLIT_P]
    d = tl.arange(0, HD)[None, :]
    acc = tl.load(acc_ptr + (rh * n_split + sp[:, None]) * HD + d, mask=sm[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(total * w, axis=0)
    tl.store(out_ptr + rh * HD + tl.arange(0, HD), out.to(out_ptr.dtype.element_ty))


# Splits of a row's blocks are at most this many (the partial sums' buffer grows with them).
MAX_DECODE_SPLITS = 32


def decode_splits(rows: int, kv_heads: int, table_width: int, programs: int) -> int:
    """How many programs share each (row, KV head)'s blocks: 1 (one program walks them all)
    where ``rows * kv_heads`` programs already make ``programs // 2`` (a wave of the GPU's
    multiprocessors), else enough splits to make ``programs`` in all, at most one a block of
    the table's width and at most ``MAX_DECODE_SPLITS``. The table width is fixed for a
    captured graph, so a graph's split count is too."""
    pairs = rows * kv_heads
    if programs <= 0 or 2 * pairs >= programs:
        return 1
    return max(1, min(-(-programs // pairs), table_width, MAX_DECODE_SPLITS))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonOps(TorchOps):
    """``TorchOps`` with the steps between matrix products as single Triton kernels (see the
    module's docstring). Shapes a kernel does not take (a head size or block size that is
    not a power of two) fall back to torch's operations."""

    decode_attention_gathers = False  # it walks the block tables: no padded context copied

    def __init__(self, decode_programs: int | None = None) -> None:
        """``decode_programs``: the programs decode attention aims for when it splits rows'
        blocks (``decode_splits``); None takes twice the multiprocessors of the GPU it runs
        on (no splitting on other devices), 0 never splits."""
        self.decode_programs = decode_programs

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
                         meta: AttentionMetadata, scale: float,
                         window: int | None = None) -> torch.Tensor:
        nd, n_heads, hd = q.shape
        _, bs, n_kv, _ = k_cache.shape
        tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
        if (tables is None or seq_lens is None or not _pow2(hd) or not _pow2(bs)
                or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
                or tables.stride(-1) != 1):
            return super().decode_attention(q, k_cache, v_cache, meta, scale, window)
        group = n_heads // n_kv
        out = torch.empty((nd, n_heads, hd), dtype=q.dtype, device=q.device)
        if not nd:
            return out
        strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                   k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                   tables.stride(0), scale, group, window or 0)
        consts = dict(GROUP_P=triton.next_power_of_2(group), HD=hd, BS=bs)
        splits = decode_splits(nd, n_kv, tables.shape[1], self._programs(q.device))
        if splits == 1:
            _paged_decode_kernel[(nd, n_kv)](q, k_cache, v_cache, out, tables, seq_lens,
                                             *strides, **consts)
            return out
        acc = torch.empty((nd, n_heads, splits, hd), dtype=torch.float32, device=q.device)
        ml = torch.empty((nd, n_heads, splits, 2), dtype=torch.float32, device=q.device)
        _paged_decode_split_kernel[(nd, n_kv, splits)](q, k_cache, v_cache, acc, ml, tables,
                                                       seq_lens, *strides, **consts)
        _paged_decode_combine_kernel[(nd * n_heads,)](
            acc, ml, out, splits, SPLIT_P=triton.next_power_of_2(splits), HD=hd)
        return out

    def _programs(self, device: torch.device) -> int:
        if self.decode_programs is not None:
            return self.decode_programs
        if device.type != "cuda":
            return 0
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
