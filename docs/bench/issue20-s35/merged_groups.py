"""A SmolLM2 forward of decodes beside verification windows: the paged-decode kernel per attention group
(as the padded paths need) against one kernel call a layer for all of them (`merged_short_queries`),
alternated in one process, in a worker thread as served.

    python merged_groups.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.benchmarks.bench_attention import random_kv_cache
from specserve.engine.attention import AttentionMetadata
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK = 16
# (label, query rows per sequence): decodes with a few windows, as adaptive steps are
STEPS = [
    ("8 seqs: 6 decodes, 2 windows of 4", [1, 4, 1, 1, 1, 4, 1, 1]),
    ("8 seqs: 4 decodes, 4 windows of 3-6", [3, 1, 6, 1, 4, 1, 5, 1]),
    ("16 seqs: 14 decodes, 2 windows of 3", [1] * 7 + [3] + [1] * 7 + [3]),
    ("4 seqs: 2 decodes, windows of 2 and 6", [1, 2, 1, 6]),
]


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    spec = ModelSpec(model_path=None, quantization_encoding="bfloat16")
    model = load_model(spec, None).model.eval()
    blocks_per_seq = 40
    kv_cache = random_kv_cache(model, 16 * blocks_per_seq * BLOCK + 1, spec)
    real = AttentionMetadata.merged_short_queries
    arms = {"per group": lambda self, rows: None, "one call": real}
    print(f"{'step':40s} {'per group ms':>13s} {'one call ms':>12s} {'one call / per group':>21s}")
    for label, q_lens in STEPS:
        contexts = [150 + 400 * i // len(q_lens) for i in range(len(q_lens))]
        seqs = [
            SequenceInput([1] * q, c, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), q)
            for i, (q, c) in enumerate(zip(q_lens, contexts, strict=True))
        ]
        times: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(repeats + 2):
            for name in list(arms) if rep % 2 == 0 else list(reversed(arms)):
                AttentionMetadata.merged_short_queries = arms[name]  # type: ignore[method-assign]
                start = time.perf_counter()
                forward_sequences(model, kv_cache, seqs, BLOCK)
                if rep >= 2:
                    times[name].append(time.perf_counter() - start)
        AttentionMetadata.merged_short_queries = real  # type: ignore[method-assign]
        ratio = statistics.median(a / b for a, b in zip(times["one call"], times["per group"], strict=True))
        g, o = (statistics.median(times[n]) * 1e3 for n in ("per group", "one call"))
        print(f"{label:40s} {g:13.2f} {o:12.2f} {ratio:20.3f}x")


if __name__ == "__main__":
    with torch.no_grad(), ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(main).result()
