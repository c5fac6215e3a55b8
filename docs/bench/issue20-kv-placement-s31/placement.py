"""In-process, served-like load: 8 sequences at a time out of a stream of requests of varied output
lengths (a finished request's slot goes to the next one, as under 8 clients), SmolLM2 bf16, speculation
off. Two block pools take turns on the same engine and KV storage, each keeping its own state from
round to round as a server's pool would: the free queue before this session (`queue_pool.py`, a copy
of engine/block_pool.py at 9a605af: last freed, first reused) and the run placement after it. Per round
and pool: the median plain 8-sequence decode forward and how many consecutive block pairs of those
forwards' block tables are adjacent ids.

    python docs/bench/issue20-kv-placement-s31/placement.py [rounds] [--prefix-caching]
"""

import importlib.util
import statistics as st
import sys
from itertools import pairwise
from pathlib import Path

import specserve.engine.runner as runner
from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams
from specserve.engine.block_pool import BlockPool

spec = importlib.util.spec_from_file_location("queue_pool", Path(__file__).with_name("queue_pool.py"))
queue_pool = importlib.util.module_from_spec(spec)
sys.modules["queue_pool"] = queue_pool  # dataclasses look their module up
spec.loader.exec_module(queue_pool)


class QueuePool(queue_pool.BlockPool):
    def allocate(self, n, after=None, growth=0):  # the old pool places blocks without hints
        return super().allocate(n)


layout = {"pairs": 0, "adjacent": 0}
forward = runner.ragged_batch


def counting_batch(seqs, block_size, device, pad_slot):
    if len(seqs) == 8 and all(len(s.token_ids) == 1 for s in seqs):
        for s in seqs:
            used = s.block_ids[: -(-(s.start_position + 1) // block_size)]
            layout["pairs"] += len(used) - 1
            layout["adjacent"] += sum(b == a + 1 for a, b in pairwise(used))
    return forward(seqs, block_size, device, pad_slot)


runner.ragged_batch = counting_batch
rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 6
caching = "--prefix-caching" in sys.argv  # each prompt comes three times a round: hits after the first
llm = LLM(None, max_batch_size=8, enable_prefix_caching=caching)
kv = llm.engine.scheduler.kv
pools = {
    "queue": QueuePool(kv.pool.num_blocks, kv.pool.enable_caching),
    "runs": BlockPool(kv.pool.num_blocks, kv.pool.enable_caching),
}
prompts = [
    llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 40)
] * 3
params = [
    SamplingParams(max_tokens=16 + (7 * i) % 33, temperature=0, ignore_eos=True, speculative_enabled=False)
    for i in range(len(prompts))
]
print(f"{len(prompts)} requests a round, {kv.pool.num_blocks} blocks, outputs 16-48 tokens", flush=True)
results = {name: [] for name in pools}
for r in range(rounds + 1):
    for name in list(pools) if r % 2 == 0 else list(pools)[::-1]:
        kv.pool = pools[name]
        layout.update(pairs=0, adjacent=0)
        llm.engine.stats.drain_events()
        llm.generate(prompts, params, use_chat_template=False)
        steps = llm.engine.stats.drain_events().steps
        plain = [s.forward_seconds for s in steps if s.prefill_tokens == 0 and s.num_sequences == 8]
        share = layout["adjacent"] / max(1, layout["pairs"])
        print(
            f"round {r} {name:5s} plain@8 {1e3 * st.median(plain):5.1f} ms over {len(plain)}, adjacent {share:.2f}",
            flush=True,
        )
        if r:  # round 0 warms both up
            results[name].append(st.median(plain))
ratio = st.median(q / n for q, n in zip(results["queue"], results["runs"], strict=True))
print(
    f"queue / runs, median of rounds: {ratio:.3f} ({1e3 * st.median(results['queue']):.1f} / {1e3 * st.median(results['runs']):.1f} ms)"
)
