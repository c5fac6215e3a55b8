"""Start-up profile of the target's forward cost over the number of tokens it verifies.

The speculation controller needs the shape of this curve before traffic arrives: on this CPU a bf16
forward of up to ~16 tokens costs about one token's, the int4/int8 kernels step every 4 rows, a GPU is
flat until large batches. Each point is one forward of n tokens (every row wants logits, as in a
verification window), the fastest of a few runs. It writes KV slots of the first blocks, which is
harmless at start-up: no request owns them yet, and a request writes its own KV before reading it.
"""

from __future__ import annotations

import logging
import time

import torch

from .models import CausalDecoder, KVCache
from .runner import SequenceInput, forward_sequences

logger = logging.getLogger("specserve.engine")

# Token counts profiled: every count up to 8 (where the CPU kernels' tiles step), then coarser.
PROFILE_POINTS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
REPEATS = 3


def profile_points(max_tokens: int) -> list[int]:
    """The counts to profile for steps of at most max_tokens verification rows."""
    points = [n for n in PROFILE_POINTS if n <= max_tokens]
    if max_tokens > points[-1] and max_tokens <= PROFILE_POINTS[-1]:
        points.append(max_tokens)
    return points


def profile_forward_cost(
    model: CausalDecoder,
    kv_cache: KVCache,
    block_size: int,
    num_blocks: int,
    device: torch.device,
    max_tokens: int,
) -> list[tuple[int, float]]:
    """(tokens, seconds) for one forward plus logits of every row, fastest of REPEATS."""
    max_tokens = max(1, min(max_tokens, num_blocks * block_size))
    points = profile_points(max_tokens)
    start = time.perf_counter()
    curve = []
    for n in [points[0], *points]:  # the first run warms up kernels and allocator
        blocks = list(range(-(-n // block_size)))
        seq = SequenceInput([0] * n, 0, blocks, n)
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            hidden = forward_sequences(model, kv_cache, [seq], block_size, device)
            with torch.inference_mode():
                model.compute_logits(hidden).cpu()  # .cpu() also waits for a GPU
            best = min(best, time.perf_counter() - t0)
        curve.append((n, best))
    curve = curve[1:]
    logger.info(
        "profiled the target's step cost for 1..%d tokens in %.1f s: %s",
        max_tokens,
        time.perf_counter() - start,
        ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in curve if n in (1, 4, 8, 16, 32, 64)),
    )
    return curve
