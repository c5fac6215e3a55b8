"""Adaptive runs of the batch-1 policy bench (`bench_spec_policy`) that stopped drafting: at least half
of their decode steps without drafts. For each, its speed against speculation off and against the best
static K of the same prompt and repeat (the same round), its acceptance and its k histogram.

    python stalled_runs.py SPEC_POLICY.json [...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def stalled(path: str) -> tuple[int, list[str]]:
    """(adaptive runs in the report, a line for each that stalled)."""
    results: list[dict[str, Any]] = json.loads(Path(path).read_text())["results"]
    rounds: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for r in results:
        rounds[(r["prompt"], r["repeat"])][r["arm"]] = r["tok_s"]
    lines, runs = [], 0
    for r in results:
        if r["arm"] != "adaptive":
            continue
        runs += 1
        hist = {int(k): n for k, n in r["k_histogram"].items()}
        if hist.get(0, 0) * 2 < sum(hist.values()):
            continue
        speeds = rounds[(r["prompt"], r["repeat"])]
        best = max((v, a) for a, v in speeds.items() if a.startswith("k"))
        lines.append(
            f"{path}: {r['prompt']} repeat {r['repeat']}: {r['tok_s'] / speeds['off']:.2f}x of off,"
            f" {r['tok_s'] / best[0]:.2f}x of the round's best static K ({best[1]}, {best[0] / speeds['off']:.2f}x of off);"
            f" acceptance {r['acceptance_rate']}; k histogram {dict(sorted(hist.items()))}"
        )
    return runs, lines


def main() -> None:
    total, found = 0, 0
    for path in sys.argv[1:]:
        runs, lines = stalled(path)
        total, found = total + runs, found + len(lines)
        print(f"{path}: {runs} adaptive runs, {len(lines)} stalled")
        for line in lines:
            print("  " + line)
    print(f"in all: {found} of {total} adaptive runs stalled")


if __name__ == "__main__":
    main()
