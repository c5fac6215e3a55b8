"""The paged-decode kernel's score pass, two versions of the C source side by side: the thirty-fifth
session's (per row, sixteen keys as the lanes of sixteen dot products summed by a transposing tree)
and this session's (each block of sixteen keys transposed once per KV head, every row then broadcast
against it: no horizontal sums). One layer's bf16 attention, alternated in one process, the shapes of
the thirty-fifth session's `decode_kernel.py`; and each version's distance from a float64 answer.

    python kernel_kpass.py [REPEATS] [OLD_COMMIT]   # default 40 timed calls, old source from 2571468

(results/kernel_kpass.txt: against 2571468, before the MHA shapes were added. kernel_kpass-mha-rows-tried.txt:
b867b9f against a trial source that scored MHA models row by row again, as 2571468 did; not kept.)
"""

from __future__ import annotations

import functools
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "issue20-s35"))
from decode_kernel import SHAPES as S35_SHAPES  # noqa: E402
from decode_kernel import make_step  # noqa: E402

from specserve.benchmarks.harness import alternated_seconds  # noqa: E402
from specserve.engine import paged_decode_kernel  # noqa: E402
from specserve.engine.attention import cpu_paged_attention, kernel_paged_attention  # noqa: E402

# The thirty-fifth session's shapes and a model with one query head per KV head (SmolLM2-1.7B's layout:
# 32 heads of 64), where a decode's KV head has a single row to share its transposed block with.
SHAPES = [
    *S35_SHAPES,
    ("MHA 32x64, 1 decode", 1, (400, 400), 1, 32, 32, 64),
    ("MHA 32x64, 8 decodes", 8, (100, 600), 1, 32, 32, 64),
    ("MHA 32x64, 1 window of 6", 1, (500, 500), 6, 32, 32, 64),
]


def build(source: Path, cache: Path) -> paged_decode_kernel.PagedDecodeKernel:
    saved = paged_decode_kernel.SOURCE
    paged_decode_kernel.SOURCE = source
    try:
        return paged_decode_kernel.build_paged_decode(cache)
    finally:
        paged_decode_kernel.SOURCE = saved


def old_source(commit: str) -> tuple[Path, Path]:
    """(the kernel's C source at `commit`, written to a new temporary directory; that directory)."""
    root = Path(__file__).resolve().parents[3]
    tmp = Path(tempfile.mkdtemp())
    source = tmp / "paged_decode.c"
    shown = subprocess.run(
        ["git", "-C", str(root), "show", f"{commit}:engine/paged_decode.c"],
        capture_output=True,
        text=True,
        check=True,
    )
    source.write_text(shown.stdout)
    return source, tmp


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    old_commit = sys.argv[2] if len(sys.argv) > 2 else "2571468"
    source, tmp = old_source(old_commit)
    kernels = {"old": build(source, tmp / "old"), "new": build(paged_decode_kernel.SOURCE, tmp / "new")}
    arms = {name: kernel_paged_attention(k) for name, k in kernels.items()}
    rng = random.Random(0)
    torch.manual_seed(0)
    print(
        f"threads {torch.get_num_threads()}, old source {old_commit}, AVX512-BF16 path {kernels['new'].vector_bf16}"
    )
    print(f"{'shape (bf16)':28s} {'old us':>8s} {'new us':>8s} {'new/old':>8s}")
    for label, sequences, contexts, q_len, heads, kv_heads, dim in SHAPES:
        step = make_step(sequences, contexts, q_len, heads, kv_heads, dim, torch.bfloat16, rng)
        calls = {name: functools.partial(arm, *step, dim**-0.5) for name, arm in arms.items()}
        times = alternated_seconds(calls, repeats, warmup=2)
        ratio = statistics.median(a / b for a, b in zip(times["new"], times["old"], strict=True))
        o, n = (statistics.median(times[name]) * 1e6 for name in ("old", "new"))
        print(f"{label:28s} {o:8.1f} {n:8.1f} {ratio:7.2f}x")
    print("\ndistance from float64 over the same bf16 inputs (max / mean absolute); outputs old != new")
    for label, sequences, contexts, q_len, heads, kv_heads, dim in SHAPES:
        step = make_step(sequences, contexts, q_len, heads, kv_heads, dim, torch.bfloat16, rng)
        wide = tuple(t.double() if torch.is_tensor(t) else t for t in step)
        ref = cpu_paged_attention(*wide, dim**-0.5)
        cells, outs = [], []
        for name in ("old", "new"):
            q, k, v, k_cache, v_cache, meta = step
            out = arms[name](q, k, v, k_cache.clone(), v_cache.clone(), meta, dim**-0.5)
            outs.append(out)
            err = (out.double() - ref).abs()
            cells.append(f"{name} {err.max().item():.4f} / {err.mean().item():.6f}")
        differ = (outs[0] != outs[1]).double().mean().item()
        print(f"{label:28s} " + "   ".join(cells) + f"   outputs differing {differ:.2%}")


if __name__ == "__main__":
    main()
