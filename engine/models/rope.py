"""Rotary position embedding tables (default and Llama-3 frequency scaling)."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with Llama-3 scaling applied when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_context / low_freq_factor
        high_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`; short ones kept; the band between is interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled).float()
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3, linear)")


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position; forward gathers by absolute position."""

    cos: torch.Tensor  # [P, D] registered buffers (typed for the checker)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        if torch.get_default_device().type == "meta":
            # Built for shapes only (the loader, the weight-size estimate): the loader rebuilds the
            # table on the real device (`bind`). arange, cos, ... have no C++ meta kernels, and their
            # Python fallback imports torch._dynamo (~2 s per process), so skip the arithmetic here;
            # the frequencies are still computed (on the CPU, a few numbers): they refuse a bad scaling and
            # give the table's width.
            with torch.device("cpu"):
                width = 2 * inverse_frequencies(head_dim, theta, scaling).numel()
            self.register_buffer("cos", torch.empty(max_positions, width), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, width), persistent=False)
            return
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin(), angles.sin()], dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, KVH, D]; cos/sin gathered to [T, 1, D] in the activations' dtype
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(q.dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
