"""What the controller promised for its batch-1 steps against what they delivered, from the steps
`bench_spec_policy` keeps (predicted tokens and seconds, a662dd4 on): per category and per number of
drafts, the steps' emitted tokens over the tokens predicted (after the gain calibration) and their
measured seconds over the seconds predicted. Above 1 in tokens: the controller expected less than its
drafts gave (it drafts too little); above 1 in seconds: its steps cost more than it priced them.

    python promise_check.py SPEC_POLICY.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

# The engine's own line between a catch-up and a proposal's first forward on what the last step accepted.
from specserve.engine.step_cost_model import SETUP_MIN_TOKENS


def main() -> None:
    report = json.loads(Path(sys.argv[1]).read_text())
    # key -> [steps, tokens emitted, tokens predicted, seconds measured, seconds predicted]
    by_category: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    by_k: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for r in report["results"]:
        if r["arm"] != "adaptive":
            continue
        for s in r["steps"]:
            # Decode steps the controller weighed; a catch-up step's seconds include the draft's prompt.
            if s["headroom"] is None or s["probe"] or s["setup_tokens"] >= SETUP_MIN_TOKENS:
                continue
            for key, table in ((r["category"], by_category), (s["draft_tokens"], by_k)):
                row = table[key]
                row[0] += 1
                row[1] += s["emitted"]
                row[2] += s["predicted_tokens"]
                row[3] += s["seconds"]
                row[4] += s["predicted_seconds"]
    for title, table in (("category", by_category), ("drafts", by_k)):
        print(f"{title} | steps | emitted / predicted tokens | measured / predicted seconds")
        for key in sorted(table, key=str):
            n, emitted, predicted, measured, priced = table[key]
            print(f"{key} | {n} | {emitted / predicted:.3f} | {measured / priced:.3f}")
        print()


if __name__ == "__main__":
    main()
