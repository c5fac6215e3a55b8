"""One SmolLM2 layer's batch-invariant attention (`--batch-invariant`) for a fresh prompt of T tokens
(bf16, 2 threads, the served engine's heap settings): run at two versions of engine/attention.py to compare.

    python invariant_prefill.py
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from specserve.engine import attention
from specserve.engine.attention import AttentionMetadata
from specserve.engine.heap_retention import retain_heaps

retain_heaps()  # as `serve` does: without it, fresh mappings for the scores decide the timings

torch.set_num_threads(2)
HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
for tokens in (256, 484, 1024):
    blocks = (tokens + BLOCK - 1) // BLOCK
    meta = AttentionMetadata.build([tokens], [tokens], [list(range(blocks))], BLOCK)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, DIM, generator=g).bfloat16()
    k = torch.randn(tokens, KV_HEADS, DIM, generator=g).bfloat16()
    v = torch.randn(tokens, KV_HEADS, DIM, generator=g).bfloat16()
    cache = (torch.zeros(blocks * BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16),) * 2
    run = functools.partial(attention._invariant_attention, q, k, v, *cache, meta, DIM**-0.5)
    out, times = run(), []
    for _ in range(30):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(
        f"T={tokens}: {1e3 * statistics.median(times):.2f} ms; output checksum {out.float().sum().item():.6f}"
    )
