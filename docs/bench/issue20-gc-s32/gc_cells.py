"""Per cell of a run made with `gc_probe.py`: plain 8-sequence decode forwards, their median ms, how many
had a collection finish inside them and the collections' ms in them; then every collection of the cell
by generation (count, total ms).

    python docs/bench/issue20-gc-s32/gc_cells.py RUN_DIR
"""

import bisect
import json
import statistics as st
import sys
from pathlib import Path

from specserve.benchmarks.step_log_report import read_steps, serve_cells


def main(run: Path) -> None:
    steps = read_steps(run / "steps.jsonl")
    probes = [json.loads(line) for line in (run / "probe.jsonl").read_text().splitlines()]
    collections = [json.loads(line) for line in (run / "gc.jsonl").read_text().splitlines()]
    ends = [c["time"] for c in collections]
    times = [p["time"] for p in probes]
    for step in steps:  # the last forward recorded before the step was logged
        step.probe = probes[bisect.bisect_left(times, step.time) - 1]
    print("cell | plain@8 | median ms | with a collection | their gc ms | gc: gen0 / gen1 / gen2 (count, ms)")
    for label, repeat, started, ended in serve_cells(run / "serve.json"):
        arm = label.split()[-1]
        group = [s for s in steps if started <= s.time <= ended]
        plain = [s for s in group if s.prefill_tokens == 0 and s.draft_tokens == 0 and s.num_sequences == 8]
        inside = []
        for s in plain:
            end = s.probe["time"]
            lo, hi = bisect.bisect_left(ends, end - s.probe["forward"]), bisect.bisect_right(ends, end)
            inside.append(sum(c["seconds"] for c in collections[lo:hi]))
        cell = collections[bisect.bisect_left(ends, started) : bisect.bisect_right(ends, ended)]
        by_gen = []
        for generation in (0, 1, 2):
            of = [c["seconds"] for c in cell if c["generation"] == generation]
            by_gen.append(f"{len(of)}, {1e3 * sum(of):.1f}")
        print(
            f"r{repeat} {arm} | {len(plain)} | {1e3 * st.median(s.forward_seconds for s in plain):.1f} | "
            f"{sum(1 for x in inside if x > 0)} | {1e3 * sum(inside):.1f} | {' / '.join(by_gen)}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
