"""Rotary position embedding as the llama family uses it: real cos/sin tables (no complex dtype, so it
runs on every backend), plain frequencies ``theta^(-2i/head_dim)`` or llama-3's scaled ones
(:class:`RopeScaling`), and the rotation of adjacent pairs (Meta's complex formulation, in reals)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3's rotary frequency scaling (Hugging Face ``rope_type: llama3``, torchtitan's
    ``scaling="llama"``): wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are slowed by ``factor``, those shorter than ``.../ high_freq_factor`` kept,
    the ones between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not (self.factor > 0 and self.original_max_position_embeddings > 0
                and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(f"rope scaling {self} needs factor > 0, original_max_position_embeddings > 0 and "
                             "0 < low_freq_factor < high_freq_factor")



def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """``theta^(-2i/head_dim)`` for each pair ``i`` (fp32), with llama-3's scaling when given
    (the computation of transformers' ``_compute_llama3_parameters`` and torchtitan's ``ComplexRoPE``)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return freqs
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * frequency_i`` (:func:`rope_frequencies`), each
    ``[max_seq_len, head_dim // 2]`` fp32."""
    freqs = rope_frequencies(head_dim, theta, scaling, device=device)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1) of ``x [b, s, heads, head_dim]`` by each position's angle.

    This is the same rotation as Meta's complex-number formulation (pairs are adjacent elements).
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
