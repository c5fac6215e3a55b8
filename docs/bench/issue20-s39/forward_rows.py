"""Whole forwards of the bf16 models with their linear layers on our few-row kernel
(engine/models/small_batch_linear.py) against torch's, alternated in one process: decodes of 1-32
sequences and verification windows (sequences x window tokens, every token's logits wanted), each
sequence 200 tokens into its context. Prints the median step times, the ratio, and how many rows'
greedy tokens and how close the logits are between the two.

    python forward_rows.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.models import small_batch_linear
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT = 16, 200
# (sequences, tokens a sequence): decodes, then verification windows of k + 1 tokens
SHAPES = [
    (1, 1),
    (4, 1),
    (8, 1),
    (16, 1),
    (32, 1),
    (1, 6),
    (2, 6),
    (4, 4),
    (4, 6),
    (4, 8),
    (8, 5),
    (8, 6),
    (8, 8),
]
MODELS = {
    "SmolLM2-135M": ModelSpec(),
    "Qwen2.5-Coder-1.5B": ModelSpec(model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct"),
}
ON = small_batch_linear.MAX_KERNEL_ROWS


def bench(name: str, spec: ModelSpec, rounds: int) -> list[str]:
    model = load_model(spec, None).model.eval()
    lines = []
    for num_seqs, window in tqdm(SHAPES, desc=name):
        blocks = (CONTEXT + window) // BLOCK + 1
        kv = model.allocate_kv_cache(blocks * BLOCK * num_seqs + 1, spec.dtype, "cpu")
        tables = [list(range(blocks * i, blocks * (i + 1))) for i in range(num_seqs)]
        prompt = [
            SequenceInput(list(range(100 + i, 100 + i + CONTEXT)), 0, t, 1) for i, t in enumerate(tables)
        ]
        forward_sequences(model, kv, prompt, BLOCK)
        seqs = [SequenceInput(list(range(7, 7 + window)), CONTEXT, t, window) for t in tables]

        def step(kv=kv, seqs=seqs) -> torch.Tensor:
            return model.compute_logits(forward_sequences(model, kv, seqs, BLOCK))  # [rows, vocab]

        arms = {"torch": 0, "ours": ON}
        logits = {}
        for arm, rows in arms.items():
            small_batch_linear.MAX_KERNEL_ROWS = rows
            logits[arm] = step()
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(rounds):
            for arm, rows in arms.items():
                small_batch_linear.MAX_KERNEL_ROWS = rows
                start = time.perf_counter()
                step().argmax(-1)
                times[arm].append(time.perf_counter() - start)
        small_batch_linear.MAX_KERNEL_ROWS = ON
        t, o = (statistics.median(times[a]) * 1e3 for a in arms)
        same = (logits["torch"].argmax(-1) == logits["ours"].argmax(-1)).sum().item()
        gap = (logits["torch"] - logits["ours"]).abs().max().item()
        lines.append(
            f"{name}, {num_seqs} x {window} rows: torch {t:.1f} ms, ours {o:.1f} ms, ours / torch {o / t:.3f}; "
            f"greedy token the same in {same}/{num_seqs * window} rows, largest logit difference {gap:.3f}"
        )
    return lines


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    lines = [line for name, spec in MODELS.items() for line in bench(name, spec, rounds)]
    print(f"our kernel up to {ON} rows (engine/models/small_batch_linear.py); torch {torch.__version__}")
    print("\n".join(lines))


if __name__ == "__main__":
    # One worker thread, as the engine runs its forwards.
    ThreadPoolExecutor(1).submit(main).result()
