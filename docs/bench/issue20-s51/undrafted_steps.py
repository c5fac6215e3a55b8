"""Why batch-1 adaptive runs drafted what they did, from the steps `bench_spec_policy` keeps (s51 on):
the weighed decode steps that drafted nothing, by the best drafting plan's goodput over the bar
(headroom: >= 1 means a plan paid and the step was a plain-price refresh), the costly drafts' gain
calibration, and per category the adaptive arm's mean k against the oracle static K.

    python undrafted_steps.py SPEC_POLICY.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path


def band(headroom: float) -> str:
    if headroom >= 1.0:
        return ">= 1 (a plan paid: refresh)"
    if headroom >= 0.95:
        return "0.95-1 (marginal)"
    return "< 0.95"


def main() -> None:
    report = json.loads(Path(sys.argv[1]).read_text())
    undrafted: Counter[str] = Counter()
    weighed: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # category -> [weighed, undrafted]
    calibration = []
    for r in report["results"]:
        if r["arm"] != "adaptive":
            continue
        for s in r["steps"]:
            if s["headroom"] is None:  # not weighed (prefill, quiet, last token)
                continue
            weighed[r["category"]][0] += 1
            calibration.append(s["gain_factor"])
            if s["draft_tokens"] == 0:
                weighed[r["category"]][1] += 1
                undrafted[band(s["headroom"])] += 1
    total = sum(w for w, _ in weighed.values())
    print(f"weighed decode steps {total}, without drafts {sum(undrafted.values())}: {dict(undrafted)}")
    cal = sorted(calibration)
    print(
        f"gain calibration: median {statistics.median(cal):.3f}, p10 {cal[len(cal) // 10]:.3f},"
        f" min {cal[0]:.3f}"
    )
    print("category | weighed steps | without drafts | adaptive mean k | oracle K | adaptive / oracle")
    for c in report["summary"]["per_category"]:
        w, u = weighed[c["category"]]
        print(
            f"{c['category']} | {w} | {u} | {c['adaptive_mean_k']:.2f} | {c['oracle_k']}"
            f" | {c['adaptive_vs_oracle']:.3f}x"
        )


if __name__ == "__main__":
    main()
