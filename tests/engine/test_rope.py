"""RotaryEmbedding: the signed-sin table and the once-a-forward gather give the textbook rotation bit
for bit, and a new positions tensor never gets an earlier forward's rows."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.models.rope import RotaryEmbedding


def textbook(rope: RotaryEmbedding, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with sin's two halves equal (transformers' formulation)."""
    half = x.shape[-1] // 2
    sin_half = rope.sin[:, half:]  # the second half carries the unsigned angles
    cos = rope.cos.index_select(0, positions).unsqueeze(1).to(x.dtype)
    sin = torch.cat([sin_half, sin_half], dim=-1).index_select(0, positions).unsqueeze(1).to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_the_textbook_one_bit_for_bit(dtype):
    rope = RotaryEmbedding(head_dim=64, max_positions=512, theta=10000.0, scaling=None)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 512, (9,), generator=gen)
    q = torch.randn(9, 4, 64, generator=gen).to(dtype)
    k = torch.randn(9, 2, 64, generator=gen).to(dtype)
    q_out, k_out = rope(positions, q, k)
    assert torch.equal(q_out, textbook(rope, positions, q))
    assert torch.equal(k_out, textbook(rope, positions, k))


def test_tables_are_gathered_again_for_new_positions_and_dtypes():
    rope = RotaryEmbedding(head_dim=32, max_positions=128, theta=10000.0, scaling=None)
    x = torch.randn(3, 2, 32)
    first = torch.tensor([1, 2, 3])
    rope(first, x, x)
    again = torch.tensor([7, 50, 100])  # another forward's positions: its own rows
    assert torch.equal(rope(again, x, x)[0], textbook(rope, again, x))
    assert torch.equal(rope(first, x, x)[0], textbook(rope, first, x))  # the same tensor again
    xb = x.to(torch.bfloat16)
    assert torch.equal(rope(first, xb, xb)[0], textbook(rope, first, xb))  # another dtype
