"""Small building blocks of the decoder: RMSNorm and rotary position embeddings."""

from __future__ import annotations

import math

import torch
from torch import nn

from phasewise.model.config import RopeConfig


class RMSNorm(nn.Module):
    """Holds an RMSNorm weight; ``ops.add_rms_norm`` / ``ops.rms_norm`` apply it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))


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
    in_band = ((wavelen >= old_len / rope.high_freq_factor)
               & (wavelen <= old_len / rope.low_freq_factor))
    return torch.where(in_band, blended, out)


class RotaryEmbedding(nn.Module):
    """Precomputed fp32 cos/sin tables (``[max_positions, head_dim]``) indexed by absolute
    position; ``ops.rope_tables`` picks a step's rows and ``ops.rope`` applies them."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
