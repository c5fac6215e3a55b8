"""Quantized weights for few rows, their bfloat16 originals for many: a draft model's two kinds of work.

PyTorch's packed int4/int8 CPU kernels reread the weight for every tile of 4 rows, so their cost grows
with the rows: the Qwen pair's int4 0.5B draft runs one token in 40 ms (bf16: 112 ms) but a 512-token
catch-up on a request's prompt in 4.19 s (bf16: 0.58 s; AMX Xeon, 2 threads). The draft's
step-by-step drafts are a few rows (one per drafting request); its first proposal for a request feeds
the whole prompt. `route_rows` keeps each quantized layer's float weight beside it and sends a forward
of at least `min_float_rows` rows to the float GEMM, where that is measured to be faster for the
layer's shape on this machine.

Only for models whose numerics do not decide the output: a draft (the target verifies every token). A
quantized target keeps one kernel for every row count, so its logits do not depend on the batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger("specserve.engine")

# Row counts at which the two paths are timed; the float GEMM only gets relatively faster beyond them.
CROSSOVER_ROWS = (2, 4, 8, 12, 16, 24, 32)
NEVER = 1 << 62  # no tested row count was faster in float: always the quantized kernel


class RowRoutedLinear(nn.Module):
    """`quantized` for forwards of fewer than `min_float_rows` rows, `F.linear(x, weight)` from there."""

    weight: torch.Tensor  # registered buffers (typed for the checker)
    bias: torch.Tensor | None

    def __init__(
        self, quantized: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, min_float_rows: int
    ):
        super().__init__()
        self.quantized = quantized
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.min_float_rows = min_float_rows
        # Buffers, not parameters (nothing trains them), so that memory accounting sees them; a tied
        # lm_head's weight is the embedding's own tensor and counts once (module_bytes).
        self.register_buffer("weight", weight, persistent=False)  # [N, K], the model's float dtype
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.numel() // self.in_features >= self.min_float_rows:
            out = nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)
            return out.to(x.dtype)
        return self.quantized(x)

    def extra_repr(self) -> str:
        return f"float from {self.min_float_rows} rows" if self.min_float_rows < NEVER else "quantized only"


def float_copy_bytes(model: nn.Module) -> int:
    """Bytes of the float weights and biases `route_rows` kept beside quantized layers (a tied
    lm_head's weight is the embedding's and does not count)."""
    owned = {
        t.data_ptr()
        for m in model.modules()
        if not isinstance(m, RowRoutedLinear)
        for t in m.parameters(recurse=False)
    }
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if not isinstance(m, RowRoutedLinear):
            continue
        for t in (m.weight, m.bias):
            if t is not None and t.data_ptr() not in owned and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _fastest(fn: Callable[..., object], *args: object, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def crossover_rows(quantized: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The fewest rows from which the float GEMM beat the quantized kernel at every larger count tested."""
    x = torch.randn(max(CROSSOVER_ROWS), weight.shape[1], dtype=weight.dtype)
    quantized(x[:1])  # warm both paths (allocator, kernel dispatch)
    nn.functional.linear(x[:1], weight, bias)
    faster = []
    for m in CROSSOVER_ROWS:
        rows = x[:m]
        float_seconds = _fastest(nn.functional.linear, rows, weight, bias)
        faster.append(float_seconds < _fastest(quantized, rows))
    crossover = NEVER
    for m, float_wins in zip(reversed(CROSSOVER_ROWS), reversed(faster), strict=True):
        if not float_wins:
            break
        crossover = m
    return crossover


def route_rows(model: nn.Module, float_weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Wrap each quantized layer named in `float_weights` ({name: (weight [N, K], bias)}, the float
    originals) whose float GEMM wins from some row count on; a layer where it never does keeps only
    its quantized form (its float weight is dropped). Layers of one shape share one measurement."""
    measured: dict[tuple[int, int, bool], int] = {}
    for name, (weight, bias) in float_weights.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        quantized = getattr(parent, attr)
        if isinstance(quantized, nn.Linear):  # no kernel fitted: it stayed float
            continue
        shape = (int(weight.shape[0]), int(weight.shape[1]), bias is not None)
        if shape not in measured:
            measured[shape] = crossover_rows(quantized, weight, bias)
        if measured[shape] < NEVER:
            setattr(parent, attr, RowRoutedLinear(quantized, weight, bias, measured[shape]))
    logger.info(
        "quantized draft: float GEMM from %s rows by layer shape",
        ", ".join(f"{n}x{k}: {'never' if m >= NEVER else m}" for (n, k, _), m in measured.items()),
    )
