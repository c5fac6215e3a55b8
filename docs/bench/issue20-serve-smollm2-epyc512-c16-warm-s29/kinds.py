"""Forward time against `bench steps`' line, per arm and kind of step (measured / priced, no per-cell
speed): which steps the adaptive cells ran slower than the line.

    python docs/bench/issue20-serve-smollm2-epyc512-c16-warm-s29/kinds.py [RUN_DIR SERVE_JSON]
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specserve.benchmarks.step_log_report import cut_by_cells, serve_cells
from specserve.benchmarks.step_work_price import fit_line, step_features

run = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
report = Path(sys.argv[2]) if len(sys.argv) > 2 else run / "measured" / "serve.json"
steps = [SimpleNamespace(**json.loads(line)) for line in (run / "steps.jsonl").read_text().splitlines()]
groups = [g for g in cut_by_cells(steps, serve_cells(report)) if g[2]]
coef, _ = fit_line([g for _, _, g in groups])


def kind(s: SimpleNamespace) -> str:
    if s.prefill_tokens > 0:
        return "prefill+drafts" if s.draft_tokens else "prefill"
    return "drafting" if s.draft_tokens else "plain"


totals: dict[tuple[str, str], list[float]] = {}
for label, _, group in groups:
    for s in group:
        t = totals.setdefault((label.split()[1], kind(s)), [0.0, 0.0, 0])
        t[0] += s.forward_seconds
        t[1] += float(np.array(step_features(s)) @ coef)
        t[2] += 1
for (arm, k), (measured, priced, n) in sorted(totals.items()):
    print(f"{arm:9s} {k:15s} {n:5d} steps, measured / priced {measured / priced:.3f} ({measured:.1f} s)")
