"""Per adaptive cell of a 16-client run: its decode-only drafting steps against the same steps without
their draft rows, both priced by `bench steps`' line (benchmarks/step_work_price.py), and the drafts'
acceptance.

    python docs/bench/issue20-draft-row-price-replay-s29/drafting_steps.py [RUN_DIR ...]
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specserve.benchmarks.step_log_report import cut_by_cells, serve_cells
from specserve.benchmarks.step_work_price import fit_line, step_features

BENCH = Path(__file__).parent.parent
RUNS = ["issue20-serve-smollm2-epyc512-c16-r16-s29", "issue20-serve-smollm2-epyc512-c16-r12-s27"]


def drafting_cells(
    run: Path, arms: tuple[str, ...] = ("adaptive",)
) -> list[tuple[str, int, int, int, float, float]]:
    """Per cell of these arms that drafted in decode-only steps: (label, repeat, drafting steps, drafts,
    accepted a draft, tokens a second against the same steps undrafted)."""
    steps = [SimpleNamespace(**json.loads(line)) for line in (run / "steps.jsonl").read_text().splitlines()]
    groups = [g for g in cut_by_cells(steps, serve_cells(run / "serve.json")) if g[2]]
    coef, _ = fit_line([g for _, _, g in groups])
    out = []
    for label, repeat, group in groups:
        drafting = [s for s in group if s.draft_tokens > 0 and s.prefill_tokens == 0]
        if label.split()[-1] not in arms or not drafting:
            continue
        drafts = sum(s.draft_tokens for s in drafting)
        tokens = sum(s.emitted_tokens for s in drafting)
        plain_tokens = sum(s.num_sequences for s in drafting)  # one a sequence without drafts
        priced = sum(float(np.array(step_features(s)) @ coef) for s in drafting)
        undrafted = [SimpleNamespace(**{**vars(s), "num_tokens": s.num_tokens - s.draft_tokens, "draft_tokens": 0})
                     for s in drafting]  # fmt: skip
        priced_plain = sum(float(np.array(step_features(s)) @ coef) for s in undrafted)
        ratio = (tokens / priced) / (plain_tokens / priced_plain)
        out.append((label, repeat, len(drafting), drafts, (tokens - plain_tokens) / drafts, ratio))
    return out


def report(run: Path) -> None:
    print(run.name)
    for _, repeat, steps, drafts, accepted, ratio in drafting_cells(run):
        print(
            f"  r{repeat}: {steps} steps, {drafts} drafts, {accepted:.2f} accepted a"
            f" draft, tokens a second against the same steps undrafted {ratio:.3f}"
        )


if __name__ == "__main__":
    for name in sys.argv[1:] or RUNS:
        report(BENCH / name if not Path(name).is_dir() else Path(name))
