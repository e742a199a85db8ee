"""Weight-only int8 (``--quantization int8``): the decoder layers' four projections (qkv, o,
gate/up, down) are quantized at load, symmetric per output channel: ``scale[n] =
max_k |w[n, k]| / 127`` and ``q[n, k] = round(w[n, k] / scale[n])`` in -127..127. The
embedding, the norms and the LM head stay in the checkpoint's dtype; activations, the K/V
cache and every accumulation are unchanged. A quantized ``nn.Linear`` holds ``weight``
(int8) and ``weight_scale`` (fp32, [out_features]); ``ops.linear`` takes both.
"""

from __future__ import annotations

import torch
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


def quantize_model_int8(model: nn.Module) -> int:
    """Quantize every decoder layer's projections in place; returns the weight bytes saved."""
    saved = 0
    for layer in model.layers:
        for name in PROJECTIONS:
            lin = getattr(layer, name)
            w = lin.weight
            q, scale = quantize_rows_int8(w)
            saved += w.numel() * w.element_size() - q.numel() - 4 * scale.numel()
            lin.weight = nn.Parameter(q, requires_grad=False)
            lin.register_buffer("weight_scale", scale, persistent=False)
    return saved
