"""Is a step that prefills a prompt beside decodes dearer than its parts? SmolLM2 bf16 forwards, in a
worker thread as served, alternated: 15 decodes alone, one prompt alone, and the two in one step.

    python mixed_step.py [REPEATS] [PROMPT_TOKENS]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.benchmarks.bench_attention import random_kv_cache
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK = 16


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    spec = ModelSpec(model_path=None, quantization_encoding="bfloat16")
    model = load_model(spec, None).model.eval()
    per_seq = 48
    kv_cache = random_kv_cache(model, 17 * per_seq * BLOCK + 1, spec)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(16)]
    decodes = [SequenceInput([1], 150 + 20 * i, tables[i], 1) for i in range(15)]
    fresh = SequenceInput([1] * prompt, 0, tables[15], 1)
    arms = {"decodes": decodes, "prompt": [fresh], "mixed": [*decodes, fresh]}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(repeats + 2):
        for name in list(arms) if rep % 2 == 0 else list(reversed(arms)):
            start = time.perf_counter()
            forward_sequences(model, kv_cache, arms[name], BLOCK)
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ratios = [m / (d + p) for m, d, p in zip(times["mixed"], times["decodes"], times["prompt"], strict=True)]
    print(
        f"15 decodes {med['decodes']:.2f} ms, a {prompt}-token prompt {med['prompt']:.2f} ms, both in one step "
        f"{med['mixed']:.2f} ms: mixed / (decodes + prompt) {statistics.median(ratios):.3f}"
    )


if __name__ == "__main__":
    with torch.no_grad(), ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(main).result()
