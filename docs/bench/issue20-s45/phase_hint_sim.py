"""A lead tried in the simulation only: the acceptance model told, through the controller's proposal
class (`Candidate.hint`), whether the request's last window was accepted in full. The draft model's
agreement comes in runs (translation: regular runs of 4-5), and a window that starts right after a
rejection starts a run where one that follows a full acceptance starts inside one, so their first
drafts' acceptance differs; one estimate per window position mixes the two. margin_sim.py's setting
(the engine as built, timing noise sd(log) SIGMA, twelve seeds), the engine's controller unchanged.

    python phase_hint_sim.py ../issue20-s44/results/agreement_traces.json [SIGMA]
"""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

from specserve.engine.spec_controller import Candidate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "issue20-s44"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import margin_sim  # noqa: E402
import policy_sim  # noqa: E402

K_MAX = policy_sim.K_MAX


def hinted_seconds(ctl, rid: str, agree: list[int], max_tokens: int, prompt_tokens: int, measure) -> float:  # noqa: ANN001
    """policy_sim.adaptive_seconds with the hint: 1 after a window accepted in full, else 0."""
    t, seconds, missing, full = 1, 0.0, prompt_tokens + 1, 0
    while t < max_tokens:
        cap = min(K_MAX, max_tokens - t - 1)
        cand = Candidate(rid, cap, False, full, (), False, missing, max_tokens - t)
        decision = ctl.choose([cand], 1, 1, 8192)
        k = decision.k.get(rid, 0)
        acc = min(k, policy_sim.run_length(agree, t))
        setup = missing if k else 0
        forward = measure(policy_sim.target_seconds(1 + k))
        draft = measure(policy_sim.DRAFT_TOKEN_S * k + policy_sim.CATCH_UP_TOKEN_S * setup) if k else 0.0
        cost = ctl.cost
        cost.observe_target(1, 1 + k, forward, 0)
        if k:
            if rid in decision.probed:
                cost.observe_probe(1, draft, setup)
            else:
                cost.observe_draft(1, k, draft, setup)
        cost.observe_overhead(policy_sim.OVERHEAD_S)
        if rid not in decision.probed:
            ctl.observe_step(1, k > 0, acc + 1, forward + draft + policy_sim.OVERHEAD_S, decision.promise)
        ctl.observe_verification(rid, k, acc, list(range(acc + 1)))
        seconds += policy_sim.step_seconds(k, setup)
        if k:
            full = int(acc == k)
        missing = (2 if acc == k else 1) if k else missing + 1
        t += acc + 1
    ctl.forget(rid)
    return seconds


def mean_vs_oracle(traces: list, sigma: float, seed: int, hinted: bool) -> tuple[float, dict[str, float]]:  # noqa: ANN001
    rng = random.Random(seed)

    def noisy(seconds: float) -> float:
        return seconds * rng.lognormvariate(0.0, sigma)

    if not hinted:
        by_cat, _ = policy_sim.simulate(traces, 48, margin_sim.controller(0.10), noisy)
    else:
        ctl = margin_sim.controller(0.10)
        by_cat, _ = policy_sim.simulate(traces, 48, margin_sim.controller(0.10), noisy)  # the static arms
        for cat in by_cat.values():
            cat["adaptive"] = 0.0
        for i, tr in enumerate(traces):
            by_cat[tr["category"]]["adaptive"] += hinted_seconds(
                ctl, f"r{i}", tr["agree"], 48, tr["prompt_tokens"], noisy
            )
    return policy_sim.mean_vs_oracle(by_cat), {c: policy_sim.vs_oracle(v)[1] for c, v in by_cat.items()}


def main() -> None:
    path = sys.argv[1]
    sigma = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
    for sets in margin_sim.SETS:
        traces = policy_sim.load_traces(path, sets)
        for hinted in (False, True):
            runs = [mean_vs_oracle(traces, sigma, seed, hinted) for seed in margin_sim.SEEDS]
            means = [r[0] for r in runs]
            cats = {c: statistics.mean(r[1][c] for r in runs) for c in runs[0][1]}
            print(
                f"{'hint' if hinted else 'as built':8s} {' '.join(sets):24s} sigma {sigma}: adaptive / best static K"
                f" {statistics.mean(means):.3f} +- {statistics.stdev(means) / len(means) ** 0.5:.3f};"
                f" {' '.join(f'{c} {v:.3f}' for c, v in cats.items())}"
            )


if __name__ == "__main__":
    main()
