"""How often the draft's argmax is the target's token, by the draft's probability of it, over every
answer position of the confidence traces (`confidence_traces.py`): how well the draft's own
probabilities stand for acceptance.

    python confidence_bins.py TRACES.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EDGES = [0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0001]


def main() -> None:
    traces = json.loads(Path(sys.argv[1]).read_text())["traces"]
    counts = [[0, 0] for _ in EDGES[:-1]]
    for trace in traces:
        for agree, confidence in zip(trace["agree"], trace["confidence"], strict=True):
            for i, (low, high) in enumerate(zip(EDGES, EDGES[1:], strict=False)):
                if low <= confidence < high:
                    counts[i][0] += 1
                    counts[i][1] += agree
    print("draft probability | positions | target agrees")
    print("---|---|---")
    for (low, high), (n, agreed) in zip(zip(EDGES, EDGES[1:], strict=False), counts, strict=True):
        print(f"{low:.2f}-{min(high, 1.0):.2f} | {n} | {agreed / n if n else 0:.2f}")


if __name__ == "__main__":
    main()
