"""What the controller promised its decode-only drafting steps (predicted tokens over predicted seconds)
against what they delivered, at one batch size, and both against that size's plain decode steps.

    python promise.py STEPS.jsonl SERVE.json SEQUENCES   # a served run's step log and bench report
"""

from __future__ import annotations

import sys
from pathlib import Path

from specserve.benchmarks.step_log_report import cut_by_cells, read_steps, serve_cells

size = int(sys.argv[3])
cells = serve_cells(Path(sys.argv[2]))
drafting, plain = [], []
for (label, _, _, _), (_, _, steps) in zip(
    cells, cut_by_cells(read_steps(Path(sys.argv[1])), cells), strict=True
):
    if "off" in label:
        continue
    decided = [s for s in steps if s.num_sequences == size and s.prefill_tokens == 0 and s.predicted_tokens]
    drafting += [s for s in decided if s.draft_tokens > 0 and s.probes == 0]
    plain += [s for s in decided if s.draft_tokens == 0]
if not drafting or not plain:
    sys.exit(f"no decided drafting or plain steps of {size} sequences")


def rate(steps: list, tokens: str, seconds: str) -> float:
    return sum(getattr(s, tokens) for s in steps) / sum(getattr(s, seconds) for s in steps)


promised, delivered = (
    rate(drafting, "predicted_tokens", "predicted_seconds"),
    rate(drafting, "emitted_tokens", "step_seconds"),
)
plain_rate = rate(plain, "emitted_tokens", "step_seconds")
tokens = sum(s.emitted_tokens for s in drafting) / sum(s.predicted_tokens for s in drafting)
seconds = sum(s.step_seconds for s in drafting) / sum(s.predicted_seconds for s in drafting)
print(f"{size} sequences: {len(drafting)} drafting steps, {len(plain)} plain")
print(
    f"drafting steps: tokens {tokens:.3f} of the promise, seconds {seconds:.3f}; rate {delivered / promised:.3f}"
)
print(
    f"against the plain steps' rate: promised {promised / plain_rate:.3f}x, delivered {delivered / plain_rate:.3f}x"
)
