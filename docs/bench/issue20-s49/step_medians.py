"""Decode steps at 4 sequences per cell of a `bench serve` run with a step log, plain and drafting apart:
how many, the median step / forward / draft / other milliseconds, tokens a step, tokens per second of
all of them (their sum over their time) and the median catch-up tokens.

    python step_medians.py RUN_DIR [...]    (RUN_DIR holds serve.json and steps.jsonl[.xz])
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from cells import read_steps


def describe(run: Path) -> None:
    report = json.loads((run / "serve.json").read_text())
    steps = read_steps(run)
    print(f"## {run}")
    print(
        "cell | kind | steps | step ms | forward ms | draft ms | other ms | tokens a step | tok/s | catch-up"
    )
    for cell in sorted(report["cells"], key=lambda c: c["started"]):
        held = [
            s
            for s in steps
            if cell["started"] <= s["time"] <= cell["ended"] + 0.5
            and s["prefill_tokens"] == 0
            and s["num_sequences"] == 4
        ]
        for kind, rows in (
            ("plain", [s for s in held if not s["drafting"]]),
            ("drafting", [s for s in held if s["drafting"]]),
        ):
            if len(rows) < 5:
                continue

            def ms(field: str, rows: list[dict] = rows) -> float:
                return statistics.median(s[field] for s in rows) * 1000

            other = statistics.median(
                s["step_seconds"] - s["forward_seconds"] - s["draft_seconds"] for s in rows
            )
            tokens = sum(s["emitted_tokens"] for s in rows)
            seconds = sum(s["step_seconds"] for s in rows)
            print(
                f"{cell['mode']} r{cell['repeat']} | {kind} | {len(rows)} | {ms('step_seconds'):.0f}"
                f" | {ms('forward_seconds'):.0f} | {ms('draft_seconds'):.0f} | {other * 1000:.0f}"
                f" | {tokens / len(rows):.2f} | {tokens / seconds:.1f}"
                f" | {statistics.median(s['setup_tokens'] for s in rows):.0f}"
            )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        describe(Path(arg))
