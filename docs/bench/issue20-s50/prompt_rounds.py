"""Each prompt's rounds in batch-1 policy bench reports (`bench_spec_policy`): adaptive's speed against
speculation off and against the round's best static K, its acceptance and its steps without drafts.

    python prompt_rounds.py PROMPT SPEC_POLICY.json [...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    prompt = sys.argv[1]
    print("report | repeat | adaptive / off | best static K / off | adaptive / best | acceptance | k=0 steps")
    for path in sys.argv[2:]:
        results = [r for r in json.loads(Path(path).read_text())["results"] if r["prompt"] == prompt]
        for repeat in sorted({r["repeat"] for r in results}):
            arms = {r["arm"]: r for r in results if r["repeat"] == repeat}
            off, adaptive = arms["off"]["tok_s"], arms["adaptive"]
            best = max((r["tok_s"], a) for a, r in arms.items() if a.startswith("k"))
            print(
                f"{path} | {repeat} | {adaptive['tok_s'] / off:.2f}x | {best[1]} {best[0] / off:.2f}x"
                f" | {adaptive['tok_s'] / best[0]:.2f}x | {adaptive['acceptance_rate']:.2f}"
                f" | {adaptive['k_histogram'].get('0', 0)} of {sum(adaptive['k_histogram'].values())}"
            )


if __name__ == "__main__":
    main()
