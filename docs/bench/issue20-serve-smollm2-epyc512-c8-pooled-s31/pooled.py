"""Every 8-client SmolLM2 run of the thirty-first session, adaptive / off per paired repeat, and the runs
with the run placement of KV blocks (06d2b5d) pooled.

    probe8/  the block pool before (9a605af), layout probed (adjacent block pairs 0.00-0.03)
    c8new/   run placement, layout probed (adjacent pairs 1.00 in every cell)
    c8cpu/   run placement, each forward's CPU time probed
    c8flt/   run placement, page faults probed
    c8ret/   run placement and glibc's heap thresholds fixed after torch's import (71b320e, reverted)
    final/   the session's last tree (run placement only), page faults probed
    ../issue20-serve-smollm2-epyc512-c8-r12-s31/  run placement, thresholds fixed before it (71b320e)

    python docs/bench/issue20-serve-smollm2-epyc512-c8-pooled-s31/pooled.py
"""

import json
import math
import statistics as st
from pathlib import Path

HERE = Path(__file__).parent
RUNS = {
    "probe8 (pool before)": HERE / "probe8",
    "c8new": HERE / "c8new",
    "c8cpu": HERE / "c8cpu",
    "c8flt": HERE / "c8flt",
    "c8ret": HERE / "c8ret",
    "c8-r12": HERE.parent / "issue20-serve-smollm2-epyc512-c8-r12-s31",
    "final": HERE / "final",
}


def paired_ratios(run: Path) -> tuple[list[float], float]:
    by_repeat: dict[int, dict[str, float]] = {}
    for cell in json.loads((run / "serve.json").read_text())["cells"]:
        by_repeat.setdefault(cell["repeat"], {})[cell["mode"]] = cell["output_tokens_per_s"]
    pairs = [m["adaptive"] / m["off"] for _, m in sorted(by_repeat.items())]
    return pairs, st.median(m["off"] for m in by_repeat.values())


def geometric(values: list[float]) -> float:
    return math.exp(st.mean(math.log(v) for v in values))


pooled: list[float] = []
print("run | pairs | adaptive / off median | geometric | pairs ahead | off tok/s")
for name, run in RUNS.items():
    pairs, off = paired_ratios(run)
    if "before" not in name:
        pooled += pairs
    ahead = sum(p > 1 for p in pairs)
    print(f"{name} | {len(pairs)} | {st.median(pairs):.3f} | {geometric(pairs):.3f} | {ahead} | {off:.1f}")
logs = [math.log(p) for p in pooled]
print(
    f"with the run placement, pooled: {len(pooled)} pairs, median {st.median(pooled):.3f}, "
    f"geometric {geometric(pooled):.3f} (standard error of the mean log {st.stdev(logs) / math.sqrt(len(logs)):.3f})"
)
