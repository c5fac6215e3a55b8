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

import contextlib
import io
import random
import statistics
import sys
from pathlib import Path

from specserve.engine.spec_controller import Candidate, SpeculationController
from specserve.engine.step_cost_model import StepCostModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import policy_sim  # noqa: E402

SEEDS = range(6)


def noisy_adaptive(sigma: float, rng: random.Random, plain: list[int]):  # noqa: ANN201 (adaptive_seconds' shape)
    """policy_sim.adaptive_seconds with noisy measurements; `plain` counts [steps that could draft, those
    the controller gave no drafts]."""

    def noisy(seconds: float) -> float:
        return seconds * rng.lognormvariate(0.0, sigma)

    def adaptive(
        ctl: SpeculationController, rid: str, agree: list[int], max_tokens: int, prompt_tokens: int
    ) -> tuple[float, float]:
        t, seconds, missing, ks = 1, 0.0, prompt_tokens + 1, []
        while t < max_tokens:
            cap = min(policy_sim.K_MAX, max_tokens - t - 1)
            decision = ctl.choose(
                [Candidate(rid, cap, False, None, (), False, missing, max_tokens - t)], 1, 1, 8192
            )
            k = decision.k.get(rid, 0)
            if cap > 0:
                plain[0] += 1
                plain[1] += k == 0
            accepted = min(k, policy_sim.run_length(agree, t))
            setup = missing if k else 0
            forward = noisy(policy_sim.target_seconds(1 + k))
            draft = noisy(policy_sim.DRAFT_TOKEN_S * k + policy_sim.CATCH_UP_TOKEN_S * setup) if k else 0.0
            cost = ctl.cost
            cost.observe_target(1, 1 + k, forward, 0)
            if k:
                if rid in decision.probed:
                    cost.observe_probe(1, draft, setup)
                else:
                    cost.observe_draft(1, k, draft, setup)
            cost.observe_overhead(policy_sim.OVERHEAD_S)
            if rid not in decision.probed:
                ctl.observe_step(
                    1, k > 0, accepted + 1, forward + draft + policy_sim.OVERHEAD_S, decision.promise
                )
            ctl.observe_verification(rid, k, accepted, list(range(accepted + 1)))
            seconds += policy_sim.step_seconds(k, setup)
            ks.append(k)
            missing = (2 if accepted == k else 1) if k else missing + 1
            t += accepted + 1
        ctl.forget(rid)
        return seconds, statistics.mean(ks)

    return adaptive


def mean_vs_oracle(traces: str, sets: list[str], sigma: float, seed: int, plain: list[int]) -> float:
    policy_sim.adaptive_seconds = noisy_adaptive(sigma, random.Random(seed), plain)
    sys.argv = ["policy_sim.py", traces, "48", *sets]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        policy_sim.main()
    return float(text.getvalue().strip().splitlines()[-1].split()[2])


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
