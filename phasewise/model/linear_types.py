"""The projection types a prepared model may hold besides ``nn.Linear``: weights in another
layout are their own module types, so that the ops ask ``isinstance`` and never a tensor's
dtype or shape.

- ``Int8Linear``: weight-only int8 (``--quantization int8``, ``phasewise.model.cpu.quant``):
  ``weight`` int8 [N, K], ``weight_scale`` fp32 [N] (one scale per output row), optional
  ``bias``. ``TorchOps.proj`` runs it through ``linear_int8`` (any ``--kernels``).
- ``PanelLinear``: a bf16 weight packed into AVX512_BF16 panels (``CpuKernelOps.pack_panels``):
  ``weight`` int32 [N / 16, K / 2, 16], its logical ``out_features`` N and ``in_features`` K,
  optional ``bias``, and ``glu`` where a SwiGLU's gate/up is packed as glu units (gate block i
  and up block i together: only ``glu_pk`` and the fused layer read it then).

Each replaces the ``nn.Linear`` in its parent (``DecoderLayer.replace_projection``,
``CausalLM.replace_lm_head`` / ``replace_embedding``); a parameter keeps its name
(``layers.0.qkv_proj.weight``). Neither has a ``forward``: the model runs projections through
its ops (``ops.proj``).
"""

from __future__ import annotations

import torch
from torch import nn


def _param(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


class Int8Linear(nn.Module):
    """Weight-only int8, symmetric per output row: ``weight[n, k] * weight_scale[n]`` is the
    weight. ``weight_scale`` is a (non-persistent) buffer."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"Int8Linear: weight must be int8 [N, K]; got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != weight.shape[:1]:
            raise ValueError(f"Int8Linear: weight_scale must be fp32 [{weight.shape[0]}]; got "
                             f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
        self.weight = _param(weight)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _param(bias)
        self.register_buffer("weight_scale", weight_scale, persistent=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        """The bytes it holds: the int8 weight, its scales and the bias."""
        ts = [self.weight, self.weight_scale] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def dense(self) -> torch.Tensor:
        """The dequantized weight, fp32 [N, K]."""
        return self.weight.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class PanelLinear(nn.Module):
    """A bf16 [N, K] weight in the panels layout (``kernels.pack_panels``): ``weight`` int32
    [N / 16, K / 2, 16]; ``glu`` where it was packed as glu units (``pack_panels(...,
    glu=True)``)."""

    def __init__(self, panels: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None, glu: bool = False) -> None:
        super().__init__()
        if (panels.dtype != torch.int32 or tuple(panels.shape)
                != (out_features // 16, in_features // 2, 16)):
            raise ValueError(f"PanelLinear: panels of a [{out_features}, {in_features}] weight "
                             f"are int32 [{out_features // 16}, {in_features // 2}, 16]; got "
                             f"{panels.dtype} {tuple(panels.shape)}")
        self.weight = _param(panels)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _param(bias)
        self.out_features, self.in_features, self.glu = out_features, in_features, glu

    @property
    def nbytes(self) -> int:
        """The bytes it holds: the panels (as many as the bf16 rows) and the bias."""
        ts = [self.weight] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def dense(self) -> torch.Tensor:
        """The bf16 [N, K] rows it was packed from (``kernels.unpack_panels``)."""
        from phasewise.model.cpu import kernels

        return kernels.unpack_panels(self.weight, glu=self.glu)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, glu={self.glu}")
