"""The decode steps of `bench serve` step logs (`--step-log`, plain or .xz) at a range of batch sizes, in
the cells where speculation was on: how many drafted and how many did not, the drafts verified, how many
of them were accepted (emitted tokens beyond one a sequence) and the drafts a drafting step held.

    python drafting_steps.py MIN_SEQUENCES MAX_SEQUENCES STEPS.jsonl[.xz] [...]
    python drafting_steps.py 3 4 c4-ab/old1/steps.jsonl.xz c4-ab/new1/steps.jsonl.xz
"""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path


def read(path: str) -> list[dict]:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


def main() -> None:
    low, high = int(sys.argv[1]), int(sys.argv[2])
    print(
        "log | drafting steps | steps without drafts | drafts | accepted | accepted / drafts | drafts a step"
    )
    for path in sys.argv[3:]:
        drafting = plain = drafts = accepted = 0
        for s in read(path):
            if not s["speculating"] or s["prefill_tokens"] or not low <= s["num_sequences"] <= high:
                continue
            if s["drafting"]:
                drafting += 1
                drafts += s["draft_tokens"]
                accepted += s["emitted_tokens"] - s["num_sequences"]
            else:
                plain += 1
        name = str(Path(path).parent)
        print(
            f"{name} | {drafting} | {plain} | {drafts} | {accepted} | {accepted / max(drafts, 1):.3f}"
            f" | {drafts / max(drafting, 1):.1f}"
        )


if __name__ == "__main__":
    main()
