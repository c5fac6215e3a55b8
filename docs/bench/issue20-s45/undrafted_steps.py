"""Decode steps of a step log (speculating, no prompt tokens) and how many of them drafted nothing.

python undrafted_steps.py STEPS.jsonl[.xz] [...]
"""

from __future__ import annotations

import json
import lzma
import sys


def main() -> None:
    for path in sys.argv[1:]:
        opener = lzma.open if path.endswith(".xz") else open
        decode = drafting = 0
        with opener(path, "rt") as f:
            for line in f:
                step = json.loads(line)
                if step.get("prefill_tokens") != 0 or not step.get("speculating"):
                    continue
                decode += 1
                drafting += step["drafting"] > 0
        undrafted = decode - drafting
        print(f"{path}: {decode} decode steps, {undrafted} without drafts ({undrafted / decode:.1%})")


if __name__ == "__main__":
    main()
