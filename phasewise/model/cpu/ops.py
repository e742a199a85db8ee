"""``CpuKernelOps``: the decoder's numeric steps on phasewise's C kernels, for bf16 tensors on
a CPU with AVX2 (``TorchOps``, in ``phasewise.model.ops``, is the reference it falls back to).

It replaces the steps that dominate a CPU decode step: linear layers (through the plan's
``LinearDispatch``, or the panels where the plan packs them), residual-add + RMSNorm,
SiLU-and-multiply, RoPE, and decode attention over the paged cache; for decode-only steps of
a few requests, a whole layer in one call (``decode_layer``) or all of them in one
(``decode_stack``). At the few rows of a decode step, a torch op costs more in dispatch than
in arithmetic; each kernel replaces several of them. Anything a kernel does not cover falls
back to ``TorchOps``. Engines build it through ``phasewise.model.cpu.backend``.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.model.attention import AttentionMetadata, PrefillSpan
from phasewise.model.cpu import kernels
from phasewise.model.cpu.kernels import ProjMode
from phasewise.model.cpu.linear import LinearDispatch
from phasewise.model.linear_types import Int8Linear, PanelLinear
from phasewise.model.ops import RopeTables, TorchOps


# A prompt's MLP runs in chunks of this many rows on the CPU paths other than AMX's (which
# blocks its own), so that the [rows, 2I] gate/up product of one chunk stays in cache for
# the SiLU-and-multiply and the down projection that read it, instead of a whole step's
# product going out to memory and back.
MLP_CHUNK_ROWS = 512
# A sparse layer's MLP of up to this many rows runs in one C call (pw_moe_mlp_bf16: the
# routing and every chosen expert, without a Python loop over the experts), whose router and
# experts stream their weights in runs of the streams' most rows (6); where the loop runs such
# a layer instead (the reference the call is compared with), moe_linear cuts it alike.
MOE_FUSED_ROWS = 32
# ... and with an expert's rows on AVX512_BF16 dot products (DecodeLayer.experts_dp), which
# read its weight once for all of them, this many: the call's scratch (each (row, expert)
# pair's rows, ~(2H + 3I) floats) stays tens of MB.
MOE_FUSED_ROWS_DP = 256
# In a larger layer, an expert's rows up to which its weight is streamed by the kernel (the
# stream reads the weight once per call; beyond a few rows the GEMM's reuse of it wins)
EXPERT_STREAM_ROWS = 8


def _projections(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer's four projections, in forward order."""
    return [lin for layer in model.layers for lin in layer.projections().values()]


def _record_experts(layers: Sequence[nn.Module], args: Sequence[kernels.DecodeLayerArgs]
                    ) -> None:
    """The experts each sparse layer's fused call read, where ``SparseMoE`` keeps its own
    count (``last_experts``, the step's stats)."""
    for layer, a in zip(layers, args):
        if a.n_experts:
            layer.moe.last_experts = a.experts_read


def glu_packed(lin: nn.Module) -> bool:
    """Whether ``lin`` (a gate/up projection) is packed into panels as glu units
    (``pack_panels(..., glu=True)``): only ``glu_pk`` and the fused layer read it then."""
    return isinstance(lin, PanelLinear) and lin.glu


