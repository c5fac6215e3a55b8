"""A decode step (1 or 4 sequences, 200 tokens into their contexts, logits and argmax) of the
Qwen2.5-Coder-0.5B int4 draft and the Qwen2.5-Coder-1.5B bf16 target with three row-op arms alternated
in one process: torch's ops, our C row ops (engine/row_ops.c), and none at all (norms, rope and the
activation skipped: the most any faster row op could save; its output is meaningless).

    python row_ops.py [ROUNDS]
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
from specserve.engine.decode_stack import use_decode_stack
from specserve.engine.models import layers, rope
from specserve.engine.row_ops_kernel import default_row_ops_kernel
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT = 16, 200
MODELS = (
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "int4", True),  # the draft
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", None, False),  # the target
)
TORCH_OPS = (layers.RMSNorm.forward, layers.RMSNorm.add_and_norm, rope.RotaryEmbedding.forward)


def skipped_norm(self, x):
    return x


def skipped_add_and_norm(self, x, delta):
    x = x + delta
    return x, x


def skipped_rope(self, positions, q, k):
    return q, k


def set_arm(model, arm: str) -> None:
    kernel = default_row_ops_kernel() if arm == "ours" else None
    layers.use_row_ops(model, kernel)  # None: torch's ops
    none = arm == "none"
    layers.RMSNorm.forward, layers.RMSNorm.add_and_norm, rope.RotaryEmbedding.forward = (
        (skipped_norm, skipped_add_and_norm, skipped_rope) if none else TORCH_OPS
    )
    for module in model.modules():
        if isinstance(module, layers.GatedMLP):
            module.act = (lambda g: g) if none else torch.nn.functional.silu


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    assert default_row_ops_kernel() is not None
    for path, encoding, draft in MODELS:
        spec = ModelSpec(model_path=path, quantization_encoding=encoding)
        model = load_model(spec, None, draft=draft).model.eval()
        use_decode_stack(model, None)  # the modules, whose row ops the arms switch (engine/decode_stack.py)
        for num_seqs in (1, 4):
            kv = model.allocate_kv_cache(64 * BLOCK * num_seqs + 1, spec.dtype, "cpu")
            tables = [list(range(64 * i, 64 * (i + 1))) for i in range(num_seqs)]
            prompts = [SequenceInput(list(range(100, 100 + CONTEXT)), 0, t, 1) for t in tables]
            forward_sequences(model, kv, prompts, BLOCK)
            seqs = [SequenceInput([5], CONTEXT, t, 1) for t in tables]
            times: dict[str, list[float]] = {"torch": [], "ours": [], "none": []}
            for _ in tqdm(range(rounds), desc=f"{path.split('/')[1]} x{num_seqs}", leave=False):
                for arm, samples in times.items():
                    set_arm(model, arm)
                    for _ in range(2):  # warm
                        model.compute_logits(forward_sequences(model, kv, seqs, BLOCK)).argmax(-1)
                    start = time.perf_counter()
                    for _ in range(3):
                        model.compute_logits(forward_sequences(model, kv, seqs, BLOCK)).argmax(-1)
                    samples.append((time.perf_counter() - start) / 3)
            set_arm(model, "torch")
            med = {arm: statistics.median(s) * 1e3 for arm, s in times.items()}
            print(
                f"{path.split('/')[1]} {num_seqs} sequence(s): torch ops {med['torch']:.2f} ms, "
                f"ours {med['ours']:.2f} ms ({med['ours'] / med['torch']:.3f}x), "
                f"none {med['none']:.2f} ms (torch's row ops {med['torch'] - med['none']:.2f} ms, "
                f"ours {med['ours'] - med['none']:.2f} ms)",
                flush=True,
            )


if __name__ == "__main__":
    # One worker thread, as the engine runs its forwards.
    ThreadPoolExecutor(1).submit(main).result()
