"""A lead tried in the simulation only: the acceptance model told, through the controller's proposal
class (`Candidate.hint`), whether the request's last window was accepted in full. The draft model's
agreement comes in runs (translation: regular runs of 4-5), and a window that starts right after a
rejection starts a run where one that follows a full acceptance starts inside one, so their first
drafts' acceptance differs; one estimate per window position mixes the two. margin_sim.py's setting
(the engine as built, timing noise sd(log) SIGMA, twelve seeds), the engine's controller unchanged;
the hint is policy_sim.adaptive_seconds's `phase_hint`.

    python phase_hint_sim.py ../issue20-s44/results/agreement_traces.json [SIGMA]
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "issue20-s44"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import margin_sim  # noqa: E402
import policy_sim  # noqa: E402


def vs_oracle(traces: list[dict[str, Any]], sigma: float, seed: int, hinted: bool) -> dict[str, float]:
    """Adaptive / best static K per category."""
    rng = random.Random(seed)

    def noisy(seconds: float) -> float:
        return seconds * rng.lognormvariate(0.0, sigma)

    by_cat, _ = policy_sim.simulate(traces, 48, policy_sim.make_controller(), noisy, phase_hint=hinted)
    return {c: policy_sim.vs_oracle(v)[1] for c, v in by_cat.items()}


def main() -> None:
    path = sys.argv[1]
    sigma = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    for sets in margin_sim.SETS:
        traces = policy_sim.load_traces(path, sets)
        for hinted in (False, True):
            runs = [vs_oracle(traces, sigma, seed, hinted) for seed in margin_sim.SEEDS]
            means = [statistics.mean(r.values()) for r in runs]
            cats = {c: statistics.mean(r[c] for r in runs) for c in runs[0]}
            print(
                f"{'hint' if hinted else 'as built':8s} {' '.join(sets):24s} sigma {sigma}: adaptive / best static K"
                f" {statistics.mean(means):.3f} +- {statistics.stdev(means) / len(means) ** 0.5:.3f};"
                f" {' '.join(f'{c} {v:.3f}' for c, v in cats.items())}"
            )


if __name__ == "__main__":
    main()
