"""One layer's attention for decodes and verification windows: the torch matmul path
(`cpu_paged_attention`) against the paged-decode kernel (`kernel_paged_attention`), alternated in one
process, contexts drawn per sequence (so the matmul path pads to the batch's longest), bf16 and float32;
and each arm's distance from a float64 answer over the same bf16 inputs.

    python decode_kernel.py [REPEATS]    # default 40 timed calls per arm and shape
"""

from __future__ import annotations

import random
import statistics
import sys
import time

import torch

from specserve.engine.attention import AttentionMetadata, cpu_paged_attention, kernel_paged_attention
from specserve.engine.paged_decode_kernel import default_paged_decode

BLOCK = 16
# (label, sequences, contexts drawn from, query rows each, heads, KV heads, head size)
SHAPES = [
    ("SmolLM2 1 decode", 1, (400, 400), 1, 9, 3, 64),
    ("SmolLM2 4 decodes", 4, (100, 600), 1, 9, 3, 64),
    ("SmolLM2 8 decodes", 8, (100, 600), 1, 9, 3, 64),
    ("SmolLM2 16 decodes", 16, (100, 700), 1, 9, 3, 64),
    ("SmolLM2 32 decodes", 32, (100, 700), 1, 9, 3, 64),
    ("SmolLM2 8 windows of 4", 8, (100, 600), 4, 9, 3, 64),
    ("SmolLM2 1 window of 9", 1, (500, 500), 9, 9, 3, 64),
    ("Qwen-1.5B 1 decode", 1, (600, 600), 1, 12, 2, 128),
    ("Qwen-1.5B 4 decodes", 4, (300, 800), 1, 12, 2, 128),
    ("Qwen-1.5B 1 window of 6", 1, (600, 600), 6, 12, 2, 128),
    ("Qwen-1.5B 4 windows of 4", 4, (300, 800), 4, 12, 2, 128),
]


def make_step(sequences, contexts, q_len, heads, kv_heads, dim, dtype, rng):
    c_lens = [rng.randint(*contexts) for _ in range(sequences)]
    blocks = [-(-c // BLOCK) for c in c_lens]
    order = [b + 1 for b in rng.sample(range(sum(blocks)), sum(blocks))]  # scattered, slot 0 the pad
    tables, used = [], 0
    for n in blocks:
        tables.append(order[used : used + n])
        used += n
    slots = (sum(blocks) + 1) * BLOCK
    k_cache = torch.randn(slots, kv_heads, dim).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim).to(dtype)
    k_cache[:BLOCK], v_cache[:BLOCK] = 0, 0
    tokens = sequences * q_len
    q = (2 * torch.randn(tokens, heads, dim)).to(dtype)
    k, v = torch.randn(tokens, kv_heads, dim).to(dtype), torch.randn(tokens, kv_heads, dim).to(dtype)
    meta = AttentionMetadata.build([q_len] * sequences, c_lens, tables, BLOCK)
    return q, k, v, k_cache, v_cache, meta


def timed(backend, step, scale) -> float:
    start = time.perf_counter()
    backend(*step, scale)
    return time.perf_counter() - start


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    kernel = default_paged_decode()
    assert kernel is not None, "the kernel did not build"
    arms = {"matmul": cpu_paged_attention, "kernel": kernel_paged_attention(kernel)}
    rng = random.Random(0)
    torch.manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}, kernel {kernel.path.name}, AVX512-BF16 path {kernel.vector_bf16}"
    )
    print(f"{'shape':28s} {'dtype':9s} {'matmul us':>10s} {'kernel us':>10s} {'kernel/matmul':>14s}")
    for label, sequences, contexts, q_len, heads, kv_heads, dim in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            step = make_step(sequences, contexts, q_len, heads, kv_heads, dim, dtype, rng)
            times: dict[str, list[float]] = {name: [] for name in arms}
            for rep in range(repeats + 2):  # two warm-up rounds dropped
                for name in list(arms) if rep % 2 == 0 else list(reversed(arms)):
                    seconds = timed(arms[name], step, dim**-0.5)
                    if rep >= 2:
                        times[name].append(seconds)
            ratio = statistics.median(a / b for a, b in zip(times["kernel"], times["matmul"], strict=True))
            m, k = (statistics.median(times[n]) * 1e6 for n in ("matmul", "kernel"))
            print(f"{label:28s} {str(dtype)[6:]:9s} {m:10.1f} {k:10.1f} {ratio:13.2f}x")
    print("\ndistance from float64 over the same bf16 inputs (max / mean absolute)")
    for label, sequences, contexts, q_len, heads, kv_heads, dim in SHAPES:
        step = make_step(sequences, contexts, q_len, heads, kv_heads, dim, torch.bfloat16, rng)
        wide = tuple(t.double() if torch.is_tensor(t) else t for t in step)
        ref = cpu_paged_attention(*wide, dim**-0.5)
        errs = []
        for name in arms:
            q, k, v, k_cache, v_cache, meta = step
            out = arms[name](q, k, v, k_cache.clone(), v_cache.clone(), meta, dim**-0.5).double()
            errs.append(((out - ref).abs().max().item(), (out - ref).abs().mean().item()))
        (m_max, m_mean), (k_max, k_mean) = errs
        print(f"{label:28s} matmul {m_max:.4f} / {m_mean:.6f}   kernel {k_max:.4f} / {k_mean:.6f}")


if __name__ == "__main__":
    main()
