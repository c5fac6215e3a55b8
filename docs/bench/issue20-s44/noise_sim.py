"""`policy_sim.py` with the machine's timing noise: every forward's and every draft's measured time is
the modelled one times a log-normal factor (SIGMA; the qa check's one-sequence forwards of one size
spread by sd(log) 0.083-0.117, `results/window_acceptance-qa.txt`), each step's time their sum, as
the engine measures it. Arms are still charged the modelled times, so only the controller's decisions
differ. Six seeds a setting. Settings: the controller as built, and with the plain-price refresh off
(StepCostModel.plain_is_stale and / or plain_is_behind always False), the one-plain-step measurements
that noise can set off when a verification row costs next to nothing.

    python noise_sim.py TRACES.json [SIGMA]
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

from specserve.engine.step_cost_model import StepCostModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import policy_sim  # noqa: E402

SEEDS = range(6)


def mean_vs_oracle(traces: str, sets: list[str], sigma: float, seed: int, plain: list[int]) -> float:
    """Adaptive / best static K, mean over categories, with measured times noisy (log-normal, `sigma`);
    `plain` counts [steps that could draft, steps given none]."""
    rng = random.Random(seed)

    def noisy(seconds: float) -> float:
        return seconds * rng.lognormvariate(0.0, sigma)

    by_cat, _ = policy_sim.simulate(
        policy_sim.load_traces(traces, sets), 48, policy_sim.make_controller(), noisy, plain
    )
    return policy_sim.mean_vs_oracle(by_cat)


def main() -> None:
    traces = sys.argv[1]
    sigma = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    stale = {"plain_is_stale": lambda self, n: False}
    behind = {"plain_is_behind": lambda self, n: False}
    settings = (
        ("as built", {}),
        ("plain-price refresh off", {**stale, **behind}),
        ("stale refresh off", stale),
        ("behind refresh off", behind),
    )
    for name, patches in settings:
        saved = {attr: getattr(StepCostModel, attr) for attr in patches}
        for attr, fn in patches.items():
            setattr(StepCostModel, attr, fn)
        for sets in (["bench"], ["heldout-s44", "heldout-s36"]):
            quiet_plain, noisy_plain = [0, 0], [0, 0]
            quiet = mean_vs_oracle(traces, sets, 0.0, 0, quiet_plain)
            runs = [mean_vs_oracle(traces, sets, sigma, seed, noisy_plain) for seed in SEEDS]
            print(
                f"{name:24s} {' '.join(sets):24s} no noise {quiet:.3f}; sigma {sigma}: mean {statistics.mean(runs):.3f}"
                f" (seeds {' '.join(f'{r:.3f}' for r in runs)}) adaptive / best static K, mean over categories;"
                f" steps without drafts where drafts were allowed: {quiet_plain[1] / quiet_plain[0]:.1%} without"
                f" noise, {noisy_plain[1] / noisy_plain[0]:.1%} with it"
            )
        for attr, fn in saved.items():
            setattr(StepCostModel, attr, fn)


if __name__ == "__main__":
    main()
