"""An upper bound on what a draft LM head over part of the vocabulary could gain in a served run: from
the run's step log, the speculating arm's time, its draft time and its draft forwards by batch size;
each forward is credited with the saving `draft_vocab_head.py` measured for 1 and 4 sequences
(results/draft_vocab_head.txt, a 32,768-token subset; other batch sizes take the nearer figure),
and no window is taken to end on a token the subset lacks.

    python vocab_head_bound.py STEPS.jsonl[.xz] ...
"""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

# ms saved per draft forward by batch size (results/draft_vocab_head.txt: 13.48 -> 11.36, 19.51 -> 16.82)
SAVED_MS = {1: 13.48 - 11.36, 4: 19.51 - 16.82}


def saved_ms(rows: int) -> float:
    return SAVED_MS[min(SAVED_MS, key=lambda r: abs(r - rows))]


def main() -> None:
    for arg in sys.argv[1:]:
        path = Path(arg)
        opener = lzma.open if path.suffix == ".xz" else open
        with opener(path, "rt") as f:
            steps = [json.loads(line) for line in f if line.strip() and '"marker"' not in line]
        spec = [s for s in steps if s["speculating"]]
        arm_s = sum(s["step_seconds"] for s in spec)
        draft_s = sum(s["draft_seconds"] for s in spec)
        # A drafting step with d sequences drafting and t draft tokens runs about t / d draft
        # forwards of d rows (requests drafting fewer tokens drop out earlier: an overestimate).
        saved = sum(
            s["draft_tokens"] / s["drafting"] * saved_ms(s["drafting"]) / 1e3 for s in spec if s["drafting"]
        )
        print(
            f"{path.parent.name}: speculating arm {arm_s:.1f} s, draft {draft_s:.1f} s"
            f" ({draft_s / arm_s:.1%}), LM-head saving at most {saved:.1f} s ({saved / arm_s:.1%} of the arm)"
        )


if __name__ == "__main__":
    main()