class PanelsEmbedding(PanelLinear):
    """A tied embedding table packed into panels as the LM head (``CpuKernelOps.pack_panels``):
    the LM head reads ``weight`` as panels (``linear_pk``, any row count: a ``PanelLinear``),
    and a lookup unpacks the rows it needs (``kernels.panels_rows``: the same values as the
    rows)."""

    def __init__(self, panels: torch.Tensor, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(panels, num_embeddings, embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return kernels.panels_rows(self.weight, ids)


def out_features(lin: nn.Module) -> int:
    """A projection's output width: its logical one where its weight is not in rows."""
    return lin.out_features if isinstance(lin, PanelLinear) else lin.weight.shape[0]


class CpuKernelOps(TorchOps):
    def __init__(self, linear: LinearDispatch) -> None:
        # Without the compiled library only the linear dispatch (torch / fp32 upcast) applies.
        self.kernels = kernels.KERNELS
        self.lib = self.kernels.load()
        self.dispatch = linear
        # decode-only steps as fused layers, and sparse layers' MLPs as one call (moe_mlp),
        # where the library is there (tests turn it off to compare against op by op:
        # tests/cpu_helpers.py)
        self.fused_decode = self.lib is not None
        # by the module itself, held weakly: the args hold its weights' raw pointers, so an
        # entry must go with its module (a key by id() could be reused by a later module)
        self._layer_args: weakref.WeakKeyDictionary[nn.Module, kernels.DecodeLayerArgs] = \
            weakref.WeakKeyDictionary()
        self._moe_args: weakref.WeakKeyDictionary[nn.Module, kernels.DecodeLayerArgs] = \
            weakref.WeakKeyDictionary()  # by SparseMoE (moe_mlp)
        self._stack: tuple | None = None  # (layers, cache pointers, (args, k, v)) of decode_stack
        # Whether the model's projections are packed into panels (pack_panels): then
        # every projection, at every row count, runs kernels.linear_pk (glu_pk for a
        # SwiGLU's gate/up where I % 16 == 0) or the fused layer's ProjMode.PANELS, and
        # nothing reads those weights as rows.
        self.panels = False

    def _ok(self, *ts: torch.Tensor) -> bool:
        return self.lib is not None and all(
            t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()
            for t in ts)

    def proj(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        """A ``PanelLinear`` (the projections and the head where ``pack_panels`` packed
        them): ``kernels.linear_pk`` at every row count; else as ``TorchOps.proj``."""
        if isinstance(lin, PanelLinear):
            return kernels.linear_pk(x, lin.weight, lin.bias)
        return super().proj(x, lin)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            return F.linear(x, w, b)
        return self.dispatch(x, w, b)

    def moe_linear(self, x: torch.Tensor, w: torch.Tensor,
                   layer_rows: int | None = None) -> torch.Tensor:
        """A router's or an expert's few rows (a decode step's tokens rarely share an
        expert) stream the weight through the kernel, whatever the plan picked for the
        projections (with the projections in panels, the plan times the LM head alone, and
        leaves plain weights to torch's bf16 GEMM, which reads a one-row product's weight at
        a third of the stream's speed). In a layer of up to ``MOE_FUSED_ROWS`` rows
        (``layer_rows``), in runs of the streams' most, each run reading the weight once:
        the runs ``pw_moe_mlp_bf16`` takes, so the two give the same bits. In a larger
        layer, up to ``EXPERT_STREAM_ROWS`` rows in one call; more go to the plan's GEMM.
        Where the CPU has AVX512_BF16, in a layer of up to ``MOE_FUSED_ROWS_DP`` rows,
        ``EXPERT_DP_ROWS`` rows or more in one call on its dot products, as
        ``pw_moe_mlp_bf16`` runs them there (``experts_dp``): the weight read once. (A larger
        layer, a long prompt chunk, keeps the plan's GEMM, which wins at hundreds of rows.)"""
        rows = x.numel() // x.shape[-1]
        if self.lib is None or not self._ok(x, w):
            return self.linear(x, w, None)
        if (self.kernels.avx512bf16 and rows >= kernels.EXPERT_DP_ROWS
                and (layer_rows or rows) <= MOE_FUSED_ROWS_DP):
            return kernels.linear_avx512bf16(x, w, None)  # as pw_moe_mlp_bf16's experts_dp
        run = self.kernels.decode_layer_max_rows
        large = (layer_rows or rows) > MOE_FUSED_ROWS
        if rows <= run or (large and rows <= EXPERT_STREAM_ROWS):
            return kernels.linear_bf16(x, w, None)
        if large:
            return self.linear(x, w, None)
        flat = x.reshape(rows, x.shape[-1])
        out = torch.cat([kernels.linear_bf16(flat[r:r + run], w, None)
                         for r in range(0, rows, run)])
        return out.reshape(*x.shape[:-1], w.shape[0])

    def moe_route(self, logits: torch.Tensor, top_k: int,
                  norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 logits: the C routing (``pw_moe_route``), the one ``pw_moe_mlp_bf16`` runs:
        its scalar softmax and torch's vectorised one differ in the last bit, which a
        renormalised weight on a bf16 rounding midpoint carries into a row's output."""
        rows, experts = logits.shape
        if (self.lib is None or logits.dtype != torch.bfloat16 or logits.device.type != "cpu"
                or rows < 1 or not 1 <= top_k <= experts <= self.kernels.max_experts):
            return super().moe_route(logits, top_k, norm)
        lg = logits.float().contiguous()
        weights = torch.empty(rows, top_k, dtype=torch.float32)
        chosen = torch.empty(rows, top_k, dtype=torch.int32)
        rc = self.lib.pw_moe_route(lg.data_ptr(), rows, experts, top_k, int(norm),
                                   weights.data_ptr(), chosen.data_ptr())
        if rc != 0:
            raise RuntimeError(f"pw_moe_route failed ({rc})")
        return weights.to(torch.bfloat16), chosen.long()

    def moe_mlp(self, moe: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """A sparse layer's MLP (``SparseMoE``) over ``x``'s rows in one C call
        (``pw_moe_mlp_bf16``: the bits of ``SparseMoE``'s own loop, its experts read once per
        run of rows, or once on AVX512_BF16); None where the loop runs it (more than
        ``MOE_FUSED_ROWS`` rows, ``MOE_FUSED_ROWS_DP`` on AVX512_BF16, more experts than the
        C routing holds, weights it cannot read, ``fused_decode`` off)."""
        rows = x.shape[0]
        most = MOE_FUSED_ROWS_DP if self.kernels.avx512bf16 else MOE_FUSED_ROWS
        if (not self.fused_decode or self.lib is None or not 1 <= rows <= most
                or x.dim() != 2):
            return None
        if not self._ok(x):
            return None
        args = self._moe_args.get(moe)
        if args is None:
            fields = self._moe_fields(moe)
            if fields is None:
                return None
            args = self._moe_args[moe] = kernels.DecodeLayerArgs(H=x.shape[1], I=moe.inter,
                                                                 **fields)
        out = torch.empty_like(x)
        args.nthreads = torch.get_num_threads()
        rc = self.lib.pw_moe_mlp_bf16(ctypes.byref(args), x.data_ptr(), rows, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"pw_moe_mlp_bf16 failed ({rc})")
        moe.last_experts = args.experts_read
        return out

    def linear_int8(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    b: torch.Tensor | None) -> torch.Tensor:
        """The int8 kernel: each weight byte read once for a decode step's few rows, the
        packed GEMM for more."""
        if (self.lib is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and (b is None or b.dtype == torch.bfloat16)):
            return kernels.linear_int8(x, q, scale, b)
        return super().linear_int8(x, q, scale, b)

    def gate_up_silu(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        """On AMX, when the plan runs these rows there: the projection and SiLU-and-multiply
        in one pass (``kernels.glu_amx``), never writing the [rows, 2I] projection; with
        int8 weights, above the int8 streams' rows (``kernels.glu_int8_amx``); on
        weights in panels, at any row count (``kernels.glu_pk``)."""
        w, b = lin.weight, lin.bias
        rows = x.numel() // x.shape[-1]
        if isinstance(lin, Int8Linear):  # the streams up to INT8_ROWS_MAX rows, AMX above
            if (rows > kernels.INT8_ROWS_MAX and kernels.amx_available()
                    and self._ok(x) and (b is None or self._ok(b)) and w.shape[0] >= 32):
                return kernels.glu_int8_amx(x, w, lin.weight_scale, b)
        elif isinstance(lin, PanelLinear):
            if lin.glu:
                # Panels packed as glu units (I % 16 == 0; nothing else reads them:
                # linear_pk would give the channels in unit order): the SiLU in the tiles'
                # epilogue, as the fused decode layer does, so the [rows, 2I] product is
                # never written and read again. glu_pk takes x as bf16 rows.
                return kernels.glu_pk(x, w, b)
        elif (self._amx_rows(rows) and self._ok(x, w) and (b is None or self._ok(b))
                and w.shape[0] >= 32):
            return kernels.glu_amx(x, w, b)
        return super().gate_up_silu(x, lin)

    def mlp(self, x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear) -> torch.Tensor:
        """Where both projections' rows run on AMX tiles with bf16 weights (and I % 32 ==
        0): one call (``kernels.mlp_amx``), the gate/up pass writing its activations in
        the tiles' packed order for the down pass, the same bits as the two calls."""
        rows = x.numel() // x.shape[-1]
        wg, wd = gate_up.weight, down.weight
        if (rows > self.kernels.decode_layer_max_rows and kernels.amx_available()
                and not isinstance(gate_up, (Int8Linear, PanelLinear))
                and not isinstance(down, (Int8Linear, PanelLinear))
                and self.dispatch.method_for(rows, tuple(wg.shape)) == "amx"
                and self.dispatch.method_for(rows, tuple(wd.shape)) == "amx"
                and self._ok(x, wg, wd) and all(b is None or self._ok(b)
                                                for b in (gate_up.bias, down.bias))
                and wd.shape[1] % 32 == 0 and wd.shape[0] >= 16
                and tuple(wg.shape) == (2 * wd.shape[1], wd.shape[0])):
            return kernels.mlp_amx(x, wg, gate_up.bias, wd, down.bias)
        if rows <= MLP_CHUNK_ROWS:
            return super().mlp(x, gate_up, down)
        # A long prompt's MLP in chunks of rows: its [rows, 2I] projection and [rows, I]
        # activations are each allocated and first touched per layer (past glibc's mmap
        # threshold, fresh pages every time) and leave the last-level cache between the
        # passes; chunks of MLP_CHUNK_ROWS stay there and are reused from the heap.
        # in chunks of equal size (513 rows: 257 + 256, not 512 + a row that would stream
        # every MLP weight once more, on another method)
        x2 = x.reshape(rows, x.shape[-1])
        width = out_features(down)
        out = torch.empty(rows, width, dtype=x.dtype)
        chunk = -(-rows // -(-rows // MLP_CHUNK_ROWS))
        for r0 in range(0, rows, chunk):
            out[r0:r0 + chunk] = super().mlp(x2[r0:r0 + chunk], gate_up, down)
        return out.view(*x.shape[:-1], width)

    def pack_panels(self, model: nn.Module) -> str:
        """Pack every decoder projection of ``model`` into the panels layout
        (``kernels.pack_panels``) in place (the same
        huge-page bytes, no second copy; a gate/up weight's blocks are reordered through a
        transient copy first), and run them there from now on: the linear layer
        and the fused decode layer at every row count, instead of the streams, the in-place
        dot-product tiles and torch's GEMM by turns. All or nothing: int8 weights, or a shape
        the panels do not take (N % 16, K % 2), leave every weight as it is. Returns why not,
        or "" once packed. Then the LM head too where its vocabulary is a multiple of 16 (a
        tied embedding table becomes a ``PanelsEmbedding``, whose lookups unpack rows): one
        kernel at every row count, as the projections (the streams, the in-place dot
        products and torch's GEMM by turns read it 1.5x slower at 32 rows, the same at 1).
        Wherever the AVX512_BF16 kernels run: the kernel plan decides whether to call it
        (``phasewise.model.cpu.plan``: its rule packs where there is no AMX)."""
        why = self.panels_refused(model)
        if why:
            return why
        self.panels = True
        self._layer_args.clear()
        self._stack = None
        with torch.no_grad():
            for layer in model.layers:  # in place where it can (the arena's always can)
                for name, lin in layer.projections().items():
                    if isinstance(lin, PanelLinear):  # packed before (then all of them are)
                        continue
                    w = lin.weight
                    # a SwiGLU's gate/up as units of a gate block and its up block, the
                    # SiLU then in the tiles' epilogue (glu_pk), where I % 16 == 0
                    glu = name == "gate_up" and w.shape[0] % 32 == 0
                    in_place = w.is_contiguous() and w.data_ptr() % 4 == 0
                    n, k = w.shape
                    layer.replace_projection(name, PanelLinear(
                        kernels.pack_panels(w, in_place=in_place, glu=glu), n, k,
                        bias=lin.bias, glu=glu))
            self._pack_head(model)
        return ""

    @staticmethod
    def _pack_head(model: nn.Module) -> None:
        """The LM head into panels, in place, where it can take them (bf16, vocabulary % 16):
        a ``PanelLinear``; a tied embedding table then becomes a ``PanelsEmbedding``."""
        head = model.lm_head_module
        if isinstance(head, (PanelLinear, Int8Linear)):
            return
        w = head.weight
        if not kernels.can_pack_panels(w):
            return
        if not model.head_is_embedding:  # untied, but perhaps the table's bytes all the
            e = model.embedding_weight     # same (packing them would garble the lookups)
            lo, hi = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
            if lo < e.data_ptr() + e.numel() * e.element_size() and e.data_ptr() < hi:
                return
        in_place = w.is_contiguous() and w.data_ptr() % 4 == 0
        n, k = w.shape
        wp = kernels.pack_panels(w, in_place=in_place)
        if model.head_is_embedding:
            model.replace_embedding(PanelsEmbedding(wp, n, k))
        else:
            model.replace_lm_head(PanelLinear(wp, n, k, bias=getattr(head, "bias", None)))

    @staticmethod
    def panels_refused(model: nn.Module) -> str:
        """Why ``pack_panels`` would leave ``model``'s projections in rows, or "" where it
        packs them (or they are packed already)."""
        if not kernels.avx512bf16_available():
            return "no AVX512_BF16 kernels"
        lins = _projections(model)
        if not lins:
            return "no decoder projections"
        if all(isinstance(lin, PanelLinear) for lin in lins):
            return ""
        for lin in lins:
            if isinstance(lin, Int8Linear):
                return "int8 weights"
            if not kernels.can_pack_panels(lin.weight):
                return f"a {tuple(lin.weight.shape)} {lin.weight.dtype} weight"
        return ""

    def add_rms_norm(self, delta: torch.Tensor | None, hidden: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        ts = (hidden, weight) if delta is None else (hidden, weight, delta)
        if not self._ok(*ts) or (delta is not None and delta.shape != hidden.shape):
            return super().add_rms_norm(delta, hidden, weight, eps)
        dim = hidden.shape[-1]
        rows = hidden.numel() // dim
        out = torch.empty_like(hidden)
        self.lib.pw_add_rmsnorm_bf16(
            delta.data_ptr() if delta is not None else None, hidden.data_ptr(),
            weight.data_ptr(), out.data_ptr(), rows, dim, float(eps), torch.get_num_threads())
        return out, hidden

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self._ok(gate_up):
            return super().silu_mul(gate_up)
        inter = gate_up.shape[-1] // 2
        rows = gate_up.numel() // gate_up.shape[-1]
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype)
        # 16 lanes where the CPU has AVX-512 (the same bits as the 8 of pw_silu_mul_bf16)
        fn = (self.lib.pw_silu_mul_avx512bf16 if kernels.avx512bf16_available()
              else self.lib.pw_silu_mul_bf16)
        fn(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    dtype: torch.dtype) -> RopeTables:
        if self.lib is None or dtype != torch.bfloat16 or cos.device.type != "cpu":
            return super().rope_tables(cos, sin, positions, dtype)
        return cos[positions].contiguous(), sin[positions].contiguous()  # fp32 [T, hd]

    def rope(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        cos, sin = tables
        t, heads, hd = x.shape
        if (self.lib is None or cos.dtype != torch.float32 or x.dtype != torch.bfloat16
                or x.stride(2) != 1 or x.stride(1) != hd):
            return super().rope(x, tables)
        # In place: x is this step's own qkv buffer.
        self.lib.pw_rope_bf16(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                              t, heads, hd, torch.get_num_threads())
        return x

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         window: int | None = None) -> torch.Tensor:
        nd, nh, hd = q.shape
        bt, lens = meta.decode_block_tables, meta.decode_seq_lens
        if (not self._ok(k_cache, v_cache) or q.dtype != torch.bfloat16 or q.stride(2) != 1
                or q.stride(1) != hd or bt is None or lens is None):
            return super().decode_attention(q, k_cache, v_cache, meta, scale, window)
        n_kv = k_cache.shape[2]
        out = torch.empty(nd, nh, hd, dtype=q.dtype)
        rc = self.lib.pw_decode_attention_bf16(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(),
            bt.shape[1], lens.data_ptr(), out.data_ptr(), nd, nh, n_kv, hd, k_cache.shape[1],
            float(scale), torch.get_num_threads(), window or 0)
        if rc != 0:
            raise MemoryError("pw_decode_attention_bf16 could not allocate scratch memory")
        return out

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          span: PrefillSpan, scale: float, out: torch.Tensor,
                          window: int | None = None) -> bool:
        """On AMX (``pw_prefill_attention_amx``): flash attention on the tiles, reading K/V
        from the paged cache, head sizes that are multiples of 32 up to 128; without AMX, on
        AVX512_BF16 (``pw_prefill_attention_avx512bf16``), the same scheme on dot products, up to
        256. Both attend to whole contexts: a chunk that outgrows its layer's sliding window
        goes to torch's SDPA with the window's mask."""
        hd = q.shape[2]
        amx = kernels.amx_available() and hd <= 128
        if window is not None and span.context_len + span.end - span.start > window:
            return False
        if (not (amx or kernels.avx512bf16_available()) or not self._ok(k_cache, v_cache)
                or q.dtype != torch.bfloat16 or q.stride(2) != 1 or q.stride(1) != hd
                or hd % 32 or hd > 256 or not out.is_contiguous()):
            return False
        name = "pw_prefill_attention_amx" if amx else "pw_prefill_attention_avx512bf16"
        dst = out[span.start:span.end]
        table = span.block_table.contiguous()
        rc = getattr(self.lib, name)(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            table.data_ptr(), k_cache.shape[1], span.context_len, q.shape[0], dst.data_ptr(),
            dst.stride(0), q.shape[1], k_cache.shape[2], hd, float(scale),
            torch.get_num_threads())
        if rc == -1:
            raise MemoryError(f"{name} could not allocate scratch memory")
        return rc == 0

    def decode_layer(self, layer: nn.Module, delta: torch.Tensor | None, hidden: torch.Tensor,
                     rope: RopeTables, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        if (not self._fusable_step(hidden, rope, meta) or not self._ok(k_cache, v_cache)
                or (delta is not None and not self._ok(delta))):
            return None
        args = self._layer_args.get(layer)
        if args is None:
            args = self._static_args(layer)
            if args is None:
                return None
            self._layer_args[layer] = args
        if self._streams_only(hidden.shape[0], args):
            return None
        out = torch.empty_like(hidden)
        self._set_step_fields(args, hidden, rope, meta, k_cache.shape[1])
        args.proj_mode = self._tile_mode(hidden.shape[0])
        args.out = out.data_ptr()
        args.delta = delta.data_ptr() if delta is not None else None
        args.k_cache, args.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        rc = self.lib.pw_decode_layer_bf16(ctypes.byref(args))
        if rc != 0:
            raise RuntimeError(f"pw_decode_layer_bf16 failed ({rc})")
        _record_experts([layer], [args])
        return out, hidden

    def decode_logits(self, layers: nn.ModuleList, hidden: torch.Tensor, rope: RopeTables,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: AttentionMetadata, norm_weight: torch.Tensor, eps: float,
                      head: nn.Module) -> torch.Tensor | None:
        """The fused stack, then the final norm and the LM head in panels in the same C call
        (``pw_decode_stack_head_bf16``): no return to Python between the last layer and the
        head's stream. The bits of ``decode_stack``, ``add_rms_norm`` and ``proj``, the
        logits written as fp32 (widened in the head's epilogue, not by a pass over a bf16
        copy). Where the head is not a ``PanelLinear`` (or has a bias), None."""
        if (not kernels.avx512bf16_available() or not isinstance(head, PanelLinear)
                or not head.weight.is_contiguous() or not self._ok(norm_weight)
                or head.bias is not None or head.in_features != hidden.shape[-1]):
            return None
        w = head.weight
        ready = self._stack_ready(layers, hidden, rope, kv_caches, meta)
        if ready is None:
            return None
        args, k_ptrs, v_ptrs, bufs = ready
        xn = torch.empty_like(hidden)
        vocab = head.out_features
        logits = torch.empty(hidden.shape[0], vocab, dtype=torch.float32)
        rc = self.lib.pw_decode_stack_head_bf16(
            args, len(layers), ctypes.addressof(k_ptrs), ctypes.addressof(v_ptrs),
            bufs[0].data_ptr(), bufs[1].data_ptr(), norm_weight.data_ptr(), float(eps),
            xn.data_ptr(), w.data_ptr(), vocab, logits.data_ptr())
        if rc != 0:
            raise RuntimeError(f"pw_decode_stack_head_bf16 failed ({rc})")
        _record_experts(layers, args)
        return logits

    def _stack_ready(self, layers: nn.ModuleList, hidden: torch.Tensor, rope: RopeTables,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     meta: AttentionMetadata) -> tuple | None:
        """The fused stack's arguments for this step, with its two output buffers, or None
        where the step cannot be fused (nothing changed then)."""
        if (not layers or len(kv_caches) != len(layers)
                or not self._fusable_step(hidden, rope, meta)):
            return None
        stack = self._stack_args(layers, kv_caches)
        if stack is None:
            return None
        args, k_ptrs, v_ptrs = stack
        if self._streams_only(hidden.shape[0], *args):
            return None
        self._set_step_fields(args[0], hidden, rope, meta, kv_caches[0][0].shape[1])
        args[0].proj_mode = self._tile_mode(hidden.shape[0])
        args[0].delta = None  # the first layer has no previous output to add
        bufs = torch.empty(2, *hidden.shape, dtype=hidden.dtype)
        return args, k_ptrs, v_ptrs, bufs

    def decode_stack(self, layers: nn.ModuleList, hidden: torch.Tensor, rope: RopeTables,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        ready = self._stack_ready(layers, hidden, rope, kv_caches, meta)
        if ready is None:
            return None
        args, k_ptrs, v_ptrs, bufs = ready
        rc = self.lib.pw_decode_stack_bf16(args, len(layers), ctypes.addressof(k_ptrs),
                                           ctypes.addressof(v_ptrs), bufs[0].data_ptr(),
                                           bufs[1].data_ptr())
        if rc != 0:
            raise RuntimeError(f"pw_decode_stack_bf16 failed ({rc})")
        _record_experts(layers, args)
        return bufs[(len(layers) - 1) % 2], hidden

    def _amx_rows(self, rows: int) -> int:
        """1 if the plan runs ``rows`` rows' bf16 projections on AMX tiles (the fused layer
        then does too), else 0."""
        return int(self.dispatch.method(rows) == "amx" and kernels.amx_available())

    def _tile_mode(self, rows: int) -> ProjMode:
        """How the fused layer runs ``rows`` rows' projections (its ``proj_mode``): PANELS
        where the weights are packed so (any row count); else as the plan runs these rows:
        AMX tiles, AVX512BF16 dot products (bf16 weights; int8 ones stream), AVX2_TILES (the
        AVX2 kernel's 2 x 6 register tiles for more rows than the streams take; bf16
        weights; as ``kernels.linear_bf16`` runs them), else STREAMS."""
        if self.panels:
            return ProjMode.PANELS
        if self._amx_rows(rows):
            return ProjMode.AMX
        method = self.dispatch.method(rows)
        if method == "avx512bf16" and kernels.avx512bf16_available():
            return ProjMode.AVX512BF16
        if method == "kernel" and rows > self.kernels.decode_layer_max_rows:
            return ProjMode.AVX2_TILES
        return ProjMode.STREAMS

    def _fused_max_rows(self, rows: int) -> int:
        """The most rows a fused step may take: the streams' limit, or more where the plan
        runs these rows on AMX tiles, AVX512_BF16 dot products or the AVX2 kernel's tiles
        (then every projection does; on AMX int8 ones widened to bf16 as they come; some
        layers cannot: ``_streams_only``)."""
        if self._tile_mode(rows):
            return max(self.kernels.amx_layer_max_rows, self.kernels.decode_layer_max_rows)
        return self.kernels.decode_layer_max_rows

    def _streams_only(self, rows: int, *args: kernels.DecodeLayerArgs) -> bool:
        """More rows than the streams take, but a layer the tiles cannot take whole: fewer
        than 16 output channels (hidden or q + 2 kv) or 8 intermediate ones, a mixture of
        experts (whose experts stream), or, on AVX512_BF16 or the AVX2 tiles, an int8
        projection. The C layer refuses such a step (as it checks the same), so it runs op
        by op."""
        no_int8 = self._tile_mode(rows) not in (ProjMode.STREAMS, ProjMode.AMX)
        return rows > self.kernels.decode_layer_max_rows and any(
            a.H < 16 or a.Q + 2 * a.KV < 16 or a.I < 8 or a.n_experts
            or (no_int8 and any((a.s_qkv, a.s_o, a.s_gate_up, a.s_down))) for a in args)

    def _fusable_step(self, hidden: torch.Tensor, rope: RopeTables,
                      meta: AttentionMetadata) -> bool:
        """Whether this step can run as fused decode layers: decode tokens only, few enough
        rows, fp32 RoPE tables, the decode metadata built, bf16 hidden states."""
        t = hidden.shape[0]
        return (self.fused_decode and meta.num_decode_tokens == t
                and t <= self._fused_max_rows(t) and rope[0].dtype == torch.float32
                and meta.decode_block_tables is not None and meta.decode_seq_lens is not None
                and self._ok(hidden))

    @staticmethod
    def _set_step_fields(args: kernels.DecodeLayerArgs, hidden: torch.Tensor,
                         rope: RopeTables, meta: AttentionMetadata, block_size: int) -> None:
        """The fields of a layer's arguments that change with each step (not the caches,
        the delta or the output, which the callers set)."""
        cos, sin = rope
        bt = meta.decode_block_tables
        args.M, args.max_blocks, args.nthreads = (hidden.shape[0], bt.shape[1],
                                                  torch.get_num_threads())
        args.bs, args.hidden = block_size, hidden.data_ptr()
        args.slots, args.block_tables = meta.slot_mapping.data_ptr(), bt.data_ptr()
        args.seq_lens, args.cos, args.sin = (meta.decode_seq_lens.data_ptr(), cos.data_ptr(),
                                             sin.data_ptr())

    def _stack_args(self, layers: nn.ModuleList,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple | None:
        """The layers' argument structs as one C array, with the caches' pointers; built once
        (and again if the caches move); the caches and weights are checked when it is built.
        None if any layer cannot be fused."""
        ptrs = tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches)
        cached = getattr(self, "_stack", None)
        if cached is not None and cached[0] is layers and cached[1] == ptrs:
            return cached[2]
        if not all(self._ok(k, v) for k, v in kv_caches):
            return None
        static = [self._static_args(layer) for layer in layers]
        if any(a is None for a in static):
            return None
        args = (kernels.DecodeLayerArgs * len(layers))(*static)
        n = len(layers)
        k_ptrs = (ctypes.c_void_p * n)(*(p[0] for p in ptrs))
        v_ptrs = (ctypes.c_void_p * n)(*(p[1] for p in ptrs))
        self._stack = (layers, ptrs, (args, k_ptrs, v_ptrs))
        return self._stack[2]

    def _moe_fields(self, moe: nn.Module) -> dict[str, Any] | None:
        """A ``SparseMoE``'s fields of ``DecodeLayerArgs``: its router, experts and shared
        expert with its gate, streamed (the C layer routes); None where the C routing cannot
        run it (more experts than it routes among, weights it cannot read)."""
        shared = ((moe.shared_gate_up.weight, moe.shared_down.weight,
                   moe.shared_expert_gate.weight) if moe.has_shared else ())
        if (moe.num_experts > self.kernels.max_experts
                or not self._ok(moe.gate.weight, moe.gate_up, moe.down, *shared)):
            return None
        fields = dict(n_experts=moe.num_experts, top_k=moe.top_k,
                      experts_dp=int(self.kernels.avx512bf16),
                      norm_topk=int(moe.norm_topk_prob), w_router=moe.gate.weight.data_ptr(),
                      w_experts_gate_up=moe.gate_up.data_ptr(),
                      w_experts_down=moe.down.data_ptr())
        if shared:
            fields.update(shared_I=moe.shared_down.weight.shape[1],
                          **{name: w.data_ptr() for name, w in zip(
                              ("w_shared_gate_up", "w_shared_down", "w_shared_gate"), shared)})
        return fields

    def _static_args(self, layer: nn.Module) -> kernels.DecodeLayerArgs | None:
        """The per-layer fields (shapes, weight pointers); None if a weight is unsuitable, or
        the layer's MLP is a mixture of experts the fused layer does not compute (more experts
        than it routes among)."""
        moe = getattr(layer, "moe", None)
        moe_fields = self._moe_fields(moe) if moe is not None else {}
        if moe_fields is None:
            return None
        cfg = layer.cfg
        projections = layer.projections()  # qkv, o, gate_up, down (DecoderLayer.projections)
        weights = {f"w_{name}_norm": w for name, w in layer.norm_weights().items()}
        weights.update({"b_" + field: lin.bias for field, lin in projections.items()})
        int8: dict[str, torch.Tensor] = {}  # int8 projections' scales, by their field
        panels: dict[str, torch.Tensor] = {}  # projections packed into panels
        for field, lin in projections.items():
            if isinstance(lin, PanelLinear):
                if not (self.panels and lin.weight.is_contiguous()):
                    return None
                panels["w_" + field] = lin.weight
                continue
            if not isinstance(lin, Int8Linear):
                weights["w_" + field] = lin.weight
                continue
            w, scale = lin.weight, lin.weight_scale
            if w.device.type != "cpu" or not (w.is_contiguous() and scale.is_contiguous()):
                return None
            int8["w_" + field], int8["s_" + field] = w, scale
        present = [w for w in weights.values() if w is not None]
        if cfg.head_dim > self.kernels.max_head_dim or not self._ok(*present):
            return None
        if (panels or self.panels) and len(panels) != len(projections):  # every one or none
            return None
        # on panels the C layer reads gate/up as glu units exactly where I % 16 == 0
        if panels and "gate_up" in projections and (
                (cfg.intermediate_size % 16 == 0) != glu_packed(projections["gate_up"])):
            return None
        weights.update(int8)
        weights.update(panels)
        args = kernels.DecodeLayerArgs(
            H=cfg.hidden_size, Q=cfg.q_size, KV=cfg.kv_size,
            I=moe.inter if moe is not None else cfg.intermediate_size,
            n_heads=cfg.num_heads, n_kv=cfg.num_kv_heads, hd=cfg.head_dim,
            qk_norm=int(cfg.qk_norm), eps=cfg.rms_norm_eps, scale=layer.scale,
            window=layer.window or 0)
        for name, value in moe_fields.items():
            setattr(args, name, value)
        for name, w in weights.items():
            setattr(args, name, w.data_ptr() if w is not None else None)
        return args
