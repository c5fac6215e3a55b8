"""Our bf16 linear kernel (engine/bf16_matmul.c) against an earlier version of its source, layer by
layer: every linear shape of SmolLM2-135M's and Qwen2.5-Coder-1.5B's decoder layers (summed over the
four projections), by rows, weights in random bf16, the caches flushed before every timed call (a
forward reads every weight from memory). First checks the two builds' outputs are equal bit for bit
(with and without a bias, row counts that fill and leave partial blocks). Prints the median time of
each and the ratio.

    python epilogue_layers.py OLD_SOURCE.c ROUNDS
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.engine.bf16_kernel import Bf16Kernel, default_bf16_kernel
from specserve.engine.c_library import build_library, int_function

SHAPES = {  # model -> (N, K) of its decoder layer's fused projections
    "SmolLM2-135M": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "Qwen2.5-1.5B": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],
}
ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 128)
FLUSH_BYTES = 256 << 20  # written before every timed call: more than any last-level cache


def build(source: Path, cache: Path) -> Bf16Kernel:
    target, library = build_library(source, cache)
    arguments: list[type] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    arguments += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return Bf16Kernel(path=target, function=int_function(library, "bf16_matmul", *arguments))


def main() -> None:
    old_source, rounds = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    new = default_bf16_kernel()
    assert new is not None, "the bf16 kernel does not build here"
    with tempfile.TemporaryDirectory() as cache:
        old = build(old_source, Path(cache))
    torch.manual_seed(0)
    for n, k in [(40, 64), (7, 100), (960, 576), (17, 33), (1536, 1536)]:
        for m in (1, 2, 3, 4, 5, 7, 13, 48, 130):
            x, w = torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)
            for bias in (None, torch.randn(n).to(torch.bfloat16)):
                assert torch.equal(old(x, w, bias), new(x, w, bias)), (n, k, m, bias is None)
    print("outputs: the same bit for bit")
    flush = torch.zeros(FLUSH_BYTES // 4)
    lines = []
    for model, shapes in tqdm(SHAPES.items(), desc="models"):
        weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in shapes]
        for m in ROWS:
            xs = [torch.randn(m, w.shape[1]).to(torch.bfloat16) for w in weights]
            times: dict[str, list[float]] = {"old": [], "new": []}
            for r in range(rounds):
                for arm in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    kernel = old if arm == "old" else new
                    total = 0.0
                    for w, x in zip(weights, xs, strict=True):
                        flush.add_(1.0)
                        start = time.perf_counter()
                        kernel(x, w, None)
                        total += time.perf_counter() - start
                    times[arm].append(total)
            o, n_ = statistics.median(times["old"]), statistics.median(times["new"])
            lines.append(
                f"{model:13s} rows {m:4d}: old {o * 1e3:7.3f} ms  new {n_ * 1e3:7.3f} ms  new / old {n_ / o:.3f}"
            )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
