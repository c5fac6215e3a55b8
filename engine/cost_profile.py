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
# Start-up time the profile may take beyond the small counts (measured: unbounded, 1..288 tokens took
# minutes for a 0.5B model on 2 slow cores). Past the budget the curve continues along its last
# segment's slope and the online calibration per batch bucket corrects it with real step timings.
ALWAYS_PROFILED = 16
BUDGET_SECONDS = 5.0
SLOW_POINT_SECONDS = 0.2  # a point this slow is timed once: noise is small next to it


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
        if n > ALWAYS_PROFILED and time.perf_counter() - start > BUDGET_SECONDS:
            break
        blocks = list(range(-(-n // block_size)))
        seq = SequenceInput([0] * n, 0, blocks, n)
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            hidden = forward_sequences(model, kv_cache, [seq], block_size, device)
            with torch.inference_mode():
                model.compute_logits(hidden).cpu()  # .cpu() also waits for a GPU
            best = min(best, time.perf_counter() - t0)
            if best > SLOW_POINT_SECONDS:
                break
        curve.append((n, best))
    curve = curve[1:]
    max_tokens = curve[-1][0]
    logger.info(
        "profiled the target's step cost for 1..%d tokens in %.1f s: %s",
        max_tokens,
        time.perf_counter() - start,
        ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in curve if n in (1, 4, 8, 16, 32, 64)),
    )
    return curve
