"""A bfloat16 linear's lone row against the same row in a batch, and what padding it to two rows costs
(SmolLM2-135M's linear shapes, random weights, 2 threads): the premise batch-invariant numerics rest on.

    python lone_row.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def timed(fn: Callable[[], object], rounds: int = 300) -> float:  # microseconds a call
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds * 1e6


def padded(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(F.pad(x, (0, 0, 0, 1)), w)[:1]


g = torch.Generator().manual_seed(0)
alone_total = padded_total = 0.0
for name, (k, n) in SHAPES.items():
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = (torch.randn(300, k, generator=g) * torch.rand(300, 1, generator=g) * 3).bfloat16()
    batch = F.linear(x, w)
    one = sum(not torch.equal(F.linear(x[i : i + 1], w)[0], batch[i]) for i in range(300))
    two = sum(not torch.equal(F.linear(x[i : i + 2], w)[0], batch[i]) for i in range(299))
    alone, pad = timed(lambda w=w, x=x: F.linear(x[:1], w)), timed(lambda w=w, x=x: padded(x[:1], w))
    alone_total, padded_total = alone_total + alone, padded_total + pad
    print(
        f"{name} {k} -> {n}: rows differing from their row in a batch of 300: alone {one}/300, as the first"
        f" of two {two}/299; one row {alone:.1f} us, padded to two {pad:.1f} us"
    )
print(
    f"a layer's four linears: {alone_total:.0f} -> {padded_total:.0f} us; 30 layers {0.03 * alone_total:.2f} -> {0.03 * padded_total:.2f} ms a step"
)
