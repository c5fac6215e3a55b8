"""In-process: plain 8-sequence decode forwards (SmolLM2 bf16, 8 prompts, 32 tokens, speculation off) with
the free KV blocks in id order (each request's blocks contiguous) or shuffled (scattered over the pool),
eight rounds of each interleaved; `--huge` asks for transparent huge pages on the KV storage
(MADV_HUGEPAGE; THP is in madvise mode on this VM, but AnonHugePages stayed 0 kB: not granted).

    python docs/bench/issue20-kv-layout-s30/layout.py [--huge]
"""

import math
import mmap
import random
import statistics as st
import sys
from collections import OrderedDict

import torch

import specserve.engine.models.decoder as decoder
from specserve.benchmarks.prompt_sets import load_prompts, parse_categories
from specserve.engine import LLM, SamplingParams


def huge_kv(shape, dtype, device):
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, count * dtype.itemsize))
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


huge = "--huge" in sys.argv
if huge:
    decoder.zeroed_kv_storage = huge_kv
llm = LLM(None, max_batch_size=8)
pool = llm.engine.scheduler.kv.pool
prompts = [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompts(parse_categories("all"), 7)][
    :8
]
sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, speculative_enabled=False)
rng = random.Random(0)
res = {"contiguous": [], "scattered": []}
for r in range(8):
    for layout in ["contiguous", "scattered"] if r % 2 == 0 else ["scattered", "contiguous"]:
        ids = list(pool._free.keys())
        rng.shuffle(ids) if layout == "scattered" else ids.sort()
        pool._free = OrderedDict((i, None) for i in ids)
        llm.engine.stats.drain_events()
        llm.generate(prompts, sp, use_chat_template=False)
        ev = llm.engine.stats.drain_events()
        plain = [s.forward_seconds for s in ev.steps if s.prefill_tokens == 0 and s.num_sequences == 8]
        if r:
            res[layout].append(st.median(plain))
contiguous, scattered = (1e3 * st.median(res[k]) for k in ("contiguous", "scattered"))
ratio = st.median(s / c for s, c in zip(res["scattered"], res["contiguous"], strict=True))
print(
    "huge" if huge else "4k",
    f"contiguous {contiguous:.1f} scattered {scattered:.1f} ms (medians of rounds)",
    f"scattered/contiguous {ratio:.3f}",
)
with open("/proc/self/smaps_rollup") as smaps:
    print("AnonHugePages", smaps.read().split("AnonHugePages:")[1].split("\n")[0].strip())
