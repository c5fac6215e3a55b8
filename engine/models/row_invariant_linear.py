"""Linear layers whose one-row forwards run as two rows, for batch-invariant numerics (`--batch-invariant`).

Batch-invariant attention rests on the premise that a bfloat16 GEMM gives a row the same result
whatever else shares the call (tests/engine/test_batch_invariance.py). On the AMD EPYC (AVX-512 BF16,
no AMX, 2 threads) that holds from two rows on, but a single row takes another kernel whose sums
round differently: over a reduction of 1536 (SmolLM2's MLP down projection), 27 of 300 rows differed
from the same rows in a batch of 300, none did at two rows, and none at 576. A decode of one request
then differed from the same request decoded beside others (SmolLM2 bf16, from the fifth token), and
a verification window (k + 1 rows) from the plain decode it stands for. A one-row forward is padded
with a zero row instead: the second row costs what a decode's weights already cost to read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear_swap import swap_linears


class RowInvariantLinear(nn.Linear):
    """nn.Linear that computes a lone row as the first of two (the second zero)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.numel() != self.in_features:
            return F.linear(x, self.weight, self.bias)
        pair = F.pad(x.reshape(1, self.in_features), (0, 0, 0, 1))  # [2, K]: the row and a zero row
        return F.linear(pair, self.weight, self.bias)[:1].reshape(*x.shape[:-1], self.out_features)


def make_linears_row_invariant(model: nn.Module) -> int:
    """Swap every plain nn.Linear of `model` for a RowInvariantLinear holding the same parameters (tied
    weights stay tied); returns how many were swapped. Quantized layers keep their own kernels."""
    return len(swap_linears(model, RowInvariantLinear))
