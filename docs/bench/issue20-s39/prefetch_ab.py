"""The bf16 kernel with the next block of channels fetched into L2 during the last pass (engine/bf16_matmul.c
as committed) against its first form without (commit d5db94a), on Qwen2.5-1.5B's linear shapes, caches
flushed before every timed call. Both builds must give the same outputs bit for bit (the prefetch moves
no arithmetic). Prints each shape's medians and, per row count, the summed time of the five layers.

    python prefetch_ab.py [ROUNDS]   (from a git checkout: the first form is read with git show)
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specserve.engine import bf16_kernel

FIRST_FORM = "d5db94a"
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]
ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48)
FLUSH_BYTES = 256 << 20


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    here = Path(bf16_kernel.SOURCE)
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "bf16_matmul.c"
        old.write_text(
            subprocess.run(
                ["git", "show", f"{FIRST_FORM}:engine/bf16_matmul.c"],
                cwd=here.parent,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        kernels = {}
        for arm, source in (("without", old), ("with", here)):
            bf16_kernel.SOURCE = source
            kernels[arm] = bf16_kernel.build_bf16_kernel(Path(tmp) / arm)
        bf16_kernel.SOURCE = here
    flush = torch.zeros(FLUSH_BYTES // 4)
    totals: dict[str, dict[int, float]] = {arm: {} for arm in kernels}
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k).to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k).to(torch.bfloat16)
            assert torch.equal(kernels["without"](x, w, None), kernels["with"](x, w, None))
            times: dict[str, list[float]] = {arm: [] for arm in kernels}
            for _ in range(rounds):
                for arm, kernel in kernels.items():
                    flush.add_(1.0)
                    start = time.perf_counter()
                    kernel(x, w, None)
                    times[arm].append(time.perf_counter() - start)
            medians = {arm: statistics.median(t) for arm, t in times.items()}
            for arm in kernels:
                totals[arm][m] = totals[arm].get(m, 0.0) + medians[arm]
            print(
                f"N={n:6d} K={k:5d} rows={m:2d}: without {medians['without'] * 1e3:7.3f} ms, "
                f"with {medians['with'] * 1e3:7.3f} ms, with / without {medians['with'] / medians['without']:.3f}"
            )
    for m in ROWS:
        print(f"rows={m:2d}: the five layers with / without {totals['with'][m] / totals['without'][m]:.3f}")


if __name__ == "__main__":
    main()
