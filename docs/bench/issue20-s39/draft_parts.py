"""Where a draft step of the Qwen2.5-Coder-0.5B int4 draft (loaded as a draft) goes: the whole step (a
forward of 1 or 4 sequences, 200 tokens into their contexts, and the logits' argmax) against the time
inside its int4 linear layers (our kernel, LM head included), timed around each layer's matmul.

    python draft_parts.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from specserve.engine import quantization
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT = 16, 200
UNTIMED = quantization.Int4TiledLinear._matmul


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization_encoding="int4")
    model = load_model(spec, None, draft=True).model.eval()
    inside = [0.0]

    def timed(self, x):
        start = time.perf_counter()
        out = UNTIMED(self, x)
        inside[0] += time.perf_counter() - start
        return out

    for num_seqs in (1, 4):
        kv = model.allocate_kv_cache(64 * BLOCK * num_seqs + 1, spec.dtype, "cpu")
        tables = [list(range(64 * i, 64 * (i + 1))) for i in range(num_seqs)]
        forward_sequences(
            model, kv, [SequenceInput(list(range(100, 100 + CONTEXT)), 0, t, 1) for t in tables], BLOCK
        )
        seqs = [SequenceInput([5], CONTEXT, t, 1) for t in tables]
        steps, matmuls = [], []
        quantization.Int4TiledLinear._matmul = timed
        for r in range(rounds + 3):
            inside[0] = 0.0
            start = time.perf_counter()
            model.compute_logits(forward_sequences(model, kv, seqs, BLOCK)).argmax(-1)
            if r >= 3:
                steps.append(time.perf_counter() - start)
                matmuls.append(inside[0])
        quantization.Int4TiledLinear._matmul = UNTIMED
        step, matmul = statistics.median(steps) * 1e3, statistics.median(matmuls) * 1e3
        print(
            f"{num_seqs} sequence(s): step {step:.2f} ms, int4 matmuls {matmul:.2f} ms, "
            f"the rest {step - matmul:.2f} ms ({(step - matmul) / step:.0%})"
        )


if __name__ == "__main__":
    # One worker thread, as the engine runs its forwards.
    ThreadPoolExecutor(1).submit(main).result()
