"""Where a one-row step of the Qwen2.5-0.5B int4 draft goes (draft loaded as a draft: tiled int4
layers with int8 activations): the step's time, and under cProfile the share spent inside the int4
kernel calls. The weights are streamed from memory once a step (the draft's int4 layers hold ~0.3 GB),
so the kernel's share is bandwidth; the rest is the model's other operations and Python. Also prints
the bytes of bf16 weights the draft kept for forwards of many rows (`route_rows`; 0 where the int4
kernel beat the float GEMM at every row count timed).

    python draft_step_profile.py [STEPS]
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.engine.builder import load_model
from specserve.engine.config import ModelSpec
from specserve.engine.decode_stack import use_decode_stack
from specserve.engine.int4_kernel import Int4Kernel
from specserve.engine.row_routed_linear import float_copy_bytes
from specserve.engine.runner import SequenceInput, forward_sequences

BLOCK, CONTEXT = 16, 200


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    spec = ModelSpec(model_path="Qwen/Qwen2.5-Coder-0.5B-Instruct", quantization_encoding="int4")
    draft = load_model(spec, None, draft=True).model.eval()
    use_decode_stack(draft, None)  # the modules, as when this was recorded (before engine/decode_stack.py)
    print(f"bf16 weights kept beside the int4 layers: {float_copy_bytes(draft) / 2**20:.0f} MiB")
    kv = draft.allocate_kv_cache(64 * BLOCK + 1, spec.dtype, "cpu")
    table = list(range(64))
    forward_sequences(draft, kv, [SequenceInput(list(range(100, 100 + CONTEXT)), 0, table, 1)], BLOCK)
    seqs = [SequenceInput([5], CONTEXT, table, 1)]

    def step() -> None:
        draft.compute_logits(forward_sequences(draft, kv, seqs, BLOCK)).argmax(-1)

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = sum(v[3] for k, v in stats.items() if k[2] == "step")
    kernel = sum(v[3] for k, v in stats.items() if k[2] == "__call__" and "int4_kernel" in k[0])
    calls = sum(v[1] for k, v in stats.items() if k[2] == "__call__" and "int4_kernel" in k[0])
    print(f"one-row draft step: median {statistics.median(times) * 1e3:.1f} ms over {steps}")
    print(
        f"under cProfile: {total / steps * 1e3:.1f} ms a step, of which {kernel / steps * 1e3:.1f} ms in"
        f" {calls // steps} int4 kernel calls ({Int4Kernel.__name__}.__call__)"
    )


if __name__ == "__main__":
    with torch.no_grad(), ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(main).result()
