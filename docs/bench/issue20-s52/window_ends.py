"""Where batch-1 adaptive windows ended, from the steps `bench_spec_policy` keeps (window_tokens: the
k a step allowed; draft_tokens: the drafts verified, fewer where the draft ended the window unsure):
per category, the drafting steps, the drafts allowed and drafted per step, the share of windows ended
unsure, and the tokens emitted per drafting step.

    python window_ends.py SPEC_POLICY.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    results = json.loads(Path(sys.argv[1]).read_text())["results"]
    # category -> [drafting steps, drafts allowed, drafts verified, windows ended unsure, tokens emitted]
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for r in results:
        if r["arm"] != "adaptive":
            continue
        for step in r["steps"]:
            if step["draft_tokens"] <= 0 or step["probe"]:
                continue
            row = rows[r["category"]]
            row[0] += 1
            row[1] += step["window_tokens"]
            row[2] += step["draft_tokens"]
            row[3] += step["draft_tokens"] < step["window_tokens"]
            row[4] += step["emitted"]
    print("category | drafting steps | allowed / step | drafted / step | ended unsure | emitted / step")
    print("---|---|---|---|---|---")
    total = [0.0] * 5
    for category, row in rows.items():
        n = row[0]
        total = [a + b for a, b in zip(total, row, strict=True)]
        print(f"{category} | {n} | {row[1] / n:.2f} | {row[2] / n:.2f} | {row[3] / n:.0%} | {row[4] / n:.2f}")
    n = total[0]
    print(
        f"all | {n:.0f} | {total[1] / n:.2f} | {total[2] / n:.2f} | {total[3] / n:.0%} | {total[4] / n:.2f}"
    )


if __name__ == "__main__":
    main()
