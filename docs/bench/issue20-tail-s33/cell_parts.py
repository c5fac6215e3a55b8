"""Each cell of a step log, split: wall, engine busy, outside the forwards, prefill steps (count, forward
seconds, prompt tokens, sequences they carried), decode steps, steps at every batch size below the
level (the cell's drain), and the median plain decode forward at the full level.

    python cell_parts.py STEPS.jsonl CELLS.json [LEVEL]   # CELLS: a bench serve report or closed_loop's
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from specserve.benchmarks.step_log_report import cut_by_cells, read_steps, serve_cells

level = int(sys.argv[3]) if len(sys.argv) > 3 else 8
cells = serve_cells(Path(sys.argv[2]))
sums: dict[str, dict[str, float]] = {}
print(
    "rep mode   wall  busy nonfwd  prefill: n  fwd s prompt tok seqs  decode: n  fwd s  drain: n    s   plain@L ms"
)
for (label, repeat, started, ended), (_, _, steps) in zip(
    cells, cut_by_cells(read_steps(Path(sys.argv[1])), cells), strict=True
):
    mode = label.split()[1]
    prefill = [s for s in steps if s.prefill_tokens > 0]
    decode = [s for s in steps if s.prefill_tokens == 0]
    drain = [s for s in steps if s.num_sequences < level]
    full = [s.forward_seconds for s in decode if s.num_sequences == level and s.num_tokens == level] or [0.0]
    row = {
        "wall": ended - started,
        "busy": sum(s.step_seconds for s in steps),
        "nonfwd": sum(s.step_seconds - s.forward_seconds for s in steps),
        "prefill_s": sum(s.forward_seconds for s in prefill),
        "decode_s": sum(s.forward_seconds for s in decode),
        "drain_s": sum(s.step_seconds for s in drain),
    }
    for key, value in row.items():
        sums.setdefault(mode, {}).setdefault(key, 0.0)
        sums[mode][key] += value
    print(
        f"{repeat:3d} {mode[:5]:5s} {row['wall']:5.2f} {row['busy']:5.2f} {row['nonfwd']:5.2f}"
        f"  {len(prefill):9d} {row['prefill_s']:6.2f} {sum(s.prefill_tokens for s in prefill):10d}"
        f" {sum(s.num_sequences for s in prefill):4d}  {len(decode):9d} {row['decode_s']:6.2f}"
        f"  {len(drain):8d} {row['drain_s']:4.2f}   {1e3 * statistics.median(full):6.1f}"
    )
for mode, row in sums.items():
    print(mode, "sums:", " ".join(f"{k} {v:.2f}" for k, v in row.items()))
