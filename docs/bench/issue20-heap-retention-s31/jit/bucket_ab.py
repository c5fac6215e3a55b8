"""Exact against bucketed padded context lengths, in one process (needs `bucket.diff` applied to
engine/attention.py; it was tried and not kept). Engine on a worker thread, 80 requests 8 at a time,
each run's prompts shifted by new filler tokens so that its exact context lengths are new.

    B=64 python bucket_ab.py [rounds]
"""

import os
import statistics as st
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import specserve.engine.attention as attention
import specserve.engine.engine_core as engine_core
from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams

records: list[tuple[int, float]] = []  # per forward: engine-thread faults, system seconds
forward = engine_core.EngineCore._forward


def thread_faults() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def measured(self, batch):
    faults, times = thread_faults(), os.times()
    result = forward(self, batch)
    records.append((thread_faults() - faults, os.times().system - times.system))
    return result


engine_core.EngineCore._forward = measured
worker = ThreadPoolExecutor(max_workers=1)


def on_worker(f, *args, **kwargs):
    return worker.submit(f, *args, **kwargs).result()


llm = on_worker(LLM, None, max_batch_size=8)
base = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 40)] * 2
filler = llm.tokenizer.encode(" note")[-1]
params = [
    SamplingParams(max_tokens=16 + (7 * i) % 33, temperature=0, ignore_eos=True, speculative_enabled=False)
    for i in range(len(base))
]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
bucket = int(os.environ.get("B", "64"))
results: dict[int, list[tuple[float, ...]]] = {1: [], bucket: []}
for r in range(rounds + 1):
    for j, size in enumerate([1, bucket] if r % 2 == 0 else [bucket, 1]):
        attention.CONTEXT_BUCKET = size
        shift = 3 * (2 * r + j) + 1  # new exact context lengths every run
        prompts = [[filler] * shift + p for p in base]
        records.clear()
        llm.engine.stats.drain_events()
        start = time.perf_counter()
        outputs = on_worker(llm.generate, prompts, params, use_chat_template=False)
        seconds = time.perf_counter() - start
        steps = llm.engine.stats.drain_events().steps
        plain = [
            (rec, s)
            for rec, s in zip(records, steps, strict=True)
            if s.prefill_tokens == 0 and s.num_sequences == 8
        ]
        row = (
            sum(len(o.token_ids) for o in outputs) / seconds,
            1e3 * st.median(s.forward_seconds for _, s in plain),
            st.mean(x[0] for x, _ in plain),
            1e3 * st.mean(x[1] for x, _ in plain),
        )
        print(
            f"round {r} bucket {size}: {row[0]:.1f} tok/s, plain@8 {row[1]:.2f} ms, faults {row[2]:.1f}, system {row[3]:.2f} ms"
        )
        if r:  # round 0 warms up
            results[size].append(row)
for size, rows in results.items():
    print(f"bucket {size}: medians", " ".join(f"{st.median(x[i] for x in rows):.2f}" for i in range(4)))
pairs = list(zip(results[1], results[bucket], strict=True))
print(f"plain@8 exact / bucketed, median of rounds: {st.median(a[1] / b[1] for a, b in pairs):.3f}")
print(f"tok/s bucketed / exact: {st.median(b[0] / a[0] for a, b in pairs):.3f}")
