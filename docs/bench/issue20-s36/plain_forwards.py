"""How fast each cell ran the same work: the forward times of a served run's plain decode steps at the
cell's full batch (no drafts, no prompt tokens: one shape), per cell, from a step log cut into the
cells of a `bench serve` or `bench guidellm` report: how far paired cells of equal work ran apart.

    python plain_forwards.py STEPS(.jsonl or .jsonl.xz) REPORT.json [CELL_PREFIX]

results/plain-forwards.txt: the s36 Qwen and mixed-length SmolLM2 serve runs and the 4-stream guidellm run.
"""

from __future__ import annotations

import lzma
import shutil
import sys
import tempfile
from pathlib import Path

from specserve.benchmarks.step_log_report import cut_by_cells, read_steps, serve_cells


def main() -> None:
    log, report = Path(sys.argv[1]), Path(sys.argv[2])
    prefix = sys.argv[3] if len(sys.argv) > 3 else ""
    if log.suffix == ".xz":
        plain_log = Path(tempfile.mkdtemp()) / "steps.jsonl"
        with lzma.open(log, "rb") as src, plain_log.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        log = plain_log
    for name, repeat, steps in cut_by_cells(read_steps(log), serve_cells(report)):
        if not name.startswith(prefix) or not steps:
            continue
        full = max(s.num_sequences for s in steps)
        ms = sorted(
            s.forward_seconds * 1e3
            for s in steps
            if s.draft_tokens == 0 and s.prefill_tokens == 0 and s.num_sequences == full
        )
        if not ms:
            continue

        def q(p: float, ms: list[float] = ms) -> float:
            return ms[int(p * (len(ms) - 1))]

        print(
            f"{name} (r{repeat}): {len(ms)} plain steps of {full}, ms p10 {q(0.1):.1f} p50 {q(0.5):.1f} p90 {q(0.9):.1f}"
        )


if __name__ == "__main__":
    main()
