"""The target forward of one 16-sequence SmolLM2 decode step, without and with verification windows,
in-process (the windows' tokens are placeholders: only the forward's time is read).

    python docs/bench/issue20-window-cost-s29/window_cost.py [ROUNDS] [VARIANT_TO_PROFILE]
    EXPAND=1 python ...   # with expand_patch.py: windows attended as single-row queries
    MERGE2=1 python ...   # with merge2_patch.py: decodes and 2-row windows as one attention group
"""

import os
import random
import statistics as st
import sys
import time

from decoding_step import decoding_step, with_windows

if os.environ.get("EXPAND"):
    import expand_patch  # noqa: F401 (patches AttentionMetadata.build)
if os.environ.get("MERGE2"):
    import merge2_patch  # noqa: F401 (patches query_groups)

eng, scheduled, rids = decoding_step()
variants = {
    "plain": {},
    "1 window of 2": {rids[0]: 1},
    "1 window of 9": {rids[0]: 8},
    "3 windows 2,3,5": {rids[0]: 1, rids[1]: 2, rids[2]: 4},
    "3 windows of 2": {rids[0]: 1, rids[1]: 1, rids[2]: 1},
    "6 windows 2..9": {rids[i]: k for i, k in enumerate([1, 2, 3, 5, 7, 8])},
    "16 windows of 5": {r: 4 for r in rids},
}
batches = {name: with_windows(eng, scheduled, v) for name, v in variants.items()}
times: dict[str, list[float]] = {name: [] for name in batches}
names = list(batches)
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 25):
    random.shuffle(names)
    for name in names:
        start = time.perf_counter()
        eng._forward(batches[name])
        times[name].append(time.perf_counter() - start)
base = st.median(times["plain"])
for name in batches:
    m = st.median(times[name])
    print(
        f"{name:18s} {1e3 * m:6.1f} ms, +{1e3 * (m - base):5.1f} ms over plain, {sum(variants[name].values())} draft rows"
    )
if len(sys.argv) > 2:
    from torch.profiler import ProfilerActivity, profile

    for name in ("plain", sys.argv[2]):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                eng._forward(batches[name])
        print("=====", name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
