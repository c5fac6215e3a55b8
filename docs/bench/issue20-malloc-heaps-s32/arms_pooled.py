"""The thirty-second session's side-by-side processes (`ab_arms.sh`, 8 clients, six repeats each), by arm:
adaptive / off per paired repeat, pooled, and the median plain 8-sequence forward of each cell with the
cells whose forwards took over 100 engine-thread page faults (a spell) counted.

    python docs/bench/issue20-malloc-heaps-s32/arms_pooled.py
"""

import json
import math
import statistics as st
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "arms"


def paired_ratios(run: Path) -> list[float]:
    by_repeat: dict[int, dict[str, float]] = {}
    for cell in json.loads((run / "serve.json").read_text())["cells"]:
        by_repeat.setdefault(cell["repeat"], {})[cell["mode"]] = cell["output_tokens_per_s"]
    return [m["adaptive"] / m["off"] for _, m in sorted(by_repeat.items())]


def cells(run: Path) -> list[tuple[float, float]]:
    """(median plain@8 forward ms, engine-thread faults a forward) per cell, from faults.py's table."""
    rows = []
    for line in (run / "faults.txt").read_text().splitlines():
        if line.startswith("r") and "|" in line:
            fields = [f.strip() for f in line.split("|")]
            rows.append((float(fields[2]), float(fields[3].split("/")[0])))
    return rows


def geometric(values: list[float]) -> float:
    return math.exp(st.mean(math.log(v) for v in values))


print("arm | processes | pairs | adaptive / off median | geometric | cells in a spell | plain@8 ms median")
for arm in ("default", "retained"):
    runs = sorted(RESULTS.glob(f"{arm}*"))
    pairs = [p for run in runs for p in paired_ratios(run)]
    all_cells = [c for run in runs for c in cells(run)]
    spells = sum(1 for _, faults in all_cells if faults > 100)
    forward = st.median(ms for ms, _ in all_cells)
    print(
        f"{arm} | {len(runs)} | {len(pairs)} | {st.median(pairs):.3f} | {geometric(pairs):.3f} | "
        f"{spells} of {len(all_cells)} | {forward:.1f}"
    )
