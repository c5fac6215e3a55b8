"""`noise_sim.py`'s setting (timing noise SIGMA, twelve seeds) with the "plain priced above drafting"
test given a tolerance: a step with draft rows counts as priced below the plain step only when its
price is below (1 - TOL) x the plain price (StepCostModel._below_plain). A candidate for the lead of
the plain-price refreshes that noise sets off at one sequence; tried in the simulation only.

    python refresh_tolerance_sim.py TRACES.json [SIGMA]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from specserve.engine.step_cost_model import StepCostModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import noise_sim  # noqa: E402

SEEDS = range(12)
TOLERANCES = (0.0, 0.05, 0.1, 0.2)


def with_tolerance(tol: float):  # noqa: ANN201 (a StepCostModel method)
    def below_plain(self: StepCostModel, bucket: int, num_sequences: int, profiled: float) -> bool:
        plain = self._calibration.get((bucket, False, False))
        drafting = self._calibration.get((bucket, False, True))
        if plain is None or drafting is None or not plain.settled or not drafting.settled:
            return False
        return drafting.predict(profiled) < (1.0 - tol) * plain.predict(float(max(1, num_sequences)))

    return below_plain


def main() -> None:
    traces = sys.argv[1]
    sigma = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    built = StepCostModel._below_plain
    for tol in TOLERANCES:
        StepCostModel._below_plain = with_tolerance(tol)  # type: ignore[method-assign]
        for sets in (["bench"], ["heldout-s44", "heldout-s36"]):
            plain = [0, 0]
            runs = [noise_sim.mean_vs_oracle(traces, sets, sigma, seed, plain) for seed in SEEDS]
            print(
                f"tolerance {tol:.2f} {' '.join(sets):24s} sigma {sigma}: adaptive / best static K"
                f" {statistics.mean(runs):.3f} +- {statistics.stdev(runs) / len(runs) ** 0.5:.3f} over"
                f" {len(runs)} seeds; steps without drafts where allowed {plain[1] / plain[0]:.1%}"
            )
    StepCostModel._below_plain = built  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
