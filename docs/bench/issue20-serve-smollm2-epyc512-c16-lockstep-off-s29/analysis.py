"""Speculation off in both arms, one output length (lockstep) against lengths mixed over 16-48: the
pairs' ratios split into work and speed by `bench steps`' pricing (benchmarks/step_work_price.py).

    python docs/bench/issue20-serve-smollm2-epyc512-c16-lockstep-off-s29/analysis.py
"""

import json
import re
from pathlib import Path
from types import SimpleNamespace

from specserve.benchmarks.step_log_report import cut_by_cells
from specserve.benchmarks.step_work_price import price_cells

HERE = Path(__file__).parent
steps = [SimpleNamespace(**json.loads(line)) for line in (HERE / "steps.jsonl").read_text().splitlines()]
cells = []
for path in sorted((HERE / "cells").glob("*-r[0-9]*/serve.json")):
    name, repeat = re.match(r"(one|mixed)-r(\d+)", path.parent.name).groups()
    cell = json.loads(path.read_text())["cells"][0]
    cells.append((f"c16 {name}", int(repeat), cell["started"], cell["ended"], cell["output_tokens_per_s"]))
groups = cut_by_cells(steps, [c[:4] for c in cells])
groups.sort(key=lambda g: (g[0] != "c16 one", g[1]))  # "one" is the reference
price = price_cells(groups)
served = {(c[0], c[1]): c[4] for c in cells}
print("line, ms:", {k: round(v, 2) for k, v in price["coefficients_ms"].items()})
for p in price["pairs"]:
    r = p["repeat"]
    print(
        f"r{r:2d} mixed / one: served {served[('c16 mixed', r)] / served[('c16 one', r)]:.3f}"
        f" steps {p['measured']:.3f} work {p['work']:.3f} speed {p['speed']:.3f}"
    )
(s,) = price["summary"]
print(
    f"{s['pairs']} pairs, median / geometric: steps {s['measured_median']:.3f} / {s['measured_geometric']:.3f},"
    f" work {s['work_median']:.3f} / {s['work_geometric']:.3f}, speed {s['speed_median']:.3f} / {s['speed_geometric']:.3f}"
)
for label, repeat, group in groups:
    decode = [s for s in group if s.prefill_tokens == 0]
    print(
        f"{label} r{repeat}: {len(group)} steps, {len(group) - len(decode)} with prompts,"
        f" {sum(1 for s in decode if s.num_sequences == 16)} decode steps at 16 sequences,"
        f" {sum(s.emitted_tokens for s in group)} tokens"
    )
