"""In-process and served-like: SmolLM2 bf16 built and stepped on one worker thread (as `specserve serve`
does, engine/async_engine.py), 8 sequences at a time out of a stream of 80 requests of 16-48 output
tokens, speculation off. Per round: output tokens/s, the median plain 8-sequence decode forward, and per
such forward the engine thread's page faults and the process's system and user CPU time.

    python stream.py [rounds]                         # glibc's adaptive thresholds (before this session)
    RETAIN=1 python stream.py [rounds]                # fixed thresholds (71b320e, reverted), set
                                                      # before torch is imported (as `serve` did)
    RETAIN=late python stream.py [rounds]             # the same, set after torch is imported
    TRIM=1,2,4,8,512 python stream.py [rounds]        # mmap threshold 32 MiB, trim threshold N MiB
                                                      # per arm, switched every round in one process

One process a setting for the first two (malloc's state is per process): alternate them to compare.
"""

import ctypes
import os
import statistics as st
import sys
import time
from concurrent.futures import ThreadPoolExecutor

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES = 32 << 20, 512 << 20
libc = ctypes.CDLL("libc.so.6")


def retain_freed_heap() -> bool:
    """What 71b320e's engine/heap_retention.py did (reverted in be04d2d): fix glibc's thresholds."""
    return libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and (
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    )


if os.environ.get("RETAIN") == "1":  # before torch and the model allocate anything, as `serve` did
    assert retain_freed_heap()

import specserve.engine.engine_core as engine_core  # noqa: E402  # torch, after the thresholds
from specserve.benchmarks.prompt_sets import load_prompts, parse_categories  # noqa: E402
from specserve.engine import LLM, SamplingParams  # noqa: E402

trims = [int(x) << 20 for x in os.environ["TRIM"].split(",")] if os.environ.get("TRIM") else []
if trims:
    assert libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
elif os.environ.get("RETAIN") == "late":
    assert retain_freed_heap()
setting = {"1": "retained", "late": "retained late"}.get(
    os.environ.get("RETAIN", ""), "adaptive"
)  # glibc's own, unless retained

records: list[tuple[int, float, float]] = []  # per forward: faults, system s, user s
forward = engine_core.EngineCore._forward


def thread_faults() -> int:
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt


def measured_forward(self, batch):
    faults, times = thread_faults(), os.times()
    result = forward(self, batch)
    after = os.times()
    records.append((thread_faults() - faults, after.system - times.system, after.user - times.user))
    return result


engine_core.EngineCore._forward = measured_forward
worker = ThreadPoolExecutor(max_workers=1)


def on_worker(f, *args, **kwargs):
    return worker.submit(f, *args, **kwargs).result()


llm = on_worker(LLM, None, max_batch_size=8)
prompts = [
    llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 40)
] * 2
params = [
    SamplingParams(max_tokens=16 + (7 * i) % 33, temperature=0, ignore_eos=True, speculative_enabled=False)
    for i in range(len(prompts))
]
arms = trims or [None]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
results: dict[int | None, list[tuple[float, ...]]] = {arm: [] for arm in arms}
for r in range(rounds + 1):
    for arm in arms if r % 2 == 0 else arms[::-1]:
        if arm is not None:
            assert libc.mallopt(M_TRIM_THRESHOLD, arm) == 1
        records.clear()
        llm.engine.stats.drain_events()
        start = time.perf_counter()
        outputs = on_worker(llm.generate, prompts, params, use_chat_template=False)
        seconds = time.perf_counter() - start
        steps = llm.engine.stats.drain_events().steps
        plain = [
            (rec, step)
            for rec, step in zip(records, steps, strict=True)
            if step.prefill_tokens == 0 and step.num_sequences == 8
        ]
        row = (
            sum(len(o.token_ids) for o in outputs) / seconds,
            1e3 * st.median(step.forward_seconds for _, step in plain),
            st.mean(rec[0] for rec, _ in plain),
            1e3 * st.mean(rec[1] for rec, _ in plain),
            1e3 * st.mean(rec[2] for rec, _ in plain),
        )
        name = setting if arm is None else f"trim {arm >> 20} MiB"
        print(
            f"round {r} {name}: %.1f tok/s, plain@8 %.1f ms, faults %.1f, system %.2f ms, user %.1f ms" % row
        )
        if r:  # round 0 warms up
            results[arm].append(row)
for arm, rows in results.items():
    name = setting if arm is None else f"trim {arm >> 20} MiB"
    medians = tuple(st.median(row[i] for row in rows) for i in range(5))
    print(
        f"{name}, medians of rounds: %.1f tok/s, plain@8 %.2f ms, faults %.1f, system %.2f ms, user %.1f ms"
        % medians
    )
