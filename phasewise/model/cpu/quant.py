"""Weight-only int8 (``--quantization int8``): every matrix a decode step streams is quantized,
symmetric per output channel: ``scale[n] = max_k |w[n, k]| / 127`` and ``q[n, k] =
round(w[n, k] / scale[n])`` in -127..127. That is the decoder layers' four projections (qkv, o,
gate/up, down) and the LM head; with tied embeddings the one shared table is int8, and the
embedding lookup dequantizes the rows it reads. The norms (and an untied embedding, which a
step reads a few rows of) keep the checkpoint's dtype; activations, the K/V cache and every
accumulation are unchanged.

A quantized module holds ``weight`` (int8) and ``weight_scale`` (fp32, [out_features]);
``ops.proj`` takes both. ``load_model(..., quantization="int8")`` quantizes each tensor as it
is read (``prepare_int8`` shapes the model first), so the full-precision weights never sit in
memory at once; ``quantize_model_int8`` converts a model already loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATION_CHOICES = ("int8",)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights, fp32 per-row scales) of a [N, K] weight."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


class Int8Embedding(nn.Module):
    """A tied embedding table in int8: the LM head streams it as int8, and a lookup
    dequantizes the rows it reads into ``dtype``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=torch.int8),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(num_embeddings), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        return (rows.float() * self.weight_scale[ids][..., None]).to(self.dtype)


def int8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose ``weight`` int8 quantizes, by the name of that weight."""
    out: dict[str, nn.Module] = {}
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            out[f"layers.{i}.{name}.weight"] = getattr(layer, name)
    if model.cfg.tie_word_embeddings:
        out["embed_tokens.weight"] = model.embed_tokens
    else:
        out["lm_head.weight"] = model.lm_head
    return out


def prepare_int8(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Give the quantized weights of a (meta) model int8 parameters of their shape and fp32
    scale buffers on the CPU, ready to be filled; a tied embedding becomes an
    ``Int8Embedding``. Returns each quantized weight's scale buffer, by the weight's name."""
    scales: dict[str, torch.Tensor] = {}
    if model.cfg.tie_word_embeddings and not isinstance(model.embed_tokens, Int8Embedding):
        n, d = model.embed_tokens.weight.shape
        with torch.device("meta"):
            model.embed_tokens = Int8Embedding(n, d, dtype)
    for name, mod in int8_modules(model).items():
        n, k = mod.weight.shape
        mod.weight = nn.Parameter(torch.empty(n, k, dtype=torch.int8, device="meta"),
                                  requires_grad=False)
        mod.register_buffer("weight_scale", torch.ones(n), persistent=False)
        scales[name] = mod.weight_scale
    return scales


def quantize_model_int8(model: nn.Module) -> int:
    """Quantize a loaded model's int8 weights in place; returns the weight bytes saved."""
    saved = 0
    for mod in list(int8_modules(model).values()):
        w = mod.weight
        if w.dtype == torch.int32:  # packed into panels (CpuKernelOps.pack_panels): no rows
            raise ValueError("quantize_model_int8: the model's weights are packed into panels; "
                             "quantize before the engine packs them (load with quantization)")
        q, scale = quantize_rows_int8(w)
        saved += w.numel() * w.element_size() - q.numel() - 4 * scale.numel()
        if isinstance(mod, nn.Embedding):  # tied: the shared table becomes int8
            emb = Int8Embedding(*w.shape, dtype=w.dtype)
            emb.weight = nn.Parameter(q, requires_grad=False)
            emb.weight_scale = scale
            model.embed_tokens = emb
            continue
        mod.weight = nn.Parameter(q, requires_grad=False)
        mod.register_buffer("weight_scale", scale, persistent=False)
    return saved
