"""The numeric steps of a decoder layer, behind one interface.

``TorchOps`` is the reference: torch operations, any device and dtype. Its implementations
replace steps with kernels: ``CpuKernelOps`` (``phasewise.model.cpu.ops``: phasewise's C
kernels for bf16 on a CPU with AVX2) and ``TritonOps`` (``phasewise.model.triton_ops``, on
CUDA). Anything a kernel does not cover falls back to ``TorchOps``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.model.attention import AttentionMetadata, PrefillSpan, decode_attention_torch
from phasewise.model.linear_types import Int8Linear

RopeTables = tuple[torch.Tensor, torch.Tensor]
INT8_DEQUANT_FLOATS = 1 << 22  # TorchOps.linear_int8's dequantized block (16 MiB of fp32)


class TorchOps:
    # decode_attention copies each row's context, padded to the batch's longest (CUDA graphs
    # bound how much of that they capture: phasewise.engine.cuda_graphs.MAX_GRAPH_KEYS)
    decode_attention_gathers = True

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, w, b)

    def moe_mlp(self, moe: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """A sparse layer's whole MLP (``SparseMoE``) in one fused call, or None: its own
        loop over the experts runs it."""
        return None

    def moe_route(self, logits: torch.Tensor, top_k: int,
                  norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture of experts' routing: each row's ``top_k`` experts by the softmax over
        its ``logits`` [T, E] (in fp32), best first, an exact tie (bf16 logits tie often) to
        the lower expert (torch.topk leaves ties to its implementation), and their weights,
        renormalised where ``norm``, in the logits' dtype. Returns (weights, chosen) [T, k]."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.sort(probs, dim=-1, descending=True, stable=True)
        weights, chosen = weights[:, :top_k], chosen[:, :top_k]
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def moe_linear(self, x: torch.Tensor, w: torch.Tensor,
                   layer_rows: int | None = None) -> torch.Tensor:
        """A mixture of experts' router, or one expert's projection over the few rows a step
        routed to it (``SparseMoE``); ``layer_rows``: the rows of the whole layer, where
        they are more than ``x``'s (kernels may run a small layer's experts otherwise)."""
        return self.linear(x, w, None)

    def proj(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        """A decoder projection or the LM head (``lin``: a module with ``weight`` and
        perhaps ``bias``): ``linear``, or for an ``Int8Linear`` (``--quantization int8``)
        ``linear_int8``."""
        if isinstance(lin, Int8Linear):
            return self.linear_int8(x, lin.weight, lin.weight_scale, lin.bias)
        return self.linear(x, lin.weight, getattr(lin, "bias", None))

    def linear_int8(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    b: torch.Tensor | None) -> torch.Tensor:
        """fp32 against the dequantized weight, a block of output rows at a time (an LM
        head's full fp32 copy would be 4x its int8 bytes)."""
        x32 = x.float()
        step = max(1, INT8_DEQUANT_FLOATS // max(1, q.shape[1]))
        parts = [F.linear(x32, q[i:i + step].float() * scale[i:i + step, None],
                          None if b is None else b[i:i + step].float())
                 for i in range(0, q.shape[0], step)]
        return torch.cat(parts, dim=-1).to(x.dtype)

    def add_rms_norm(self, delta: torch.Tensor | None, hidden: torch.Tensor,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden += delta`` (if given), then RMSNorm it. Returns (normed, new hidden).
        The norm runs in fp32 and is cast back before the weight, as the reference does.
        Implementations may update ``hidden`` in place: callers use the returned one."""
        if delta is not None:
            hidden = hidden + delta
        normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=eps).to(hidden.dtype)
        return weight * normed, hidden

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.add_rms_norm(None, x, weight, eps)[0]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gate_up_silu(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        """A SwiGLU MLP's first half: ``silu_mul(proj(x, lin))`` with ``lin`` the fused
        gate/up projection ([gate | up] rows). Implementations may fuse the two."""
        return self.silu_mul(self.proj(x, lin))

    def mlp(self, x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear) -> torch.Tensor:
        """A SwiGLU MLP: ``proj(gate_up_silu(x, gate_up), down)``. Implementations may
        fuse the two."""
        return self.proj(self.gate_up_silu(x, gate_up), down)

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                    dtype: torch.dtype) -> RopeTables:
        """Rows of the fp32 cos/sin tables for this step's positions, shared by all layers."""
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]

    def rope(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """Rotate ``x`` ([T, heads, head_dim], any strides); returns the rotated tensor."""
        cos, sin = tables
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         window: int | None = None) -> torch.Tensor:
        """The decode rows' attention (``decode_attention_torch``'s contract; ``window``:
        the layer's sliding window, None for the whole context)."""
        return decode_attention_torch(q, k_cache, v_cache, meta, scale, window)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          span: PrefillSpan, scale: float, out: torch.Tensor,
                          window: int | None = None) -> bool:
        """A prefill span's attention (q [n, n_heads, hd], the span's K/V already in the
        caches) into ``out[span.start:span.end]``, returning True; or False to leave it to
        torch's SDPA, as here. ``window``: the layer's sliding window (None: whole context)."""
        return False

    def decode_layer(self, layer: nn.Module, delta: torch.Tensor | None, hidden: torch.Tensor,
                     rope: RopeTables, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A whole decoder layer in one call for a decode-only step, or None to run it op by
        op. Same contract as ``DecoderLayer.forward``."""
        return None

    def decode_stack(self, layers: nn.ModuleList, hidden: torch.Tensor, rope: RopeTables,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every decoder layer of a decode-only step in one call, or None to run them one
        by one. Returns (last layer's MLP output, residual stream before adding it)."""
        return None

    def decode_logits(self, layers: nn.ModuleList, hidden: torch.Tensor, rope: RopeTables,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: AttentionMetadata, norm_weight: torch.Tensor, eps: float,
                      head: nn.Module) -> torch.Tensor | None:
        """``decode_stack``, the final norm and the LM head (``head``) in one call: the
        logits ([rows, vocab]: the head's bf16 values, as fp32) of a decode-only step, or
        None (nothing run) where the implementation cannot take it whole."""
        return None
