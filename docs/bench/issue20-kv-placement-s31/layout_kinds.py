"""Which property of a scattered KV layout costs: each request's blocks out of order, or the blocks
spread over the whole pool. SmolLM2 bf16, 8 prompts, 32 tokens, speculation off, the old free queue
(`queue_pool.py`) primed with four orders, interleaved rounds; plain 8-sequence decode forwards.

    contiguous  ids in order (each request's blocks consecutive, all near the pool's start)
    scattered   all ids shuffled
    runs        runs of 32 consecutive ids, the runs shuffled over the pool (consecutive, spread)
    local       the lowest 512 ids shuffled, the rest in order (out of order, not spread)

    python docs/bench/issue20-kv-placement-s31/layout_kinds.py [rounds]
"""

import importlib.util
import random
import statistics as st
import sys
from collections import OrderedDict
from pathlib import Path

from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams

spec = importlib.util.spec_from_file_location("queue_pool", Path(__file__).with_name("queue_pool.py"))
queue_pool = importlib.util.module_from_spec(spec)
sys.modules["queue_pool"] = queue_pool  # dataclasses look their module up
spec.loader.exec_module(queue_pool)

llm = LLM(None, max_batch_size=8)
kv = llm.engine.scheduler.kv
pool = queue_pool.BlockPool(kv.pool.num_blocks, kv.pool.enable_caching)
pool.allocate = lambda n, after=None, growth=0: queue_pool.BlockPool.allocate(pool, n)  # no hints
kv.pool = pool
N = pool.num_blocks
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 7)][
    :8
]
print("blocks", N, "prompt tokens", [len(p) for p in prompts], flush=True)
sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, speculative_enabled=False)
rng = random.Random(0)


def order(layout: str) -> list[int]:
    ids = list(range(N))
    if layout == "scattered":
        rng.shuffle(ids)
    elif layout == "runs":
        runs = [ids[i : i + 32] for i in range(0, N, 32)]
        rng.shuffle(runs)
        ids = [b for run in runs for b in run]
    elif layout == "local":
        head = ids[:512]
        rng.shuffle(head)
        ids = head + ids[512:]
    return ids


layouts = ["contiguous", "scattered", "runs", "local"]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
results: dict[str, list[float]] = {k: [] for k in layouts}
for r in range(rounds + 1):
    for layout in layouts[r % len(layouts) :] + layouts[: r % len(layouts)]:
        pool._free = OrderedDict((i, None) for i in order(layout))
        llm.engine.stats.drain_events()
        llm.generate(prompts, sp, use_chat_template=False)
        steps = llm.engine.stats.drain_events().steps
        plain = [s.forward_seconds for s in steps if s.prefill_tokens == 0 and s.num_sequences == 8]
        if r:
            results[layout].append(st.median(plain))
for layout in layouts:
    ratio = st.median(a / b for a, b in zip(results[layout], results["contiguous"], strict=True))
    print(f"{layout:11s} {1e3 * st.median(results[layout]):6.2f} ms  /contiguous {ratio:.3f}", flush=True)
