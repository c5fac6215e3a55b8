"""Rotary position embedding tables (default and Llama-3 frequency scaling)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..row_ops_kernel import RowOpsKernel, takes


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
    row_ops: RowOpsKernel | None = None  # bf16 CPU rows on our kernel (layers.use_row_ops)

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        # (positions, dtype, cos rows, sin rows) of the last forward (see _tables)
        self._gathered: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
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
        # The first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin bit for bit (a
        # negation is exact and rounding is symmetric), one copy a tensor instead of a negation and one.
        self.register_buffer("sin", torch.cat([-angles.sin(), angles.sin()], dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, KVH, D]
        if self.row_ops is not None and takes(q, k) and _float32_cpu(self.cos):
            return self.row_ops.rope(q, k, positions, self.cos, self.sin)
        cos, sin = self._tables(positions, q.dtype)  # [T, 1, D] each
        return q * cos + _swap_halves(q) * sin, k * cos + _swap_halves(k) * sin

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at `positions`, in `dtype`. Every layer of a model shares this module and
        gets the same positions tensor in a forward, so the rows are gathered once a forward, not once
        a layer (with the sign folded into the table, a Qwen2.5-0.5B int4 draft step took 0.953x the
        time: docs/bench/issue20-s38/results/rope_tables.txt); the gathered rows hold a reference to
        `positions`, so a later tensor cannot pass for it."""
        gathered = self._gathered
        if gathered is not None and gathered[0] is positions and gathered[1] == dtype:
            return gathered[2], gathered[3]
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        self._gathered = (positions, dtype, cos, sin)
        return cos, sin


def _float32_cpu(table: torch.Tensor) -> bool:  # as our kernel reads the tables (a model cast
    return table.dtype == torch.float32 and table.device.type == "cpu"  # whole may have cast them)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)
