"""One prompt's adaptive rounds in a batch-1 policy bench report (`bench_spec_policy`, which keeps each
adaptive run's steps since s51), step by step: drafts, probe, emitted, quiet, and the controller's
best plan over its bar (headroom), the bar's factor and the costly drafts' gain calibration.

    python round_steps.py PROMPT SPEC_POLICY.json [REPEAT]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    prompt, path = sys.argv[1], Path(sys.argv[2])
    only = int(sys.argv[3]) if len(sys.argv) > 3 else None
    results = json.loads(path.read_text())["results"]
    for index, r in enumerate(results):
        if r["arm"] != "adaptive" or r["prompt"] != prompt or (only is not None and r["repeat"] != only):
            continue
        print(
            f"## {prompt} repeat {r['repeat']} (result {index}): {r['tok_s']:.2f} tok/s, mean k {r['mean_k']:.2f}"
        )
        print("step | drafts | probe | setup | emitted | quiet | headroom | bar | gain calibration | ms")
        for n, s in enumerate(r["steps"]):
            print(
                f"{n} | {s['draft_tokens']} | {'P' if s['probe'] else ''} | {s['setup_tokens']} | {s['emitted']}"
                f" | {'q' if s['quiet'] else ''} | {fmt(s['headroom'])} | {fmt(s['required_gain'])}"
                f" | {fmt(s['gain_factor'])} | {s['seconds'] * 1e3:.0f}"
            )


if __name__ == "__main__":
    main()
