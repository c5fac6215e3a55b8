"""bf16 linear layers that send forwards of few rows (decodes, verification windows, short prefill
chunks) to our kernel (engine/bf16_kernel.py) and the rest (longer prefill chunks) to torch's.

Not for `--batch-invariant`: there a row's result must not depend on how many rows share the call,
and the two kernels round differently; that mode keeps torch's kernel for every row count
(row_invariant_linear.py). Within the kernel's range a row's result is the same for any row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..bf16_kernel import Bf16Kernel
from .linear_swap import swap_linears

# Whole forwards of SmolLM2 and Qwen2.5-Coder-1.5B of 1-48 rows ran 0.53-0.92x torch's time, layer
# by layer 0.37-0.99x (AMD EPYC, 2 threads; docs/bench/issue20-s39/results/forward_rows.txt,
# bf16_rows.txt). Ours stays ahead up to ~128 rows: a prompt's prefill step of 56-112 tokens took
# 0.86-0.97x torch's time on SmolLM2 and of 56-128 tokens 0.82-0.95x on Qwen2.5-Coder-1.5B; with ours
# for every row count, SmolLM2's 144-token prompt was level (1.005x) and from 160 tokens torch's was
# ahead (1.025x, 1.057x at 192, 1.097x at 256; docs/bench/issue20-s47/results/kernel_rows-*.txt).
# Longer prefill chunks keep oneDNN.
MAX_KERNEL_ROWS = 128


class SmallBatchLinear(nn.Linear):
    """nn.Linear whose bf16 forwards of at most `MAX_KERNEL_ROWS` rows run our kernel."""

    kernel: Bf16Kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        rows = x.numel() // self.in_features
        # Prefill chunks, and a layer or input moved off the CPU or to another dtype since the swap.
        if (
            rows > MAX_KERNEL_ROWS
            or x.dtype != torch.bfloat16
            or self.weight.dtype != torch.bfloat16
            or x.device.type != "cpu"
            or self.weight.device.type != "cpu"
        ):
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features)  # [M, K]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return self.kernel(x2, self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)


def use_small_batch_kernel(model: nn.Module, kernel: Bf16Kernel) -> int:
    """Swap every plain bf16 nn.Linear of `model` (CPU, contiguous weight) for a SmallBatchLinear holding
    the same parameters (tied weights stay tied); returns how many were swapped."""

    def takes(linear: nn.Linear) -> bool:
        return (
            linear.weight.dtype == torch.bfloat16
            and linear.weight.device.type == "cpu"
            and linear.weight.is_contiguous()
            and (linear.bias is None or linear.bias.dtype == torch.bfloat16)
        )

    layers = swap_linears(model, SmallBatchLinear, takes)
    for layer in layers:
        layer.kernel = kernel
    return len(layers)
