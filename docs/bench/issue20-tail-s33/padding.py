"""Plain decode forwards at the full level from closed_loop.py's FWDLOG: their longest context (what the
decode attention pads every sequence to) and summed context, per arm and per cell, and a line
ms = a + b x padded keys + c x summed keys (thousands) over all of them.

    python padding.py DIR [LEVEL]   # DIR holds cells.json and fwd.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np

directory = sys.argv[1]
level = int(sys.argv[2]) if len(sys.argv) > 2 else 8
with open(f"{directory}/cells.json") as f:
    cells = json.load(f)["cells"]
with open(f"{directory}/fwd.jsonl") as f:
    forwards = [json.loads(line) for line in f]
rows = []
for forward in forwards:
    cell = next((c for c in cells if c["started"] <= forward["time"] <= c["ended"]), None)
    seqs = forward["seqs"]
    if cell and len(seqs) == level and all(q == 1 for q, _, _ in seqs):
        contexts = [c for _, c, _ in seqs]
        rows.append((cell["mode"], cell["repeat"], 1e3 * forward["seconds"], max(contexts), sum(contexts)))
for mode in dict.fromkeys(r[0] for r in rows):
    mine = [r for r in rows if r[0] == mode]
    print(
        f"{mode}: {len(mine)} forwards, median {statistics.median(r[2] for r in mine):.1f} ms, longest context"
        f" {statistics.median(r[3] for r in mine)}, summed {statistics.median(r[4] for r in mine)}"
    )
print("repeat mode  ms  longest summed (medians)")
for cell in cells:
    mine = [r for r in rows if r[0] == cell["mode"] and r[1] == cell["repeat"]]
    if mine:
        print(
            cell["repeat"],
            cell["mode"][:5],
            f"{statistics.median(r[2] for r in mine):.1f}",
            statistics.median(r[3] for r in mine),
            statistics.median(r[4] for r in mine),
        )
x = np.array([[1, level * r[3] / 1000, r[4] / 1000] for r in rows])
coef, *_ = np.linalg.lstsq(x, np.array([r[2] for r in rows]), rcond=None)
print(f"fit: ms = {coef[0]:.1f} + {coef[1]:.2f} x padded keys (k) + {coef[2]:.2f} x summed keys (k)")
