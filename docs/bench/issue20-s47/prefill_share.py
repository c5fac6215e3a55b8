"""The prefill steps of served runs' cells (a `bench serve` report and its step log): per mode, the
steps that prefilled, their seconds, the prompt tokens they took, prefill's share of the cells' step
time, the median step's prompt tokens and the steps of at most SHORT prompt tokens (rows our bf16
kernel takes since this session); adaptive's prefill seconds over off's, pair by pair (median).

    python prefill_share.py RUN_DIR [...]     (each holding serve.json and steps.jsonl.xz)
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from collections import defaultdict
from pathlib import Path

SHORT = 128


def main() -> None:
    for run in map(Path, sys.argv[1:]):
        serve = json.loads((run / "serve.json").read_text())
        with lzma.open(run / "steps.jsonl.xz", "rt") as f:
            steps = [json.loads(line) for line in f]
        totals: dict[tuple[int, str], list[tuple[int, float, int, float]]] = defaultdict(list)
        sizes: dict[tuple[int, str], list[int]] = defaultdict(list)
        by_pair: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
        for cell in serve["cells"]:
            inside = [s for s in steps if cell["started"] <= s["time"] - s["step_seconds"] <= cell["ended"]]
            prefill = [s for s in inside if s["prefill_tokens"] > 0]
            seconds = sum(s["step_seconds"] for s in prefill)
            total = sum(s["step_seconds"] for s in inside)
            tokens = sum(s["prefill_tokens"] for s in prefill)
            totals[(cell["concurrency"], cell["mode"])].append((len(prefill), seconds, tokens, total))
            sizes[(cell["concurrency"], cell["mode"])] += [s["prefill_tokens"] for s in prefill]
            by_pair[(cell["concurrency"], cell["repeat"])][cell["mode"]] = seconds
        print(run.name)
        for (conc, mode), cells in sorted(totals.items()):
            n = sum(c[0] for c in cells)
            s = sum(c[1] for c in cells)
            t = sum(c[2] for c in cells)
            share = s / sum(c[3] for c in cells)
            short = [x for x in sizes[(conc, mode)] if x <= SHORT]
            print(
                f"  c{conc} {mode:8s}: {n:4d} prefill steps, {s:6.1f} s, {t:6d} prompt tokens, {share:.0%} of step"
                f" time; median step {statistics.median(sizes[(conc, mode)]):.0f} tokens; {len(short)} steps of"
                f" <= {SHORT} ({sum(short)} tokens)"
            )
        for conc in sorted({c for c, _ in by_pair}):
            ratios = [p["adaptive"] / p["off"] for (c, _), p in by_pair.items() if c == conc and len(p) == 2]
            if ratios:
                median = statistics.median(ratios)
                print(
                    f"  c{conc}: adaptive's prefill seconds / off's, median over {len(ratios)} pairs: {median:.3f}"
                )


if __name__ == "__main__":
    main()
