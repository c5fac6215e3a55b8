"""The machine's speed in recorded served runs of the Qwen pair, from their step logs: the target's
prefill per prompt token (off arm, one sequence, prompts of 100+ tokens), a plain one-sequence decode
forward, and the draft's catch-up per token (steps that fed it 100+ tokens; the step's own drafts
included), each a median.

    python served_speed.py RUN_FOLDER...      # folder names under docs/bench/, each with steps.jsonl.xz
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def main() -> None:
    for name in sys.argv[1:]:
        with lzma.open(BENCH / name / "steps.jsonl.xz", "rt") as f:
            steps = [json.loads(line) for line in f if line.strip()]
        prefill = [
            s["forward_seconds"] / s["prefill_tokens"] * 1e3
            for s in steps
            if s["prefill_tokens"] >= 100 and s["speculating"] == 0 and s["num_sequences"] == 1
        ]
        decode = [
            s["forward_seconds"] * 1e3
            for s in steps
            if s["prefill_tokens"] == 0 and s["drafting"] == 0 and s["num_sequences"] == 1
        ]
        catch_up = [s["draft_seconds"] / s["setup_tokens"] * 1e3 for s in steps if s["setup_tokens"] >= 100]
        p, d, c = (statistics.median(v) if v else float("nan") for v in (prefill, decode, catch_up))
        print(
            f"{name[:60]:60s} target prefill ms/tok {p:.2f}  plain1 fwd {d:.1f} ms  "
            f"catch-up ms/tok {c:.2f}  ratio {c / p:.3f}"
        )


if __name__ == "__main__":
    main()
