"""Small building blocks of the decoder: RMSNorm and rotary position embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from phasewise.model.config import RopeConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Per-pair inverse frequencies ([head_dim // 2], fp32) after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        # Position interpolation: dividing positions by `factor` equals dividing frequencies.
        return inv_freq / rope.factor
    # "llama3": wavelengths longer than old_len / low_freq_factor are slowed by `factor`,
    # those shorter than old_len / high_freq_factor are kept, and the band between is a
    # linear blend of the two, weighted by old_len / wavelength.
    old_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = inv_freq / rope.factor
    t = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - t) * slowed + t * inv_freq
    out = torch.where(wavelen > old_len / rope.low_freq_factor, slowed, inv_freq)
    in_band = (wavelen >= old_len / rope.high_freq_factor) & (wavelen <= old_len / rope.low_freq_factor)
    return torch.where(in_band, blended, out)


class RotaryEmbedding(nn.Module):
    """Rotary embedding with a precomputed cos/sin table indexed by absolute position.

    The table is fp32 (``[max_positions, head_dim]``); rows are cast to the activation dtype
    when applied, matching the reference's rounding.
    """

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the table for ``positions`` ([T]), cast to ``dtype``: ([T, 1, hd], ...).
        Computed once per step and shared by every layer."""
        cos = self.cos[positions].to(dtype)[:, None, :]
        sin = self.sin[positions].to(dtype)[:, None, :]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([T, n_heads, head_dim], any strides) by precomputed ``cos``/``sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
