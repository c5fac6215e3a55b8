"""A served run's step log cut by arm and kind of step: prefill steps (count, prompt tokens, seconds),
plain decode steps, drafting steps with a catch-up (16+ tokens fed to the draft) and without, with the
tokens they emitted and, for the drafting kinds, what the same time would have emitted at the arm's
own plain rate for the same batch size (gained > 0: drafting beat plain steps).

    python step_kinds.py STEPS.jsonl[.xz]
"""

from __future__ import annotations

import collections
import json
import lzma
import sys
from pathlib import Path


def main() -> None:
    path = Path(sys.argv[1])
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as f:
        steps = [json.loads(line) for line in f if line.strip() and '"marker"' not in line]
    totals: dict[tuple[str, str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0])
    for s in steps:
        arm = "adaptive" if s["speculating"] else "off"
        if s["prefill_tokens"]:
            kind, n = "prefill", 0
        elif not s["drafting"]:
            kind, n = "plain", s["num_sequences"]
        else:
            kind, n = ("catch-up" if s["setup_tokens"] >= 16 else "drafting"), s["num_sequences"]
        t = totals[(arm, kind, n)]
        t[0] += 1
        t[1] += s["step_seconds"]
        t[2] += s["emitted_tokens"]
        t[3] += s["prefill_tokens"]
    for (arm, kind, n), (count, seconds, tokens, prompt) in sorted(totals.items()):
        line = f"{arm:8s} {kind:8s} seqs {n:2d}: {count:5d} steps {seconds:7.1f} s {tokens:6d} tokens"
        if kind == "prefill":
            line += f" {prompt:6d} prompt tokens"
        elif kind != "plain":
            plain = totals.get((arm, "plain", n))
            if plain and plain[1] > 0:
                line += f"  gained {tokens / (plain[2] / plain[1]) - seconds:+.1f} s"
        print(line)


if __name__ == "__main__":
    main()
