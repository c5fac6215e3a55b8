"""A draft model's time in the steps where it drafted for 1-4 requests and fed them at most a few
accepted tokens (no prompt catch-up, no prefill in the step), from `--step-log` files: the median
draft seconds a step and per drafted token, by the number of drafting requests.

    python draft_step_costs.py STEPS.jsonl[.xz] ...
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def rows(path: str) -> list[dict]:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


def main() -> None:
    print(
        "| step log | drafting requests | steps | draft ms a step | draft ms per drafted token | target forward ms |"
    )
    print("|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        by_drafting: dict[int, list[dict]] = defaultdict(list)
        for r in rows(path):
            small_feed = r["setup_tokens"] <= 4 * r["drafting"] + 4
            if r["drafting"] > 0 and small_feed and r["prefill_tokens"] == 0 and r["draft_tokens"] > 0:
                by_drafting[r["drafting"]].append(r)
        for drafting, steps in sorted(by_drafting.items()):
            draft_ms = statistics.median(s["draft_seconds"] for s in steps) * 1e3
            per_token = statistics.median(s["draft_seconds"] / s["draft_tokens"] for s in steps) * 1e3
            forward_ms = statistics.median(s["forward_seconds"] for s in steps) * 1e3
            print(
                f"| {Path(path).parent.name} | {drafting} | {len(steps)} | {draft_ms:.1f} | {per_token:.1f}"
                f" | {forward_ms:.1f} |"
            )


if __name__ == "__main__":
    main()
