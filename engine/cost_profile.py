"""Start-up profiles: the target's forward cost over the number of tokens it verifies, and a draft
model's step and catch-up costs (`profile_draft_cost`).

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
from .step_cost_model import DraftCostProfile

logger = logging.getLogger("specserve.engine")

# Token counts profiled: every count up to 8 (where the CPU kernels' tiles step), then coarser.
PROFILE_POINTS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Rounds over the small counts. Each round times every count once, alternating direction, so a slow
# spell of the machine lands on all counts of one round instead of on all repeats of one count: timed
# count by count (3 repeats back to back), SmolLM2's profile on this 2-core VM had the 2nd token +21.6
# ms and the 3rd +4.3 ms where steps measured +16.5 / +18.5, and the controller drafted 2 where 1 paid.
REPEATS = 5
# Start-up time the profile may take beyond the small counts (measured: unbounded, 1..288 tokens took
# minutes for a 0.5B model on 2 slow cores). Past the budget the curve continues along its last
# segment's slope and the online calibration per batch bucket corrects it with real step timings.
ALWAYS_PROFILED = 16
BUDGET_SECONDS = 5.0
# A count this slow is timed twice, not REPEATS times: noise is small next to it. Not once: the first
# timing of a count can be a spell of its own: on the AMD EPYC VM the Qwen pair's batch-1 profile put
# 9 tokens at 301 ms against 80 ms for 8 (the policy bench of s47), where profiles taken one after
# another put 9 at 101.5 ms and 10 at 98.6-103.9 (docs/bench/issue20-s48/results/profile_repeat.txt).
# Timed once, the largest count has no larger one to lower it: a window of 8 drafts was priced ~3x
# its forward.
SLOW_POINT_SECONDS = 0.2


def profile_points(max_tokens: int) -> list[int]:
    """The counts to profile for steps of at most max_tokens verification rows."""
    points = [n for n in PROFILE_POINTS if n <= max_tokens]
    if max_tokens > points[-1] and max_tokens <= PROFILE_POINTS[-1]:
        points.append(max_tokens)
    return points


def monotone(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The curve with every point lowered to the cheapest time of any larger count. Each point is a
    fastest-of-N time, so its noise only adds; a larger count measured faster shows that the smaller
    one was timed during a slow spell (more tokens never cost less)."""
    fixed, cheapest = [], float("inf")
    for n, seconds in reversed(curve):
        cheapest = min(cheapest, seconds)
        fixed.append((n, cheapest))
    return fixed[::-1]


def profile_forward_cost(
    model: CausalDecoder,
    kv_cache: KVCache,
    block_size: int,
    num_blocks: int,
    device: torch.device,
    max_tokens: int,
) -> list[tuple[int, float]]:
    """(tokens, seconds) for one forward plus logits of every row, fastest of up to REPEATS."""
    max_tokens = max(1, min(max_tokens, num_blocks * block_size))
    points = profile_points(max_tokens)

    def timed(n: int) -> float:
        blocks = list(range(-(-n // block_size)))
        seq = SequenceInput([0] * n, 0, blocks, n)
        t0 = time.perf_counter()
        hidden = forward_sequences(model, kv_cache, [seq], block_size, device)
        with torch.inference_mode():
            model.compute_logits(hidden).cpu()  # .cpu() also waits for a GPU
        return time.perf_counter() - t0

    start = time.perf_counter()
    timed(points[0])  # warms up kernels and allocator
    best: dict[int, float] = {}
    small = [n for n in points if n <= ALWAYS_PROFILED]
    for round_no in range(REPEATS):
        for n in small if round_no % 2 == 0 else reversed(small):
            if round_no <= 1 or best[n] <= SLOW_POINT_SECONDS:
                best[n] = min(best.get(n, float("inf")), timed(n))
    for n in points[len(small) :]:
        if time.perf_counter() - start > BUDGET_SECONDS:
            break
        best[n] = timed(n)
        for _ in range(REPEATS - 1 if best[n] <= SLOW_POINT_SECONDS else 1):
            best[n] = min(best[n], timed(n))
    curve = monotone(sorted(best.items()))
    logger.info(
        "profiled the target's step cost for 1..%d tokens in %.1f s: %s",
        curve[-1][0],
        time.perf_counter() - start,
        ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in curve if n in (1, 4, 8, 16, 32, 64)),
    )
    return curve


# Requests per draft step profiled (beyond the last, the controller extends its last segment), and the
# tokens of the one catch-up timed: a prompt's catch-up runs the draft's many-row path, whose cost per
# token at 64 tokens is within a quarter of its cost at 256-512 on the CPUs measured (the Qwen pair's
# int4 0.5B draft on the AVX-512 Xeon: 8.2 ms a token at 64, 6.5 at 256).
DRAFT_PROFILE_REQUESTS = (1, 2, 4, 8, 16, 32)
CATCH_UP_PROFILE_TOKENS = 64
DRAFT_REPEATS = 3


def profile_draft_cost(
    model: CausalDecoder,
    kv_cache: KVCache,
    block_size: int,
    num_blocks: int,
    device: torch.device,
    max_requests: int,
) -> DraftCostProfile:
    """A draft model's step for 1..max_requests requests (one token each, one block each) and its
    catch-up per token (one sequence of CATCH_UP_PROFILE_TOKENS tokens), fastest of DRAFT_REPEATS.
    Like the target's profile it writes KV slots no request owns yet. The contexts are empty, so a
    step is priced below what it costs over long prompts; the controller's timings of real steps
    take over from the first one."""

    def timed(seqs: list[SequenceInput]) -> float:
        t0 = time.perf_counter()
        hidden = forward_sequences(model, kv_cache, seqs, block_size, device)
        with torch.inference_mode():
            model.compute_logits(hidden).cpu()  # .cpu() also waits for a GPU
        return time.perf_counter() - t0

    start = time.perf_counter()
    most = max(1, min(max_requests, num_blocks))
    counts = [n for n in DRAFT_PROFILE_REQUESTS if n <= most]
    timed([SequenceInput([0], 0, [0], 1)])  # warms up kernels and allocator
    steps = {
        n: min(timed([SequenceInput([0], 0, [i], 1) for i in range(n)]) for _ in range(DRAFT_REPEATS))
        for n in counts
    }
    tokens = max(1, min(CATCH_UP_PROFILE_TOKENS, num_blocks * block_size))
    blocks = list(range(-(-tokens // block_size)))
    catch_up = min(timed([SequenceInput([0] * tokens, 0, blocks, 1)]) for _ in range(DRAFT_REPEATS))
    profile = DraftCostProfile(tuple(monotone(sorted(steps.items()))), catch_up / tokens)
    logger.info(
        "profiled the draft's step cost in %.1f s: %s requests; catch-up %.2f ms a token",
        time.perf_counter() - start,
        ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in profile.step_seconds),
        profile.catch_up_token_seconds * 1e3,
    )
    return profile
