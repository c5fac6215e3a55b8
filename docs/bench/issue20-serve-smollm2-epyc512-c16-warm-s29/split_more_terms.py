"""The work / speed split with a richer line: constants for prefill steps with and without decodes
riding along, for plain and for drafting decode steps, then per prompt token, decode row, draft row
(a speed per cell, as `bench steps`).

    python docs/bench/issue20-serve-smollm2-epyc512-c16-warm-s29/split_more_terms.py RUN_DIR [SERVE_JSON]
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specserve.benchmarks.stats import geomean, median
from specserve.benchmarks.step_log_report import cut_by_cells, serve_cells
from specserve.benchmarks.step_work_price import fit_line

TERMS = ("prefill only", "prefill + decodes", "plain", "drafting", "prompt token", "decode row", "draft row")


def features(s: SimpleNamespace) -> list[float]:
    prompt, drafts = s.prefill_tokens, s.draft_tokens
    rows = s.num_tokens - prompt - drafts
    return [
        float(bool(prompt) and rows == 0),
        float(bool(prompt) and rows > 0),
        float(not prompt and not drafts),
        float(not prompt and bool(drafts)),
        float(prompt),
        float(rows),
        float(drafts),
    ]


def main() -> None:
    run = Path(sys.argv[1])
    report = Path(sys.argv[2]) if len(sys.argv) > 2 else run / "serve.json"
    steps = [SimpleNamespace(**json.loads(line)) for line in (run / "steps.jsonl").read_text().splitlines()]
    groups = [g for g in cut_by_cells(steps, serve_cells(report)) if g[2]]
    coef, slowness = fit_line([g for _, _, g in groups], features)
    designs = [np.array([features(s) for s in g]) for _, _, g in groups]
    print("ms:", ", ".join(f"{t} {c * 1e3:.2f}" for t, c in zip(TERMS, coef, strict=True)))
    cells = {}
    for (label, repeat, g), x, w in zip(groups, designs, slowness, strict=True):
        tokens = sum(s.emitted_tokens for s in g)
        outside = sum(s.step_seconds - s.forward_seconds for s in g)
        measured = tokens / sum(s.step_seconds for s in g)
        cells[(label.split()[1], repeat)] = (tokens / (float((x @ coef).sum()) + outside), measured, 1 / w)
    work, measured, speed = [], [], []
    for repeat in sorted({r for _, r in cells}):
        if ("adaptive", repeat) in cells and ("off", repeat) in cells:
            a, o = cells[("adaptive", repeat)], cells[("off", repeat)]
            work.append(a[0] / o[0])
            measured.append(a[1] / o[1])
            speed.append(a[2] / o[2])
    for name, values in (("steps-time", measured), ("work", work), ("speed", speed)):
        print(f"adaptive / off {name}: median {median(values):.3f}, geometric {geomean(values):.3f}")


if __name__ == "__main__":
    main()
