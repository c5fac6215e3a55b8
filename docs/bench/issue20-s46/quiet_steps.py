"""Quiet steps and the time outside forwards in served step logs (`serve --step-log`, optionally
xz-compressed): per batch bucket (8-15, 16-31 sequences) and arm (off: no request speculating;
adaptive: the controller decided), the decode-only steps, how many were quiet (StepRecord.quiet) or
drafted, the forwards' median, and the step time outside the forward and the proposer (median and
mean, ms): the policy's machinery is the adaptive arm's excess over off's.

    python quiet_steps.py STEPS.jsonl[.xz] ...
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from pathlib import Path

BUCKETS = ((8, 15), (16, 31))


def read(path: Path) -> list[dict]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    for name in sys.argv[1:]:
        rows = read(Path(name))
        print(name)
        print(
            f"{'sequences':>9s} {'arm':8s} {'steps':>5s} {'quiet':>5s} {'drafting':>8s} {'forward ms':>10s} {'outside ms (median / mean)':>27s}"
        )
        for lo, hi in BUCKETS:
            for arm in ("off", "adaptive"):
                steps = [
                    r
                    for r in rows
                    if r["prefill_tokens"] == 0
                    and lo <= r["num_sequences"] <= hi
                    and (r["speculating"] == 0 if arm == "off" else r["predicted_seconds"] is not None)
                ]
                if not steps:
                    continue
                outside = [
                    1000 * (r["step_seconds"] - r["forward_seconds"] - r["draft_seconds"]) for r in steps
                ]
                print(
                    f"{lo:>4d}-{hi:<4d} {arm:8s} {len(steps):5d} {sum(bool(r.get('quiet')) for r in steps):5d}"
                    f" {sum(r['drafting'] > 0 for r in steps):8d}"
                    f" {1000 * statistics.median(r['forward_seconds'] for r in steps):10.2f}"
                    f" {statistics.median(outside):13.3f} / {statistics.mean(outside):.3f}"
                )


if __name__ == "__main__":
    main()
