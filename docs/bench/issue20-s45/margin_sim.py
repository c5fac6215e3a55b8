"""The engine's controller over issue20-s44's draft-agreement traces at batch 1 (policy_sim.py's
setting) with this machine's timing noise (noise_sim.py's, SIGMA, twelve seeds), for several values of
StepCostModel's `inconsistent_margin` (engine default INCONSISTENT_MARGIN = 0.10; 0.0 is the
forty-fourth session's engine). Unlike issue20-s44/refresh_tolerance_sim.py, which patched the test,
this runs the engine as built, including the refresh of a plain price above drafting's by less than
the margin once it is STALE_FORWARDS old.

    python margin_sim.py ../issue20-s44/results/agreement_traces.json [SIGMA]
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "issue20-s44"))
import policy_sim  # noqa: E402

SEEDS = range(12)
MARGINS = (0.0, 0.05, 0.10, 0.20)
SETS = (["bench"], ["heldout-s44", "heldout-s36"])


def mean_vs_oracle(
    traces: str, sets: list[str], margin: float, sigma: float, seed: int, plain: list[int]
) -> float:
    """Adaptive / best static K, mean over categories; `plain` counts [steps that could draft, steps
    given none]."""
    rng = random.Random(seed)

    def noisy(seconds: float) -> float:
        return seconds * rng.lognormvariate(0.0, sigma)

    by_cat, _ = policy_sim.simulate(
        policy_sim.load_traces(traces, sets),
        48,
        policy_sim.make_controller(inconsistent_margin=margin),
        noisy,
        plain,
    )
    return policy_sim.mean_vs_oracle(by_cat)


def main() -> None:
    traces = sys.argv[1]
    sigma = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    for margin in MARGINS:
        for sets in SETS:
            quiet_plain, noisy_plain = [0, 0], [0, 0]
            quiet = mean_vs_oracle(traces, sets, margin, 0.0, 0, quiet_plain)
            runs = [mean_vs_oracle(traces, sets, margin, sigma, seed, noisy_plain) for seed in SEEDS]
            print(
                f"margin {margin:.2f} {' '.join(sets):24s} no noise {quiet:.3f}; sigma {sigma}:"
                f" {statistics.mean(runs):.3f} +- {statistics.stdev(runs) / len(runs) ** 0.5:.3f} over"
                f" {len(runs)} seeds, adaptive / best static K (mean over categories); steps without"
                f" drafts where allowed {quiet_plain[1] / quiet_plain[0]:.1%} without noise,"
                f" {noisy_plain[1] / noisy_plain[0]:.1%} with it"
            )


if __name__ == "__main__":
    main()
