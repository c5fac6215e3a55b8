"""One 256-token prefill forward, timed: the bf16 Qwen2.5-Coder-1.5B target (`target`) or the int4
0.5B draft (`draft`), on whichever specserve is imported (run it with PYTHONPATH at another commit's
package to compare code on the same machine).

    python prefill_ab.py target|draft [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import specserve
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT = 16, 256


def main() -> None:
    which = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(2)
    print(specserve.__file__)
    if which == "target":
        spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    else:
        spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization_encoding="int4")
    model = load_model(spec, None).model.eval()
    kv = model.allocate_kv_cache((CONTEXT // BLOCK + 2) * BLOCK + 1, torch.bfloat16, "cpu")
    table = list(range(CONTEXT // BLOCK + 2))
    prompt = [(7 * i) % 5000 + 100 for i in range(CONTEXT)]
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.compute_logits(forward_sequences(model, kv, [SequenceInput(prompt, 0, table, 1)], BLOCK))
        seconds.append(time.perf_counter() - start)
    print(
        which,
        "prefill 256 ms",
        [round(s * 1e3) for s in seconds],
        "median",
        round(statistics.median(seconds) * 1e3, 1),
    )


if __name__ == "__main__":
    main()
