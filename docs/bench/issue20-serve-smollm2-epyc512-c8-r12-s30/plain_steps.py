"""Plain 8-sequence decode forwards (no prompt, no drafts: the same shape) per cell of this run, off
against adaptive, and by whether the next step had a prompt (a request arriving while it ran).

    python docs/bench/issue20-serve-smollm2-epyc512-c8-r12-s30/plain_steps.py
"""

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specserve.benchmarks.step_log_report import cut_by_cells, serve_cells

RUN = Path(__file__).parent


def main() -> None:
    steps = [SimpleNamespace(**json.loads(line)) for line in (RUN / "steps.jsonl").read_text().splitlines()]
    medians: dict[int, dict[str, float]] = {}
    by_next: dict[tuple[int, str, str], list[float]] = {}
    for label, repeat, group in cut_by_cells(steps, serve_cells(RUN / "serve.json")):
        arm = label.split()[-1]
        plain = [s for s in group if s.prefill_tokens == 0 and s.draft_tokens == 0 and s.num_sequences == 8]
        medians.setdefault(repeat, {})[arm] = 1e3 * statistics.median(s.forward_seconds for s in plain)
        for step, after in zip(group[:-1], group[1:], strict=True):
            if step.prefill_tokens == 0 and step.draft_tokens == 0 and step.num_sequences in (7, 8):
                kind = "next step has a prompt" if after.prefill_tokens else "next step has none"
                by_next.setdefault((step.num_sequences, arm, kind), []).append(1e3 * step.forward_seconds)
    print("repeat | off plain@8 median ms | adaptive | adaptive / off")
    for repeat, m in sorted(medians.items()):
        print(f"r{repeat} | {m['off']:.1f} | {m['adaptive']:.1f} | {m['adaptive'] / m['off']:.3f}")
    print("\nsequences, arm, next step | forwards | p25 / p50 / p75 ms")
    for (n, arm, kind), values in sorted(by_next.items()):
        p25, p50, p75 = np.percentile(values, [25, 50, 75])
        print(f"{n}, {arm}, {kind} | {len(values)} | {p25:.1f} / {p50:.1f} / {p75:.1f}")


if __name__ == "__main__":
    main()
