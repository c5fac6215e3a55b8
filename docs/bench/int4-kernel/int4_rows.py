"""Our tiled int4 kernel (`Int4TiledLinear`, engine/int4_matmul.c) against PyTorch's packed int4 CPU
kernel (`Int4Linear`) and bf16 `F.linear`, on the same weights, by the number of rows: the
Qwen2.5-0.5B draft's MLP and LM-head shapes, one process, arms alternated. `q8` is our kernel with the
draft's int8 activations (`round_draft_activations`).

    python int4_rows.py [REPEATS]
"""

from __future__ import annotations

import functools
import statistics
import sys

import torch

from specserve.benchmarks.harness import alternated_seconds
from specserve.engine.quantization import Int4Linear, Int4TiledLinear, dequantize_int4, quantize_int4

SHAPES = [(4864, 896), (896, 4864), (151936, 896)]  # [N, K]: gate/up, down, LM head
ROWS = (1, 2, 4, 8, 16, 64, 256)


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    torch.manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}; ms per call (median), and ours / PyTorch's int4 at the same rows"
    )
    print(
        f"{'[N, K]':16s} {'rows':>4s} {'tiled ms':>9s} {'torch ms':>9s} {'bf16 ms':>8s} {'q8 ms':>8s}"
        f" {'tiled/torch':>12s} {'tiled/bf16':>11s} {'q8/tiled':>9s} {'q8/bf16':>8s}"
        f" {'tiled/1 row':>12s} {'torch/1 row':>12s}"
    )
    for n, k in SHAPES:
        q, sz = quantize_int4(torch.randn(n, k) * 0.02, 64)
        tiled, plain = Int4TiledLinear.from_codes(q, sz, 64), Int4Linear.from_codes(q, sz, 64)
        q8 = Int4TiledLinear.from_codes(q, sz, 64)
        q8.int8_activations = True
        bf16 = dequantize_int4(q, sz, 64).to(torch.bfloat16)
        first: dict[str, float] = {}
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            arms = {
                "tiled": functools.partial(tiled, x),
                "q8": functools.partial(q8, x),
                "torch": functools.partial(plain, x),
                "bf16": functools.partial(torch.nn.functional.linear, x, bf16),
            }
            rounds = repeats if n * m < 2**22 else max(3, repeats // 4)
            times = alternated_seconds(arms, rounds, warmup=2)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            first = first or dict(ms)
            print(
                f"{str([n, k]):16s} {m:4d} {ms['tiled']:9.3f} {ms['torch']:9.3f} {ms['bf16']:8.3f} {ms['q8']:8.3f}"
                f" {ms['tiled'] / ms['torch']:11.2f}x {ms['tiled'] / ms['bf16']:10.2f}x"
                f" {ms['q8'] / ms['tiled']:8.2f}x {ms['q8'] / ms['bf16']:7.2f}x"
                f" {ms['tiled'] / first['tiled']:11.2f}x {ms['torch'] / first['torch']:11.2f}x"
            )


if __name__ == "__main__":
    with torch.no_grad():
        main()
