"""Two or more `bench_spec_policy` runs of the same code pooled: each run's prompts count as one more
repeat, and the bench's own summary (medians of paired ratios per category) is taken over them all.

And the best static K chosen apart from the runs it is judged on: a category's best of eight noisy
arms is favoured by its own noise (the largest of eight draws), so for each run the K that the other
runs found best (their pooled summary) is compared with adaptive in this run.

    python pool_policy_runs.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from specserve.benchmarks.bench_spec_policy import summarize
from specserve.benchmarks.stats import compare


def speeds(rows: list[dict[str, Any]], arm: str) -> dict[Any, float]:
    return {(r["prompt"], r["repeat"]): r["tok_s"] for r in rows if r["arm"] == arm}


def main() -> None:
    runs: list[list[dict[str, Any]]] = []
    sweep: list[int] = []
    offset = 0
    for run in sys.argv[1:]:
        report = json.loads((Path(run) / "spec_policy.json").read_text())
        sweep = sweep or report["config"]["k_sweep"]
        runs.append([{**r, "repeat": offset + r["repeat"]} for r in report["results"]])
        offset += 1 + max(r["repeat"] for r in report["results"])
    summary = summarize([r for run in runs for r in run], sweep)
    print(f"{len(sys.argv) - 1} runs pooled: {', '.join(Path(r).name for r in sys.argv[1:])}")
    print("category         oracle  adaptive/oracle  adaptive/K5  adaptive/off")
    for c in summary["per_category"]:
        print(
            f"{c['category']:16s} k{c['oracle_k']:<6d} {c['adaptive_vs_oracle']:15.3f} {c['adaptive_vs_k5']:12.3f}"
            f" {c['vs_off']['adaptive']:12.3f}"
        )
    within = sum(c["adaptive_vs_oracle"] >= 0.97 for c in summary["per_category"])
    print(
        f"mean adaptive/oracle {summary['adaptive_vs_oracle_mean']:.3f} (within 3%: {within} of"
        f" {len(summary['per_category'])}), mean adaptive/K5 {summary['adaptive_vs_k5_mean']:.3f}"
    )
    if len(runs) < 2:
        return
    print("\nthe best static K chosen on the other runs, judged on this one: adaptive / that K")
    held: dict[str, list[float]] = {}
    for i, run in enumerate(runs):
        others = summarize([r for j, o in enumerate(runs) if j != i for r in o], sweep)["per_category"]
        chosen = {c["category"]: c["oracle_k"] for c in others}
        for cat, k in chosen.items():
            rows = [r for r in run if r["category"] == cat]
            ratio = compare(speeds(rows, "adaptive"), speeds(rows, f"k{k}")).median  # as the bench's columns
            held.setdefault(cat, []).append(ratio)
            print(f"  run {i + 1} {cat:16s} k{k}: {ratio:.3f}")
    means = {cat: statistics.mean(v) for cat, v in held.items()}
    print(
        "mean over runs, per category: "
        + ", ".join(f"{cat} {m:.3f}" for cat, m in means.items())
        + f"; over categories {statistics.mean(means.values()):.3f}, within 3%:"
        f" {sum(m >= 0.97 for m in means.values())} of {len(means)}"
    )


if __name__ == "__main__":
    main()
