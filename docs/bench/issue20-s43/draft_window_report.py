"""draft_window_batch1.py's rows: per category, each bound's time against the whole context's on the
same prompt (geometric mean of the ratios), whether every arm emitted the same tokens, and accepted
drafts, drafting steps and seconds per bound.

    python draft_window_report.py results/draft_window_batch1.json
"""

from __future__ import annotations

import collections
import json
import math
import statistics
import sys


def geomean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def main() -> None:
    with open(sys.argv[1]) as f:
        rows = json.load(f)
    by_prompt: dict[str, dict] = collections.defaultdict(dict)
    for r in rows:
        by_prompt[r["prompt"]][r["window"]] = r
    bounds = sorted({r["window"] for r in rows if r["window"] is not None})
    ratios: dict[str, dict[int, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    same = True
    for arms in by_prompt.values():
        whole = arms[None]
        for bound in bounds:
            ratios[whole["category"]][bound].append(whole["seconds"] / arms[bound]["seconds"])
            same &= arms[bound]["tokens"] == whole["tokens"]
    print("same tokens in every arm:", same)
    print("speed against the whole context (geometric mean over the category's prompts):")
    pooled: dict[int, list[float]] = collections.defaultdict(list)
    for category, per_bound in ratios.items():
        print(f"  {category:15s}", {b: round(geomean(v), 3) for b, v in per_bound.items()})
        for b, v in per_bound.items():
            pooled[b] += v
    print(f"  {'all':15s}", {b: round(geomean(v), 3) for b, v in pooled.items()})
    print("accepted drafts, drafting steps, seconds:")
    totals: dict[str, dict] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0.0]))
    for r in rows:
        t = totals[r["category"]][str(r["window"])]
        t[0] += r["accepted"]
        t[1] += r["drafts"]
        t[2] += r["seconds"]
    for category, per_bound in totals.items():
        print(f"  {category:15s}", {b: (a, d, round(s, 1)) for b, (a, d, s) in per_bound.items()})


if __name__ == "__main__":
    main()
