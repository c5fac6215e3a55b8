"""A decode step (1 or 4 sequences, 200 tokens into their contexts; logits and argmax) and a 5-row
verification window of the Qwen2.5-Coder-0.5B int4 draft and the Qwen2.5-Coder-1.5B bf16 target, with
the layers as modules and as one C call (engine/decode_stack.c), alternated in one process. Checks that
both arms give the same logits bit for bit.

    python decode_stack.py [ROUNDS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.decode_stack import use_decode_stack
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT = 16, 200
MODELS = (
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "int4", True),  # the draft
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", None, False),  # the target
)


def step(model, kv, seqs) -> torch.Tensor:  # [rows, vocab] float32
    return model.compute_logits(forward_sequences(model, kv, seqs, BLOCK))


SHAPES = {"decode x1": (1, 1), "decode x4": (4, 1), "window 5 x1": (1, 5)}  # (sequences, rows each)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    results = []
    for path, encoding, draft in MODELS:
        spec = ModelSpec(model_path=path, quantization_encoding=encoding)
        model = load_model(spec, None, draft=draft).model.eval()
        stack = model.decode_stack
        assert stack is not None, "the stack needs the C kernels (AVX512-BF16)"
        for shape, (num_seqs, rows) in SHAPES.items():
            kv = model.allocate_kv_cache(64 * BLOCK * num_seqs + 1, spec.dtype, "cpu")
            tables = [list(range(64 * i, 64 * (i + 1))) for i in range(num_seqs)]
            prompts = [SequenceInput(list(range(100, 100 + CONTEXT)), 0, t, 1) for t in tables]
            use_decode_stack(model, None)
            forward_sequences(model, kv, prompts, BLOCK)
            seqs = [SequenceInput(list(range(5, 5 + rows)), CONTEXT, t, rows) for t in tables]

            arms = {"modules": None, "stack": stack}
            logits = {}
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for _ in tqdm(range(rounds), desc=f"{path.split('/')[1]} {shape}", leave=False):
                for arm, samples in times.items():
                    model.decode_stack = arms[arm]
                    for _ in range(2):  # warm
                        logits[arm] = step(model, kv, seqs)
                    start = time.perf_counter()
                    for _ in range(3):
                        step(model, kv, seqs).argmax(-1)
                    samples.append((time.perf_counter() - start) / 3)
            model.decode_stack = stack
            same = torch.equal(logits["modules"], logits["stack"])
            medians = {arm: statistics.median(s) * 1e3 for arm, s in times.items()}
            results.append(
                {
                    "model": path,
                    "encoding": encoding or "bfloat16",
                    "shape": shape,
                    "modules_ms": round(medians["modules"], 2),
                    "stack_ms": round(medians["stack"], 2),
                    "ratio": round(medians["stack"] / medians["modules"], 3),
                    "same_logits": same,
                    "rounds": rounds,
                }
            )
    print(json.dumps(results, indent=1))
    print(f"{'model':34} {'shape':12} {'modules ms':>10} {'stack ms':>9} {'ratio':>6}  same logits")
    for r in results:
        print(
            f"{r['model'].split('/')[1] + ' ' + r['encoding']:34} {r['shape']:12} {r['modules_ms']:10.2f}"
            f" {r['stack_ms']:9.2f} {r['ratio']:6.3f}  {r['same_logits']}"
        )


if __name__ == "__main__":
    # One worker thread, as the engine runs its forwards.
    ThreadPoolExecutor(1).submit(main).result()
