"""Which served cells' plain price fell behind their drafting steps' (StepCostModel.plain_is_behind),
against what those cells' drafting steps delivered.

    python docs/bench/issue20-plain-behind-s30/behind.py [RUN_DIR ...]

Every decode forward of a run's step log goes through a StepCostModel (the target calibration only,
the SmolLM2 bf16 profile measured in the twenty-ninth session); a cell "asks" when plain_is_behind holds
before one of its decode steps, counted at most once every INCONSISTENT_FORWARDS decode forwards. In a
log written before the rule existed nothing was measured when it asked, so it goes on asking; in one
written with it, the server's refreshing plain steps are in the log. The drafting steps' delivery is
`drafting_steps.py`'s: tokens a second against the same steps without their draft rows, both priced by
`bench steps`' line.
"""

import json
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from specserve.benchmarks.step_log_report import serve_cells
from specserve.engine.step_cost_model import INCONSISTENT_FORWARDS, StepCostModel
from specserve.engine.step_cost_model import batch_bucket as _bucket

BENCH = Path(__file__).parent.parent
sys.path.insert(0, str(BENCH / "issue20-draft-row-price-replay-s29"))
from drafting_steps import drafting_cells  # noqa: E402
from replay import PROFILE_MS  # noqa: E402

RUNS = [
    "issue20-serve-smollm2-epyc512-c16-r16-s29",
    "issue20-serve-smollm2-epyc512-c16-r12-s27",
    "issue20-serve-smollm2-epyc512-c16-r12-mixed-s27",
    "issue20-serve-smollm2-epyc512-c16-aa-adaptive-s29",
]


def asks(run: Path) -> Counter[tuple[str, int]]:
    """(label, repeat) -> times plain_is_behind held before one of the cell's decode steps."""
    steps = [SimpleNamespace(**json.loads(line)) for line in (run / "steps.jsonl").read_text().splitlines()]
    cells = serve_cells(run / "serve.json")
    cost = StepCostModel([(n, ms / 1e3) for n, ms in PROFILE_MS])
    counts: Counter[tuple[str, int]] = Counter()
    next_ask: dict[int, int] = {}  # batch bucket -> the decode forward count before which none is counted
    for s in steps:
        cell = next(((label, r) for label, r, a, b in cells if a <= s.time <= b), None)
        bucket = _bucket(s.num_sequences)
        if cell is not None and not s.prefill_tokens and cost.plain_is_behind(s.num_sequences):
            forwards = cost._forwards.get(bucket, 0)
            if forwards >= next_ask.get(bucket, 0):
                counts[cell] += 1
                next_ask[bucket] = forwards + INCONSISTENT_FORWARDS
        cost.observe_target(s.num_sequences, s.num_tokens, s.forward_seconds, s.prefill_tokens)
    return counts


def main() -> None:
    for name in sys.argv[1:] or RUNS:
        run = Path(name) if Path(name).is_dir() else BENCH / name
        asked = asks(run)
        arms = tuple(sorted({label.split()[-1] for label, _ in asked} | {"adaptive", "on"}))
        print(run.name)
        print("cell | drafting decode steps | accepted a draft | against undrafted | plain behind")
        lost = gained = lost_asked = gained_asked = 0
        for label, repeat, steps, _, accepted, ratio in drafting_cells(run, arms):
            n = asked[(label, repeat)]
            print(f"{label} r{repeat} | {steps} | {accepted:.2f} | {ratio:.3f} | {n}")
            if ratio < 1:
                lost, lost_asked = lost + 1, lost_asked + (n > 0)
            else:
                gained, gained_asked = gained + 1, gained_asked + (n > 0)
        print(
            f"plain behind in {lost_asked} of {lost} cells whose drafting delivered less than undrafted, "
            f"in {gained_asked} of {gained} whose drafting gained\n"
        )


if __name__ == "__main__":
    main()
