"""What a draft model's catch-up costs served: the draft seconds of the logged steps that fed the draft
at least MIN_TOKENS tokens it had not seen (`setup_tokens`: a request's prompt, the first time), per such
token. The step's own draft forwards are included, so this is an upper bound on the catch-up's price.

    python catch_up_cost.py STEPS.jsonl[.xz] [MIN_TOKENS]     # default 100
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from pathlib import Path


def main() -> None:
    path = Path(sys.argv[1])
    least = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        steps = [json.loads(line) for line in f if line.strip()]
    big = [s for s in steps if s["setup_tokens"] >= least]
    per_token = sorted(s["draft_seconds"] / s["setup_tokens"] * 1e3 for s in big)
    if not per_token:
        print(f"{path}: no step fed the draft {least} tokens or more")
        return
    print(
        f"{path}: {len(big)} steps fed the draft {min(s['setup_tokens'] for s in big)}-"
        f"{max(s['setup_tokens'] for s in big)} tokens; draft ms per such token: median "
        f"{statistics.median(per_token):.2f}, range {per_token[0]:.2f}-{per_token[-1]:.2f}"
    )


if __name__ == "__main__":
    main()
