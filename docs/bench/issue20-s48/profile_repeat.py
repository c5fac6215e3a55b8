"""The start-up profile of the target's forward cost (engine/cost_profile.py), taken several times on one
engine: how far apart its points come out, and what a count costs against its neighbours. The engine is
built as `bench_spec_policy` builds it (batch 1, K_max 8: counts 1..9), and each extra profile covers
1..MAX_TOKENS. Prints every profile's points (ms) and, per count, the fastest and slowest of them.

    python profile_repeat.py TARGET DRAFT MAX_TOKENS PROFILES
    python profile_repeat.py Qwen/Qwen2.5-Coder-1.5B-Instruct Qwen/Qwen2.5-Coder-0.5B-Instruct 16 4
"""

from __future__ import annotations

import logging
import sys

import torch

from specserve.engine.cost_profile import profile_forward_cost
from specserve.engine.llm import LLM


def main() -> None:
    target, draft, max_tokens_arg, profiles_arg = sys.argv[1:5]
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine logs its own profile
    torch.set_num_threads(2)
    llm = LLM(
        target,
        draft_model_path=draft,
        draft_quantization_encoding="int4",
        speculative_method="ngram,draft_model",
        num_speculative_tokens=8,
        max_length=4096,
        max_kv_cache_tokens=8192,
        max_batch_size=1,
    )
    engine = llm.engine
    cost = engine.controller.cost
    print("engine's profile:", ", ".join(f"{n}: {cost.curve(n) * 1e3:.1f}" for n in range(1, 10)))
    seen: dict[int, list[float]] = {}
    for _ in range(int(profiles_arg)):
        points = profile_forward_cost(
            engine.model,
            engine.kv_cache,
            engine.config.block_size,
            engine.num_blocks,
            engine.device,
            int(max_tokens_arg),
        )
        print("profile:", ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in points))
        for n, s in points:
            seen.setdefault(n, []).append(s)
    print("count  fastest ms  slowest ms")
    for n, times in sorted(seen.items()):
        print(f"{n:5d}  {min(times) * 1e3:10.1f}  {max(times) * 1e3:10.1f}")


if __name__ == "__main__":
    main()
