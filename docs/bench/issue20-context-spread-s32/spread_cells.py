"""Per cell of a run made with `spread_probe.py`: plain 8-sequence decode forwards, their median ms, and
the median over them of the longest context, the mean context and padding (longest x 8 / total).

    python docs/bench/issue20-context-spread-s32/spread_cells.py RUN_DIR
"""

import bisect
import json
import statistics as st
import sys
from pathlib import Path

from specserve.benchmarks.step_log_report import cut_by_cells, read_steps, serve_cells


def main(run: Path) -> None:
    steps = read_steps(run / "steps.jsonl")
    batches = [json.loads(line) for line in (run / "spread.jsonl").read_text().splitlines()]
    times = [b["time"] for b in batches]
    print("cell | plain@8 | median ms | longest context | mean context | padded / total")
    pads: dict[str, list[float]] = {}
    for label, repeat, group in cut_by_cells(steps, serve_cells(run / "serve.json")):
        arm = label.split()[-1]
        plain = [s for s in group if s.prefill_tokens == 0 and s.draft_tokens == 0 and s.num_sequences == 8]
        contexts = [batches[bisect.bisect_left(times, s.time) - 1]["contexts"] for s in plain]
        padding = st.median(8 * max(c) / sum(c) for c in contexts)
        pads.setdefault(arm, []).append(padding)
        print(
            f"r{repeat} {arm} | {len(plain)} | {1e3 * st.median(s.forward_seconds for s in plain):.1f} | "
            f"{st.median(max(c) for c in contexts)} | {st.median(st.mean(c) for c in contexts):.0f} | {padding:.3f}"
        )
    print("padded / total, median cell:", {arm: round(st.median(v), 3) for arm, v in pads.items()})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
