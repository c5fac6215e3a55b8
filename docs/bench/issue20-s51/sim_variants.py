"""s44's batch-1 simulation (`../issue20-s44/policy_sim.py`, the engine's own controller on recorded
draft-agreement traces) with one part of the controller changed, on the benchmark's prompts and the
held-out ones. Constants are changed with policy_sim.py's NAME=VALUE arguments; this script adds the
variants that are not a constant of the acceptance model.

    cd ../issue20-s44 && python ../issue20-s51/sim_variants.py VARIANT

VARIANT: base (as built), nocal (the gain calibration's factor held at 1), mingain1 (MIN_GAIN 1.0),
norelax (RELAX_DECAY 1.0), probe4 (FIRST_PROBE_INTERVAL 4), budget5 (PROBE_BUDGET 0.05).
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, ".")  # run from ../issue20-s44, where policy_sim.py and its traces are

import policy_sim  # noqa: E402

from specserve.engine import acceptance_model, spec_controller  # noqa: E402

TRACES = "results/agreement_traces.json"


def report(variant: str, sets: list[str]) -> str:
    by_cat, _ = policy_sim.simulate(policy_sim.load_traces(TRACES, sets), 48, policy_sim.make_controller())
    ratios = {name: policy_sim.vs_oracle(cat)[1] for name, cat in by_cat.items()}
    vs_k5 = statistics.mean(cat["k5"] / cat["adaptive"] for cat in by_cat.values())
    within = sum(r >= 0.97 for r in ratios.values())
    cells = " ".join(f"{name}:{r:.3f}" for name, r in ratios.items())
    return (
        f"{variant} [{' '.join(sets)}]: mean adaptive/oracle {statistics.mean(ratios.values()):.3f}"
        f" (within 3%: {within} of {len(ratios)}), mean adaptive/K5 {vs_k5:.3f}; {cells}"
    )


def main() -> None:
    variant = sys.argv[1] if len(sys.argv) > 1 else "base"
    if variant == "nocal":
        acceptance_model.GainCalibration.factor = property(lambda self: 1.0)  # type: ignore[method-assign]
    elif variant == "mingain1":
        spec_controller.MIN_GAIN = 1.0
    elif variant == "norelax":
        spec_controller.RELAX_DECAY = 1.0
    elif variant == "probe4":
        spec_controller.FIRST_PROBE_INTERVAL = 4
    elif variant == "budget5":
        spec_controller.PROBE_BUDGET = 0.05
    elif variant != "base":
        raise SystemExit(f"unknown variant {variant}")
    for sets in (["bench"], ["heldout-s44", "heldout-s36"]):
        print(report(variant, sets))


if __name__ == "__main__":
    main()
