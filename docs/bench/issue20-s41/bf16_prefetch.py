"""The bf16 kernel (engine/bf16_matmul.c) with the next block's prefetch in the last pass over a block's
rows (the thirty-ninth session's, from git) and spread over every pass (this session's), alternated in
one process: Qwen2.5-Coder-1.5B's linear layers at 1-16 rows, and whole one-sequence forwards of the
target (the decode stack, logits included) for windows of 1-9 rows. Checks the outputs are the same.

    python bf16_prefetch.py [ROUNDS] [OLD_REV]
"""

from __future__ import annotations

import ctypes
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.engine.bf16_kernel import Bf16Kernel, default_bf16_kernel
from specserve.engine.builder import load_model
from specserve.engine.c_library import build_library, int_function
from specserve.engine.config import ModelSpec
from specserve.engine.decode_stack import default_decode_stack_kernel, use_decode_stack
from specserve.engine.models.small_batch_linear import SmallBatchLinear
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT = 16, 200
LAYER_ROWS = (1, 2, 4, 5, 6, 8, 12, 16)
WINDOW_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def old_kernel(rev: str, directory: Path) -> Bf16Kernel:
    source = directory / "bf16_matmul.c"
    source.write_text(
        subprocess.run(
            ["git", "show", f"{rev}:engine/bf16_matmul.c"], check=True, capture_output=True, text=True
        ).stdout
    )
    path, library = build_library(source, directory)
    arguments: list[type] = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    arguments += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return Bf16Kernel(path=path, function=int_function(library, "bf16_matmul", *arguments))


def step(model, kv, seqs) -> torch.Tensor:  # [rows, vocab] float32
    return model.compute_logits(forward_sequences(model, kv, seqs, BLOCK))


def timed(fn, repeats: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    rev = sys.argv[2] if len(sys.argv) > 2 else "6528c96"
    new = default_bf16_kernel()
    stack_kernel = default_decode_stack_kernel()
    assert new is not None and stack_kernel is not None, "needs the C kernels (AVX512-BF16)"
    old = old_kernel(rev, Path(tempfile.mkdtemp()))
    arms = {"last pass": old, "every pass": new}
    spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    model = load_model(spec, None).model.eval()
    linears = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    results = []
    layer0 = model.layers[0]
    shapes = {
        "qkv": layer0.self_attn.qkv_proj,
        "o": layer0.self_attn.o_proj,
        "gate_up": layer0.mlp.gate_up_proj,
        "down": layer0.mlp.down_proj,
    }
    g = torch.Generator().manual_seed(0)
    for name, layer in shapes.items():
        for rows in LAYER_ROWS:
            x = torch.randn(rows, layer.in_features, generator=g).bfloat16()
            outs = {arm: k(x, layer.weight, layer.bias) for arm, k in arms.items()}
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            for _ in range(rounds):
                for arm, k in arms.items():
                    times[arm].append(timed(functools.partial(k, x, layer.weight, layer.bias), 20))
            ms = {arm: statistics.median(t) * 1e3 for arm, t in times.items()}
            results.append(
                {
                    "what": f"{name} N={layer.out_features} K={layer.in_features}",
                    "rows": rows,
                    "last_ms": round(ms["last pass"], 3),
                    "every_ms": round(ms["every pass"], 3),
                    "same": torch.equal(outs["last pass"], outs["every pass"]),
                }
            )
    kv = model.allocate_kv_cache(64 * BLOCK + 1, spec.dtype, "cpu")
    table = list(range(64))
    forward_sequences(model, kv, [SequenceInput(list(range(100, 100 + CONTEXT)), 0, table, 1)], BLOCK)

    def set_arm(kernel: Bf16Kernel) -> None:
        for linear in linears:
            linear.kernel = kernel
        use_decode_stack(model, stack_kernel)  # the stack holds the kernel's address: build it again

    for rows in tqdm(WINDOW_ROWS, desc="windows"):
        seqs = [SequenceInput(list(range(5, 5 + rows)), CONTEXT, table, rows)]
        times = {arm: [] for arm in arms}
        logits = {}
        for _ in range(rounds):
            for arm, kernel in arms.items():
                set_arm(kernel)
                logits[arm] = step(model, kv, seqs)
                times[arm].append(timed(functools.partial(step, model, kv, seqs)))
        ms = {arm: statistics.median(t) * 1e3 for arm, t in times.items()}
        results.append(
            {
                "what": "Qwen2.5-Coder-1.5B forward, 1 sequence",
                "rows": rows,
                "last_ms": round(ms["last pass"], 2),
                "every_ms": round(ms["every pass"], 2),
                "same": torch.equal(logits["last pass"], logits["every pass"]),
            }
        )
    print(json.dumps(results, indent=1))
    print(f"{'what':42} {'rows':>4} {'last pass ms':>12} {'every pass ms':>13} {'every / last':>12}  same")
    for r in results:
        print(
            f"{r['what']:42} {r['rows']:4} {r['last_ms']:12.3f} {r['every_ms']:13.3f}"
            f" {r['every_ms'] / r['last_ms']:12.3f}  {r['same']}"
        )


if __name__ == "__main__":
    # One worker thread, as the engine runs its forwards.
    ThreadPoolExecutor(1).submit(main).result()
