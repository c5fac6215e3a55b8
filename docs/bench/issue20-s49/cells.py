"""Per cell of a `bench serve` run with a step log (`--step-log`, plain or .xz): the decode steps that
drafted, the plain decode steps at 4 sequences, the drafting steps' median draft and forward times,
and, where the log has them (from c8a5b08), the controller's reasons: its best drafting plan's
goodput over the bar (`headroom`), the bar's factor (`required_gain`) and the costly drafts' gain
calibration (`gain_factor`), medians over the cell's weighed decode steps.

    python cells.py RUN_DIR [...]    (RUN_DIR holds serve.json and steps.jsonl[.xz])
"""

from __future__ import annotations

import json
import lzma
import statistics
import sys
from pathlib import Path


def read_steps(run: Path) -> list[dict]:
    path = run / "steps.jsonl"
    opener, path = (open, path) if path.exists() else (lzma.open, run / "steps.jsonl.xz")
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


def describe(run: Path) -> None:
    report = json.loads((run / "serve.json").read_text())
    steps = read_steps(run)
    print(f"## {run}")
    print(
        "cell | steps | drafting | plain at 4 | draft ms | forward ms | headroom | required gain | gain factor"
    )
    for cell in sorted(report["cells"], key=lambda c: c["started"]):
        held = [s for s in steps if cell["started"] <= s["time"] <= cell["ended"] + 0.5]
        decode = [s for s in held if s["prefill_tokens"] == 0]
        drafting = [s for s in decode if s["drafting"]]
        plain = [s for s in decode if not s["drafting"] and s["num_sequences"] == 4]
        weighed = [s for s in decode if s.get("headroom") is not None and not s.get("quiet")]

        def median(rows: list[dict], field: str, scale: float = 1.0) -> str:
            return f"{statistics.median(s[field] for s in rows) * scale:.2f}" if rows else "-"

        print(
            f"{cell['mode']} r{cell['repeat']} | {len(held)} | {len(drafting)} | {len(plain)}"
            f" | {median(drafting, 'draft_seconds', 1000)} | {median(drafting, 'forward_seconds', 1000)}"
            f" | {median(weighed, 'headroom')} | {median(weighed, 'required_gain')}"
            f" | {median(weighed, 'gain_factor')}"
        )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        describe(Path(arg))
