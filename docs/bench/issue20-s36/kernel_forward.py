"""Whole forwards with the paged-decode kernel's two score passes (`kernel_kpass.py`'s old and new C
source): one model's forward over the paged KV cache per batch shape, the two kernels alternated in one
worker thread (as served), contexts spread as `bench_attention --context-spread 0.8` spreads them.

    python kernel_forward.py [REPEATS] [MODEL] [OLD_COMMIT]   # default 10, SmolLM2 (the default model)
"""

from __future__ import annotations

import functools
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_kpass import build, old_source  # noqa: E402

from specserve.benchmarks.bench_attention import contexts_of, random_kv_cache  # noqa: E402
from specserve.benchmarks.harness import alternated_seconds  # noqa: E402
from specserve.engine import paged_decode_kernel  # noqa: E402
from specserve.engine.attention import kernel_paged_attention  # noqa: E402
from specserve.engine.builder import load_model  # noqa: E402
from specserve.engine.config import ModelSpec  # noqa: E402
from specserve.engine.runner import SequenceInput, forward_sequences  # noqa: E402

BLOCK = 16
CONTEXT = 512
SHAPES = [(1, 1), (4, 1), (8, 1), (16, 1), (32, 1), (1, 9), (4, 4), (8, 4), (16, 4)]  # (sequences, rows)


def use_backend(model: torch.nn.Module, arms: dict[str, Callable[..., torch.Tensor]], name: str) -> None:
    """Switch every attention layer of `model` to arm `name`'s backend (untimed, before its forward)."""
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = arms[name]


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    model_path = sys.argv[2] if len(sys.argv) > 2 else None
    source, tmp = old_source(sys.argv[3] if len(sys.argv) > 3 else "2571468")
    kernels = {"old": build(source, tmp / "old"), "new": build(paged_decode_kernel.SOURCE, tmp / "new")}
    spec = ModelSpec(model_path=model_path, quantization_encoding="bfloat16")
    model = load_model(spec, None).model.eval()
    per_seq = -(-(CONTEXT + 16) // BLOCK)
    kv_cache = random_kv_cache(model, 32 * per_seq * BLOCK + 1, spec)
    arms = {name: kernel_paged_attention(k) for name, k in kernels.items()}
    print(
        f"{model_path or 'SmolLM2-135M'} bf16, threads {torch.get_num_threads()}, {repeats} forwards an arm"
    )
    print(f"{'sequences x rows':18s} {'old ms':>8s} {'new ms':>8s} {'new/old':>8s}")
    for num_seqs, rows in SHAPES:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
        seqs = [
            SequenceInput([1] * rows, c, t, rows)
            for t, c in zip(tables, contexts_of(num_seqs, CONTEXT, 0.8), strict=True)
        ]
        forward = functools.partial(forward_sequences, model, kv_cache, seqs, BLOCK)
        times = alternated_seconds(
            {name: forward for name in arms}, repeats, prepare=functools.partial(use_backend, model, arms)
        )
        ratio = statistics.median(n / o for n, o in zip(times["new"], times["old"], strict=True))
        o, n = (statistics.median(times[name]) * 1e3 for name in ("old", "new"))
        print(f"{num_seqs:>8d} x {rows:<7d} {o:8.2f} {n:8.2f} {ratio:7.3f}x")


if __name__ == "__main__":
    with torch.no_grad(), ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(main).result()
