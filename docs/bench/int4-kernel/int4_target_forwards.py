"""Whole forwards of the Qwen2.5-Coder-1.5B target: bf16, int4 on PyTorch's kernel (`Int4Linear`) and
int4 on ours (`Int4TiledLinear`), one process, arms alternated: a 256-token prefill, a one-token decode
and verification windows of 4 and 6 rows (one sequence, 256 tokens of context), and a decode step of 8
sequences. The brief's complaint: int4 windows cost 1.6-3.6x one row, int4 prefill 4-6x bf16's.

    python int4_target_forwards.py [REPEATS]
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.benchmarks.harness import alternated_seconds
from specserve.engine import int4_kernel
from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.runner import SequenceInput, forward_sequences

TARGET = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
BLOCK, CONTEXT, SEQS = 16, 256, 8


def load(encoding: str, tiled: bool):
    os.environ["SPECSERVE_INT4_KERNEL"] = "1" if tiled else "0"
    int4_kernel.default_int4_kernel.cache_clear()  # the layout is chosen at load
    model = load_model(ModelSpec(model_path=TARGET, quantization_encoding=encoding), None).model.eval()
    kv = model.allocate_kv_cache(SEQS * (CONTEXT // BLOCK + 2) * BLOCK + 1, torch.bfloat16, "cpu")
    return model, kv


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    arms = {
        "bf16": load("bfloat16", True),
        "int4 torch": load("int4", False),
        "int4 tiled": load("int4", True),
    }
    tables = [list(range(i * (CONTEXT // BLOCK + 2), (i + 1) * (CONTEXT // BLOCK + 2))) for i in range(SEQS)]
    prompt = [(7 * i) % 5000 + 100 for i in range(CONTEXT)]
    shapes = {
        "prefill 256": [SequenceInput(prompt, 0, tables[0], 1)],
        "decode 1": [SequenceInput([11], CONTEXT, tables[0], 1)],
        "window 4": [SequenceInput([11, 12, 13, 14], CONTEXT, tables[0], 4)],
        "window 6": [SequenceInput([11, 12, 13, 14, 15, 16], CONTEXT, tables[0], 6)],
        "decode 8 seqs": [SequenceInput([11], CONTEXT, tables[i], 1) for i in range(SEQS)],
    }
    for model, kv in arms.values():  # every sequence's context, once per model
        for table in tables:
            forward_sequences(model, kv, [SequenceInput(prompt, 0, table, 1)], BLOCK)

    def forward(name: str, seqs: list[SequenceInput]) -> None:
        model, kv = arms[name]
        model.compute_logits(forward_sequences(model, kv, seqs, BLOCK))

    print(f"threads {torch.get_num_threads()}; ms per forward with its logits (median of {repeats})")
    print(
        f"{'shape':14s} {'bf16':>9s} {'int4 torch':>11s} {'int4 tiled':>11s} {'tiled/torch':>12s} {'tiled/bf16':>11s}"
    )
    first: dict[str, float] = {}
    for shape, seqs in shapes.items():
        times = alternated_seconds({a: functools.partial(forward, a, seqs) for a in arms}, repeats, warmup=1)
        ms = {a: statistics.median(t) * 1e3 for a, t in times.items()}
        first = first or ms
        print(
            f"{shape:14s} {ms['bf16']:9.1f} {ms['int4 torch']:11.1f} {ms['int4 tiled']:11.1f}"
            f" {ms['int4 tiled'] / ms['int4 torch']:11.2f}x {ms['int4 tiled'] / ms['bf16']:10.2f}x"
        )
    print("(rows: prefill 256 / window k rows / decode 8 seqs; ratios are within a row)")


if __name__ == "__main__":
    with torch.no_grad(), ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(main).result()
