"""A `category_ab.py` step log cut by arm and drafts per step: how many drafting steps had k drafts,
how many tokens each emitted, and the conditional acceptance at each draft position (accepted at j
over steps that reached j). Also the arm's predicted against emitted tokens and seconds, and the
median forward time of the decode steps (every arm) by the tokens they held, and its spread.

    python window_acceptance.py STEP_LOG.jsonl
"""

from __future__ import annotations

import collections
import json
import math
import statistics
import sys


def main() -> None:
    arm = None
    hist: dict[tuple[str, int], collections.Counter[int]] = collections.defaultdict(collections.Counter)
    pred: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0])
    forwards: dict[int, list[float]] = collections.defaultdict(list)
    with open(sys.argv[1]) as f:
        for line in f:
            step = json.loads(line)
            if "marker" in step:
                arm = step["marker"].split()[2]
                continue
            if arm is None or step["prefill_tokens"]:
                continue
            forwards[step["num_tokens"]].append(step["forward_seconds"])
            totals = pred[arm]
            totals[0] += 1
            if step["predicted_tokens"] is not None:
                totals[1] += step["predicted_tokens"]
                totals[2] += step["emitted_tokens"]
                totals[3] += step["predicted_seconds"]
                totals[4] += step["step_seconds"]
            if step["drafting"]:
                hist[(arm, step["draft_tokens"])][step["emitted_tokens"] - 1] += 1
    for name, (steps, p_tok, e_tok, p_s, s) in pred.items():
        print(
            f"{name}: {steps:.0f} decode steps; predicted {p_tok:.1f} tokens, emitted {e_tok:.0f};"
            f" predicted {p_s:.2f} s, took {s:.2f} s"
        )
    print(
        "median decode forward by tokens held: "
        + ", ".join(
            f"{n}: {statistics.median(t) * 1e3:.1f} ms ({len(t)})" for n, t in sorted(forwards.items())
        )
    )
    print(
        "their spread, sd(log), sizes with 10 or more: "
        + ", ".join(
            f"{n}: {statistics.stdev([math.log(x) for x in t]):.3f}"
            for n, t in sorted(forwards.items())
            if len(t) >= 10
        )
    )
    print("arm, drafts a step, steps, {accepted: steps}, conditional acceptance by position")
    for (name, k), counts in sorted(hist.items()):
        cond = []
        for j in range(1, k + 1):
            reached = sum(v for a, v in counts.items() if a >= j - 1)
            cond.append(f"{sum(v for a, v in counts.items() if a >= j) / reached:.2f}" if reached else "-")
        print(name, k, sum(counts.values()), dict(sorted(counts.items())), " ".join(cond))


if __name__ == "__main__":
    main()
