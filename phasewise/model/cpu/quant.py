"""Weight-only int8 (``--quantization int8``): every matrix a decode step streams is quantized,
symmetric per output channel: ``scale[n] = max_k |w[n, k]| / 127`` and ``q[n, k] =
round(w[n, k] / scale[n])`` in -127..127. That is the decoder layers' four projections (qkv, o,
gate/up, down) and the LM head; with tied embeddings the one shared table is int8, and the
embedding lookup dequantizes the rows it reads. The norms (and an untied embedding, which a
step reads a few rows of) keep the checkpoint's dtype; activations, the K/V cache and every
accumulation are unchanged.

A quantized projection or LM head is an ``Int8Linear`` (``phasewise.model.linear_types``:
``weight`` int8, ``weight_scale`` fp32 [out_features], the bias), put in place of the
``nn.Linear``; ``ops.proj`` runs it. ``load_model(..., quantization="int8")`` quantizes each tensor as it
is read (``prepare_int8`` shapes the model first), so the full-precision weights never sit in
memory at once; ``quantize_model_int8`` converts a model already loaded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.model.linear_types import Int8Linear, PanelLinear

QUANTIZATION_CHOICES = ("int8",)


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, fp32 per-row scales) of a [N, K] weight."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


class Int8Embedding(Int8Linear):
    """A tied embedding table in int8: the LM head streams it as int8 (an ``Int8Linear``), and
    a lookup dequantizes the rows it reads into ``dtype``."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 dtype: torch.dtype) -> None:
        super().__init__(weight, weight_scale)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        return (rows.float() * self.weight_scale[ids][..., None]).to(self.dtype)


def _int8_targets(model: nn.Module) -> list[tuple[str, nn.Module, Callable[[nn.Module], None]]]:
    """The modules whose ``weight`` int8 quantizes: (the weight's name, the module, how to put
    its replacement in its place)."""
    out: list[tuple[str, nn.Module, Callable[[nn.Module], None]]] = []
    for i, layer in enumerate(model.layers):
        for short, mod in layer.projections().items():
            out.append((f"layers.{i}.{short}_proj.weight", mod,
                        functools.partial(layer.replace_projection, short)))
    if model.head_is_embedding:
        out.append(("embed_tokens.weight", model.embed_tokens, model.replace_embedding))
    else:
        out.append(("lm_head.weight", model.lm_head, model.replace_lm_head))
    return out


def int8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose ``weight`` int8 quantizes, by the name of that weight."""
    return {name: mod for name, mod, _ in _int8_targets(model)}


def _int8_module(old: nn.Module, q: torch.Tensor, scale: torch.Tensor,
                 dtype: torch.dtype) -> Int8Linear:
    """``old``'s replacement holding int8 ``q`` and ``scale`` (and ``old``'s bias)."""
    if isinstance(old, nn.Embedding):  # tied: the shared table becomes int8
        return Int8Embedding(q, scale, dtype)
    return Int8Linear(q, scale, getattr(old, "bias", None))


def prepare_int8(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Replace the quantized weights' modules of a (meta) model with ``Int8Linear``s (a tied
    embedding with an ``Int8Embedding``) holding int8 parameters of their shape and fp32
    scale buffers on the CPU, ready to be filled. Returns each quantized weight's scale
    buffer, by the weight's name."""
    scales: dict[str, torch.Tensor] = {}
    for name, mod, replace in _int8_targets(model):
        if isinstance(mod, Int8Linear):
            scales[name] = mod.weight_scale
            continue
        n, k = mod.weight.shape
        q = torch.empty(n, k, dtype=torch.int8, device="meta")
        new = _int8_module(mod, q, torch.ones(n), dtype)
        replace(new)
        scales[name] = new.weight_scale
    return scales


def quantize_model_int8(model: nn.Module) -> int:
    """Quantize a loaded model's int8 weights in place; returns the weight bytes saved."""
    saved = 0
    for _, mod, replace in _int8_targets(model):
        if isinstance(mod, PanelLinear):  # packed (CpuKernelOps.pack_panels): no rows
            raise ValueError(  # noqa: TRY004 (the model's state, not a caller's type)
                "quantize_model_int8: the model's weights are packed into panels; "
                "quantize before the engine packs them (load with quantization)")
        w = mod.weight
        q, scale = quantize_rows_int8(w)
        saved += w.numel() * w.element_size() - q.numel() - 4 * scale.numel()
        replace(_int8_module(mod, q, scale, w.dtype))
    return saved
