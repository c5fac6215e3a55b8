"""What PyTorch's packed int4 CPU kernel (`Int4Linear`, the int4 draft's and an int4 target's layers)
costs by the number of rows, against bf16 `F.linear` on the same weight: the Qwen2.5-0.5B draft's MLP
and LM-head shapes, one process, alternated. A lead for a small-M int4 kernel (not built): a draft step
over 4-8 requests and a verification window of an int4 target are that many rows.

    python int4_rows.py [REPEATS]
"""

from __future__ import annotations

import functools
import statistics
import sys

import torch

from specserve.benchmarks.harness import alternated_seconds
from specserve.engine.quantization import Int4Linear

SHAPES = [(4864, 896), (896, 4864), (151936, 896)]  # [N, K]: gate/up, down, LM head
ROWS = (1, 2, 4, 8, 16)


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    torch.manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}; ms per call (median of {repeats}), and each arm against its own 1 row"
    )
    print(
        f"{'[N, K]':16s} {'rows':>4s} {'int4 ms':>8s} {'bf16 ms':>8s} {'int4 / 1 row':>13s} {'bf16 / 1 row':>13s}"
    )
    for n, k in SHAPES:
        weight = torch.randn(n, k) * 0.02
        int4 = Int4Linear.from_float(weight, None, 64)
        bf16 = weight.to(torch.bfloat16)
        first: dict[str, float] = {}
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            arms = {
                "int4": functools.partial(int4, x),
                "bf16": functools.partial(torch.nn.functional.linear, x, bf16),
            }
            times = alternated_seconds(arms, repeats, warmup=2)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            first = first or dict(ms)
            print(
                f"{str([n, k]):16s} {m:4d} {ms['int4']:8.3f} {ms['bf16']:8.3f}"
                f" {ms['int4'] / first['int4']:12.2f}x {ms['bf16'] / first['bf16']:12.2f}x"
            )


if __name__ == "__main__":
    with torch.no_grad():
        main()
