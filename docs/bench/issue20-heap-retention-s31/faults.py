"""Per cell of a served run made with `serve_probe.py`: plain 8-sequence decode forwards (no prompt, no
drafts), their median wall time, and per forward the engine thread's page faults, the process's and the
system CPU time; then adaptive / off of the plain forwards per repeat.

    python docs/bench/issue20-heap-retention-s31/faults.py docs/bench/issue20-heap-retention-s31/served-c8-r12
"""

import bisect
import json
import statistics as st
import sys
from pathlib import Path
from types import SimpleNamespace

from specserve.benchmarks.step_log_report import cut_by_cells, serve_cells


def main(run: Path) -> None:
    steps = [SimpleNamespace(**json.loads(line)) for line in (run / "steps.jsonl").read_text().splitlines()]
    probes = [json.loads(line) for line in (run / "probe.jsonl").read_text().splitlines()]
    times = [p["time"] for p in probes]
    for step in steps:  # the last forward recorded before the step was logged
        step.probe = probes[bisect.bisect_left(times, step.time) - 1]
    medians: dict[int, dict[str, float]] = {}
    print(
        "cell | plain@8 forwards | median ms | engine-thread / process faults | system ms | all steps' faults"
    )
    for label, repeat, group in cut_by_cells(steps, serve_cells(run / "serve.json")):
        arm = label.split()[-1]
        plain = [s for s in group if s.prefill_tokens == 0 and s.draft_tokens == 0 and s.num_sequences == 8]
        medians.setdefault(repeat, {})[arm] = 1e3 * st.median(s.forward_seconds for s in plain)

        def mean(key: str, of: list) -> float:
            return st.mean(s.probe[key] for s in of)

        print(
            f"r{repeat} {arm} | {len(plain)} | {medians[repeat][arm]:.1f} | "
            f"{mean('thread_minflt', plain):.1f} / {mean('minflt', plain):.1f} | "
            f"{1e3 * mean('system', plain):.2f} | {mean('minflt', group):.1f}"
        )
    ratios = [m["adaptive"] / m["off"] for _, m in sorted(medians.items())]
    print(
        "\nplain@8 adaptive / off per repeat:",
        " ".join(f"{r:.3f}" for r in ratios),
        f"(median {st.median(ratios):.3f})",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
