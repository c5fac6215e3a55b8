"""Our bf16 linear kernel (engine/bf16_matmul.c) against torch's (oneDNN) by rows, on every linear
shape of SmolLM2-135M and the Qwen2.5-Coder 0.5B/1.5B pair, weights in random bf16. The caches are
flushed before every timed call (a forward reads every weight from memory). Prints the median time of
each, the ratio, and each kernel's largest error against a float64 product, in bf16 rounding steps of
its row's largest output.

    python bf16_rows.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.engine.bf16_kernel import default_bf16_kernel

SHAPES = {  # model -> (N, K) of its fused projections and head
    "SmolLM2-135M": [(1728, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    "Qwen2.5-0.5B": [(1152, 896), (896, 896), (9728, 896), (896, 4864), (151936, 896)],
    "Qwen2.5-1.5B": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)],
}
ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
FLUSH_BYTES = 256 << 20  # written before every timed call: more than any last-level cache


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    kernel = default_bf16_kernel()
    if kernel is None:
        sys.exit("the bf16 kernel does not build on this machine")
    torch.manual_seed(0)
    cases = [(model, n, k, m) for model, shapes in SHAPES.items() for n, k in shapes for m in ROWS]
    lines = []
    flush = torch.zeros(FLUSH_BYTES // 4)
    w = torch.empty(0)
    for model, n, k, m in tqdm(cases, desc="shapes x rows"):
        if w.shape != (n, k):
            w = torch.randn(n, k).to(torch.bfloat16)
        x = torch.randn(m, k).to(torch.bfloat16)
        exact = x.double() @ w.double().T  # [M, N]
        step = exact.abs().amax(dim=1, keepdim=True) * 2.0**-8  # a bf16 step of each row's largest
        errors = {
            arm: ((out.double() - exact).abs() / step).max().item()
            for arm, out in (("torch", F.linear(x, w)), ("ours", kernel(x, w, None)))
        }
        times: dict[str, list[float]] = {"torch": [], "ours": []}
        for r in range(rounds + 1):
            for arm in times:
                flush.add_(1.0)
                start = time.perf_counter()
                F.linear(x, w) if arm == "torch" else kernel(x, w, None)
                if r >= 1:
                    times[arm].append(time.perf_counter() - start)
        t, o = (statistics.median(times[a]) * 1e3 for a in ("torch", "ours"))
        lines.append(
            f"{model:13s} N={n:6d} K={k:5d} rows={m:3d}: torch {t:7.3f} ms, ours {o:7.3f} ms, "
            f"ours / torch {o / t:.2f}; largest error (bf16 steps) torch {errors['torch']:.2f}, "
            f"ours {errors['ours']:.2f}"
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
