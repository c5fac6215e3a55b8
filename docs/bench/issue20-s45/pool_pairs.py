"""Pool the paired cells of several `bench steps` reports (step_log.json) for one mode: median and
geometric mean of measured / work / speed over every pair.

    python pool_pairs.py MODE STEP_LOG.json [...]      (MODE e.g. "c16 adaptive")
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def main() -> None:
    mode, paths = sys.argv[1], sys.argv[2:]
    pairs = [
        p
        for path in paths
        for p in json.loads(Path(path).read_text())["work_price"]["pairs"]
        if p["mode"] == mode
    ]
    parts = []
    for field in ("measured", "work", "speed"):
        values = [p[field] for p in pairs]
        geometric = math.exp(statistics.mean(math.log(v) for v in values))
        parts.append(f"{field} {statistics.median(values):.3f} / {geometric:.3f}")
    print(f"{mode} over {len(pairs)} pairs from {len(paths)} runs (median / geometric): {', '.join(parts)}")


if __name__ == "__main__":
    main()
